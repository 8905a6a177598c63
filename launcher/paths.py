"""Where vlaunch's data lives: the YAML profiles and the local caches."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
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
    print(f"vlaunch: warning: cache {path}: {why}; ignored, never trusted (delete the file to "
          "start afresh)", file=sys.stderr)


def read_json_object(path: Path) -> dict[str, Any]:
    """A cache file as a dict; {} when it is missing, unreadable or not a JSON object (a corrupt
    cache is reported once and ignored, never trusted). Callers check each entry's types."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
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


def atomic_write(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> Path:
    """Write `text` to `path` so that readers see the old file or the new one, never a mix.

    The temp file lives in the same folder because `os.replace` is only atomic within one
    filesystem. It is fsynced before the rename so a node crash cannot leave an empty file
    under the final name.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target
