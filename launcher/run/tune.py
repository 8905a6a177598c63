"""`vlaunch tune`: measure candidate configurations on the real engine, choose by goodput.

The planner predicts; this module measures. Why each piece is the way it is:

- Candidates come from the planner (`make_plan` over variants of the knobs that need a restart:
  max_num_seqs, max_num_batched_tokens, kv dtype, enforce-eager, the layout where the hardware
  has one to choose), only those it predicts to start, ranked by its predicted goodput. Starting
  an engine costs minutes on a GPU node, so a blind grid or a utilization descent is what this
  avoids.
- vLLM's defaults (the model, its context and the memory sizing it needs to start; every tuned
  knob left to vLLM) are always measured in the same run: a recommendation is only worth its
  gain over what a user gets without vlaunch.
- Outer loop: successive halving over engine starts. Rung 0 measures several candidates
  coarsely; the best of each rung are restarted and measured more finely (more prompts, a finer
  knee) while `--max-starts` and the wall-clock `--budget` allow. A start that fails is
  classified (`vllmlog.classify_failure`) and marked infeasible with its cause; the same flags are
  never started again, in this run or on `--resume`.
- Inner loop on a running engine: an uncounted warm-up, then a concurrency search for the SLO
  knee (the largest concurrency where at least `threshold` of the completed requests meet both
  the TTFT and the TPOT objective), doubling then bisecting; a point whose verdict would flip
  within +-10% of the SLO is measured again and pooled. Load comes from vLLM's own benchmark
  (`launcher.run.loadgen`, in a child process).
- MTP trials also measure the draft's acceptance on natural text (the user's `--dataset` or
  the project's own prompts) in a short run of their own (`tune_acceptance`, which says why
  not on the knee's random prompts); only that figure is recorded for the next plans.
- Everything measured is kept: `tune.json` is rewritten atomically after every point, so a
  kill -9 loses at most one point, and `--resume` skips finished trials. Ctrl-C/SIGTERM stop the
  engine, keep what was measured and report the best so far.

Parts: `tune_candidates` (what is worth a start), `tune_search` (rungs, the knee search, when a
point is measured again), `tune_measure` (one running engine: warm-up, search, repeats),
`tune_acceptance` (MTP acceptance on natural prompts), `tune_report` (the choice, the table,
the plot), `tune_record` (tune.json: the document, --resume, the recommended plan). This
module runs the loop: the rungs, each trial's engine life cycle, calibration.

Pure orchestration: no click; `out` receives the lines to print. Engine and load generator are
injectable (`runner_factory`, `loadgen_factory`) so the bookkeeping is tested without vLLM.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs.hardware import Hardware
from ..inputs.model import ModelSpec
from ..inputs.prompts import PromptSet, builtin_prompts
from ..inputs.workload import SLO, Workload
from ..predict.search.engine_from_plan import shape_from_plan
from ..predict.search.planner import Pins
from ..redact import SECRET_FLAGS, redact_args, redact_text, secret_flags
from ..term import bar, status
from . import tune_acceptance
from .emit import atomic_write, emit_plan, startup_deadline_s
from .exposure import exposure_warning, with_host
from .loadgen import LoadGenerator
from .runner import VllmRunner
from .startup_timing import learn_startup
from .tune_candidates import TrialSpec, build_candidates, finished_first
from .tune_candidates import flags_key as flags_key  # tests/test_tune_engine.py imports it here
from .tune_measure import (
    STOP_MARGIN_S,
    BudgetExhausted,
    Interrupted,
    TrialMeasurement,
    max_concurrency,
)
from .tune_record import TUNE_FILE, TuneRecord
from .tune_report import plot, score, table
from .tune_search import (
    THRESHOLD,
    rung_sizes,
    utc_now,
)
from .vllmargs import arg_value

STATUSES = ("ok", "infeasible", "failed", "skipped")

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s)")


# ----------------------------------------------------------------------------- input parsing


def parse_budget(text: str | float | int) -> float:
    """`20m`, `90s`, `1h30m`, `1.5h` or a plain number of seconds; more than zero."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        s = text.strip().lower()
        if re.fullmatch(r"\d+(?:\.\d+)?", s):
            seconds = float(s)
        elif s and re.fullmatch(r"(?:\d+(?:\.\d+)?\s*[hms]\s*)+", s):
            unit = {"h": 3600.0, "m": 60.0, "s": 1.0}
            seconds = sum(float(v) * unit[u] for v, u in _DURATION.findall(s))
        else:
            raise InputError(f"malformed --budget {text!r}: use e.g. 20m, 90s, 1h30m or seconds")
    if not seconds > 0 or math.isinf(seconds):
        raise InputError(f"--budget must be more than zero, got {text!r}")
    return seconds


