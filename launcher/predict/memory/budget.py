"""The budget model: bytes from shapes, the way vLLM counts them. Pure functions, no I/O.

vLLM (V1 engine) gives each GPU a request of ``ceil(total x gpu_memory_utilization)`` bytes and
hands the KV cache whatever is left after the weights, the activation peak of its profiling run,
non-torch memory (NCCL, custom all-reduce, attention workspaces) and, since v0.21.0, its CUDA-graph
estimate (gpu_worker.determine_available_memory). The cache is cut into pages of ``block_size``
tokens; every rank is set to the smallest block count (kv_cache_utils.get_kv_cache_configs).

Shapes give exact answers for weights and KV bytes per token. Activations, CUDA graphs and
non-torch memory are estimates; each constant below names its source and applies to every model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...inputs.arch import Tensor, cache_layout
from ...inputs.hardware import GiB, MiB  # noqa: F401 - the units, defined once; re-exported
from ...inputs.model import DTYPE_BYTES, ModelSpec, Quant
from . import kvcache as K

VOCAB_PADDING = 64
"""vLLM pads vocab-parallel embeddings to a multiple of 64 (DEFAULT_VOCAB_PADDING_SIZE)."""

SAMPLER_LOGIT_COPIES = 9.65
"""Peak bytes of the sampler's profiling run, in units of one fp32 logits tensor
(max_num_seqs x vocab x 4 B): logits, probabilities, sort values and int64 indices for
top-k/top-p. Measured on vLLM V1 start-ups of Llama-3.1-8B, Qwen3-0.6B, Qwen3-32B and
gpt-oss-20b/120b on H100 (shared/validation rows LD01-LD10: 9.59-9.73 for three vocabularies)."""

SORT_COPIES = 3
"""What a full-vocabulary sort adds to the sampler peak, in fp32-logit units: sorted fp32
values (1) and int64 indices (2)."""

ACT_HIDDEN_COPIES = 9
"""Live hidden-size activations per token during the profiling forward pass (residual,
norm output, attention input/output, MoE input and combine buffers), in units of
hidden_size x activation bytes. One value for every model, chosen over all validation rows whose
forward pass sets the peak (V0 DeepSeek-R1 TP8 at 163,840 tokens: ~8; V0 DeepSeek-V3-AWQ TP8:
~14; Llama-3-8B V0: ~6 with the MLP term below)."""

ACT_MLP_COPIES = 2
"""Live MLP-width activations per token: the gate/up output and the activated product
(2 x 2 x intermediate per rank); for MoE, fused-MoE's intermediate cache over top-k experts."""

NON_TORCH_SINGLE = int(0.13 * GiB)
"""Non-torch memory on one GPU (CUDA/cuBLAS workspaces): 0.13-0.14 GiB in V1 start-ups on
H100 (rows LD01-LD10)."""

NON_TORCH_TP_BASE = int(1.5 * GiB)
NON_TORCH_TP_PER_RANK = int(0.2 * GiB)
"""With tensor parallelism vLLM adds NCCL communicators and custom all-reduce buffers. V0 TP8
logs show 4.66-7.16 GiB including graph-capture pools (DS17); V1 keeps graphs out of it.
Modelled as 1.5 GiB + 0.2 GiB per TP rank (3.1 GiB at TP8); calibrate against real logs."""

NON_TORCH_PER_EXTRA_NODE = int(0.5 * GiB)
"""Inter-node NCCL (IB/socket) buffers per extra node in the group."""

CUDAGRAPH_PER_CAPTURE = 6 * MiB
"""CUDA-graph pool growth per captured batch size (vLLM's estimate extrapolates linearly:
per-graph cost x number of sizes; 51 sizes by default for max capture 512)."""

DEFAULT_CAPTURE_SIZES = 51
"""[1, 2, 4] + range(8, 256, 8) + range(256, 513, 16): 51 sizes for a max capture size of 512."""

