"""What `exec` takes from a loaded plan passes the flag table's checks before anything runs.

A plan.json on a shared volume is text an attacker may have written (issue 31): the codec says
it is well formed; this says every value that reaches vLLM's argv or a re-plan is one a plan
may carry (live free memory is `exec_plan.live_misfit`'s question).
"""

from __future__ import annotations

import math
import re

from ..deployment.argv import pool_argv
from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs import vllm_flags as F

_VERSION = re.compile(r"\d{1,4}(\.\d{1,6}){0,3}([.+-][A-Za-z0-9.+-]{1,40})?")


def _finite(v: float, *, whole: bool = False, positive: bool = True) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    if whole and not isinstance(v, int):
        return False
    return v > 0 if positive else v >= 0


def plan_context(dep: Deployment, plan_dir: str | None = None) -> F.PlanContext:
    """The flag table's context for a plan's argv: the model the plan names, and the folders a
    path it carries (a chat template) may point into, the model's own and the plan's. The one
    context `check_exec_plan` and `multinode.build_launch` check every argv against."""
    m = dep.model
    return F.PlanContext(m.path or m.hf_id, tuple(str(r) for r in (m.path, plan_dir) if r))


def check_exec_plan(dep: Deployment, plan_dir: str | None = None) -> None:
    """Everything `exec` takes from a loaded plan into vLLM's argv or a re-plan (a plan.json on
    a shared volume is an attacker's text, issue 31): the engine's arguments through the flag
    table's allow-list with each value checked (no other model, a chat template only inside the
    model's or the plan's folder, parsers and backends only as plain names), and the numbers a
    re-plan reads finite and in range. One line naming the field; never a traceback."""
    fix = "re-emit it with `vlaunch plan MODEL --emit DIR`"
    m, ctx = dep.model, plan_context(dep, plan_dir)
    for pool in dep.pools:  # exec runs the plan's argv and environment as they are
        if dep.fits:  # a P/D pool's --kv-transfer-config included
            F.check_plan_args(pool_argv(pool), ctx)
        F.check_plan_env(pool.env)
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
