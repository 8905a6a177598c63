"""MTP speculative decoding: cost from first principles, gain, decision, flags, version gates.

The MTP layer of DeepSeek-V3/R1 (layer 61) is one more MoE decoder layer plus eh_proj and three
norms; its embedding and head are shared with the target's (vLLM drops its own copies), except
the embedding under PP. Sizes below use the checkpoint's FP8 block format: a weight of R x C
stores R*C bytes plus ceil(R/128)*ceil(C/128) fp32 scales.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from launcher.deployment.codec import load
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, resolve_workload
from launcher.predict.features import speculative as S
from launcher.predict.memory import budget as B
from launcher.predict.search.plan_inputs import inputs_from_plan
from launcher.predict.search.planner import Pins, make_plan

H, N, QLR, KLR, NOPE, ROPE, V = 7168, 128, 1536, 512, 128, 64, 128
E, MOE_I, VOCAB = 256, 2048, 129280


def fp8(rows: int, cols: int) -> int:
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * 4


# One MTP layer of V3/R1, by how vLLM shards each piece (bytes, all ranks together):
REPLICATED = (fp8(QLR, H) + QLR * 2          # q_a_proj + q_a_layernorm
              + fp8(KLR + ROPE, H) + KLR * 2  # kv_a_proj_with_mqa + kv_a_layernorm
              + 2 * H * 2                     # input / post-attention layernorms
              + E * H * 2 + E * 4             # router (bf16) + e_score_correction_bias (fp32)
              + H * 2 * H * 2                 # eh_proj: nn.Linear(2h, h) in bf16, replicated
              + 3 * H * 2)                    # enorm, hnorm, shared_head.norm
TP_SPLIT = (fp8(N * (NOPE + ROPE), QLR)       # q_b_proj (column)
            + fp8(N * (NOPE + V), KLR)        # kv_b_proj (column)
            + fp8(H, N * V)                   # o_proj (row)
            + fp8(2 * MOE_I, H) + fp8(H, MOE_I))  # shared expert gate_up + down
EXPERTS = E * (fp8(2 * MOE_I, H) + fp8(H, MOE_I))  # 256 routed experts
EMBED_ROW = H * 2                             # one vocab row of the bf16 embedding


def _no_index(name: str):
    """The profile without its checkpoint index, so bytes are the shapes' alone."""
    return dataclasses.replace(load_model(name), checkpoint_bytes=None)


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-r1"])
def test_mtp_weights_per_gpu_from_first_principles(name):
    spec = _no_index(name)
    # TP8 (EP inside the TP group or not: experts are split 8 ways either way)
    tp8 = REPLICATED + TP_SPLIT / 8 + EXPERTS / 8
    assert S.weight_bytes(spec, B.Layout(tp=8, expert_parallel=True)) == round(tp8)
    assert S.weight_bytes(spec, B.Layout(tp=8)) == round(tp8)
    # DP8 + EP: attention whole on each rank (TP 1), 256 / 8 = 32 experts per rank
    dp8 = REPLICATED + TP_SPLIT + EXPERTS * 32 / 256
    assert S.weight_bytes(spec, B.Layout(dp=8, expert_parallel=True)) == round(dp8)
    # TP8 x PP2: the draft lives on the last stage and keeps its own embedding (the target's
    # is on stage 0), vocab-parallel: 129,280 rows (a multiple of 64) / 8
    pp2 = tp8 + VOCAB / 8 * EMBED_ROW
    assert S.weight_bytes(spec, B.Layout(tp=8, pp=2, expert_parallel=True)) == round(pp2)
    # the published size: about 11.5 GB of FP8 for the whole layer (DeepSeek-V3 README)
    assert 11.3e9 < REPLICATED + TP_SPLIT + EXPERTS < 11.8e9


def test_mtp_weights_follow_the_checkpoint_index_scale():
    spec = load_model("deepseek-r1")  # checkpoint_bytes from model.safetensors.index.json
    plain = S.weight_bytes(_no_index("deepseek-r1"), B.Layout(tp=8))
    assert S.weight_bytes(spec, B.Layout(tp=8)) == round(plain * B.checkpoint_scale(spec))


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-r1"])
def test_mtp_kv_per_token_is_one_mla_layer_on_every_rank(name):
    spec = load_model(name)
    latent = KLR + ROPE  # 576 values per token and layer
    for layout in (B.Layout(tp=8), B.Layout(dp=8, expert_parallel=True), B.Layout(tp=8, pp=2)):
        assert S.kv_bytes_per_token(spec, "auto", layout) == latent * 2  # bf16: 1,152 B
        assert S.kv_bytes_per_token(spec, "fp8", layout) == latent  # 576 B


