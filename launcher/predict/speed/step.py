"""One forward step of one engine (a DP rank), as a sum of operator rooflines. Pure functions.

A step carries `decodes` running sequences, each verifying 1 + k tokens (k MTP drafts; 0 without
speculation), and optionally a prefill chunk of `chunk` tokens whose prompt already has `prefix`
tokens cached. Its M = decodes x (1 + k) + chunk tokens go through every layer of the stage:

- dense GEMMs: max((weights + activations) / (HBM x hbm_eff), M x 2 x params / (peak x eff));
- routed experts: the distinct experts the step's tokens touch (E_local x (1 - (1 - k/E)^T),
  T the tokens entering this rank's experts: every DP rank's under EP), their bytes read once,
  their FLOPs at the same roofline, plus the fused-MoE kernel's floor per MoE layer;
- attention: decode reads every sequence's KV at its context (sliding windows bounded by the
  window; MLA's latent; fp8 KV halves it), prefill attention of the chunk over its whole prefix
  (the chunks of a prompt sum to its causal L^2 / 2);
- collectives: two TP all-reduces per layer of M x hidden bf16 (vLLM's custom all-reduce inside
  NVLink, NCCL across nodes or over PCIe), EP all-gather + reduce-scatter of every DP rank's
  hidden states per MoE layer (vLLM's default all2all backend), a pipeline hop per stage, a DP
  synchronisation per step;
- fixed: per layer (kernel launches, norms, rotary) and per step (scheduler, sampler, input
  preparation; several milliseconds more in the V0 engine).

`Constants` holds every efficiency and fixed cost, each with its physical range and source;
the shape holds only physical facts, so replacing `shape.constants` moves every constant (the fit
in bench/perf_fit.py and `vlaunch tune`'s calibration do exactly that).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ...inputs.hardware import Hardware
from ...inputs.model import ModelSpec
from ..memory import budget as B
from .ops import gather_s, ring_allreduce_s, send_s


@dataclass(frozen=True)
class Constants:
    """Efficiencies (shares of a peak) and fixed costs (microseconds). The values are the fit of
    `bench/perf_fit.py` inside the BOUNDS there, rounded; each field says its physical range."""

    hbm_eff: float = 0.872
    """Share of peak HBM bandwidth weight and KV reads reach. Range 0.6-0.92: aiconfigurator's
    vLLM GEMM tables give 0.76-0.86 for bf16 weights, FlashMLA decode ~0.9 of H800's HBM
    (ai-dynamo/aiconfigurator; deepseek-ai/FlashMLA README)."""
    compute_eff: float = 0.452
    """Share of dense tensor peak a decode step's GEMMs and attention reach. Range 0.4-0.70:
    aiconfigurator measures 0.5-0.59 for fp8 and ~0.8 for bf16 GEMMs at large M; decode M is
    small, so <= 0.70 (the issue's bound)."""
    prefill_eff: float = 0.45
    """Share of dense tensor peak a prefill chunk's GEMMs and attention reach. Range 0.45-0.75:
    FlashAttention-3 reaches ~740 of 989 bf16 TFLOPS on H100 (~75%, arXiv 2407.08608);
    aiconfigurator's large-M GEMMs 0.79-0.81 (bf16) and 0.50-0.59 (fp8) of peak."""
    fp8_gemm_share: float = 0.65
    """fp8 GEMMs reach this share of the efficiency bf16 GEMMs reach, of their (twice as high)
    fp8 peak: scaling and smaller tiles. Range 0.5-1.0: aiconfigurator's vLLM GEMM tables give
    0.50-0.59 of fp8 peak on H100/H200 against 0.79-0.81 of bf16 peak (~0.65). Below 0.5 an
    fp8 GEMM would be slower than bf16 at the same shape on every catalog GPU (fp8 peak = 2x
    bf16): vLLM would not choose that kernel, so `stage_step` never times an fp8 GEMM below
    the bf16 one (physics: the same math on a unit at least as fast)."""
    moe_eff: float = 0.456
    """Share of the roofline (bandwidth and compute alike) a fused-MoE grouped GEMM reaches,
    beyond the dense GEMMs' efficiencies: routing, permutation and per-expert tiles. Range
    0.05-1.0: aiconfigurator's vLLM fused-MoE tables give median utilisation 0.53 (bf16), 0.40
    (fp8), 0.23 (nvfp4), 0.07 (int4 weight-only)."""
    layer_us: float = 43.0
    """Fixed cost per layer per step: ~6-10 kernels of ~2-4 us each under CUDA graphs (norms,
    rotary, KV write, activation). Range 5-60 us; aiconfigurator's element-wise op floor is
    ~3 us and its GEMM floor 3.8-8.7 us."""
    moe_layer_us: float = 41.1
    """Floor of one fused-MoE layer (router, top-k, permutation, grouped-GEMM set-up). Range
    20-120 us: aiconfigurator's vLLM fused-MoE tables floor at 22-50 us."""
    allreduce_us: float = 5.0
    """Latency of one vLLM custom all-reduce inside NVLink / Infinity Fabric under a CUDA graph.
    Range 4-25 us: 5.1 us at 8 KB on 8xH100, ~20 us outside a graph (vLLM
    custom_all_reduce benchmarks, csrc/custom_all_reduce.cuh)."""
    link_eff: float = 0.54
    """Share of the link bandwidth a collective's ring moves bytes at. Range 0.2-0.9: vLLM's
    custom all-reduce on 8xH100 takes 5.1 us at 8 KB and 19.4 at 2 MB (7.9 at 128 KB, 15.0 at
    1 MB): 14.3 us per 2 MB over that range, 2 x 7/8 x 2 MB / (450 GB/s x 0.54) with
    allreduce_us = 5 (the sizes decode and small prefill steps move); nccl-tests reach ~0.8 of
    NVLink as bus bandwidth at large sizes. Kept at that measurement, not fitted."""
    nccl_us: float = 16.0
    """Latency of one NCCL collective inside a node where vLLM's custom all-reduce does not
    apply (EP all-gather / reduce-scatter, DP synchronisation, PCIe). Range 8-30 us: nccl-tests
    on 8xH100 ~16 us at 8 KB."""
    network_us: float = 5.08
    """Latency of one step of a collective (or one pipeline hop) that crosses nodes over
    InfiniBand / RoCE: a small message through NCCL's network proxy. A ring all-reduce over n
    ranks takes 2 (n - 1) such steps and an all-gather n - 1, each as slow as its slowest link,
    so TP16 over two nodes pays ~30 of them per all-reduce. Range 2-20 us: ~1-2 us of verbs
    latency, plus NCCL's LL-protocol flag polling and the proxy thread (nccl-tests multi-node
    all-reduce at 8 KB on 16 H100s: tens of microseconds to ~150 us, i.e. 2-5 us per step)."""
    step_us: float = 281.0
    """Per engine step: scheduler, sampler, input preparation, output processing (V1 engine).
    Range 100-3,000 us: V1 overlaps scheduling with the GPU but a step still costs ~0.5 ms of
    host work (vLLM V1 alpha blog, 2025-01-27)."""
    v0_step_us: float = 3000.0
    """Extra per step in the V0 engine (synchronous scheduling, Python sampler and detokeniser
    on the critical path). Range 0-10,000 us: the V1 blog reports V0's CPU overhead as what V1
    removed (1.7x throughput); used only for rows measured on V0 releases."""
    v0_kernel_eff: float = 0.5
    """Share of the compute efficiencies the kernels of V0-era releases (vLLM < 0.8: Triton
    block-FP8 and fused-MoE GEMMs before CUTLASS/DeepGEMM, MLA before FlashMLA's prefill path,
    no torch.compile fusion) reached in math and in the fused MoE; their dense memory-bound
    kernels streamed weights and KV about as fast (a GEMV's speed is its bandwidth), and their
    floors stretch by it (more, unfused kernels). Range 0.05-1.0: Neural Magic measured
    DeepSeek-R1 on vLLM 0.7.0 at 238 and 0.7.1 at 821 output tok/s on the same GPUs (3.4x from
    kernels alone, neuralmagic.com 'Enhancing DeepSeek models with MLA and FP8'). Used only for
    V0 rows."""
    request_us: float = 49000.0
    """Per request before its first token: HTTP, tokenisation, engine hand-off, first chunk out.
    Range 1-60 ms: Qwen3-8B on H100 at concurrency 1 measures 59 ms TTFT for a 233-token prompt
    of ~10 ms compute (gpustack performance lab)."""
    frontend_us: float = 2000.0
    """Serial host work per request in one API-server process: HTTP parsing, chat template and
    tokenisation, the engine hand-off and the detokenised response. One process does it for
    every request one after the other, so it caps a deployment at api servers / frontend_us
    requests/s (vLLM 0.32 starts one API server per local DP rank: entrypoints/cli/serve.py
    defaults api_server_count to data_parallel_size_local). It binds when outputs are tiny: a
    128-in / 4-out burst ran at 1 / 2.75 of the engine-only requests/s (vlaunch issue 28,
    +175%). Range 0.3-10 ms: below request_us (the whole per-request latency, 59 ms TTFT for
    ~10 ms of compute on Qwen3-8B, gpustack), above the ~0.3 ms a tokenised HTTP round trip
    costs in Python."""
    spec_seq_us: float = 29.8
    """Host and sampler work per sequence per verified or drafted token of an MTP step: the
    rejection sampler's per-request bookkeeping (v1/sample/rejection_sampler.py: target
    probabilities, accepted-length metadata for every sequence) and the proposer's per-request
    input preparation before each draft pass (v1/spec_decode/llm_base_proposer.py
    prepare_inputs), which run between the GPU's kernels where a plain decode step overlaps its
    host work with them. What makes a verified token cost more as the batch grows. Range
    2-200 us: vLLM's V1 scheduler and output processor spend ~5-20 us of Python per request
    per step (V1 alpha blog, 2025-01-27), a few times that with drafts to track."""
    draft_pass_us: float = 500.0
    """Fixed cost of one MTP draft pass beyond its layer's operators: the proposer's input
    preparation, sampling and the draft's LM-head launch. Range 50-2,000 us (vLLM
    v1/spec_decode/llm_base_proposer.py propose: one forward + argmax per draft)."""


DEFAULT = Constants()

BOUNDS: dict[str, tuple[float, float]] = {
    "hbm_eff": (0.6, 0.92), "moe_eff": (0.05, 1.0), "fp8_gemm_share": (0.5, 1.0),
    "compute_eff": (0.4, 0.70),
    "prefill_eff": (0.45, 0.75),
    "layer_us": (5.0, 60.0), "moe_layer_us": (20.0, 120.0), "allreduce_us": (4.0, 25.0),
    "link_eff": (0.2, 0.9), "nccl_us": (8.0, 30.0), "network_us": (2.0, 20.0),
    "step_us": (100.0, 3000.0),
    "v0_step_us": (0.0, 10000.0), "v0_kernel_eff": (0.05, 1.0), "request_us": (1000.0, 60000.0),
    "draft_pass_us": (50.0, 2000.0), "frontend_us": (300.0, 10000.0),
    "spec_seq_us": (2.0, 200.0),
}
"""The physical range of every constant (the docstrings give the sources): the fit never
leaves it."""

NOMINAL: dict[str, float] = {
    "hbm_eff": 0.85, "moe_eff": 0.5, "fp8_gemm_share": 0.65, "compute_eff": 0.55,
    "prefill_eff": 0.6,
    "layer_us": 20.0, "moe_layer_us": 45.0, "allreduce_us": 5.0, "link_eff": 0.54,
    "nccl_us": 16.0, "network_us": 5.0, "step_us": 500.0, "v0_step_us": 3000.0,
    "v0_kernel_eff": 0.5, "request_us": 20000.0, "draft_pass_us": 300.0, "frontend_us": 2000.0,
    "spec_seq_us": 20.0,
}
"""What the sources in the docstrings say before any fit: the fit's starting point and the
centre of its weak prior (bench/perf_fit.py)."""

ACTIVATION_PASSES = 12
"""Hidden-sized bf16 tensors a layer reads or writes per token (residual, two norms, QKV in,
attention out, O in/out, MLP in/out): the activation bytes beside the weights."""

PCIE_BW = 25e9
"""Bytes/s of a PCIe Gen4 x16 peer path (~25 GB/s achieved of 32): the link without NVLink."""


@dataclass(frozen=True)
class EngineShape:
    """The physical facts of one engine (a DP rank) on its limiting GPU. No constant is folded
    in: every efficiency and fixed cost is read from `constants` when a step is timed."""

    tp: int
    pp: int
    dp: int
    expert_parallel: bool
    layers: int  # per pipeline stage
    moe_layers: int  # per pipeline stage
    experts: int
    topk: int
    hidden: int
    dense_bytes: float  # non-expert weights one GPU reads per step (its stage)
    expert_bytes: float  # routed-expert weights one GPU holds (its stage)
    dense_flops_per_token: float  # non-expert matmul FLOPs per token on one GPU (its stage)
    expert_flops_per_token: float  # one token's top-k expert FLOPs in the stage, unsharded
    attn_decode_flops: float  # per query per context token on one GPU (its stage)
    attn_prefill_flops: float  # per query per context token on one GPU (its stage)
    kv_bytes_per_token: int  # per GPU, all layers of the stage
    hbm: float  # bytes/s
    peak: float  # FLOP/s of the weights' GEMM dtype
    link: str  # nvlink | xgmi | pcie: the path TP collectives take inside a node
    link_bw: float  # bytes/s per GPU, one direction
    net_bw: float  # bytes/s per GPU across nodes
    cross_node_tp: bool
    cross_node_pp: bool
    cross_node_ep: bool
    max_num_seqs: int  # per engine
    max_num_batched_tokens: int
    kv_tokens: int  # per engine
    chunked_prefill: bool
    constants: Constants = DEFAULT
    v0: bool = False  # the V0 engine (vLLM < 0.8 rows): its larger per-step host cost
    fp8_gemm: bool = False  # the GEMMs run on fp8 tensor cores (fp8 weights, a card with them)
    attn_peak: float = 0.0  # FLOP/s of attention math (bf16); 0: same as peak
    kv_grow: float = 1.0  # share of KV bytes per token in layers whose cache grows with context
    kv_windows: tuple[tuple[float, int], ...] = ()  # (share, window) of sliding layers
    # Speculative decoding (launcher/predict/speed/mtp.py): draft tokens verified per step, output
    # tokens a step yields on average, and the draft layer's own shape.
    spec_tokens: int = 0
    spec_yield: float = 1.0
    draft: EngineShape | None = field(default=None, compare=False)
    vocab: int = 0  # logits per sampled token (the sampler's and rejection sampler's bytes)

    @property
    def moe_group(self) -> int:
        """DP ranks whose tokens meet in every MoE layer. vLLM flattens TP across DP for the
        fused-MoE layer with or without expert parallelism
        (model_executor/layers/fused_moe/config.py FusedMoEParallelConfig.make and
        flatten_tp_across_dp_and_pcp) and, with DP > 1, all-gathers every rank's tokens before
        the experts and reduce-scatters after them (fused_moe/runner/moe_runner.py
        do_naive_dispatch_combine): EP only decides whether a rank holds whole experts or a
        slice of each."""
        return self.dp if self.experts and self.dp > 1 else 1

    @property
    def expert_shards(self) -> int:
        """Ranks the routed experts are spread over: TP x DP for a MoE under DP, EP or not."""
        return self.tp * self.moe_group


# ----------------------------------------------------------------------------- construction


def _active_counts(spec: ModelSpec) -> tuple[float, float]:
    """(dense matmul params, routed-expert params) of the loaded model."""
    dense = experts = 0.0
    for t in spec.tensors:
        if not t.loaded or t.part in ("embed", "vision", "mtp") or t.cols == 1:
            continue
        if t.part == "experts":
            experts += t.elements
        else:
            dense += t.elements
    return dense, experts


def _bytes_per_rank(spec: ModelSpec, layout: B.Layout) -> tuple[float, float]:
    """(non-expert bytes, routed-expert bytes) one GPU holds, summed over all stages."""
    return B.memo("perf_bytes", spec, layout, lambda: _sum_bytes_per_rank(spec, layout))


def _sum_bytes_per_rank(spec: ModelSpec, layout: B.Layout) -> tuple[float, float]:
    dense = experts = 0.0
    for t in spec.tensors:
        if not t.loaded or t.part in ("embed", "vision", "mtp"):
            continue
        size = B.tensor_bytes(t, spec.quant, spec.dtype_bytes) * B.shard_fraction(
            t, layout, spec.vocab_size)
        if t.part == "experts":
            experts += size
        else:
            dense += size
    scale = B.checkpoint_scale(spec)
    return dense * scale, experts * scale


def _moe_layers(spec: ModelSpec) -> int:
    return len({t.layer for t in spec.tensors if t.part == "experts" and t.layer is not None})


def attn_dims(spec: ModelSpec) -> tuple[float, float]:
    """FLOPs per query per context position per layer, all heads: (decode, prefill)."""
    h = spec.num_heads
    if spec.attention.startswith("mla"):
        c = spec.config
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        qk = c.get("qk_nope_head_dim", 128) + spec.qk_rope_head_dim
        v = c.get("v_head_dim", 128)
        # decode runs absorbed (scores over the 576-wide latent, values over 512);
        # prefill expands the latent to per-head keys and values.
        return 2.0 * h * (latent + spec.kv_lora_rank), 2.0 * h * (qk + v)
    return 4.0 * h * spec.head_dim, 4.0 * h * spec.head_dim


def _kv_shares(spec: ModelSpec, tp: int) -> tuple[float, tuple[tuple[float, int], ...]]:
    """(share of KV bytes in growing layers, ((share, window), ...) of sliding layers)."""
    def compute() -> tuple[float, tuple[tuple[float, int], ...]]:
        try:
            layers = B.layer_caches(spec, "auto", tp)
        except Exception:  # noqa: BLE001 - a layout the cache model rejects reads as full
            return 1.0, ()
        total = sum(getattr(x, "per_token", 0) for x in layers
                    if x.grows_with_context() or getattr(x, "window", 0))
        if not total:
            return 1.0, ()
        grow = sum(x.per_token for x in layers if x.grows_with_context()) / total
        windows: dict[int, float] = {}
        for x in layers:
            w = getattr(x, "window", 0) or getattr(x, "chunk", 0)
            if w and not x.grows_with_context():
                windows[w] = windows.get(w, 0.0) + x.per_token / total
        return grow, tuple((share, w) for w, share in sorted(windows.items()))
    return B.memo("perf_kv_shares", spec, tp, compute)


def engine_shape(spec: ModelSpec, hw: Hardware, layout: B.Layout, kv_bytes_per_token: int,
                 kv_tokens: int, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool, constants: Constants = DEFAULT,
                 v0: bool = False) -> EngineShape | None:
    """The one constructor of an engine's step inputs; None when the catalog has no speed facts
    for the GPU (a card given only by size): then no performance is claimed."""
    kind = hw.kind
    if not kind.hbm_gbps or not kind.bf16_tflops:
        return None
    fp8_weights = spec.quant.method.startswith("fp8")
    tflops = kind.fp8_tflops if fp8_weights and kind.fp8_tflops else kind.bf16_tflops
    dense_p, expert_p = B.memo("active", spec, B.Layout(), lambda: _active_counts(spec))
    topk = spec.experts_per_token if spec.is_moe else 0
    gpus = layout.tp * layout.pp
    dense_b, expert_b = _bytes_per_rank(spec, layout)
    dec, pre = attn_dims(spec)
    layers_stage = max(len(r) for r in B.pp_stages(spec.num_layers, layout.pp))
    if kind.platform == "rocm" and kind.nvlink_gbps:
        # Infinity Fabric: every GPU has a direct xGMI link to each of its peers in the node,
        # and vLLM's custom all-reduce runs over them as over NVLink
        link, link_bw = "xgmi", kind.nvlink_gbps * 1e9 * max(1, hw.gpus_per_node - 1)
    elif kind.nvlink and kind.nvlink_gbps:
        link, link_bw = "nvlink", kind.nvlink_gbps * 1e9
    else:
        link, link_bw = "pcie", PCIE_BW
    grow, windows = _kv_shares(spec, layout.tp)
    # GPUs that reach each other over NVLink: a node, or a whole NVL72 domain of trays (a
    # replica of several GB200 trays runs TP/EP over NVLink, not the network)
    per_node = hw.count if hw.count <= kind.nvlink_domain else hw.gpus_per_node
    return EngineShape(
        tp=layout.tp, pp=layout.pp, dp=layout.dp, expert_parallel=layout.expert_parallel,
        layers=layers_stage, moe_layers=math.ceil(_moe_layers(spec) / layout.pp),
        experts=spec.num_experts if spec.is_moe else 0, topk=topk, hidden=spec.hidden_size,
        dense_bytes=dense_b / layout.pp, expert_bytes=expert_b / layout.pp,
        dense_flops_per_token=2.0 * dense_p / gpus,
        expert_flops_per_token=(2.0 * expert_p * topk / spec.num_experts / layout.pp
                                if spec.is_moe and spec.num_experts else 0.0),
        attn_decode_flops=dec * layers_stage / layout.tp,
        attn_prefill_flops=pre * layers_stage / layout.tp,
        kv_bytes_per_token=kv_bytes_per_token, hbm=kind.hbm_gbps * 1e9, peak=tflops * 1e12,
        link=link, link_bw=link_bw, net_bw=(kind.network_gbps or 50.0) * 1e9,
        cross_node_tp=layout.tp > per_node, cross_node_pp=layout.pp > 1 and layout.nodes > 1,
        cross_node_ep=(spec.is_moe and layout.dp > 1 and layout.tp * layout.dp > per_node),
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        kv_tokens=kv_tokens, chunked_prefill=chunked_prefill, constants=constants, v0=v0,
        fp8_gemm=bool(fp8_weights and kind.fp8_tflops),
        attn_peak=kind.bf16_tflops * 1e12, kv_grow=grow, kv_windows=windows,
        vocab=spec.vocab_size)


# ----------------------------------------------------------------------------- step costs


def touched_fraction(experts: int, topk: int, tokens: float) -> float:
    """Expected share of routed experts that `tokens` tokens touch (uniform routing)."""
    if not experts:
        return 0.0
    return 1.0 - (1.0 - topk / experts) ** max(tokens, 0.0)


def kv_read_tokens(s: EngineShape, ctx: float) -> float:
    """Full-layer-equivalent tokens of KV one sequence at context `ctx` reads per step."""
    return s.kv_grow * ctx + sum(share * min(w, ctx) for share, w in s.kv_windows)


def _attn_span(s: EngineShape, ctx: float) -> float:
    """Context positions a query attends to, averaged over layers (windows bound theirs)."""
    return kv_read_tokens(s, ctx)


@dataclass(frozen=True)
class Step:
    """One step of one stage, split by what binds each operator (seconds)."""

    memory: float  # operators whose bytes bound them
    compute: float  # operators whose FLOPs bound them
    fixed: float  # collectives, floors, per-layer and per-step host costs
    bytes_read: float  # per GPU
    flops: float  # per GPU

    @property
    def total(self) -> float:
        return self.memory + self.compute + self.fixed


SOFT_Q = 3.0
"""Exponent of the soft maximum of an operator's two rooflines, (mem^q + comp^q)^(1/q): near
the ridge a kernel is neither purely memory- nor compute-bound and pays for both (the
per-operator models compared in shared/reference/perf-models.md: q ~ 2-3 removes most of the
error at the ridge, M ~ 256 for bf16 on Hopper). It is why a verified draft token is never
free: at q = 3 an operator whose math is half its byte time takes 4% longer, at par 26%."""


def _op(parts: list[float], bytes_read: float, flops: float, bw: float, eff_bw: float,
        peak: float, eff_c: float) -> None:
    mem = bytes_read / (bw * eff_bw) if bytes_read > 0 else 0.0
    comp = flops / (peak * eff_c) if flops > 0 else 0.0
    t = (mem ** SOFT_Q + comp ** SOFT_Q) ** (1 / SOFT_Q) if mem and comp else mem + comp
    if mem >= comp:
        parts[0] += t
    else:
        parts[1] += t


PREFILL_ATTN_HALF = 1000.0
"""Sequence length at which prefill attention reaches half its peak efficiency: aiconfigurator's
vLLM tables fit eta = 0.65 s / (s + s_half) with s_half ~1,000 on H100/H200 (~1,100 B200, ~450
A100; shared/reference/perf-models.md). Short prompts' attention is tile- and launch-bound."""

MOE_SLOT_PASSES = 3.0
"""Hidden-sized bf16 rows the fused-MoE kernel moves per routed token slot beside its weights
(fused_moe.py fused_experts_impl: the gate-up GEMM reads the token's row, the down GEMM writes
intermediate_cache3, moe_sum reads it back), plus 6 intermediate-sized rows (gate-up writes
2 x I into intermediate_cache1, the activation reads them and writes I into cache2, the down
GEMM reads it): bytes per slot = (3 x hidden + 6 x I_local) x 2. A verified draft token pays
them like any token: the MoE cost that grows with tokens per expert."""

LOGIT_PASSES = 3.0
"""fp32 passes over a sampled token's full-vocabulary logits: the LM head writes them, the
sampler's softmax / the rejection sampler's target probabilities read and write them (vLLM
v1/sample/rejection_sampler.py computes target probabilities for all 1 + k positions of every
sequence). Logits are gathered to every TP rank, so every GPU pays vocab x 4 bytes x passes."""


def stage_step(s: EngineShape, decodes: float, ctx: float, chunk: float = 0.0,
               prefix: float = 0.0, moe_tokens: float | None = None) -> Step:
    """One step of one pipeline stage on one GPU: `decodes` sequences at context `ctx`, each
    verifying 1 + spec_tokens tokens, beside a `chunk`-token prefill piece after `prefix`
    cached tokens. `moe_tokens`: tokens entering the EP group's experts (default: this
    engine's tokens times DP under EP, every rank in lockstep)."""
    k = s.constants
    q = 1 + s.spec_tokens
    m = decodes * q + chunk
    parts = [0.0, 0.0]
    ke = k.v0_kernel_eff if s.v0 else 1.0
    # V0-era kernels lost their time in math (Triton block-FP8 GEMMs and MHA-style MLA
    # prefill at large M) and in the fused MoE, not in streaming dense weights or KV
    hbm_eff, c_eff, p_eff = k.hbm_eff, k.compute_eff * ke, k.prefill_eff * ke
    eff = c_eff if chunk <= 0 else (c_eff * decodes * q + p_eff * chunk) / m
    peak_a = s.attn_peak or s.peak
    if s.fp8_gemm:
        # fp8 tensor cores at their share of the bf16 kernels' efficiency, never below what
        # the bf16 GEMM reaches at the same shape: the same math on a unit twice as fast
        eff *= max(k.fp8_gemm_share, peak_a / s.peak)
    act = m * s.hidden * 2 * ACTIVATION_PASSES * s.layers
    logits = decodes * q * s.vocab * 4 * LOGIT_PASSES
    _op(parts, s.dense_bytes + act + logits, m * s.dense_flops_per_token, s.hbm, hbm_eff,
        s.peak, eff)
    bytes_read = s.dense_bytes + act + logits
    flops = m * s.dense_flops_per_token
    if s.experts and s.moe_layers:
        t = m * s.moe_group if moe_tokens is None else moe_tokens
        eb = s.expert_bytes * touched_fraction(s.experts, s.topk, t)
        ef = _moe_flops(s, t)
        eb += _moe_slot_bytes(s, t)
        # V0's Triton fused-MoE (before tuned block-FP8 configs) streamed experts slowly too
        _op(parts, eb, ef, s.hbm, hbm_eff * k.moe_eff * ke, s.peak, eff * k.moe_eff)
        bytes_read += eb
        flops += ef
    if decodes > 0:
        kvb = decodes * kv_read_tokens(s, ctx) * s.kv_bytes_per_token
        af = decodes * q * _attn_span(s, ctx) * s.attn_decode_flops
        _op(parts, kvb, af, s.hbm, hbm_eff, peak_a, c_eff)
        bytes_read += kvb
        flops += af
    if chunk > 0:
        span = _attn_span(s, prefix + chunk / 2)
        kvb = kv_read_tokens(s, prefix + chunk) * s.kv_bytes_per_token
        af = chunk * span * s.attn_prefill_flops
        seq = prefix + chunk
        _op(parts, kvb, af, s.hbm, hbm_eff, peak_a, p_eff * seq / (seq + PREFILL_ATTN_HALF))
        bytes_read += kvb
        flops += af
    return Step(parts[0], parts[1], _collectives_s(s, m) + _floors_s(s), bytes_read, flops)


MOE_TILES = (16.0, 32.0, 64.0, 128.0)
"""Row tiles (BLOCK_SIZE_M) vLLM's fused-MoE kernel runs with."""


def moe_tile_rows(s: EngineShape, tokens: float) -> float:
    """Rows of one fused-MoE GEMM tile for `tokens` tokens entering the group: the smallest
    tile that holds the mean tokens per expert (tokens x top-k / experts). vLLM's tuned
    configs (model_executor/layers/fused_moe/configs/E=...,device_name=....json, from
    benchmarks/kernels/benchmark_moe.py) pick that tile: E=256 on H200, block fp8 (DeepSeek
    at TP8), keeps 16 rows up to 512 tokens (16 per expert) and 64 from 1,024; E=64 on H200
    bf16 moves 16 -> 32 -> 64 -> 128 at 64 / 128 / 256 / 512 tokens. moe_align_block_size
    pads every expert's tokens to whole tiles, and a tile does all its rows' math."""
    if not s.experts:
        return MOE_TILES[0]
    per_expert = tokens * s.topk / s.experts
    return next((t for t in MOE_TILES if t >= per_expert), MOE_TILES[-1])


def _moe_flops(s: EngineShape, tokens: float) -> float:
    """Math the stage's grouped GEMMs do for `tokens` tokens entering the MoE group, on one
    rank (its share of the experts): every routed slot's, plus each touched expert's padding
    of its last tile (half a tile on average, never more than the tile less its tokens): the
    grouped GEMM's efficiency, slots / padded rows, rises as tokens per expert grow."""
    if not s.experts:
        return 0.0
    useful = tokens * s.expert_flops_per_token / s.expert_shards
    touched = s.experts * touched_fraction(s.experts, s.topk, tokens)
    per_row = s.expert_flops_per_token / max(s.topk, 1) / s.expert_shards
    tile = moe_tile_rows(s, tokens)
    per_expert = tokens * s.topk / s.experts
    pad = min(tile / 2, max(tile - per_expert, 0.0))
    return useful + touched * pad * per_row


def _moe_slot_bytes(s: EngineShape, tokens: float) -> float:
    """Activation bytes the fused-MoE kernels of the stage move for `tokens` tokens entering
    the MoE group (MOE_SLOT_PASSES). The intermediate size comes from the expert FLOPs per
    slot (2 x 3 x hidden x I, gated MLP). Sliced experts (no EP) put every slot on every rank
    at I / shards; whole experts (EP) put 1 / shards of the slots on each rank at full I."""
    if not (s.topk and s.hidden and s.expert_flops_per_token):
        return 0.0
    inter = s.expert_flops_per_token / s.topk / (6.0 * s.hidden) / s.moe_layers
    slots = tokens * s.topk
    if s.expert_parallel:
        per_slot = (3.0 * s.hidden + 6.0 * inter) / s.expert_shards
    else:
        per_slot = 3.0 * s.hidden + 6.0 * inter / s.expert_shards
    return slots * per_slot * 2.0 * s.moe_layers


def _floors_s(s: EngineShape) -> float:
    """Per-layer floors; V0-era kernels (no torch.compile fusion, Triton fused-MoE before
    CUTLASS / DeepGEMM) launch more, slower kernels per layer: their floors stretch by the
    same v0_kernel_eff as their efficiencies."""
    k = s.constants
    ke = k.v0_kernel_eff if s.v0 else 1.0
    return (s.layers * k.layer_us + s.moe_layers * k.moe_layer_us) * 1e-6 / ke


def _collectives_s(s: EngineShape, m: float) -> float:
    """TP all-reduces (two per layer) and the MoE group's all-gather + reduce-scatter of every
    DP rank's hidden states (per MoE layer, with or without EP: `moe_group`)."""
    k = s.constants
    t = 0.0
    msg = m * s.hidden * 2  # bf16 hidden states
    if s.tp > 1:
        if s.cross_node_tp:  # a ring's 2 (n - 1) steps, each paying the network's latency
            lat, bw, eff = 2 * (s.tp - 1) * k.network_us * 1e-6, s.net_bw, 1.0
        elif s.link == "pcie":
            lat, bw, eff = k.nccl_us * 1e-6, s.link_bw, 1.0
        else:
            lat, bw, eff = k.allreduce_us * 1e-6, s.link_bw, k.link_eff
        t += 2 * s.layers * ring_allreduce_s(msg, s.tp, lat, bw, eff)
    if s.moe_group > 1 and s.moe_layers:
        ranks = s.tp * s.dp
        lat = ((ranks - 1) * k.network_us if s.cross_node_ep else k.nccl_us) * 1e-6
        bw, eff = (s.net_bw, 1.0) if s.cross_node_ep else (s.link_bw, k.link_eff)
        total = msg * s.dp  # every DP rank's hidden states, all-gathered then reduce-scattered
        t += 2 * s.moe_layers * gather_s(total, ranks, lat, bw, eff)
    return t


def step_s(s: EngineShape, decodes: float, ctx: float, chunk: float = 0.0,
           prefix: float = 0.0, moe_tokens: float | None = None) -> float:
    """Seconds of one engine step: every stage once (a token crosses all of them), the
    pipeline hops, a DP synchronisation when DP ranks run in lockstep (MoE), the host's
    per-step cost, and the MTP draft passes. With PP the batch splits into one micro-batch per
    stage, so a stage sees decodes / pp sequences."""
    k = s.constants
    micro = max(decodes / s.pp, min(decodes, 1.0)) if decodes > 0 else 0.0
    # a chunk rides in one micro-batch and crosses every stage: the pipeline runs at its pace
    st = stage_step(s, micro, ctx, chunk, prefix, moe_tokens)
    t = s.pp * st.total
    if s.pp > 1:
        m = micro * (1 + s.spec_tokens) + chunk
        lat = k.network_us * 1e-6 if s.cross_node_pp else k.allreduce_us * 1e-6
        t += (s.pp - 1) * send_s(m * s.hidden * 2, lat,
                                 s.net_bw if s.cross_node_pp else s.link_bw)
    if s.dp > 1 and s.experts:
        t += k.nccl_us * 1e-6  # DPMetadata: the ranks agree on the step's token counts
    t += (k.step_us + (k.v0_step_us if s.v0 else 0.0)) * 1e-6
    if s.draft is not None and s.spec_tokens and decodes > 0:
        t += draft_s(s, decodes, ctx)
        # per sequence: the 1 + k tokens it verifies and the k it drafts
        t += decodes * (1 + 2 * s.spec_tokens) * k.spec_seq_us * 1e-6
    return t


def draft_s(s: EngineShape, decodes: float, ctx: float) -> float:
    """The k draft passes of an MTP step: the first over every verified token (1 + k per
    sequence: the proposer's padded batch), the rest over one token per sequence
    (llm_base_proposer.propose), each with the draft layer's operators and a fixed cost."""
    d = s.draft
    if d is None or not s.spec_tokens:
        return 0.0
    k = s.constants
    d = d if d.constants is k else _with_constants(d, k)
    ep = s.moe_group
    total = 0.0
    first = dataclasses.replace(d, spec_tokens=s.spec_tokens)  # 1 + k queries per sequence
    for i in range(s.spec_tokens):
        layer = first if i == 0 else d
        tokens = decodes * (1 + layer.spec_tokens)
        # each sequence's KV is read once per pass, whatever its number of queries
        st = stage_step(layer, decodes, ctx, moe_tokens=tokens * ep)
        total += st.total + k.draft_pass_us * 1e-6
    return total


def _with_constants(d: EngineShape, k: Constants) -> EngineShape:
    return dataclasses.replace(d, constants=k)