CPU_NON_KV_MARGIN = int(1.0 * GiB)
"""On the CPU engine: memory left for the process itself besides weights (Python, torch, the
API server); vLLM's CPU worker measures its RSS instead of profiling activations."""


@dataclass(frozen=True)
class Layout:
    """How the model is spread: tensor, pipeline and data parallel sizes."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


# ----------------------------------------------------------------------------- weights


def is_quantized(t: Tensor, quant: Quant) -> bool:
    """Whether the checkpoint's format stores this tensor quantized."""
    if not t.quant or quant.method == "none":
        return False
    if quant.only_experts and t.part != "experts":
        return False
    parts = t.name.split(".")
    return not any(frag.split(".")[-1] in parts for frag in quant.skip
                   if frag.split(".")[-1] not in ("*", ""))


def tensor_bytes(t: Tensor, quant: Quant, dtype_bytes: int) -> float:
    """Stored bytes of a tensor group, including quantization scales and zero points."""
    n = t.elements
    if not is_quantized(t, quant):
        return n * (DTYPE_BYTES[t.dtype] if t.dtype else dtype_bytes)
    if quant.method == "fp8_block":
        b0, b1 = quant.block
        return n + math.ceil(t.rows / b0) * math.ceil(t.cols / b1) * 4 * t.count
    if quant.method == "fp8_channel":
        return n + t.rows * 4 * t.count
    if quant.method == "int4_group":
        # group_size -1 (GPTQ): one group over all of a row's inputs, i.e. per channel
        per_row = math.ceil(t.cols / quant.group_size) if quant.group_size > 0 else 1
        groups = per_row * t.rows * t.count
        return n * quant.bits / 8 + groups * 2 + groups * quant.bits / 8  # scales fp16 + zeros
    if quant.method == "mxfp4":
        return n / 2 + n / 32  # two values per byte, one e8m0 scale per 32
    raise ValueError(f"unknown quantization method {quant.method}")


def scale_elements(t: Tensor, quant: Quant) -> int:
    """Elements of the scale tensors a block-FP8 checkpoint stores next to a weight."""
    if quant.method != "fp8_block" or not is_quantized(t, quant):
        return 0
    b0, b1 = quant.block
    return math.ceil(t.rows / b0) * math.ceil(t.cols / b1) * t.count


def param_count(spec: ModelSpec) -> int:
    """Every element the checkpoint stores: MTP layers, vision towers and FP8 scales included."""
    return sum(t.elements + scale_elements(t, spec.quant) for t in spec.tensors)


def weights_bytes(spec: ModelSpec, loaded_only: bool = True) -> int:
    """Bytes of all weights, all ranks together (what vLLM loads unless loaded_only=False)."""
    return memo("weights", spec, loaded_only, lambda: round(sum(
        tensor_bytes(t, spec.quant, spec.dtype_bytes) for t in spec.tensors
        if t.loaded or not loaded_only)))


def checkpoint_scale(spec: ModelSpec) -> float:
    """How the checkpoint's own byte total (model.safetensors.index.json, the ground truth)
    compares with the bytes counted from config.json; 1.0 when there is no index."""
    if not spec.checkpoint_bytes:
        return 1.0
    counted = weights_bytes(spec, loaded_only=False)
    return spec.checkpoint_bytes / counted if counted else 1.0


ROUGH_FIT_SHARE = 0.85
"""Share of a GPU's memory the weights may take and still leave room for a KV cache, for the
coarse filter that picks which GPU counts to plan at all: vLLM's default 0.9 utilisation less
activations and CUDA graphs (a few percent); the plan then decides for real."""


def holds_roughly(spec: ModelSpec, per_gpu_bytes: int, gpus: int) -> bool:
    """Whether `gpus` GPUs of `per_gpu_bytes` could hold the checkpoint with room for a KV cache
    (the coarse filter of capacity's options and of the plan's other-GPU alternatives)."""
    return per_gpu_bytes * gpus * ROUGH_FIT_SHARE > weights_bytes(spec) * checkpoint_scale(spec)


