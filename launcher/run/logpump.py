"""vLLM's output: drained into a bounded, rotated log file, echoed, and read back in pieces.

Why a pump: vLLM writes to a pipe; a reader that stops (a full disk, a slow terminal) leaves
it blocked on a full pipe, serving nothing. So one thread drains the pipe and never stops for
a failed write (it counts it); a second thread echoes lines fed through a bounded queue, so a
slow terminal drops echoed lines instead of stalling vLLM. What was printed is read back in
bounded pieces (the first LOG_HEAD_BYTES kept in memory, the rest from the end of the file),
never a whole log and never an earlier run's lines in the same file.
"""

from __future__ import annotations

import contextlib
import os
import queue
import stat
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ..paths import cache_dir, create_private

LOG_MAX_BYTES = 64 << 20
"""A log file is rotated to `<name>.1` past this size (one backup): at most twice this on disk
per attempt, whatever vLLM prints."""
LOG_HEAD_BYTES = 2 << 20  # the start of the output, kept in memory (start-up lines)
LOG_TAIL_BYTES = 4 << 20  # read back from the end of the log (the last words)
MAX_LINE_BYTES = 64 << 10  # a longer "line" is split: no unbounded read
ECHO_QUEUE_LINES = 10_000
TAIL_LINES = 200  # lines kept in memory for `lines_since` and a failure's last words
_TAIL_LINE_CHARS = 4096


