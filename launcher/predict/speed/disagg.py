"""Prefill/decode disaggregation as performance: rate matching, the KV hand-off, TTFT. Pure.

A disaggregated deployment is a prefill pool and a decode pool (xPyD: x prefill replicas, y
decode replicas). Each pool is an engine the step model already times (`request_model.py`,
`step.py`);
this module only composes them:

- **Prefill rate.** A prefill engine only prefills: a prompt of L tokens rides in its own chunks
  (`perf.prompt_s` beside no decodes); prompts shorter than the token budget share a step. With
  DP, every rank prefills its own prompts. The pool sustains x times that.
- **Decode rate.** A decode engine receives the KV and only decodes: the largest running batch
  whose step meets the TPOT SLO (no prefill interference, the point of splitting), capped by
  max-num-seqs and the KV cache at full length, over the output's steps (Little's law).
- **Rate matching** (NVIDIA aiconfigurator, `picking.py`; Dynamo's planner): the deployment's
  requests/s is min(x P 0.9, y D 0.92). 0.9 stands for the prefill pool's pipeline bubbles
  (prompts do not arrive exactly as a step frees) and 0.92 for a decode batch never kept at its
  last slot; we keep aiconfigurator's values, its authors' measured de-rating, rather than
  fitting our own to no data. The xPyD unit is the (x, y) with the most requests/s per GPU,
  counting every GPU of both pools; ties go to fewer GPUs.
- **TTFT** = the wait for a prefill engine (M/D/1 at the pool's load: rho / (2 (1 - rho)) of a
  prompt's service time) + the prompt's prefill + the KV hand-off + decode's first step.
- **The hand-off** moves the prompt's KV (bytes per token per GPU of the prefill layout, so each
  rank sends its own share in parallel; MLA keeps the whole latent on every TP rank) over
  NVLink inside a node, or the RDMA NIC of each GPU across nodes, at the link efficiency of the
  collectives, plus one network latency per transfer (`step.Constants.network_us` across nodes,
  `nccl_us` inside one: the same hops the collectives pay). NIXL's handshake (~5 s per
  prefill-decode pair, made lazily on the first request: llm-d docs/operations/disaggregation/
  vllm.md) is a one-time cost, reported beside TTFT, not in it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ...inputs.hardware import Hardware
from ...inputs.workload import SLO, Workload
from .request_model import EngineShape, decode_step_s, prompt_s, running_limit

PREFILL_DERATE = 0.9
"""aiconfigurator picking.py: seq/s = min(P * nP * 0.9, ...): 'pipeline bubble'."""
DECODE_DERATE = 0.92
"""aiconfigurator picking.py: '... D * nD * 0.92)': 'not saturating the batchsize slot'."""
NIXL_HANDSHAKE_S = 5.0
"""NIXL's metadata handshake per prefill-decode pair, once (llm-d vllm.md: '~5 s')."""
MAX_REPLICAS = 16
"""Largest x or y the xPyD unit search tries: beyond it a unit is a fleet, capacity's job."""
MAX_RHO = 0.95


@dataclass(frozen=True)
class Transfer:
    """The KV hand-off of one prompt."""

    bytes_per_gpu: float
    path: str  # nvlink | xgmi | pcie inside a node, rdma across nodes
    seconds: float
    handshake_s: float


@dataclass(frozen=True)
class PrefillPool:
    requests_per_s: float  # one replica, not de-rated
    prompt_s: float  # one prompt alone, the TTFT's prefill term
    gpus: int


@dataclass(frozen=True)
class DecodePool:
    requests_per_s: float  # one replica, not de-rated
    running: float  # per DP engine, at the TPOT SLO
    tpot_ms: float
    first_step_s: float
    gpus: int


@dataclass(frozen=True)
class Split:
    """One xPyD deployment's figures (all GPUs of both pools counted per GPU)."""

    prefill_replicas: int
    decode_replicas: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    gpus: int
    bound: str  # prefill | decode: the side the other was sized to; ttft: the load the SLO allows
    transfer: Transfer

    @property
    def output_tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.gpus