def shard_fraction(t: Tensor, layout: Layout, vocab: int) -> float:
    """Fraction of a tensor group one rank holds under TP / DP+EP."""
    tp, ep = layout.tp, layout.tp * layout.dp
    if t.shard in ("column", "row"):
        return 1 / tp
    if t.shard == "kv":
        return max(1 / tp, 1 / t.heads) if t.heads else 1 / tp
    if t.shard == "vocab":
        padded = math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING
        return math.ceil(padded / tp) / vocab
    if t.part == "shared" and layout.expert_parallel and layout.dp > 1:
        # DP+EP keeps the shared experts whole on every GPU: they run with the attention's
        # data parallelism, not in the expert-parallel group (DeepseekV2MoE's shared_experts
        # get no TP split when is_sequence_parallel / DP attention is on).
        return 1.0
    if t.shard in ("expert_column", "expert_row"):
        if layout.expert_parallel:
            return math.ceil(t.count / ep) / t.count
        return 1 / ep  # without EP, MoE layers use TP over DP x TP ranks
    return 1.0


def pp_stages(num_layers: int, pp: int) -> list[range]:
    """Layer ranges per pipeline stage, as vLLM partitions them (extra layers before the last)."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


_MEMO: dict[tuple, tuple] = {}


def memo(kind: str, spec: ModelSpec, layout: object, compute):  # noqa: ANN001
    """Per-(spec, layout) results of sums over every tensor: a plan asks for them once per KV
    dtype and objective, and DeepSeek has ~1,000 tensor groups. Keyed by identity; the entry
    holds the spec, so an id is never reused while its entry lives."""
    key = (kind, id(spec), layout)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_MEMO) > 4096:
        _MEMO.clear()
    value = compute()
    _MEMO[key] = (spec, value)
    return value


def stage_weight_bytes(spec: ModelSpec, layout: Layout) -> list[int]:
    """Weight bytes on one rank of each pipeline stage (embedding first, head last)."""
    return list(memo("stage_weights", spec, layout, lambda: _stage_weight_bytes(spec, layout)))


def _stage_weight_bytes(spec: ModelSpec, layout: Layout) -> list[int]:
    stages = pp_stages(spec.num_layers, layout.pp)
    totals = [0.0] * layout.pp
    for t in spec.tensors:
        if not t.loaded:
            continue
        size = tensor_bytes(t, spec.quant, spec.dtype_bytes) * shard_fraction(
            t, layout, spec.vocab_size)
        if t.name == "kv_b_proj" and spec.attention.startswith("mla"):
            size += mla_absorbed_bytes(t, spec, layout)
        if t.layer is None:
            totals[-1 if t.part == "head" else 0] += size
        else:
            idx = next((i for i, r in enumerate(stages) if t.layer in r), layout.pp - 1)
            totals[idx] += size
    return [round(x) for x in totals]


def mla_absorbed_bytes(t: Tensor, spec: ModelSpec, layout: Layout) -> float:
    """MLA's W_UK / W_UV made after loading from a quantized kv_b_proj: vLLM dequantizes it to
    the activation dtype and keeps both halves for the absorbed decode path
    (model_executor/layers/attention/mla_attention.py process_weights_after_loading:
    W_UV, W_UK_T), one bf16 copy of the rank's kv_b_proj. A bf16 kv_b_proj is only viewed."""
    if not is_quantized(t, spec.quant):
        return 0.0
    return t.elements * shard_fraction(t, layout, spec.vocab_size) * spec.dtype_bytes


# ----------------------------------------------------------------------------- KV cache


@dataclass(frozen=True)
class KVSpec:
    """What one token costs in one layer's cache, per GPU (vLLM's AttentionSpec page / block)."""

    kind: str  # mla | mla_sparse | gqa
    bytes_per_layer: int


