"""Processes that leave vLLM's group (issue 31, Low): a grandchild that starts its own session,
as a daemon or Ray's raylet does, used to survive serve's stop. The group now tracks the
leader's descendants by psutil and stops them with it.

Every process here is ours, small, and killed by the test's own cleanup whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.run.procgroup import TRACK_S, ProcessGroup

# The leader: starts a child in a new session (setsid), which starts a grandchild; writes
# both pids; then either stays (a server) or exits after a second (an engine that crashed:
# what it started is reparented to init, out of both the group and the leader's tree).
LEADER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(g.pid))
time.sleep(120)
''', sys.argv[1] + ".g"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120 if sys.argv[2] == "stay" else 1.0)
"""


def _wait_for(path: Path, timeout: float = 20.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("leader_stays", [True, False])
def test_a_grandchild_in_its_own_session_does_not_survive_the_stop(tmp_path: Path,
                                                                   leader_stays: bool) -> None:
    pidfile = tmp_path / "pids"
    leader = subprocess.Popen([sys.executable, "-c", LEADER, str(pidfile),
                               "stay" if leader_stays else "go"], start_new_session=True)
    group = ProcessGroup(leader.pid, grace_period=5.0)
    group.track()
    child = grandchild = None
    try:
        child = _wait_for(pidfile)
        grandchild = _wait_for(Path(str(pidfile) + ".g"))
        assert os.getsid(child) == child != os.getpgid(leader.pid)  # it left the group
        time.sleep(2 * TRACK_S)  # a snapshot or two while the leader still runs
        if not leader_stays:
            leader.wait(timeout=20)
            time.sleep(2 * TRACK_S)
            assert psutil.Process(child).ppid() != leader.pid  # reparented
        assert {child, grandchild} <= set(group.pids())
        group.signal(signal.SIGTERM)
        assert group.wait_empty(time.monotonic() + 20, reap=leader)
        for pid in (child, grandchild):
            with contextlib.suppress(psutil.NoSuchProcess):
                assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    finally:
        for pid in (leader.pid, child, grandchild):
            if pid:
                _kill(pid)
        leader.wait(timeout=10)


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    """A tracked process that ended and whose pid now names another is forgotten, not
    signalled: the record is (pid, create time)."""
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        group = ProcessGroup(leader.pid, grace_period=1.0)
        group._snapshot()  # noqa: SLF001
        group._known[bystander.pid] = 1.0  # noqa: SLF001 - as if an old process had its pid
        group.signal(signal.SIGTERM)
        assert group.wait_empty(time.monotonic() + 10, reap=leader)
        assert bystander.poll() is None  # untouched
        assert bystander.pid not in group._known  # noqa: SLF001
    finally:
        _kill(leader.pid)
        _kill(bystander.pid)
        leader.wait(timeout=10)
        bystander.wait(timeout=10)