def prefill_pool(s: EngineShape, w: Workload) -> PrefillPool:
    """What one prefill replica sustains at the workload's prompt length."""
    own, _ = prompt_s(s, w.input_len, 0.0, 0.0)
    per_step = max(1, int(s.max_num_batched_tokens // max(w.input_len, 1))) \
        if s.chunked_prefill and w.input_len < s.max_num_batched_tokens else 1
    if per_step > 1:  # short prompts share a step: k prompts in one step of k x L tokens
        shared, _ = prompt_s(s, per_step * w.input_len, 0.0, 0.0)
        rate = per_step / shared
    else:
        rate = 1.0 / own if own > 0 else 0.0
    return PrefillPool(rate * s.dp, own, s.tp * s.pp * s.dp)


def decode_pool(s: EngineShape, w: Workload, slo: SLO) -> DecodePool | None:
    """What one decode replica sustains within the TPOT SLO; None if one request misses it."""
    ctx = w.input_len + w.output_len / 2
    cap, _ = running_limit(s, w)

    def tpot(b: float) -> float:
        return decode_step_s(s, b, ctx) * 1e3

    if tpot(1.0) > slo.tpot_ms:
        return None
    lo, hi = 1, max(1, int(cap))
    if tpot(hi) <= slo.tpot_ms:
        lo = hi
    while hi - lo > 1:  # TPOT never falls as the batch grows: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tpot(mid) <= slo.tpot_ms else (lo, mid)
    t = tpot(lo)
    steps = max(w.output_len - 1, 1)
    rate = lo / (steps * t / 1e3) * s.dp
    first = decode_step_s(s, lo, w.input_len) * s.spec_yield
    return DecodePool(rate, float(lo), t, first, s.tp * s.pp * s.dp)


def transfer(pre: EngineShape, w: Workload, same_node: bool, connector: str) -> Transfer:
    """The prompt's KV from the prefill ranks to the decode ranks."""
    k = pre.constants
    per_gpu = pre.kv_bytes_per_token * w.input_len
    if same_node:  # NVLink / Infinity Fabric, or PCIe where the node has neither
        path, bw, lat = pre.link, pre.link_bw * k.link_eff, k.nccl_us * 1e-6
    else:
        path, bw, lat = "rdma", pre.net_bw * k.link_eff, k.network_us * 1e-6
    seconds = per_gpu / bw + lat if bw > 0 else 0.0
    handshake = NIXL_HANDSHAKE_S if connector == "NixlConnector" else 0.0
    return Transfer(per_gpu, path, seconds, handshake)


def _wait_s(rate: float, capacity: float, service_s: float) -> float:
    """M/D/1 wait for a prefill engine at `rate` of `capacity` requests/s."""
    if capacity <= 0:
        return math.inf
    rho = min(rate / capacity, MAX_RHO)
    return rho / (2 * (1 - rho)) * service_s


def split(p: PrefillPool, d: DecodePool, w: Workload, xfer: Transfer, x: int, y: int,
          ttft_slo_ms: float | None = None) -> Split:
    """The figures of x prefill and y decode replicas. With `ttft_slo_ms`, a load whose prefill
    queue would break the TTFT SLO is lowered to the largest that keeps it (bound `ttft`):
    the deployment is run where it meets the SLO, as the aggregated knee is. M/D/1: the wait
    rho / (2 (1 - rho)) s_p stays within the budget B = SLO - (s_p + hand-off + first step)
    for rho <= 2 B / (s_p + 2 B)."""
    p_rate, d_rate = x * p.requests_per_s * PREFILL_DERATE, y * d.requests_per_s * DECODE_DERATE
    rate = min(p_rate, d_rate)
    bound = "prefill" if p_rate <= d_rate else "decode"
    fixed = p.prompt_s + xfer.seconds + d.first_step_s
    wait = _wait_s(rate, x * p.requests_per_s, p.prompt_s)
    if ttft_slo_ms is not None and (wait + fixed) * 1e3 > ttft_slo_ms:
        budget = ttft_slo_ms / 1e3 - fixed
        if budget > 0:
            rho = 2 * budget / (p.prompt_s + 2 * budget) * (1 - 1e-9)  # within, not on it
            rate = min(rate, rho * x * p.requests_per_s)
            wait, bound = _wait_s(rate, x * p.requests_per_s, p.prompt_s), "ttft"
    ttft = wait + fixed
    return Split(x, y, rate, rate * w.output_len, ttft * 1e3, d.tpot_ms,
                 x * p.gpus + y * d.gpus, bound, xfer)


def best_split(p: PrefillPool, d: DecodePool, w: Workload, slo: SLO, xfer: Transfer,
               max_gpus: int | None = None) -> Split | None:
    """The xPyD unit with the most requests/s per GPU that meets the TTFT SLO (each at the
    largest load that meets it)."""
    best: Split | None = None
    for x in range(1, MAX_REPLICAS + 1):
        for y in range(1, MAX_REPLICAS + 1):
            sp = split(p, d, w, xfer, x, y, slo.ttft_ms)
            if max_gpus is not None and sp.gpus > max_gpus:
                continue
            if not slo.met(sp.ttft_ms, sp.tpot_ms):
                continue
            key = (sp.requests_per_s / sp.gpus, -sp.gpus)
            if best is None or key > (best.requests_per_s / best.gpus, -best.gpus):
                best = sp
    return best


def pool_hardware(hw: Hardware) -> Hardware:
    """One pool's share of `hw` when a prefill and a decode pool split it evenly: half the
    nodes, or half of one node's GPUs; on the CPU engine, half the host's memory (both engines
    allocate their KV cache from it)."""
    if hw.is_cpu:
        return dataclasses.replace(hw, total_bytes=hw.total_bytes // 2,
                                   free_bytes=hw.free_bytes // 2)
    if hw.nodes > 1:
        return dataclasses.replace(hw, nodes=hw.nodes // 2)
    return dataclasses.replace(hw, gpus_per_node=max(1, hw.gpus_per_node // 2))
