"""`exec --replan` plans again with every decision of the emitted plan pinned; the planner itself
says which pins were the user's ("pinned by you") and which the plan's ("from the emitted
plan"), from the pins' origin (Pins.from_plan), so no reason's text is edited after the fact and
the typed serving decisions carry the same Reason objects as the plan's list."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.search.plan_inputs import PINNED_BY, inputs_from_plan, replan_pins, user_pins
from launcher.predict.search.planner import Pins, make_plan

CASES = [("deepseek-r1", "2x8xH100", {}),  # EPLB and MTP on by the planner
         ("deepseek-r1", "2x8xH100", {"eplb": False, "kv_cache_dtype": "auto"}),
         ("deepseek-r1", "8xH200", {"speculative": False, "max_model_len": 65536}),
         ("qwen3-8b", "H100", {"gpu_memory_utilization": 0.9, "reasoning_parser": "none"}),
         ("llama-3.1-8b", "2xH100", {"tp": 2, "vllm_version": "0.32.0"})]


def _replanned(model, gpus, pins):
    dep = make_plan(load_model(model), parse_gpus(gpus), Pins(**pins)).deployment()
    spec, hw, every = inputs_from_plan(dep)
    again = make_plan(spec, hw, replan_pins(dep, every)).deployment()
    fresh = make_plan(spec, hw, every).deployment()  # the same pins, all of them the user's
    return dep, again, fresh


def _serving_reasons(dep):
    s = dep.pool.serving
    out = [s.speculative.reason, s.ep_backend.reason, *(s.parsers.reasons or ())]
    if s.eplb is not None:
        out.append(s.eplb.reason)
    return [r for r in out if r is not None]


@pytest.mark.parametrize("model, gpus, pins", CASES)
def test_only_the_users_pins_say_pinned_by_you_and_the_rest_say_the_emitted_plan(model, gpus,
                                                                                 pins):
    dep, again, fresh = _replanned(model, gpus, pins)
    mine = {r.code for r in dep.reasons if r.data.get("pinned")}
    for r in again.reasons:
        if r.data.get("pinned"):
            assert r.code in mine, r  # the user's own pin, labelled as before
            assert "from the emitted plan" not in r.text and not r.data.get("from_plan")
        if r.data.get("from_plan"):  # (a reason the pin did not decide names no origin)
            assert r.code not in mine, r
            assert "pinned by you" not in r.text and "--vllm-version" not in r.text, r
    said = [r for r in again.reasons if "from the emitted plan" in r.text]
    assert said and all(r.data.get("from_plan") for r in said)
    assert {r.code for r in again.reasons if r.data.get("pinned")} == mine
    # the typed decisions hold the very reasons the plan lists (no copy left unlabelled)
    for r in _serving_reasons(again):
        assert r in again.reasons or any(x.data == r.data and x.text == r.text
                                         for x in again.reasons), r


@pytest.mark.parametrize("model, gpus, pins", CASES)
def test_the_replanned_plan_decides_exactly_what_a_fresh_plan_with_the_same_pins_does(model, gpus,
                                                                                      pins):
    """Only the origin differs: the same codes, the same figures, the same engine; a reason no
    pin touched reads word for word the same."""
    _, again, fresh = _replanned(model, gpus, pins)
    assert again.engine == fresh.engine
    assert [r.code for r in again.reasons] == [r.code for r in fresh.reasons]

    def figures(r):
        return {k: v for k, v in r.data.items() if k not in ("pinned", "from_plan")}

    relabelled = 0
    for a, f in zip(again.reasons, fresh.reasons, strict=True):
        assert figures(a) == figures(f), a.code
        assert bool(a.data.get("from_plan")) <= bool(f.data.get("pinned")), a.code
        if a.data.get("from_plan") and ("pinned by you" in f.text or "--vllm-version" in f.text
                                        or "(pinned)" in f.text):
            assert "from the emitted plan" in a.text, (a.text, f.text)
            relabelled += 1
        else:
            assert a.text == f.text, a.code
    assert relabelled >= 2  # at least the layout and the vLLM version


def test_the_emitted_plan_names_the_users_pins_by_their_reasons():
    dep = make_plan(load_model("deepseek-r1"), parse_gpus("2x8xH100"),
                    Pins(kv_cache_dtype="fp8", eplb=True, speculative=False)).deployment()
    assert user_pins(dep) == {"kv_cache_dtype", "eplb", "speculative", "num_speculative_tokens",
                              "mtp_acceptance"}
    spec, hw, every = inputs_from_plan(dep)
    p = replan_pins(dep, every)
    assert p.origin("kv_cache_dtype") == "you" and p.origin("eplb") == "you"
    assert p.origin("tp", "pp", "dp") == "plan" and p.origin("vllm_version") == "plan"
    assert p.origin("reasoning_parser") == "plan"
    assert dataclasses.replace(p, from_plan=frozenset()) == every  # the values are the plan's
    # every family the table names is a reason code the planner makes
    assert {"layout", "eplb", "mtp", "all2all"} <= {k.split(".")[0] for k in PINNED_BY}
