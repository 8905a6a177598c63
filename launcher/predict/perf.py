"""The performance model: how fast a layout serves a workload. Pure functions, no I/O.

A vLLM engine advances every running request by one token per step. One decode step on one GPU
costs the larger of two rooflines plus fixed costs:

- memory: the bytes the step reads - the dense weights of its shard, the routed experts the
  step's tokens touch (for DeepSeek 8 of 256 per token: E x (1 - (1 - k/E)^B) distinct experts
  at batch B; with DP+EP the experts see the tokens of every DP rank), and the KV cache of every
  running request at its current context - over HBM bandwidth x `bw_efficiency`;
- compute: 2 x active parameters x tokens plus attention over the context, over the GPU's dense
  peak (fp8 tensor cores when the weights are fp8 and the card has them) x `compute_efficiency`;
- fixed: per layer (kernel launches, norms, rotary, the MoE router and grouped-GEMM set-up), per
  TP all-reduce (two per layer), per EP all-to-all (two per MoE layer), per step (scheduler,
  sampler, Python), and link latency where a collective or a pipeline hop crosses nodes.
  Measured DeepSeek-R1 decode on 8xH200 is ~20-26 ms per token at batch 4 where the rooflines
  alone give ~4 ms: at small batches these fixed costs ARE the model.

Prefill is compute-bound: a prompt's tokens cost their FLOPs at `prefill_efficiency`. With
chunked prefill the chunks ride in decode steps, so every prompt adds its compute to the steps
of the requests already running. Staggered users meet the other prompts while decoding (TPOT)
and queue behind the prefill share of engine time (TTFT); benchmark clients with fixed lengths
move in waves, so half the other prompts land in TTFT and half in TPOT.
Closed-loop concurrency C then gives, by Little's law, C / (TTFT + (output - 1) x TPOT)
requests per second.

The constants are fitted once to public vLLM measurements (`bench/perf_bench.py` prints the fit
row by row against shared/validation/vllm-perf-observations.csv); every one applies to every
model and GPU. `vlaunch tune` refits the fixed and roofline scales for one engine from what it
measured (`Calibration`), and plans for that engine then say `source: measured`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from ..inputs.hardware import Hardware
from ..inputs.model import ModelSpec
from ..inputs.workload import SLO, Workload
from . import budget as B


@dataclass(frozen=True)
class Constants:
    """Efficiencies and fixed costs. Each starts from the physics named in its docstring; the
    values are the coordinate-descent fit of `bench/perf_fit.py` to the public rows, inside
    physically bounded ranges, rounded (the fit's output is printed there)."""

    bw_efficiency: float = 0.90
    """Share of peak HBM bandwidth a decode step's weight and KV reads reach. The Llama-3.1-8B
    ITL slope on H100 (4.37e-5 ms per context token for 128 KiB/token) is 3.0 TB/s of 3.35."""
    compute_efficiency: float = 0.25
    """Share of dense tensor peak reached by decode-batch GEMMs and attention."""
    prefill_efficiency: float = 0.34
    """Share of dense tensor peak reached by prefill (large GEMMs; vLLM's wide-EP DeepSeek
    prefill reaches ~7,000 tokens/s/H200, ~0.27 of fp8 peak with its attention)."""
    layer_us: float = 40.0
    """Fixed cost per layer per step: ~10-20 kernels at a few microseconds each, even under
    CUDA graphs (Llama-3.1-8B on H100 at batch 1: 6.4 ms where its weights read in 5.1 ms)."""
    moe_layer_us: float = 100.0
    """Extra fixed cost per MoE layer: router, top-k, token permutation, grouped-GEMM set-up."""
    allreduce_us: float = 45.0
    """Latency of one TP all-reduce over NVLink (two per layer), beyond its bytes."""
    network_us: float = 130.0
    """Latency of one collective or pipeline hop that crosses nodes (InfiniBand / RoCE)."""
    step_us: float = 775.0
    """Per engine step: scheduling, sampling, detokenisation hand-off, input preparation."""
    request_us: float = 49000.0
    """Per request before its first token: HTTP, tokenisation, engine hand-off, streaming out
    (Qwen3-8B on H100 at concurrency 1: 59 ms TTFT for a 233-token prompt of ~10 ms compute)."""
    gemm_m_half: float = 64.0
    """Rows (tokens) at which a GEMM reaches half its large-batch efficiency: thin GEMMs waste
    tensor-core tiles. MoE experts see batch x k / E tokens each, so a TP-split expert at batch
    1,000 runs at 31 rows, far from peak, while the same experts under EP see the DP ranks'
    tokens together."""
    pcie_factor: float = 3.0
    """All-reduce latency multiplier without NVLink (PCIe peer-to-peer through the host)."""


DEFAULT = Constants()

# ----------------------------------------------------------------------------- engine shape


MAX_RHO = 0.95
"""Cap on the prefill share of engine time in the staggered TTFT queueing term."""


@dataclass(frozen=True)
class EngineShape:
    """What one step costs on the limiting GPU of one engine (a DP rank), from model + layout."""

    tp: int
    pp: int
    dp: int
    expert_parallel: bool
    layers: int  # per pipeline stage
    moe_layers: int  # per pipeline stage
    experts: int
    topk: int
    hidden: int
    dense_bytes: float  # non-expert weights one GPU reads per step
    expert_bytes: float  # routed-expert weights one GPU holds
    dense_flops_per_token: float  # non-expert matmul FLOPs per token on one GPU
    expert_flops_per_token: float  # routed-expert matmul FLOPs per token on one GPU
    attn_decode_flops: float  # per token per context position on one GPU
    attn_prefill_flops: float  # per token per context position on one GPU (causal, unabsorbed)
    kv_bytes_per_token: int  # per GPU, all layers of the stage
    hbm: float  # bytes/s
    peak: float  # FLOP/s
    link_latency_s: float  # one all-reduce
    link_bw: float  # bytes/s for collectives
    cross_node_tp: bool
    cross_node_pp: bool
    cross_node_ep: bool
    max_num_seqs: int  # per engine
    max_num_batched_tokens: int
    kv_tokens: int  # per engine
    chunked_prefill: bool
    constants: Constants = DEFAULT
    gemm_scale: float = 1.0
    # Speculative decoding (launcher/predict/speculative.py): draft tokens verified per step,
    # output tokens a step yields on average, and the draft model's own step shape.
    spec_tokens: int = 0
    spec_yield: float = 1.0
    draft: EngineShape | None = None


def _active_counts(spec: ModelSpec) -> tuple[float, float]:
    """(dense matmul params, routed-expert params) of the loaded model."""
    dense = experts = 0.0
    for t in spec.tensors:
        if not t.loaded or t.part in ("embed", "vision") or t.cols == 1:
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
        if not t.loaded or t.part in ("embed", "vision"):
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


def _attn_dims(spec: ModelSpec) -> tuple[float, float]:
    """FLOPs per token per context position per layer, all heads: (decode, prefill)."""
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


def engine_shape(spec: ModelSpec, hw: Hardware, layout: B.Layout, kv_bytes_per_token: int,
                 kv_tokens: int, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool, constants: Constants = DEFAULT,
                 gemm_scale: float = 1.0) -> EngineShape | None:
    """The step-cost inputs of one engine; None when the catalog has no speed facts for the GPU
    (a card given only by size): then no performance is claimed. `gemm_scale` slows the GEMMs
    of a vLLM release whose kernels for this weight format were slower (capabilities.yaml)."""
    kind = hw.kind
    if not kind.hbm_gbps or not kind.bf16_tflops:
        return None
    if kind.gemm_m_half:
        constants = dataclasses.replace(constants, gemm_m_half=kind.gemm_m_half)
    fp8_weights = spec.quant.method.startswith("fp8")
    tflops = kind.fp8_tflops if fp8_weights and kind.fp8_tflops else kind.bf16_tflops
    dense_p, expert_p = B.memo("active", spec, B.Layout(), lambda: _active_counts(spec))
    topk = spec.experts_per_token if spec.is_moe else 0
    active = dense_p + (expert_p * topk / spec.num_experts if spec.is_moe else 0.0)
    gpus = layout.tp * layout.pp
    dense_b, expert_b = _bytes_per_rank(spec, layout)
    dec, pre = _attn_dims(spec)
    layers_stage = max(len(r) for r in B.pp_stages(spec.num_layers, layout.pp))
    per_node = hw.gpus_per_node
    if kind.nvlink_gbps and kind.nvlink:
        link_lat, link_bw = constants.allreduce_us * 1e-6, kind.nvlink_gbps * 1e9
    else:
        link_lat, link_bw = constants.allreduce_us * constants.pcie_factor * 1e-6, 25e9
    return EngineShape(
        tp=layout.tp, pp=layout.pp, dp=layout.dp, expert_parallel=layout.expert_parallel,
        layers=layers_stage, moe_layers=math.ceil(_moe_layers(spec) / layout.pp),
        experts=spec.num_experts, topk=topk, hidden=spec.hidden_size,
        dense_bytes=dense_b / layout.pp, expert_bytes=expert_b / layout.pp,
        dense_flops_per_token=2.0 * dense_p / gpus,
        expert_flops_per_token=2.0 * (active - dense_p) / gpus,
        attn_decode_flops=dec * layers_stage / layout.tp,
        attn_prefill_flops=pre * layers_stage / layout.tp,
        kv_bytes_per_token=kv_bytes_per_token, hbm=kind.hbm_gbps * 1e9, peak=tflops * 1e12,
        link_latency_s=link_lat, link_bw=link_bw,
        cross_node_tp=layout.tp > per_node, cross_node_pp=layout.pp > 1 and layout.nodes > 1,
        cross_node_ep=layout.expert_parallel and layout.tp * layout.dp > per_node,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        kv_tokens=kv_tokens, chunked_prefill=chunked_prefill, constants=constants,
        gemm_scale=gemm_scale)


# ----------------------------------------------------------------------------- step costs


def touched_fraction(experts: int, topk: int, tokens: float) -> float:
    """Expected share of routed experts that `tokens` tokens touch (uniform routing)."""
    if not experts:
        return 0.0
    return 1.0 - (1.0 - topk / experts) ** max(tokens, 0.0)


def _fixed_s(s: EngineShape, tokens: float) -> float:
    """Latency floor of one step on one stage, whatever its size."""
    k = s.constants
    t = s.layers * k.layer_us * 1e-6 + s.moe_layers * k.moe_layer_us * 1e-6
    if s.tp > 1:
        lat = k.network_us * 1e-6 if s.cross_node_tp else s.link_latency_s
        size = tokens * s.hidden * 2 * 2 * (s.tp - 1) / s.tp  # bf16 ring all-reduce
        t += 2 * s.layers * (lat + size / s.link_bw)
    if s.expert_parallel and s.dp > 1:
        lat = k.network_us * 1e-6 if s.cross_node_ep else s.link_latency_s
        size = tokens * max(s.topk, 1) * s.hidden * 3  # fp8 dispatch + bf16 combine
        t += 2 * s.moe_layers * lat + s.moe_layers * size / s.link_bw
    return t


def gemm_seconds(s: EngineShape, flops: float, rows: float, efficiency: float) -> float:
    """Seconds for `flops` of GEMMs whose M dimension is `rows` tokens."""
    if flops <= 0:
        return 0.0
    eff = efficiency * s.gemm_scale * rows / (rows + s.constants.gemm_m_half)
    return flops / (s.peak * max(eff, 1e-6))


def matmul_seconds(s: EngineShape, tokens: float, moe_tokens: float, efficiency: float) -> float:
    """Dense layers at M = tokens; each touched expert at M = its share of the MoE's tokens."""
    t = gemm_seconds(s, tokens * s.dense_flops_per_token, tokens, efficiency)
    if s.experts:
        touched = max(touched_fraction(s.experts, s.topk, moe_tokens) * s.experts, 1.0)
        t += gemm_seconds(s, tokens * s.expert_flops_per_token, moe_tokens * s.topk / touched,
                          efficiency)
    return t


def step_parts(s: EngineShape, tokens: float, ctx_tokens: float, moe_tokens: float,
               attn_flops: float) -> tuple[float, float, float]:
    """(fixed, memory, compute) seconds of one step of one stage: `tokens` new tokens whose
    attention spans `ctx_tokens` cached tokens in all; experts see `moe_tokens` tokens."""
    k = s.constants
    read = (s.dense_bytes + s.expert_bytes * touched_fraction(s.experts, s.topk, moe_tokens)
            + ctx_tokens * s.kv_bytes_per_token)
    mem = read / (s.hbm * k.bw_efficiency)
    comp = (matmul_seconds(s, tokens, moe_tokens, k.compute_efficiency)
            + attn_flops / (s.peak * k.compute_efficiency))
    return _fixed_s(s, tokens), mem, comp


def decode_step_s(s: EngineShape, batch: float, ctx: float) -> float:
    """Seconds for every one of `batch` running requests (context `ctx`) to gain one token.
    With PP the batch is split into one micro-batch per stage and a token crosses all stages.
    With speculative decoding a step verifies 1 + spec_tokens tokens per request (the KV is read
    once, the matmuls and attention see every query), the draft runs its own passes, and the
    step yields spec_yield tokens on average: the time per token is the step over the yield."""
    k = s.constants
    b = max(batch, 1e-9)
    micro = max(b / s.pp, min(b, 1.0))  # a request is never split across micro-batches
    q = 1 + s.spec_tokens  # a speculative step verifies q tokens per request
    moe = micro * q * (s.dp if s.expert_parallel else 1)
    fixed, mem, comp = step_parts(s, micro * q, micro * ctx, moe,
                                  micro * q * ctx * s.attn_decode_flops)
    stage = fixed + max(mem, comp)
    hops = (s.pp - 1) * (k.network_us * 1e-6 if s.cross_node_pp else s.link_latency_s)
    step = s.pp * stage + hops + k.step_us * 1e-6
    if s.draft is not None and s.spec_tokens:
        from .speculative import draft_seconds

        step += draft_seconds(s, b, ctx)
    return step / s.spec_yield


def prefill_compute_s(s: EngineShape, tokens: float) -> float:
    """Compute seconds of a `tokens`-token prompt (causal attention over half of it on average),
    summed over the stages: what the prompt adds to the steps it rides in."""
    k = s.constants
    moe = tokens * (s.dp if s.expert_parallel else 1)
    attn = tokens * tokens / 2 * s.attn_prefill_flops / (s.peak * k.prefill_efficiency)
    return s.pp * (matmul_seconds(s, tokens, moe, k.prefill_efficiency) + attn)


def prefill_step_s(s: EngineShape, chunk: float, running: float, ctx: float) -> float:
    """One step that carries a `chunk`-token prompt piece beside `running` decodes."""
    k = s.constants
    fixed, mem, _ = step_parts(s, chunk + running, running * ctx,
                               (chunk + running) * (s.dp if s.expert_parallel else 1), 0.0)
    comp = prefill_compute_s(s, chunk) / s.pp + matmul_seconds(
        s, running, running * (s.dp if s.expert_parallel else 1), k.compute_efficiency)
    return s.pp * (fixed + max(mem, comp)) + k.step_us * 1e-6


# ----------------------------------------------------------------------------- operating points


@dataclass(frozen=True)
class Point:
    """The deployment at `concurrency` requests in flight (all DP engines together)."""

    concurrency: float
    tpot_ms: float
    ttft_ms: float
    output_tokens_per_s: float
    requests_per_s: float
    running: float  # per engine, actually decoding
    limit: str  # what caps `running`: none | max_num_seqs | kv_cache
    compute_bound: bool

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": round(self.concurrency, 2), "tpot_ms": round(self.tpot_ms, 2),
                "ttft_ms": round(self.ttft_ms, 1),
                "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                "requests_per_s": round(self.requests_per_s, 3)}


def running_limit(s: EngineShape, w: Workload) -> tuple[float, str]:
    """How many requests one engine decodes at once: max_num_seqs, or the KV cache."""
    # Requests are admitted while blocks are free, then grow; once the cache is full vLLM
    # preempts, so what stays running is what fits at full length.
    full = w.input_len + w.output_len
    kv = s.kv_tokens / full if full else float("inf")
    if kv < s.max_num_seqs:
        return max(kv, 1.0), "kv_cache"
    return float(s.max_num_seqs), "max_num_seqs"


def point(s: EngineShape, w: Workload, concurrency: float) -> Point:
    """Closed loop: `concurrency` clients, each sending its next request when one completes."""
    per_engine = max(concurrency, 1e-9) / s.dp
    cap, why = running_limit(s, w)
    b = min(per_engine, cap)
    ctx = w.input_len + w.output_len / 2
    t_dec = decode_step_s(s, b, ctx)
    steps = max(w.output_len - 1, 1)
    if s.chunked_prefill:
        prefill_add = prefill_compute_s(s, w.input_len)
        budget = max(s.max_num_batched_tokens - b, 1)
        chunks = math.ceil(w.input_len / budget)
        chunk = w.input_len / chunks
        own = chunks * prefill_step_s(s, chunk, b, ctx)
    else:  # a whole prompt is its own step (V0, MLA on the CPU backend)
        own = prefill_step_s(s, w.input_len, 0, 0)
        prefill_add = own
    # Every request's E2E carries the other b - 1 prompts it shares the engine with:
    # own + (b - 1) x prefill + (O - 1) x decode step. Staggered users (random arrivals) meet
    # them while decoding (TPOT) and wait only behind the prefill share of engine time (rho) for
    # their first token. Synchronized clients (fixed lengths, started together: benchmarks)
    # move in waves: half the wave's prompts before the first token (TTFT), half in decode.
    others = max(b - 1, 0) * prefill_add
    request = s.constants.request_us * 1e-6
    if w.synchronized:
        tpot = t_dec + others / 2 / steps
        ttft = own + others / 2 + t_dec / 2 + request
    else:
        tpot = t_dec + others / steps
        cycle = steps * t_dec + b * prefill_add  # engine time in which b requests complete
        rho = min(b * prefill_add / cycle, MAX_RHO) if cycle else 0.0
        ttft = own / (1 - rho) + t_dec / 2 + request
    e2e = ttft + steps * tpot
    rate = b / e2e  # requests per second one engine completes while saturated
    if per_engine > b:  # the rest wait for a slot: Little's law on the closed loop
        ttft += (per_engine - b) / rate
        e2e = ttft + steps * tpot
    rps = per_engine / e2e * s.dp
    _, mem, comp = step_parts(s, b, b * ctx, b, b * ctx * s.attn_decode_flops)
    return Point(concurrency, tpot * 1e3, ttft * 1e3, rps * w.output_len, rps, b,
                 why if per_engine >= cap else "none", comp > mem)


def open_loop_rate(s: EngineShape, w: Workload, knee_concurrency: float) -> float:
    """Requests/s of Poisson arrivals the engine takes within the SLO.

    Closed-loop clients never arrive together; Poisson arrivals do. With requests in flight
    C = rate x E2E (Little), random arrivals push the in-flight count about sqrt(C) above its
    mean (square-root staffing, Halfin-Whitt), so the SLO holds while C + sqrt(C) <= the
    closed-loop knee K: C = ((sqrt(4K + 1) - 1) / 2)^2, at that C's rate."""
    if knee_concurrency <= 0:
        return 0.0
    c = ((math.sqrt(4 * knee_concurrency + 1) - 1) / 2) ** 2
    return point(s, w, max(c, 1e-6)).requests_per_s if c >= 1 else 0.0


def max_running(s: EngineShape, w: Workload) -> float:
    """Requests the whole deployment decodes at once at its limits."""
    return running_limit(s, w)[0] * s.dp


def knee(s: EngineShape, w: Workload, slo: SLO) -> Point | None:
    """The largest whole concurrency that still meets the SLO; None if even 1 misses it.
    TTFT and TPOT never fall as concurrency rises, so a bisection finds it."""
    if not _meets(point(s, w, 1), slo):
        return None
    lo, hi = 1, max(2, int(max_running(s, w) * 2))
    if _meets(point(s, w, hi), slo):
        return point(s, w, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _meets(point(s, w, mid), slo):
            lo = mid
        else:
            hi = mid
    return point(s, w, lo)


def _meets(p: Point, slo: SLO) -> bool:
    return slo.met(p.ttft_ms, p.tpot_ms)


def curve(s: EngineShape, w: Workload, extra: tuple[float, ...] = ()) -> list[Point]:
    """Concurrency 1, 2, 4, ... to twice the running limit, plus `extra` levels."""
    top = max(2.0, max_running(s, w) * 2)
    levels = {float(2 ** i) for i in range(0, int(math.log2(top)) + 1)}
    levels |= {float(x) for x in extra if x and x > 0}
    return [point(s, w, c) for c in sorted(levels)]


def binding(s: EngineShape, w: Workload, k: Point | None, slo: SLO) -> str:
    """What stops the deployment at its knee: the SLO (decode compute or memory), the KV cache,
    or max_num_seqs."""
    if k is None:
        return "slo"
    if k.limit == "kv_cache":
        return "kv_cache"
    if k.limit == "max_num_seqs":
        return "max_num_seqs"
    nxt = point(s, w, k.concurrency + 1)
    which = "tpot" if nxt.tpot_ms > slo.tpot_ms else "ttft"
    return f"slo_{which}" + ("_compute" if nxt.compute_bound else "")


# ----------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    """Scales refitted from one engine's measured points (`vlaunch tune`): fixed costs, decode
    rooflines, prefill and the per-request overhead before the first token, each a multiplier
    on the time it models (1.0: as the model says)."""

    fixed_scale: float
    roofline_scale: float
    points: int
    median_error: float
    prefill_scale: float = 1.0
    request_scale: float = 1.0
    uncalibrated_error: float = 0.0
    """The same median |error| of output tokens/s with every scale at 1.0 (reported beside it;
    the fit minimises `loss`, so this one figure may move either way)."""
    loss: float = 0.0
    """The fit's objective at the fitted scales: weighted RMS of the log errors."""
    loss_uncalibrated: float = 0.0
    """The same objective with every scale at 1.0: the fit may never be worse than no fit."""


def scaled(c: Constants, cal: Calibration) -> Constants:
    """Constants with each group of costs scaled by a calibration (a time scale s divides an
    efficiency by s and multiplies a fixed cost by s)."""
    f, r, p = cal.fixed_scale, cal.roofline_scale, cal.prefill_scale
    return dataclasses.replace(
        c, layer_us=c.layer_us * f, moe_layer_us=c.moe_layer_us * f,
        allreduce_us=c.allreduce_us * f, network_us=c.network_us * f, step_us=c.step_us * f,
        bw_efficiency=c.bw_efficiency / r, compute_efficiency=c.compute_efficiency / r,
        prefill_efficiency=c.prefill_efficiency / p,
        request_us=c.request_us * cal.request_scale)


CAL_GRID = tuple(2.0 ** i for i in range(-8, 9))
"""Scales tried: 1/256 to 256 in steps of 2 (the loss has separate valleys: prefill and decode
trade against each other), every combination of the first three, then refined one at a time."""


def calibrate(s: EngineShape, measured: list[dict[str, Any]]) -> Calibration | None:
    """Fit the fixed, decode, prefill and per-request scales that best predict measured output
    tokens/s (weighted double: capacity and goodput rest on it), TPOT and TTFT (half weight),
    in log space: a grid over the first three, then coordinate refinement of all four. Each
    point is replayed on its own engine limits (max_num_seqs, max_num_batched_tokens)."""
    pts = [m for m in measured if m.get("output_tokens_per_s") and m.get("concurrency")
           and m.get("input_len") and m.get("output_len")]
    if not pts:
        return None
    engines = []
    for m in pts:
        # tune measures with vLLM's benchmark on fixed lengths: synchronized clients
        w = Workload(int(m["input_len"]), int(m["output_len"]),
                     synchronized=bool(m.get("synchronized", True)))
        engines.append((m, w,
                        dataclasses.replace(
                            s, max_num_seqs=int(m.get("max_num_seqs") or s.max_num_seqs),
                            max_num_batched_tokens=int(m.get("max_num_batched_tokens")
                                                       or s.max_num_batched_tokens))))

    def errors(x: tuple[float, ...]) -> list[tuple[float, float, float]]:
        k = scaled(s.constants, Calibration(x[0], x[1], 0, 0, x[2], x[3]))
        out = []
        for m, w, engine in engines:
            p = point(dataclasses.replace(engine, constants=k), w, float(m["concurrency"]))
            out.append((math.log(p.output_tokens_per_s / m["output_tokens_per_s"]),
                        math.log(p.tpot_ms / m["tpot_ms"]) if m.get("tpot_ms") else 0.0,
                        math.log(p.ttft_ms / m["ttft_ms"]) if m.get("ttft_ms") else 0.0))
        return out

    def loss(x: tuple[float, ...]) -> float:
        return sum(2 * a * a + b * b + 0.5 * c * c for a, b, c in errors(x))

    best: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    best_loss = loss(best)
    for x3 in itertools.product(CAL_GRID, repeat=3):
        x = (*x3, 1.0)
        value = loss(x)
        if value < best_loss:
            best, best_loss = x, value
    for steps in (CAL_GRID, None, None):
        for i in range(4):
            values = steps or [min(max(best[i] * 2 ** (j / 8), CAL_GRID[0]), CAL_GRID[-1])
                               for j in range(-8, 9)]
            for v in values:
                x = tuple(v if k == i else best[k] for k in range(4))
                value = loss(x)
                if value < best_loss:
                    best, best_loss = x, value
    def median_tput(x: tuple[float, ...]) -> float:
        tput = sorted(abs(math.expm1(a)) for a, _, _ in errors(x))
        return tput[len(tput) // 2]

    def rms(x: tuple[float, ...]) -> float:
        return math.sqrt(loss(x) / (3.5 * len(pts)))

    unit = (1.0, 1.0, 1.0, 1.0)
    return Calibration(best[0], best[1], len(pts), median_tput(best), best[2], best[3],
                       median_tput(unit), rms(best), rms(unit))
