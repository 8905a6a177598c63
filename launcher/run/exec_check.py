"""Whether an emitted plan still fits the GPUs as they are now, before `exec` starts it.

`exec` runs what the plan says and never plans again (unless asked with --replan): a plan made
when the cards were free can meet a co-tenant at start-up. vLLM would then refuse to start
(free < utilization x total, v1/worker/utils.py request_memory) after minutes of loading;
this says so first, from the plan's per-GPU requested bytes and NVML's free bytes now. And
every value exec takes from the plan passes the flag table's checks first (`check_exec_plan`).
"""

from __future__ import annotations

import math
import re

from ..deployment.argv import engine_argv
from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs import vllm_flags as F
from ..inputs.hardware import GiB


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


_VERSION = re.compile(r"\d{1,4}(\.\d{1,6}){0,3}([.+-][A-Za-z0-9.+-]{1,40})?")


def _finite(v: float, *, whole: bool = False, positive: bool = True) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    if whole and not isinstance(v, int):
        return False
    return v > 0 if positive else v >= 0


def check_exec_plan(dep: Deployment, plan_dir: str | None = None) -> None:
    """Everything `exec` takes from a loaded plan into vLLM's argv or a re-plan (a plan.json on
    a shared volume is an attacker's text, issue 31): the engine's arguments through the flag
    table's allow-list with each value checked (no other model, a chat template only inside the
    model's or the plan's folder, parsers and backends only as plain names), and the numbers a
    re-plan reads finite and in range. One line naming the field; never a traceback."""
    fix = "re-emit it with `vlaunch plan MODEL --emit DIR`"
    m = dep.model
    ctx = F.PlanContext(m.path or m.hf_id, tuple(str(r) for r in (m.path, plan_dir) if r))
    if dep.fits:
        F.check_plan_args(engine_argv(dep.engine), ctx)
    if m.commit is not None and (why := F.check_value("revision", m.commit, ctx)):
        raise InputError(f"the plan's `model.commit` is {m.commit[:64]!r}, which {why}; {fix}")
    numbers = []
    if dep.workload is not None:
        numbers += [("performance.input_len", dep.workload.input_len, True),
                    ("performance.output_len", dep.workload.output_len, True)]
    if dep.slo is not None:
        numbers += [("performance.slo.ttft_ms", dep.slo.ttft_ms, False),
                    ("performance.slo.tpot_ms", dep.slo.tpot_ms, False)]
    for where, value, whole in numbers:
        if not _finite(value, whole=whole):
            raise InputError(f"the plan's `{where}` is {value!r:.40}; it must be a "
                             f"{'whole ' if whole else ''}number above 0; {fix}")
    if not _VERSION.fullmatch(dep.vllm_version or ""):
        raise InputError(f"the plan's `vllm_version` is {dep.vllm_version!r:.40}; it must be a "
                         f"release such as 0.32.0; {fix}")
