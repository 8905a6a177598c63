"""The version-gate table (profiles/capabilities.yaml vllm_features) and vLLM 0.32's
per-version accounting: a plan uses nothing its vLLM lacks, or refuses with the reason."""

from __future__ import annotations

import shlex

import pytest

from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.features import capabilities as caps
from launcher.predict.features.capabilities import batch_defaults, version_traits
from launcher.predict.memory import budget as B
from launcher.predict.search.planner import Pins, layouts, make_plan


def test_features_follow_their_first_release():
    old, new = version_traits("0.7.3"), version_traits("0.32.0")
    for name in caps.table()["vllm_features"]:
        assert new.has(name), name  # 0.32 has everything the table names
    assert not old.has("expert_parallel") and version_traits("0.8.0").has("expert_parallel")
    assert not version_traits("0.19.1").has("cudagraph_estimate")
    assert version_traits("0.20.0").has("cudagraph_estimate")
    with pytest.raises(KeyError):
        new.has("no_such_feature")


def test_mla_before_0_7_1_is_refused_with_the_reason():
    with pytest.raises(InputError, match="predates MLA"):
        make_plan(load_model("deepseek-v3"), parse_gpus("2x8xH100"), Pins(vllm_version="0.6.0"))


def test_no_expert_or_data_parallel_before_they_exist():
    spec, hw = load_model("deepseek-v3"), parse_gpus("2x8xH100")
    old = layouts(spec, hw, Pins(), version_traits("0.7.3"))
    assert old and all(not L.expert_parallel and L.dp == 1 for L in old)
    mid = layouts(spec, hw, Pins(), version_traits("0.8.2"))
    assert any(L.expert_parallel for L in mid) and all(L.dp == 1 for L in mid)
    assert any(L.dp > 1 for L in layouts(spec, hw, Pins(), version_traits("0.8.3")))
    with pytest.raises(InputError, match="predates --enable-expert-parallel"):
        layouts(spec, hw, Pins(expert_parallel=True), version_traits("0.7.3"))
    with pytest.raises(InputError, match="data-parallel"):
        layouts(spec, hw, Pins(dp=2), version_traits("0.8.0"))


def test_pinned_kv_bytes_need_the_flag():
    with pytest.raises(InputError, match="kv-cache-memory-bytes"):
        make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100"),
                  Pins(vllm_version="0.10.1", kv_cache_memory_bytes=10 << 30))
    with pytest.raises(InputError, match="kv-cache-memory-bytes"):
        make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100"),
                  Pins(vllm_version="0.10.1", pin_kv_memory=True))


def test_old_versions_get_no_flag_or_env_they_lack():
    # the startup-plan env exists since 0.26.0; a CPU plan pins KV bytes only where vLLM has
    # --kv-cache-memory-bytes (0.10.2)
    h100 = parse_gpus("1xH100")
    spec = load_model("llama-3.1-8b")
    assert "VLLM_ENABLE_STARTUP_PLAN" in make_plan(spec, h100, Pins(vllm_version="0.32.0")).env()
    assert "VLLM_ENABLE_STARTUP_PLAN" not in make_plan(spec, h100,
                                                       Pins(vllm_version="0.25.0")).env()
    tiny = load_model("r1-distill-qwen-1.5b")
    cpu = parse_gpus("cpu")
    new = make_plan(tiny, cpu, Pins(vllm_version="0.32.0"), suggest=False)
    old = make_plan(tiny, cpu, Pins(vllm_version="0.9.0"), suggest=False)
    assert "--kv-cache-memory-bytes" in new.vllm_args()
    assert "--kv-cache-memory-bytes" not in old.vllm_args()


def test_fp8_mla_cache_is_gated():
    ok, why = caps.fp8_kv_support(parse_gpus("8xH200"), "mla", "0.10.1")
    assert not ok and "0.10.2" in why
    assert caps.fp8_kv_support(parse_gpus("8xH200"), "mla", "0.10.2")[0]


def test_newer_than_modelled_warns_and_missing_vllm_says_what_it_assumed(monkeypatch):
    spec, hw = load_model("llama-3.1-8b"), parse_gpus("1xH100")
    plan = make_plan(spec, hw, Pins(vllm_version="9.0.0"))
    newest = caps.table()["newest_modelled_vllm"]
    assert any("newer than the newest" in w.text and newest in w.text for w in plan.warnings)
    monkeypatch.setattr(caps, "installed_vllm", lambda: None)
    plan = make_plan(spec, hw, Pins())
    assert any("assumed (no vLLM is installed" in r.text for r in plan.reasons)


def test_non_torch_after_the_snapshot_keeps_only_the_per_rank_term():
    # Before 0.11: 0.13 + 1.5 + 0.2 x 8 GiB at TP8; since, NCCL and custom all-reduce are set
    # up before the snapshot: 0.13 + 0.2 x 8.
    L = B.Layout(tp=8)
    assert B.non_torch_bytes(L) == B.NON_TORCH_SINGLE + B.NON_TORCH_TP_BASE + 8 * (
        B.NON_TORCH_TP_PER_RANK)
    assert B.non_torch_bytes(L, True) == B.NON_TORCH_SINGLE + 8 * B.NON_TORCH_TP_PER_RANK


