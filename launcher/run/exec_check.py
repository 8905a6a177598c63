"""Whether an emitted plan still fits the GPUs as they are now, before `exec` starts it.

`exec` runs what the plan says and never plans again (unless asked with --replan): a plan made
when the cards were free can meet a co-tenant at start-up. vLLM would then refuse to start
(free < utilization x total, v1/worker/utils.py request_memory) after minutes of loading;
this says so first, from the plan's per-GPU requested bytes and NVML's free bytes now.
"""

from __future__ import annotations

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