class OutputLog:
    """One run's output. `open()` it, `start(pipe)` the pump, `join()` at the end.

    `on_line` (and `echo`, on its own thread) see each decoded line; their exceptions are
    swallowed, since nothing may stop the draining.
    """

    def __init__(
        self,
        log_path: str | os.PathLike[str] | None = None,
        *,
        echo: Callable[[str], None] | None = None,
        on_line: Callable[[str], None] | None = None,
        max_bytes: int = LOG_MAX_BYTES,
    ) -> None:
        # None: a fresh file under cache_dir()/logs, made by open() (not for a dry run).
        self.path: Path | None = Path(log_path) if log_path is not None else None
        self.echo = echo
        self.on_line = on_line
        self.max_bytes = max(1, int(max_bytes))
        self.write_errors = 0
        self.write_error: str | None = None
        self.echo_dropped = 0
        self.lines_seen = 0
        self.bytes_seen = 0
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._head = bytearray()
        self._file: IO[bytes] | None = None
        self._offset = 0  # where this run's bytes start in a log that already existed
        self._file_bytes = 0
        self._rotations = 0
        self._reader: threading.Thread | None = None
        self._echo_thread: threading.Thread | None = None
        self._echo_queue: queue.Queue[str | None] | None = None

    # --- writing -----------------------------------------------------------------------------

    def open(self) -> None:
        """Make the log file: always a new one, 0600, never through a symlink (O_EXCL |
        O_NOFOLLOW; paths.create_private). A name that exists already (tune's predictable
        `vllm-trialN.log` on a resume, or a planted link) gets the next free `NAME-2.log`, and
        `path` says which file it is."""
        if self.path is None:
            logs = cache_dir() / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log", dir=logs)  # O_EXCL, 0600
            self._file = os.fdopen(fd, "ab", buffering=0)
            self.path = Path(name)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file, self.path = create_private(self.path)
        self._offset = self._file_bytes = 0

    def close(self) -> None:
        """Close the file when the pump never started (the program could not be run)."""
        if self._file is not None:
            self._file.close()

    def start(self, pipe: IO[bytes]) -> None:
        """Drain `pipe` on a reader thread (and echo on another) until it ends."""
        if self.echo is not None:
            self._echo_queue = queue.Queue(maxsize=ECHO_QUEUE_LINES)
            self._echo_thread = threading.Thread(target=self._echo_loop, daemon=True)
            self._echo_thread.start()
        self._reader = threading.Thread(target=self._pump, args=(pipe,), daemon=True)
        self._reader.start()

    def join(self) -> None:
        """Wait (bounded) for the pump and the echo to finish: the file then holds the end."""
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._echo_thread is not None:
            self._echo_thread.join(timeout=2)

    def _pump(self, pipe: IO[bytes]) -> None:
        """Drain the output into the log, the echo queue and `on_line`.

        Nothing stops the draining but the end of the output: a failed write (a full disk) is
        counted and the next line tried again.
        """
        try:
            for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                self._write(raw)
                self.lines_seen += 1
                self.bytes_seen += len(raw)
                if len(self._head) < LOG_HEAD_BYTES:
                    self._head += raw[: LOG_HEAD_BYTES - len(self._head)]
                with contextlib.suppress(Exception):
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    self.tail.append(line[:_TAIL_LINE_CHARS])
                    self._echo_line(line)
                    if self.on_line is not None:
                        self.on_line(line)
        finally:
            with contextlib.suppress(Exception):
                self.close()
            if self._echo_queue is not None:
                with contextlib.suppress(queue.Full):
                    self._echo_queue.put(None, timeout=1)

    def _write(self, raw: bytes) -> None:
        try:
            if self._file_bytes and self._file_bytes + len(raw) > self.max_bytes:
                self._rotate()
            if self._file is None:
                raise ValueError("the log file is not open")
            self._file.write(raw)
            self._file_bytes += len(raw)
        except (OSError, ValueError) as e:
            self.write_errors += 1
            self.write_error = str(e)

    def _rotate(self) -> None:
        """Keep one backup: `<log>.1` holds the previous `max_bytes`."""
        assert self.path is not None and self._file is not None
        self._file.close()
        self._file_bytes = 0
        try:
            os.replace(self.path, self._backup_path())
            self._rotations += 1
        finally:
            # the same name, new and private; a link planted there since is not followed
            self._file, _ = create_private(self.path, tries=1)

    def _backup_path(self) -> Path:
        assert self.path is not None
        return self.path.with_name(self.path.name + ".1")

    def _echo_line(self, line: str) -> None:
        if self._echo_queue is None:
            return
        try:
            self._echo_queue.put_nowait(line)
        except queue.Full:
            self.echo_dropped += 1

    def _echo_loop(self) -> None:
        assert self._echo_queue is not None and self.echo is not None
        while True:
            line = self._echo_queue.get()
            if line is None:
                return
            with contextlib.suppress(Exception):
                self.echo(line)

    # --- reading back ------------------------------------------------------------------------

    def _file_tail(self, want: int) -> bytes:
        """The last `want` bytes this run wrote, from the log and its rotated backup."""
        if self.path is None:
            return b""
        files = [(self.path, self._offset if self._rotations == 0 else 0)]
        if self._rotations:
            files.append((self._backup_path(), self._offset if self._rotations == 1 else 0))
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

    def text(self) -> str:
        """This run's output, bounded: its first LOG_HEAD_BYTES (kept in memory: the start-up
        lines) and its last LOG_TAIL_BYTES (read back from the log)."""
        head = bytes(self._head)
        rest = self.bytes_seen - len(head)
        if rest <= 0:
            return head.decode("utf-8", "replace")
        if self.write_errors:  # the file misses lines: the lines kept in memory
            tail = "\n".join(self.tail).encode()
        else:
            tail = self._file_tail(min(rest, LOG_TAIL_BYTES))
        if rest <= len(tail):  # head and tail meet: the whole output
            return (head + tail[len(tail) - rest:]).decode("utf-8", "replace")
        if b"\n" in tail:
            tail = tail.split(b"\n", 1)[1]  # a cut line is no line
        head = head[: head.rfind(b"\n") + 1] if b"\n" in head else head + b"\n"
        return (head + b"[... output not shown ...]\n" + tail).decode("utf-8", "replace")

    def text_since(self, mark: int) -> str:
        """What was printed after `bytes_seen` was `mark` (at most LOG_TAIL_BYTES of it)."""
        want = self.bytes_seen - mark
        if want <= 0:
            return ""
        if self.write_errors:
            return "\n".join(self.tail)
        return self._file_tail(min(want, LOG_TAIL_BYTES)).decode("utf-8", "replace")

    def lines_since(self, mark: int) -> list[str]:
        """The lines printed after `lines_seen` was `mark` (at most the last TAIL_LINES)."""
        n = self.lines_seen - mark
        return list(self.tail)[-n:] if n > 0 else []

    def settle(self, quiet: float = 0.3, limit: float = 2.0) -> None:
        """Wait (up to `limit`) until the output pauses: last words about something that just
        failed may still be in the pipe."""
        end = time.monotonic() + limit
        seen = self.lines_seen
        while time.monotonic() < end:
            time.sleep(quiet)
            if self.lines_seen == seen:
                return
            seen = self.lines_seen


def prefixed_echo(prefix: str = "[vllm] ", stream=None) -> Callable[[str], None]:
    """An `echo` callback that prints each vLLM line with a prefix (to stderr by default)."""

    def echo(line: str) -> None:
        out = stream if stream is not None else sys.stderr
        out.write(prefix + line + "\n")
        out.flush()

    return echo
