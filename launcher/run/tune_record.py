"""tune.json as `vlaunch tune` keeps it: the document, the earlier run's finished trials
(`--resume`), one record per trial, the choice, and the plan that `vlaunch exec` runs.

Why a module of its own: the loop (`tune.Tuner`) decides what to start; what is kept about
each start, and how a later run reads it back, is bookkeeping with its own rules (an
infeasible trial is never started again; a failure of the environment is no verdict on the
flags and is retried), tested without an engine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import __version__
from ..deployment.codec import to_json
from ..deployment.plan import Deployment
from ..errors import InputError
from ..paths import loads_json, read_small_text
from .emit import atomic_write
from .tune_candidates import TrialSpec
from .tune_report import decide, score, summary
from .tune_search import utc_now

TUNE_FILE = "tune.json"
SCHEMA = 1


class TuneRecord:
    """The tune.json document of one run, and the finished trials of the run before it."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.doc: dict[str, Any] = {}
        self.previous: dict[tuple[int, str], dict[str, Any]] = {}

    def load_previous(self, resume: bool) -> None:
        """Finished trials of an earlier run into the same folder (`--resume`). A trial whose
        start failed for the environment (vLLM missing, no GPU, the driver) says nothing
        about its flags: it is not finished, and is started again."""
        path = self.dir / TUNE_FILE
        if not resume or not path.exists():
            return
        try:
            old = loads_json(read_small_text(path))
        except (OSError, ValueError) as e:
            raise InputError(f"--resume: cannot read {path} ({e})") from None
        for t in old.get("trials", []):
            if t.get("environment"):
                continue
            if t.get("status") in ("ok", "infeasible"):
                self.previous[(int(t.get("rung", 0)), t.get("key", ""))] = t
            if t.get("status") == "infeasible":
                self.previous[(-1, t.get("key", ""))] = t  # never started again, any rung

    def new(self, baseline: TrialSpec, notes: list[str], o: Any) -> None:
        from ..predict.features.capabilities import installed_vllm

        self.doc = {
            "schema": SCHEMA, "vlaunch_version": __version__,
            "vllm_version": installed_vllm() or baseline.plan.vllm_version,
            "started_at": utc_now(), "updated_at": utc_now(), "finished_at": None,
            "status": "running",
            "model": to_json(baseline.plan.model), "gpus": to_json(baseline.plan.hardware),
            "workload": {"input_len": o.workload.input_len, "output_len": o.workload.output_len,
                         "name": o.workload.name},
            "slo": {"ttft_ms": o.slo.ttft_ms, "tpot_ms": o.slo.tpot_ms,
                    "threshold": o.threshold},
            "objective": o.objective,
            "settings": {"budget_s": o.budget_s, "max_starts": o.max_starts, "seed": o.seed,
                         "eta": o.eta, "rungs": o.rungs, "max_concurrency": o.max_concurrency,
                         "resume": o.resume},
            "notes": notes, "starts": 0, "elapsed_s": 0.0,
            "baseline": None, "recommended": None, "trials": [],
        }

    def save(self, starts: int, elapsed_s: float) -> None:
        self.doc["updated_at"] = utc_now()
        self.doc["starts"] = starts
        self.doc["elapsed_s"] = round(elapsed_s, 1)
        atomic_write(self.dir / TUNE_FILE, json.dumps(self.doc, indent=2, default=str) + "\n")

    def trial(self, t: TrialSpec, rung: int) -> dict[str, Any]:
        """A new trial's record, "skipped / not reached" until something happens to it."""
        rec = {"name": t.name, "source": t.source, "rung": rung, "key": t.key,
               "vllm_args": t.vllm_args, "env": t.env, "pins": t.pins,
               "predicted": t.predicted, "status": "skipped", "cause": "not reached",
               "started_at": None, "finished_at": None, "startup_s": None,
               "knee": None, "warmup": None, "results": []}
        self.doc["trials"].append(rec)
        return rec

    def decide(self, slo: Any) -> None:
        """Best so far and the baseline beside it, into the document (see tune_report.decide)."""
        self.doc["baseline"], self.doc["recommended"] = decide(self.doc["trials"], slo)

    def best_partial(self, out: Callable[[str], None]) -> bool:
        """No finished trial: say what the cut-short ones measured (kept in tune.json, re-run
        by --resume), so an interruption still answers "how far did it get". False when
        nothing was measured at all."""
        cut = [r for r in self.doc["trials"] if r.get("knee") and r["knee"]["concurrency"]]
        if not cut:
            out("vlaunch: no configuration was measured; nothing to recommend "
                f"(status: {self.doc['status']})")
            return False
        best = max(cut, key=score)
        self.doc["best_so_far"] = {**summary(best), "final": False}
        k = best["knee"]
        out(f"best so far ({self.doc['status']}; not final, no plan.json): {best['name']}: "
            f"SLO met up to concurrency {k['concurrency']} at least, "
            f"{k['goodput_rps']:.2f} req/s goodput; --resume measures it again")
        return True

    def recommended_plan(self, rec: dict[str, Any], specs: dict[str, TrialSpec]) -> Deployment:
        """The plan that `vlaunch exec --plan` runs: the planner's own plan of the chosen
        candidate (exec re-plans from its fields), with what was measured beside it."""
        trial = next(r for r in self.doc["trials"] if r["name"] == rec["trial"]
                     and r["rung"] == rec["rung"])
        spec = specs.get(trial["key"])
        if spec is None:  # resumed from a run whose candidates differ: the baseline's plan
            spec = next(iter(specs.values()))
        dep = spec.plan
        tuned = json.loads(json.dumps({
            "tune_json": str(self.dir / TUNE_FILE), "trial": rec["trial"],
            "concurrency": rec["concurrency"], "measured": rec["measured"],
            "slo": self.doc["slo"], "workload": self.doc["workload"],
            "extra_args": trial["pins"].get("extra_args", [])}))
        perf = dep.performance
        if perf is not None:
            perf = dataclasses.replace(perf, measured=json.loads(json.dumps(
                {"source": "measured", "concurrency": rec["concurrency"], **rec["measured"]})))
            pools = (dataclasses.replace(dep.pool, performance=perf), *dep.pools[1:])
            dep = dataclasses.replace(dep, performance=perf, pools=pools)
        return dataclasses.replace(dep, tuned=tuned)
