"""`vlaunch serve`: plan, start vLLM, check what it allocated, recover, keep serving.

The loop: plan -> start vLLM on the plan's arguments (a user's own flags after `--` win, and
are reported) -> wait for /health and /v1/models -> compare what vLLM logged with the plan ->
one short completion. A start-up that dies of vLLM's KV shortage, CUDA OOM or its free-memory
check is re-planned from what the failed attempt measured (a shorter context, a lower
utilization) and retried, up to `max_attempts`. A smoke request that fails on fp8 KV is a lesson
recorded in the capability cache, and the engine restarts with auto KV. The exporter serves
planned and actual numbers side by side for as long as vLLM runs.

A signal (SIGTERM, SIGINT, SIGHUP) ends the run wherever it arrives: vLLM is stopped (drained
for up to `stop_timeout`, then killed), nothing is retried or learnt, and the exit code is
128 + the signal. Each attempt logs to its own file (`vllm-<run id>-attempt<N>.log`), so a
second run in the same folder never reads the first one's lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..deployment.argv import pool_argv
from ..deployment.codec import dump
from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs import vllm_flags as F
from ..inputs.hardware import Hardware
from ..inputs.model import ModelSpec
from ..inputs.vllm_failures import classify
from ..observe.doctor import explain_log
from ..predict.features.capabilities import lesson_key, record_lesson
from ..predict.memory.budget import GiB
from ..predict.search.after_failure import merge_args, replan_pins
from ..predict.search.planner import Pins, Plan, make_plan
from ..redact import command_line_warning, redact_args, redact_env
from ..render import plan_text
from ..term import bar, fit, width
from ..term import command as command_lines
from . import vllmlog
from .drain import DEFAULT_STOP_TIMEOUT_S, with_drain
from .emit import startup_deadline_s
from .exporter_beside import set_actual, start_exporter, start_worker_exporter
from .exposure import exposure_warning, with_host
from .extra_args import parallel_flags, pins_from_extra
from .logpump import prefixed_echo
from .runner import VllmRunner
from .startup_timing import learn_startup
from .vllmargs import (
    DEFAULT_PORT,
    VLLM_COMMAND_ENV,
    arg_value,
    drop_flag,
    first_free_port,
    serve_both_names,
    vllm_command,
)


@dataclass
class Attempt:
    number: int
    args: list[str]  # as run, less secrets: results are printed (--format json) and kept
    outcome: str
    detail: str = ""

    def __post_init__(self) -> None:
        self.args = redact_args(self.args)


@dataclass
class ServeResult:
    exit_code: int
    attempts: list[Attempt] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    actual: dict[str, Any] | None = None
    command: list[str] | None = None  # a dry run: the argv vlaunch would execute
    env: dict[str, str] | None = None  # ... and the environment it adds


def next_attempt(pins: Pins, plan: Plan, failure: vllmlog.Failure | None, extra: list[str],
                 transient_retried: bool) -> tuple[Pins, list[str], str, bool] | None:
    """(pins, extra vLLM flags, why, same flags?) for the start after `failure`; None to stop.

    A deterministic failure is retried only with changed flags, re-planned from what the failed
    start measured; a transient one (`failure.transient`: memory changed during profiling, an
    NCCL timeout) may be retried once with the same flags. Both per issue 12, item 5.
    """
    if failure is None:
        return None
    fix = replan_pins(pins, plan, failure)
    if fix is not None:
        new_pins, why = fix
        new_extra = drop_flag(extra, F.flag("max_model_len")) if new_pins.max_model_len else extra
        if (new_pins, new_extra) != (pins, extra):
            return new_pins, new_extra, why, False
    if failure.transient and not transient_retried:
        return pins, extra, (f"{failure.cause or failure.kind} is transient; retrying once "
                             "with the same flags"), True
    return None


def verification_table(plan: Deployment, actual: Any) -> tuple[list[str], dict[str, Any]]:
    """Predicted vs actual per component, with the error; and the numbers as a dict."""
    pool = plan.pool
    kv = pool.kv_cache
    alloc = actual.allocation
    rows = [("KV cache tokens", kv.tokens, actual.kv_cache_tokens, "{:,.0f}"),
            ("KV blocks", kv.blocks, actual.num_blocks, "{:,.0f}"),
            ("block size", kv.block_size, actual.block_size, "{:,.0f}"),
            ("KV cache memory GiB", kv.memory_bytes / GiB,
             (actual.kv_cache_memory_bytes / GiB) if actual.kv_cache_memory_bytes
             else alloc.available_kv_gib, "{:,.2f}"),
            ("weights GiB (per GPU)", pool.per_gpu.weights_bytes / GiB, alloc.weights_gib,
             "{:,.2f}"),
            ("max concurrency", pool.max_concurrency, actual.max_concurrency, "{:,.2f}")]
    lines = [f"  {'':24} {'planned':>14} {'actual':>14} {'error':>8}"]
    numbers: dict[str, Any] = {}
    for name, want, got, fmt in rows:
        err = ""
        if want is not None and got is not None and want:
            err = f"{(got - want) / want:+.1%}"
        show = (lambda v, f=fmt: f.format(v) if v is not None else "-")  # noqa: E731
        lines.append(f"  {name:24} {show(want):>14} {show(got):>14} {err:>8}")
        numbers[name] = {"planned": want, "actual": got}
    return lines, numbers


_runs = itertools.count(1)


def new_run_id() -> str:
    """Names this run's logs apart from every other run's in the same folder (the time, the
    process, and which run of this process)."""
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}-{next(_runs)}"


_FP8_WORDS = re.compile(r"fp8|float8|e4m3|e5m2|kv_cache_dtype", re.I)


def smoke_says_fp8(error: str | None, logged: str) -> bool:
    """Does a failed first request blame fp8 KV? Its error or what vLLM logged meanwhile must
    say so (the doctor's kv_cache_dtype_unsupported); any other failure teaches nothing."""
    if error and _FP8_WORDS.search(error):
        return True
    if not logged.strip():
        return False
    root = classify(logged)
    return root is not None and root.cause == "kv_cache_dtype_unsupported"


def explain_failure(runner: VllmRunner, outcome: Any, out: Callable[[str], None],
                    lines: int = 8) -> None:
    """vLLM's last lines and the doctor's diagnosis, so a failed start shows its cause."""
    tail = [line for line in outcome.log_tail if line.strip()][-lines:]
    if tail:
        out(f"vlaunch: vLLM's last lines (all in {runner.log_path}):")
        for line in tail:
            out(f"  | {line[:400]}")
    with contextlib.suppress(Exception):  # a diagnosis is a bonus, never a second failure
        root = explain_log(runner.log_text())
        if root is not None:
            why = "; ".join(root.explain) or "see `vlaunch doctor` on the log"
            out(f"vlaunch: doctor: {root.cause} (phase {root.phase}): {why}")


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _ended_by_signal(runner: VllmRunner, out: Callable[[str], None]) -> int:
    """The exit status of a run a signal ended: 128 + the signal (143 TERM, 130 INT, 129 HUP)."""
    sig = runner.interrupted or signal.SIGTERM
    if runner.killed_after_grace:
        out(f"vlaunch: vLLM did not stop within {runner.grace_period:g}s; killed")
    out(f"vlaunch: stopped by {_signal_name(sig)}")
    return 128 + sig


def _output_notes(runner: VllmRunner, out: Callable[[str], None]) -> None:
    if runner.log_write_errors:
        out(f"vlaunch: {runner.log_write_errors} lines of vLLM's output could not be written to "
            f"{runner.log_path} ({runner.log_write_error}); vLLM was not held up")
    if runner.echo_dropped:
        out(f"vlaunch: {runner.echo_dropped} lines not echoed (the terminal was slower than "
            f"vLLM); all are in {runner.log_path}")


def _refuse_busy_port(runner: VllmRunner) -> None:
    if runner.port_answers():
        raise InputError(
            f"port {runner.port} already answers on {runner.host} (another server, or a vLLM "
            "left by an earlier run?); stop it or give a free --port")


_NEXT = "next attempt"
_GIVE_UP = "give up"
Verdict = str | None
"""What an attempt leaves to the loop: _NEXT (start again with the new pins and flags),
_GIVE_UP (no further attempt helps), or None (the run is over; `result` says how)."""


def serve(spec: ModelSpec | None, hw: Hardware | None, pins: Pins, extra: list[str], *,
          max_attempts: int = 3, quiet: bool = False, verbose: bool = False,
          dry_run: bool = False, metrics_port: int | None = 9400,
          metrics_bind: str = "127.0.0.1", log_dir: Path | None = None,
          goals: dict[str, Any] | None = None,
          startup_timeout: float | None = None, port: int | None = None,
          stop_timeout: float = DEFAULT_STOP_TIMEOUT_S,
          out: Callable[[str], None] = print,
          host: str | None = None, fixed: Deployment | None = None) -> ServeResult:
    """Run the whole loop; returns when vLLM exits (or start-up finally failed, or a signal
    stopped it: exit code 128 + the signal, no restart, nothing learnt). With `fixed` (exec of
    an emitted plan) every attempt runs that Deployment and a failed start is not re-planned."""
    loop = _ServeLoop(spec, hw, pins, list(extra), max_attempts=max_attempts, quiet=quiet,
                      verbose=verbose, dry_run=dry_run, metrics_port=metrics_port,
                      metrics_bind=metrics_bind, log_dir=log_dir, goals=goals or {},
                      startup_timeout=startup_timeout, port=port, stop_timeout=stop_timeout,
                      out=out, host=host, fixed=fixed)
    return loop.run()


@dataclass
class _ServeLoop:
    """One `serve` run: the attempts, and what carries from one to the next (the pins and flags
    the next plan uses, the exporter, whether a transient failure was already retried)."""

    spec: ModelSpec | None  # None with `fixed`: nothing is planned
    hw: Hardware | None
    pins: Pins
    extra: list[str]
    max_attempts: int
    quiet: bool
    verbose: bool
    dry_run: bool
    metrics_port: int | None
    metrics_bind: str
    log_dir: Path | None
    goals: dict[str, Any]
    startup_timeout: float | None
    port: int | None
    stop_timeout: float
    out: Callable[[str], None]
    host: str | None = None  # vLLM's --host; None: loopback (exposure.with_host)
    fixed: Deployment | None = None  # exec: the emitted plan, run as it is, never re-planned
    result: ServeResult = field(default_factory=lambda: ServeResult(exit_code=1))
    exporter: Any = None
    transient_retried: bool = False
    original: Pins | None = None  # as given: a context shortened for fp8 is re-planned from it
    api_port: int = 0
    user_port: bool = False
    run_id: str = ""

    def _bind_host(self) -> str:
        """Where vLLM will listen (its own --host after `--`, ours, else loopback)."""
        host = arg_value(with_host(self.extra, self.host), "host") or "127.0.0.1"
        return "0.0.0.0" if host in ("", "0.0.0.0") else ("::" if host == "::" else host)

    def say(self, text: str) -> None:
        """Progress, silenced by --quiet (unlike what went wrong, which `out` always shows)."""
        if not self.quiet:
            self.out(text)

    def run(self) -> ServeResult:
        self.pins, self.extra, pin_notes = pins_from_extra(self.pins, self.extra)
        for n in pin_notes:
            self.out(f"vlaunch: {n}")
        if warning := command_line_warning(self.extra):
            self.out(f"vlaunch: {warning}")
        self.original = self.pins
        # One API port for every attempt, so the exporter (up from the start, showing
        # vlaunch_engine_up 0 while a long load runs) always scrapes the right place.
        user_port = arg_value(self.extra, "port")
        # The port is chosen first, the same way for a dry run and a real one (vLLM's default
        # when free, else the first free one above it), then printed: a dry run shows the port
        # a real run started now takes.
        self.api_port = int(user_port) if user_port else (
            self.port or first_free_port(self._bind_host()))
        self.user_port = bool(user_port or self.port)
        self.run_id = new_run_id()
        try:
            for number in range(1, self.max_attempts + 1):
                verdict = self._attempt(number)
                if verdict is None:
                    return self.result
                if verdict == _GIVE_UP:
                    break
            self.out("vlaunch: could not start vLLM: " + "; ".join(
                f"attempt {a.number}: {a.outcome} ({a.detail[:200]})"
                for a in self.result.attempts))
            if self.result.exit_code == 0:
                self.result.exit_code = 1
            return self.result
        finally:
            if self.exporter:
                self.exporter.stop()

    # --- one attempt -------------------------------------------------------------------------

    def _attempt(self, number: int) -> Verdict:
        plan: Plan | None = None
        if self.fixed is not None:
            dep = self.fixed
        else:
            plan = make_plan(self.spec, self.hw, self.pins, **self.goals)
            dep = plan.deployment()
        d = dump(dep)
        self.result.plan = d
        if number == 1 and not (self.dry_run and dep.fits):
            self.say(plan_text(dep))
        if not dep.fits:
            self.out("vlaunch: the plan does not fit; not starting vLLM (see 'what would fit')")
            self.result.exit_code = 3
            return None
        args = self._args(dep)
        env = dict(dep.pool.env)
        if dep.pool.kv_cache.pinned:
            # A legacy VLLM_CPU_KVCACHE_SPACE in our environment would replace the pinned bytes.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if self.dry_run:
            runner = VllmRunner(args, env=env)
            # what is shown and returned (--format json) never holds a key
            self.result.command, self.result.env = redact_args(runner.argv), redact_env(env)
            how = (F.flag("port") if self.user_port else "vLLM's default, free now"
                   if self.api_port == DEFAULT_PORT else
                   f"the first free one: {DEFAULT_PORT} is taken")
            would = fit([f"  vlaunch would run (port {self.api_port}, {how}):"], width()) \
                + command_lines(redact_args(runner.argv), width(), indent="    ",
                                env=redact_env(env))
            # what will run in the plan's command place, before the figures and reasons
            self.out("\n".join(would) if self.quiet else plan_text(dep, command=would))
            self.result.exit_code = 0
            return None
        runner = self._runner(number, args, env, dep)
        self.say(f"vlaunch: attempt {number}/{self.max_attempts}: starting vLLM "
                 f"(log: {runner.log_path})")
        with runner, runner.forward_signals():
            return self._supervise(number, runner, plan, dep, args)

    def _args(self, dep: Deployment) -> list[str]:
        """The plan's vLLM arguments with the user's on top, our port, and a drain on stop."""
        # the pool's argv: a disaggregated plan's pool (exec of its folder) adds its side of
        # the KV hand-off (--kv-transfer-config); an aggregated pool's is its engine's
        args, notes = merge_args(serve_both_names(pool_argv(dep.pool)), self.extra)
        if F.flag("port") not in args:
            args += [F.flag("port"), str(self.api_port)]
        args = with_host(args, self.host)  # loopback unless the user chose a host
        if not self.result.attempts and (warning := exposure_warning(args, dict(dep.pool.env))):
            self.out(f"vlaunch: {warning}")
        args = with_drain(args, dep.vllm_version, self.stop_timeout)
        for n in notes:
            self.out(f"vlaunch: {n}")
        return args

    def _runner(self, number: int, args: list[str], env: dict[str, str],
                d: Deployment) -> VllmRunner:
        """This attempt's supervisor (its own log file, phases printed as they come), and the
        exporter told about it."""
        deadline = self.startup_timeout or startup_deadline_s(d)
        log_path = (self.log_dir or Path.cwd()) / f"vllm-{self.run_id}-attempt{number}.log"
        started = time.monotonic()

        def on_phase(phase: str) -> None:  # behind a bar of the start-up deadline spent
            t = time.monotonic() - started
            self.say(f"  [{t:6.1f}s] {bar(t / deadline, 20)} {phase}")

        runner = VllmRunner(args, env=env, log_path=log_path, on_phase=on_phase,
                            echo=prefixed_echo() if self.verbose else None,
                            startup_timeout=deadline, grace_period=self.stop_timeout)
        _refuse_busy_port(runner)
        if self.metrics_port is not None and self.exporter is None:
            self.exporter = start_exporter(runner.base_url, d, self.metrics_port,
                                            self.metrics_bind, self.out, deadline)
        elif self.exporter is not None:
            self.exporter.plan = d
            self.exporter.record_restart()
        return runner

    def _supervise(self, number: int, runner: VllmRunner, plan: Plan | None, d: Deployment,
                   args: list[str]) -> Verdict:
        """Start, wait until ready, check what vLLM allocated, one smoke request, serve."""
        try:
            runner.start()
        except OSError as e:
            self.out(f"vlaunch: cannot run {shlex.join(runner.program)}: {e.strerror or e}; "
                     f"is vLLM installed? ({VLLM_COMMAND_ENV} sets the command)")
            self.result.attempts.append(Attempt(number, args, "not started", str(e)))
            self.result.exit_code = 127
            return None
        outcome = runner.wait_ready()
        if runner.interrupted is not None:
            return self._interrupted(number, runner, args)
        if not outcome.ready:
            return self._start_failed(number, runner, outcome, plan, args)
        actual = runner.read_actual()
        lines, numbers = verification_table(d, actual)
        self.say("vlaunch: vLLM is ready; planned vs actual:")
        for line in lines:
            self.say(line)
        self.result.actual = {"numbers": numbers, **actual.to_dict()}
        learnt = learn_measured_kv(d, actual.allocation)
        if learnt:
            self.say(f"vlaunch: recorded vLLM's measured KV memory for the next plan ({learnt})")
        if timed := learn_startup(runner, d, self.goals.get("load_path")):
            self.say(timed)
        mark = runner.bytes_seen
        smoke = runner.smoke_test()
        if runner.interrupted is not None:  # a signal is no evidence about fp8
            return self._interrupted(number, runner, args)
        if not smoke.ok:
            return self._smoke_failed(number, runner, smoke, mark, plan, d, args)
        self.result.attempts.append(Attempt(number, args, "serving"))
        self.say(f"vlaunch: smoke request answered in {smoke.seconds:.2f}s; serving on "
                 f"{runner.base_url}")
        if self.exporter is not None:
            set_actual(self.exporter, actual)
        status = runner.wait()
        _output_notes(runner, self.out)
        if runner.interrupted is not None:
            self.result.exit_code = _ended_by_signal(runner, self.out)
            return None
        if runner.unexpected_exit:
            self.out(f"vlaunch: vLLM exited unexpectedly with status {status}")
        self.result.exit_code = status if status is not None else 1
        return None

    def _interrupted(self, number: int, runner: VllmRunner, args: list[str]) -> Verdict:
        self.result.attempts.append(Attempt(number, args, "interrupted"))
        runner.stop()
        self.result.exit_code = _ended_by_signal(runner, self.out)
        return None

    def _start_failed(self, number: int, runner: VllmRunner, outcome: Any, plan: Plan | None,
                      args: list[str]) -> Verdict:
        """Say why, and re-plan from what the failed start measured (or give up)."""
        failure = outcome.failure
        detail = failure.message if failure else f"{outcome.reason} (rc {outcome.returncode})"
        self.result.attempts.append(Attempt(number, args, "failed", detail))
        self.out(f"vlaunch: attempt {number} failed: {detail}")
        explain_failure(runner, outcome, self.out)
        if plan is None:
            self.out("vlaunch: not re-planning an emitted plan; pass --replan to let exec plan "
                     "again from this failure")
            return _GIVE_UP
        step = next_attempt(self.pins, plan, failure, self.extra, self.transient_retried)
        if step is None or number == self.max_attempts:
            return _GIVE_UP
        self.pins, self.extra, why, same_flags = step
        self.transient_retried = self.transient_retried or same_flags
        self.out(f"vlaunch: re-planning: {why}")
        return _NEXT

    def _smoke_failed(self, number: int, runner: VllmRunner, smoke: Any, mark: int,
                      plan: Plan | None, d: Deployment, args: list[str]) -> Verdict:
        """A first request that fails on fp8 KV is a lesson and a restart with auto KV; any
        other failure is explained and ends the run."""
        kv = d.pool.kv_cache.dtype
        self.result.attempts.append(Attempt(number, args, "smoke failed", smoke.error or ""))
        self.out(f"vlaunch: the smoke request failed: {smoke.error}")
        runner.settle()
        logged = runner.text_since(mark)
        said = smoke_says_fp8(smoke.error, logged)
        if kv.startswith("fp8") and said and number < self.max_attempts and plan is not None:
            key = lesson_key(self.hw, self.spec.attention, plan.vllm_version)
            path = record_lesson(key, False, f"fp8 KV allocated, then the first request failed "
                                 f"({(smoke.error or '')[:160]})")
            self.out(f"vlaunch: fp8 KV does not work here; recorded in {path}; restarting with "
                     "--kv-cache-dtype auto")
            # A context shortened for fp8's capacity is re-planned for the new dtype.
            given = self.original or self.pins
            self.pins = dataclasses.replace(self.pins, kv_cache_dtype="auto",
                                            max_model_len=given.max_model_len)
            self.extra = drop_flag(self.extra, F.flag("kv_cache_dtype"))
            return _NEXT
        explain_failure(runner, SimpleNamespace(log_tail=logged.splitlines()[-40:]), self.out)
        return _GIVE_UP


def _run_pre_command(pre: list[str], out: Callable[[str], None]) -> int:
    """Run one node pre-command (e.g. `ray start --head`); a failure is one line, not a
    traceback. Returns its exit status (127 when it cannot be run).

    Its output goes to a temporary file, not a pipe: daemons it leaves running (Ray's) keep
    their inherited descriptors, and a pipe would never reach end-of-file.
    """
    with tempfile.TemporaryFile() as log:
        try:
            rc = subprocess.run(pre, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT).returncode
        except OSError as e:
            out(f"vlaunch: cannot run `{shlex.join(pre)}`: {e.strerror or e}")
            return 127
        if rc == 0:
            return 0
        log.seek(max(0, log.seek(0, os.SEEK_END) - 65536))
        lines = [ln for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    why = f": {lines[-1].strip()[:300]}" if lines else ""
    out(f"vlaunch: `{shlex.join(pre)}` failed with status {rc}{why}")
    return rc if 0 < rc < 256 else 1


def node_runner(launch: Any, d: Deployment, *, port: int | None, extra: list[str],
                log_path: Path | None, stop_timeout: float, startup_timeout: float | None,
                verbose: bool, on_phase: Callable[[str], None] | None = None,
                host: str | None = None) -> VllmRunner:
    """The runner for one node: `vllm serve ...` with the plan's arguments, or the node's
    own program (a Ray worker's `ray start --block`) run verbatim."""
    from .multinode import VLLM_PROGRAM

    program = list(VLLM_PROGRAM)
    echo = prefixed_echo() if verbose else None
    if launch.argv[: len(program)] != program:
        if extra:
            raise InputError(f"this node runs `{shlex.join(launch.argv[:2])}`, not vLLM; give "
                             "vLLM's flags after -- to the leader")
        return VllmRunner(launch.argv, env=launch.env, command=[], api=False, echo=echo,
                          log_path=log_path, grace_period=stop_timeout, on_phase=on_phase)
    args = launch.argv[len(program):]
    if args and not args[0].startswith("-"):  # `vllm serve MODEL`: the module form wants --model
        args = [F.flag("model"), args[0], *args[1:]]
    if parallel_flags(extra):
        raise InputError("a multi-node plan's layout is fixed (every node must agree); plan "
                         "again with --tp/--pp/--dp instead of passing them after --")
    args, _ = merge_args(serve_both_names(args), extra)
    if launch.serves_api:
        if port and F.flag("port") not in args:
            args += [F.flag("port"), str(port)]
        args = with_host(args, host)  # loopback unless the user chose a host
        args = with_drain(args, d.vllm_version, stop_timeout)
    deadline = startup_timeout or startup_deadline_s(d)
    return VllmRunner(args, env=launch.env, echo=echo, log_path=log_path,
                      command=vllm_command(serve_cli=F.flag("headless") in args),
                      startup_timeout=deadline, grace_period=stop_timeout, on_phase=on_phase,
                      api=launch.serves_api)


def run_node(launch: Any, d: Deployment, *, port: int | None, metrics_port: int | None,
             metrics_bind: str, log_dir: Path, dry_run: bool, verbose: bool,
             startup_timeout: float | None, stop_timeout: float = DEFAULT_STOP_TIMEOUT_S,
             extra: list[str] | None = None, out: Callable[[str], None] = print,
             host: str | None = None) -> int:
    """One node of a multi-node plan (`launcher.run.multinode.NodeLaunch`), supervised.

    The leader is watched like `serve` (ready, planned vs actual, exporter); a headless worker
    or a Ray worker only runs until its process exits. Re-planning is not attempted: the group
    must agree on one plan. The dry run prints exactly what would be executed.
    """
    log_path = log_dir / f"vllm-{new_run_id()}-{launch.role}{launch.node_rank}.log"
    runner = node_runner(launch, d, port=port, extra=list(extra or []), log_path=log_path,
                         stop_timeout=stop_timeout, startup_timeout=startup_timeout,
                         verbose=verbose, on_phase=lambda phase: out(f"  {launch.role}: {phase}"),
                         host=host)
    if launch.serves_api and (warning := exposure_warning(runner.vllm_args, launch.env)):
        out(f"vlaunch: {warning}")
    if warning := command_line_warning(runner.argv):
        out(f"vlaunch: {warning}")
    if dry_run:
        cols = width()
        for pre in launch.pre_commands:
            out(f"  {launch.role} {launch.node_rank}, first:")
            for line in command_lines(redact_args(pre), cols, indent="    "):
                out(line)
        out(f"  {launch.role} {launch.node_rank} would run:")
        for line in command_lines(redact_args(runner.argv), cols, indent="    ",
                                  env=dict(sorted(redact_env(launch.env).items()))):
            out(line)
        return 0
    if launch.serves_api:
        _refuse_busy_port(runner)
    for pre in launch.pre_commands:  # e.g. `ray start --head`; a failure is the node's failure
        rc = _run_pre_command(pre, out)
        if rc:
            return rc
    exporter = None
    with runner, runner.forward_signals():
        try:
            runner.start()
        except OSError as e:
            out(f"vlaunch: cannot run {shlex.join(runner.argv[:2])}: {e.strerror or e}")
            return 127
        if not launch.serves_api and metrics_port is not None:
            exporter = start_worker_exporter(metrics_port, metrics_bind, out)
        if launch.serves_api:
            outcome = runner.wait_ready()
            if runner.interrupted is not None:
                return _ended_by_signal(runner, out)
            if not outcome.ready:
                why = outcome.failure.message if outcome.failure else outcome.reason
                out(f"vlaunch: {launch.role} failed to start: {why}")
                explain_failure(runner, outcome, out)
                return runner.exit_status or 1
            actual = runner.read_actual()
            for line in verification_table(d, actual)[0]:
                out(line)
            out(f"vlaunch: {launch.role} serving on {runner.base_url}")
            if metrics_port is not None:
                exporter = start_exporter(runner.base_url, d, metrics_port, metrics_bind, out)
                if exporter is not None:
                    set_actual(exporter, actual)
        try:
            status = runner.wait()
        finally:
            if exporter:
                exporter.stop()
        _output_notes(runner, out)
        if runner.interrupted is not None:
            return _ended_by_signal(runner, out)
        if runner.unexpected_exit:
            out(f"vlaunch: {launch.role}'s process exited unexpectedly with status {status}")
            if status and not launch.serves_api:
                explain_failure(runner, SimpleNamespace(log_tail=runner.lines_since(0)[-40:]),
                                out)
    return status if status is not None else 1


def learn_measured_kv(d: Deployment, alloc: vllmlog.Allocation) -> str | None:
    """Record what vLLM measured (its startup-plan files) as ground truth for the next plan."""
    from ..predict.memory import measured_kv as measured

    if d.pool.kv_cache.pinned:
        return None
    kv = measured.read_startup_plans(alloc.startup_plan_paths) or alloc.startup_plan_applied_bytes
    if not kv:
        return None
    path = measured.record(d, kv, f"vLLM {d.vllm_version} startup plan")
    return f"{kv / GiB:.2f} GiB in {path}"
