"""Where vlaunch's data lives: the YAML profiles and the local caches."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def profiles_dir() -> Path:
    """The `profiles/` folder: shipped inside the wheel, or next to the package in a checkout."""
    env = os.environ.get("VLAUNCH_PROFILES_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    packaged = here / "_profiles"
    return packaged if packaged.is_dir() else here.parent / "profiles"


def cache_dir() -> Path:
    """Local state (capability lessons, generated test models): $VLAUNCH_CACHE_DIR or XDG."""
    env = os.environ.get("VLAUNCH_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vlaunch"


@functools.lru_cache(maxsize=64)
def _read_yaml(path: str, mtime_ns: int) -> Any:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster
    data = yaml.load(Path(path).read_text(), Loader=loader)  # noqa: S506 (a safe loader)
    _check_profile(Path(path), data)
    return data


_CHECKED_FILE = "profiles-checked.json"
_checked: dict[str, Any] | None = None


def _check_profile(path: Path, data: Any) -> None:
    """Hold a profile to its schema (launcher/profile_check), once per version of the file:
    a stamp (mtime, size, the schema's mtime) of each file that passed is kept in the cache,
    so a plan does not import jsonschema (~0.1 s) to re-check the same shipped files."""
    from .profile_check import SCHEMAS, check, schema_for

    global _checked
    try:
        relative = path.resolve().relative_to(profiles_dir().resolve())
    except ValueError:  # not a profile
        return
    schema = schema_for(relative)
    if schema is None:
        return
    try:
        st, schema_st = path.stat(), (SCHEMAS / f"{schema}.json").stat()
        stamp = f"{st.st_mtime_ns}:{st.st_size}:{schema_st.st_mtime_ns}"
    except OSError:
        stamp = None
    store, key = cache_dir() / _CHECKED_FILE, str(path.resolve())
    if _checked is None:
        _checked = read_json_object(store)
    if stamp is not None and _checked.get(key) == stamp:
        return
    check(path, data, schema)
    if stamp is not None:
        _checked[key] = stamp
        with contextlib.suppress(OSError):  # a read-only cache costs a re-check, nothing more
            update_json_object(store, lambda d: d.__setitem__(key, stamp))


def read_yaml(path: Path) -> Any:
    """A YAML file parsed once per process (re-read if it changes), with libyaml when present:
    `vlaunch plan` reads every profile and must answer in well under a second. A profile is
    checked against its schema on that first read (InputError, one line, when it breaks it)."""
    return _read_yaml(str(path), path.stat().st_mtime_ns)


_REPORTED: set[str] = set()


def report_corrupt(path: Path, why: str) -> None:
    """Say on stderr, once per process and file, that a cache is being ignored: silence would
    hide a disk or permission problem, and a traceback would stop a plan that can do without
    the cache."""
    if str(path) in _REPORTED:
        return
    _REPORTED.add(str(path))
    from .term import echo  # the presentation layer: plain unless stderr is a terminal

    echo(f"vlaunch: warning: cache {path}: {why}; ignored, never trusted (delete the file to "
         "start afresh)", err=True)


MAX_SMALL_FILE = 16 << 20
"""The most a plan, a cache entry or a config.json may hold: each is KiB to a few MiB (a
DeepSeek-V3 index is 9 MiB); a larger one is a mistake or an attack, not data."""


class NotSmallFile(OSError):
    """A path that is not a regular file of at most `limit` bytes (strerror says which)."""

    def __str__(self) -> str:
        return str(self.strerror)


def read_small(path: str | os.PathLike[str], limit: int = MAX_SMALL_FILE) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, read without waiting or filling
    memory: a FIFO, a device (/dev/zero), a folder or a socket at the name is refused, whatever
    symlink leads there, and so is a file larger than `limit` (issue 31: a FIFO or a link to
    /dev/zero in the cache hung every plan). O_NONBLOCK makes opening a FIFO return at once;
    the type is checked on the open descriptor, so a swap after a check cannot slip past; at
    most limit + 1 bytes are ever read."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotSmallFile(0, "not a regular file", str(path))
        if st.st_size > limit:
            raise NotSmallFile(0, f"larger than {limit >> 20} MiB", str(path))
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > limit:  # grew while read
            raise NotSmallFile(0, f"larger than {limit >> 20} MiB", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_small_text(path: str | os.PathLike[str], limit: int = MAX_SMALL_FILE) -> str:
    """`read_small` decoded as UTF-8 (UnicodeDecodeError when it is not)."""
    return read_small(path, limit).decode("utf-8")


def loads_json(text: str | bytes, **kw: Any) -> Any:
    """json.loads where nesting too deep for the parser is a JSONDecodeError like any other
    malformed file, not a RecursionError traceback (a config.json of 100,000 `[`)."""
    import json

    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A cache file as a dict; {} when it is missing, unreadable or not a JSON object (a corrupt
    cache is reported once and ignored, never trusted). Callers check each entry's types."""
    import json

    try:
        data = loads_json(read_small_text(path))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        report_corrupt(path, f"unreadable: {e}")
        return {}
    if not isinstance(data, dict):
        report_corrupt(path, f"a JSON {type(data).__name__}, not an object")
        return {}
    return data


def update_json_object(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """Read-modify-write a JSON cache under an exclusive lock, replacing the file atomically.

    Two runs recording at once (a `serve` and a `tune`, two pods on one cache volume) would
    otherwise each read the old file and the second rename would drop the first one's entry.
    The lock is a sidecar file (`.NAME.lock`), so readers never wait: they see the old file or
    the new one, never a mix.
    """
    import fcntl
    import json


    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        data = read_json_object(path)
        change(data)
        return atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def inside(folder: Path, *parts: str) -> Path:
    """folder/parts, refused (InputError) unless it stays inside `folder`: a name from a
    file or a server (a commit id, a shard name, a branch) never becomes an absolute path or
    climbs out with `..` (issue 31, H1: a Hub "sha" of `/abs/y` wrote `/abs/y.json`). The
    check is on the names, before any symlink is followed, and on the resolved path too."""
    from .errors import InputError

    for part in parts:
        if (not part or "\x00" in part or part.startswith("/") or len(part) > 255 * 4
                or any(p in ("..", ".") or not p for p in part.split("/"))):
            raise InputError(f"refusing the name {part[:80]!r} as a file inside {folder}: "
                             "it is empty, absolute or climbs out of the folder")
    path = folder.joinpath(*parts)
    base = os.path.realpath(folder)
    real = os.path.realpath(path.parent)
    if real != base and not real.startswith(base.rstrip("/") + "/"):
        raise InputError(f"refusing {path}: it lies outside {folder}")
    return path


def warn_if_foreign(path: str | os.PathLike[str]) -> bool:
    """Warn (stderr, one line) when a file vlaunch acts on (a plan that becomes a command
    line) is owned by another user or writable by everyone: whoever can write it chooses what
    runs. Root's files are not foreign. True when a warning was printed."""
    import stat

    try:
        st = os.stat(path)
    except OSError:
        return False
    who = None
    if st.st_uid not in (os.geteuid(), 0):
        who = f"is owned by user {st.st_uid}, not you ({os.geteuid()})"
    elif st.st_mode & stat.S_IWOTH:
        who = "is writable by every user"
    if who is None:
        return False
    from .term import echo

    echo(f"vlaunch: warning: {path} {who}; whoever can write it chooses what vlaunch runs "
         "(chmod o-w, or keep plans in a folder only you can write)", err=True)
    return True


def warn_if_open_folder(folder: str | os.PathLike[str]) -> bool:
    """Warn (stderr, one line) when an output folder is writable by every user: another user
    can swap or plant files there (without the sticky bit), or read what lands in it as it is
    written there. True when a warning was printed."""
    import stat

    try:
        st = os.stat(folder)
    except OSError:
        return False
    if not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH):
        return False
    sticky = " (sticky: others cannot replace your files, but can plant other names)" \
        if st.st_mode & stat.S_ISVTX else ""
    from .term import echo

    echo(f"vlaunch: warning: {folder} is writable by every user{sticky}; write plans to a "
         "folder only you can write (chmod o-w)", err=True)
    return True


def current_umask() -> int:
    """The process umask, read without changing it where Linux says it (/proc/self/status);
    elsewhere set-and-restore (os.umask has no read-only form)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def atomic_write(path: str | os.PathLike[str], text: str, mode: int | None = None) -> Path:
    """Write `text` to `path` so that readers see the old file or the new one, never a mix.

    The temp file lives in the same folder because `os.replace` is only atomic within one
    filesystem. It is fsynced before the rename so a node crash cannot leave an empty file
    under the final name. The file gets the permissions `open()` would give a new file (0666
    less the umask), not mkstemp's 0600 nor a fixed 0644: a user who set `umask 077` keeps
    plans and caches private. `mode`, when given, is masked by the umask too.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), (0o666 if mode is None else mode) & ~current_umask())
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def _open_char_device(path: Path) -> Any:
    """An existing character device named explicitly (/dev/null, /dev/full) opened for
    appending, else None. Only root makes device nodes, so writing to one leaks nothing to
    whoever made the name; checked again on the open descriptor, against a swap meanwhile."""
    import stat

    try:
        if not stat.S_ISCHR(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    if not stat.S_ISCHR(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "ab", buffering=0)


def create_private(path: str | os.PathLike[str], *, tries: int = 1000) -> tuple[Any, Path]:
    """A new file only this user can read (0600), opened for appending bytes, unbuffered.

    O_EXCL | O_NOFOLLOW: a name that already exists, or a symlink planted under it (log names
    such as tune's `vllm-trial3.log` are predictable, and a log dir may be shared), is never
    opened or followed; the next free name `STEM-2.SUFFIX`, `STEM-3.SUFFIX`, ... is taken
    instead. An existing character device named on purpose (/dev/null) is written to as it is.
    Returns (file, the path actually opened).
    """
    target = Path(path)
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
             | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    for n in range(1, tries + 1):
        candidate = target if n == 1 else target.with_name(f"{target.stem}-{n}{target.suffix}")
        try:
            fd = os.open(candidate, flags, 0o600)
        except FileExistsError:
            device = _open_char_device(candidate)
            if device is not None:
                return device, candidate
            continue
        return os.fdopen(fd, "ab", buffering=0), candidate
    raise FileExistsError(f"{target} and {tries - 1} alternatives exist; clean up {target.parent}")
