"""The performance model from first principles: each test states the arithmetic it checks."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

import pytest

from launcher.deployment.codec import load
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.memory import budget as B
from launcher.predict.search.engine_from_plan import shape_from_plan
from launcher.predict.search.planner import Pins, make_plan
from launcher.predict.speed import request_model as perf
from launcher.predict.speed.step import ACTIVATION_PASSES, BOUNDS, SOFT_Q, stage_step
from launcher.render import plan_text

V = Pins(vllm_version="0.32.0")


def toy(**kw) -> perf.EngineShape:
    """A dense one-GPU engine with round numbers: 10 GB of weights, 1 TB/s, 1 PFLOPS (the
    ~1,000 FLOP per byte of a data-centre GPU), 10 layers of hidden 1,000."""
    base = dict(tp=1, pp=1, dp=1, expert_parallel=False, layers=10, moe_layers=0, experts=0,
                topk=0, hidden=1000, dense_bytes=10e9, expert_bytes=0.0,
                dense_flops_per_token=2e10, expert_flops_per_token=0.0,
                attn_decode_flops=0.0, attn_prefill_flops=0.0, kv_bytes_per_token=100_000,
                hbm=1e12, peak=1e15, link="nvlink", link_bw=1e11, net_bw=5e10,
                cross_node_tp=False, cross_node_pp=False, cross_node_ep=False, max_num_seqs=256,
                max_num_batched_tokens=8192, kv_tokens=1_000_000, chunked_prefill=True)
    base.update(kw)
    return perf.EngineShape(**base)


K = perf.DEFAULT
ACT = ACTIVATION_PASSES * 1000 * 2 * 10  # activation bytes per token of the toy's 10 layers


def fixed_s(k=K, layers=10):
    return layers * k.layer_us * 1e-6 + k.step_us * 1e-6


def test_touched_experts_follow_the_occupancy_formula():
    # One token touches k of E experts; B tokens touch E x (1 - (1 - k/E)^B) on average.
    assert perf.touched_fraction(256, 8, 1) == pytest.approx(8 / 256)
    assert perf.touched_fraction(256, 8, 4) == pytest.approx(1 - (248 / 256) ** 4)
    assert perf.touched_fraction(256, 8, 10_000) == pytest.approx(1.0)
    assert perf.touched_fraction(0, 0, 5) == 0.0


def test_moe_tile_is_the_smallest_that_holds_the_mean_tokens_per_expert():
    # vLLM's tuned fused-MoE configs pick BLOCK_SIZE_M near the mean tokens per expert,
    # T x top-k / E: DeepSeek (E = 256, top-8) on H200 keeps 16 rows up to 512 tokens (16 per
    # expert); Qwen3-30B-A3B (E = 128, top-8) needs 32 rows at 512 tokens (32 per expert).
    from launcher.predict.speed.step import moe_tile_rows

    ds = toy(experts=256, topk=8, moe_layers=1)
    assert [moe_tile_rows(ds, t) for t in (1, 64, 128, 512)] == [16.0] * 4
    assert moe_tile_rows(ds, 513) == 32.0  # 16.03 per expert
    assert moe_tile_rows(ds, 2048) == 64.0  # 64 per expert
    assert moe_tile_rows(ds, 1e6) == 128.0  # never above vLLM's largest tile
    qw = toy(experts=128, topk=8, moe_layers=1)
    assert moe_tile_rows(qw, 512) == 32.0
    # the tile follows the load, not the dtype: fp8 weights change nothing
    assert moe_tile_rows(dataclasses.replace(ds, fp8_gemm=True), 128) == 16.0


def test_a_burst_past_the_cache_recomputes_what_preemption_evicts():
    # KV 100k tokens, 100-token prompts growing to 1,000: 100 fit at full length (the cap),
    # 200 are admitted (their prompts fit). The cache fills at 100k / 200 = 500 tokens each;
    # from there R(L) = 100k / L stay, so 200 - 100 = 100 are preempted between 500 and
    # 1,000 tokens and recomputed: 100k x ln(1000 / 500) = 69.3k tokens, 693 each.
    s = toy(kv_tokens=100_000, max_num_seqs=256)
    w = Workload(100, 900, synchronized=True)
    cap = perf.running_limit(s, w)[0]
    assert cap == pytest.approx(100)
    ctx = 100 + 900 / 2
    one = perf.prompt_s(s, 100_000 * math.log(2) / 100, cap, ctx)[1]
    assert perf.recompute_s(s, w, 200, cap) == pytest.approx(100 * one)
    # two cohorts of 200 (a burst of 400 with 256 seats, prompts fitting 999 at once) ...
    assert perf.recompute_s(s, w, 400, cap) == pytest.approx(
        400 / 256 * (256 - 100) * perf.prompt_s(
            s, 100_000 * math.log(1000 / (100_000 / 256)) / 156, cap, ctx)[1])
    # ... and nothing to recompute while the burst fits at full length
    assert perf.recompute_s(s, w, 100, cap) == 0.0
    assert perf.recompute_s(toy(), w, 100, 256) == 0.0
    # the burst's makespan carries it: more requests past the cap, never faster per request
    few, many = perf.burst_point(s, w, 100), perf.burst_point(s, w, 200)
    assert many.requests_per_s <= few.requests_per_s * (1 + 1e-9)


def test_batch_one_decode_is_weights_over_bandwidth_plus_fixed_costs():
    s = toy()
    # memory: (10 GB + one token's activations) / (1 TB/s x hbm_eff); compute, 20 GFLOP at
    # 1 PFLOPS x compute_eff, is far smaller and adds only through the soft maximum
    # (mem^3 + comp^3)^(1/3).
    mem = (10e9 + ACT) / (1e12 * K.hbm_eff)
    comp = 2e10 / (1e15 * K.compute_eff)
    soft = (mem ** SOFT_Q + comp ** SOFT_Q) ** (1 / SOFT_Q)
    assert perf.decode_step_s(s, 1, 0) == pytest.approx(soft + fixed_s(), rel=1e-9)
    assert soft - mem < 1e-6 * mem


def test_a_one_row_gemm_is_memory_bound_not_charged_in_flops():
    # 20 GFLOP at 1 PFLOPS x compute_eff is ~0.04 ms; reading 10 GB is ~12 ms: the GEMV is
    # priced by its bytes, and the step says so.
    s = toy()
    st = stage_step(s, 1, 0)
    assert st.compute == 0 and st.memory == pytest.approx((10e9 + ACT) / (1e12 * K.hbm_eff),
                                                          rel=1e-6)


def test_context_costs_its_kv_bytes_over_bandwidth():
    # One more cached token read per step costs kv_bytes / (hbm x efficiency) seconds.
    s = toy()
    slope = (perf.decode_step_s(s, 1, 20_000) - perf.decode_step_s(s, 1, 10_000)) / 10_000
    assert slope == pytest.approx(100_000 / (1e12 * K.hbm_eff), rel=1e-9)


def test_a_sliding_window_bounds_what_its_layers_read():
    # Half the KV bytes in 128-token windows: beyond the window only the other half grows.
    s = toy(kv_grow=0.5, kv_windows=((0.5, 128),))
    slope = (perf.decode_step_s(s, 1, 20_000) - perf.decode_step_s(s, 1, 10_000)) / 10_000
    assert slope == pytest.approx(0.5 * 100_000 / (1e12 * K.hbm_eff), rel=1e-9)


def test_fp8_kv_halves_the_context_slope_on_a_real_model():
    spec, hw = load_model("llama-3.1-8b"), parse_gpus("1xH100")
    layout = B.Layout()
    shapes = {}
    for dtype in ("auto", "fp8"):
        per_token = B.kv_bytes_per_token(spec, dtype, layout)
        shapes[dtype] = perf.engine_shape(spec, hw, layout, per_token, 10**6, 256, 8192, True)
    slopes = {d: perf.decode_step_s(s, 1, 32_768) - perf.decode_step_s(s, 1, 0)
              for d, s in shapes.items()}
    # 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 B = 128 KiB per token in bf16.
    assert shapes["auto"].kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    # (the soft maximum lets the attention's math show through by < 0.02%)
    assert slopes["fp8"] == pytest.approx(slopes["auto"] / 2, rel=2e-4)


def test_compute_takes_over_at_large_batches():
    # 20 GFLOP per token at 1 PFLOPS x compute_eff: at batch 4,096 the GEMMs cost more than
    # reading 10 GB plus the activations.
    s = toy()
    b = 4096
    comp = b * 2e10 / (1e15 * K.compute_eff)
    mem = (10e9 + b * ACT) / (1e12 * K.hbm_eff)
    assert comp > mem
    soft = (comp ** SOFT_Q + mem ** SOFT_Q) ** (1 / SOFT_Q)  # mem / comp ~0.6: +7%
    assert perf.decode_step_s(s, b, 0) == pytest.approx(soft + fixed_s(), rel=1e-9)
    assert stage_step(s, b, 0).compute == pytest.approx(soft, rel=1e-9)


def test_tp_adds_two_all_reduces_per_layer():
    # Inside NVLink: latency + 2 (n - 1) / n x message / (link x link_eff), twice per layer.
    one, two = toy(), toy(tp=2)
    msg = 1 * 1000 * 2
    ar = K.allreduce_us * 1e-6 + msg / (1e11 * K.link_eff)
    assert perf.decode_step_s(two, 1, 0) - perf.decode_step_s(one, 1, 0) == pytest.approx(
        2 * 10 * ar, rel=1e-9)


def test_constants_are_read_when_a_step_is_timed_not_when_a_shape_is_built():
    # The fit and the calibration swap constants on a built shape: every one of them moves it.
    s = toy(tp=2, pp=2, dp=2, experts=8, topk=2, moe_layers=10, expert_bytes=1e9,
            expert_flops_per_token=1e9, expert_parallel=True, v0=True, cross_node_pp=True,
            fp8_gemm=True, attn_peak=5e14)
    draft = toy(layers=1)
    s = dataclasses.replace(s, spec_tokens=1, spec_yield=1.5, draft=draft)
    w = Workload(4096, 256)
    base = perf.point(s, w, 64)
    for f in dataclasses.fields(perf.Constants):
        moved = dataclasses.replace(K, **{f.name: getattr(K, f.name) * 1.5})
        if f.name == "frontend_us":  # binds only where tiny outputs make requests/s the limit
            tiny, plain = Workload(16, 2), toy()
            p = perf.point(dataclasses.replace(plain, constants=moved), tiny, 256)
            assert p.requests_per_s < perf.point(plain, tiny, 256).requests_per_s, f.name
            continue
        p = perf.point(dataclasses.replace(s, constants=moved), w, 64)
        assert (p.tpot_ms, p.ttft_ms) != (base.tpot_ms, base.ttft_ms), f.name


def test_latency_and_throughput_rise_monotonically_with_concurrency():
    spec, hw = load_model("deepseek-r1"), parse_gpus("8xH200")
    a = make_plan(spec, hw, V, objective="throughput").performance
    w = Workload(1024, 256)
    last = None
    half = perf.max_running(a.shape, w) / 2
    for c in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        p = perf.point(a.shape, w, c)
        # (near the running limit the decodes and drafts fill the token budget and prompts
        # starve: the first token waits, tokens come as fast as decode allows, throughput may
        # fall - as vLLM's does)
        if last and c <= half:
            assert p.tpot_ms >= last.tpot_ms - 1e-9
            assert p.ttft_ms >= last.ttft_ms - 1e-9
            assert p.output_tokens_per_s >= last.output_tokens_per_s - 1e-6
        if last:
            assert p.ttft_ms >= last.ttft_ms - 1e-9
        last = p


def test_littles_law_ties_throughput_to_latency():
    # Closed loop: C clients each waiting TTFT + (O - 1) x TPOT per request.
    s, w = toy(), Workload(512, 128)
    p = perf.point(s, w, 16)
    e2e = (p.ttft_ms + 127 * p.tpot_ms) / 1e3
    assert p.requests_per_s == pytest.approx(16 / e2e, rel=1e-6)
    assert p.output_tokens_per_s == pytest.approx(p.requests_per_s * 128, rel=1e-9)


def test_knee_is_the_last_concurrency_within_the_slo():
    s, w = toy(), Workload(512, 128)
    slo = SLO(ttft_ms=2000, tpot_ms=20)
    k = perf.knee(s, w, slo)
    assert k is not None and slo.met(k.ttft_ms, k.tpot_ms)
    nxt = perf.point(s, w, k.concurrency + 1)
    assert not slo.met(nxt.ttft_ms, nxt.tpot_ms)
    assert perf.knee(s, w, SLO(tpot_ms=1)) is None  # 1 ms per token is out of reach


def test_kv_cache_caps_running_requests():
    # 100,000 KV tokens hold 100,000 / (900 + 100) = 100 requests at full length.
    s, w = toy(kv_tokens=100_000), Workload(900, 100)
    assert perf.running_limit(s, w) == (100.0, "kv_cache")
    p = perf.point(s, w, 400)
    assert p.running == 100 and p.limit == "kv_cache"


def test_calibration_recovers_known_scales():
    # Points generated with fixed costs x2 and rooflines x0.5: the fit finds them again.
    s, w = toy(), Workload(256, 64, synchronized=True)  # tune measures benchmark waves
    truth = perf.Calibration(2.0, 0.5, 0, 0)
    true_shape = dataclasses.replace(s, constants=perf.scaled(K, truth))
    points = []
    for c in (1, 4, 16, 64):
        p = perf.point(true_shape, w, c)
        points.append({"concurrency": c, "input_len": 256, "output_len": 64,
                       "output_tokens_per_s": p.output_tokens_per_s, "tpot_ms": p.tpot_ms})
    cal = perf.calibrate(s, points)
    assert cal is not None and cal.median_error < 0.02
    fitted = dataclasses.replace(s, constants=perf.scaled(K, cal))
    for c in (2, 8, 32):
        want = perf.point(true_shape, w, c).output_tokens_per_s
        assert perf.point(fitted, w, c).output_tokens_per_s == pytest.approx(want, rel=0.05)


def test_unknown_speed_facts_claim_no_performance():
    spec = load_model("llama-3.1-8b")
    p = make_plan(spec, parse_gpus("1x80GiB"), V)
    assert p.fits and p.performance is None
    assert p.to_dict()["performance"] is None
    assert any("no performance prediction" in r.text for r in p.reasons)


def test_every_catalog_constant_is_positive_and_sourced():
    from launcher.inputs.hardware import kinds

    for k in kinds():
        assert k.hbm_gbps and k.hbm_gbps > 0 and k.bf16_tflops and k.bf16_tflops > 0, k.name
        for p in k.prices:
            assert p.source and re.match(r"\d{4}-\d{2}", p.date) and p.usd_per_hour > 0, k.name
            assert p.gpus in k.node_sizes, (k.name, p.gpus)  # a price is for a shape sold
    for f in dataclasses.fields(perf.Constants):
        value = getattr(K, f.name)
        lo, hi = BOUNDS[f.name]
        assert lo <= value <= hi and not math.isnan(value), f.name
        doc = perf.Constants.__dataclass_fields__[f.name]
        assert doc is not None
    # each constant's docstring names its range and a source
    text = inspect.getsource(perf.Constants)
    for f in dataclasses.fields(perf.Constants):
        block = text.split(f"    {f.name}:")[1].split('"""')[1]
        assert "Range" in block and re.search(r"[A-Za-z]+[ /(].*\d", block), f.name




