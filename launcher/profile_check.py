"""The profiles (`profiles/*.yaml`) checked against their JSON Schemas as they are read.

Why: the profiles are data a user edits (a new GPU, a new model). A misspelt key
(`hbm_gbs` for `hbm_gbps`) would otherwise read as "not given": the plan silently claims no
performance for that GPU. So `paths.read_yaml` validates every profile when it first reads it,
and a violation is one line (file, where, what, the schema to read) and exit 2, never a
traceback or a quiet wrong answer. The schemas live in `launcher/schemas/profiles/`, beside the
code that reads the profiles, so a folder given with VLAUNCH_PROFILES_DIR is held to the same
rules.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from .errors import InputError

SCHEMAS = Path(__file__).resolve().parent / "schemas" / "profiles"


def schema_for(relative: Path) -> str | None:
    """The schema of a file at `relative` inside the profiles folder (None: not a profile)."""
    parts = relative.parts
    if parts in (("gpus.yaml",), ("capabilities.yaml",), ("serving.yaml",),
                 ("connectors.yaml",)):
        return relative.stem
    if len(parts) == 2 and parts[0] == "models" and relative.suffix == ".yaml":
        return "model"
    return None


@functools.lru_cache(maxsize=8)
def _validator(schema: str) -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads((SCHEMAS / f"{schema}.json").read_text()))


def problems(data: Any, schema: str) -> list[str]:
    """Every violation of `schema` (a name in SCHEMAS) by `data`, as "where: what" lines."""
    out = []
    for e in sorted(_validator(schema).iter_errors(data), key=lambda e: list(map(str, e.path))):
        where = ".".join(str(p) for p in e.absolute_path) or "(top)"
        out.append(f"{where}: {e.message}")
    return out


def check(path: Path, data: Any, schema: str) -> None:
    """InputError, one line, when `data` (read from `path`) breaks `schema`."""
    found = problems(data, schema)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise InputError(f"profile {path}: {found[0]}{more}; see "
                         f"{SCHEMAS / (schema + '.json')} for what it may hold")
