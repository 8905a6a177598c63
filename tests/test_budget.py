"""The budget model from first principles: each test states the arithmetic it checks."""

from __future__ import annotations

import dataclasses
import math

import pytest

from launcher.inputs.model import Quant, load_model, spec_from_config
from launcher.predict.memory import budget as B


@pytest.fixture(scope="module")
def v3():
    return load_model("deepseek-v3")


def test_deepseek_v3_main_model_parameters(v3):
    # 2*V*H + H + L*(attn + 2H) + k*3*H*I + (L-k)*(E+S)*3*H*Im + router, from deepseek-facts §2.2:
    # 671,026,419,200 main-model params; plus MTP (13.46B) and fp8 scales = 684,531,386,000 stored.
    main = sum(t.elements for t in v3.tensors if t.loaded)
    assert main == 671_026_419_200
    assert B.param_count(v3) == 684_531_386_000


def test_deepseek_v3_loaded_bytes(v3):
    # FP8 linear weights at 1 B + 128x128-block fp32 scales + bf16 embed/head/router + fp32
    # router bias; MTP not loaded: about 673.2 GB.
    assert B.weights_bytes(v3) == pytest.approx(673.2e9, rel=1e-3)


def test_mla_bytes_per_token(v3):
    # (kv_lora_rank 512 + qk_rope 64) * 2 B * 61 layers = 70,272 B; fp8 halves it.
    assert B.kv_bytes_per_token(v3, "auto", B.Layout(tp=8)) == 576 * 2 * 61 == 70_272
    assert B.kv_bytes_per_token(v3, "fp8", B.Layout(tp=8)) == 35_136


def test_mla_cache_is_not_split_by_tp(v3):
    one = B.kv_bytes_per_token(v3, "auto", B.Layout(tp=1))
    assert all(B.kv_bytes_per_token(v3, "auto", B.Layout(tp=t)) == one for t in (2, 4, 8, 16))


def test_mla_cache_is_split_by_pp(v3):
    # 61 layers over 2 stages: [31, 30]; the limiting GPU holds 31 layers.
    assert B.pp_stages(61, 2) == [range(0, 31), range(31, 61)]
    assert B.kv_bytes_per_token(v3, "auto", B.Layout(tp=8, pp=2)) == 576 * 2 * 31


def test_deepseek_v32_sparse_layout():
    # fp8_ds_mla: 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 B; indexer 128 + 4 = 132 B.
    v32 = load_model("deepseek-v3.2")
    assert B.kv_bytes_per_token(v32, "fp8", B.Layout()) == (656 + 132) * 61 == 48_068
    assert B.kv_bytes_per_token(v32, "auto", B.Layout()) == (1152 + 132) * 61


