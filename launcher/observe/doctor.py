"""`vlaunch doctor`: why a vLLM start failed, which memory consumer to attack, and the fix.

Why: vLLM's own messages are good for KV sizing and poor for everything else. The real cause
of a failed start hides above "Engine core initialization failed. See root cause above",
repeated by every rank, in logs of tens of thousands of lines. A "CUDA out of memory" is a
budget problem: it has to be charged to a consumer (weights, KV cache, activations, CUDA
graphs, another process) before anyone can say which knob to turn.

How: `launcher.inputs.vllm_failures` reads the log (the table of vLLM's and NCCL's failure
messages, shared with serve and tune); this module diagnoses and renders. Fixes are
exact vLLM flags: from the log's own numbers (`doctor_logfix`), and whenever the failed launch's
model and hardware are known (MODEL --gpus, --plan, or what the log says) every fix is run
through the planner with that launch's settings before it is shown: a fix the planner says
will not fit is replaced by one that does, or dropped with the planner's reason.
"""

from __future__ import annotations

import shlex
from typing import Any, TextIO

from ..deployment.plan import Deployment
from ..inputs.vllm_failures import Diagnosis, Report, scan_text
from ..inputs.vllm_logfiles import read_logs
from ..term import PIPED_WIDTH, fit, shell_lines, wrap
from .doctor_logfix import apply_log_fixes
from .doctor_plancheck import (
    PLANNED_CAUSES,
    PlanContext,
    apply_plan_fixes,
    context_from_log,
    context_from_model,
    context_from_plan,
)

# The doctor's entry points (cli.py reads the launch's context through this module).
__all__ = ["PlanContext", "context_from_model", "context_from_plan", "diagnose", "diagnose_all",
           "explain_log", "render", "render_all", "to_json"]
from .pool_role import note, pool_of

# --- entry points ------------------------------------------------------------------------------


def explain_log(text: str) -> Diagnosis | None:
    """The root cause of a failed start in `text` with its log-only fix (what serve prints when
    a start fails), or None when the log shows no error."""
    report = scan_text(text)
    apply_log_fixes(report)
    return report.root


def diagnose(source: str, ctx: PlanContext | None = None, stdin: TextIO | None = None,
             plan: Deployment | None = None) -> tuple[Report, list[str]]:
    """Read a log (a file, a folder's newest log, or "-"), diagnose it, and compute each fix."""
    name, report = diagnose_all(source, ctx, stdin, plan)[0]
    return report, [name]


def diagnose_all(source: str, ctx: PlanContext | None = None, stdin: TextIO | None = None,
                 plan: Deployment | None = None) -> list[tuple[str, Report]]:
    """Every log of `source` (one for a file or stdin; a folder's, newest first), each
    diagnosed with its fixes; `plan` names the pool of a disaggregated plan that failed."""
    logs = read_logs(source, stdin)
    for name, report in logs:
        _fix(report, ctx, plan, [name])
    return logs


def _fix(report: Report, ctx: PlanContext | None, plan: Deployment | None = None,
         names: list[str] | tuple[str, ...] = ()) -> None:
    apply_log_fixes(report)
    if report.root is not None and (pd := pool_of(report.facts, plan, names)) is not None:
        report.root.explain.insert(0, note(pd))
        report.root.numbers["pool"] = pd
    ctx = ctx or context_from_log(report)
    if ctx is not None:
        apply_plan_fixes(report, ctx)
        return
    for d in report.diagnoses:
        if d.fix_args and d.cause in PLANNED_CAUSES:
            d.explain.append("not checked by vlaunch's planner: pass MODEL --gpus ... or "
                             "--plan to check this fix fits")


def to_json(logs: list[tuple[str, Report]]) -> dict[str, Any]:
    """The newest log's report, with `sources` naming every log read (newest first) and
    `older` holding the other logs' reports, each with its `source`."""
    (name, report), *rest = logs
    doc: dict[str, Any] = {"sources": [n for n, _ in logs], **report.to_dict()}
    if rest:
        doc["older"] = [{"source": n, **r.to_dict()} for n, r in rest]
    return doc


def render_all(logs: list[tuple[str, Report]], width: int = PIPED_WIDTH) -> str:
    """Every log's report for people, newest first, a blank line between."""
    return "\n\n".join(render(report, [name], width) for name, report in logs)


# --- rendering ---------------------------------------------------------------------------------


def render(report: Report, names: list[str], width: int = PIPED_WIDTH) -> str:
    """The report for people: the root cause first, each with evidence, fix and command, every
    line within `width` columns (long log lines wrap under their "|", reasons under their
    "-", the command continued with backslashes so it still pastes)."""
    src = ", ".join(names)
    out = fit([f"vlaunch doctor: {src} ({report.lines:,} lines; furthest phase: "
               f"{report.phase or 'none'})"], width)
    if not report.diagnoses:
        out += fit(["no failure found: vLLM printed no error this doctor knows or that looks "
                    "like one"], width)
        return "\n".join(out)
    for i, d in enumerate(report.diagnoses):
        title = "root cause" if i == 0 else "also"
        ranks = f", ranks: {d.ranks}" if d.ranks > 1 else ""
        out.append("")
        out += fit([f"{title}: {d.cause} (phase: {d.phase}, consumer: {d.consumer}{ranks}"
                    + (", transient" if d.transient else "") + ")"], width)
        for e in d.evidence[:4]:
            out += wrap(e[:600], width, indent="  | ", hang="  | ")
        for x in d.explain:
            out += fit([f"  - {x}"], width)
        if d.fix_args or d.fix_env:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in d.fix_env.items())
            fix = " ".join(filter(None, [env, shlex.join(d.fix_args)]))
            out += _labelled("fix", fix, width)
        if d.serve_command:
            out += _labelled("run", d.serve_command, width)
        if d.vllm_command:
            out += _labelled(" or" if d.serve_command else "run", d.vllm_command, width)
    return "\n".join(out)


def _labelled(label: str, command: str, width: int) -> list[str]:
    """`  fix: CMD`, the command wrapped with backslashes when it is wider than the text."""
    lines = shell_lines(command, width, indent=" " * (len(label) + 4))
    return [f"  {label}: " + lines[0].lstrip()] + lines[1:]