def kv_dtype_bytes(kv_dtype: str, model_dtype_bytes: int) -> int:
    return 1 if kv_dtype.startswith("fp8") else model_dtype_bytes


def kv_spec(spec: ModelSpec, kv_dtype: str, tp: int, plain_fp8_sparse: bool = False) -> KVSpec:
    """Per-layer, per-token KV bytes on one GPU.

    MLA caches one latent (kv_lora_rank + qk_rope_head_dim) per token and layer on EVERY TP rank:
    it has a single KV head, so TP does not split it. DeepSeek-V3.2 stores the latent in
    vLLM's fp8_ds_mla format (512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 B) plus the indexer's
    key cache (head_dim fp8 + one fp32 scale per 128 values). On Blackwell (vLLM >= 0.19) an
    fp8 cache goes to FLASHINFER_MLA_SPARSE, which stores plain fp8 latents (576 B) instead
    (plain_fp8_sparse). GQA caches K and V per KV head, split over TP until TP exceeds the KV
    heads, which are then replicated.
    """
    eb = kv_dtype_bytes(kv_dtype, spec.dtype_bytes)
    if spec.attention in ("mla", "mla_sparse"):
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        if spec.attention == "mla_sparse":
            main = (spec.kv_lora_rank + 4 * (spec.kv_lora_rank // 128) + 2 * spec.qk_rope_head_dim
                    if eb == 1 and not plain_fp8_sparse else latent * eb)
            indexer = spec.index_head_dim + spec.index_head_dim // 128 * 4
            return KVSpec("mla_sparse", main + indexer)
        return KVSpec("mla", latent * eb)
    heads = max(1, spec.num_kv_heads // tp)
    return KVSpec("gqa", 2 * heads * spec.head_dim * eb)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, layout: Layout) -> int:
    """What one token costs on the limiting GPU: the pipeline stage with the most layers."""
    layers = max(len(r) for r in pp_stages(spec.num_layers, layout.pp))
    return kv_spec(spec, kv_dtype, layout.tp).bytes_per_layer * layers


def state_bytes(linear: tuple[int, int, int, int, int], tp: int, conv_bytes: int,
                ssm_bytes: int, speculative: int = 0) -> int:
    """One gated delta-net layer's state per request on one GPU (MambaStateShapeCalculator.
    gated_delta_net_state_shape): a conv state of (2 x key heads x key dim + value heads x value
    dim) / TP channels x (kernel - 1 + speculative tokens) in the model dtype, and a temporal
    state of value heads / TP x value dim x key dim in the SSM dtype."""
    kh, kd, vh, vd, kernel = linear
    conv = (2 * kh * kd + vh * vd) // tp * (kernel - 1 + speculative) * conv_bytes
    return conv + vh // tp * vd * kd * ssm_bytes


def layer_caches(spec: ModelSpec, kv_dtype: str, tp: int, *, hybrid: bool = True,
                 mla_align: int = 0, ssm_bytes: int | None = None,
                 chunked_hybrid: bool = False, plain_fp8_sparse: bool = False
                 ) -> list[K.LayerCache]:
    """One cache spec per decoder layer, on one GPU of a TP group.

    hybrid: whether this vLLM has the hybrid KV cache manager; without it (or for Llama 4's
    chunked layers, which vLLM 0.32 keeps off the hybrid manager unless
    VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1: config/vllm.py), windowed layers next
    to full ones are cached as full attention (unify_hybrid_kv_cache_specs).
    mla_align: V0 padded MLA's latent to this many values. ssm_bytes: the SSM state dtype when
    the platform overrides the config's (the CPU engine resets it to float32 on AVX512-BF16).
    """
    per = kv_spec(spec, kv_dtype, tp, plain_fp8_sparse)
    per_token = per.bytes_per_layer
    if mla_align and spec.attention == "mla":
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        per_token = math.ceil(latent / mla_align) * mla_align * kv_dtype_bytes(
            kv_dtype, spec.dtype_bytes)
    if spec.attention == "mla":
        return [K.MLA(per_token)] * spec.num_layers
    if spec.attention == "mla_sparse":
        return [K.SparseMLA(per_token)] * spec.num_layers
    lay = cache_layout(spec.config)
    kinds = list(lay.kinds[:spec.num_layers]) + ["full"] * (spec.num_layers - len(lay.kinds))
    full = K.FullAttention(per_token)
    mixed = "full" in kinds and any(k in ("sliding", "chunked") for k in kinds)
    out: list[K.LayerCache] = []
    for kind in kinds:
        if kind == "sliding" and lay.window and (hybrid or not mixed):
            out.append(K.SlidingWindow(per_token, lay.window))
        elif kind == "chunked" and lay.chunk and ((hybrid and chunked_hybrid) or not mixed):
            out.append(K.ChunkedLocal(per_token, lay.chunk))
        elif kind == "linear" and lay.linear:
            ssm = ssm_bytes or DTYPE_BYTES.get(lay.ssm_dtype or spec.dtype, spec.dtype_bytes)
            out.append(K.State(state_bytes(lay.linear, tp, spec.dtype_bytes, ssm)))
        else:
            out.append(full)
    return out


def kv_pool(spec: ModelSpec, kv_dtype: str, tp: int, block: int, **kw: object
            ) -> tuple[K.Pool, list[K.LayerCache]]:
    """The layers' specs and vLLM's grouping of them (memoised: a plan asks per layout)."""
    key = (kv_dtype, tp, block, tuple(sorted(kw.items())))
    return memo("kv_pool", spec, key, lambda: _kv_pool(spec, kv_dtype, tp, block, kw))


def _kv_pool(spec: ModelSpec, kv_dtype: str, tp: int, block: int, kw: dict
             ) -> tuple[K.Pool, list[K.LayerCache]]:
    layers = layer_caches(spec, kv_dtype, tp, **kw)
    return K.build_pool(layers, block), layers


def kv_blocks(available: int, page: int) -> int:
    """Whole pages that fit (kv_cache_utils: available_memory // page_size_bytes)."""
    return max(0, available // page) if page else 0


# ----------------------------------------------------------------------------- overheads


def requested_bytes(total: int, utilization: float) -> int:
    """vLLM's per-GPU request: a fraction of the card's TOTAL memory, rounded up."""
    return math.ceil(total * utilization)


def _mlp_width_per_rank(spec: ModelSpec, layout: Layout) -> int:
    dense = 2 * spec.intermediate_size // layout.tp if spec.intermediate_size else 0
    moe = 0
    if spec.is_moe:
        moe = spec.experts_per_token * 2 * spec.moe_intermediate // max(1, layout.tp)
    return max(dense, moe)


def activation_bytes(spec: ModelSpec, layout: Layout, max_num_batched_tokens: int,
                     max_num_seqs: int, *, sampler_sorts: bool = True,
                     moe_all_dp_tokens: bool = False) -> int:
    """Peak of vLLM's profiling run: a forward pass over max_num_batched_tokens, or the sampler
    over max_num_seqs x vocab logits, whichever is larger (they do not overlap).

    sampler_sorts: top-k/top-p by a full-vocabulary sort (fp32 values + int64 indices, three
    logits' worth); releases whose FlashInfer/Triton top-k/top-p kernels skip it peak lower.
    moe_all_dp_tokens: under DP+EP with the all-gather/reduce-scatter all-to-all (vLLM's
    default), each rank's fused-MoE runs on the tokens of every DP rank, so its workspace
    (tokens x top-k x (2 x intermediate + hidden)) grows with DP (fused_moe/modular_kernel.py
    _allocate_buffers: M is the gathered token count, no chunking in 0.32).
    """
    act = spec.dtype_bytes
    per_token = act * (ACT_HIDDEN_COPIES * spec.hidden_size
                       + ACT_MLP_COPIES * _mlp_width_per_rank(spec, layout))
    forward = max_num_batched_tokens * per_token
    if moe_all_dp_tokens and spec.is_moe and layout.dp > 1 and layout.expert_parallel:
        width = spec.experts_per_token * (2 * spec.moe_intermediate + spec.hidden_size)
        forward += (layout.dp - 1) * max_num_batched_tokens * width * act
    copies = SAMPLER_LOGIT_COPIES if sampler_sorts else SAMPLER_LOGIT_COPIES - SORT_COPIES
    sampler = copies * max_num_seqs * spec.vocab_size * 4
    return round(max(forward, sampler))


def non_torch_bytes(layout: Layout, setup_before_snapshot: bool = False) -> int:
    """NCCL / custom all-reduce buffers and CUDA workspaces outside torch's allocator.

    setup_before_snapshot: since vLLM 0.11 the distributed setup (NCCL communicators, custom
    all-reduce buffers, inter-node transports) runs before the memory snapshot the KV budget
    is measured from (v1/worker/gpu_worker.py init_device), so only what NCCL allocates lazily
    during the profiling pass still counts: the per-rank term, not the base or per-node one.
    """
    group = layout.tp * layout.pp
    if group == 1 and layout.dp == 1:
        return NON_TORCH_SINGLE
    if setup_before_snapshot:
        return NON_TORCH_SINGLE + NON_TORCH_TP_PER_RANK * layout.tp
    extra_nodes = max(0, layout.nodes - 1)
    return (NON_TORCH_SINGLE + NON_TORCH_TP_BASE + NON_TORCH_TP_PER_RANK * layout.tp
            + NON_TORCH_PER_EXTRA_NODE * extra_nodes)


def capture_list(max_num_seqs: int, max_num_batched_tokens: int, cap: int = 512,
                 decode_query_len: int = 1) -> list[int]:
    """The batch sizes vLLM captures (config/vllm.py _set_cudagraph_sizes): 1, 2, 4, multiples
    of 8 below 256, of 16 from 256, up to min(max_num_seqs x decode_query_len x 2, cap) and
    max_num_batched_tokens. cap: 512, 1024 on data-center Blackwell (vLLM >= 0.28) or when a
    model raises it (gpt-oss)."""
    top = min(max_num_seqs * decode_query_len * 2, cap, max_num_batched_tokens)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, cap + 1, 16))
    return [x for x in sizes if x <= top]


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, cap: int = 512) -> int:
    """How many batch sizes vLLM captures piecewise (see capture_list)."""
    return len(capture_list(max_num_seqs, max_num_batched_tokens, cap))