def test_tp8_weights_per_gpu(v3):
    # Replicated q_a/kv_a/router stay whole; everything else /8: (673.15-1.13)/8 + 1.13 GB,
    # plus MLA's bf16 W_UK/W_UV made from the fp8 kv_b_proj: 61 layers x 128/8 heads x
    # (128 nope + 128 v) x 512 latent x 2 B = 61 x 4 MiB = 244 MiB.
    per_gpu = B.stage_weight_bytes(v3, B.Layout(tp=8, expert_parallel=True))[0]
    absorbed = 61 * (128 // 8) * (128 + 128) * 512 * 2
    assert absorbed == 244 * B.MiB
    assert (per_gpu - absorbed) / B.GiB == pytest.approx(79.3, abs=0.1)


def test_mla_absorbed_copies_only_for_a_quantized_kv_b_proj(v3):
    # A bf16 kv_b_proj is viewed, not copied: 4 MiB per layer only for the fp8 checkpoint.
    t = next(x for x in v3.tensors if x.name == "kv_b_proj")
    layout = B.Layout(tp=8, expert_parallel=True)
    assert B.mla_absorbed_bytes(t, v3, layout) == 4 * B.MiB
    bf16 = dataclasses.replace(v3, quant=Quant())
    assert B.mla_absorbed_bytes(t, bf16, layout) == 0


def test_dp8_ep8_replicates_attention(v3):
    # Routed experts /8, everything else whole on each rank: 93.9 GiB (deepseek-facts §2.4).
    # Plus W_UK/W_UV for all 128 heads: 61 x 128 x 256 x 512 x 2 B = 1.91 GiB.
    per_gpu = B.stage_weight_bytes(v3, B.Layout(tp=1, dp=8, expert_parallel=True))[0]
    absorbed = 61 * 128 * 256 * 512 * 2
    assert (per_gpu - absorbed) / B.GiB == pytest.approx(93.9, abs=0.1)


def _gqa(**over):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
    return spec_from_config({**cfg, **over}, name="gqa-test")


def test_gqa_kv_split_by_tp_then_replicated():
    m = _gqa()
    # 2 (K,V) * 32 layers * 8 heads * 128 dim * 2 B = 131,072 B at TP1
    assert B.kv_bytes_per_token(m, "auto", B.Layout(tp=1)) == 2 * 32 * 8 * 128 * 2
    assert B.kv_bytes_per_token(m, "auto", B.Layout(tp=4)) == 2 * 32 * 2 * 128 * 2
    # TP16 > 8 KV heads: one head per rank, replicated
    assert B.kv_bytes_per_token(m, "auto", B.Layout(tp=16)) == 2 * 32 * 1 * 128 * 2


def test_llama8b_parameters():
    # embed + head 2*128256*4096, per layer q/o 2*4096^2 + k/v 2*1024*4096 + mlp 3*4096*14336
    # + norms 2*4096, final norm 4096 = 8,030,261,248.
    m = _gqa()
    per_layer = 2 * 4096**2 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert B.param_count(m) == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248


def test_vocab_padding():
    # vLLM pads the vocab to a multiple of 64 then splits: ceil(128256/64)*64 = 128256 -> /8.
    m = _gqa(vocab_size=32001)
    head = next(t for t in m.tensors if t.name == "lm_head")
    assert B.shard_fraction(head, B.Layout(tp=8), 32001) == math.ceil(32064 / 8) / 32001


def test_requested_memory_rounds_up():
    assert B.requested_bytes(143771 * B.MiB, 0.92) == math.ceil(143771 * B.MiB * 0.92)


def test_blocks_are_whole_pages():
    page = 64 * 1152 * 61  # one MLA block: 64 tokens * 1152 B * 61 layers
    for whole in (0, 1, 10, 4739):
        for spare in (0, 1, page - 1):
            assert B.kv_blocks(whole * page + spare, page) == whole


def test_int4_and_fp8_channel_bytes():
    # int4 group 128: 0.5 B/weight + fp16 scale and 4-bit zero per 128 inputs per row.
    t = B.Tensor("w", 256, 1024, quant=True)
    q = B.Quant("int4_group", 4, 128)
    groups = 1024 // 128 * 256
    assert B.tensor_bytes(t, q, 2) == 256 * 1024 / 2 + groups * 2 + groups / 2
    # per-channel fp8: 1 B/weight + one fp32 scale per output row
    assert B.tensor_bytes(t, B.Quant("fp8_channel", 8), 2) == 256 * 1024 + 256 * 4


def test_sampler_dominates_small_models():
    # 1024 seqs * 151,936 vocab * 4 B * 9.65 copies ~ 5.6 GiB: the Qwen3-0.6B V1 start-up.
    m = _gqa(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
             num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=28)
    act = B.activation_bytes(m, B.Layout(), 8192, 1024)
    assert act == round(B.SAMPLER_LOGIT_COPIES * 1024 * 151936 * 4)


def test_cudagraph_zero_when_eager(v3):
    assert B.cudagraph_bytes(v3, B.Layout(tp=8), 1024, 8192, enforce_eager=True) == 0
    assert B.capture_sizes(1024, 8192) == 51


def test_skip_list_matches_whole_module_names():
    # modules_to_not_convert: ["gate"] keeps the router in bf16 but must not catch gate_up.
    q = B.Quant("fp8_block", 8, 0, (128, 128), skip=("gate",))
    router = B.Tensor("gate", 256, 3072, quant=False)
    experts = B.Tensor("experts.gate_up", 3072, 3072, quant=True)
    assert not B.is_quantized(router, q)
    assert B.is_quantized(experts, q)
