"""Tensor shapes from made-up configs, checked against hand arithmetic.

Every small config below shares one text stack unless it says otherwise:
hidden h=64, 4 query heads and 2 KV heads of head_dim 16, MLP width 96, vocab 100, 2 layers.
So q/o are 64x64 (4096 each), k/v 32x64 (2048 each): 12,288 per attention block; a SwiGLU MLP
is 3 x 96 x 64 = 18,432; an embedding (or an lm_head) is 100 x 64 = 6,400.

A second, independent check instantiates the same configs in transformers on the meta device
(no memory, no weights) and compares the state-dict sizes.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from launcher.errors import InputError
from launcher.inputs.arch import Tensor, layer_kinds
from launcher.inputs.model import ModelSpec, spec_from_config
from launcher.predict.memory.budget import Layout, param_count, shard_fraction

TEXT: dict[str, Any] = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=96, vocab_size=100,
                            num_hidden_layers=2, rms_norm_eps=1e-6)

LLAMA = dict(TEXT, model_type="llama", tie_word_embeddings=False)

# tie_word_embeddings=False at the top: transformers' Mistral3Config defaults it to True there,
# while vLLM (and launcher.inputs.arch) read only text_config's flag (default False).
MISTRAL3 = dict(
    model_type="mistral3", spatial_merge_size=2, multimodal_projector_bias=False,
    tie_word_embeddings=False,
    vision_feature_layer=-1, projector_hidden_act="gelu",
    text_config=dict(TEXT, model_type="mistral"),
    vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=2, head_dim=16, patch_size=4,
                       image_size=32, num_channels=3))

GEMMA3 = dict(
    model_type="gemma3", mm_tokens_per_image=4,
    text_config=dict(TEXT, model_type="gemma3_text", sliding_window=8),
    vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=2, patch_size=4, image_size=16,
                       num_channels=3, vision_use_head=False))

GPT_OSS = dict(TEXT, model_type="gpt_oss", intermediate_size=32, num_local_experts=4,
               num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"])

MINIMAX = dict(TEXT, model_type="minimax_m2", intermediate_size=32, num_local_experts=4,
               num_experts_per_tok=2, use_qk_norm=True, qk_norm_type="per_layer",
               use_routing_bias=True, rotary_dim=8, tie_word_embeddings=False,
               attn_type_list=[1, 1])

QWEN3_5 = dict(
    model_type="qwen3_5", tie_word_embeddings=False,
    text_config=dict(TEXT, model_type="qwen3_5_text", num_hidden_layers=4,
                     full_attention_interval=2, linear_num_key_heads=2,
                     linear_key_head_dim=8, linear_num_value_heads=4,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4, attn_output_gate=True,
                     mtp_num_hidden_layers=1, tie_word_embeddings=False),
    vision_config=dict(model_type="qwen3_5", hidden_size=32, intermediate_size=48, depth=2,
                       num_heads=2, patch_size=4, temporal_patch_size=2, in_channels=3,
                       num_position_embeddings=16, spatial_merge_size=2, out_hidden_size=64,
                       deepstack_visual_indexes=[]))

# The families added for Hub ids, on the same small text stack (token ids inside the vocabulary:
# transformers' defaults point past 100 for some of them).
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
PHI3 = dict(TEXT, **IDS, model_type="phi3", tie_word_embeddings=False)
GRANITE = dict(TEXT, **IDS, model_type="granite", tie_word_embeddings=True,
               embedding_multiplier=12.0, residual_multiplier=0.22,
               attention_multiplier=0.0078, logits_scaling=8.0)
OLMO2 = dict(TEXT, **IDS, model_type="olmo2", tie_word_embeddings=False)
COHERE = dict(TEXT, **IDS, model_type="cohere", use_qk_norm=True, layer_norm_eps=1e-5)
COHERE2 = dict(TEXT, **IDS, model_type="cohere2", sliding_window=8, sliding_window_pattern=2,
               layer_norm_eps=1e-5)
GLM4_MOE = dict(TEXT, **IDS, model_type="glm4_moe", num_hidden_layers=3, first_k_dense_replace=1,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=32, attention_bias=True, use_qk_norm=True,
                partial_rotary_factor=0.5, num_nextn_predict_layers=1, n_group=1,
                topk_group=1, tie_word_embeddings=False)
LLAMA4_TEXT = dict(TEXT, **IDS, model_type="llama4_text", num_hidden_layers=4, num_local_experts=4,
                   num_experts_per_tok=1, interleave_moe_layer_step=2, intermediate_size=32,
                   intermediate_size_mlp=96, attention_chunk_size=8, use_qk_norm=True,
                   no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=False)
LLAMA4 = dict(
    model_type="llama4", tie_word_embeddings=False, text_config=LLAMA4_TEXT, **IDS,
    vision_config=dict(model_type="llama4_vision_model", hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=2, patch_size=4, image_size=16,
                       num_channels=3, vision_output_dim=40, projector_input_dim=40,
                       projector_output_dim=40, pixel_shuffle_ratio=0.5))


def _spec(cfg: dict[str, Any]) -> ModelSpec:
    return spec_from_config(cfg, name="tiny")


def _named(spec: ModelSpec, name: str) -> list[Tensor]:
    return [t for t in spec.tensors if t.name == name]


# ----------------------------------------------------------------------------- totals by hand


def test_llama_count() -> None:
    # per layer 12,288 attention + 2 x 64 norms + 18,432 MLP = 30,848; x2 = 61,696;
    # + embedding 6,400 + lm_head 6,400 + final norm 64 = 74,560
    assert param_count(_spec(LLAMA)) == 74_560


def test_tied_embeddings_drop_the_head() -> None:
    tied = _spec(dict(LLAMA, tie_word_embeddings=True))
    assert not _named(tied, "lm_head")
    assert param_count(_spec(LLAMA)) - param_count(tied) == 100 * 64


def test_qwen2_has_qkv_bias() -> None:
    # q bias 64 + k/v biases 2 x 32 = 128 per layer, x2 layers
    qwen2 = _spec(dict(LLAMA, model_type="qwen2"))
    assert param_count(qwen2) - param_count(_spec(LLAMA)) == 2 * 128


def test_mistral3_count() -> None:
    # text: as the Llama case, 74,560.
    # Pixtral (width 32): patch conv 32 x 3 x 4 x 4 = 1,536 (no bias), ln_pre 32;
    #   per block q/k/v/o 4 x 32 x 32 = 4,096, gated MLP 3 x 48 x 32 = 4,608, 2 norms 64
    #   = 8,768; x2 = 17,536.
    # projector: norm 32, patch merger 32 x (32 x 2 x 2) = 4,096, linear_1 64 x 32 = 2,048,
    #   linear_2 64 x 64 = 4,096 = 10,272 (no biases).
    # 74,560 + 1,536 + 32 + 17,536 + 10,272 = 103,936
    spec = _spec(MISTRAL3)
    assert param_count(spec) == 103_936
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.hidden_size) == (2, 2, 16, 64)


def test_mistral_small_3_1_published_size() -> None:
    # Mistral-Small-3.1-24B (transformers' Mistral3Config defaults):
    # text: embed + head 2 x 131,072 x 5,120 = 1,342,177,280; per layer q/o 2 x 4,096 x 5,120
    #   + k/v 2 x 1,024 x 5,120 = 52,428,800, MLP 3 x 32,768 x 5,120 = 503,316,480,
    #   norms 10,240 -> 555,755,520 x 40 = 22,230,220,800; + norm 5,120 = 23,572,403,200
    #   (the Devstral-Small-2507 index total / 2).
    # vision: conv 1,024 x 3 x 14 x 14 = 602,112; ln_pre 1,024; per block 4 x 1,024^2
    #   + 3 x 4,096 x 1,024 + 2,048 = 16,779,264, x24 = 402,702,336; projector 1,024
    #   + 1,024 x 4,096 + 5,120 x 1,024 + 5,120^2 = 35,652,608 -> 438,958,080.
    # total 24,011,361,280
    cfg = dict(
        model_type="mistral3", spatial_merge_size=2, multimodal_projector_bias=False,
        text_config=dict(model_type="mistral", hidden_size=5120, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=32768,
                         num_hidden_layers=40, vocab_size=131072),
        vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, head_dim=64,
                           patch_size=14, image_size=1540, num_channels=3))
    assert param_count(_spec(cfg)) == 24_011_361_280


def test_gemma3_count() -> None:
    # text (tied: no lm_head): embed 6,400; per layer 12,288 + q/k norms 2 x 16 + 4 norms
    #   4 x 64 + 18,432 = 31,008, x2 = 62,016; final norm 64 -> 68,480.
    # SigLIP (width 32): conv 32 x 3 x 4 x 4 + 32 bias = 1,568; positions (16/4)^2 x 32 = 512;
    #   per block q/k/v/o 4,096 + 128 bias, fc1 1,536 + 48, fc2 1,536 + 32, 2 LayerNorms 128
    #   = 7,504, x2 = 15,008; post-LayerNorm 64 -> 17,152.
    # projector: RMSNorm 32 + 32 x 64 = 2,080.   Total 87,712
    spec = _spec(GEMMA3)
    assert param_count(spec) == 87_712
    assert not _named(spec, "lm_head")


def test_gpt_oss_count() -> None:
    # per layer: attention 12,288 + biases 64 + 32 + 32 + 64 + 4 sinks = 12,484; norms 128;
    #   router 4 x 64 + 4 bias = 260; 4 experts x (gate_up 64 x 64 + 64 bias
    #   + down 64 x 32 + 64 bias) = 25,088 -> 37,960, x2 = 75,920; + 6,400 x 2 + 64 = 88,784
    spec = _spec(GPT_OSS)
    assert param_count(spec) == 88_784
    assert (spec.num_experts, spec.experts_per_token, spec.moe_intermediate) == (4, 2, 32)


def test_minimax_m2_count() -> None:
    # per layer: attention 12,288 + q_norm 4 x 16 + k_norm 2 x 16 = 12,384; norms 128;
    #   router 4 x 64 + routing bias 4; 4 experts x (64 x 64 + 64 x 32) = 24,576 -> 37,348;
    #   x2 = 74,696; + 12,864 = 87,560 (MTP never counted: published files store none)
    assert param_count(_spec(MINIMAX)) == 87_560


def test_minimax_lightning_layers_are_refused() -> None:
    with pytest.raises(InputError, match="attn_type_list"):
        _spec(dict(MINIMAX, attn_type_list=[0, 1]))


def test_qwen3_5_count() -> None:
    # layers 0, 2 Gated DeltaNet (interval 2): conv channels 2 x 2 x 8 + 4 x 8 = 64;
    #   in_proj_qkv 64 x 64 = 4,096, z 32 x 64 = 2,048, b+a 2 x 4 x 64 = 512, conv 64 x 4 = 256,
    #   dt_bias 4, A_log 4, norm 8, out 64 x 32 = 2,048 -> 8,976.
    # layers 1, 3 full attention with output gate: q 2 x 64 x 64 = 8,192 + k/v 4,096 + o 4,096
    #   + q/k norms 32 = 16,416.
    # each layer also 2 norms 128 + MLP 18,432 = 18,560.
    # stack 2 x 27,536 + 2 x 34,976 = 125,024; + 12,864 -> 137,888
    # MTP: fc 64 x 128 = 8,192, 3 norms 192, one full layer 34,976 -> 43,360
    # ViT (width 32): conv 32 x 3 x 2 x 4 x 4 + 32 = 3,104; positions 16 x 32 = 512; blocks
    #   2 x 7,504 = 15,008; merger LayerNorm 64 + 128 x 128 + 128 + 64 x 128 + 64 = 24,832
    #   -> 43,456.     Total 137,888 + 43,360 + 43,456 = 224,704
    spec = _spec(QWEN3_5)
    assert param_count(spec) == 224_704
    assert sum(t.elements for t in spec.tensors if t.part == "mtp") == 43_360
    assert spec.mtp_layers == 1 and spec.num_layers == 4


# ----------------------------------------------------------------------------- vLLM metadata


def test_vision_and_mtp_placement() -> None:
    for cfg in (MISTRAL3, GEMMA3, QWEN3_5):
        vision = [t for t in _spec(cfg).tensors if t.part == "vision"]
        assert vision
        assert all(t.shard == "replicated" and t.layer is None and not t.quant for t in vision)
    mtp = [t for t in _spec(QWEN3_5).tensors if t.part == "mtp"]
    assert mtp and not any(t.loaded for t in mtp)
    assert all(t.layer == 4 for t in mtp)  # stored after the 4 decoder layers


def test_fp32_tensors() -> None:
    q = _spec(QWEN3_5)
    assert {t.dtype for t in q.tensors if t.name in ("linear_attn.A_log", "linear_attn.norm")} \
        == {"float32"}
    m = _spec(MINIMAX)
    assert {t.dtype for t in m.tensors if t.part == "router"} == {"float32"}


def test_kv_heads_limit_kv_sharding() -> None:
    # k_proj of 2 KV heads: TP8 cannot split it below one head per rank -> 1/2 per rank
    spec = _spec(MINIMAX)
    k = _named(spec, "k_proj")[0]
    k_norm = _named(spec, "k_norm")[0]
    assert (k.heads, k_norm.heads) == (2, 2)
    assert shard_fraction(k, Layout(tp=8), spec.vocab_size) == 0.5
    sinks = _named(_spec(GPT_OSS), "sinks")[0]
    assert shard_fraction(sinks, Layout(tp=4), 100) == 0.25


def test_mxfp4_quantizes_expert_matrices_only() -> None:
    cfg = dict(GPT_OSS, quantization_config={"quant_method": "mxfp4"})
    spec = _spec(cfg)
    assert {t.name for t in spec.tensors if t.quant and t.part == "experts"} \
        == {"experts.gate_up", "experts.down"}
    assert not any(t.quant for t in spec.tensors if t.name.endswith(".bias"))


def test_layer_kinds() -> None:
    assert layer_kinds(GPT_OSS) == ("sliding", "full")
    assert layer_kinds(QWEN3_5) == ("linear", "full", "linear", "full")
    # Gemma 2 without layer_types: even layers slide; Gemma 3: every 6th layer is global
    assert layer_kinds(dict(TEXT, model_type="gemma2", num_hidden_layers=4)) \
        == ("sliding", "full", "sliding", "full")
    kinds = layer_kinds(dict(TEXT, model_type="gemma3_text", num_hidden_layers=12))
    assert [i for i, k in enumerate(kinds) if k == "full"] == [5, 11]
    assert layer_kinds(LLAMA) == ("full", "full")


# ----------------------------------------------------------------------------- errors


def test_unknown_model_type_gets_a_generic_decoder_estimate() -> None:
    generic = _spec(dict(LLAMA, model_type="brand_new_lm"))
    assert generic.estimate == "generic"
    assert param_count(generic) == param_count(_spec(LLAMA))
    assert _spec(LLAMA).estimate == "architecture"


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "vocab_size", "intermediate_size"])
def test_generic_estimate_refusal_names_the_missing_field(field: str) -> None:
    cfg = {k: v for k, v in dict(LLAMA, model_type="mamba2").items() if k != field}
    with pytest.raises(InputError, match=f"model_type 'mamba2' .* has no {field} for a generic"):
        _spec(cfg)


def test_incomplete_config_is_an_input_error() -> None:
    broken = dict(MISTRAL3, vision_config={"hidden_size": 32})
    with pytest.raises(InputError, match="incomplete for mistral3"):
        _spec(broken)


# ----------------------------------------------------------------------------- transformers


def _hf_count(cfg: dict[str, Any]) -> int:
    """State-dict elements of the transformers model built from `cfg` on the meta device,
    minus a tied lm_head (transformers lists the shared matrix under both names)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    args = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **args)
    auto = (transformers.AutoModelForImageTextToText if "vision_config" in cfg
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(config)
    state = model.state_dict()
    total = sum(v.numel() for v in state.values())
    head = model.get_output_embeddings().weight
    if head is model.get_input_embeddings().weight:
        total -= head.numel()
    return total


@pytest.mark.parametrize("cfg", [LLAMA, MISTRAL3, GEMMA3, GPT_OSS, MINIMAX, QWEN3_5, PHI3,
                                 GRANITE, OLMO2, COHERE, COHERE2, GLM4_MOE, LLAMA4_TEXT,
                                 LLAMA4],
                         ids=lambda c: c["model_type"])
def test_matches_transformers(cfg: dict[str, Any]) -> None:
    spec = _spec(cfg)
    # transformers does not build Qwen3.5's MTP block (vLLM does, for speculative decoding)
    ours = sum(t.elements for t in spec.tensors if t.part != "mtp")
    assert ours == _hf_count(cfg)


# ----------------------------------------------------------------------------- published sizes
# config.json fields of the published checkpoints (written from the model cards' config.json;
# none of these is vendored under ../shared) and the total parameter counts their authors
# publish. Published totals leave out stored-but-not-loaded MTP layers (GLM-4.5: 355B, 358B
# with its MTP layer), so the vLLM-loaded elements are compared, within 1%.

_L4_TEXT = dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192,
                intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128, vocab_size=202048, num_local_experts=16,
                num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192,
                max_position_embeddings=10485760, use_qk_norm=True, tie_word_embeddings=False)
