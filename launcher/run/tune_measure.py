"""`vlaunch tune`'s measurement of one running engine: warm-up, the knee search, repeats.

Why its own unit: this is where the numbers in tune.json come from. On an engine that has
answered its smoke request, an uncounted warm-up runs first (the load generator's imports, the
engine's first batches), then the concurrency search for the SLO knee (`tune_search`); a point
whose verdict is fragile is measured again and pooled. A trial that runs MTP measures its
draft's acceptance on natural prompts between the two (`tune_acceptance` says why not on the
knee's random prompts). Every point is written into the trial's
record, and saved, as it comes: a kill loses at most one. The budget and signals are checked
between points, and a cut-short search still leaves the knee it found.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..inputs.prompts import PromptSet
from ..inputs.workload import SLO, Workload
from ..predict.features.speculative import measured_acceptance, record_acceptance
from . import tune_acceptance
from .loadgen import LoadgenError, LoadSpec
from .runner import VllmRunner
from .tune_candidates import TrialSpec
from .tune_report import ms
from .tune_search import RESOLUTION, KneeSearch, flat_point, fragile, knee_of, pooled
from .vllmargs import arg_value

PROMPTS_PER_CONCURRENCY = (3, 4)
"""Requests per point (early rungs, last rung) as a multiple of the concurrency: at least three
waves, so the burst at t=0 is not the whole measurement."""

MIN_PROMPTS = 8
MAX_REPEATS = 2
STOP_MARGIN_S = 30.0
"""Kept free at the end of the budget: stopping vLLM's group (SIGTERM, grace, SIGKILL)."""


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived: stop, keep what was measured."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class BudgetExhausted(Exception):
    """The wall-clock budget is spent: stop measuring, keep what was measured."""


class Reporter(Protocol):
    """What the measurement needs of tune's progress line: the budget left and two ways to
    speak (a line, a heartbeat)."""

    @property
    def left(self) -> float: ...

    def line(self, text: str) -> None: ...

    def tick(self, text: str) -> None: ...


def max_concurrency(t: TrialSpec, given: int | None) -> int:
    """The search's ceiling: the user's, else 4x the engine's batch room (past max-num-seqs
    requests queue, and TTFT finds the knee)."""
    if given:
        return given
    seqs = int(arg_value(t.vllm_args, "max_num_seqs") or t.plan.engine.max_num_seqs)
    dp = t.plan.engine.parallel.dp
    return max(64, 4 * seqs * dp)