def test_calibration_is_recorded_and_plans_say_measured(tmp_path, monkeypatch):
    """tune's points for one engine refit its scales; the next plan for the same key says
    `source: measured`, another layout of the same family borrows the scales as `model`."""
    from launcher.predict.speed import calibration

    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path))
    spec, hw = load_model("llama-3.1-8b"), parse_gpus("8xH100")
    pins = Pins(vllm_version="0.32.0", tp=1, pp=1, kv_cache_dtype="auto")
    d = make_plan(spec, hw, pins).deployment()
    assert d.performance.source == "model"
    w = Workload(d.workload.input_len, d.workload.output_len, synchronized=True)
    a = make_plan(spec, hw, pins).performance
    slow = dataclasses.replace(a.shape, constants=perf.scaled(K, perf.Calibration(3.0, 1.5, 0,
                                                                                    0)))
    pts = [{"concurrency": c, "input_len": w.input_len, "output_len": w.output_len,
            "output_tokens_per_s": perf.point(slow, w, c).output_tokens_per_s,
            "tpot_ms": perf.point(slow, w, c).tpot_ms} for c in (8, 64, 512)]
    calibration.record(d, pts, "test", shape_from_plan(d))
    again = make_plan(spec, hw, pins)
    assert again.to_dict()["performance"]["source"] == "measured"
    for c in (8, 64, 512):
        want = perf.point(slow, w, c).output_tokens_per_s
        got = perf.point(again.performance.shape, w, c).output_tokens_per_s
        assert got == pytest.approx(want, rel=0.1)
    other = make_plan(spec, hw, Pins(vllm_version="0.32.0", tp=2, kv_cache_dtype="auto"))
    perf_d = other.to_dict()["performance"]
    assert perf_d["source"] == "model"
    why = perf_d["notes"][0]  # borrowed from another layout: the note says so in its data
    assert why["code"] == "performance.calibrated" and why["data"]["scope"] == "layout"
    assert why["data"]["points"] == 3 and "another layout" in why["text"]


