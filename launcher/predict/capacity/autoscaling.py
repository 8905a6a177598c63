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

The two pools of a disaggregated plan scale apart, each on what binds it (`prefill_scaling`,
`decode_scaling`): a prefill replica on its queue within the TTFT SLO, a decode replica on its
running requests and KV at the TPOT knee. `POOL_TRIGGERS` names each role's triggers, and
`desired_replicas` is KEDA's arithmetic over them: the ScaledObject (run/emit.py) and the
exporter's advisory count (observe/families.py) both read these, so they cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...deployment.notes import note
from ...deployment.plan import Autoscaling, Reason, Startup
from ...errors import InputError

HPA_MAX_WINDOW_S = 3600
"""`stabilizationWindowSeconds` must be 0..3600 (autoscaling/v2 HPAScalingRules; KEDA CRD)."""

HPA_SCALE_DOWN_DEFAULT_S = 300
"""The HPA's scale-down stabilization when none is set (same source); llm-d's queue
ScaledObject keeps 300 s too."""

ROLES = ("aggregated", "prefill", "decode")

POOL_TRIGGERS: dict[str, tuple[str, ...]] = {
    "aggregated": ("running", "waiting", "kv_usage"),
    # a prefill engine holds a prompt only while it prefills (max_tokens 1) and its KV only
    # until the decode side reads it: its queue is what the TTFT SLO bounds
    "prefill": ("waiting", "running"),
    # a decode replica is full when its running batch reaches the TPOT knee or its KV fills
    "decode": ("running", "kv_usage"),
}
"""The ScaledObject triggers of each pool role (keys of `trigger_thresholds`)."""


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


def bounds(ask: ScalingAsk, knee: Knee) -> tuple[int, int, Reason]:
    """(min, max, why) of the pool's replicas; `why` a note (deployment/notes.py)."""
    ask.validate()
    lo = ask.min_replicas or 1
    if ask.users is None and ask.rps is None:
        hi = ask.max_replicas or lo
        why = (note("replicas.max_replicas", min_replicas=lo, max_replicas=hi)
               if ask.max_replicas else note("replicas.at_minimum", min_replicas=lo))
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
    return lo, hi, note("replicas.for_load", load=load, unit=what, per_replica=round(per, 2),
                        headroom=ask.headroom, spare=ask.spare, replicas=need)


def derive(knee: Knee, *, ttft_slo_ms: float, single_ttft_ms: float, dp: int,
           kv_tokens_per_engine: int, block_size: int, input_len: int, output_len: int,
           startup: Startup, ask: ScalingAsk, role: str = "aggregated") -> Autoscaling:
    """The pool's targets from one replica's knee, the SLO and its start-up."""
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
    notes = [why]
    up, down = _windows(startup, notes)
    basis = {"knee_concurrency": round(knee.concurrency, 2),
             "knee_ttft_ms": round(knee.ttft_ms, 1), "ttft_slo_ms": ttft_slo_ms,
             "requests_per_s": round(knee.requests_per_s, 3),
             "output_tokens_per_s": round(knee.output_tokens_per_s, 1),
             "prefill_tokens_per_s": round(prefill_tps, 1),
             "open_loop_requests_per_s": round(knee.open_loop_requests_per_s, 3),
             "kv_tokens_per_engine": kv_tokens_per_engine, "tokens_held_per_request": held,
             "startup_source": startup.source}
    return _targets(role, running, waiting, kv, backlog, (lo, hi), (up, down), startup, basis,
                    notes)


def _targets(role: str, running: int, waiting: int, kv: float, backlog: float | None,
             replicas: tuple[int, int], windows: tuple[int, int], startup: Any,
             basis: dict[str, Any], notes: list[Reason]) -> Autoscaling:
    """The plan's own `deployment.plan.Autoscaling` (one declaration of the shape): the KV
    threshold up to whole percent, the start-up at 0.1 s as the plan prints it."""
    return Autoscaling(role=role, target_running_per_replica=running,
                       target_waiting_per_replica=waiting,
                       kv_usage_threshold=math.ceil(kv * 100) / 100, prefill_backlog_s=backlog,
                       min_replicas=replicas[0], max_replicas=replicas[1],
                       scale_up_stabilization_s=windows[0],
                       scale_down_stabilization_s=windows[1],
                       startup_s=round(startup.seconds, 1), basis=basis, notes=tuple(notes))


def trigger_thresholds(a: Any) -> dict[str, float]:
    """Each trigger of the pool's role at its per-replica threshold (KEDA AverageValue)."""
    every = {"running": float(a.target_running_per_replica),
             "waiting": float(a.target_waiting_per_replica),
             "kv_usage": float(a.kv_usage_threshold)}
    return {k: every[k] for k in POOL_TRIGGERS[a.role]}


def desired_replicas(a: Any, load: Mapping[str, float]) -> int:
    """The replicas the HPA asks for under `load` (each trigger's metric summed over the pool:
    running and waiting requests, and the per-replica KV usage summed over replicas): AverageValue
    gives ceil(sum / threshold) per trigger, and the HPA takes the largest."""
    return max(math.ceil(load[k] / t - 1e-9) for k, t in trigger_thresholds(a).items())


def _windows(startup: Startup, notes: list[Reason]) -> tuple[int, int]:
    up = math.ceil(startup.seconds - 1e-9)  # never shorter than the start-up
    down = max(up, HPA_SCALE_DOWN_DEFAULT_S)
    if down > HPA_MAX_WINDOW_S:
        notes.append(note("windows.capped", startup_s=round(startup.seconds, 1),
                          max_window_s=HPA_MAX_WINDOW_S))
    return min(up, HPA_MAX_WINDOW_S), min(down, HPA_MAX_WINDOW_S)


