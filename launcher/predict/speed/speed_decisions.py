"""Decisions by speed: the performance model applied to the planner's candidates.

The budget model says which layouts fit; this module says how fast each one serves the workload
and ranks them by the user's objective:

- balanced (default): the most output tokens/s at the SLO knee (per GPU: the same GPUs here),
  and max_num_seqs capped at the knee so overload queues instead of breaking the SLO;
- throughput: the same ranking, max_num_seqs left at vLLM's limit (overload raises tokens/s
  and latency together - for batch work);
- latency: the lowest TPOT for a single request, ties to throughput.

It also picks max_num_batched_tokens (the largest chunk whose mixed step still meets the TPOT
SLO) and reads calibrations that `vlaunch tune` recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...deployment import plan as D
from ...deployment.notes import note
from ...deployment.plan import Reason
from ...inputs.hardware import Hardware
from ...inputs.model import ModelSpec
from ...inputs.workload import SLO, Workload
from . import calibration
from . import request_model as perf

FP8_MARGIN = 0.10
"""fp8 KV is chosen for speed only when it raises the objective's figure by at least this much:
it halves KV bytes but, without calibrated scales, can cost accuracy."""

CHUNK_CHOICES = (2048, 4096, 8192, 16384)


@dataclass
class Assessment:
    """One candidate's predicted service: its knee under the SLO and its curve."""

    shape: perf.EngineShape
    knee: perf.OperatingPoint | None
    at: perf.OperatingPoint
    curve: list[perf.OperatingPoint]
    binding: str
    single: perf.OperatingPoint  # one request alone: the latency objective's figure
    source: str = "model"
    notes: list[Reason] = field(default_factory=list)  # deployment/notes.py PERFORMANCE_CODES
    candidate: Any = None  # the planner's Candidate this assesses
    client: str = "closed-loop"  # the client `at` assumes (perf.CLIENTS); the knee's: closed-loop

    def score(self, objective: str, gpus: int) -> float:
        """Higher is better."""
        if objective == "latency":
            return -self.single.tpot_ms
        if self.knee is None:  # the SLO is out of reach: closer is better, below any that meet
            return -1e9 - self.single.tpot_ms
        return self.knee.output_tokens_per_s / gpus


def _constants_for(spec: ModelSpec, hw: Hardware, cand: Any, version: str
                   ) -> tuple[perf.Constants, str, list[Reason]]:
    """The model's constants, or those refitted from `vlaunch tune`'s measurements."""
    k = calibration.key(spec.name, hw.kind.name, hw.count, cand.layout.tp, cand.layout.pp,
                        cand.layout.dp, cand.layout.expert_parallel, cand.kv_dtype, version)
    entry = calibration.lookup(k)
    source = "measured"
    if entry is None:
        hit = calibration.lookup_family(calibration.family(spec.name, hw.kind.name, version))
        if hit is None:
            return perf.DEFAULT, "model", []
        entry, source = hit[1], "model"
    cal = perf.Calibration(entry["fixed_scale"], entry["roofline_scale"],
                           len(entry.get("points", [])), entry.get("median_error", 0.0),
                           entry.get("prefill_scale", 1.0), entry.get("request_scale", 1.0))
    why = note("performance.calibrated", points=cal.points,
               scope="engine" if source == "measured" else "layout",
               recorded_at=str(entry.get("recorded_at", "?")),
               median_error=round(cal.median_error, 4))
    return perf.scaled(perf.DEFAULT, cal), source, [why]


def assess(spec: ModelSpec, hw: Hardware, cand: Any, traits: Any, chunked: bool,
           workload: Workload, slo: SLO, concurrency: int | None = None) -> Assessment | None:
    """Predict `cand`'s service; None when the GPU has no speed facts or it does not fit."""
    if not cand.fits:
        return None
    constants, source, notes = _constants_for(spec, hw, cand, traits.version)
    shape = perf.engine_shape(spec, hw, cand.layout, cand.kv_bytes_per_token, cand.tokens,
                              cand.max_num_seqs, cand.max_num_batched_tokens, chunked,
                              constants, v0=traits.engine == "v0")
    if shape is None:
        return None
    return assessment_for(shape, workload, slo, concurrency, source, notes, cand)


