"""One candidate's memory: the budget model at exactly the flags the candidate would emit.

A candidate is a parallel layout with its KV dtype, context, batch limits and chunked-prefill
setting; `evaluate` runs vLLM's start-up accounting for it on the limiting rank (weights,
activations, CUDA graphs, non-torch memory, the KV pool) and says whether and how well it fits.
`layouts` lists the layouts a model's heads and the hardware allow. The search
(`predict/search/search.py`) combines these with the performance model; the planner composes both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import InputError
from ...inputs.hardware import GiB, Hardware, MiB
from ...inputs.model import ModelSpec
from ..features.capabilities import (
    VersionTraits,
    attention_support,
    batch_defaults,
    block_size,
    cpu_resets_ssm_dtype,
    gate_reason,
    head_size_support,
)
from ..search.pins import Pins
from . import budget as B
from . import kvcache as K

CUDA_CONTEXT_BYTES = 600 * MiB
"""Memory the vLLM process itself takes (CUDA context, NCCL init) before it checks that free
memory covers its request (gpu_worker's start-up check measures after initialisation)."""

MIN_CONTEXT = 4096
"""The shortest context vlaunch calls serviceable when the user pins none (chat + tools)."""

CPU_MEMORY_FRACTION = 0.5
"""Share of free RAM the CPU engine may use for weights and KV (vLLM's former CPU default)."""


@dataclass
class Candidate:
    """One layout evaluated by the budget model, per GPU on the limiting rank."""

    layout: B.Layout
    kv_dtype: str
    block_size: int
    utilization: float
    requested: int
    weights: int
    activation: int
    cudagraph: int
    non_torch: int
    kv_memory: int
    kv_bytes_per_token: int
    blocks: int
    tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    fits: bool
    problem: str = ""
    stages: list[dict[str, int]] = field(default_factory=list)  # per PP stage, limiting rank
    cache: dict[str, Any] = field(default_factory=dict)  # kvcache.Pool facts for the plan
    pool_layers: tuple = field(default=(), repr=False)  # kvcache specs, one per layer
    demand: K.Demand = field(default=K.Demand(0, 0), repr=False)

    @property
    def concurrency(self) -> float:
        """Full-length requests the whole deployment holds (DP engines have their own caches):
        vLLM's "Maximum concurrency" per engine (pool blocks / blocks per request) x DP."""
        if not self.max_model_len:
            return 0.0
        per_engine = self.cache.get("engine_concurrency")
        if per_engine is None:
            per_engine = self.tokens / self.max_model_len
        return self.layout.dp * per_engine

    def label(self) -> str:
        L = self.layout
        parts = [f"TP{L.tp}"]
        if L.pp > 1:
            parts.append(f"PP{L.pp}")
        if L.dp > 1:
            parts.append(f"DP{L.dp}")
        text = "x".join(parts)
        return text + ("+EP" if L.expert_parallel else "")

    def summary(self) -> str:
        if not self.fits:
            return f"{self.label()}: {self.problem}"
        return (f"{self.label()}: {self.tokens:,} KV tokens per engine, "
                f"{self.concurrency:.1f} concurrent at {self.max_model_len:,} tokens")




def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n): pairs (d, n // d) up to sqrt(n)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def tp_allowed(spec: ModelSpec, tp: int) -> str | None:
    """None when vLLM can shard this model over `tp` ranks, else why not."""
    if spec.num_heads % tp:
        return f"TP {tp} does not divide the {spec.num_heads} attention heads"
    kv = spec.num_kv_heads
    if spec.attention == "gqa" and kv % tp and tp % kv:
        return f"TP {tp} and the {kv} KV heads do not divide one another"
    return None



def layouts(spec: ModelSpec, hw: Hardware, pins: Pins,
            traits: VersionTraits | None = None) -> list[B.Layout]:
    """Layouts over all GPUs. TP groups never straddle a node unless TP spans whole nodes
    (TP16 on 2x8: valid in vLLM, ranked against TP8 x PP2 by the model's cross-node
    all-reduce cost); PP stages inside a node or across nodes (vLLM places ranks TP-major,
    so a stage is a TP group); DP (+EP for MoE) as engines; an EP group never larger than the
    routed experts (vLLM cannot give a rank no expert)."""
    if hw.is_cpu:
        if (pins.tp or 1) > 1 or (pins.pp or 1) > 1 or (pins.dp or 1) > 1:
            raise InputError("the CPU engine is planned as one process: drop --tp/--pp/--dp "
                             "(or the parallel sizes after --)")
        return [B.Layout()]
    has_ep = traits is None or traits.has("expert_parallel")
    has_dp = traits is None or traits.has("data_parallel")
    if pins.expert_parallel and not spec.is_moe:
        raise InputError(f"--expert-parallel: {spec.name} is a dense model with no experts to "
                         "spread; drop the flag")
    if pins.expert_parallel and not has_ep:
        raise InputError(f"{gate_reason('expert_parallel', traits.version)}: drop "
                         "--expert-parallel or plan for a newer --vllm-version")
    if (pins.dp or 1) > 1 and not has_dp:
        raise InputError(f"{gate_reason('data_parallel', traits.version)}: drop --dp or plan "
                         "for a newer --vllm-version")
    total, per_node = hw.count, hw.gpus_per_node
    tps = _divisors(per_node) + [per_node * k for k in _divisors(hw.nodes) if k > 1]
    out = []
    for tp in tps:
        if pins.tp and tp != pins.tp or tp_allowed(spec, tp):
            continue
        for dp in _divisors(total // tp):
            pp = total // (tp * dp)
            if pins.pp and pp != pins.pp or pins.dp and dp != pins.dp:
                continue
            if dp > 1 and not has_dp:
                continue
            if pp > 1 and (dp > 1 or pp > spec.num_layers):
                continue
            if tp > per_node and dp > 1:
                continue
            ep = spec.is_moe and tp * dp > 1 and has_ep
            if pins.expert_parallel is not None:
                ep = pins.expert_parallel and spec.is_moe
            if ep and tp * dp > spec.num_experts:
                continue
            out.append(B.Layout(tp=tp, pp=pp, dp=dp, expert_parallel=ep, nodes=hw.nodes))
    if pins.tp and not out:
        why = tp_allowed(spec, pins.tp) or (f"TP {pins.tp} does not fit {per_node} GPUs per node "
                                            "with the pinned PP/DP")
        raise InputError(f"--tp {pins.tp} is not possible for {spec.name}: {why}")
    return out




def cache_options(spec: ModelSpec, hw: Hardware, traits: VersionTraits) -> dict[str, Any]:
    """How this vLLM on this platform builds the layer caches (budget.layer_caches)."""
    ssm = None
    lay_dtype = str((spec.config.get("text_config") or spec.config).get("mamba_ssm_dtype") or "")
    if hw.is_cpu and cpu_resets_ssm_dtype() and lay_dtype not in ("float32",):
        ssm = 4  # platforms/cpu.py: AVX512-BF16 CPUs keep GDN's SSM state in float32
    return {"hybrid": traits.has("hybrid_kv_cache"), "mla_align": traits.mla_cache_align,
            "ssm_bytes": ssm, "plain_fp8_sparse": is_blackwell(hw)
            and traits.has("sparse_mla_plain_fp8")}


def is_blackwell(hw: Hardware) -> bool:
    """Data-center Blackwell (compute capability 10.x: B200, B300, GB200)."""
    cc = hw.kind.cc
    return hw.kind.platform == "cuda" and cc is not None and 10.0 <= cc < 11.0


def capture_cap(spec: ModelSpec, hw: Hardware, traits: VersionTraits) -> int:
    """vLLM's largest CUDA-graph capture size: 512, or 1024 on data-center Blackwell
    (config/vllm.py _set_cudagraph_sizes) and for gpt-oss (GptOssForCausalLMConfig)."""
    if spec.architecture == "gpt_oss" or (is_blackwell(hw)
                                           and traits.has("blackwell_capture_1024")):
        return 1024
    return 512


def concurrent_batches(hw: Hardware, layout: B.Layout, traits: VersionTraits) -> int:
    """Batches scheduled but not yet settled (VllmConfig.max_concurrent_batches): two with
    async scheduling, which vLLM turns on by default for one pipeline stage with the mp
    executor vlaunch uses (config/vllm.py); the pipeline depth otherwise. The CPU platform
    turns async scheduling off (platforms/cpu.py check_and_update_config): one batch."""
    if hw.is_cpu:
        return 1
    if layout.pp == 1 and traits.has("async_scheduling"):
        return 2
    return layout.pp


def state_pages(traits: VersionTraits) -> int:
    """State pages a request holds: prefix caching (on by default) puts Mamba-style layers in
    "align" mode, two pages (MambaModelConfig, MambaSpec.max_memory_usage_bytes)."""
    return 2 if traits.has("mamba_prefix_caching") else 1


def usable_bytes(hw: Hardware) -> int:
    """What one GPU can give vLLM at most: its free memory less the process's own CUDA context.
    A pinned --kv-cache-memory-bytes skips vLLM's profiling, so nothing else stops a KV cache
    larger than the card until the allocation fails."""
    return max(0, hw.free_bytes - CUDA_CONTEXT_BYTES)


def _longest(pool: K.Pool, available: int, demand: K.Demand, limit: int,
             layers: range | None) -> int:
    """kvcache.longest_fitting, answered at once when the whole `limit` fits (the usual case:
    the search asks for it many times)."""
    if K.fits(pool, available, K.Demand(limit, demand.in_flight, demand.state_pages), layers):
        return limit
    return K.longest_fitting(pool, available, demand, limit, layers)


def evaluate(spec: ModelSpec, hw: Hardware, layout: B.Layout, kv_dtype: str, util: float,
             traits: VersionTraits, pins: Pins, chunked: bool) -> Candidate:
    """Run the budget model for one layout; the result says whether and how well it fits."""
    block = pins.block_size or block_size(hw, spec.attention, kv_dtype)[0]
    world = layout.tp * layout.pp
    d_tokens, d_seqs = batch_defaults(hw, world, traits.version)
    seqs = pins.max_num_seqs or d_seqs
    stages = B.pp_stages(spec.num_layers, layout.pp)
    pool, layer_specs = B.kv_pool(spec, kv_dtype, layout.tp, block, **cache_options(
        spec, hw, traits))
    block = pool.block  # a state layer may have grown it (Platform._align_hybrid_block_size)
    limiting = max(stages, key=len)
    per_token = K.context_bytes_per_token([layer_specs[i] for i in limiting])
    scale = B.checkpoint_scale(spec)
    weights = [round(w * scale) for w in B.stage_weight_bytes(spec, layout)]
    full = spec.max_context
    target = pins.max_model_len or full

    tokens_cap = pins.max_num_batched_tokens or min(d_tokens, seqs * target)
    if not chunked:  # vLLM requires a whole max-length prompt per step without chunking
        tokens_cap = max(tokens_cap, target)
    demand = K.Demand(target, tokens_cap * concurrent_batches(hw, layout, traits),
                      state_pages(traits))
    profile_tokens = tokens_cap if chunked else max(tokens_cap, target)
    activation = B.activation_bytes(spec, layout, profile_tokens, seqs,
                                    sampler_sorts=not traits.has("sampler_no_sort"),
                                    moe_all_dp_tokens=True)
    eager = pins.enforce_eager or hw.is_cpu
    cudagraph = (B.cudagraph_bytes(spec, layout, seqs, tokens_cap, eager,
                                   full_and_piecewise=traits.has("full_and_piecewise"),
                                   cap=capture_cap(spec, hw, traits))
                 if traits.has("cudagraph_estimate") else 0)
    non_torch = 0 if hw.is_cpu else B.non_torch_bytes(layout,
                                                       traits.has("nccl_before_snapshot"))
    block_bytes = [pool.bytes_per_block(r if len(stages) > 1 else None) for r in stages]

    pinned = pins.kv_cache_memory_bytes
    if hw.is_cpu:
        requested = B.requested_bytes(hw.free_bytes, util)
        budget = requested - max(weights) - B.CPU_NON_KV_MARGIN
        # never more than the batch can use: every sequence at full length, and the null block
        want = (seqs * pool.blocks_per_request(demand) + 1) * max(block_bytes)
        avail = [pinned if pinned else min(budget, want)]
        activation = cudagraph = 0
    else:
        requested = B.requested_bytes(hw.budget_total, util)
        overhead = activation + cudagraph + non_torch
        avail = [pinned if pinned else requested - w - overhead for w in weights]
    if len(avail) == 1 and len(stages) > 1:
        avail = avail * len(stages)
    blocks = min(B.kv_blocks(a, bb) for a, bb in zip(avail, block_bytes, strict=True))
    kv_memory = blocks * max(block_bytes)
    on_stage = [r if len(stages) > 1 else None for r in stages]
    limit = pins.max_model_len or full  # no context beyond the target is ever asked for
    longest = min(_longest(pool, a, demand, limit, r)
                  for a, r in zip(avail, on_stage, strict=True)) if min(avail) > 0 else 0
    length = pins.max_model_len or longest
    cap = K.capacity(pool, blocks, K.Demand(length, demand.in_flight, demand.state_pages))
    tokens = cap.tokens
    problem = ""
    runs, why = attention_support(hw, spec.attention)
    if runs:
        runs, why = head_size_support(hw, spec.attention, spec.head_dim)
    if not runs:
        problem = why
    elif min(avail) <= 0:
        short = -min(avail)
        problem = (f"weights {max(weights) / GiB:.1f} GiB + overhead "
                   f"{(activation + cudagraph + non_torch) / GiB:.1f} GiB exceed the "
                   f"{requested / GiB:.1f} GiB vLLM may use per GPU by {short / GiB:.1f} GiB")
    elif pinned and not hw.is_cpu and (over := max(weights) + activation + cudagraph
                                       + non_torch + pinned - usable_bytes(hw)) > 0:
        problem = (f"the pinned KV cache {pinned / GiB:.1f} GiB + weights "
                   f"{max(weights) / GiB:.1f} GiB + overhead "
                   f"{(activation + cudagraph + non_torch) / GiB:.1f} GiB exceed the "
                   f"{usable_bytes(hw) / GiB:.1f} GiB a GPU has for vLLM by {over / GiB:.1f} GiB")
    elif longest < length:
        problem = (f"KV cache holds {longest:,} tokens for one request, less than one "
                   f"{length:,}-token request")
    elif not pins.max_model_len and length < min(MIN_CONTEXT, full):
        problem = f"only {longest:,} tokens of KV cache: below the {MIN_CONTEXT:,}-token minimum"
    seqs_final = pins.max_num_seqs or seqs
    if not problem and tokens_cap < seqs_final:
        problem = (f"max-num-batched-tokens {tokens_cap:,} is below max-num-seqs "
                   f"{seqs_final:,}: vLLM refuses that (SchedulerConfig)")
    stage_info = [{"layers": len(r), "weights_bytes": w, "kv_cache_bytes": blocks * bb}
                  for r, w, bb in zip(stages, weights, block_bytes, strict=True)]
    cache = {"kinds": pool.kinds(), "groups": len(pool.groups),
             "blocks_per_request": cap.blocks_per_request, "block_bytes": max(block_bytes),
             "engine_concurrency": cap.concurrency}
    return Candidate(layout, kv_dtype, block, util, requested, max(weights), activation,
                     cudagraph, non_torch, kv_memory, per_token, blocks, tokens, length,
                     seqs_final, tokens_cap, not problem, problem, stage_info, cache,
                     tuple(layer_specs), demand)


