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
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ..errors import InputError
from .vllm_failures import Report, Scanner
from .vllm_loglines import LAUNCH, MAX_LINE

# --- reading logs ------------------------------------------------------------------------------

_LOG_NAMES = ("*.log", "*.txt", "*.out", "*.err")
MAX_BYTES = 256 << 20  # read at most the last 256 MiB of a log: the failure is at its end
_HEAD = 65536  # a vLLM log names vLLM in its first 64 KiB (the banner, the version line)


def _mentions_vllm(head: bytes) -> bool:
    """vLLM's name, its engine or API server process, or the usage line of its entry point
    (vllm/entrypoints/openai/api_server.py, whose argparse errors name nothing else)."""
    return (b"vllm" in head.lower() or b"EngineCore" in head or b"(APIServer" in head
            or b"api_server.py" in head)


def _regular(path: Path) -> bool:
    """A regular file: never a device (/dev/zero never ends), a FIFO (blocks), a socket."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def log_files(path: Path) -> list[Path]:
    """The vLLM logs in a folder: regular *.log/*.txt/*.out/*.err files that mention vLLM
    (first 64 KiB), oldest first so that a later restart's log is read last."""
    files = sorted({p for pat in _LOG_NAMES for p in path.glob(pat) if _regular(p)},
                   key=lambda p: (p.stat().st_mtime, p.name))
    out = []
    for p in files:
        with contextlib.suppress(OSError), p.open("rb") as f:
            if _mentions_vllm(f.read(_HEAD)):
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


def _skip_to_last_launch(files: list[Path], scanner: Scanner) -> tuple[int, int | None]:
    """(index of the first file to read, offset in it) after skipping what precedes the last
    launch of the stream; the skipped lines and launches are counted into `scanner`."""
    for i in range(len(files) - 1, -1, -1):
        found = _last_launch(files[i])
        if found is None:
            continue
        offset, lines, launches = found
        for skipped in files[:i]:
            with _open_at(skipped) as stream:
                for raw in _lines_of(stream):
                    lines += 1
                    launches += LAUNCH in raw
        scanner.count, scanner.launches = lines, launches
        scanner.vllm_seen = True
        return i, offset
    return 0, None


def scan_source(source: str, stdin: TextIO | None = None) -> tuple[Report, list[str]]:
    """Diagnose a file, a folder of vLLM logs, or "-" (stdin). Returns (report, names read).

    Raises InputError for a missing, unreadable or non-regular path, an empty log, a file or
    stream that is not a vLLM log (the folder scan's rule: vLLM named in its first 64 KiB),
    or a folder without vLLM logs: one line that says what to pass instead. At most the last
    MAX_BYTES of a file (the first of stdin) are read.
    """
    if source == "-":
        stream = stdin if stdin is not None else _stdin()
        scanner = Scanner()
        for raw in _lines_of(stream, [MAX_BYTES]):
            scanner.feed(raw)
        report = scanner.report()
        names = ["<stdin>"]
        if report.lines and not scanner.vllm_seen:
            raise InputError("stdin is not a vLLM log (no vLLM line in it); pipe the log of a "
                             "vLLM start, e.g. kubectl logs POD | vlaunch doctor -")
    else:
        path = Path(source)
        if not path.exists():
            raise InputError(f"no such log: {source}; pass a vLLM log file, a folder of logs, "
                             "or - for stdin")
        if path.is_dir():
            files = log_files(path)
            if not files:
                raise InputError(f"no vLLM logs in {source} (looked for *.log, *.txt, *.out, "
                                 "*.err that mention vLLM)")
        elif not _regular(path):
            raise InputError(f"{source} is not a regular file (a device, FIFO or socket); pass "
                             "a vLLM log file, a folder of logs, or - for stdin")
        else:
            files = [path]
        scanner = Scanner()
        try:
            if files == [path]:
                with path.open("rb") as head:
                    first = head.read(_HEAD)
                if first and not _mentions_vllm(first):
                    raise InputError(f"{source} is not a vLLM log (no vLLM line in its "
                                     "first 64 KiB); pass the log of a vLLM start")
            start, offset = _skip_to_last_launch(files, scanner)
            for i, f in enumerate(files[start:]):
                with _open_at(f, offset if i == 0 else None) as stream:
                    for raw in _lines_of(stream):
                        scanner.feed(raw)
        except OSError as e:
            raise InputError(f"cannot read {e.filename or source}: {e.strerror or e}") from None
        except ValueError as e:  # mmap of a file that changed size while read
            raise InputError(f"cannot read {source}: {e}") from None
        report = scanner.report()
        names = [str(f) for f in files]
    if report.lines == 0:
        raise InputError(f"the log {names[0]} is empty; pass the log of a vLLM start")
    return report, names


def _stdin() -> TextIO:
    return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