_L4_VISION = dict(hidden_size=1408, intermediate_size=5632, num_hidden_layers=34,
                  num_attention_heads=16, patch_size=14, image_size=336, num_channels=3,
                  vision_output_dim=4096, projector_input_dim=4096, projector_output_dim=4096,
                  pixel_shuffle_ratio=0.5)
_GLM45 = dict(model_type="glm4_moe", hidden_size=5120, intermediate_size=12288,
              moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96,
              num_key_value_heads=8, head_dim=128, n_routed_experts=160, n_shared_experts=1,
              num_experts_per_tok=8, first_k_dense_replace=3, vocab_size=151552,
              attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=1,
              max_position_embeddings=131072, tie_word_embeddings=False)
PUBLISHED = {
    # meta-llama/Llama-4-Scout-17B-16E-Instruct: 109B total, 17B active
    "Llama-4-Scout": (dict(model_type="llama4", text_config=_L4_TEXT, vision_config=_L4_VISION),
                      109e9),
    # meta-llama/Llama-4-Maverick-17B-128E-Instruct: 400B total (MoE every other layer)
    "Llama-4-Maverick": (dict(model_type="llama4", vision_config=_L4_VISION,
                              text_config=dict(_L4_TEXT, num_local_experts=128,
                                               interleave_moe_layer_step=2)), 400e9),
    # zai-org/GLM-4.5: 355B total, 32B active
    "GLM-4.5": (_GLM45, 355e9),
    # zai-org/GLM-4.5-Air: 106B total, 12B active
    "GLM-4.5-Air": (dict(_GLM45, hidden_size=4096, intermediate_size=10944,
                         moe_intermediate_size=1408, num_hidden_layers=46, n_routed_experts=128,
                         first_k_dense_replace=1, use_qk_norm=False), 106e9),
    # microsoft/phi-4: 14.7B
    "phi-4": (dict(model_type="phi3", hidden_size=5120, intermediate_size=17920,
                   num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                   vocab_size=100352, max_position_embeddings=16384,
                   tie_word_embeddings=False), 14.7e9),
    # microsoft/Phi-3-mini-4k-instruct: 3.8B
    "Phi-3-mini": (dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                        vocab_size=32064, max_position_embeddings=4096,
                        tie_word_embeddings=False), 3.8e9),
    # ibm-granite/granite-3.1-8b-instruct: 8.17B (safetensors total on the Hub)
    "granite-3.1-8b": (dict(model_type="granite", hidden_size=4096, intermediate_size=12800,
                            num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                            vocab_size=49155, max_position_embeddings=131072,
                            tie_word_embeddings=True), 8.17e9),
    # CohereForAI/c4ai-command-r-v01: 35B
    "command-r": (dict(model_type="cohere", hidden_size=8192, intermediate_size=22528,
                       num_hidden_layers=40, num_attention_heads=64, num_key_value_heads=64,
                       vocab_size=256000, max_position_embeddings=131072), 35e9),
    # CohereForAI/c4ai-command-r-plus: 104B (GQA, q/k LayerNorms)
    "command-r-plus": (dict(model_type="cohere", hidden_size=12288, intermediate_size=33792,
                            num_hidden_layers=64, num_attention_heads=96, num_key_value_heads=8,
                            vocab_size=256000, max_position_embeddings=131072,
                            use_qk_norm=True), 104e9),
    # allenai/OLMo-2-1124-7B and -13B: 7.3B and 13.7B
    "OLMo-2-7B": (dict(model_type="olmo2", hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=100352, max_position_embeddings=4096,
                       tie_word_embeddings=False), 7.3e9),
    "OLMo-2-13B": (dict(model_type="olmo2", hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        vocab_size=100352, max_position_embeddings=4096,
                        tie_word_embeddings=False), 13.7e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_size(name: str) -> None:
    cfg, published = PUBLISHED[name]
    spec = spec_from_config(cfg, name=name)
    assert spec.estimate == "architecture"
    loaded = sum(t.elements for t in spec.tensors if t.loaded)
    assert loaded == pytest.approx(published, rel=0.01)


def test_glm45_mtp_layer_is_stored_not_loaded() -> None:
    spec = spec_from_config(_GLM45, name="GLM-4.5")
    mtp = [t for t in spec.tensors if t.part == "mtp"]
    assert mtp and not any(t.loaded for t in mtp)
    # one MTP layer: a full MoE decoder block plus its own embedding and head copies
    assert sum(t.elements for t in mtp) > 2 * 151552 * 5120
    assert spec.mtp_layers == 1


def test_llama4_kinds_and_moe_interleave() -> None:
    maverick = PUBLISHED["Llama-4-Maverick"][0]
    kinds = layer_kinds(maverick)
    # every fourth layer is a global (NoPE) layer, the rest attend within 8,192-token chunks
    assert [i for i, k in enumerate(kinds) if k == "full"] == list(range(3, 48, 4))
    assert set(kinds) == {"full", "chunked"}
    spec = spec_from_config(maverick, name="maverick")
    moe_layers = {t.layer for t in spec.tensors if t.part == "experts"}
    assert moe_layers == set(range(1, 48, 2))


def test_cohere2_sliding_pattern() -> None:
    kinds = layer_kinds(dict(COHERE2, num_hidden_layers=8, sliding_window_pattern=4))
    assert [i for i, k in enumerate(kinds) if k == "full"] == [3, 7]


@pytest.mark.parametrize(("cfg", "key", "bad"), [
    (LLAMA4, "text_config.intermediate_size_mlp", 0),
    (LLAMA4, "text_config.interleave_moe_layer_step", -1),
    (LLAMA4, "vision_config.projector_input_dim", "40"),
    (GLM4_MOE, "n_shared_experts", -1),
])
def test_new_family_fields_are_checked(cfg: dict[str, Any], key: str, bad: Any) -> None:
    import copy

    broken = copy.deepcopy(cfg)
    *path, last = key.split(".")
    section = broken
    for p in path:
        section = section[p]
    section[last] = bad
    with pytest.raises(InputError, match=re.escape(key)):
        _spec(broken)
