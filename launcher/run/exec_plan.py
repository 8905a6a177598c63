"""What `vlaunch exec` does with an emitted plan besides running it.

`exec` runs what the plan says and never plans again (unless asked with --replan): a plan made
when the cards were free can meet a co-tenant at start-up. vLLM would then refuse to start
(free < utilization x total, v1/worker/utils.py request_memory) after minutes of loading;
`live_misfit` says so first, from the plan's per-GPU requested bytes and NVML's free bytes now.
With --replan, exec plans again for the GPUs as they are now (`live_hardware`), for the goals
the plan was made for (`goals_from_plan`), with every decision of the plan pinned and only the
user's own labelled as theirs (predict/search/plan_inputs.py replan_pins: the planner renders
the others "from the emitted plan" itself, so no reason's text is edited afterwards).

A disaggregated plan's folder runs one pool (`plan --role R --emit DIR`: the plan's `role`);
`check_pool_plan` refuses a whole disaggregated plan, and a pool whose peers could not reach
its KV side channel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs.hardware import GiB, Hardware

SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"


def check_pool_plan(dep: Deployment, replan: bool = False,
                    environ: Mapping[str, str] | None = None) -> None:
    """One line (exit 2) when exec cannot run this plan as one pool's engine.

    - a disaggregated plan without `role` holds two pools and exec runs one engine;
    - a pool is not re-planned alone: its layout, batch and side of the KV hand-off were chosen
      with the other pool's (rate matching), so --replan of one pool would break the pairing;
    - a pool whose connector has a side channel (NIXL) must advertise its own address: a
      pool's folder leaves VLLM_NIXL_SIDE_CHANNEL_HOST to where it runs (a pod's IP, which
      every pod of the pool differs in; run/emit.py pool_plan), and vLLM's default, localhost,
      cannot be reached from the other pool's pods.
    """
    if dep.kind != "disaggregated":
        return
    if dep.role is None:
        raise InputError("this plan is disaggregated (a prefill and a decode pool): exec runs "
                         "one engine; emit each pool with `vlaunch plan MODEL --disaggregate on "
                         "--role prefill|decode --emit DIR`, or on one machine `vlaunch serve "
                         "MODEL --disaggregate on`")
    if replan:
        raise InputError(f"--replan: the {dep.role} pool was sized with the other pool (rate "
                         "matching), so it is not re-planned alone; re-emit both pools with "
                         "`vlaunch plan ... --role prefill|decode --emit DIR`")
    env = os.environ if environ is None else environ
    pool = dep.pool
    if (SIDE_CHANNEL_PORT in pool.env and SIDE_CHANNEL_HOST not in pool.env
            and not env.get(SIDE_CHANNEL_HOST)):
        raise InputError(f"the {dep.role} pool's KV side channel needs this engine's own "
                         f"address: set {SIDE_CHANNEL_HOST} to it (in Kubernetes, the pod IP "
                         "from the downward API, fieldRef status.podIP)")


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
