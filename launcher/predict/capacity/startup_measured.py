"""Start-up times measured by `vlaunch serve` and `tune`: ground truth for the next plans.

Why: start-up depends on what no table knows well (the disk behind the weights, the compile
cache, the driver), and it sets the autoscaler's stabilization windows. So once an engine of a
setup has started, the time from launch to ready (and each log phase's share) is recorded under
a key of the decisions that change it, and a later plan of the same setup uses it instead of the
model in `startup_time.py`, saying so (as MTP acceptance is learnt, features/speculative.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from ...deployment.plan import Deployment, Startup
from ...paths import cache_dir, read_json_object, report_corrupt, update_json_object
from .startup_time import measured

STORED_DIGITS = 2
"""Decimals of a second the store keeps: what a later plan reads, so what `serve` prints."""


def key(d: Deployment, load_path: str) -> str:
    """A digest of what a start-up time depends on, from a plan: the model, the GPUs, the
    layout, the graphs captured, vLLM's version and where the weights come from."""
    m, g, e = d.model, d.hardware, d.engine
    p = e.parallel
    factors = {"model": m.path or m.hf_id, "quantization": m.quantization,
               "gpu": [g.name, g.count, g.nodes],
               "parallel": {"tp": p.tp, "pp": p.pp, "dp": p.dp,
                            "expert_parallel": p.expert_parallel},
               "load_path": load_path, "max_num_seqs": e.max_num_seqs,
               "enforce_eager": e.enforce_eager, "vllm_version": d.vllm_version}
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:20]


def _store() -> Path:
    return cache_dir() / "startup.json"


def lookup(k: str, load_path: str) -> Startup | None:
    """The recorded start-up for key `k`; a malformed row is reported and not used."""
    row = read_json_object(_store()).get(k)
    if row is None:
        return None
    s = row.get("seconds") if isinstance(row, dict) else None
    pairs = row.get("phases") if isinstance(row, dict) else None
    if (isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0 and math.isfinite(s)
            and isinstance(pairs, list)
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                    and isinstance(p[1], (int, float)) for p in pairs)):
        return measured(float(s), dict(pairs), load_path, str(row.get("recorded_at", "?")))
    report_corrupt(_store(), f"entry {k!r} has no positive `seconds` and `phases` list")
    return None


def phase_durations(marks: list[tuple[str, float]], ready_at: float, started_at: float
                    ) -> dict[str, float]:
    """Seconds spent in each phase, from (phase, time it began) marks in order: a phase lasts
    until the next one begins, the last until ready."""
    out: dict[str, float] = {}
    bounds = [*(t for _, t in marks[1:]), ready_at]
    for (phase, t), end in zip(marks, bounds, strict=True):
        out[phase] = out.get(phase, 0.0) + max(0.0, end - max(t, started_at))
    return out


def record(d: Deployment, load_path: str, seconds: float, phases: dict[str, float],
           source: str) -> Path | None:
    """Keep a measured start-up of the plan `d` for later plans (atomic, under a lock)."""
    if not (seconds > 0 and math.isfinite(seconds)):
        return None
    # phases as [name, seconds] pairs: in the order vLLM went through them (a JSON object's
    # keys are sorted when the store is written)
    row = {"seconds": round(seconds, STORED_DIGITS),
           "phases": [[p, round(v, STORED_DIGITS)] for p, v in phases.items()],
           "source": source, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    k = key(d, load_path)

    def add(data: dict[str, Any]) -> None:
        data[k] = row

    return update_json_object(_store(), add)
