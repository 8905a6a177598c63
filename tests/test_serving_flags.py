"""Reasoning / tool-call parsers and chat flags: from profiles/serving.yaml, version-gated,
overridable, shown in the plan with their reason."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.deployment.codec import load
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.features import serving_flags as F
from launcher.predict.search.plan_inputs import inputs_from_plan
from launcher.predict.search.planner import Pins, make_plan
from launcher.render import plan_text


def _args(name: str, version: str = "0.32.0", **kw) -> list[str]:
    return F.decide(load_model(name), version, **kw).vllm_args()


def test_r1_gets_the_r1_reasoning_parser_and_no_tools():
    assert _args("deepseek-r1") == ["--reasoning-parser", "deepseek_r1"]
    assert _args("r1-distill-qwen-7b") == ["--reasoning-parser", "deepseek_r1"]


def test_v32_gets_parsers_auto_tool_choice_and_its_tokenizer_mode():
    assert _args("deepseek-v3.2") == ["--reasoning-parser", "deepseek_v3",
                                      "--tool-call-parser", "deepseek_v32",
                                      "--enable-auto-tool-choice",
                                      "--tokenizer-mode", "deepseek_v32"]


def test_tools_that_need_vllms_template_wait_for_it():
    f = F.decide(load_model("deepseek-v3.1"), "0.32.0")
    assert f.vllm_args() == ["--reasoning-parser", "deepseek_v3"]
    (r,) = [r for r in f.parsers.reasons if r.code == "parsers.tools_need_template"]
    assert "tool_chat_template_deepseekv31.jinja" in r.text
    assert r.data["template"].endswith("tool_chat_template_deepseekv31.jinja")
    with_t = _args("deepseek-v3.1", chat_template="/t/v31.jinja")
    assert with_t == ["--reasoning-parser", "deepseek_v3", "--tool-call-parser", "deepseek_v31",
                      "--enable-auto-tool-choice", "--chat-template", "/t/v31.jinja"]
    assert _args("deepseek-v3", chat_template="/t/v3.jinja")[:2] == ["--tool-call-parser",
                                                                     "deepseek_v3"]


def test_overrides_win_and_none_drops():
    assert _args("deepseek-r1", reasoning_parser="none") == []
    assert _args("deepseek-r1", reasoning_parser="qwen3") == ["--reasoning-parser", "qwen3"]
    assert _args("llama-3.1-8b") == []
    assert _args("llama-3.1-8b", tool_call_parser="llama3_json") == [
        "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"]
    with pytest.raises(InputError):
        F.decide(load_model("deepseek-r1"), "0.32.0", reasoning_parser=" ")


@pytest.mark.parametrize("version,expect", [
    ("0.6.0", []),                                                 # no reasoning outputs yet
    ("0.8.5", ["--enable-reasoning", "--reasoning-parser", "deepseek_r1"]),
    ("0.9.0", ["--reasoning-parser", "deepseek_r1"]),              # --enable-reasoning gone
])
def test_reasoning_parser_version_gate(version, expect):
    f = F.decide(load_model("deepseek-r1"), version)
    assert f.vllm_args() == expect
    if not expect:
        assert any("since 0.7.1" in w.text and w.data["since"] == "0.7.1" for w in f.warnings)


def test_v32_on_an_old_version_gets_nothing_it_lacks():
    f = F.decide(load_model("deepseek-v3.2"), "0.10.2")
    assert f.vllm_args() == []
    text = " ".join(w.text for w in f.warnings)
    assert "deepseek_v3" in text and "deepseek_v32" in text


def test_matching_uses_the_hf_id_for_local_folders():
    spec = dataclasses.replace(load_model("deepseek-r1"), name="my-copy",
                               hf_id="/models/DeepSeek-R1-0528")
    assert F.profile_row(spec)["reasoning_parser"] == "deepseek_r1"
    assert F.profile_row(spec)["tool_call_parser"] == "deepseek_v3"  # the 0528 row


def test_plan_json_and_text_show_parsers_with_reason():
    plan = make_plan(load_model("deepseek-v3.2"), parse_gpus("8xH200"), suggest=False)
    d = plan.to_dict()
    p = d["serving"]["parsers"]
    assert p["tool_call_parser"] == "deepseek_v32" and p["enable_auto_tool_choice"]
    assert "--tool-call-parser" in d["vllm_args"]
    text = plan_text(load(d))
    assert "tool-call-parser deepseek_v32 with --enable-auto-tool-choice" in text
    # exec re-plans the same flags
    spec, hw, pins = inputs_from_plan(load(d))
    assert make_plan(spec, hw, pins, suggest=False).to_dict()["vllm_args"] == d["vllm_args"]


def test_old_version_plan_has_no_parser_it_lacks():
    d = make_plan(load_model("deepseek-v3.2"), parse_gpus("8xH200"),
                  Pins(vllm_version="0.11.0"), suggest=False).to_dict()
    assert "--tool-call-parser" not in d["vllm_args"]
    assert "--tokenizer-mode" not in d["vllm_args"]
    assert any("no --tool-call-parser" in w["text"] for w in d["warnings"])