def assessment_for(shape: perf.EngineShape, workload: Workload, slo: SLO,
                   concurrency: int | None, source: str, notes: list[Reason],
                   cand: Any) -> Assessment:
    """The knee, the operating point, the curve and the binding limit of one engine shape."""
    knee = perf.knee(shape, workload, slo)
    # --concurrency N predicts what `vllm bench serve --max-concurrency N` measures on these
    # fixed lengths (synchronised clients); the knee is users under the SLO (closed loop)
    at = perf.bench_point(shape, workload, concurrency) if concurrency else (
        knee or perf.point(shape, workload, 1))
    extra = tuple(x for x in (knee.concurrency if knee else None, concurrency) if x)
    return Assessment(shape, knee, at, perf.curve(shape, workload, extra),
                      perf.binding(shape, workload, knee, slo), perf.point(shape, workload, 1),
                      source, notes, cand,
                      "bench-synchronised" if concurrency else perf.client_of(workload))


def choose_chunk(a: Assessment, slo: SLO, default: int) -> tuple[int, str]:
    """The largest prefill chunk whose step (beside the knee's decodes) stays within the TPOT
    SLO, so a token that shares a step with a prompt still meets it; never below 2,048."""
    s = a.shape
    running = a.knee.running if a.knee else 1.0
    ctx = 0.0
    best = CHUNK_CHOICES[0]
    for m in CHUNK_CHOICES:
        step = perf.prefill_step_s(s, m, running, ctx) * 1e3
        if step <= slo.tpot_ms:
            best = m
    step = perf.prefill_step_s(s, best, running, ctx) * 1e3
    why = (f"max-num-batched-tokens {best:,}: the largest chunk whose step beside "
           f"{running:,.0f} decodes takes {step:.1f} ms, within the {slo.tpot_ms:.0f} ms TPOT SLO"
           if step <= slo.tpot_ms else
           f"max-num-batched-tokens {best:,}: even this chunk's step takes {step:.1f} ms, over "
           f"the {slo.tpot_ms:.0f} ms TPOT SLO; smaller chunks only slow prefill")
    if best == default:
        why += " (vLLM's default)"
    return best, why


def knee_seqs(a: Assessment) -> int | None:
    """max_num_seqs per engine that holds the SLO: the knee's running requests, when the SLO
    (not the KV cache or vLLM's own limit) is what binds."""
    if a.knee is None or not a.binding.startswith("slo"):
        return None
    return max(1, math.floor(a.knee.concurrency / a.shape.dp))


def performance_range(a: Assessment) -> D.Range:
    """What the figures at the operating point may really be: the held-out spread of the
    published rows (perf.HELD_OUT_SPREAD) around the prediction; a calibrated engine keeps the
    same spread (the calibration's own fit error is in the notes)."""
    p = a.knee or a.at
    tput = perf.value_range("output_tokens_per_s", p.output_tokens_per_s)
    tpot = perf.value_range("tpot_ms", p.tpot_ms)
    ttft = perf.value_range("ttft_ms", p.ttft_ms)
    return D.Range(low=round(tput[0], 1), high=round(tput[1], 1), of="output_tokens_per_s",
                   tpot_ms=D.TpotRange(round(tpot[0], 2), round(tpot[1], 2)),
                   ttft_ms=D.TpotRange(round(ttft[0], 1), round(ttft[1], 1)),
                   basis="10th-90th percentile of leave-one-source-out error on published "
                         "vLLM rows (bench/perf_fit.py)")


def performance(a: Assessment, workload: Workload, asked_concurrency: int | None = None
                ) -> D.Performance:
    """The assessment as the plan's typed Performance (its points through
    OperatingPoint.plan_point, the one conversion): built once, never from JSON."""
    return D.Performance(
        source=a.source, at=a.at.plan_point(),
        knee=a.knee.plan_point() if a.knee else None, range=performance_range(a),
        binding=a.binding, single_request=a.single.plan_point(),
        curve=tuple(p.plan_point() for p in a.curve), notes=tuple(a.notes),
        asked_concurrency=asked_concurrency, client=a.client,
        knee_client=perf.client_of(workload))
