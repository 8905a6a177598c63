"""The one (de)serialiser of a Deployment: `dump(d) -> dict`, `load(dict) -> Deployment`.

`load(dump(d)) == d`. The JSON is the Deployment's fields, among them the keys scripts read
since before pools existed (`parallel`, `max_model_len`, ..., `vllm_args`, `env`, `serving`),
read from the pool the plan runs (the aggregated one; in a pool's folder, `vlaunch plan --role R
--emit`, the pool `role` names), and `pools` (each pool whole, with its `engine`: every vLLM
flag's value): the `TOP` table says which and in what order; `role` only where set. `load`
reads the pools and the deployment's own fields, type by type from the dataclasses'
annotations, and says in one line which field is missing or wrong (an `InputError`: exit 2), so
no other module needs to subscript a plan dict.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

from ..errors import InputError
from . import plan as P
from .argv import pool_argv

FIX = "re-emit it with `vlaunch plan MODEL --emit DIR`"

# keys the JSON of a type carries beyond its fields (derived when dumped, ignored when loaded)
EXTRA_KEYS: dict[type, dict[str, Any]] = {
    P.HardwareRef: {"count": int},
}
# a field whose JSON key differs from its name (the names scripts have read since before pools;
# the Deployment's come from TOP below)
JSON_KEY: dict[type, dict[str, str]] = {}
# fields written only when set (the model's provenance, as the plan has always written it)
OMIT_IF_NONE: dict[type, tuple[str, ...]] = {
    P.ModelRef: ("revision", "commit", "params_by_dtype", "checkpoint_params"),
    P.Performance: ("measured",),
    P.Deployment: ("tuned", "role"),  # role: only a pool's folder says which pool it runs
}

# The top level of the plan's JSON, in its order: each key is a field of the Deployment, or
# (`pool:PATH`) a summary key scripts have read since before pools, the JSON at PATH of the pool
# the plan runs (`Deployment.pool`). A Deployment field TOP does not name is written after
# these, under its own name, so a new field needs no edit here. deployment/schema.py types
# every key from the same table.
TOP: dict[str, str] = {
    "fits": "fits", "model": "model", "gpus": "hardware",
    "parallel": "pool:parallel",
    "gpu_memory_utilization": "pool:engine.gpu_memory_utilization",
    "max_model_len": "pool:engine.max_model_len",
    "max_num_seqs": "pool:engine.max_num_seqs",
    "max_num_batched_tokens": "pool:engine.max_num_batched_tokens",
    "enable_chunked_prefill": "pool:engine.enable_chunked_prefill",
    "enforce_eager": "pool:engine.enforce_eager",
    "kv_cache": "pool:kv_cache", "per_gpu": "pool:per_gpu",
    "max_concurrency": "pool:max_concurrency", "candidates": "candidates",
    "per_stage": "pool:per_stage", "vllm_version": "vllm_version", "vllm_args": "pool:vllm_args",
    "env": "pool:env", "reasons": "reasons", "warnings": "warnings",
    "suggestions": "suggestions", "alternatives": "runners_up", "performance": "performance",
    "problem": "problem", "serving": "pool:serving", "startup": "pool:startup",
    "autoscaling": "pool:autoscaling", "objective": "objective", "workload": "workload",
    "slo": "slo", "deployment": "kind", "pools": "pools", "tuned": "tuned", "role": "role",
}
POOL = "pool:"
SUMMARY: dict[str, str] = {k: v[len(POOL):] for k, v in TOP.items() if v.startswith(POOL)}
JSON_KEY[P.Deployment] = {v: k for k, v in TOP.items() if not v.startswith(POOL) and k != v}


def top_level() -> list[tuple[str, str]]:
    """(JSON key, source) of each top-level key in order: TOP's, then any Deployment field it
    does not name."""
    named = {v for v in TOP.values() if not v.startswith(POOL)}
    return [*TOP.items(), *((f.name, f.name) for f in dataclasses.fields(P.Deployment)
                            if f.name not in named)]


# keys a summary object carries beyond its pool's (path in the same pool's JSON)
SUMMARY_EXTRA: dict[str, dict[str, str]] = {
    "parallel": {"distributed_executor_backend": "engine.distributed_executor_backend"},
}
# keys a pool's JSON carries beyond its fields (its `performance` is a performance block)
POOL_EXTRA: dict[str, Any] = {"parallel": P.Parallel, "vllm_args": tuple[str, ...]}
# a performance block's goal: key -> path in the Deployment (written only when both are set)
PERF_GOAL: dict[str, str] = {
    "objective": "objective", "input_len": "workload.input_len",
    "output_len": "workload.output_len", "workload": "workload.name",
    "assumed_workload": "workload.assumed", "slo": "slo",
}
# the deployment's own performance block adds the per-GPU figure over every pool's GPUs
DEPLOYMENT_PERF_EXTRA: dict[str, Any] = {"gpus": int, "output_tokens_per_s_per_gpu": float}


def to_json(v: Any) -> Any:
    """A typed value as JSON values: dataclasses as objects, tuples as lists."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        out = {}
        for f in dataclasses.fields(v):
            x = getattr(v, f.name)
            if x is None and f.name in OMIT_IF_NONE.get(type(v), ()):
                continue
            out[f.name] = to_json(x)
        for k in EXTRA_KEYS.get(type(v), {}):
            out[k] = getattr(v, k)
        return out
    if isinstance(v, (tuple, list)):
        return [to_json(x) for x in v]
    if isinstance(v, Mapping):
        return {k: to_json(x) for k, x in v.items()}
    return v


