"""Where vlaunch's data lives: the YAML profiles and the local caches."""

from __future__ import annotations

import os
from pathlib import Path


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
