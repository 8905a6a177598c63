"""The one (de)serialiser of a Deployment: `dump(d) -> dict`, `load(dict) -> Deployment`.

`load(dump(d)) == d`. The JSON keeps the keys scripts read since before pools existed (`fits`,
`model`, `gpus`, `parallel`, `max_model_len`, ..., `vllm_args`, `env`, `performance`), read from
the pool the plan runs (the aggregated one; in a pool's folder, `vlaunch plan --role R --emit`,
the pool `role` names), and adds `deployment` (the kind), `pools` (each pool whole, with its
`engine`: every vLLM flag's value), `objective`/`workload`/`slo`, and `role` where set.
`load` reads the pools and the deployment's own fields, type by type from the dataclasses'
annotations, and says in one line which field is missing or wrong (an `InputError`: exit 2), so
no other module needs to subscript a plan dict.
"""

from __future__ import annotations

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
# a field whose JSON key differs from its name (the names scripts have read since before pools)
JSON_KEY: dict[type, dict[str, str]] = {
    P.Deployment: {"hardware": "gpus", "kind": "deployment", "runners_up": "alternatives"},
}
# fields written only when set (the model's provenance, as the plan has always written it)
OMIT_IF_NONE: dict[type, tuple[str, ...]] = {
    P.ModelRef: ("revision", "commit", "params_by_dtype", "checkpoint_params"),
    P.Performance: ("measured",),
}


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
    w = d.workload
    return {"source": perf.source, "objective": d.objective, "input_len": w.input_len,
            "output_len": w.output_len, "workload": w.name, "assumed_workload": w.assumed,
            "slo": to_json(d.slo), **{k: v for k, v in to_json(perf).items() if k != "source"}}


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


def dump(d: P.Deployment) -> dict[str, Any]:
    """The plan's JSON (`vlaunch plan --format json`, plan.json)."""
    pool, e = d.pool, d.engine
    pools = [pool_json(d, p) for p in d.pools]
    return {
        "fits": d.fits,
        "model": to_json(d.model),
        "gpus": to_json(d.hardware),
        "parallel": {**to_json(e.parallel),
                     "distributed_executor_backend": e.distributed_executor_backend},
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "max_model_len": e.max_model_len,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "enable_chunked_prefill": e.enable_chunked_prefill,
        "enforce_eager": e.enforce_eager,
        "kv_cache": to_json(pool.kv_cache),
        "per_gpu": to_json(pool.per_gpu),
        "max_concurrency": pool.max_concurrency,
        "candidates": to_json(d.candidates),
        "per_stage": to_json(pool.per_stage),
        "vllm_version": d.vllm_version,
        "vllm_args": pools[d.pools.index(pool)]["vllm_args"],
        "env": dict(pool.env),
        "reasons": to_json(d.reasons),
        "warnings": to_json(d.warnings),
        "suggestions": to_json(d.suggestions),
        "alternatives": [_alternative_json(d, a) for a in d.runners_up],
        "performance": _deployment_performance(d),
        "problem": d.problem,
        "serving": to_json(pool.serving),
        "startup": to_json(pool.startup),
        "autoscaling": to_json(pool.autoscaling),
        "objective": d.objective,
        "workload": to_json(d.workload),
        "slo": to_json(d.slo),
        "deployment": d.kind,
        "pools": pools,
        **({"tuned": to_json(d.tuned)} if d.tuned is not None else {}),
        # only a pool's folder (`plan --role R --emit DIR`) says which pool it runs
        **({"role": d.role} if d.role is not None else {}),
    }


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
