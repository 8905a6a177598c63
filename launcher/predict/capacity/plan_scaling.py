"""The plan's start-up and autoscaling: `startup_time.py` and `autoscaling.py` applied to a Plan.

Why a composer apart from the planner: the two models are pure and take figures; this module
reads those figures off the planner's chosen candidate and its assessment (the same knee the
plan prints), and looks up a start-up that `vlaunch serve`/`tune` measured for this setup.
Duck-typed on the Plan so that the planner imports it, not the reverse.
"""

from __future__ import annotations

from typing import Any

from ...deployment.plan import Startup
from ..speed import request_model as perf
from . import startup_measured
from . import startup_time as startup
from .autoscaling import Autoscaling, Knee, ScalingAsk, derive


def plan_startup(plan: Any, d: Any, load_path: str | None) -> Startup:
    """The measured start-up of this setup if one was recorded, else the model's."""
    m = plan.model
    path = load_path or startup.load_path_for(m.source, m.path)
    found = startup_measured.lookup(startup_measured.key(d, path), path)
    if found is not None:
        return found
    c, L = plan.chosen, plan.chosen.layout
    spec = plan.serving.speculative.num_speculative_tokens if plan.serving is not None else 0
    return startup.predict(c.weights, L.tp * L.pp * L.dp, m.num_layers, c.max_num_seqs, path,
                           enforce_eager=plan.enforce_eager, cpu=plan.hardware.is_cpu,
                           speculative_tokens=spec)


def plan_autoscaling(plan: Any, start: Startup, ask: ScalingAsk | None,
                     role: str = "aggregated") -> Autoscaling | None:
    """The pool's targets from the plan's knee; None when it has no knee (the SLO is out of
    reach, or no speed facts), unless a load was asked for, which cannot then be held."""
    ask = ask or ScalingAsk()
    ask.validate()
    a = plan.performance
    if a is None or a.knee is None or plan.workload is None or plan.slo is None:
        if ask.users is not None or ask.rps is not None:
            from ...errors import InputError

            raise InputError("the plan has no SLO knee (the SLO is out of reach, or the GPU has "
                             "no speed facts), so no replica count holds --users/--rps; relax "
                             "--slo or plan other GPUs")
        return None
    w, k, c = plan.workload, a.knee, plan.chosen
    open_rps = perf.open_loop_rate(a.shape, w, k.concurrency)
    knee = Knee(k.concurrency, k.requests_per_s, k.output_tokens_per_s, k.ttft_ms, open_rps)
    return derive(knee, ttft_slo_ms=plan.slo.ttft_ms, single_ttft_ms=a.single.ttft_ms,
                  dp=c.layout.dp, kv_tokens_per_engine=int(c.tokens), block_size=c.block_size,
                  input_len=w.input_len, output_len=w.output_len, startup=start, ask=ask,
                  role=role)


def attach(plan: Any, ask: ScalingAsk | None = None, load_path: str | None = None) -> None:
    """Set `plan.startup` and `plan.autoscaling` (nothing for a plan that does not fit)."""
    if not plan.fits:
        return
    plan.startup = plan_startup(plan, plan.deployment(), load_path)
    plan.autoscaling = plan_autoscaling(plan, plan.startup, ask)
