"""launcher/schemas/plan.json, generated from the Deployment's types and the codec's layout.

Every dataclass of deployment/plan.py becomes a `$defs` entry (its fields, required when they
have no default, nothing else allowed); the top level is the codec's `dump`: the keys scripts
have read since before pools, then `deployment` and `pools`. `python -m launcher.deployment.schema`
rewrites the file; tests/test_deployment.py checks that the committed file is this output.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import plan as P
from .codec import EXTRA_KEYS, JSON_KEY, hints

PATH = Path(__file__).resolve().parent.parent / "schemas" / "plan.json"
_PERF_GOAL = {"objective": {"$ref": "#/$defs/Objective"}, "input_len": {"type": "integer"},
              "output_len": {"type": "integer"},
              "workload": {"anyOf": [{"type": "string"}, {"type": "null"}]},
              "assumed_workload": {"type": "boolean"}, "slo": {"$ref": "#/$defs/SLO"}}


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
    """A performance block as the codec writes it: the goal, then the Performance fields."""
    _type(P.Performance, defs)
    body = json.loads(json.dumps(defs["Performance"]))
    body["properties"] = {"source": body["properties"].pop("source"), **_PERF_GOAL,
                          **body["properties"]}
    body["required"] = [*body["required"], *_PERF_GOAL]
    return {"anyOf": [body, {"type": "null"}]}


def _with(ref: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"allOf": [ref], **extra} if extra else ref


def generate() -> dict[str, Any]:
    defs: dict[str, Any] = {"Objective": {"enum": list(typing.get_args(P.Objective))}}
    t = lambda tp: _type(tp, defs)  # noqa: E731 - one short name for the many fields below
    deployment = t(P.Deployment)  # walks every type once
    del deployment
    perf = {"$ref": "#/$defs/performance_block"}
    defs["performance_block"] = _performance_block(defs)
    whole = json.loads(json.dumps(defs["performance_block"]))
    whole["anyOf"][0]["properties"].update({"gpus": {"type": "integer"},
                                            "output_tokens_per_s_per_gpu": {"type": "number"}})
    whole["anyOf"][0]["required"] += ["gpus", "output_tokens_per_s_per_gpu"]
    defs["deployment_performance_block"] = whole
    pool = json.loads(json.dumps(defs["Pool"]))
    pool["properties"].update({"parallel": t(P.Parallel), "vllm_args": t(tuple[str, ...]),
                               "performance": perf})
    pool["required"] += ["parallel", "vllm_args"]
    defs["pool_block"] = pool
    alt = json.loads(json.dumps(defs["Alternative"]))
    alt["properties"]["performance"] = perf
    defs["alternative_block"] = alt
    # the top level below and pool_block are the JSON forms of these two (keys renamed, blocks
    # added): their field-by-field entries would describe no document
    del defs["Deployment"], defs["Pool"]
    top_parallel = json.loads(json.dumps(defs["Parallel"]))
    top_parallel["properties"]["distributed_executor_backend"] = {"type": "string"}
    top_parallel["required"].append("distributed_executor_backend")
    e = hints(P.EngineConfig)
    props = {
        "fits": t(bool), "model": t(P.ModelRef), "gpus": t(P.HardwareRef),
        "parallel": top_parallel,
        "gpu_memory_utilization": t(e["gpu_memory_utilization"]),
        "max_model_len": t(e["max_model_len"]), "max_num_seqs": t(e["max_num_seqs"]),
        "max_num_batched_tokens": t(e["max_num_batched_tokens"]),
        "enable_chunked_prefill": t(bool), "enforce_eager": t(bool),
        "kv_cache": t(P.KVCache), "per_gpu": t(P.PerGpuBudget), "max_concurrency": t(float),
        "candidates": t(P.SearchCounts), "per_stage": t(tuple[P.Stage, ...]),
        "vllm_version": t(str), "vllm_args": t(tuple[str, ...]), "env": t(Mapping[str, str]),
        "reasons": t(tuple[P.Reason, ...]), "warnings": t(tuple[P.Reason, ...]),
        "suggestions": t(tuple[P.Reason, ...]),
        "alternatives": {"type": "array", "items": {"$ref": "#/$defs/alternative_block"}},
        "performance": {"$ref": "#/$defs/deployment_performance_block"},
        "problem": t(str | None), "serving": t(P.Serving | None),
        "startup": t(P.Startup | None), "autoscaling": t(P.Autoscaling | None),
        "objective": t(P.Objective), "workload": t(P.Workload | None),
        "slo": t(P.SLO | None), "deployment": t(P.Kind),
        "pools": {"type": "array", "items": {"$ref": "#/$defs/pool_block"}, "minItems": 1},
        "tuned": t(Mapping[str, Any]),
        "role": t(P.PoolRole),
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://vlaunch/schemas/plan.json",
        "title": "vlaunch plan",
        "description": "`vlaunch plan --format json` and plan.json from --emit: the codec's dump "
                       "of a Deployment (launcher/deployment), generated by "
                       "launcher/deployment/schema.py. The top-level keys before `deployment` "
                       "are the pool it runs (the aggregated one; a pool's folder: the pool "
                       "`role` names), kept for scripts; `pools` holds each pool whole. "
                       "max_concurrency is vLLM's 'Maximum concurrency' (full-length "
                       "requests the KV cache holds), never a load.",
        "type": "object", "properties": props,
        "required": [k for k in props if k not in ("tuned", "role")],
        "additionalProperties": False, "$defs": dict(sorted(defs.items())),
    }


def text() -> str:
    return json.dumps(generate(), indent=2) + "\n"


if __name__ == "__main__":
    from ..paths import atomic_write

    atomic_write(PATH, text())
    print(PATH)