def cudagraph_bytes(spec: ModelSpec, layout: Layout, max_num_seqs: int,
                    max_num_batched_tokens: int, enforce_eager: bool, *,
                    full_and_piecewise: bool = False, cap: int = 512,
                    decode_query_len: int = 1) -> int:
    """vLLM's CUDA-graph memory estimate (subtracted from the KV budget since v0.20):
    the largest graph's capture plus a per-graph cost for every other graph
    (v1/worker/gpu_model_runner.py profile_cudagraph_memory: max first capture over the modes +
    per-graph x (graphs - 1) per mode). Under FULL_AND_PIECEWISE (the default since 0.11)
    there are two lists: piecewise graphs for every size, full graphs for uniform decode
    batches up to max_num_seqs x decode_query_len."""
    if enforce_eager:
        return 0
    sizes = capture_list(max_num_seqs, max_num_batched_tokens, cap, decode_query_len)
    n = len(sizes)
    if full_and_piecewise:
        n += sum(1 for x in sizes if x <= max_num_seqs * decode_query_len) - 1
    top = sizes[-1] if sizes else 0
    act = spec.dtype_bytes * top * (ACT_HIDDEN_COPIES * spec.hidden_size
                                    + ACT_MLP_COPIES * _mlp_width_per_rank(spec, layout))
    return n * CUDAGRAPH_PER_CAPTURE + act
