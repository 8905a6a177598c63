"""Supervise one vLLM server process: start it, know when it is ready, stop it cleanly.

The supervisor composes four parts, each readable on its own:
- `vllmargs`: which program runs and what its flags say (port, model name, host);
- `procgroup`: vLLM's process group (it leads its own, every stop acts on all of it, a
  watchdog stops it if we die) and which process holds the port;
- `logpump`: its output drained into a bounded, rotated log, echoed, read back in pieces;
- `endpoint`: its HTTP API (health, served models, smoke test, what it allocated);
and `drain` says how long a stop may take. This module holds the life cycle: start, wait until
ready, wait while serving, stop (SIGTERM to the group, SIGKILL after the grace period; the
group is empty when `stop()` returns), and signals forwarded from our own process.

Typical use (this is what `launcher/run/serve.py` builds on):

    runner = VllmRunner(plan["vllm_args"], env=plan["env"], on_phase=print)
    with runner, runner.forward_signals():     # __exit__ stops the group
        runner.start()
        outcome = runner.wait_ready()          # StartupOutcome, never raises for vLLM errors
        if not outcome.ready:
            ...                                # outcome.failure: vllmlog.Failure (kind, numbers)
        runner.smoke_test()                    # SmokeResult: one short /v1/completions call
        actual = runner.read_actual()          # Actual: log Allocation + cache_config_info
        status = runner.wait()                 # blocks while serving; shell-style exit status

API summary
- `VllmRunner(vllm_args, env=None, *, python=None, command=None, log_path=None, echo=None,
  on_phase=None, startup_timeout=900, grace_period=DEFAULT_STOP_TIMEOUT_S, host="127.0.0.1",
  api=True, log_max_bytes=LOG_MAX_BYTES)`.
  `vllm_args` are the arguments after the program, starting with `--model` (as in a plan).
  A `--port` is added when missing (a free local port). `env` is added to our environment; a
  value of None removes that variable (e.g. an inherited VLLM_CPU_KVCACHE_SPACE, which would
  override --kv-cache-memory-bytes; an empty value crashes vLLM's worker). `api=False`
  supervises a process with no HTTP API (a Ray worker's `ray start --block`): `command` +
  `vllm_args` run verbatim.
- `start()`, `wait_ready(timeout=None) -> StartupOutcome`, `stop(grace=None) -> int | None`,
  `wait(timeout=None) -> int | None`, `poll()`, `returncode` (Popen's: negative = signal),
  `exit_status` (shell style: 128 + signal), `unexpected_exit`, `interrupted` (the signal that
  asked us to stop), `killed_after_grace`, `phase`, `group_pids()`, `port_answers()`,
  `owns_port()`, `smoke_test()`, `read_actual()`, `log_text()`, `lines_seen`,
  `lines_since(mark)`, `bytes_seen`, `text_since(mark)`, `settle()`, `forward_signals()`,
  `log_write_errors`, `echo_dropped`.

Callbacks (`echo`, `on_phase`) run on the pump's threads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..inputs import vllm_flags as F
from . import vllmlog
from .drain import DEFAULT_STOP_TIMEOUT_S
from .endpoint import Actual, Endpoint, SmokeResult
from .logpump import LOG_MAX_BYTES, OutputLog
from .procgroup import ProcessGroup
from .vllmargs import (
    arg_value,
    connect_host,
    free_port,
    in_serve_form,
    port_answers,
    vllm_command,
)

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a run: ^C, a stop, a lost terminal (each ends with 128 + the signal)."""


@dataclass
class StartupOutcome:
    """How a start-up ended. `reason`: ready | exited | timeout | interrupted | not_started."""

    ready: bool
    reason: str
    seconds: float
    phase: str | None
    returncode: int | None = None
    failure: vllmlog.Failure | None = None
    log_tail: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        d = dict(self.__dict__)
        d["failure"] = self.failure.to_dict() if self.failure else None
        return d


