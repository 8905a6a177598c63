"""Where vlaunch's data lives: the YAML profiles and the local caches."""

from __future__ import annotations

import functools
import os
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
    return yaml.load(Path(path).read_text(), Loader=loader)  # noqa: S506 (a safe loader)


def read_yaml(path: Path) -> Any:
    """A YAML file parsed once per process (re-read if it changes), with libyaml when present:
    `vlaunch plan` reads every profile and must answer in well under a second."""
    return _read_yaml(str(path), path.stat().st_mtime_ns)


def read_json_object(path: Path) -> dict[str, Any]:
    """A cache file as a dict; {} when it is missing, unreadable or not a JSON object (a corrupt
    cache is ignored, never trusted)."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