def test_v32_mtp_kv_layer_includes_the_indexer_cache():
    spec = load_model("deepseek-v3.2")
    # fp8_ds_mla: 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 B; indexer: 128 + 4 = 132 B
    assert S.kv_bytes_per_token(spec, "fp8", B.Layout(tp=8)) == 656 + 132


def _plan(name, gpus, **kw):
    goals = {k: kw.pop(k) for k in ("objective", "workload", "slo", "concurrency") if k in kw}
    goals.setdefault("workload", resolve_workload())
    return make_plan(load_model(name), parse_gpus(gpus), Pins(vllm_version="0.32.0", **kw),
                     suggest=False, **goals)


@pytest.mark.parametrize("gpus,pins,layers_off,layers_on", [
    ("8xH200", {"tp": 8}, 61, 62),
    ("8xH200", {"dp": 8, "expert_parallel": True}, 61, 62),
    # PP2 splits 61 layers 31 + 30; the draft joins the 30-layer last stage (31 layers), so
    # the limiting stage still caches 31 layers per token
    ("2x8xH200", {"tp": 8, "pp": 2}, 31, 31),
])
def test_plan_takes_the_draft_from_the_kv_cache(gpus, pins, layers_off, layers_on):
    off = _plan("deepseek-r1", gpus, speculative=False, **pins)
    on = _plan("deepseek-r1", gpus, num_speculative_tokens=1, **pins)
    d_off, d_on = off.to_dict(), on.to_dict()
    c = d_on["serving"]["speculative"]["cost_per_gpu"]
    spec = load_model("deepseek-r1")
    layout = on.chosen.layout
    assert c["weights_bytes"] == S.weight_bytes(spec, layout)
    assert c["kv_bytes_per_token"] == S.kv_bytes_per_token(spec, on.chosen.kv_dtype, layout)
    assert c["kv_bytes_per_token"] == (1152 if on.chosen.kv_dtype == "auto" else 576)
    # weights per GPU grow by the draft on the limiting (last) rank
    last_off, last_on = (off.chosen.stages[-1]["weights_bytes"],
                         on.chosen.stages[-1]["weights_bytes"])
    assert last_on - last_off == c["weights_bytes"]
    # KV bytes per token on the limiting GPU: one more 1,152 B layer where the draft lives
    per_layer = {"auto": 1152, "fp8": 576}
    assert d_on["kv_cache"]["bytes_per_token"] == layers_on * per_layer[on.chosen.kv_dtype]
    assert d_off["kv_cache"]["bytes_per_token"] == layers_off * per_layer[off.chosen.kv_dtype]
    assert on.chosen.stages[-1]["layers"] == off.chosen.stages[-1]["layers"] + 1
    assert d_on["kv_cache"]["tokens"] < d_off["kv_cache"]["tokens"]
    assert '{"method":"mtp","num_speculative_tokens":1}' in d_on["vllm_args"]
    assert "--speculative-config" not in d_off["vllm_args"]


def test_tokens_per_step_is_the_accepted_chain():
    a = S.Acceptance(0.8, 0.5, "test")
    assert a.tokens_per_step(0) == 1.0
    assert a.tokens_per_step(1) == pytest.approx(1.8)
    assert a.tokens_per_step(3) == pytest.approx(1 + 0.8 * (1 + 0.5 + 0.25))
    d = S.acceptance()
    assert d.first == 0.81 and "12755" in d.source  # the stated default: vLLM's measurement


def test_capture_sizes_follow_vllm_with_draft_tokens():
    # vLLM 0.32 without drafts: grid up to min(2 x 128, 512) = 256, plus 128 itself
    base = S.capture_sizes(128, 8192, 0)
    assert max(base) == 256 and 128 in base and 250 not in base
    # one draft: decode batches of 2 tokens per request, up to min(128 x 2 x 2, 512) = 512
    mtp = S.capture_sizes(128, 8192, 1)
    assert max(mtp) == 512 and all(n * 2 in mtp for n in (1, 2, 4, 8, 128))
    # capped by max_num_batched_tokens
    assert max(S.capture_sizes(128, 300, 1)) == 300