class VllmRunner:
    """One supervised vLLM server (see the module docstring for the contract)."""

    def __init__(
        self,
        vllm_args: Sequence[str],
        env: Mapping[str, str | None] | None = None,
        *,
        python: str | None = None,
        command: Sequence[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        echo: Callable[[str], None] | None = None,
        on_phase: Callable[[str], None] | None = None,
        startup_timeout: float = 900.0,
        grace_period: float = DEFAULT_STOP_TIMEOUT_S,
        host: str = "127.0.0.1",
        poll_interval: float = 1.0,
        http_timeout: float = 5.0,
        api: bool = True,
        log_max_bytes: int = LOG_MAX_BYTES,
    ) -> None:
        args = [str(a) for a in vllm_args]
        self.env = dict(env or {})
        self.api = api
        model = arg_value(args, "model")
        if api and model is None:
            raise ValueError("vllm_args must contain --model")
        bind = arg_value(args, "host")
        self.host = connect_host(bind, host)
        if api and arg_value(args, "port") is None:
            args += [F.flag("port"), str(free_port(host if bind is None else "127.0.0.1"))]
        self.vllm_args = args
        self.port = int(arg_value(args, "port") or 0)
        self.model_name = arg_value(args, "served_model_name") or model or ""
        self.endpoint = Endpoint(self.host, self.port, self.model_name, args, self.env,
                                 http_timeout)
        if command is not None:
            self.program = list(command)
        else:
            self.program = vllm_command(python) if api else []
        self.startup_timeout = startup_timeout
        self.grace_period = grace_period
        self.poll_interval = poll_interval
        self.on_phase = on_phase
        self.output = OutputLog(log_path, echo=echo, on_line=self._track_phase,
                                max_bytes=log_max_bytes)
        self.phase: str | None = None
        self.phase_marks: list[tuple[str, float]] = []  # (phase, monotonic time it began)
        self.unexpected_exit = False
        self.interrupted: int | None = None  # the signal that asked us to stop
        self.killed_after_grace = False
        self.foreign_listener = False  # /health answered from a process not ours
        self._proc: subprocess.Popen[bytes] | None = None
        self._group: ProcessGroup | None = None
        self._stop_requested = False
        self._signalled = False
        self._started_at = 0.0

    # --- what the parts know -----------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url

    @property
    def log_path(self) -> Path | None:
        """The log file (made by `start()` when none was given)."""
        return self.output.path

    @property
    def lines_seen(self) -> int:
        return self.output.lines_seen

    @property
    def bytes_seen(self) -> int:
        """Bytes of output so far: a mark for `text_since`."""
        return self.output.bytes_seen

    @property
    def log_write_errors(self) -> int:
        return self.output.write_errors

    @property
    def log_write_error(self) -> str | None:
        return self.output.write_error

    @property
    def echo_dropped(self) -> int:
        return self.output.echo_dropped

    def log_text(self) -> str:
        """This run's output, bounded (see `OutputLog.text`)."""
        return self.output.text()

    def text_since(self, mark: int) -> str:
        return self.output.text_since(mark)

    def lines_since(self, mark: int) -> list[str]:
        return self.output.lines_since(mark)

    def settle(self, quiet: float = 0.3, limit: float = 2.0) -> None:
        self.output.settle(quiet, limit)

    # --- process -----------------------------------------------------------------------------

    @property
    def argv(self) -> list[str]:
        """The full argv. `vllm serve` takes the model positionally; the module takes --model."""
        return in_serve_form(self.program, self.vllm_args)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def port_answers(self) -> bool:
        """Does something already accept connections on the port vLLM is to use?"""
        return bool(self.port) and port_answers(self.host, self.port)

    def start(self) -> None:
        """Spawn vLLM as the leader of a new session (so of a new process group), its watchdog
        and the pump of its output. OSError when the program cannot be run."""
        if self._proc is not None:
            raise RuntimeError("this runner was already started")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self.output.open()
        self._started_at = time.monotonic()
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            self.output.close()
            raise
        self._group = ProcessGroup(self._proc.pid, self.grace_period)
        self._group.start_watchdog()
        self._group.track()  # descendants that leave the group are stopped with it
        self._set_phase("starting")
        assert self._proc.stdout is not None
        self.output.start(self._proc.stdout)

    def _track_phase(self, line: str) -> None:
        phase = vllmlog.phase_of_line(line)
        if phase is not None and phase != "ready":  # ready is what the API says, not the log
            self._set_phase(phase)

    def _set_phase(self, phase: str) -> None:
        if self.phase is not None and vllmlog.phase_rank(phase) <= vllmlog.phase_rank(self.phase):
            return
        self.phase = phase
        self.phase_marks.append((phase, time.monotonic()))  # start-up timing (startup_timing)
        if self.on_phase is not None:
            with contextlib.suppress(Exception):
                self.on_phase(phase)

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc else None

    @property
    def returncode(self) -> int | None:
        """Popen's return code of the server process: None while running, -N for signal N."""
        return self._proc.returncode if self._proc else None

    @property
    def exit_status(self) -> int | None:
        """Shell-style exit status: 128 + N when killed by signal N."""
        rc = self.returncode
        return None if rc is None else (128 - rc if rc < 0 else rc)

    def group_pids(self) -> list[int]:
        """Processes still alive in vLLM's process group (the server and its children)."""
        return self._group.pids() if self._group else []

    def owns_port(self) -> bool | None:
        """Is the socket listening on our port held by our own process group? None when the OS
        cannot tell (then a live child answering is taken as ours)."""
        return self._group.holds_port(self.port) if self._group else None

    # --- stopping ----------------------------------------------------------------------------

    def stop(self, grace: float | None = None, sig: int = signal.SIGTERM) -> int | None:
        """Stop the whole group: `sig` (unless a forwarded signal already asked), then SIGKILL
        after `grace` seconds (`killed_after_grace`). Returns returncode.

        Also reaps leftovers when the server already exited (e.g. killed from outside) but its
        engine core or workers did not.
        """
        if self._proc is None or self._group is None:
            return None
        self._stop_requested = True
        grace = self.grace_period if grace is None else grace
        group = self._group
        if group.pids():
            if not self._signalled:
                group.signal(sig)
            if not group.wait_empty(time.monotonic() + grace, reap=self._proc):
                self.killed_after_grace = True
                group.signal(signal.SIGKILL)
                group.wait_empty(time.monotonic() + 10, reap=self._proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        self.output.join()
        group.stop_watchdog()
        return self._proc.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Block while the server runs; returns its shell-style exit status (None on timeout),
        or 128 + N when signal N asked us to stop.

        An exit nobody asked for (crash, killed from outside) sets `unexpected_exit`, cleans up
        the rest of the group, and never reads as success: a 0 then becomes 1.
        """
        if self._proc is None:
            raise RuntimeError("not started")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._proc.poll() is None:
            if self.interrupted is not None:
                self.stop()
                break
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
        if not self._stop_requested:
            self.unexpected_exit = True
            self.stop(grace=5)  # the engine core and workers may have outlived the server
        else:
            self.stop()  # the group, the reader and the watchdog
        if self.interrupted is not None:
            return 128 + self.interrupted
        status = self.exit_status
        if self.unexpected_exit and status == 0:
            return 1
        return status

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def forward_signals(self, signals: Sequence[int] = SIGNALS
                        ) -> contextlib.AbstractContextManager[None]:
        """While inside, SIGINT/SIGTERM/SIGHUP sent to us are forwarded to vLLM's group (see
        `forward` and the module's `forward_signals`, which does it for several runners).

        The handler only forwards and records `interrupted`; `wait_ready()`, `smoke_test()`
        and `wait()` notice it and finish the job with `stop()` (SIGKILL after the grace
        period). Main thread only.
        """
        return forward_signals([self], signals)

    def forward(self, signum: int) -> None:
        """Take signal `signum` as ours: record it and pass it to vLLM's group (SIGHUP as
        SIGTERM: a lost terminal is a stop, and vLLM drains only on TERM/INT). Safe in a
        signal handler: it sets flags and sends a signal, nothing more."""
        self.interrupted = signum
        self._stop_requested = True
        if self._group is not None:
            self._signalled = True
            self._group.signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    # --- readiness ---------------------------------------------------------------------------

    def is_ready(self) -> bool:
        """Our child is alive, GET /health is 200 from a listener our group holds, and GET
        /v1/models lists our model. (A server left on the port by an earlier run answers
        /health too; it is not ours.)"""
        if self._proc is not None and self._proc.poll() is not None:
            return False
        try:
            # Ownership first, before a single request is sent: a listener that took the port
            # ahead of our child must not see our requests (and /v1 ones carry the key). A bare
            # TCP connect (no bytes) tells whether anyone listens yet, cheaply; only then is the
            # listener's owner looked up (a scan of every process's sockets).
            if self._proc is not None:
                if not self.port_answers():
                    return False
                if self.owns_port() is False:
                    self.foreign_listener = True
                    return False
            if not self.endpoint.healthy():
                return False
            return self.endpoint.serves_model()
        except (OSError, ValueError, AttributeError):
            return False

    def _outcome(self, ready: bool, reason: str) -> StartupOutcome:
        failure = None
        if not ready:
            if self.poll() is not None:
                self.output.join()  # so the log file holds vLLM's last words
            failure = vllmlog.classify_failure(self.log_text())
        return StartupOutcome(
            ready=ready,
            reason=reason,
            seconds=round(time.monotonic() - self._started_at, 3),
            phase=self.phase,
            returncode=self.returncode,
            failure=failure,
            log_tail=list(self.output.tail)[-40:],
        )

    def wait_ready(self, timeout: float | None = None) -> StartupOutcome:
        """Poll until ready, exited, interrupted or past the start-up deadline.

        On timeout or interruption the group is stopped (a hang is a failure). On an early
        exit the rest of the group is reaped and the log is classified into `failure`.
        """
        if self._proc is None:
            return StartupOutcome(False, "not_started", 0.0, None)
        limit = self.startup_timeout if timeout is None else timeout
        deadline = self._started_at + limit
        while True:
            if self.interrupted is not None:
                self.stop()
                return self._outcome(False, "interrupted")
            if self._proc.poll() is not None:
                self.stop(grace=5)
                return self._outcome(False, "exited")
            if self.is_ready():
                self._set_phase("ready")
                return self._outcome(True, "ready")
            if time.monotonic() >= deadline:
                self.stop()
                return self._outcome(False, "timeout")
            self._sleep(self.poll_interval)

    def _sleep(self, seconds: float) -> None:
        """Sleep, but wake early for a signal or our child's exit."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.interrupted is not None or (self._proc and self._proc.poll() is not None):
                return
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    # --- checks on a running server ----------------------------------------------------------

    def smoke_test(
        self, prompt: str = "Hello, my name is", max_tokens: int = 4, timeout: float = 120.0
    ) -> SmokeResult:
        """One short greedy completion; a signal ends the wait at once (see Endpoint)."""
        return self.endpoint.smoke_test(prompt, max_tokens, timeout, lambda: self.interrupted)

    def metrics_text(self) -> str:
        return self.endpoint.metrics_text()

    def read_actual(self) -> Actual:
        """What vLLM allocated: the log's numbers, overridden by /metrics where it has them."""
        return self.endpoint.read_actual(self.log_text())


@contextlib.contextmanager
def forward_signals(runners: Sequence[VllmRunner], signals: Sequence[int] = SIGNALS,
                    on_signal: Callable[[int], None] | None = None) -> Iterator[None]:
    """While inside, each of `signals` is forwarded to every runner in `runners` (read when
    the signal arrives, so runners appended later get it too), then `on_signal(signum)` runs;
    the previous handlers come back on exit. One handler for one engine (`vlaunch serve`) or
    several (a P/D deployment's prefill and decode engines). Main thread only."""
    previous = {}

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        for r in list(runners):
            r.forward(signum)
        if on_signal is not None:
            on_signal(signum)

    for s in signals:
        previous[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