def parse_candidate(text: str) -> list[str]:
    """One `--candidate`: vLLM flags measured on top of the defaults baseline, e.g.
    "--max-num-seqs 16" (a user's own idea, measured like the planner's)."""
    shown = redact_text(text)  # an error message must not echo a key either
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise InputError(f"malformed --candidate {shown!r}: {e}") from None
    if not args or not args[0].startswith("--"):
        raise InputError(f"--candidate {shown!r}: give vLLM flags, e.g. \"--max-num-seqs 16\"")
    if arg_value(args, "model") or arg_value(args, "port"):
        raise InputError("--candidate must not set --model or --port (tune sets them)")
    if flags := secret_flags(args):
        # A secret is no tuning knob, and a candidate's flags are printed and saved in
        # tune.json and plan.json: refused before anything can echo or record it.
        env = " / ".join(SECRET_FLAGS[f] for f in flags)
        raise InputError(f"--candidate must not carry {' or '.join(flags)} (it would be saved "
                         f"in tune.json and plan.json); set {env} in the environment instead")
    return args


def check_output_dir(path: str | os.PathLike[str]) -> Path:
    """The output folder exists (made if needed) and is writable; else one clear error."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"--output {out}: not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / ".vlaunch-write-test", "ok\n")
        (out / ".vlaunch-write-test").unlink()
    except OSError as e:
        raise InputError(f"--output {out}: cannot write there ({e.strerror or e})") from None
    return out


# ----------------------------------------------------------------------------- the tuner


@dataclass
class TuneOptions:
    workload: Workload
    slo: SLO
    objective: str = "balanced"
    budget_s: float = 1200.0
    max_starts: int = 6
    output: Path = Path("tune")
    resume: bool = False
    seed: int = 0
    threshold: float = THRESHOLD
    max_concurrency: int | None = None
    rungs: int | None = None
    eta: int = 2
    user_candidates: list[list[str]] = field(default_factory=list)
    startup_timeout: float | None = None
    plot: bool = False
    verbose: bool = False
    calibrate: bool = True
    prompts: PromptSet | None = None
    """The user's `--dataset` (inputs.prompts.load_prompts); None: the built-in natural prompts.
    Used only to measure MTP acceptance."""


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Elapsed time and budget left on every line; heartbeats while waiting (in place on a
    terminal, one line each otherwise) so the user never waits in silence."""

    def __init__(self, budget_s: float, out: Callable[[str], None],
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.t0 = clock()
        self.budget_s = budget_s
        self.out = out
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._pending = False

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed

    def stamp(self) -> str:
        return f"[{_fmt_s(self.elapsed):>6} | {_fmt_s(self.left):>6} left]"

    def line(self, text: str) -> None:
        with self._lock:
            if self._pending:
                sys.stderr.write("\n")
                self._pending = False
            self.out(f"{self.stamp()} {text}")

    def tick(self, text: str) -> None:
        with self._lock:
            if self.tty:  # in place, behind a bar of the budget spent
                spent = self.elapsed / self.budget_s if self.budget_s > 0 else 1.0
                status(f"{bar(spent, 20)} {self.stamp()} {text}")
                self._pending = True
            else:
                self.out(f"{self.stamp()} {text}")


RunnerFactory = Callable[..., VllmRunner]
LoadgenFactory = Callable[[Path], Any]


def _default_runner(args: list[str], env: dict[str, str | None], **kw: Any) -> VllmRunner:
    # Trials are measured from this machine: vLLM listens on loopback only (a candidate's own
    # --host wins, and is warned about by the caller when it reaches beyond this machine).
    return VllmRunner(with_host(args), env=env, **kw)


def _default_loadgen(log_path: Path) -> LoadGenerator:
    return LoadGenerator(log_path=log_path)


class EnvironmentFailed(Exception):
    """A start failed for the machine (vLLM or a module missing, no driver, no GPU): the run
    stops, and the trial is no verdict on its flags."""


class Tuner:
    """One `vlaunch tune` run. `run()` returns the exit status (0, or 128 + signal)."""

    def __init__(self, spec: ModelSpec, hw: Hardware, pins: Pins, opts: TuneOptions, *,
                 out: Callable[[str], None] = print, log: Callable[[str], None] | None = None,
                 runner_factory: RunnerFactory = _default_runner,
                 loadgen_factory: LoadgenFactory = _default_loadgen,
                 progress: Progress | None = None, tokenizer: str | None = None) -> None:
        self.spec, self.hw, self.pins, self.opts = spec, hw, pins, opts
        self.out = out
        self.runner_factory = runner_factory
        self.loadgen_factory = loadgen_factory
        self.progress = progress or Progress(opts.budget_s, log or out)
        self.tokenizer = tokenizer
        self.dir = Path(opts.output)
        self.starts = 0
        self.interrupted: int | None = None
        self.record = TuneRecord(self.dir)
        self.startup_times: list[float] = []
        self._specs: dict[str, TrialSpec] = {}
        self._sizes: list[int] = []
        self._acceptance: tuple[PromptSet, Path, int] | None = None

    # --- bookkeeping (tune_record.TuneRecord) --------------------------------------------

    @property
    def doc(self) -> dict[str, Any]:
        return self.record.doc

    @property
    def previous(self) -> dict[tuple[int, str], dict[str, Any]]:
        return self.record.previous

    def save(self) -> None:
        self.record.save(self.starts, self.progress.elapsed)

    def _trial_record(self, t: TrialSpec, rung: int) -> dict[str, Any]:
        return self.record.trial(t, rung)

    def _decide(self) -> None:
        self.record.decide(self.opts.slo)

    # --- signals -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """Outside a running engine a signal only sets a flag; the loop stops at its next
        check (inside one, the runner forwards it to vLLM's group)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: object) -> None:  # noqa: ARG001
            self.interrupted = signum

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _check(self, runner: VllmRunner | None = None) -> None:
        if runner is not None and runner.interrupted is not None:
            self.interrupted = runner.interrupted
        if self.interrupted is not None:
            raise Interrupted(self.interrupted)
        if self.progress.left <= STOP_MARGIN_S:
            raise BudgetExhausted()

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        o = self.opts
        if o.max_starts < 1:
            raise InputError("--max-starts must be at least 1")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.record.load_previous(o.resume)
        self.progress.line(f"planning candidates for {self.spec.name} ...")
        baseline, cands, notes = build_candidates(self.spec, self.hw, self.pins, o.workload,
                                                  o.slo, o.objective, o.user_candidates)
        self.record.new(baseline, notes, o)
        self.save()
        if self.previous:  # --resume: among equally ranked candidates, the finished first
            cands = finished_first(cands, {k for _, k in self.previous})
        pool = [baseline, *cands]
        self.doc["notes"] += self._prepare_acceptance(pool)
        if self._acceptance:
            prompts, path, n = self._acceptance
            self.doc["acceptance_prompts"] = {**prompts.to_dict(), "file": str(path), "sent": n}
        self.save()
        self._specs = {t.key: t for t in pool}
        sizes = rung_sizes(len(pool), o.max_starts, o.eta, o.rungs)
        self._sizes = sizes
        self.progress.line(f"tune {self.spec.name} on {self.hw.describe()}: "
                           f"{o.workload.describe()}, SLO {o.slo.describe()} for "
                           f"{o.threshold:.0%} of requests; {len(pool)} candidates "
                           f"({len(cands)} from the planner), rungs {sizes}, "
                           f"at most {o.max_starts} starts")
        for n in notes:
            self.progress.line(f"note: {n}")
        status = 0
        with self._signals():
            try:
                self._halving(pool, sizes)
                self.doc["status"] = "done"
            except Interrupted as e:
                self.doc["status"] = f"interrupted by {signal.Signals(e.signum).name}"
                status = 128 + e.signum
            except BudgetExhausted:
                self.doc["status"] = "budget spent"
            except EnvironmentFailed as e:
                self.doc["status"] = f"stopped: the environment failed ({e})"
                self._decide()
                self.doc["finished_at"] = utc_now()
                self.save()
                self.out(f"vlaunch: error: vLLM could not start on this machine, whatever the "
                         f"flags: {str(e)[:300]}; fix the environment (`vlaunch doctor "
                         f"{self.dir}` reads the logs) and rerun with --resume")
                return 2
        self._finish()
        return status

    def _prepare_acceptance(self, pool: list[TrialSpec]) -> list[str]:
        """The natural prompts MTP trials measure acceptance on, written into the output
        folder; notes for tune.json (a --dataset that no trial needs is said to be unused)."""
        o = self.opts
        if not any(tune_acceptance.runs_mtp(t.vllm_args) for t in pool):
            return (["--dataset is used only to measure MTP acceptance, and no candidate runs "
                     "MTP: not used"] if o.prompts else [])
        prompts = o.prompts or builtin_prompts()
        path, n = tune_acceptance.prepare(prompts, self.dir, o.seed)
        self._acceptance = (prompts, path, n)
        return [f"MTP acceptance is measured on {prompts.describe()}, not on the knee's random "
                "prompts"]

    def _halving(self, pool: list[TrialSpec], sizes: list[int]) -> None:
        entrants = pool[:sizes[0]] if sizes else []
        try:
            self._rungs(pool, entrants, sizes)
        finally:
            recorded = {r["key"] for r in self.doc["trials"]}
            for t in pool:
                if t.key in recorded:
                    continue
                rec = self._trial_record(t, 0)
                rec["cause"] = ("not reached: the run stopped first" if t in entrants else
                                "not measured: the planner ranked it below the rung-0 entrants")

    def _rungs(self, pool: list[TrialSpec], entrants: list[TrialSpec], sizes: list[int]) -> None:
        for rung, size in enumerate(sizes):
            if rung > 0:
                ok = [r for r in self.doc["trials"] if r["rung"] == rung - 1
                      and r["status"] == "ok"]
                if len(ok) < 2:
                    break
                ok.sort(key=lambda r: -score(r))
                by_key = {t.key: t for t in pool}
                entrants = [by_key[r["key"]] for r in ok[:size]]
                self.progress.line(f"rung {rung}: restarting the best {len(entrants)} of "
                                   f"{len(ok)} for a finer measurement")
            for t in entrants:
                self._trial(t, rung)
                self._decide()
                self.save()

    # --- one trial -----------------------------------------------------------------------

    def _trial(self, t: TrialSpec, rung: int) -> None:
        rec = self._trial_record(t, rung)
        done = self.previous.get((rung, t.key)) or self.previous.get((-1, t.key))
        if done is not None:
            rec.update({k: v for k, v in done.items() if k not in ("rung",)})
            rec["resumed"] = True
            self.progress.line(f"{t.name}: {done['status']} in the earlier run, not "
                               "started again (--resume)")
            return
        failed = [r for r in self.doc["trials"] if r is not rec and r["key"] == t.key
                  and r["status"] == "infeasible"]
        if failed:
            rec["status"], rec["cause"] = "skipped", (f"same flags as '{failed[0]['name']}', "
                                                      f"which was infeasible")
            return
        if self.starts >= self.opts.max_starts:
            rec["cause"] = "--max-starts reached"
            return
        self._check()
        estimate = self._start_estimate(t)
        if self.progress.left - STOP_MARGIN_S < estimate:
            rec["cause"] = (f"budget: {_fmt_s(self.progress.left)} left, a start takes about "
                            f"{_fmt_s(estimate)}")
            self.progress.line(f"{t.name}: skipped ({rec['cause']})")
            return
        self._run_engine(t, rec, rung)

    def _start_estimate(self, t: TrialSpec) -> float:
        if self.startup_times:
            return max(self.startup_times)
        return 0.0  # nothing known yet: try, with the budget as the start-up deadline

    def _startup_deadline(self, t: TrialSpec) -> float:
        deadline = self.opts.startup_timeout or startup_deadline_s(t.plan)
        return max(1.0, min(deadline, self.progress.left - STOP_MARGIN_S))

    def _run_engine(self, t: TrialSpec, rec: dict[str, Any], rung: int) -> None:
        self.starts += 1
        n = self.starts
        log_path = self.dir / f"vllm-trial{n}.log"
        rec.update(started_at=utc_now(), status="failed", cause="started", log=str(log_path))
        self.save()
        self.progress.line(f"start {n}/{self.opts.max_starts} (rung {rung}): {t.name}")
        if self.opts.verbose:
            self.progress.line("  vllm " + shlex.join(redact_args(t.vllm_args)))
        if arg_value(t.vllm_args, "host") and (warning := exposure_warning(t.vllm_args,
                                                                              t.env)):
            self.progress.line(f"  {warning}")
        env: dict[str, str | None] = dict(t.env)
        if arg_value(t.vllm_args, "kv_cache_memory_bytes"):
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would replace the pinned bytes
        runner = self.runner_factory(
            list(t.vllm_args), env, log_path=log_path, startup_timeout=self._startup_deadline(t),
            grace_period=10.0,
            on_phase=lambda phase: self.progress.line(f"  {phase}"))
        t0 = time.monotonic()
        with runner, runner.forward_signals():
            runner.start()
            # the log is always a new file: a resumed run's old one keeps its name
            rec["log"] = str(getattr(runner, "log_path", None) or log_path)
            outcome = self._wait_ready(runner, t)
            rec["startup_s"] = round(time.monotonic() - t0, 1)
            if not outcome.ready:
                self._start_failed(rec, outcome, runner)
                return
            self.startup_times.append(rec["startup_s"])
            if timed := learn_startup(runner, t.plan, None):
                self.progress.line(f"  {timed}")
            smoke = runner.smoke_test(timeout=max(5.0, min(120.0, self.progress.left
                                                           - STOP_MARGIN_S)))
            if not smoke.ok:
                rec["status"], rec["cause"] = "infeasible", (
                    f"started, but the first request failed: {(smoke.error or '')[:300]}")
                self.progress.line(f"  infeasible: {rec['cause']}")
                return
            self.progress.line(f"  ready in {rec['startup_s']:.0f}s; measuring")
            try:
                self._measure(runner, t, rec, rung)
            finally:
                rec["finished_at"] = utc_now()
                self.save()
        self._check(runner)

    def _wait_ready(self, runner: VllmRunner, t: TrialSpec):
        """wait_ready, with a heartbeat line every few seconds while vLLM loads."""
        stop = threading.Event()

        def beat() -> None:
            t0 = time.monotonic()
            while not stop.wait(5.0):
                self.progress.tick(f"  starting {t.name}: {runner.phase or 'starting'} "
                                   f"({time.monotonic() - t0:.0f}s)")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            return runner.wait_ready()
        finally:
            stop.set()
            thread.join(timeout=1)

    def _start_failed(self, rec: dict[str, Any], outcome: Any, runner: VllmRunner) -> None:
        rec["finished_at"] = utc_now()
        if outcome.reason == "interrupted":
            rec["status"], rec["cause"] = "failed", "interrupted during start-up"
            self._check(runner)
        f = outcome.failure
        if outcome.reason == "timeout" and self.progress.left <= STOP_MARGIN_S + 1:
            rec["status"], rec["cause"] = "skipped", "the budget ran out during start-up"
        elif outcome.reason == "timeout":
            rec["status"], rec["cause"] = "infeasible", (
                f"start-up hung past {runner.startup_timeout:.0f}s (phase {outcome.phase})")
        elif f is not None and f.environment:
            # the machine failed, not the flags: no verdict on them (--resume starts them
            # again), and every other start would fail the same way
            rec["status"], rec["environment"] = "failed", True
            rec["cause"] = f"environment: {f.message}"
            rec["failure"] = f.to_dict()
            self.progress.line(f"  {rec['status']}: {rec['cause'][:300]}")
            raise EnvironmentFailed(f.message)
        else:
            rec["status"] = "infeasible"
            rec["cause"] = (f"{f.kind}: {f.message}" if f else
                            f"vLLM exited with status {outcome.returncode} during start-up")
            rec["failure"] = f.to_dict() if f else None
        self.progress.line(f"  {rec['status']}: {rec['cause'][:300]}")

    # --- measuring -----------------------------------------------------------------------

    def _measure(self, runner: VllmRunner, t: TrialSpec, rec: dict[str, Any], rung: int) -> None:
        """Measure the running engine (tune_measure), then calibrate and report the knee."""
        o = self.opts
        hint = None
        if rung > 0:
            prev = [r for r in self.doc["trials"] if r["key"] == t.key and r["rung"] < rung
                    and r.get("knee")]
            hint = prev[-1]["knee"]["concurrency"] if prev else None
        measurement = TrialMeasurement(
            runner, t, rec, self.loadgen_factory(self.dir / f"loadgen-trial{self.starts}.log"),
            self.progress, o.workload, o.slo, o.threshold, o.seed,
            max_concurrency(t, o.max_concurrency),
            fine=rung >= len(self._sizes) - 1,  # the last rung measures finely
            hint=hint, tokenizer=self.tokenizer, model_name=self.spec.name, save=self.save,
            check=lambda: self._check(runner),
            acceptance=self._acceptance if tune_acceptance.runs_mtp(t.vllm_args) else None)
        cause = measurement.run()
        if rec["status"] == "ok":
            self._calibrate(t, rec)
        k = rec["knee"] or {}
        bound = "bounded" if k.get("bounded") else "SLO met up to the largest tried"
        self.progress.line(f"  {rec['status']}: knee at concurrency {k.get('concurrency')} "
                           f"({bound}), goodput {k.get('goodput_rps') or 0:.2f} req/s"
                           + (f"; {cause}" if cause else ""))
        if cause and "budget" in cause:
            raise BudgetExhausted()

    def _calibrate(self, t: TrialSpec, rec: dict[str, Any]) -> None:
        """Teach the performance model what was measured (launcher.predict.speed.calibration)."""
        if not self.opts.calibrate or not rec["results"]:
            return
        from ..predict.speed import calibration

        points = [{k: p[k] for k in ("concurrency", "input_len", "output_len",
                                     "output_tokens_per_s", "tpot_ms", "ttft_ms")}
                  for p in rec["results"] if p["completed"]]
        try:
            from ..paths import cache_dir

            cache_dir().mkdir(parents=True, exist_ok=True)  # record() writes beside it
            path = calibration.record(t.plan, points, f"vlaunch tune {utc_now()}",
                                      shape_from_plan(t.plan))
        except Exception as e:  # noqa: BLE001 - a calibration problem must not lose the trial
            rec["calibration"] = f"not recorded: {type(e).__name__}: {e}"
            return
        rec["calibration"] = str(path)

    # --- the end -------------------------------------------------------------------------

    def _finish(self) -> None:
        self._decide()
        self.doc["finished_at"] = utc_now()
        self.save()
        for line in self.table():
            self.out(line)
        rec = self.doc["recommended"]
        if rec is None:
            if self.record.best_partial(self.out):
                self.save()
            return
        plan = self.record.recommended_plan(rec, self._specs)
        emit_plan(plan, self.dir)
        self.out(f"recommended: {rec['trial']} at concurrency {rec['concurrency']}: "
                 f"{rec['measured']['goodput_rps']:.2f} req/s goodput, "
                 f"{rec['measured']['output_tokens_per_s']:.1f} output tok/s")
        self.out(f"  why: {rec['why']}")
        self.out(f"  {self.dir / TUNE_FILE}; run it: vlaunch exec --plan "
                 f"{self.dir / 'plan.json'}" + (
                     " -- " + shlex.join(redact_args(list(plan.tuned["extra_args"])))
                     if plan.tuned and plan.tuned.get("extra_args") else ""))
        if self.opts.plot:
            self._plot()

    def _spec_of(self, trial: dict[str, Any]) -> TrialSpec | None:
        return self._specs.get(trial["key"])

    def table(self) -> list[str]:
        """One row per trial (see tune_report.table)."""
        return table(self.doc["trials"])

    def _plot(self) -> None:
        def plan_of(trial: dict[str, Any]) -> Deployment | None:
            spec = self._spec_of(trial)
            return spec.plan if spec else None

        plot(self.doc["trials"], plan_of, self.opts.slo, self.dir / "tune.png", self.out)


def tune(spec: ModelSpec, hw: Hardware, pins: Pins, opts: TuneOptions, *,
         out: Callable[[str], None] = print, **kw: Any) -> tuple[int, dict[str, Any]]:
    """Run a tune; (exit status, the tune.json document)."""
    tuner = Tuner(spec, hw, pins, opts, out=out, **kw)
    status = tuner.run()
    return status, tuner.doc
