"""EPLB as a choice: the redundant experts' memory from first principles, the decision and its
reason as data, the pin, and the flags gated by the releases read from the sdists."""

from __future__ import annotations

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
from launcher.predict.features import eplb
from launcher.predict.memory import redundant_experts as RX
from launcher.predict.memory.budget import Layout
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
    return SimpleNamespace(tokens=tokens, max_num_seqs=seqs, fits=fits, problem="")


def test_the_memory_decides_when_the_batch_would_no_longer_fit():
    w = SimpleNamespace(input_len=1000, output_len=1000)  # 64 x 2,000 = 128,000 tokens
    d = eplb.Decision(applies=True, enabled=True, ep_size=32, num_redundant_experts=32,
                      slots_per_rank=9, bytes_per_gpu=2_554_954_752)
    import dataclasses
    on = eplb.settle(dataclasses.replace(d), _cand(400_000), _cand(128_000), w)
    assert on.enabled and on.code == "eplb.on" and on.data["batch_tokens"] == 128_000
    off = eplb.settle(dataclasses.replace(d), _cand(400_000), _cand(127_999), w)
    assert not off.enabled and off.code == "eplb.off" and "batch needs" in off.text
    pinned = eplb.settle(dataclasses.replace(d, pinned=True), _cand(400_000), _cand(10), w)
    assert pinned.enabled and pinned.data["pinned"]  # a pin is obeyed; the KV pays


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
    assert tp_only.blocked and not tp_only.enabled  # this layout is out, not the whole plan
    prefill = eplb.propose(r1, hw, Layout(dp=16, expert_parallel=True), "0.32.0", None,
                           "deepep_high_throughput")
    assert not prefill.enabled and prefill.code == "eplb.off"


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
