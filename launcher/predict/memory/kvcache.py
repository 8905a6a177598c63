"""The KV cache as vLLM 0.32 lays it out: one small frozen spec per kind of layer cache, the
grouping of layers into KV cache groups that share one block pool, and what one request needs.

Pure arithmetic, no I/O. Each rule names the vLLM source it follows (vllm/v1/kv_cache_interface.py
for the specs, vllm/v1/core/kv_cache_utils.py for the grouping, vllm/platforms/interface.py for the
state-page alignment).

A spec knows two things: its page (bytes of one block of ``block`` tokens) and how many blocks one
request of ``max_len`` tokens holds at most. Full attention grows with the request; a sliding
window holds the window plus what is in flight; a chunked-local layer one chunk plus what is in
flight; a state layer (gated delta-net, Mamba) a fixed number of state pages whatever the length.
Hybrid models put each kind in its own groups of equal layer count, all drawing pages of one
size from one pool, so a request's blocks are summed over the groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Demand:
    """What the scheduler lets one request hold (VllmConfig.max_in_flight_tokens et al.).

    in_flight: tokens scheduled but not yet settled, ``max_num_batched_tokens`` x concurrent
    batches (2 with async scheduling, the pipeline depth with PP, 1 on the CPU engine);
    state_pages: pages a state layer keeps per request: 2 when prefix caching puts Mamba-style
    layers in "align" mode (MambaModelConfig.verify_and_update_config), 1 without it, plus one
    per speculative token (MambaSpec.max_memory_usage_bytes).
    """

    max_len: int
    in_flight: int
    state_pages: int = 2


@dataclass(frozen=True)
class FullAttention:
    """A layer that caches every token (FullAttentionSpec): cdiv(max_len, block) blocks."""

    per_token: int  # bytes per token of this layer on one GPU
    kind: ClassVar[str] = "full"

    def page(self, block: int) -> int:
        return block * self.per_token

    def blocks(self, d: Demand, block: int) -> int:
        return cdiv(d.max_len, block)

    def grows_with_context(self) -> bool:
        return True


@dataclass(frozen=True)
class MLA(FullAttention):
    """MLA's latent cache (MLAAttentionSpec): full attention with one shared KV head."""

    kind: ClassVar[str] = "mla"


@dataclass(frozen=True)
class SparseMLA(FullAttention):
    """DeepSeek-V3.2's latent + indexer key cache: full attention for the allocator."""

    kind: ClassVar[str] = "mla_sparse"


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    """A sliding-window layer (SlidingWindowSpec.max_admission_blocks_per_request): it keeps the
    last window - 1 computed tokens plus the in-flight ones, never more than max_len, plus one
    block because the window need not start on a block boundary."""

    window: int = 0
    kind: ClassVar[str] = "sliding"

    def blocks(self, d: Demand, block: int) -> int:
        return cdiv(min(self.window - 1 + d.in_flight, d.max_len), block) + 1

    def grows_with_context(self) -> bool:
        return False


@dataclass(frozen=True)
class ChunkedLocal(FullAttention):
    """Llama 4's chunked local attention (ChunkedLocalAttentionSpec): one chunk plus the
    in-flight tokens, never more than max_len."""

    chunk: int = 0
    kind: ClassVar[str] = "chunked"

    def blocks(self, d: Demand, block: int) -> int:
        return cdiv(min(self.chunk + d.in_flight, d.max_len), block)

    def grows_with_context(self) -> bool:
        return False


@dataclass(frozen=True)
class State:
    """A recurrent state per request (MambaSpec: gated delta-net conv + SSM state). Its page is
    the state's bytes, padded to the attention page so both share one pool
    (Platform._align_hybrid_block_size)."""

    state_bytes: int
    kind: ClassVar[str] = "state"

    def page(self, block: int) -> int:  # noqa: ARG002 - padded by the pool, not by the block
        return self.state_bytes

    def blocks(self, d: Demand, block: int) -> int:  # noqa: ARG002
        return d.state_pages

    def grows_with_context(self) -> bool:
        return False


LayerCache = FullAttention | State


@dataclass(frozen=True)
class Group:
    """One KV cache group: layers (by index) of one spec sharing one block table."""

    spec: LayerCache
    members: tuple[int, ...]
    block: int  # tokens per block of this group (scaled up when its page was smaller)


