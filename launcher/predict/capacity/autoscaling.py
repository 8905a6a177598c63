"""Autoscaling targets for a pool, derived from the replica's capacity at the SLO knee (pure).

Why: KEDA and the HPA scale vLLM on running requests, queued requests and KV usage per replica,
with thresholds people guess (llm-d ships 16 running and 1 waiting, the endpoint picker 5
waiting and 0.8 KV). The planner knows what one replica holds within the SLO, and how long a
new one takes to start, so each threshold is a figure of the plan:

- target_running_per_replica: the requests in flight at the knee (all DP engines together); the
  most a replica runs within the SLO, so more on average means the pool needs another;
- target_waiting_per_replica: requests a replica can queue and still start each within the TTFT
  SLO. A queue of q drains at the knee's prefill rate (prompt tokens/s = completions/s x prompt
  length), so q x input_len / prefill tok/s must fit in the TTFT the knee leaves unused
  (Little's law); at least 1, since a threshold of 0 would scale on any queue;
- kv_usage_threshold: the KV fraction the knee's running requests fill on one engine, each
  holding its prompt and on average half its answer, at whole blocks;
- prefill_backlog_s (prefill pools only): the TTFT SLO minus one prompt's prefill time, the
  queueing a prefill replica may add before the TTFT breaks;
- min/max replicas: the user's, or capacity's count for --users/--rps (one rule,
  `replicas_needed`, which `vlaunch capacity` uses too);
- stabilization windows: never shorter than the predicted start-up (a decision inside it acts
  on demand that the replica being started cannot serve yet), the scale-down window at least
  the HPA's default 300 s, and both at most the 3,600 s the HPA accepts (the KEDA CRD's
  `stabilizationWindowSeconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...deployment.plan import Autoscaling
from ...errors import InputError
from .startup_time import Startup

HPA_MAX_WINDOW_S = 3600
"""`stabilizationWindowSeconds` must be 0..3600 (autoscaling/v2 HPAScalingRules; KEDA CRD)."""

HPA_SCALE_DOWN_DEFAULT_S = 300
"""The HPA's scale-down stabilization when none is set (same source); llm-d's queue
ScaledObject keeps 300 s too."""

ROLES = ("aggregated", "prefill", "decode")


@dataclass(frozen=True)
class ScalingAsk:
    """What the user asked of the pool's size: bounds, or a load to size it for."""

    min_replicas: int | None = None
    max_replicas: int | None = None
    users: int | None = None
    rps: float | None = None
    headroom: float = 0.2
    spare: int = 0

    def validate(self) -> None:
        for flag, v in (("--min-replicas", self.min_replicas),
                        ("--max-replicas", self.max_replicas)):
            if v is not None and v < 1:
                raise InputError(f"{flag} must be at least 1, got {v} (vLLM's own metrics drive "
                                 "the triggers: a pool of 0 replicas exports none and never "
                                 "scales up)")
        if (self.min_replicas is not None and self.max_replicas is not None
                and self.min_replicas > self.max_replicas):
            raise InputError(f"--min-replicas {self.min_replicas} is above --max-replicas "
                             f"{self.max_replicas}; give a minimum no larger than the maximum")
        if self.users is not None and self.rps is not None:
            raise InputError("give at most one of --users N or --rps R")
        if self.users is not None and self.users < 1:
            raise InputError(f"--users must be a positive number of users, got {self.users}")
        if self.rps is not None and not (self.rps > 0 and math.isfinite(self.rps)):
            raise InputError(f"--rps must be a positive request rate, got {self.rps}")


def replicas_needed(load: float, per_replica: float, headroom: float, spare: int,
                    closed: bool = False) -> int:
    """Replicas for `load` (users, `closed`, or requests/s) at `per_replica` each: ceil(load x
    (1 + headroom) / per_replica), one more when closed-loop users would fill every replica to
    its knee (100% busy is never planned), + spare; the rule `vlaunch capacity` sizes by."""
    if per_replica <= 0:
        raise ValueError("per_replica must be positive")
    active = max(1, math.ceil(load * (1 + headroom) / per_replica - 1e-9))
    if closed and load / active >= per_replica:
        active += 1
    return active + spare


@dataclass(frozen=True)
class Knee:
    """One replica at its SLO knee: the figures the targets come from."""

    concurrency: float  # requests in flight, all DP engines
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: float
    open_loop_requests_per_s: float  # Poisson arrivals it takes within the SLO

    def prefill_tokens_per_s(self, input_len: int) -> float:
        return self.requests_per_s * input_len