def _pool_bounds(ask: ScalingAsk, knee: Knee, planned: int) -> tuple[int, int, Reason]:
    """`bounds`, with the pool's rate-matched replicas as its floor when no --min-replicas is
    given (never above the most the load or --max-replicas allow)."""
    lo, hi, why = bounds(ask, knee)
    if ask.min_replicas is None:
        if ask.max_replicas is None and ask.users is None and ask.rps is None:
            return planned, planned, note("replicas.rate_matched", replicas=planned)
        lo = min(planned, hi)
        if why.code == "replicas.max_replicas":  # the floor moved: say the bounds it has
            why = note("replicas.max_replicas", min_replicas=lo, max_replicas=hi)
    return lo, hi, why


def _held(tokens: float, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


def prefill_scaling(*, replicas: int, dp: int, requests_per_s: float, prompt_s: float,
                    fixed_s: float, derate: float, ttft_slo_ms: float,
                    time_in_system_s: float, kv_tokens_per_engine: int, block_size: int,
                    input_len: int, startup: Any, ask: ScalingAsk | None = None) -> Autoscaling:
    """A prefill pool's targets, from one replica's prompt rate and the TTFT SLO.

    - backlog B = TTFT SLO - `fixed_s` (one prompt's prefill + the KV hand-off + decode's first
      step): the queueing the TTFT leaves room for;
    - target_waiting = floor(B x mu), mu = the replica's prompts/s: a queue of q drains in
      q / mu s, so a longer one starts its last prompt past the SLO;
    - the replica's rate within the SLO: rho x mu, rho = min(de-rate, 2B / (s + 2B)), the
      M/D/1 load whose mean wait rho / (2 (1 - rho)) s equals B (s = one prompt's prefill);
    - target_running = floor(that rate x s): prompts in service (Little's law);
    - kv_usage (advisory, not a trigger): those prompts' KV, whole blocks, per engine.
    """
    ask = ask or ScalingAsk()
    ask.validate()
    backlog = max(0.0, ttft_slo_ms / 1e3 - fixed_s)
    rho = min(derate, 2 * backlog / (prompt_s + 2 * backlog)) if prompt_s > 0 else derate
    rate = rho * requests_per_s
    waiting = max(1, math.floor(backlog * requests_per_s + 1e-9))
    running = max(1, math.floor(rate * prompt_s + 1e-9))
    held = _held(input_len, block_size)
    kv = min(1.0, running / max(dp, 1) * held / kv_tokens_per_engine) \
        if kv_tokens_per_engine else 1.0
    knee = Knee(rate * time_in_system_s, rate, 0.0, fixed_s * 1e3, rate)
    lo, hi, why = _pool_bounds(ask, knee, replicas)
    notes = [why]
    up, down = _windows(startup, notes)
    basis = {"requests_per_s": round(requests_per_s, 3), "prompt_s": round(prompt_s, 4),
             "fixed_ttft_s": round(fixed_s, 4), "ttft_slo_ms": ttft_slo_ms,
             "utilization_at_slo": round(rho, 4), "rate_at_slo": round(rate, 3),
             "queued_prompt_tokens": waiting * input_len, "kv_tokens_per_engine":
             kv_tokens_per_engine, "tokens_held_per_request": held,
             "startup_source": startup.source}
    return _targets("prefill", running, waiting, kv, round(backlog, 3), (lo, hi), (up, down),
                    startup, basis, notes)


def decode_scaling(*, replicas: int, dp: int, requests_per_s: float,
                   running_per_engine: float, derate: float, ttft_slo_ms: float,
                   ttft_ms: float, time_in_system_s: float, kv_tokens_per_engine: int,
                   block_size: int, input_len: int, output_len: int, startup: Any,
                   ask: ScalingAsk | None = None) -> Autoscaling:
    """A decode pool's targets, from one replica's batch at the TPOT knee.

    - target_running = floor(de-rate x the knee's running per engine x DP engines): the batch
      is planned not to fill every slot (aiconfigurator's 0.92), so more on average means the
      pool needs another replica before TPOT breaks;
    - kv_usage: that batch's KV per engine, each request holding its prompt and half its
      answer, at whole blocks;
    - target_waiting (advisory, not a trigger): what the TTFT left over at the operating point
      lets queue, at the replica's completions/s.
    """
    ask = ask or ScalingAsk()
    ask.validate()
    running = max(1, math.floor(derate * running_per_engine * dp + 1e-9))
    held = _held(input_len + output_len / 2, block_size)
    kv = min(1.0, running / max(dp, 1) * held / kv_tokens_per_engine) \
        if kv_tokens_per_engine else 1.0
    rate = derate * requests_per_s
    spare_s = max(0.0, (ttft_slo_ms - ttft_ms) / 1e3)
    waiting = max(1, math.floor(spare_s * rate + 1e-9))
    knee = Knee(rate * time_in_system_s, rate, rate * output_len, ttft_ms, rate)
    lo, hi, why = _pool_bounds(ask, knee, replicas)
    notes = [why]
    up, down = _windows(startup, notes)
    basis = {"requests_per_s": round(requests_per_s, 3),
             "running_per_engine_at_knee": round(running_per_engine, 2), "dp": dp,
             "derate": derate, "rate_at_slo": round(rate, 3), "ttft_ms": round(ttft_ms, 1),
             "ttft_slo_ms": ttft_slo_ms, "kv_tokens_per_engine": kv_tokens_per_engine,
             "tokens_held_per_request": held, "startup_source": startup.source}
    return _targets("decode", running, waiting, kv, None, (lo, hi), (up, down), startup,
                    basis, notes)


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