def test_latency_objective_turns_mtp_on_with_reason_and_numbers():
    plan = _plan("deepseek-r1", "8xH200", objective="latency")
    d = plan.to_dict()
    s = d["serving"]["speculative"]
    assert s["enabled"] and s["num_speculative_tokens"] >= 1
    reason = next(r["text"] for r in d["reasons"] if r["text"].startswith("MTP on"))
    assert re.search(r"at equal load \([\d,]+ in flight, same flags without the draft\): "
                     r"TPOT [\d.]+ vs [\d.]+ ms", reason)
    assert re.search(r"at the SLO knee: TPOT [\d.]+ ms vs TPOT [\d.]+ ms for the best plan "
                     r"without MTP", reason)
    assert "GiB of MTP weights" in reason and "B/token of KV" in reason
    assert s["cost_per_gpu"]["weights_bytes"] > 1e9
    # the plan's performance is the prediction with MTP
    off = _plan("deepseek-r1", "8xH200", objective="latency", speculative=False).to_dict()
    assert (d["performance"]["single_request"]["tpot_ms"]
            < off["performance"]["single_request"]["tpot_ms"])
    text = __import__("launcher.render", fromlist=["plan_text"]).plan_text(load(d))
    assert "MTP on" in text and "--speculative-config" in text


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_mtp_is_on_exactly_when_its_best_beats_the_best_without_by_the_margin(objective):
    # long prompts on 16 engines: whatever MTP gains at the knee, the decision follows the
    # margin (the discount rank.py applies to a draft the planner, not the user, turns on)
    from launcher.predict.search import rank

    kw = dict(dp=16, objective=objective, workload=resolve_workload(8192, 256))
    auto = _plan("deepseek-v3.2", "2x8xH200", **kw)
    off = _plan("deepseek-v3.2", "2x8xH200", speculative=False, **kw)
    on = _plan("deepseek-v3.2", "2x8xH200", speculative=True, **kw)
    gpus = 16

    def score(p):
        return p.performance.score(objective, gpus)

    gain = (score(on) - score(off)) / abs(score(off))
    s = auto.to_dict()["serving"]["speculative"]
    assert s["enabled"] == (gain >= rank.mtp_margin() - 1e-9)
    if not s["enabled"]:
        r = s["reason"]
        assert r["code"] == "mtp.off.gain" and r["data"]["gain"] < r["data"]["margin"]
        assert r["text"].startswith("MTP off") and "margin" in r["text"]


def test_a_pin_wins_both_ways():
    off = _plan("deepseek-r1", "8xH200", objective="latency", speculative=False).to_dict()
    assert off["serving"]["speculative"]["reason"] == {
        "code": "mtp.off.pinned", "text": "MTP off: pinned by you (--no-mtp)",
        "data": {"pinned": True}}
    on = _plan("deepseek-v3.2", "2x8xH200", dp=16, objective="throughput",
               workload=resolve_workload(8192, 256), num_speculative_tokens=2).to_dict()
    s = on["serving"]["speculative"]
    assert s["enabled"] and s["num_speculative_tokens"] == 2
    assert "pinned by you" in s["reason"]["text"] and s["reason"]["data"]["pinned"]
    with pytest.raises(InputError):
        _plan("deepseek-r1", "8xH200", speculative=False, num_speculative_tokens=1)
    with pytest.raises(InputError):
        _plan("deepseek-r1", "8xH200", num_speculative_tokens=1, mtp_acceptance=1.5)


def test_acceptance_input_moves_the_prediction():
    lo = _plan("deepseek-r1", "8xH200", objective="latency", num_speculative_tokens=1,
               mtp_acceptance=0.3).to_dict()
    hi = _plan("deepseek-r1", "8xH200", objective="latency", num_speculative_tokens=1,
               mtp_acceptance=0.9).to_dict()
    assert (hi["performance"]["single_request"]["tpot_ms"]
            < lo["performance"]["single_request"]["tpot_ms"])
    assert lo["serving"]["speculative"]["acceptance"]["source"] == "your --mtp-acceptance"


@pytest.mark.parametrize("version,expect", [("0.8.5", None), ("0.10.0", "deepseek_mtp"),
                                            ("0.32.0", "mtp")])