def test_plans_carry_the_held_out_range_around_their_figures():
    d = make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100"), V).to_dict()
    perf_d, r = d["performance"], d["performance"]["range"]
    knee = perf_d["knee"]
    assert r["low"] <= knee["output_tokens_per_s"] <= r["high"]
    assert r["tpot_ms"]["low"] <= knee["tpot_ms"] <= r["tpot_ms"]["high"]
    lo, hi = perf.HELD_OUT_SPREAD["output_tokens_per_s"]
    assert r["low"] == pytest.approx(knee["output_tokens_per_s"] / (1 + hi), rel=1e-3)
    # the text prints the same range the JSON carries
    text = plan_text(load(d))
    assert f"output tok/s (likely {r['low']:,.0f}-{r['high']:,.0f})" in text


def test_the_performance_models_import_no_planner_search_or_serving_decision():
    # models -> search -> plan, one way: ops/step/request_model/mtp/speed_decisions never reach
    # back.
    import ast
    from pathlib import Path

    root = Path(perf.__file__).parent
    banned = {"planner", "serving", "speculative", "capacity", "engine_from_plan"}
    for name in ("ops", "step", "request_model", "mtp", "speed_decisions"):
        tree = ast.parse((root / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mods = {(node.module or "").split(".")[-1]} | {a.name for a in node.names}
                assert not mods & banned, (name, ast.dump(node))
            elif isinstance(node, ast.Import):
                assert not {a.name.split(".")[-1] for a in node.names} & banned, name


def test_a_prefill_first_wave_prefills_in_budget_groups():
    # Four synchronised clients, 1,000-token prompts, a 2,000-token budget and no chunked
    # prefill (V0): two prompts per step. Requests 1-2 get their first token after one group
    # step, 3-4 after two: mean 1.5 group steps; the wave's last after 2. A group step is one
    # prompt's step plus the second prompt's work beyond the step's fixed part.
    s = toy(chunked_prefill=False, max_num_batched_tokens=2000)
    own = perf.prompt_s(s, 1000, 0, 0)[0]
    empty = perf.step_s(s, 0.0, 0.0)
    group = own + (own - empty)
    mean, last = perf._wave_s(s, 1000, 4, own)
    assert mean == pytest.approx(1.5 * group) and last == pytest.approx(2 * group)
    # and the plan's bench point waits at least that long for its first token
    p = perf.bench_point(s, Workload(1000, 64), 4)
    assert p.ttft_ms >= 1.5 * group * 1e3
