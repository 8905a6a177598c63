"""vLLM's process group: who is in it, who holds a port, how to empty it, and a watchdog.

Why: vLLM is a tree of processes (API server -> EngineCore -> workers). Killing only the
process we started can leave the engine core and its workers holding the memory the next
attempt needs, so the server leads its own process group and every stop acts on the whole
group. A watchdog process outside the group does the same if the supervisor itself dies
(SIGKILL, a lost terminal), so vLLM never outlives vlaunch as an orphan that a later run would
mistake for its own server. psutil answers "which processes" and "which sockets", on Linux
and macOS alike.

The group alone is not the whole tree: a process may leave it (setsid, as a daemon does) and
Ray starts its daemons (raylet, GCS) in sessions of their own, so a stop that signalled only
the group left them running, holding memory and ports (issue 31). The group therefore also
tracks the leader's descendants by psutil: a snapshot every TRACK_S while vLLM runs, and one
more before every signal, remembered by (pid, create time) so a reused pid is never signalled,
and a process reparented to init after its parent died is still known. What escapes is a
double fork that completes within one TRACK_S (a daemon's fork, setsid, fork, exit).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
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


TRACK_S = 0.25  # how often the leader's descendants are snapshotted while it runs
MAX_TRACKED = 4096  # a fork bomb is not tracked pid by pid forever


def _live(pid: int, created: float) -> bool:
    """Is `pid` still the process first seen with `created` (not a zombie, not a reuse)?"""
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ProcessGroup:
    """The process group led by `pgid` (vLLM's server), its descendants, and a watchdog."""

    def __init__(self, pgid: int, grace_period: float) -> None:
        self.pgid = pgid
        self.grace_period = grace_period
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._known: dict[int, float] = {}  # pid -> create time, every descendant ever seen
        self._lock = threading.RLock()  # signal() may run in a handler on the main thread
        self._tracking = threading.Event()
        self._own = os.getpid()

    def _snapshot(self) -> None:
        """Record the leader's descendants, and those of every process already known (a
        reparented one keeps its own children findable): one pass over the process table."""
        children: dict[int, list[int]] = {}
        created: dict[int, float] = {}
        for p in psutil.process_iter(["ppid", "create_time"]):
            info = p.info
            if info.get("ppid") is None or info.get("create_time") is None:
                continue
            children.setdefault(info["ppid"], []).append(p.pid)
            created[p.pid] = info["create_time"]
        with self._lock:
            todo = [self.pgid, *(p for p, c in self._known.items() if created.get(p) == c)]
            seen: set[int] = set()
            while todo and len(seen) < MAX_TRACKED:
                pid = todo.pop()
                if pid in seen or pid == self._own or pid not in created:
                    continue
                seen.add(pid)
                self._known.setdefault(pid, created[pid])
                todo += children.get(pid, [])
            for pid in [p for p, c in self._known.items() if created.get(p) != c]:
                del self._known[pid]  # gone, or its pid now names another process

    def track(self) -> None:
        """Snapshot the leader's descendants every TRACK_S, in a daemon thread that ends when
        the group and every tracked process are gone."""
        if self._tracking.is_set():
            return
        self._tracking.set()

        def loop() -> None:
            while self._tracking.is_set():
                self._snapshot()
                if not self.pids():
                    break
                time.sleep(TRACK_S)
            self._tracking.clear()

        threading.Thread(target=loop, name="vlaunch-procgroup-track", daemon=True).start()

    def pids(self) -> list[int]:
        """Processes still alive of vLLM's: its group, and every descendant seen (the server,
        its engine and workers, and what left the group)."""
        with self._lock:
            known = [p for p, c in self._known.items() if _live(p, c)]
        return sorted(set(pids_in_group(self.pgid)) | set(known))

    def holds_port(self, port: int) -> bool | None:
        """Is the socket listening on `port` held by this group? None when the OS cannot tell
        (then a live child answering is taken as ours)."""
        holders = listening_pids(port)
        if holders is None:
            return None
        return bool(holders & set(self.pids()))

    def signal(self, sig: int) -> None:
        """`sig` to the group, and to each descendant that left it (checked to be the same
        process first seen, so a pid the kernel reused is left alone)."""
        self._snapshot()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)
        with self._lock:
            known = list(self._known.items())
        for pid, created in known:
            try:
                if os.getpgid(pid) == self.pgid or not _live(pid, created):
                    continue
                psutil.Process(pid).send_signal(sig)
            except (OSError, psutil.Error):
                continue

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