def test_version_gate_and_method_name(version, expect):
    d = make_plan(load_model("deepseek-r1"), parse_gpus("8xH200"),
                  Pins(vllm_version=version, num_speculative_tokens=1), suggest=False).to_dict()
    s = d["serving"]["speculative"]
    if expect is None:
        assert not s["enabled"] and "since 0.9.0" in s["reason"]["text"]
        assert s["reason"]["data"]["since"] == "0.9.0"
        assert s["reason"]["data"]["cause"] == "mtp.unsupported.version"
        assert "--speculative-config" not in d["vllm_args"]
        assert any("MTP was asked for" in w["text"] for w in d["warnings"])
    else:
        i = d["vllm_args"].index("--speculative-config")
        assert json.loads(d["vllm_args"][i + 1]) == {"method": expect,
                                                     "num_speculative_tokens": 1}


def test_models_without_an_mtp_layer_never_get_one():
    d = make_plan(load_model("deepseek-v2-lite"), parse_gpus("1xH200"),
                  Pins(num_speculative_tokens=1), suggest=False).to_dict()
    assert not d["serving"]["speculative"]["enabled"]
    r = d["serving"]["speculative"]["reason"]
    assert "num_nextn_predict_layers is 0" in r["text"]
    assert (r["code"], r["data"]["cause"]) == ("mtp.off.unsupported", "mtp.unsupported.no_layer")


def test_exec_replans_the_same_mtp_decision():
    d = _plan("deepseek-r1", "8xH200", objective="latency").to_dict()
    spec, hw, pins = inputs_from_plan(load(d))
    assert pins.speculative is True
    assert pins.num_speculative_tokens == d["serving"]["speculative"]["num_speculative_tokens"]
    again = make_plan(spec, hw, pins, suggest=False).to_dict()
    assert again["vllm_args"] == d["vllm_args"]


def test_measured_acceptance_from_vllm_bench_result():
    m = S.measured_acceptance({"spec_decode_acceptance_length": 2.1,
                               "spec_decode_per_position_acceptance_rates": [0.8, 0.4]})
    assert m == {"acceptance_length": 2.1, "first": 0.8, "later": 0.5}
    assert S.measured_acceptance({}) is None


