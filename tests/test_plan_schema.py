"""The plan's schema and its types agree both ways, and the serving block's reasons are data.

The schema (launcher/schemas/plan.json) is generated from deployment/plan.py and the codec's
tables; these tests read the committed file and the types independently: every field of every
type is a property of its schema with the same kind of JSON value, every property is a field
or a key the codec documents (EXTRA_KEYS, POOL_EXTRA, SUMMARY, PERF_GOAL), and `dump` writes
exactly the top level the schema declares, in its order.
"""

from __future__ import annotations

import dataclasses
import json
import random
import types
import typing
from collections.abc import Mapping
from typing import Any

import pytest

from launcher.deployment import codec, schema
from launcher.deployment import plan as P
from launcher.deployment.codec import dump, load
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.search.planner import Pins, make_plan

SCHEMA = json.loads(schema.PATH.read_text())
DEFS = SCHEMA["$defs"]
TYPES = [v for v in vars(P).values() if dataclasses.is_dataclass(v) and isinstance(v, type)]
BLOCKS = {P.Deployment: SCHEMA, P.Pool: DEFS["pool_block"]}  # their JSON forms


def _deref(s: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in s:
        s = DEFS[s["$ref"].rsplit("/", 1)[1]]
    return s


def _kind(tp: Any, s: dict[str, Any]) -> None:
    """Assert the schema `s` takes the values of Python type `tp` (and only their kind)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        assert s == {}, s
    elif origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        assert "anyOf" in s and len(s["anyOf"]) == len(args), (tp, s)
        for a, sub in zip(args, s["anyOf"], strict=True):
            _kind(a, sub)
    elif origin is typing.Literal:
        assert _deref(s)["enum"] == list(typing.get_args(tp)), (tp, s)
    elif origin is tuple:
        assert s["type"] == "array", (tp, s)
        _kind(typing.get_args(tp)[0], s["items"])
    elif origin is Mapping or tp is Mapping:
        assert s["type"] == "object" and "additionalProperties" in s, (tp, s)
    elif dataclasses.is_dataclass(tp):
        name = s.get("$ref", "").rsplit("/", 1)[-1]
        assert name in (tp.__name__, f"{tp.__name__.lower()}_block"), (tp, s)
    else:
        want = {int: "integer", float: "number", str: "string", bool: "boolean",
                type(None): "null"}[tp]
        assert s == {"type": want}, (tp, s)


def _keys(cls: type) -> dict[str, str]:
    """JSON key -> field name of a type."""
    return {codec.JSON_KEY.get(cls, {}).get(f.name, f.name): f.name
            for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
def test_every_field_is_in_the_schema_with_its_type_and_nothing_else(cls):
    body = BLOCKS.get(cls) or DEFS[cls.__name__]
    props, hints = body["properties"], codec.hints(cls)
    keys = _keys(cls)
    documented = set(codec.EXTRA_KEYS.get(cls, {}))
    if cls is P.Pool:
        documented |= set(codec.POOL_EXTRA)
    if cls is P.Deployment:
        documented |= set(codec.SUMMARY)
    assert set(props) == set(keys) | documented  # both ways: no field missing, no stray key
    assert body["additionalProperties"] is False
    for key, name in keys.items():
        tp = hints[name]
        if name in codec.OMIT_IF_NONE.get(cls, ()) and cls is P.Deployment:
            tp = typing.get_args(tp)[0]  # left out when None, never null
        if key == "performance" and cls in BLOCKS:  # a block: Performance's fields, its goal
            perf = _deref(props[key])["anyOf"][0]
            assert set(DEFS["Performance"]["properties"]) <= set(perf["properties"])
            assert set(codec.PERF_GOAL) <= set(perf["properties"])
            continue
        if key == "alternatives" and cls in BLOCKS:
            assert props[key]["items"]["$ref"].endswith("alternative_block")
            continue
        _kind(tp, props[key])
    f_required = {k for k, n in keys.items()
                  if next(f for f in dataclasses.fields(cls) if f.name == n).default
                  is dataclasses.MISSING
                  and next(f for f in dataclasses.fields(cls) if f.name == n).default_factory
                  is dataclasses.MISSING}
    if cls is P.Deployment:  # the top level writes every field but the ones left out when None
        omitted = {k for k, n in keys.items() if n in codec.OMIT_IF_NONE[cls]}
        assert set(body["required"]) == set(props) - omitted
    else:
        assert f_required <= set(body["required"])


def test_the_top_level_writes_every_deployment_field_once_and_the_summary_keys():
    sources = [src for _, src in codec.top_level()]
    fields = [s for s in sources if not s.startswith(codec.POOL)]
    assert sorted(fields) == sorted(f.name for f in dataclasses.fields(P.Deployment))
    assert [k for k, s in codec.top_level() if s.startswith(codec.POOL)] == list(codec.SUMMARY)
    assert list(SCHEMA["properties"]) == [k for k, _ in codec.top_level()]


def test_a_summary_key_has_the_schema_of_its_place_in_the_pool():
    pool = DEFS["pool_block"]
    for key, path in codec.SUMMARY.items():
        s = pool
        for part in path.split("."):
            s = _deref(s)["properties"][part]
        top = SCHEMA["properties"][key]
        extra = codec.SUMMARY_EXTRA.get(key, {})
        if extra:  # the pool's object, widened by the documented keys
            assert set(top["properties"]) == set(_deref(s)["properties"]) | set(extra)
        else:
            assert top == s, key


@pytest.mark.parametrize("model,gpus,pins", [
    ("llama-3.1-8b", "1xH100", Pins()), ("deepseek-r1", "8xH200", Pins()),
    ("deepseek-v3.2", "8xH200", Pins(speculative=False)), ("qwen3-8b", "cpu", Pins()),
])
def test_dump_writes_the_schemas_top_level_in_its_order(model, gpus, pins):
    j = dump(make_plan(load_model(model), parse_gpus(gpus), pins, suggest=False).deployment())
    assert list(j) == [k for k in SCHEMA["properties"] if k in j]
    assert set(SCHEMA["required"]) <= set(j)


# ---- the serving block's reasons are data ------------------------------------------------------

SERVING_CASES = [("deepseek-r1", "8xH200", {}), ("deepseek-r1", "8xH200", {"speculative": False}),
                 ("deepseek-v3.2", "2x8xH200", {"dp": 16, "expert_parallel": True}),
                 ("deepseek-v3.1", "8xH200", {}), ("deepseek-v2-lite", "1xH200",
                                                   {"num_speculative_tokens": 1}),
                 ("llama-3.1-8b", "1xH100", {"tool_call_parser": "llama3_json"}),
                 ("deepseek-r1", "8xH200", {"vllm_version": "0.8.5"})]


def _serving_reasons(s: P.Serving) -> list[P.Reason]:
    out = [s.speculative.reason, *s.parsers.reasons]
    return out + ([s.ep_backend.reason] if s.ep_backend.reason is not None else [])


@pytest.mark.parametrize("model,gpus,pins", SERVING_CASES)
def test_serving_reasons_are_the_plans_reasons_as_data(model, gpus, pins):
    d = make_plan(load_model(model), parse_gpus(gpus), Pins(**pins), suggest=False).deployment()
    s = d.pool.serving
    assert s is not None
    for r in _serving_reasons(s):
        assert isinstance(r, P.Reason) and r in d.reasons  # one object, shown once at the edge
        assert r.code.split(".")[0] in ("mtp", "all2all", "parsers"), r.code
        assert all(part.replace("_", "").isalnum() for part in r.code.split(".")), r.code
        assert isinstance(r.data.get("pinned", False), bool)
        json.dumps(dict(r.data))  # numbers and names, JSON values
    j = json.loads(json.dumps(dump(d)))
    sj = j["serving"]
    for r in (sj["speculative"]["reason"], *sj["parsers"]["reasons"],
              *([sj["ep_backend"]["reason"]] if sj["ep_backend"]["reason"] else [])):
        assert set(r) == {"code", "text", "data"}
    assert load(j) == d


def test_a_serving_reasons_numbers_are_the_decisions():
    d = make_plan(load_model("deepseek-r1"), parse_gpus("8xH200"), Pins(),
                  suggest=False).deployment()
    mtp = d.pool.serving.speculative
    if mtp.enabled:
        r = mtp.reason
        assert r.code == "mtp.on"
        assert r.data["num_speculative_tokens"] == mtp.num_speculative_tokens
        assert r.data["tokens_per_step"] == mtp.tokens_per_step
        assert f"{mtp.tokens_per_step:.2f} tokens per step" in r.text
        if mtp.equal_load:
            assert r.data["equal_load_speedup"] == mtp.equal_load["speedup"]
    e = d.pool.serving.ep_backend
    if e.reason is not None and e.reason.code == "all2all.chosen":
        assert e.reason.data["backend"] == e.backend
        assert e.reason.data["buffer_bytes"] == e.buffer_bytes_per_gpu


def test_an_mtp_options_figure_carries_its_numbers():
    d = make_plan(load_model("deepseek-r1"), parse_gpus("8xH200"), Pins(),
                  suggest=False).deployment()
    judged = [o for o in d.pool.serving.speculative.options if "figure" in o]
    assert judged
    for o in judged:
        k = o["knee"]
        if k is not None:  # the sentence is made from these numbers
            assert f"{k['output_tokens_per_s']:,.0f} output tok/s" in o["figure"]
            assert f"TPOT {k['tpot_ms']:.1f} ms" in o["figure"]
        assert o["single_request"]["tpot_ms"] > 0


def test_perturbed_serving_reasons_round_trip():
    rng = random.Random(33)
    d = make_plan(load_model("deepseek-r1"), parse_gpus("8xH200"), Pins(),
                  suggest=False).deployment()
    for n in range(200):
        s = d.pool.serving
        why = P.Reason(f"mtp.x{n}", f"text {rng.random()}", {"n": rng.randrange(10**6),
                                                             "f": rng.random()})
        s = dataclasses.replace(
            s, speculative=dataclasses.replace(s.speculative, reason=why),
            parsers=dataclasses.replace(s.parsers, reasons=(why,) * rng.randrange(3)),
            ep_backend=dataclasses.replace(s.ep_backend,
                                           reason=why if rng.random() < 0.5 else None))
        dn = dataclasses.replace(d, pools=(dataclasses.replace(d.pool, serving=s),))
        assert load(json.loads(json.dumps(dump(dn)))) == dn, n


def test_no_code_decides_by_a_reasons_text():
    """A reason's `text` is for people: no module of launcher/ compares it, tests it with `in`,
    startswith/endswith/find, or a regex (decide by `code` and `data`). By AST, over every
    attribute named `text`."""
    import ast
    from pathlib import Path

    def is_text(e: ast.AST) -> bool:
        return isinstance(e, ast.Attribute) and e.attr == "text"

    def decides(n: ast.AST) -> bool:
        if isinstance(n, ast.Compare):
            return any(map(is_text, [n.left, *n.comparators]))
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            return False
        if n.func.attr in ("startswith", "endswith", "find", "index", "count"):
            return is_text(n.func.value)
        return n.func.attr in ("search", "match", "fullmatch", "findall") and any(
            map(is_text, n.args))

    hits = [f"{p.name}:{n.lineno}"
            for p in (Path(__file__).resolve().parent.parent / "launcher").rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text())) if decides(n)]
    assert hits == []