def bounds(ask: ScalingAsk, knee: Knee) -> tuple[int, int, str]:
    """(min, max, why) of the pool's replicas."""
    ask.validate()
    lo = ask.min_replicas or 1
    if ask.users is None and ask.rps is None:
        hi = ask.max_replicas or lo
        why = ("--max-replicas" if ask.max_replicas else
               "no --max-replicas, --users or --rps: the pool stays at its minimum")
        return lo, hi, why
    load, per, what = ((ask.users, knee.concurrency, "users") if ask.users is not None
                       else (ask.rps, knee.open_loop_requests_per_s, "requests/s"))
    if per <= 0:
        raise InputError(f"one replica holds no {what} within the SLO (its knee is at one "
                         "request); relax --slo or plan bigger GPUs")
    need = replicas_needed(float(load), per, ask.headroom, ask.spare,
                           closed=ask.users is not None)
    if ask.max_replicas is not None and ask.max_replicas < need:
        raise InputError(f"{load:g} {what} need {need} replicas at {per:,.2f} each within the "
                         f"SLO, above --max-replicas {ask.max_replicas}; raise it or lower the "
                         "load")
    hi = ask.max_replicas or need
    if lo > hi:
        raise InputError(f"--min-replicas {lo} is above the {hi} replicas {load:g} {what} "
                         "need; lower it or give --max-replicas")
    return lo, hi, f"{load:g} {what} at {per:,.2f} per replica (+{ask.headroom:.0%} headroom, " \
                   f"{ask.spare} spare): {need}"


def derive(knee: Knee, *, ttft_slo_ms: float, single_ttft_ms: float, dp: int,
           kv_tokens_per_engine: int, block_size: int, input_len: int, output_len: int,
           startup: Startup, ask: ScalingAsk, role: str = "aggregated") -> Autoscaling:
    """The pool's targets from one replica's knee, the SLO and its start-up, as the plan's own
    `deployment.plan.Autoscaling` (one declaration of the shape; start-up at 0.1 s, as printed)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    lo, hi, why = bounds(ask, knee)
    running = max(1, math.floor(knee.concurrency + 1e-9))
    spare_ttft_s = max(0.0, (ttft_slo_ms - knee.ttft_ms) / 1e3)
    prefill_tps = knee.prefill_tokens_per_s(input_len)
    waiting = max(1, math.floor(spare_ttft_s * prefill_tps / max(input_len, 1) + 1e-9))
    per_engine = knee.concurrency / max(dp, 1)
    held = math.ceil((input_len + output_len / 2) / block_size) * block_size
    kv = min(1.0, per_engine * held / kv_tokens_per_engine) if kv_tokens_per_engine else 1.0
    backlog = (round(max(0.0, ttft_slo_ms - single_ttft_ms) / 1e3, 3)
               if role == "prefill" else None)
    notes = [f"replicas: {why}"]
    up = math.ceil(startup.seconds - 1e-9)  # never shorter than the start-up
    down = max(up, HPA_SCALE_DOWN_DEFAULT_S)
    if down > HPA_MAX_WINDOW_S:
        notes.append(f"start-up {startup.seconds:,.0f} s is longer than the {HPA_MAX_WINDOW_S} s "
                     "stabilization window the HPA accepts: windows capped there")
    up, down = min(up, HPA_MAX_WINDOW_S), min(down, HPA_MAX_WINDOW_S)
    basis = {"knee_concurrency": round(knee.concurrency, 2),
             "knee_ttft_ms": round(knee.ttft_ms, 1), "ttft_slo_ms": ttft_slo_ms,
             "requests_per_s": round(knee.requests_per_s, 3),
             "output_tokens_per_s": round(knee.output_tokens_per_s, 1),
             "prefill_tokens_per_s": round(prefill_tps, 1),
             "open_loop_requests_per_s": round(knee.open_loop_requests_per_s, 3),
             "kv_tokens_per_engine": kv_tokens_per_engine, "tokens_held_per_request": held,
             "startup_source": startup.source}
    return Autoscaling(role=role, target_running_per_replica=running,
                       target_waiting_per_replica=waiting,
                       kv_usage_threshold=math.ceil(kv * 100) / 100, prefill_backlog_s=backlog,
                       min_replicas=lo, max_replicas=hi, scale_up_stabilization_s=up,
                       scale_down_stabilization_s=down, startup_s=round(startup.seconds, 1),
                       basis=basis, notes=tuple(notes))


def ask_from_plan(dep: Any) -> dict[str, Any]:
    """make_plan's `scaling` and `load_path` for a re-plan of an emitted plan (`vlaunch exec`,
    a typed Deployment): the same replica bounds and weights path, so its autoscaling and
    start-up key match."""
    a, st = dep.pool.autoscaling, dep.pool.startup
    out: dict[str, Any] = {}
    if a is not None:
        out["scaling"] = ScalingAsk(min_replicas=a.min_replicas, max_replicas=a.max_replicas)
    if st is not None:
        out["load_path"] = st.load_path
    return out