@dataclass(frozen=True)
class Pool:
    """The groups of the whole model and the page every layer's block takes after
    unification (all pages equal; a state page padded up to it)."""

    groups: tuple[Group, ...]
    page: int
    block: int  # the attention block size after state alignment

    def bytes_per_block(self, layers: range | None = None) -> int:
        """Bytes one block takes on a worker holding `layers` (all when None): the widest
        group's layers on that worker (kv_cache_utils._get_kv_cache_bytes_per_block over the
        groups projected onto the worker, _project_kv_cache_groups_to_worker)."""
        def held(g: Group) -> int:
            return len(g.members) if layers is None else sum(1 for i in g.members if i in layers)
        return max((held(g) for g in self.groups), default=0) * self.page

    def blocks_per_request(self, d: Demand) -> int:
        """Blocks one max_len request draws from the shared pool, summed over the groups
        (get_max_concurrency_for_kv_cache_config)."""
        return sum(g.spec.blocks(d, g.block) for g in self.groups)

    def needed_bytes(self, d: Demand, layers: range | None = None) -> int:
        """What vLLM's start-up check asks of one worker: each of its layers' maximum usage
        (check_enough_kv_cache_memory: max_memory_usage_bytes over the layer specs)."""
        return sum(g.spec.blocks(d, g.block) * self.page
                   * (len(g.members) if layers is None
                      else sum(1 for i in g.members if i in layers))
                   for g in self.groups)

    def kinds(self) -> dict[str, int]:
        """Layers per kind, for the plan's text and JSON."""
        out: Counter[str] = Counter()
        for g in self.groups:
            out[g.spec.kind] += len(g.members)
        return dict(out)


def align_state_block(block: int, state_bytes: int, attn_per_token: int,
                      kernel_block: int) -> int:
    """The attention block size that makes an attention page hold a whole state page
    (Platform._align_hybrid_block_size): a multiple of the kernel alignment
    max(smallest kernel block, block), large enough that block x per-token >= state."""
    align = max(kernel_block, block)
    need = align * cdiv(state_bytes, align * attn_per_token)
    return max(block, need)


def build_pool(layers: list[LayerCache], block: int, kernel_block: int = 16) -> Pool:
    """Group the layers of the whole model as vLLM 0.32 does (get_kv_cache_groups).

    1. One spec for every layer: one group of all layers.
    2. Hybrid: a state layer makes the attention block cover the state page, and the state page
       is padded to the attention page; a smaller attention page scales its block up to the
       largest page (unify_kv_cache_spec_page_size). Layers of one spec form a bucket; the group
       size is the smallest bucket, or the largest when it is under 1.5x the smallest; a bucket
       of n layers splits into cdiv(n, size) groups, layer i going to group i mod that count
       (_get_kv_cache_groups_uniform_page_size).
    """
    if not layers:
        return Pool((), 0, block)
    buckets: dict[LayerCache, list[int]] = {}
    for i, s in enumerate(layers):
        buckets.setdefault(s, []).append(i)
    if len(buckets) == 1:
        return Pool((Group(layers[0], tuple(range(len(layers))), block),),
                    layers[0].page(block), block)
    states = [s for s in buckets if isinstance(s, State)]
    attn = [s for s in buckets if not isinstance(s, State)]
    if states and attn:
        block = align_state_block(block, max(s.state_bytes for s in states),
                                  max(s.per_token for s in attn), kernel_block)
    page = max(s.page(block) for s in attn) if attn else max(s.state_bytes for s in states)
    sizes = [len(v) for v in buckets.values()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups: list[Group] = []
    for spec, idx in buckets.items():
        g_block = block
        if not isinstance(spec, State) and spec.page(block) < page \
                and page % spec.page(block) == 0:
            g_block = block * (page // spec.page(block))
        n = cdiv(len(idx), size)
        groups += [Group(spec, tuple(idx[k::n]), g_block) for k in range(n)]
    return Pool(tuple(groups), page, block)


@dataclass(frozen=True)
class Capacity:
    """What vLLM logs after sizing the pool: "KV cache size: N tokens, Maximum concurrency for
    L tokens per request: X" (kv_cache_utils.get_kv_cache_capacity)."""

    blocks: int
    blocks_per_request: int
    concurrency: float
    tokens: int


def capacity(pool: Pool, blocks: int, d: Demand) -> Capacity:
    """Concurrency = pool blocks / blocks one max_len request needs; tokens = concurrency x len."""
    per_request = pool.blocks_per_request(d)
    conc = blocks / per_request if per_request else 0.0
    return Capacity(blocks, per_request, conc, int(conc * d.max_len))


def fits(pool: Pool, available: int, d: Demand, layers: range | None = None) -> bool:
    """vLLM's start-up check on one worker: the memory left after the null block holds one
    max_len request (check_enough_kv_cache_memory, get_kv_cache_configs)."""
    return available - pool.bytes_per_block(layers) >= pool.needed_bytes(d, layers)


def longest_fitting(pool: Pool, available: int, d: Demand, limit: int,
                    layers: range | None = None) -> int:
    """The longest max_len <= limit that passes the start-up check (estimate_max_model_len's
    binary search); 0 when not even one token fits."""
    def ok(n: int) -> bool:
        return fits(pool, available, Demand(n, d.in_flight, d.state_pages), layers)

    if not ok(1):
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def context_bytes_per_token(layers: list[LayerCache]) -> int:
    """Bytes per token of the layers whose cache grows with the context: what a decode step
    reads per token of context (sliding and state layers read a bounded amount)."""
    return sum(s.per_token for s in layers if s.grows_with_context())

