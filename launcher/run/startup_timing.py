"""Record how long a vLLM start-up took, phase by phase, for the next plans of the setup.

Why: the plan's start-up is a prediction (capacity/startup_time.py) that sets the autoscaler's
stabilization windows; the runner times each log phase vLLM announces (vllmlog.PHASES) as it
comes, and once the API answers, `serve` and `tune` keep the whole time and each phase's share
(capacity/startup_measured.py). A later plan of the same model, GPUs, layout, graphs, version
and load path uses the measurement instead of the model.
"""

from __future__ import annotations

from typing import Any

from ..deployment.plan import Deployment
from ..predict.capacity import startup_measured
from ..predict.capacity import startup_time as startup


def learn_startup(runner: Any, d: Deployment, load_path: str | None) -> str | None:
    """Record the runner's start-up (launch to ready) for plan `d`; a line saying so, or None
    when the runner did not time one (a fake runner, or it never became ready)."""
    marks = list(getattr(runner, "phase_marks", None) or [])
    if len(marks) < 2 or marks[-1][0] != "ready":
        return None
    began, ready = marks[0][1], marks[-1][1]
    # as the store keeps them, so the line below and the next plan print one figure (1.049 s
    # printed 1.0 beside a plan's 1.1, rounded from the stored 1.05)
    digits = startup_measured.STORED_DIGITS
    seconds = round(ready - began, digits)
    phases = {p: round(v, digits)
              for p, v in startup_measured.phase_durations(marks[:-1], ready, began).items()}
    st = d.pool.startup
    path = load_path or (st.load_path if st else
                         startup.load_path_for(d.model.source, d.model.path))
    where = startup_measured.record(d, path, seconds, phases,
                                    f"vlaunch, vLLM {d.vllm_version} log phases")
    if where is None:
        return None
    return (f"vlaunch: start-up took {seconds:.1f} s ("
            + ", ".join(f"{p} {v:.1f} s" for p, v in phases.items())
            + f"); recorded for the next plans in {where}")
