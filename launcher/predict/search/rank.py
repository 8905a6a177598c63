"""How candidates compare: one value per candidate, under the conditions every one shares.

The order, highest first:
1. it fits (memory) and holds one request of the workload;
2. its context, up to the target (the pinned max-model-len, else the model's full context), in
   steps of 1/CONTEXT_STEPS of the target: a plan never trades the context a user can rely on
   for speed, but a few hundred tokens (what a smaller batch frees in activations) are not
   worth half the throughput;
3. the objective's figure (perfplan.Assessment.score: output tok/s per GPU at the SLO knee, or
   minus one request's TPOT for latency), discounted by the margin a risky feature must beat
   when the planner (not the user) would turn it on: fp8 KV without calibrated scales
   (perfplan.FP8_MARGIN) and MTP drafts (the serving table's margin);
4. ties: no draft, more concurrent full-length requests, fewer stages, fewer engines.

`objective_score` is item 3 alone: the property tests hold every pinned plan to it.
"""

from __future__ import annotations

from typing import Any

from ...deployment import notes
from ...deployment.plan import Reason
from ..features.speculative import mtp_table
from ..speed.speed_decisions import FP8_MARGIN

CONTEXT_STEPS = 64
"""Contexts are compared in steps of 1/64 of the target (2,048 tokens of a 131,072 context)."""


def context_rank(max_model_len: int, target: int) -> int:
    """Item 2: the context up to the target, in whole steps (the full target is the top)."""
    step = max(1, target // CONTEXT_STEPS)
    return min(max_model_len, target) // step


def mtp_margin() -> float:
    """The gain an MTP draft the planner turns on must show (profiles/serving.yaml)."""
    return float(mtp_table()["margin"])


def _discount(score: float, margin: float) -> float:
    """`score` made worse by `margin` (scores may be negative: latency is minus a TPOT)."""
    return score / (1 + margin) if score > 0 else score * (1 + margin)


def objective_score(a: Any, objective: str, gpus: int, kv_dtype: str, draft: int,
                    fp8_pinned: bool = False, mtp_pinned: bool = False) -> float:
    """The objective's figure for one assessment, after the margins of item 3."""
    if a is None:
        return float("-inf")
    score = a.score(objective, gpus)
    if kv_dtype.startswith("fp8") and not fp8_pinned:
        score = _discount(score, FP8_MARGIN)
    if draft and not mtp_pinned:
        score = _discount(score, mtp_margin())
    return score


def figure_data(a: Any, objective: str) -> dict[str, Any]:
    """The numbers that decide, from the same rounded points the JSON carries (so a reason never
    prints 3,590 where the curve says 3,589): one request's TPOT, and the knee's figures (None
    where the SLO is out of reach, or for latency, which ranks on one request alone)."""
    one = a.single.to_dict()
    k = a.knee.to_dict() if a.knee is not None and objective != "latency" else None
    return {"objective": objective, "single_tpot_ms": one["tpot_ms"],
            "output_tokens_per_s": k["output_tokens_per_s"] if k else None,
            "concurrency": k["concurrency"] if k else None,
            "tpot_ms": k["tpot_ms"] if k else None, "ttft_ms": k["ttft_ms"] if k else None}


def figure(a: Any, objective: str) -> str:
    """The number that decided, in words (deployment/notes.py words it)."""
    return notes.figure(figure_data(a, objective))


def headline(a: Any, objective: str) -> str:
    """The deciding number alone, rounded as the JSON rounds it."""
    return notes.headline(figure_data(a, objective))


def value(j: Any, goal: Any) -> tuple:
    """The sort key of a judged candidate (search.Judged) under `goal` (search.Goal)."""
    c, k = j.cand, j.knobs
    target = goal.pins.max_model_len or goal.spec.max_context
    score = objective_score(j.perf, goal.objective, goal.hw.count, k.kv_dtype, k.draft,
                            bool(goal.pins.kv_cache_dtype), goal.mtp_pinned)
    return (c.fits, context_rank(c.max_model_len, target), round(score, 9), -k.draft,
            round(c.concurrency, 1), -k.layout.pp, -k.layout.dp, k.layout.tp)


def lost_on(j: Any, best: Any, objective: str, target: int) -> Reason:
    """What a runner-up lost on, against the chosen candidate's same figure, as a Reason of
    deployment/notes.py's RUNNER_UP_CODES."""
    c, b = j.cand, best.cand
    if not c.fits:
        return notes.note("runner_up.does_not_fit", problem=c.problem)
    if context_rank(c.max_model_len, target) < context_rank(b.max_model_len, target):
        return notes.note("runner_up.shorter_context", max_model_len=c.max_model_len,
                          chosen_max_model_len=b.max_model_len, target=target)
    if j.perf is None or best.perf is None:
        return notes.note("runner_up.no_prediction", concurrent_sequences=round(c.concurrency, 2),
                          chosen_concurrent_sequences=round(b.concurrency, 2))
    return notes.note("runner_up.slower", **figure_data(j.perf, objective),
                      chosen=figure_data(best.perf, objective))
