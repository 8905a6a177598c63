"""Reading vLLM logs from a file, a folder or stdin, in bounded memory, into the scan.

Why a module of its own: what counts as a vLLM log, how much of it is read (the tail, the last
launch) and how a folder is walked are questions of files, not of vLLM's messages; serve and
tune scan text they already hold and never need this.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ..errors import InputError
from .vllm_failures import Report, Scanner
from .vllm_loglines import ARGPARSE_LINE, EXCEPTION_LINE, LAUNCH, MAX_LINE, split_line

# --- reading logs ------------------------------------------------------------------------------

_LOG_NAMES = ("*.log", "*.txt", "*.out", "*.err")
MAX_BYTES = 256 << 20  # read at most the last 256 MiB of a log: the failure is at its end
_HEAD = 65536  # a vLLM log names vLLM in its first 64 KiB (the banner, the version line)


def _mentions_vllm(head: bytes) -> bool:
    """vLLM's name, its engine or API server process, or the usage line of its entry point
    (vllm/entrypoints/openai/api_server.py, whose argparse errors name nothing else)."""
    return (b"vllm" in head.lower() or b"EngineCore" in head or b"(APIServer" in head
            or b"api_server.py" in head)


_NCCL_HOST = re.compile(r"^[\w.-]+:\d+:\d+ \[\d+\] NCCL ")
_FRAME = re.compile(r'^\s*File "')
LOG_SHARE = 1 / 3  # the least share of a log's lines that read as log lines (see looks_like_log)


def _log_line(raw: str) -> bool | None:
    """Does this line read as a log's (True), as prose (False), or neither (None: blank, an
    indented source or table line, a progress bar)? A log's lines: vLLM's logger prefix
    (level and time, or the process), NCCL's host prefix, uvicorn's level, a traceback's
    frame, an exception, argparse's usage and error."""
    text = raw.strip()
    if not text:
        return None
    line = split_line(0, raw)
    c = line.content
    if line.level or line.rank or _NCCL_HOST.match(c) or _FRAME.match(raw):
        return True
    if c.startswith(("Traceback (most recent call last)", "usage: ", "INFO:", "WARNING:",
                     "ERROR:", "DEBUG:")) or EXCEPTION_LINE.match(c) or ARGPARSE_LINE.match(c):
        return True
    if raw[:1].isspace() or "%|" in c or "it/s]" in c or "s/it]" in c:
        return None
    return False


def looks_like_log(lines: list[str]) -> bool:
    """Reads as a vLLM log: it names vLLM, and at least a third of its lines (blank, indented
    and progress-bar lines aside) read as log lines. A README that quotes a few of vLLM's
    lines in its prose (or a config, a script) names vLLM and is no log: the doctor would call
    it healthy. The shortest real logs (an argparse error, a shell's "Killed") are half log
    lines or more (tests/fixtures/doctor)."""
    if not _mentions_vllm("".join(lines).encode("utf-8", "replace")):
        return False
    votes = [v for v in map(_log_line, lines) if v is not None]
    return not votes or sum(votes) >= LOG_SHARE * len(votes)


def _head_lines(path: Path) -> list[str]:
    with path.open("rb") as f:
        return f.read(_HEAD).decode("utf-8", "replace").splitlines()


