"""Workload, SLO and objective: parsing, and the decisions the performance model drives."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import PRESETS, SLO, fit_to_context, parse_slo, resolve_workload
from launcher.predict.search.planner import Pins, make_plan


def plan(model, gpus, objective="balanced", **kw):
    return make_plan(load_model(model), parse_gpus(gpus), Pins(vllm_version="0.32.0"),
                     objective=objective, **kw)


def test_slo_parses_seconds_and_milliseconds():
    assert parse_slo("ttft=2s,tpot=50ms") == SLO(2000.0, 50.0)
    assert parse_slo("tpot=0.04s") == SLO(tpot_ms=40.0)
    assert parse_slo(None) == SLO()


@pytest.mark.parametrize("text", ["ttft=2", "tpot=fast", "latency=2s", "ttft=0s", "ttft2s"])
def test_malformed_slo_is_an_input_error(text):
    with pytest.raises(InputError):
        parse_slo(text)


def test_workload_presets_and_the_assumed_default():
    w = resolve_workload()
    assert w.assumed and (w.input_len, w.output_len) == PRESETS["chat"][:2]
    assert resolve_workload(preset="rag").input_len == 8192
    w = resolve_workload(input_len=3000)
    assert (w.input_len, w.output_len, w.assumed) == (3000, 256, False)
    with pytest.raises(InputError):
        resolve_workload(output_len=0)


def test_deepseek_on_8xh200_is_ep_at_the_best_knee_for_throughput_and_tp8_for_latency():
    thr = plan("deepseek-r1", "8xH200", "throughput")
    lat = plan("deepseek-r1", "8xH200", "latency")
    # which EP layout serves most within the SLO is the performance model's call (at the
    # default 50 ms TPOT SLO, TP8+EP and the DP+EP layouts are within ~15% of each other)
    assert thr.chosen.layout.expert_parallel
    assert lat.chosen.layout.tp == 8 and lat.chosen.layout.dp == 1
    # the numbers that decided are in the plan
    d = thr.to_dict()
    others = [a for a in d["alternatives"] if (a.get("performance") or {}).get("knee")]
    assert others and all(a["performance"]["knee"]["output_tokens_per_s"]
                          <= d["performance"]["knee"]["output_tokens_per_s"] for a in others)
    knee = d["performance"]["knee"]  # each lost on its figure against the chosen one's
    assert all(a["why_not"]["code"] == "runner_up.slower" and a["why_not"]["data"]["chosen"][
        "output_tokens_per_s"] == knee["output_tokens_per_s"] for a in others)
    ld = lat.to_dict()
    assert ld["performance"]["single_request"]["tpot_ms"] < min(
        a["performance"]["single_request"]["tpot_ms"] for a in ld["alternatives"]
        if a["performance"])


def test_an_8b_model_on_8_gpus_is_eight_tp1_engines_for_throughput():
    p = plan("llama-3.1-8b", "8xH100", "throughput")
    assert (p.chosen.layout.tp, p.chosen.layout.dp) == (1, 8)


def test_fp8_kv_only_with_a_reason_and_never_against_a_pin():
    # DeepSeek-V3 on 8xH200: bf16 holds the context and the knee; fp8 is not worth the risk.
    p = plan("deepseek-v3", "8xH200")
    assert p.chosen.kv_dtype == "auto"
    pinned = make_plan(load_model("deepseek-v3"), parse_gpus("8xH200"),
                       Pins(vllm_version="0.32.0", kv_cache_dtype="fp8"))
    assert pinned.chosen.kv_dtype == "fp8"
    assert any("pinned by you" in r.text for r in pinned.reasons)


def test_balanced_caps_max_num_seqs_at_the_knee_throughput_does_not():
    bal = plan("deepseek-r1", "8xH200", "balanced")
    thr = plan("deepseek-r1", "8xH200", "throughput")
    knee = bal.to_dict()["performance"]["knee"]["concurrency"]
    dp = bal.chosen.layout.dp
    # the cap is the uncapped engine's knee per engine: the capped engine (judged at its own
    # flags) holds at least that many in flight within the SLO, the rest queue
    assert bal.chosen.max_num_seqs * dp <= knee
    assert bal.chosen.max_num_seqs < 1024
    assert thr.chosen.max_num_seqs == 1024  # vLLM's default for this GPU class
    assert any("the SLO knee" in r.text for r in bal.reasons)


def test_a_tighter_slo_lowers_the_knee():
    loose = plan("deepseek-r1", "8xH200", slo=SLO(tpot_ms=80)).to_dict()["performance"]
    tight = plan("deepseek-r1", "8xH200", slo=SLO(tpot_ms=30)).to_dict()["performance"]
    assert tight["knee"]["concurrency"] < loose["knee"]["concurrency"]


def test_performance_json_contract():
    r = CliRunner().invoke(cli, ["plan", "deepseek-r1", "--gpus", "8xH200", "--format", "json",
                                 "--input-len", "2000", "--output-len", "500", "--slo",
                                 "ttft=3s,tpot=40ms", "--concurrency", "32"])
    assert r.exit_code == 0, r.output
    perf = json.loads(r.output)["performance"]
    assert perf["source"] == "model" and perf["objective"] == "balanced"
    assert (perf["input_len"], perf["output_len"]) == (2000, 500)
    assert perf["slo"] == {"ttft_ms": 3000.0, "tpot_ms": 40.0}
    keys = {"concurrency", "tpot_ms", "ttft_ms", "output_tokens_per_s", "requests_per_s"}
    assert set(perf["at"]) >= keys and set(perf["knee"]) >= keys
    assert perf["at"]["concurrency"] == 32
    assert all(set(p) >= keys - {"requests_per_s"} for p in perf["curve"])
    assert any(p["concurrency"] == 32 for p in perf["curve"])


def test_text_plan_shows_the_curve_and_the_assumption():
    r = CliRunner().invoke(cli, ["plan", "deepseek-r1", "--gpus", "8xH200"])
    assert r.exit_code == 0
    assert "assumed, none given" in r.output
    assert "TPOT ms" in r.output and "knee" in r.output and "runner-ups:" in r.output


@pytest.mark.parametrize("args,needle", [
    (["--slo", "ttft=fast"], "malformed --slo"),
    (["--input-len", "-3"], "--input-len"),
    (["--concurrency", "0"], "--concurrency"),
    (["--objective", "cheap"], "objective"),
])
def test_bad_workload_input_is_one_line(args, needle):
    r = CliRunner().invoke(cli, ["plan", "deepseek-r1", "--gpus", "8xH200", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_exec_replans_for_the_workload_the_plan_was_made_for(tmp_path):
    from launcher.deployment.codec import load
    from launcher.run.exec_plan import goals_from_plan

    r = CliRunner().invoke(cli, ["plan", "deepseek-r1", "--gpus", "8xH200", "--workload", "rag",
                                 "--slo", "tpot=40ms", "--objective", "latency", "--emit",
                                 str(tmp_path)])
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "plan.json").read_text())
    goals = goals_from_plan(load(d))
    assert goals["workload"].input_len == 8192 and goals["objective"] == "latency"
    assert goals["slo"].tpot_ms == 40.0
    again = make_plan(load_model("deepseek-r1"), parse_gpus("8xH200"),
                      Pins(vllm_version=d["vllm_version"]), **goals)
    assert again.to_dict()["performance"]["input_len"] == 8192


@pytest.mark.parametrize("context", [2, 3, 100, 1024, 1279, 1280, 4096])
def test_an_assumed_workload_is_scaled_into_the_context_a_given_one_never(context: int):
    assumed = resolve_workload()
    fitted = fit_to_context(assumed, context)
    assert fitted.input_len >= 1 and fitted.output_len >= 1
    assert fitted.input_len + fitted.output_len == min(context, 1280)
    assert fitted.assumed and fitted.name == assumed.name
    given = resolve_workload(input_len=1024, output_len=256)
    assert fit_to_context(given, context) == given


def test_a_pinned_short_context_plans_the_assumed_workload_scaled_and_says_so():
    p = make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100"), Pins(max_model_len=1024))
    assert p.fits
    assert any("assumed workload" in r.text and "1,024-token context" in r.text for r in p.reasons)
