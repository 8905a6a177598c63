"""What `vlaunch exec` does with an emitted plan besides running it.

`exec` runs what the plan says and never plans again (unless asked with --replan): a plan made
when the cards were free can meet a co-tenant at start-up. vLLM would then refuse to start
(free < utilization x total, v1/worker/utils.py request_memory) after minutes of loading;
`live_misfit` says so first, from the plan's per-GPU requested bytes and NVML's free bytes now.
With --replan, exec plans again for the GPUs as they are now (`live_hardware`), for the goals
the plan was made for (`goals_from_plan`), keeping the user's pins labelled as theirs
(`relabel_pins`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs.hardware import GiB, Hardware


def live_misfit(dep: Deployment) -> str | None:
    """One line when the live free memory of this machine's GPUs is below what the plan's
    engine requests per GPU; None when it fits or cannot be read (no GPU here, a CPU plan)."""
    if dep.hardware.platform == "cpu" or not dep.fits:
        return None
    from ..inputs.inventory import detect_hardware

    try:
        hw = detect_hardware()
    except InputError:
        return None  # nothing readable here: vLLM's own check still applies at start-up
    need = dep.pool.per_gpu.requested_bytes
    if hw.free_bytes >= need:
        return None
    return (f"the plan's engine requests {need / GiB:.2f} GiB per GPU but only "
            f"{hw.free_bytes / GiB:.2f} GiB is free now (the plan saw "
            f"{dep.hardware.free_bytes / GiB:.2f} GiB); free the GPUs, or pass --replan to plan "
            "again for the memory that is free")


def live_hardware(dep: Deployment, planned: Hardware) -> Hardware:
    """The hardware `exec --replan` plans for: this machine's GPUs as NVML reads them now
    (free memory included) when they are the plan's kind and count, else the plan's own."""
    if dep.hardware.platform == "cpu":
        return planned
    from ..inputs.inventory import detect_hardware

    try:
        hw = detect_hardware(count=dep.hardware.count)
    except InputError:
        return planned
    return hw if hw.kind.name == planned.kind.name and hw.count == planned.count else planned


def relabel_pins(dep: Deployment) -> Callable[[Any], Any]:
    """A plan hook for `exec --replan`: it re-plans with every decision of the emitted plan
    pinned, so the planner would call values it chose itself at `vlaunch plan` time "pinned by
    you". Only the reasons the emitted plan marked pinned (`data.pinned`) keep that label."""
    user = {r.code for r in dep.reasons if r.data.get("pinned")}

    def relabel(plan: Any) -> Any:
        for i, r in enumerate(plan.reasons):
            if r.data.get("pinned") and r.code not in user:
                text = (r.text.removesuffix(" (pinned)") + " (from the emitted plan)"
                        if r.code == "layout" else
                        r.text.replace("pinned by you", "from the emitted plan"))
                plan.reasons[i] = dataclasses.replace(r, text=text,
                                                      data={**r.data, "pinned": False})
        return plan

    return relabel


def goals_from_plan(dep: Deployment) -> dict[str, Any] | None:
    """The workload, SLO and objective an emitted plan was made for, so exec re-plans for them."""
    from ..inputs.workload import SLO, Workload
    from ..predict.capacity.autoscaling import ask_from_plan

    if dep.workload is None or dep.slo is None or dep.performance is None:
        return None
    w = dep.workload
    return {"workload": Workload(w.input_len, w.output_len, w.name or "custom", w.assumed),
            "objective": dep.objective, "slo": SLO(dep.slo.ttft_ms, dep.slo.tpot_ms),
            **ask_from_plan(dep)}  # the pool's bounds and weights path, as emitted