def _regular(path: Path) -> bool:
    """A regular file: never a device (/dev/zero never ends), a FIFO (blocks), a socket."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def log_files(path: Path) -> list[Path]:
    """The vLLM logs in a folder: regular *.log/*.txt/*.out/*.err files whose first 64 KiB
    read as a vLLM log (`looks_like_log`), newest first: each is diagnosed on its own (serve's
    vllm-RUN-attemptN.log are one launch each), the latest attempt at the top."""
    files = sorted({p for pat in _LOG_NAMES for p in path.glob(pat) if _regular(p)},
                   key=lambda p: (-p.stat().st_mtime, p.name))
    out = []
    for p in files:
        with contextlib.suppress(OSError):
            if looks_like_log(_head_lines(p)):
                out.append(p)
    return out


def _lines_of(stream: TextIO, budget: list[int] | None = None) -> Iterator[str]:
    """Lines of a text stream, each at most MAX_LINE characters, without holding the file;
    with `budget` ([characters left]) it stops once that many have been read (stdin's cap)."""
    while True:
        chunk = stream.readline(MAX_LINE)
        if not chunk:
            return
        if not chunk.endswith("\n"):
            rest = chunk
            while rest and not rest.endswith("\n"):  # drop the remainder of an overlong line
                rest = stream.readline(MAX_LINE)
                if budget is not None:  # what is dropped was read: it counts to the cap
                    budget[0] -= len(rest)
                    if budget[0] < 0:
                        return
        if budget is not None:
            budget[0] -= len(chunk)
            if budget[0] < 0:
                return
        yield chunk


def _tail_start(size: int, m: Any) -> int:
    """Where reading a file of `size` bytes starts: at most MAX_BYTES before its end, on a
    line boundary."""
    if size <= MAX_BYTES:
        return 0
    cut = m.find(b"\n", size - MAX_BYTES)
    return size if cut < 0 else cut + 1


def _last_launch(path: Path) -> tuple[int, int, int] | None:
    """(offset, lines before it, launches before it) of the last launch in the file's tail,
    or None when the tail holds no launch. A restart resets the diagnosis (the last launch is
    the one diagnosed), so everything before the last launch only counts lines and launches:
    a crash-looping pod's 50,000 lines are then scanned from its last start."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            start = _tail_start(size, m)
            pos = m.rfind(LAUNCH.encode(), start)
            if pos < 0:
                return None
            line = m.rfind(b"\n", start, pos) + 1 or start
            # the API server names its version on the line before (log_version_and_model)
            prev = m.rfind(b"\n", start, max(start, line - 1)) + 1 or start
            if line > start and b"version" in m[prev:line]:
                line = prev
            before = m[start:line]
            return line, before.count(b"\n"), before.count(LAUNCH.encode())


def _open_at(path: Path, offset: int | None = None) -> TextIO:
    """The file as text from `offset`, or from at most MAX_BYTES before its end, starting at a
    whole line."""
    f = path.open("rb")
    if offset is None:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BYTES:
            f.seek(size - MAX_BYTES)
            f.readline()  # the rest of a line cut in half
    else:
        f.seek(offset)
    return io.TextIOWrapper(f, encoding="utf-8", errors="replace")


def _skip_to_last_launch(path: Path, scanner: Scanner) -> int | None:
    """The offset of the file's last launch, or None (read it all); the lines and launches
    before it are counted into `scanner`."""
    found = _last_launch(path)
    if found is None:
        return None
    offset, lines, launches = found
    scanner.count, scanner.launches = lines, launches
    scanner.vllm_seen = True
    return offset


def read_logs(source: str, stdin: TextIO | None = None) -> list[tuple[str, Report]]:
    """Diagnose a file, every vLLM log of a folder (newest first), or "-" (stdin): (name,
    report) for each.

    Raises InputError for a missing, unreadable or non-regular path, an empty log, a file or
    stream that is not a vLLM log (`looks_like_log`, whatever its name), stdin beyond
    MAX_BYTES, or a folder without vLLM logs: one line that says what to pass instead. At most
    the last MAX_BYTES of a file are read.
    """
    if source == "-":
        return [("<stdin>", _read_stdin(stdin if stdin is not None else _stdin()))]
    path = Path(source)
    if not path.exists():
        raise InputError(f"no such log: {source}; pass a vLLM log file, a folder of logs, "
                         "or - for stdin")
    if path.is_dir():
        files = log_files(path)
        if not files:
            raise InputError(f"no vLLM logs in {source} (looked for *.log, *.txt, *.out, "
                             "*.err that read as a vLLM log)")
        return [(str(f), _read_file(f, str(f))) for f in files]
    if not _regular(path):
        raise InputError(f"{source} is not a regular file (a device, FIFO or socket); pass "
                         "a vLLM log file, a folder of logs, or - for stdin")
    try:
        head = _head_lines(path)
    except OSError as e:
        raise InputError(f"cannot read {e.filename or source}: {e.strerror or e}") from None
    if head and not looks_like_log(head):
        raise InputError(f"{source} is not a vLLM log (its first 64 KiB name no vLLM process "
                         "or read as prose, not log lines); pass the log of a vLLM start")
    return [(source, _read_file(path, source))]


def _read_file(path: Path, name: str) -> Report:
    scanner = Scanner()
    try:
        offset = _skip_to_last_launch(path, scanner)
        with _open_at(path, offset) as stream:
            for raw in _lines_of(stream):
                scanner.feed(raw)
    except OSError as e:
        raise InputError(f"cannot read {e.filename or name}: {e.strerror or e}") from None
    except ValueError as e:  # mmap of a file that changed size while read
        raise InputError(f"cannot read {name}: {e}") from None
    report = scanner.report()
    if report.lines == 0:
        raise InputError(f"the log {name} is empty; pass the log of a vLLM start")
    return report


def _read_stdin(stream: TextIO) -> Report:
    """stdin, at most MAX_BYTES: a stream cannot be read from its tail, so a longer one is an
    error that says how to pass it, never a diagnosis of its first part."""
    scanner = Scanner()
    head: list[str] = []
    size = 0
    budget = [MAX_BYTES]
    for raw in _lines_of(stream, budget):
        if size < _HEAD:
            head.append(raw)
            size += len(raw)
        scanner.feed(raw)
    if budget[0] < 0:
        raise InputError(f"stdin holds more than {MAX_BYTES >> 20} MiB, the most the doctor "
                         "reads from a pipe; save it to a file (the doctor reads a file's last "
                         f"{MAX_BYTES >> 20} MiB) or pipe its tail: ... | tail -c "
                         f"{MAX_BYTES >> 20}M | vlaunch doctor -")
    report = scanner.report()
    if report.lines == 0:
        raise InputError("the log <stdin> is empty; pass the log of a vLLM start")
    if not looks_like_log(head):
        raise InputError("stdin is not a vLLM log (no vLLM process named, or prose rather "
                         "than log lines); pipe the log of a vLLM start, e.g. kubectl logs "
                         "POD | vlaunch doctor -")
    return report


def scan_source(source: str, stdin: TextIO | None = None) -> tuple[Report, list[str]]:
    """The newest log `read_logs` finds (a file, a folder's newest, stdin): (report, [name])."""
    name, report = read_logs(source, stdin)[0]
    return report, [name]


def _stdin() -> TextIO:
    return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