def test_sampler_without_a_sort_peaks_three_logits_lower():
    spec = load_model("llama-3.1-8b")
    L = B.Layout()
    # sampler-bound profile: 1,024 sequences x 128,256 vocab x 4 B x copies
    sort = B.activation_bytes(spec, L, 16, 1024)
    nosort = B.activation_bytes(spec, L, 16, 1024, sampler_sorts=False)
    assert sort - nosort == pytest.approx(3 * 1024 * spec.vocab_size * 4, rel=1e-9)


def test_fused_moe_workspace_sees_every_dp_ranks_tokens():
    # DP8+EP, 2,048 tokens per rank: 7 more ranks' tokens x top-8 x (2 x 2,048 + 7,168) x 2 B
    spec = load_model("deepseek-v3")
    L = B.Layout(tp=1, dp=8, expert_parallel=True)
    base = B.activation_bytes(spec, L, 2048, 1)
    more = B.activation_bytes(spec, L, 2048, 1, moe_all_dp_tokens=True)
    assert more - base == 7 * 2048 * 8 * (2 * 2048 + 7168) * 2


def test_two_capture_lists_and_the_blackwell_cap():
    # 256 sequences, 8,192 tokens: piecewise sizes up to min(2 x 256, 512, 8192) = 51 sizes;
    # full decode graphs for sizes <= 256: 35; the estimate counts 51 + 35 - 1 per-graph costs.
    # With 1,024 sequences a 1,024 cap adds 528..1024 in steps of 16: 32 more sizes.
    spec = load_model("llama-3.1-8b")
    L = B.Layout()
    assert B.capture_sizes(256, 8192) == 51
    assert len(B.capture_list(1024, 8192, 1024)) == 51 + 32
    one = B.cudagraph_bytes(spec, L, 256, 8192, False)
    two = B.cudagraph_bytes(spec, L, 256, 8192, False, full_and_piecewise=True)
    assert two - one == 34 * B.CUDAGRAPH_PER_CAPTURE


def test_large_gpus_get_vllm_0_28s_batch_defaults():
    b200 = parse_gpus("8xB200")
    assert batch_defaults(b200, 8, "0.32.0") == (16384, 1024)
    assert batch_defaults(b200, 8, "0.27.0") == (8192, 1024)
    assert batch_defaults(parse_gpus("8xH200"), 8, "0.32.0") == (8192, 1024)


def test_v32_on_blackwell_caches_plain_fp8():
    # FLASHINFER_MLA_SPARSE (vLLM >= 0.19, Blackwell): 576 fp8 + 132 indexer B per layer;
    # Hopper keeps fp8_ds_mla: 656 + 132.
    spec = load_model("deepseek-v3.2")
    pins = Pins(kv_cache_dtype="fp8", tp=8, speculative=False)
    b200 = make_plan(spec, parse_gpus("8xB200"), pins, suggest=False).chosen
    h200 = make_plan(spec, parse_gpus("8xH200"), pins, suggest=False).chosen
    assert b200.kv_bytes_per_token == (576 + 132) * 61
    assert h200.kv_bytes_per_token == (656 + 132) * 61
    old = make_plan(spec, parse_gpus("8xB200"), Pins(kv_cache_dtype="fp8", tp=8, speculative=False,
                                                     vllm_version="0.18.0"), suggest=False)
    assert old.chosen.kv_bytes_per_token == (656 + 132) * 61


def test_requested_bytes_use_cudas_total():
    # H100: NVML 81,559 MiB, CUDA 81,080 MiB (79.18 GiB): vLLM requests 0.92 x the latter.
    hw = parse_gpus("1xH100")
    assert hw.budget_total == 81080 * B.MiB
    plan = make_plan(load_model("llama-3.1-8b"), hw, Pins(vllm_version="0.32.0"))
    assert plan.chosen.requested == B.requested_bytes(81080 * B.MiB, 0.92)


@pytest.mark.parametrize("version,program", [
    ("0.4.3", ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]),
    ("0.5.0", ["vllm", "serve"]), ("0.11.0", ["vllm", "serve"]), ("0.32.0", ["vllm", "serve"])])
def test_the_printed_command_takes_the_form_its_vllm_wants(version, program):
    """`vllm serve MODEL` (model positional: --model is refused from 0.5.5, deprecated since
    vLLM #25967) where the release has `vllm serve` (the serve_cli gate); the API server module
    with --model before it. The plan text prints exactly that command."""
    from launcher.render import plan_text, vllm_command_of

    plan = make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100"),
                     Pins(vllm_version=version))
    dep = plan.deployment()
    argv = vllm_command_of(dep)
    assert argv[:len(program)] == program
    assert argv[len(program)] == plan.vllm_args()[1] and "--model" not in argv[len(program):]
    line = next(x for x in plan_text(dep).splitlines() if " ".join(program) in x)
    assert shlex.split(line)[-len(argv):] == argv  # the printed line is that argv, pasteable
