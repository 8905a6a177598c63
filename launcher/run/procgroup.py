"""vLLM's process group: who is in it, who holds a port, how to empty it, and a watchdog.

Why: vLLM is a tree of processes (API server -> EngineCore -> workers). Killing only the
process we started can leave the engine core and its workers holding the memory the next
attempt needs, so the server leads its own process group and every stop acts on the whole
group. A watchdog process outside the group does the same if the supervisor itself dies
(SIGKILL, a lost terminal), so vLLM never outlives vlaunch as an orphan that a later run would
mistake for its own server. psutil answers "which processes" and "which sockets", on Linux
and macOS alike.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

# Runs as `python -c` outside vLLM's group: when the supervisor that started it is gone (its
# parent pid changed), stop vLLM's group as `ProcessGroup.stop` would. Exits when the group
# is empty. Plain Python (no psutil): it starts with -I -S, outside any virtual environment.
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


def pids_in_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`.

    Zombies are excluded: they hold no memory, and reparented ones may never be reaped inside a
    container whose init does not reap.
    """
    out = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except (OSError, psutil.Error):  # gone meanwhile, or not ours to look at
            continue
    return sorted(out)


def listening_pids(port: int) -> set[int | None] | None:
    """Processes with a TCP socket listening on `port` (any address); None when the OS will
    not say (no listener seen, or no right to look). A pid is None for a socket whose owner
    we may not see (another user's process)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    pids = {c.pid for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
    return pids or None


class ProcessGroup:
    """The process group led by `pgid` (vLLM's server), with its watchdog."""

    def __init__(self, pgid: int, grace_period: float) -> None:
        self.pgid = pgid
        self.grace_period = grace_period
        self._watchdog: subprocess.Popen[bytes] | None = None

    def pids(self) -> list[int]:
        """Processes still alive in the group (the server and its children)."""
        return pids_in_group(self.pgid)

    def holds_port(self, port: int) -> bool | None:
        """Is the socket listening on `port` held by this group? None when the OS cannot tell
        (then a live child answering is taken as ours)."""
        holders = listening_pids(port)
        if holders is None:
            return None
        return bool(holders & set(self.pids()))

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def wait_empty(self, deadline: float, reap: subprocess.Popen[bytes] | None = None) -> bool:
        """Wait until no process of the group is left (reaping the leader, `reap`, so it does
        not linger as a zombie); False at `deadline` with survivors."""
        while time.monotonic() < deadline:
            if reap is not None:
                reap.poll()
            if not self.pids():
                return True
            time.sleep(0.1)
        return not self.pids()

    def start_watchdog(self) -> None:
        """A process outside the group that stops it if we die (see _WATCHDOG)."""
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(self.pgid),
                 str(self.grace_period)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:  # no watchdog is no reason not to serve
            self._watchdog = None

    def stop_watchdog(self) -> None:
        if self._watchdog is not None and self._watchdog.poll() is None:
            with contextlib.suppress(OSError):
                self._watchdog.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=5)
