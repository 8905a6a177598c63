"""Planner verdicts and the `vlaunch plan` contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.search.planner import Pins, make_plan

V = Pins(vllm_version="0.32.0")


def plan(model, gpus, **pins):
    return make_plan(load_model(model), parse_gpus(gpus), Pins(vllm_version="0.32.0", **pins))


def test_v3_fits_8xh200_full_context_bf16_kv_when_it_holds_the_workload():
    # bf16 KV already holds the full context and the chat workload's knee: fp8 would not
    # raise the figure by the margin, so the plan keeps auto and says why.
    p = plan("deepseek-v3", "8xH200")
    assert p.fits
    assert p.chosen.max_model_len == 163_840
    assert p.chosen.kv_dtype == "auto"
    assert any("kv-cache-dtype auto: bf16 KV already holds" in r.text for r in p.reasons)
    assert p.chosen.concurrency >= 1


def test_fp8_kv_when_bf16_cannot_hold_the_context():
    # 70B on 2xH100: ~66 GiB of weights per GPU leave ~5 GiB of KV; bf16 (160 KiB/token at
    # TP2) holds about half the context fp8 holds, so fp8 is needed, with the accuracy caveat.
    p = plan("llama-3.1-70b", "2xH100")
    assert p.fits and p.chosen.kv_dtype == "fp8"
    assert any(re.search(r"kv-cache-dtype fp8: bf16 KV holds only [\d,]+ tokens", r.text)
               for r in p.reasons)
    assert any("accuracy" in w.text for w in p.warnings)


def test_v3_does_not_fit_8xh100_and_says_what_would():
    p = plan("deepseek-v3", "8xH100")
    assert not p.fits
    assert "exceed" in p.chosen.problem
    text = " ".join(s.text for s in p.suggestions)
    assert "2x8xH100" in text and "distill" in text and "int4" in text


def test_r1_fits_two_h100_nodes():
    p = plan("deepseek-r1", "2x8xH100")
    assert p.fits and p.chosen.layout.nodes == 2
    assert p.chosen.layout.tp * p.chosen.layout.pp * p.chosen.layout.dp == 16


def test_pinned_tp_is_kept_and_explained():
    p = plan("deepseek-v3", "8xH200", tp=8)
    assert p.chosen.layout.tp == 8 and p.chosen.layout.dp == 1
    assert p.chosen.max_model_len == 163_840


def test_pinned_len_that_cannot_fit_is_a_misfit():
    p = plan("r1-distill-qwen-32b", "1xL4", max_model_len=131072)
    assert not p.fits


def test_fp8_not_on_ampere_for_mla():
    p = plan("deepseek-v2-lite", "1xA100-80GB")
    assert p.chosen.kv_dtype == "auto"
    assert any("8.9" in r.text for r in p.reasons)


def test_fp8_never_on_cpu_for_mla():
    from launcher.inputs.model import spec_from_config

    small = {"model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128,
             "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
             "v_head_dim": 64, "intermediate_size": 512, "moe_intermediate_size": 128,
             "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
             "first_k_dense_replace": 1, "vocab_size": 512, "max_position_embeddings": 4096}
    p = make_plan(spec_from_config(small, name="small-mla"), parse_gpus("cpu"), V)
    assert p.chosen.kv_dtype == "auto"
    assert "--kv-cache-memory-bytes" in p.vllm_args()


def test_gqa_tp_must_divide_heads():
    # 28 heads: TP 8 is impossible; the planner picks TP 1, 2 or 4 only.
    p = plan("r1-distill-qwen-7b", "8xH100")
    assert p.chosen.layout.tp in (1, 2, 4)


def test_utilization_lowered_when_gpu_is_shared():
    from dataclasses import replace

    hw = parse_gpus("1xH100")
    busy = replace(hw, free_bytes=hw.total_bytes // 2, source="nvml",
                   notes=("GPU 0: pid 42 (python) holds 39.8 GiB",))
    p = make_plan(load_model("r1-distill-qwen-1.5b"), busy, V)
    assert p.chosen.utilization <= 0.5
    assert any("pid 42" in w.text for w in p.warnings)


@pytest.mark.parametrize("args, needle", [
    (["plan", "nosuch", "--gpus", "8xH200"], "unknown model"),
    (["plan", "deepseek-v3", "--gpus", "8xZ9"], "unknown GPU"),
    (["plan", "deepseek-v3", "--gpus", "8x/H200"], "malformed --gpus"),
    (["plan", "deepseek-v3", "--gpus", "8xH200", "--tp", "3"], "does not divide"),
    (["plan", "deepseek-v3", "--gpus", "16xH100"], "2x8xH100"),
    (["plan", "deepseek-v3", "--gpus", "8xH200", "--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["plan", "deepseek-v3", "--gpus", "8xH200", "--max-model-len", "-5"], "positive"),
    (["plan", "deepseek-v3", "--gpus", "8xH200", "--kv-cache-dtype", "int3"], "kv-cache-dtype"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_bad_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    r = CliRunner().invoke(cli, ["plan", str(tmp_path), "--gpus", "1xH100"])
    assert r.exit_code == 2 and "cannot read" in r.output
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = CliRunner().invoke(cli, ["plan", str(tmp_path), "--gpus", "1xH100"])
    assert r.exit_code == 2 and "incomplete" in r.output


def test_json_contract():
    r = CliRunner().invoke(cli, ["plan", "deepseek-v3", "--gpus", "8xH200", "--format", "json",
                                 "--vllm-version", "0.32.0"])
    assert r.exit_code == 0
    d = json.loads(r.output)
    for key in ("fits", "model", "gpus", "parallel", "gpu_memory_utilization", "max_model_len",
                "max_num_seqs", "max_num_batched_tokens", "kv_cache", "per_gpu",
                "max_concurrency", "vllm_args", "env", "reasons", "warnings", "suggestions"):
        assert key in d
    assert d["model"]["params"] == 684_531_386_000
    assert set(d["kv_cache"]) >= {"dtype", "bytes_per_token", "block_size", "memory_bytes",
                                  "tokens"}
    assert d["vllm_args"][:2] == ["--model", "deepseek-ai/DeepSeek-V3"]


def test_misfit_exits_3():
    r = CliRunner().invoke(cli, ["plan", "deepseek-v3", "--gpus", "8xH100"])
    assert r.exit_code == 3
    assert "DOES NOT FIT" in r.output and "what would fit" in r.output


def test_plan_path_stays_light():
    code = ("import sys; from launcher.cli import main; sys.argv=['vlaunch','plan','deepseek-v3',"
            "'--gpus','8xH200','--format','json']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "heavy=[m for m in ('torch','vllm','transformers','numpy','matplotlib')\n"
            "       if m in sys.modules]\n"
            "print('HEAVY', heavy, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stderr, r.stderr


def test_pin_kv_memory_passes_the_planned_bytes():
    p = plan("deepseek-v3", "8xH200", pin_kv_memory=True)
    args = p.vllm_args()
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(p.chosen.kv_memory)
    # vLLM still checks free memory against utilization x total (request_memory): kept.
    assert args[args.index("--gpu-memory-utilization") + 1] == f"{p.chosen.utilization:.2f}"
    assert any("pin-kv-memory" in w.text for w in p.warnings)


def test_emit_when_it_does_not_fit(tmp_path):
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates the file; vlaunch only writes where it exists
    out = tmp_path / "plan"
    r = CliRunner().invoke(cli, ["plan", "deepseek-v3", "--gpus", "8xH100", "--emit", str(out),
                                 "--termination-log", str(log)])
    assert r.exit_code == 3
    assert "DOES NOT FIT" in log.read_text() and "2x8xH100" in log.read_text()
    assert not (out / "plan.json").exists()


def test_emit_writes_the_handoff_files(tmp_path):
    r = CliRunner().invoke(cli, ["plan", "deepseek-v3", "--gpus", "8xH200", "--emit",
                                 str(tmp_path), "--format", "json"])
    assert r.exit_code == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "vllm-args").read_text().split("\n")[:2] == ["--model",
                                                                     plan["model"]["hf_id"]]
    assert "VLLM_ENGINE_READY_TIMEOUT_S" in (tmp_path / "vllm.env").read_text()


def test_sparse_attention_needs_hopper():
    # V3.2's FlashMLA-Sparse kernels need compute capability 9.0+: A100s are a misfit whatever
    # their memory, and the suggestions do not offer more A100s.
    p = plan("deepseek-v3.2", "2x8xA100-80GB")
    assert not p.fits and "Hopper" in p.chosen.problem
    assert not any("A100" in s.text for s in plan("deepseek-v3.2", "8xA100-80GB").suggestions)
    assert plan("deepseek-v3.2", "8xH200").fits


def test_enforce_eager_reaches_vllm():
    p = plan("deepseek-v3", "8xH200", enforce_eager=True)
    assert "--enforce-eager" in p.vllm_args() and p.to_dict()["enforce_eager"] is True
    assert p.chosen.cudagraph == 0


def test_misfit_has_no_command_and_says_by_how_much():
    d = plan("deepseek-v3", "8xH100").to_dict()
    assert d["vllm_args"] == [] and "exceed" in d["problem"] and "GiB" in d["problem"]


def test_checkpoint_index_is_the_ground_truth_for_weights(tmp_path):
    # A checkpoint whose index says twice what config.json implies (e.g. extra stored tensors):
    # the plan sizes weights from the index and warns about the difference.
    cfg = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2048,
           "vocab_size": 4096, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    counted = make_plan(load_model(str(tmp_path)), parse_gpus("1xL4"), V).to_dict()
    index = {"metadata": {"total_size": 2 * counted["model"]["weights_bytes"]}, "weight_map": {}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    d = make_plan(load_model(str(tmp_path)), parse_gpus("1xL4"), V).to_dict()
    assert d["model"]["weights_bytes"] == 2 * counted["model"]["weights_bytes"]
    assert d["per_gpu"]["weights_bytes"] == pytest.approx(2 * counted["per_gpu"]["weights_bytes"],
                                                          abs=2)
    assert any("checkpoint index" in w["text"] for w in d["warnings"])


def test_pipeline_parallel_inside_a_node_and_tp_across_nodes():
    # TP x PP <= GPUs per node is valid: TP4 x PP2 on one 8-GPU node, with its stages shown.
    p = plan("llama-3.1-70b", "8xH100", tp=4, pp=2, max_model_len=8192)
    assert p.fits and (p.chosen.layout.tp, p.chosen.layout.pp) == (4, 2)
    d = p.to_dict()
    assert [s["layers"] for s in d["per_stage"]] == [40, 40]
    # blocks x 16 tokens x 40 layers x (K, V) x 2 KV heads per rank x 128 x 2 B
    assert all(s["kv_cache_bytes"] == d["kv_cache"]["blocks"] * 16 * 40 * 2 * 2 * 128 * 2
               for s in d["per_stage"])
    assert "pipeline stages" in CliRunner().invoke(
        cli, ["plan", "llama-3.1-70b", "--gpus", "8xH100", "--tp", "4", "--pp", "2",
              "--max-model-len", "8192"]).output
    # TP16 across two nodes is a layout vLLM runs; the planner plans it when pinned.
    t16 = plan("deepseek-r1", "2x8xH100", tp=16)
    assert t16.fits and t16.chosen.layout.tp == 16 and t16.chosen.layout.nodes == 2


def test_expert_parallel_never_exceeds_the_routed_experts():
    from launcher.inputs.model import spec_from_config

    small = {"model_type": "deepseek_v3", "hidden_size": 1024, "num_hidden_layers": 4,
             "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 256,
             "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
             "v_head_dim": 64, "intermediate_size": 2048, "moe_intermediate_size": 256,
             "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
             "first_k_dense_replace": 1, "vocab_size": 4096, "max_position_embeddings": 8192}
    spec = spec_from_config(small, name="four-experts")
    from launcher.predict.search.planner import layouts

    lays = layouts(spec, parse_gpus("8xH100"), Pins())
    assert lays and all(L.tp * L.dp <= 4 for L in lays if L.expert_parallel)


def test_batched_tokens_below_max_num_seqs_is_not_a_plan():
    p = plan("llama-3.1-8b", "1xH100", max_num_seqs=512, max_num_batched_tokens=256)
    assert not p.fits and "max-num-batched-tokens" in p.chosen.problem