def performance_json(d: P.Deployment, perf: P.Performance | None) -> dict[str, Any] | None:
    """A performance block as the plan writes it: the goal it was predicted for, then the
    figures (so a reader of `performance` alone knows the workload and SLO)."""
    if perf is None or d.workload is None or d.slo is None:
        return None
    goal = {k: to_json(_attr(d, path)) for k, path in PERF_GOAL.items()}
    return {"source": perf.source, **goal,
            **{k: v for k, v in to_json(perf).items() if k != "source"}}


def _attr(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _item(doc: Any, path: str) -> Any:
    for key in path.split("."):
        doc = doc[key]
    return doc


def pool_json(d: P.Deployment, pool: P.Pool) -> dict[str, Any]:
    body = to_json(pool)
    body["parallel"] = to_json(pool.engine.parallel)
    body["vllm_args"] = pool_argv(pool) if d.fits else []
    body["performance"] = performance_json(d, pool.performance)
    return body


def _deployment_performance(d: P.Deployment) -> dict[str, Any] | None:
    """The deployment's own figures, and the same per GPU over every GPU of every pool."""
    out = performance_json(d, d.performance)
    if out is not None and d.performance is not None:
        gpus = d.gpus
        at = d.performance.at
        out["gpus"] = gpus
        out["output_tokens_per_s_per_gpu"] = round(at.output_tokens_per_s / gpus, 2)
    return out


def _alternative_json(d: P.Deployment, a: P.Alternative) -> dict[str, Any]:
    out = to_json(a)
    out["performance"] = performance_json(d, a.performance)
    return out


def _summary(first: dict[str, Any]) -> dict[str, Any]:
    """The summary keys, read from the JSON of the pool the plan runs (copies: an edit of one
    is an edit)."""
    out = {k: copy.deepcopy(_item(first, path)) for k, path in SUMMARY.items()}
    for key, extra in SUMMARY_EXTRA.items():
        out[key] = {**out[key], **{k: _item(first, path) for k, path in extra.items()}}
    return out


def dump(d: P.Deployment) -> dict[str, Any]:
    """The plan's JSON (`vlaunch plan --format json`, plan.json): `top_level()`'s keys."""
    pools = [pool_json(d, p) for p in d.pools]
    summary = _summary(pools[d.pools.index(d.pool)])  # the pool it runs
    block = {"performance": lambda: _deployment_performance(d), "pools": lambda: pools,
             "runners_up": lambda: [_alternative_json(d, a) for a in d.runners_up]}
    out: dict[str, Any] = {}
    for key, source in top_level():
        if source.startswith(POOL):
            out[key] = summary[key]
            continue
        v = getattr(d, source)
        if v is None and source in OMIT_IF_NONE[P.Deployment]:
            continue
        out[key] = block[source]() if source in block else to_json(v)
    return out


# ----------------------------------------------------------------------------- load


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(P))


