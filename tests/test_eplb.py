"""EPLB as a choice: the redundant experts' memory from first principles, the decision and its
reason as data, the pin, and the flags gated by the releases read from the sdists."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.deployment.argv import engine_argv
from launcher.errors import InputError
from launcher.inputs import vllm_flags as F
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.features import eplb
from launcher.predict.features.capabilities import version_traits
from launcher.predict.memory import redundant_experts as RX
from launcher.predict.memory.budget import Layout
from launcher.predict.search import search
from launcher.predict.search.planner import Pins, make_plan

# DeepSeek-V3/R1 (../shared/reference/deepseek-facts.md): 58 MoE layers, hidden 7168, expert
# intermediate 2048, 256 routed experts, block-FP8 weights with one fp32 scale per 128x128.
H, INTER, LAYERS, EXPERTS = 7168, 2048, 58, 256


@pytest.fixture(scope="module")
def r1():
    return load_model("deepseek-r1")


def test_one_expert_of_deepseek_is_its_weights_and_scales_over_58_layers(r1):
    weights = 3 * H * INTER  # gate, up, down: 44,040,192 FP8 bytes a layer
    scales = (math.ceil(2 * INTER / 128) * math.ceil(H / 128)  # gate_up [4096, 7168]: 32 x 56
              + math.ceil(H / 128) * math.ceil(INTER / 128)) * 4  # down [7168, 2048]: 56 x 16, fp32
    assert (weights, scales) == (44_040_192, 10_752)
    assert RX.expert_bytes(r1) == LAYERS * (weights + scales) == 2_554_954_752
    # vLLM's EP guide: "approximately 2.4 GB for one redundant expert per EP rank"
    assert 2.3e9 < RX.expert_bytes(r1) < 2.6e9


@pytest.mark.parametrize("ep, redundant, slots", [(16, 16, 17), (32, 32, 9), (64, 64, 5),
                                                  (8, 8, 33)])
def test_redundant_experts_per_gpu_is_bytes_per_expert_times_redundant_over_ep(r1, ep, redundant,
                                                                               slots):
    assert RX.redundant_experts(EXPERTS, ep) == redundant
    assert RX.slots_per_rank(EXPERTS, redundant, ep) == slots == (EXPERTS + redundant) // ep
    layout = Layout(tp=1, dp=ep, expert_parallel=True)
    # 256 divides by EP: bytes per expert x redundant experts / EP ranks, one slot a rank
    assert RX.bytes_per_gpu(r1, layout, redundant) == RX.expert_bytes(r1) * redundant // ep
    assert RX.bytes_per_gpu(r1, Layout(tp=2, dp=ep // 2, expert_parallel=True), redundant) \
        == RX.bytes_per_gpu(r1, layout, redundant)  # the EP group is TP x DP


def test_redundant_experts_property_over_thousands_of_shapes():
    cases = 0
    for experts in range(1, 300, 7):
        for ep in range(1, 130, 3):
            r = RX.redundant_experts(experts, ep)
            assert 1 <= r <= ep and (experts + r) % ep == 0, (experts, ep, r)
            # the fewest: no smaller positive count splits exactly
            assert not any((experts + x) % ep == 0 for x in range(1, r))
            extra = RX.extra_slots(experts, r, ep)
            assert extra == (1 if experts % ep == 0 else 0), (experts, ep)
            cases += 1
    assert cases > 1500
    with pytest.raises(ValueError):
        RX.slots_per_rank(256, 3, 16)


def test_the_flags_are_table_rows_gated_by_their_first_release():
    for dest in ("enable_eplb", "eplb_config"):
        since, until = F.releases(dest)
        assert since and until is None
        assert F.available(dest, "0.32.0") and not F.available(dest, "0.9.1")
    assert F.releases("enable_eplb")[0] == "0.9.2" and F.releases("eplb_config")[0] == "0.10.2"
    pin = F.BY_DEST["enable_eplb"].pin
    assert pin is not None and pin.option == "--eplb" and pin.negatable
    assert F.check_value("eplb_config", '{"num_redundant_experts":32}') is None
    assert F.check_value("eplb_config", '{"num_redundant_experts":32,"policy":"x"}')
    assert F.check_value("eplb_config", '{"num_redundant_experts":0}')


def _plan(r1, gpus, **pins):
    return make_plan(r1, parse_gpus(gpus), Pins(vllm_version="0.32.0", **pins)).deployment()


def _layout_pins(d):
    e = d.engine
    p = e.parallel
    return dict(tp=p.tp, dp=p.dp, expert_parallel=p.expert_parallel,
                max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                max_model_len=e.max_model_len, speculative=False)


def test_wide_ep_decode_turns_eplb_on_and_pays_for_it_from_the_kv_cache(r1):
    on = _plan(r1, "2x8xH100")
    e, s = on.engine, on.pool.serving
    assert e.parallel.expert_parallel and e.parallel.tp * e.parallel.dp == 16
    assert s.eplb.enabled and not s.eplb.pinned and e.enable_eplb
    assert e.num_redundant_experts == s.eplb.num_redundant_experts == 16
    argv = engine_argv(e)
    assert argv[argv.index("--eplb-config") + 1] == '{"num_redundant_experts":16}'
    reason = next(r for r in on.reasons if r.code == "eplb.on")
    assert reason.data["bytes_per_gpu"] == s.eplb.bytes_per_gpu == 2_554_954_752
    assert reason.data["kv_tokens_after"] < reason.data["kv_tokens_before"]
    assert reason.data["kv_tokens_after"] == on.pool.kv_cache.tokens  # one number per fact
    assert reason.data["imbalance"]["hottest_rank_over_mean_without"] > \
        reason.data["imbalance"]["hottest_rank_over_mean_with"] >= 1
    # the same layout and batch without EPLB: the weights differ by exactly the redundant
    # experts and the KV cache by the same bytes, to one block
    pins = _layout_pins(on)
    off = _plan(r1, "2x8xH100", eplb=False, **pins)
    on2 = _plan(r1, "2x8xH100", eplb=True, **pins)
    assert not off.engine.enable_eplb and "--enable-eplb" not in engine_argv(off.engine)
    assert next(r for r in off.reasons if r.code == "eplb.off").data["pinned"] is True
    b_on, b_off = on2.pool.per_gpu, off.pool.per_gpu
    assert b_on.weights_bytes - b_off.weights_bytes == 2_554_954_752
    block = on2.pool.kv_cache.bytes_per_block or 0
    lost = b_off.kv_cache_bytes - b_on.kv_cache_bytes
    assert 2_554_954_752 - block <= lost <= 2_554_954_752 + block, (lost, block)
    assert on2.pool.kv_cache.tokens < off.pool.kv_cache.tokens


def test_ep_within_one_node_keeps_its_kv_cache(r1):
    d = _plan(r1, "8xH200", tp=1, dp=8, expert_parallel=True)
    assert not d.engine.enable_eplb
    r = next(r for r in d.reasons if r.code == "eplb.off")
    assert r.data["ep_size"] == 8 and r.data["bytes_per_gpu"] == 2_554_954_752


def _cand(tokens, seqs=64, fits=True):
    return SimpleNamespace(tokens=tokens, max_num_seqs=seqs, fits=fits, problem="no room")


def _wanted(ep=32, pinned=False):
    """EPLB as `propose` leaves it for a wide-EP engine of DeepSeek-R1: wanted, not settled."""
    return dataclasses.replace(eplb.NONE, applies=True, enabled=True, pinned=pinned, ep_size=ep,
                               num_redundant_experts=ep, slots_per_rank=256 // ep + 1,
                               bytes_per_gpu=2_554_954_752)


def test_the_threshold_is_the_share_of_the_hot_rank_s_tokens_eplb_removes():
    # TensorRT-LLM blog 4, Table 1: the hottest rank 2.564x the mean without, 1.109x with
    assert eplb.HOT_RANK_CUT == pytest.approx(1 - 1.109 / 2.564) == pytest.approx(0.5675, abs=1e-4)


def test_the_cut_costs_the_batch_the_kv_cache_holds_before_and_after():
    w = SimpleNamespace(input_len=1000, output_len=1000)  # 2,000 tokens a request
    # max-num-seqs binds: 400,000 tokens hold 200 requests, the engine schedules 64; after the
    # cut 128,000 tokens still hold 64: the cut costs nothing (the old rule said so too)
    on = eplb.settle(_wanted(), _cand(400_000), _cand(128_000), w)
    assert on.enabled and on.reason.code == "eplb.on"
    assert (on.reason.data["batch_before"], on.reason.data["batch_after"]) == (64, 64)
    assert on.reason.data["batch_cost_share"] == 0
    # one token fewer: 63.9995 requests, a 0.0008% cut - still on (the old rule turned it off)
    assert eplb.settle(_wanted(), _cand(400_000), _cand(127_999), w).enabled
    # the KV cache binds (vLLM's default 1,024 seqs): 200 -> 100 requests is a 50% cut, under
    # 1 - 1.109/2.564 = 56.75%: on; the old rule wanted 1,024 x 2,000 tokens and said off
    half = eplb.settle(_wanted(), _cand(400_000, 1024), _cand(200_000, 1024), w)
    assert half.enabled and half.reason.data["batch_cost_share"] == 0.5
    # 200 -> 86.5 requests (173,000 tokens) is 56.75%: off; 173,100 tokens (86.55) is on
    edge = 400_000 * 1.109 / 2.564  # 173,010.9 tokens: the break-even
    assert not eplb.settle(_wanted(), _cand(400_000, 1024), _cand(173_000, 1024), w).enabled
    assert eplb.settle(_wanted(), _cand(400_000, 1024), _cand(173_100, 1024), w).enabled
    assert 173_000 < edge < 173_100
    off = eplb.settle(_wanted(), _cand(400_000, 1024), _cand(86_000, 1024), w)
    assert not off.enabled and off.reason.code == "eplb.off"
    assert off.reason.data["cause"] == "batch" and off.reason.data["batch_after"] == 43
    assert off.reason.text == eplb.render("eplb.off", off.reason.data)
    misfit = eplb.settle(_wanted(), _cand(400_000), _cand(0, fits=False), w)
    assert not misfit.enabled and misfit.reason.data["cause"] == "misfit"
    assert misfit.reason.text.endswith("would leave too little: no room")
    pinned = eplb.settle(_wanted(pinned=True), _cand(400_000), _cand(10), w)
    assert pinned.enabled and pinned.reason.data["pinned"]  # a pin is obeyed; the KV pays


def test_the_kv_bound_wide_ep_engine_keeps_eplb_on_with_vllm_s_default_batch(r1):
    """The inverted rule: with max-num-seqs 1,024 the old test (the cache holds 1,024 whole
    requests) failed wherever the KV cache binds, so more GPUs turned EPLB off."""
    d = _plan(r1, "4x8xH100", tp=1, dp=32, expert_parallel=True, max_num_seqs=1024,
              speculative=False)
    r = next(r for r in d.reasons if r.code.startswith("eplb."))
    assert d.engine.max_num_seqs == 1024 and r.data["max_num_seqs"] == 1024
    assert r.data["kv_tokens_before"] / 1280 < 1024  # the KV cache binds
    assert r.code == "eplb.on" and d.engine.enable_eplb, r.text
    assert r.data["batch_cost_share"] < eplb.HOT_RANK_CUT
    assert r.data["batch_before"] == round(r.data["kv_tokens_before"] / 1280, 2)


def _goal(spec, hw, util, workload, pins=None):
    return search.Goal(spec, hw, pins or Pins(vllm_version="0.32.0"),
                       version_traits("0.32.0"), util, workload, SLO(), "balanced", None, True,
                       False, ["auto"], [0])


def test_eplb_auto_is_monotone_in_memory_never_narrow_and_a_pin_always_wins():
    """Properties over models, GPU kinds and counts, layouts, batches and workloads, each at a
    rising share of the GPU's memory: more memory never turns auto EPLB off; EP at or below
    WIDE_EP never runs it; --eplb and --no-eplb are obeyed wherever the layout can run it."""
    cases = flips = 0
    causes: set[str] = set()
    utils = [0.6 + 0.025 * i for i in range(15)]
    for model in ("deepseek-r1", "deepseek-v2-lite"):
        spec = load_model(model)
        for gpus in ("8xH100", "2x8xH100", "4x8xH100", "2x8xH200", "4x8xB200", "2x8xMI300X",
                     "8x8xH100", "2x8xA100-80GB"):
            hw = parse_gpus(gpus)
            for tp in (1, 2, 4, 8):
                for pp in (1, 2):
                    dp = hw.count // (tp * pp)
                    if dp < 1 or tp * dp > spec.num_experts:
                        continue
                    for seqs, w, ctx in ((None, Workload(1024, 256), 8192),
                                         (64, Workload(8000, 1000), 32768),
                                         (None, Workload(200, 2000), 4096)):
                        lay = Layout(tp=tp, pp=pp, dp=dp, expert_parallel=True)
                        k = search.Knobs(lay, "auto", ctx, None, seqs, True)
                        was_on = False
                        for u in utils:
                            j = search.memory(_goal(spec, hw, u, w), k)
                            cases += 1
                            on = j.eplb.enabled and j.cand.fits
                            if tp * dp <= eplb.WIDE_EP or pp > 1:
                                assert not j.eplb.enabled, (model, gpus, lay, u)
                            assert not (was_on and not on), (model, gpus, lay, seqs, w, u)
                            flips += on and not was_on
                            was_on = was_on or on
                            if j.eplb.reason is not None:
                                r = j.eplb.reason
                                assert r.text == eplb.render(r.code, r.data)
                                causes.add(r.data["cause"])
                        if tp * dp > eplb.WIDE_EP and pp == 1:  # the pins, at the top share
                            for pin in (True, False):
                                g = _goal(spec, hw, utils[-1], w, Pins(vllm_version="0.32.0",
                                                                       eplb=pin))
                                j = search.memory(g, k)
                                if j.eplb.applies:
                                    assert j.eplb.enabled is pin, (model, gpus, lay, pin)
    assert cases > 3000 and flips > 100, (cases, flips)
    # every branch of the rule was met: the batch's share, a misfit, narrow EP, on
    assert {"batch", "misfit", "narrow", "pipeline", "wide_ep"} <= causes, causes


def test_a_pin_eplb_cannot_honour_is_one_line_and_exit_2():
    for args in (["deepseek-r1", "--gpus", "cpu", "--eplb"],
                 ["llama-3.1-8b", "--gpus", "8xH100", "--eplb"],
                 # MLA is in 0.7.1, --eplb-config first in 0.10.2 (the sdists)
                 ["deepseek-r1", "--gpus", "2x8xH100", "--eplb", "--vllm-version", "0.10.1"]):
        r = CliRunner().invoke(cli, ["plan", *args])
        assert r.exit_code == 2, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1 and "--eplb" in r.output, r.output


def test_propose_refuses_only_what_no_layout_could_run(r1):
    hw = parse_gpus("2x8xH100")
    with pytest.raises(InputError, match="no --enable-eplb .first in 0.9.2"):
        eplb.propose(r1, hw, Layout(dp=16, expert_parallel=True), "0.9.1", True, None)
    tp_only = eplb.propose(r1, hw, Layout(tp=16), "0.32.0", True, None)
    assert eplb.blocked(tp_only, True) and not tp_only.enabled  # this layout is out, not all
    assert eplb.problem(tp_only) == ("--eplb pinned, but EPLB balances expert-parallel MoE "
                                     "layers; this layout has none (vLLM: "
                                     "enable_expert_parallel and TP x DP > 1)")
    prefill = eplb.propose(r1, hw, Layout(dp=16, expert_parallel=True), "0.32.0", None,
                           "deepep_high_throughput")
    assert not prefill.enabled and prefill.reason.code == "eplb.off"


def test_the_installed_vllm_reads_the_eplb_flags_the_plan_writes(r1):
    """vLLM 0.32's own parser turns the plan's two flags into ParallelConfig's enable_eplb and an
    EPLBConfig with the planned redundant experts (config/parallel.py)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    d = _plan(r1, "2x8xH100")
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(engine_argv(d.engine))
    assert ns.enable_eplb is True and ns.enable_expert_parallel is True
    assert ns.eplb_config.num_redundant_experts == d.engine.num_redundant_experts == 16
    assert (EXPERTS + ns.eplb_config.num_redundant_experts) % (ns.tensor_parallel_size
                                                              * ns.data_parallel_size) == 0


def test_one_expert_times_the_experts_is_every_expert_weight_of_every_moe_profile():
    from launcher.inputs.model import list_profiles
    from launcher.predict.memory.budget import tensor_bytes

    checked = 0
    for s in list_profiles():
        if not s.is_moe:
            continue
        total = sum(tensor_bytes(t, s.quant, s.dtype_bytes) for t in s.tensors
                    if t.loaded and t.part == "experts")
        assert RX.expert_bytes(s) * s.num_experts == pytest.approx(total, rel=1e-9), s.name
        checked += 1
    assert checked >= 3