@dataclass
class TrialMeasurement:
    """Measure `trial` on `runner` (ready), writing points, knee, status and cause into `rec`.

    `fine`: the last rung (more prompts, a finer knee). `hint`: the knee an earlier rung found.
    `check()` raises Interrupted or BudgetExhausted between points; `save()` writes tune.json.
    `acceptance`: for an MTP trial, the natural prompts (the set, the file sent, how many) its
    draft's acceptance is measured on.
    """

    runner: VllmRunner
    trial: TrialSpec
    rec: dict[str, Any]
    loadgen: Any
    progress: Reporter
    workload: Workload
    slo: SLO
    threshold: float
    seed: int
    ceiling: int
    fine: bool
    hint: int | None
    tokenizer: str | None
    model_name: str  # the profile MTP acceptance is recorded for
    save: Callable[[], None]
    check: Callable[[], None]
    acceptance: tuple[PromptSet, Path, int] | None = None

    def run(self) -> str | None:
        """Warm up, search, record the knee; the cause when the search was cut short (the
        benchmark failed, the budget ran out), None when it ran to the end. Interrupted is
        raised on, after the knee so far is recorded."""
        self._repeats = 0
        search = KneeSearch(self._probe, self.ceiling, RESOLUTION[int(self.fine)], self.hint)
        rec, cause = self.rec, None
        try:
            with self.loadgen:
                rec["warmup"] = self._warmup()
                if self.acceptance is not None:
                    rec["mtp_acceptance"] = self._measure_acceptance(*self.acceptance)
                    self.save()
                search.run()
        except LoadgenError as e:
            cause = f"the benchmark failed: {e}"
            if self.runner.poll() is not None:
                cause = f"vLLM exited during the measurement (status {self.runner.exit_status})"
        except BudgetExhausted:
            cause = "the budget ran out during the measurement (knee from what was measured)"
        except Interrupted:
            rec["knee"] = knee_of(rec["results"], search)
            rec["status"], rec["cause"] = "failed", "interrupted; kept what was measured"
            raise
        rec["knee"] = knee_of(rec["results"], search)
        if cause and not rec["knee"]:
            rec["status"], rec["cause"] = "failed", cause
        else:
            rec["status"], rec["cause"] = "ok", cause
            if cause:
                rec["partial"] = True
        return cause

    # --- one point ---------------------------------------------------------------------------

    def _timeout(self) -> float:
        left = self.progress.left - STOP_MARGIN_S
        if left <= 0:
            raise BudgetExhausted()
        return left

    def _heartbeat(self, c: int | str) -> Callable[[float], None]:
        def beat(waited: float) -> None:
            what = (c if isinstance(c, str) else f"concurrency {c}") if c else "warm-up"
            self.progress.tick(f"  {what}: measuring ({waited:.0f}s)")
            if self.runner.interrupted is not None:
                raise Interrupted(self.runner.interrupted)
        return beat

    def _load_spec(self, c: int, prompts: int, warmups: int) -> LoadSpec:
        r = self.runner
        tokenizer = self.tokenizer or arg_value(r.vllm_args, "model") or r.model_name
        return LoadSpec(r.base_url, r.model_name, tokenizer, self.workload.input_len,
                        self.workload.output_len, c, prompts, self.seed, self.slo.ttft_ms,
                        self.slo.tpot_ms, warmups)

    def _warmup(self) -> dict[str, Any]:
        """An uncounted run first: the child's imports, the engine's first batches."""
        t0 = time.monotonic()
        s = self.loadgen.run(self._load_spec(2, 4, 0), timeout=self._timeout(),
                             heartbeat=self._heartbeat(0))
        self.progress.line(f"  warm-up done in {time.monotonic() - t0:.0f}s (not counted)")
        return {"seconds": round(time.monotonic() - t0, 1), "completed": s["completed"]}

    def _measure_acceptance(self, prompts: PromptSet, path: Path, n: int) -> dict[str, Any]:
        """The draft's acceptance on natural prompts (see tune_acceptance), recorded for the
        model's next plans with its source. A failed run loses the figure, not the trial (the
        knee search that follows says whether the engine is still there)."""
        spec = tune_acceptance.load_spec(self._load_spec(1, 1, 0), path, n,
                                         self.workload.output_len)
        self.progress.line(f"  MTP acceptance on {prompts.describe()}: {n} requests, "
                           f"{spec.concurrency} in flight")
        try:
            record = tune_acceptance.measure(
                lambda s: self.loadgen.run(s, timeout=self._timeout(),
                                           heartbeat=self._heartbeat("MTP acceptance")),
                spec, prompts)
        except LoadgenError as e:
            if self.progress.left <= STOP_MARGIN_S + 1:  # cut off by the budget
                raise BudgetExhausted() from None
            record = {"source": prompts.describe(), "error": f"the benchmark failed: {e}"[:500]}
        if "first" in record:
            record_acceptance(self.model_name, record, source=record["source"])
            self.progress.line(f"  MTP acceptance: first draft {record['first']:.0%}, "
                               f"{record['acceptance_length']:.2f} tokens per step")
        else:
            self.progress.line(f"  MTP acceptance not measured: {record['error'][:200]}")
        return record

    def _one(self, c: int, repeat: int) -> dict[str, Any]:
        per_c = PROMPTS_PER_CONCURRENCY[int(self.fine)]
        spec = self._load_spec(c, max(MIN_PROMPTS, per_c * c), min(c, 4))
        try:
            s = self.loadgen.run(spec, timeout=self._timeout(), heartbeat=self._heartbeat(c))
        except LoadgenError:
            if self.progress.left <= STOP_MARGIN_S + 1:  # cut off by the budget
                raise BudgetExhausted() from None
            raise
        point = flat_point(s, self.slo, self.threshold, repeat)
        self.rec["results"].append(point)
        acc = measured_acceptance(point.get("raw") or {})
        if acc:  # on random tokens: kept for comparison, never recorded for planning
            self.rec["mtp_acceptance_random"] = {**acc, "source": "random-token prompts of the "
                                                 "knee search (not used for planning)"}
        self.save()
        return point

    def _probe(self, c: int) -> bool:
        """Does concurrency `c` meet the SLO? Measured again (and pooled) when fragile."""
        self.check()
        points = [self._one(c, 0)]
        while (fragile(points[-1], self.slo, self.threshold) and self._repeats < MAX_REPEATS
               and len(points) < 2):
            self._repeats += 1
            self.progress.line(f"  concurrency {c}: verdict within 10% of the SLO, "
                               "measuring again")
            self.check()
            points.append(self._one(c, len(points)))
        p = pooled(points)
        met = p["failed"] == 0 and p["slo_fraction"] >= self.threshold
        self.progress.line(
            f"  concurrency {c:>4}: {p['output_tokens_per_s']:8.1f} tok/s, TTFT p50/p99 "
            f"{ms(p['ttft_p50_ms'])}/{ms(p['ttft_p99_ms'])}, TPOT p50/p99 "
            f"{ms(p['tpot_p50_ms'])}/{ms(p['tpot_p99_ms'])}, SLO met by "
            f"{p['slo_fraction']:.0%} -> {'meets' if met else 'misses'}")
        return met