def _fail(where: str, v: Any, what: str) -> InputError:
    return InputError(f"the plan's `{where}` is {v!r:.40}; it must be {what}; {FIX}")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def describe(tp: Any) -> str:
    """A type as the one-line error names it."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin is tuple:
        return "a list"
    if origin is Mapping or tp is Mapping:
        return "an object"
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {int: "a whole number", float: "a number", str: "text", bool: "true or false",
            type(None): "null"}.get(tp, str(tp))


def build(tp: Any, v: Any, where: str) -> Any:
    """`v` (JSON values) as type `tp`, or an InputError naming `where`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return v
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return build(a, v, where)
            except InputError:
                if len(args) == 2:
                    raise
        raise _fail(where, v, describe(tp))
    if origin is typing.Literal:
        if v not in typing.get_args(tp):
            raise _fail(where, v, describe(tp))
        return v
    if origin is tuple:
        if not isinstance(v, list):
            raise _fail(where, v, "a list")
        item = typing.get_args(tp)[0]
        return tuple(build(item, x, f"{where}[{i}]") for i, x in enumerate(v))
    if origin is Mapping or tp is Mapping:
        if not isinstance(v, dict):
            raise _fail(where, v, "an object")
        args = typing.get_args(tp)
        value_tp = args[1] if args else Any
        return {str(k): build(value_tp, x, f"{where}.{k}") for k, x in v.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            raise _fail(where, v, "an object")
        kw = {}
        for f in dataclasses.fields(tp):
            key = JSON_KEY.get(tp, {}).get(f.name, f.name)
            name = f"{where}.{key}" if where else key
            if key not in v:
                if f.default is not dataclasses.MISSING or \
                        f.default_factory is not dataclasses.MISSING:
                    continue
                raise InputError(f"the plan has no `{name}`; {FIX}")
            kw[f.name] = build(hints(tp)[f.name], v[key], name)
        return tp(**kw)
    if tp is bool:
        if not isinstance(v, bool):
            raise _fail(where, v, "true or false")
        return v
    if tp is int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _fail(where, v, "a whole number")
        return v
    if tp is float:
        if not _is_num(v):
            raise _fail(where, v, "a number")
        return v
    if tp is str:
        if not isinstance(v, str):
            raise _fail(where, v, "text")
        return v
    raise TypeError(f"the codec cannot read {tp!r}")  # a type added without a reader


def _check(d: P.Deployment, raw: dict[str, Any]) -> None:
    """What the types alone cannot say: counts of at least one, a fraction, and the argv the
    file carries being the one its engine builds (a hand edit of `vllm_args` alone would
    otherwise be ignored silently)."""
    if not d.pools:
        raise InputError(f"the plan has no pools; {FIX}")
    for i, pool in enumerate(d.pools):
        e, where = pool.engine, f"pools[{i}]"
        counts = {"replicas": pool.replicas, "gpus_per_replica": pool.gpus_per_replica,
                  "nodes_per_replica": pool.nodes_per_replica,
                  "engine.parallel.tp": e.parallel.tp, "engine.parallel.pp": e.parallel.pp,
                  "engine.parallel.dp": e.parallel.dp, "engine.parallel.nodes": e.parallel.nodes}
        if d.fits:  # a plan that does not fit has no context or batch to run
            counts.update({"engine.max_model_len": e.max_model_len,
                           "engine.max_num_seqs": e.max_num_seqs,
                           "engine.max_num_batched_tokens": e.max_num_batched_tokens})
        for name, n in counts.items():
            if n < 1:
                raise _fail(f"{where}.{name}", n, "a whole number of at least 1")
        if d.fits and e.kv_cache_memory_bytes is not None and e.kv_cache_memory_bytes < 1:
            raise _fail(f"{where}.engine.kv_cache_memory_bytes", e.kv_cache_memory_bytes,
                        "a whole number of bytes of at least 1, or null")
        if not 0 < e.gpu_memory_utilization <= 1:
            raise _fail(f"{where}.engine.gpu_memory_utilization", e.gpu_memory_utilization,
                        "a number in (0, 1]")
        got = raw["pools"][i].get("vllm_args")
        want = pool_argv(pool) if d.fits else []
        if got is not None and got != want:
            raise InputError(f"the plan's `{where}.vllm_args` differ from the arguments its "
                             f"`{where}.engine` gives ({' '.join(map(str, want))[:60]}...); "
                             f"edit the engine, not the argv, or {FIX}")
    if d.role is not None and (d.kind != "disaggregated"
                               or d.role not in {p.role for p in d.pools}):
        raise InputError(f"the plan's `role` is {d.role!r} but it has no {d.role} pool (its "
                         f"pools: {', '.join(p.role for p in d.pools)}); re-emit it with "
                         "`vlaunch plan MODEL --disaggregate on --role prefill|decode --emit DIR`")
    hw = d.hardware
    for name, n in (("gpus.nodes", hw.nodes), ("gpus.gpus_per_node", hw.gpus_per_node)):
        if n < 1:
            raise _fail(name, n, "a whole number of at least 1")
    for name, n in (("gpus.total_bytes", hw.total_bytes), ("gpus.free_bytes", hw.free_bytes)):
        if n < 0:
            raise _fail(name, n, "a whole number of bytes")


def load(raw: Any) -> P.Deployment:
    """The Deployment a plan's JSON holds; an InputError (one line) when it does not hold one."""
    if not isinstance(raw, dict):
        raise InputError(f"a plan is a JSON object; {FIX}")
    if "pools" not in raw:
        raise InputError("the plan has no `pools`: it was written by a vlaunch older than "
                         f"typed deployments; {FIX}")
    d = build(P.Deployment, raw, "")
    _check(d, raw)
    _check_derived(d, raw)
    return d


def _agrees(got: Any, want: Any) -> bool:
    """Whether every value `got` holds equals what `want` says at the same place (keys `got`
    leaves out, or that `want` does not write, are not compared)."""
    if isinstance(got, dict) and isinstance(want, dict):
        return all(_agrees(v, want[k]) for k, v in got.items() if k in want)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(map(_agrees, got, want))
    return got == want and type(got) is type(want) or (
        isinstance(got, (int, float)) and isinstance(want, (int, float))
        and not isinstance(got, bool) and not isinstance(want, bool) and got == want)


def _check_derived(d: P.Deployment, raw: dict[str, Any]) -> None:
    """The top-level keys scripts read (`vllm_args`, `serving`, `kv_cache`, ...) are written
    from the pools; a file where one says otherwise than its pools was edited by hand, and
    `exec` would otherwise run the pools and silently ignore the edit (issue 31: a tampered plan
    fails loudly). A key the file leaves out is not an edit."""
    for key, want in dump(d).items():
        if key != "pools" and key in raw and not _agrees(raw[key], want):
            raise InputError(f"the plan's `{key}` differs from what its `pools` give (a hand "
                             f"edit?); edit `pools`, not the summary keys, or {FIX}")
