"""launcher/schemas/plan.json, generated from the Deployment's types and the codec's layout.

Every dataclass of deployment/plan.py becomes a `$defs` entry (its fields, required when they
have no default, nothing else allowed). The top level is generated the same way, from the
Deployment's fields and the codec's tables (TOP: each key a field, or a summary key scripts have
read since before pools, typed by its path in the pool; POOL_EXTRA, PERF_GOAL,
DEPLOYMENT_PERF_EXTRA), which are what `dump` writes: no key is listed here.
`python -m launcher.deployment.schema` rewrites the file; tests/test_deployment.py checks that
the committed file is this output.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import plan as P
from .codec import (
    DEPLOYMENT_PERF_EXTRA,
    EXTRA_KEYS,
    JSON_KEY,
    OMIT_IF_NONE,
    PERF_GOAL,
    POOL,
    POOL_EXTRA,
    SUMMARY,
    SUMMARY_EXTRA,
    hints,
    top_level,
)

PATH = Path(__file__).resolve().parent.parent / "schemas" / "plan.json"


def _strip_none(tp: Any) -> Any:
    """`X | None` as X (a path walks through a value that is set)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _path_type(cls: Any, path: str, first: dict[str, Any] | None = None) -> Any:
    """The type at `path` (field names joined by dots) from `cls`; `first` types the keys the
    first step's JSON carries beyond its fields."""
    tp = cls
    for i, name in enumerate(path.split(".")):
        tp = (first[name] if i == 0 and first and name in first
              else hints(_strip_none(tp))[name])
    return tp


def _type(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return {}
    if tp is P.Objective:
        return {"$ref": "#/$defs/Objective"}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type(a, defs) for a in typing.get_args(tp)]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is tuple:
        return {"type": "array", "items": _type(typing.get_args(tp)[0], defs)}
    if origin is Mapping or tp is Mapping:
        args = typing.get_args(tp)
        return {"type": "object", "additionalProperties": _type(args[1], defs) if args else {}}
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # a placeholder while its fields are walked
            defs[tp.__name__] = _object(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    return {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"},
            bool: {"type": "boolean"}, type(None): {"type": "null"}}[tp]


def _object(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required = []
    for f in dataclasses.fields(cls):
        key = JSON_KEY.get(cls, {}).get(f.name, f.name)
        props[key] = _type(hints(cls)[f.name], defs)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(key)
    for key, tp in EXTRA_KEYS.get(cls, {}).items():
        props[key] = _type(tp, defs)
        required.append(key)
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _performance_block(defs: dict[str, Any]) -> dict[str, Any]:
    """A performance block as the codec writes it: the goal (PERF_GOAL: written only when the
    workload and SLO are set), then the Performance fields."""
    _type(P.Performance, defs)
    body = copy.deepcopy(defs["Performance"])
    goal = {k: _type(_goal_type(path), defs) for k, path in PERF_GOAL.items()}
    body["properties"] = {"source": body["properties"].pop("source"), **goal,
                          **body["properties"]}
    body["required"] = [*body["required"], *goal]
    return {"anyOf": [body, {"type": "null"}]}


def _goal_type(path: str) -> Any:
    """A goal key's type: the block exists only when the workload and SLO are set, so a field
    of the Deployment itself (`slo`) is never null there; a field inside one keeps its type."""
    tp = _path_type(P.Deployment, path)
    return _strip_none(tp) if "." not in path else tp


def _summary(defs: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    """The summary keys' schemas: each the first pool's at its path (codec.SUMMARY), objects
    widened by their SUMMARY_EXTRA keys."""
    out = {}
    for key, path in SUMMARY.items():
        head = path.split(".")[0]
        sub = (pool["properties"][head] if "." not in path and head in POOL_EXTRA
               else _type(_path_type(P.Pool, path, POOL_EXTRA), defs))
        extra = SUMMARY_EXTRA.get(key)
        if extra:
            sub = copy.deepcopy(defs[sub["$ref"].rsplit("/", 1)[1]])
            for k, p in extra.items():
                sub["properties"][k] = _type(_path_type(P.Pool, p, POOL_EXTRA), defs)
                sub["required"].append(k)
        out[key] = sub
    return out


def generate() -> dict[str, Any]:
    """The whole schema from the types and the codec's tables (no key listed here)."""
    defs: dict[str, Any] = {"Objective": {"enum": list(typing.get_args(P.Objective))}}
    _type(P.Deployment, defs)  # walks every type once
    defs["performance_block"] = _performance_block(defs)
    perf = {"$ref": "#/$defs/performance_block"}
    whole = copy.deepcopy(defs["performance_block"])
    whole["anyOf"][0]["properties"].update(
        {k: _type(tp, defs) for k, tp in DEPLOYMENT_PERF_EXTRA.items()})
    whole["anyOf"][0]["required"] += list(DEPLOYMENT_PERF_EXTRA)
    defs["deployment_performance_block"] = whole
    pool = copy.deepcopy(defs["Pool"])
    pool["properties"].update({k: _type(tp, defs) for k, tp in POOL_EXTRA.items()})
    pool["properties"]["performance"] = perf
    pool["required"] += list(POOL_EXTRA)
    defs["pool_block"] = pool
    alt = copy.deepcopy(defs["Alternative"])
    alt["properties"]["performance"] = perf
    defs["alternative_block"] = alt
    block = {"performance": {"$ref": "#/$defs/deployment_performance_block"},
             "runners_up": {"type": "array", "items": {"$ref": "#/$defs/alternative_block"}},
             "pools": {"type": "array", "items": {"$ref": "#/$defs/pool_block"},
                       "minItems": 1}}
    props: dict[str, Any] = {}
    optional = set(OMIT_IF_NONE[P.Deployment])
    summary = _summary(defs, pool)
    for key, source in top_level():
        if source.startswith(POOL):
            props[key] = summary[key]
            continue
        tp = hints(P.Deployment)[source]
        props[key] = block.get(source) or _type(
            _strip_none(tp) if source in optional else tp, defs)  # omitted, never null
    # the top level and pool_block are the JSON forms of these two (keys renamed, blocks
    # added): their field-by-field entries would describe no document
    del defs["Deployment"], defs["Pool"]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://vlaunch/schemas/plan.json",
        "title": "vlaunch plan",
        "description": "`vlaunch plan --format json` and plan.json from --emit: the codec's dump "
                       "of a Deployment (launcher/deployment), generated by "
                       "launcher/deployment/schema.py from its types and the codec's tables. "
                       "The summary keys (`parallel`, `max_model_len`, ..., `serving`, "
                       "`autoscaling`) are the pool it runs (the aggregated one; a pool's "
                       "folder: the pool `role` names), kept for scripts; `pools` holds each "
                       "pool whole. max_concurrency is vLLM's 'Maximum concurrency' "
                       "(full-length requests the KV cache holds), never a load.",
        "type": "object", "properties": props,
        "required": [k for k, source in top_level() if source not in optional],
        "additionalProperties": False, "$defs": dict(sorted(defs.items())),
    }


def text() -> str:
    return json.dumps(generate(), indent=2) + "\n"


if __name__ == "__main__":
    from ..paths import atomic_write

    atomic_write(PATH, text())
    print(PATH)