# ----------------------------------------------------------------------------- engine


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.engine
def test_tiny_deepseek_serves_with_mtp_on_vllm_cpu(tmp_path):
    """The tiny DeepSeek-V3 model with one MTP layer, planned with --num-speculative-tokens 1
    and started with exactly the plan's arguments: vLLM reports the planned KV tokens (the MTP
    layer's 1,152 B/token in the same pool) and drafts tokens."""
    pytest.importorskip("torch")
    from launcher.run.tinymodel import ensure_tiny_model

    model = ensure_tiny_model(mtp=True)
    plan = make_plan(load_model(str(model)), parse_gpus("cpu"),
                     Pins(num_speculative_tokens=1, max_model_len=2048, max_num_seqs=4,
                          kv_cache_memory_bytes=64 * 1024 * 1024), suggest=False)
    d = plan.to_dict()
    assert d["kv_cache"]["bytes_per_token"] == 4 * 576 * 2  # 3 layers + the MTP layer
    # 64 MiB / (16 tokens x 4,608 B) = 910 blocks -> 14,560 tokens
    assert d["kv_cache"]["tokens"] == 67108864 // (16 * 4608) * 16
    port = _free_port()
    args = d["vllm_args"]
    env = {**os.environ, **d["env"]}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    log = tmp_path / "vllm.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                                 *args, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        text = log.read_text()
        assert proc.poll() is None, text[-3000:]
        m = re.search(r"KV cache size: ([\d,]+) tokens", text)
        assert m and int(m.group(1).replace(",", "")) == d["kv_cache"]["tokens"], text[-3000:]
        body = json.dumps({"model": d["model"]["name"], "prompt": "Hello world",
                           "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        out = json.load(urllib.request.urlopen(req, timeout=60))
        assert out["usage"]["completion_tokens"] == 8
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        drafts = re.search(rb"vllm:spec_decode_num_drafts_total\{[^}]*\} ([\d.]+)", metrics)
        assert drafts and float(drafts.group(1)) > 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_tiny_mtp_variant_keeps_the_plain_model_identity(tmp_path):
    pytest.importorskip("torch")
    from launcher.run import tinymodel

    assert tinymodel.config_dict()["num_nextn_predict_layers"] == 0
    names = [n for n, _, _ in tinymodel._tensor_shapes(tinymodel.config_dict())]
    assert not any(n.startswith("model.layers.3.") for n in names)
    mtp = [n for n, _, _ in tinymodel._tensor_shapes(tinymodel.config_dict(1))]
    assert mtp[:len(names) - 2] == names[:-2]  # same tensors, same order, MTP before the head
    assert "model.layers.3.eh_proj.weight" in mtp
    assert tinymodel.default_path(True) != tinymodel.default_path()
    assert Path(tinymodel.default_path(True)).name == "tiny-deepseek-v3-mtp"


def test_tune_varies_mtp_as_a_knob():
    from launcher.run import tune_candidates as tune

    spec, hw = load_model("deepseek-r1"), parse_gpus("8xH200")
    base = _plan("deepseek-r1", "8xH200").deployment()
    variants = tune.mtp_variants(spec, hw, Pins(), base)
    assert {"speculative": False} in variants
    assert {"speculative": True, "num_speculative_tokens": 1} in variants
    assert tune.mtp_variants(spec, hw, Pins(speculative=False), base) == [{}]  # a pin stays
    lite = load_model("deepseek-v2-lite")
    assert tune.mtp_variants(lite, hw, Pins(), base) == [{}]  # no MTP layer, no knob
    base_k = base.pool.serving.speculative.num_speculative_tokens
    k = 1 if base_k == 2 else 2  # a draft count the base plan does not use
    on = _plan("deepseek-r1", "8xH200", num_speculative_tokens=k).deployment()
    assert tune._describe(on).endswith(f"mtp={k}") and tune._changes(on, base) >= 1


def test_capacity_options_carry_the_serving_features():
    from launcher.predict.capacity.capacity import Load, plan_capacity

    d = plan_capacity(load_model("deepseek-r1"), Load(rps=5), resolve_workload(), SLO(),
                      ["8xH200"])
    o = d["options"][0]
    s = o["serving"]
    assert s is not None and "mtp" in s and "all2all_backend" in s
    if s["mtp"]:
        assert "--speculative-config" in o["vllm_args"] and s["mtp_reason"].startswith("MTP on")
    # capacity's replica is `vlaunch plan`'s plan for the option: the same command
    from launcher.predict.search.planner import make_plan

    plan = make_plan(load_model("deepseek-r1"), parse_gpus("8xH200"),
                     workload=resolve_workload(), slo=SLO()).to_dict()
    assert o["vllm_args"] == plan["vllm_args"]
    assert o["per_replica"]["output_tokens_per_s"] == \
        plan["performance"]["knee"]["output_tokens_per_s"]


def test_measured_acceptance_feeds_the_next_plan(tmp_path, monkeypatch):
    # What `vlaunch tune` measured for a model replaces the default acceptance in its next
    # plans: first 0.70, later 0.50 -> 1 + 0.70 x (1 + 0.5 + 0.25) = 2.225 tokens at k = 3.
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path))
    assert S.acceptance(model="deepseek-r1").first == 0.81  # the table's default
    # a record of an earlier vlaunch (no source: measured on random-token prompts) is ignored
    (tmp_path / "mtp_acceptance.json").write_text('{"deepseek-r1": {"first": 0.95}}')
    assert S.acceptance(model="deepseek-r1").first == 0.81
    assert S.record_acceptance("deepseek-r1", {"first": 0.70}, source="") is None
    S.record_acceptance("deepseek-r1", {"first": 0.70, "later": 0.50, "acceptance_length": 2.2},
                        source="your --dataset chat.jsonl (40 prompts)")
    acc = S.acceptance(model="deepseek-r1")
    assert (acc.first, acc.later) == (0.70, 0.50) and "measured by vlaunch tune" in acc.source
    assert "your --dataset chat.jsonl" in acc.source
    assert acc.tokens_per_step(3) == pytest.approx(2.225)
    assert S.acceptance(0.9, model="deepseek-r1").first == 0.9  # a pin still wins
    plan = make_plan(load_model("deepseek-r1"), parse_gpus("8xH200"),
                     Pins(num_speculative_tokens=3), objective="latency")
    sp = plan.to_dict()["serving"]["speculative"]
    assert sp["acceptance"]["first"] == 0.70 and sp["tokens_per_step"] == pytest.approx(2.225)
    # a corrupt record is ignored, never trusted
    (tmp_path / "mtp_acceptance.json").write_text('{"deepseek-r1": {"first": "high"}}')
    assert S.acceptance(model="deepseek-r1").first == 0.81
