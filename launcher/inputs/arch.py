"""Architectures: from a config.json to the tensors a checkpoint stores.

Each architecture function returns the shapes the budget model needs and a tuple of `Tensor`
groups. A group is one tensor shape repeated `count` times (e.g. 256 experts of one layer), with
the way vLLM shards it across ranks:

- column: output rows split by tensor parallelism (q_proj, gate/up, kv_b_proj);
- row: input columns split by TP (o_proj, down_proj);
- kv: GQA k/v projections; split by KV heads until TP exceeds them, then replicated;
- vocab: vocab-parallel embedding / lm_head, padded to a multiple of 64 per vLLM;
- replicated: every rank holds a full copy (norms, routers, MLA's down-projections);
- expert: one routed expert's matrix; split by TP, or whole experts spread over EP ranks.

`part` says what a tensor belongs to (attention, mlp, experts, shared, router, embed, head, norm,
indexer, vision, mtp) so data-parallel attention can replicate the right pieces; `layer` places
it in a pipeline stage (None: embedding side for embed/vision, last stage for head).

KV fields (num_kv_heads, head_dim, num_layers) describe the attention layers; `layer_kinds`
says which layers cache a sliding window, a chunk or a recurrent state instead of every token
(launcher/predict/memory/kvcache.py sizes each kind as vLLM does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .cache_layout import CacheLayout, cache_layout, layer_kinds
from .cache_layout import merged_config as _merged
from .tensor_group import Tensor
from .tensor_group import linear as _linear
from .tensor_group import vec as _vec
from .vision_towers import llama4_vision as _llama4_vision
from .vision_towers import pixtral_tower as _pixtral_tower
from .vision_towers import qwen_vit as _qwen_vit
from .vision_towers import siglip_tower as _siglip_tower
from .vision_towers import vision_linear as _vision_linear

__all__ = ["ARCHITECTURES", "CacheLayout", "Tensor", "cache_layout", "decoder", "layer_kinds"]


# --------------------------------------------------------------------------- DeepSeek / MLA


def _mla_attention(c: dict[str, Any], layer: int, loaded: bool = True) -> list[Tensor]:
    h, n = c["hidden_size"], c["num_attention_heads"]
    qlr, klr = c.get("q_lora_rank"), c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    t: list[Tensor] = []
    if qlr:
        t += [_linear("q_a_proj", qlr, h, "replicated", "attention", layer, loaded=loaded),
              _vec("q_a_layernorm", qlr, "attention", layer, loaded=loaded),
              _linear("q_b_proj", n * (nope + rope), qlr, "column", "attention", layer,
                      loaded=loaded)]
    else:
        t.append(_linear("q_proj", n * (nope + rope), h, "column", "attention", layer,
                         loaded=loaded))
    t += [_linear("kv_a_proj_with_mqa", klr + rope, h, "replicated", "attention", layer,
                  loaded=loaded),
          _vec("kv_a_layernorm", klr, "attention", layer, loaded=loaded),
          _linear("kv_b_proj", n * (nope + v), klr, "column", "attention", layer, loaded=loaded),
          _linear("o_proj", h, n * v, "row", "attention", layer, loaded=loaded)]
    if c.get("index_topk"):  # DeepSeek-V3.2 sparse-attention indexer
        ih, idim = c["index_n_heads"], c["index_head_dim"]
        t += [_linear("indexer.wq_b", ih * idim, qlr, "replicated", "indexer", layer,
                      loaded=loaded),
              _linear("indexer.wk", idim, h, "replicated", "indexer", layer, loaded=loaded),
              _linear("indexer.weights_proj", ih, h, "replicated", "indexer", layer,
                      quant=False, loaded=loaded),
              _vec("indexer.k_norm", 2 * idim, "indexer", layer, loaded=loaded)]
    return t


def _deepseek_moe(c: dict[str, Any], layer: int, loaded: bool = True) -> list[Tensor]:
    h, im = c["hidden_size"], c["moe_intermediate_size"]
    e, s = c["n_routed_experts"], c.get("n_shared_experts") or 0
    t = [_linear("gate", e, h, "replicated", "router", layer, quant=False, loaded=loaded),
         _linear("experts.gate_up", 2 * im, h, "expert_column", "experts", layer, count=e,
                 loaded=loaded),
         _linear("experts.down", h, im, "expert_row", "experts", layer, count=e, loaded=loaded)]
    if c.get("topk_method") == "noaux_tc":
        t.append(_vec("e_score_correction_bias", e, "router", layer, dtype="float32",
                      loaded=loaded))
    if s:
        t += [_linear("shared.gate_up", 2 * im * s, h, "column", "shared", layer, loaded=loaded),
              _linear("shared.down", h, im * s, "row", "shared", layer, loaded=loaded)]
    return t


def _dense_mlp(h: int, inter: int, layer: int, part: str = "mlp", loaded: bool = True,
               bias: bool = False) -> list[Tensor]:
    t = [_linear("mlp.gate_up", 2 * inter, h, "column", part, layer, loaded=loaded),
         _linear("mlp.down", h, inter, "row", part, layer, loaded=loaded)]
    if bias:
        t += [_vec("mlp.gate_up.bias", 2 * inter, part, layer, loaded=loaded, shard="column"),
              _vec("mlp.down.bias", h, part, layer, loaded=loaded)]
    return t


def _nextn_layers(block: Callable[..., list[Tensor]], layers: int, mtp: int, h: int,
                  vocab: int) -> list[Tensor]:
    """DeepSeek-style MTP layers, stored as model.layers.{layers + j}: a decoder block, eh_proj
    over [embedding; hidden], three norms, and their own embedding and head copies. vLLM loads
    them only for MTP speculative decoding, so they are stored-but-not-loaded."""
    t: list[Tensor] = []
    for j in range(mtp):
        i = layers + j
        t += [Tensor(x.name, x.rows, x.cols, x.count, x.shard, "mtp", x.layer, x.quant, x.dtype,
                     x.heads, False) for x in block(i, loaded=False)]
        t += [_linear("mtp.eh_proj", h, 2 * h, "replicated", "mtp", i, quant=False, loaded=False),
              _vec("mtp.norms", 3 * h, "mtp", i, loaded=False),
              _linear("mtp.embed_tokens", vocab, h, "vocab", "mtp", i, quant=False, loaded=False),
              _linear("mtp.head", vocab, h, "vocab", "mtp", i, quant=False, loaded=False)]
    return t


def deepseek(c: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V2-Lite/V3/R1/V3.1/V3.2 and Kimi-K2: MLA attention, DeepSeekMoE."""
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    k = c.get("first_k_dense_replace", 0)
    freq = c.get("moe_layer_freq", 1) or 1
    mtp = int(c.get("num_nextn_predict_layers") or 0)
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]

    def block(i: int, loaded: bool = True) -> list[Tensor]:
        out = _mla_attention(c, i, loaded)
        out.append(_vec("layernorms", 2 * h, "norm", i, loaded=loaded))
        moe = c.get("n_routed_experts") and i >= k and i % freq == 0
        out += _deepseek_moe(c, i, loaded) if moe else _dense_mlp(h, c["intermediate_size"], i,
                                                                  loaded=loaded)
        return out

    for i in range(layers):
        t += block(i)
    t += [_vec("norm", h, "head", None),
          _linear("lm_head", vocab, h, "vocab", "head", None, quant=False)]
    t += _nextn_layers(block, layers, mtp, h, vocab)
    sparse = bool(c.get("index_topk"))
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h,
        num_heads=c["num_attention_heads"], num_kv_heads=1,
        head_dim=c["kv_lora_rank"] + c["qk_rope_head_dim"], vocab_size=vocab,
        attention="mla_sparse" if sparse else "mla", kv_lora_rank=c["kv_lora_rank"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        index_head_dim=c.get("index_head_dim", 0) if sparse else 0,
        num_experts=c.get("n_routed_experts") or 0,
        experts_per_token=c.get("num_experts_per_tok") or 0,
        moe_intermediate=c.get("moe_intermediate_size") or 0,
        intermediate_size=c.get("intermediate_size") or 0, mtp_layers=mtp)


# --------------------------------------------------------------------------- GQA decoders


def _tied(c: dict[str, Any], default: bool) -> bool:
    """Whether lm_head shares the embedding. `default` is the transformers config class default
    for the architecture (True for Gemma, False for Llama-style models) when the key is absent.

    A tied model is counted WITHOUT an lm_head tensor. Some checkpoints store the copy anyway
    (Qwen3-0.6B) and the config cannot tell; vLLM loads one matrix either way.
    """
    value = c.get("tie_word_embeddings")
    return default if value is None else bool(value)


def _gqa_attention(c: dict[str, Any], layer: int, *, qkv_bias: bool | None = None,
                   o_bias: bool = False, qk_norm: str = "", q_gate: bool = False,
                   loaded: bool = True, part: str = "attention") -> list[Tensor]:
    """q/k/v/o projections of grouped-query attention, with the optional pieces.

    qk_norm: "" (none), "head" (one RMSNorm weight of head_dim each for q and k: Qwen3, Gemma3,
    Qwen3.5) or "full" (over all heads: MiniMax-M2, n*hd for q and kv*hd for k; vLLM splits
    these by head). q_gate: q_proj also emits a per-head output gate (Qwen3.5 attn_output_gate),
    doubling its rows.
    """
    h, n = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    if qkv_bias is None:
        qkv_bias = bool(c.get("attention_bias")) or c.get("model_type") == "qwen2"
    q_rows = n * hd * (2 if q_gate else 1)
    t = [Tensor("q_proj", q_rows, h, 1, "column", part, layer, True, None, 0, loaded),
         Tensor("k_proj", kv * hd, h, 1, "kv", part, layer, True, None, kv, loaded),
         Tensor("v_proj", kv * hd, h, 1, "kv", part, layer, True, None, kv, loaded),
         Tensor("o_proj", h, n * hd, 1, "row", part, layer, True, None, 0, loaded)]
    if qkv_bias:
        t += [_vec("q_proj.bias", q_rows, part, layer, loaded=loaded, shard="column"),
              Tensor("kv_proj.bias", 2 * kv * hd, 1, 1, "kv", part, layer, heads=kv,
                     loaded=loaded)]
    if o_bias:  # added once after the all-reduce, so every rank holds it whole
        t.append(_vec("o_proj.bias", h, part, layer, loaded=loaded))
    if qk_norm == "head":
        t.append(_vec("q_norm+k_norm", 2 * hd, part, layer, loaded=loaded))
    elif qk_norm == "full":
        t += [_vec("q_norm", n * hd, part, layer, loaded=loaded, shard="column"),
              Tensor("k_norm", kv * hd, 1, 1, "kv", part, layer, heads=kv, loaded=loaded)]
    return t


def _moe_block(c: dict[str, Any], layer: int, experts: int, inter: int,
               loaded: bool = True, part_prefix: str = "") -> list[Tensor]:
    h = c["hidden_size"]
    t = [Tensor("router", experts, h, 1, "replicated", "router", layer, False, None, 0, loaded),
         Tensor("experts.gate_up", 2 * inter, h, experts, "expert_column", "experts", layer,
                True, None, 0, loaded),
         Tensor("experts.down", h, inter, experts, "expert_row", "experts", layer, True, None,
                0, loaded)]
    shared = c.get("shared_expert_intermediate_size") or 0
    if shared:  # qwen2_moe style shared expert with its own sigmoid gate
        t += _dense_mlp(h, shared, layer, part="shared", loaded=loaded)
        t.append(Tensor("shared_expert_gate", 1, h, 1, "replicated", "router", layer, False,
                        None, 0, loaded))
    return t


def _head(c: dict[str, Any], h: int, vocab: int, tied_default: bool) -> list[Tensor]:
    """Final norm, and lm_head unless the embedding is tied."""
    t = [_vec("norm", h, "head", None)]
    if not _tied(c, tied_default):
        t.append(_linear("lm_head", vocab, h, "vocab", "head", None, quant=False))
    return t


def decoder(c: dict[str, Any]) -> dict[str, Any]:
    """Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE, Phi-3/Phi-4 (fused qkv and
    gate_up, the same elements), Granite (multipliers, no extra weights), OLMo 2 (q/k RMSNorms
    over all heads, norms after attention and MLP instead of before): pre-norm GQA decoders.
    Also the generic estimate for a model_type the tables do not know."""
    c = _merged(c)
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    experts = c.get("num_local_experts") or c.get("num_experts") or 0
    moe_inter = c.get("moe_intermediate_size") or c.get("intermediate_size")
    sparse_step = c.get("decoder_sparse_step", 1) or 1
    dense_only = set(c.get("mlp_only_layers") or [])
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmo2": "full"}.get(
        str(c.get("model_type")), "")
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _gqa_attention(c, i, qk_norm=qk_norm)
        t.append(_vec("layernorms", 2 * h, "norm", i))
        if experts and i not in dense_only and (i + 1) % sparse_step == 0:
            t += _moe_block(c, i, experts, moe_inter)
        else:
            t += _dense_mlp(h, c["intermediate_size"], i)
    t += _head(c, h, vocab, tied_default=False)
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa", num_experts=experts,
        experts_per_token=c.get("num_experts_per_tok") or 0,
        moe_intermediate=moe_inter if experts else 0,
        intermediate_size=c.get("intermediate_size") or 0)


# --------------------------------------------------------------------------- Gemma 2 / 3


def gemma(c: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2, Gemma 3 (text-only gemma3_text, or gemma3 with its SigLIP tower): GQA with
    four RMSNorms per layer (pre/post attention, pre/post MLP), GeGLU MLP, embeddings tied by
    default. Gemma 3 adds per-head q/k norms; its multimodal projector is one
    (vision hidden x text hidden) matrix after an RMSNorm over the vision width."""
    text = _merged(c)
    h, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    n = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or n
    hd = text.get("head_dim") or h // n
    qk_norm = "head" if str(text.get("model_type", "")).startswith("gemma3") else ""
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _gqa_attention(text, i, qk_norm=qk_norm)
        t.append(_vec("layernorms", 4 * h, "norm", i))
        t += _dense_mlp(h, text["intermediate_size"], i)
    t += _head(text, h, vocab, tied_default=True)
    vision = c.get("vision_config")
    if vision and c.get("text_config"):
        t += _siglip_tower(vision)
        vh = vision["hidden_size"]
        t += [Tensor("mm_soft_emb_norm", vh, 1, 1, "replicated", "vision", None),
              Tensor("mm_input_projection", vh, h, 1, "replicated", "vision", None)]
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa",
        intermediate_size=text["intermediate_size"])


# --------------------------------------------------------------------------- Mistral 3


def mistral3(c: dict[str, Any]) -> dict[str, Any]:
    """Mistral 3 (Mistral-Small-3.1/3.2, Magistral, Devstral-2 vision builds): a Mistral text
    decoder under text_config, a Pixtral vision tower and a projector made of an RMSNorm over the
    vision width, a patch merger (spatial_merge_size^2 patches concatenated -> vision width,
    no bias) and a two-layer GELU MLP (vision x layers -> text hidden -> text hidden, biased
    when multimodal_projector_bias)."""
    # vLLM builds the language model from text_config alone, so only its tie flag counts
    # (MistralConfig default: untied); transformers' Mistral3Config has its own top-level one.
    out = decoder({k: v for k, v in c.items() if k != "tie_word_embeddings"})
    v = c["vision_config"]
    vh, th = v["hidden_size"], out["hidden_size"]
    m = c.get("spatial_merge_size", 2)
    feature = c.get("vision_feature_layer", -1)
    feeds = len(feature) if isinstance(feature, list) else 1
    bias = bool(c.get("multimodal_projector_bias", False))
    t = _pixtral_tower(v)
    t.append(Tensor("projector.norm", vh, 1, 1, "replicated", "vision", None))
    t += _vision_linear("projector.patch_merger", vh, vh * m * m, 1, False)
    t += _vision_linear("projector.linear_1", th, vh * feeds, 1, bias)
    t += _vision_linear("projector.linear_2", th, th, 1, bias)
    out["tensors"] = out["tensors"] + tuple(t)
    return out


# --------------------------------------------------------------------------- gpt-oss


def gpt_oss(c: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: GQA with q/k/v/o biases and one learned attention-sink logit per head,
    a biased router and biased SwiGLU experts (MXFP4 in the checkpoint, quantized experts only).

    Counts are logical elements (one per FP4 value); MXFP4's e8m0 scales are not counted, as in
    the published 20.9 B / 116.8 B totals. Bytes come from budget.tensor_bytes (0.5 B per value
    plus one scale byte per 32).
    """
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    e, inter = c["num_local_experts"], c["intermediate_size"]
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _gqa_attention(c, i, qkv_bias=True, o_bias=True)
        t.append(_vec("sinks", n, "attention", i, shard="column"))
        t.append(_vec("layernorms", 2 * h, "norm", i))
        t += [_linear("router", e, h, "replicated", "router", i, quant=False),
              _vec("router.bias", e, "router", i),
              _linear("experts.gate_up", 2 * inter, h, "expert_column", "experts", i, count=e),
              Tensor("experts.gate_up.bias", 2 * inter, 1, e, "expert_column", "experts", i),
              _linear("experts.down", h, inter, "expert_row", "experts", i, count=e),
              # down bias: whole per expert (TP adds it once), counted like the expert matrix
              Tensor("experts.down.bias", h, 1, e, "expert_row", "experts", i)]
    t += _head(c, h, vocab, tied_default=False)
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa", num_experts=e,
        experts_per_token=c.get("num_experts_per_tok") or c.get("experts_per_token") or 0,
        moe_intermediate=inter, intermediate_size=0)


# --------------------------------------------------------------------------- MiniMax-M2


def minimax_m2(c: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M2 / M2.x: GQA with q/k RMSNorm over all heads (qk_norm_type per_layer) or per
    head, sigmoid router kept in FP32 with an FP32 routing bias, SwiGLU experts (block-FP8 in
    the published checkpoints), optional shared expert.

    MTP: the config advertises use_mtp / num_mtp_modules, but the published M2.x checkpoints
    store no MTP tensors, and nothing in the config says whether they are stored; they are not
    counted.
    """
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    e, inter = c["num_local_experts"], c["intermediate_size"]
    if any(int(x) != 1 for x in c.get("attn_type_list") or []):
        raise ValueError("attn_type_list (only full-attention layers, type 1, are supported)")
    qk_norm = ""
    if c.get("use_qk_norm"):
        qk_norm = "full" if c.get("qk_norm_type", "per_layer") == "per_layer" else "head"
    shared = c.get("shared_intermediate_size") or 0
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _gqa_attention(c, i, qkv_bias=False, qk_norm=qk_norm)
        t.append(_vec("layernorms", 2 * h, "norm", i))
        t += [Tensor("gate", e, h, 1, "replicated", "router", i, False, "float32"),
              _linear("experts.gate_up", 2 * inter, h, "expert_column", "experts", i, count=e),
              _linear("experts.down", h, inter, "expert_row", "experts", i, count=e)]
        if c.get("use_routing_bias"):
            t.append(_vec("e_score_correction_bias", e, "router", i, dtype="float32"))
        if shared:
            t += _dense_mlp(h, shared, i, part="shared")
    t += _head(c, h, vocab, tied_default=False)
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa", num_experts=e,
        experts_per_token=c.get("num_experts_per_tok") or 0, moe_intermediate=inter,
        intermediate_size=0)


# --------------------------------------------------------------------------- Cohere Command-R


def cohere(c: dict[str, Any]) -> dict[str, Any]:
    """Cohere Command-R / R+ (cohere) and Command R7B / Command A (cohere2): one LayerNorm
    (weight only) before attention and MLP, which run in parallel; q/k LayerNorms of shape
    (heads, head_dim) when use_qk_norm (R+); embeddings tied by default (CohereConfig).
    Cohere2's sliding-window layers are described by layer_kinds."""
    c = _merged(c)
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    qk_norm = "full" if c.get("use_qk_norm") else ""
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _gqa_attention(c, i, qk_norm=qk_norm)
        t.append(_vec("input_layernorm", h, "norm", i))
        t += _dense_mlp(h, c["intermediate_size"], i)
    t += _head(c, h, vocab, tied_default=True)
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa",
        intermediate_size=c["intermediate_size"])


# --------------------------------------------------------------------------- GLM-4.5 MoE


def glm4_moe(c: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5 / 4.6 / 4.5-Air (glm4_moe): GQA with q/k/v biases (attention_bias) and optional
    per-head q/k RMSNorms (use_qk_norm), first_k_dense_replace dense layers, then DeepSeekMoE
    layers (sigmoid router with an FP32 e_score_correction_bias, always present in vLLM's
    Glm4MoE, and n_shared_experts shared experts), and DeepSeek-style MTP layers stored after
    the decoder (num_nextn_predict_layers)."""
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    k = c.get("first_k_dense_replace", 0) or 0
    mtp = int(c.get("num_nextn_predict_layers") or 0)
    qk_norm = "head" if c.get("use_qk_norm") else ""
    moe = {**c, "topk_method": "noaux_tc"}
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]

    def block(i: int, loaded: bool = True) -> list[Tensor]:
        out = _gqa_attention(c, i, qkv_bias=bool(c.get("attention_bias")), qk_norm=qk_norm,
                             loaded=loaded)
        out.append(_vec("layernorms", 2 * h, "norm", i, loaded=loaded))
        if c.get("n_routed_experts") and i >= k:
            out += _deepseek_moe(moe, i, loaded)
        else:
            out += _dense_mlp(h, c["intermediate_size"], i, loaded=loaded)
        return out

    for i in range(layers):
        t += block(i)
    t += _head(c, h, vocab, tied_default=False)
    t += _nextn_layers(block, layers, mtp, h, vocab)
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa",
        num_experts=c.get("n_routed_experts") or 0,
        experts_per_token=c.get("num_experts_per_tok") or 0,
        moe_intermediate=c.get("moe_intermediate_size") or 0,
        intermediate_size=c.get("intermediate_size") or 0, mtp_layers=mtp)


# --------------------------------------------------------------------------- Llama 4


def llama4(c: dict[str, Any]) -> dict[str, Any]:
    """Llama 4 Scout / Maverick (llama4 with its vision tower, llama4_text): GQA with weightless
    L2 q/k norms, chunked attention on RoPE layers (layer_kinds), MoE every
    interleave_moe_layer_step-th layer (a router, routed SwiGLU experts of intermediate_size and
    one shared expert of the same width), dense layers of intermediate_size_mlp between."""
    text = _merged(c)
    h, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    n = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or n
    hd = text.get("head_dim") or h // n
    experts = text.get("num_local_experts") or 0
    step = text.get("interleave_moe_layer_step", 1) or 0
    inter = text["intermediate_size"]
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _gqa_attention(text, i, qkv_bias=bool(text.get("attention_bias")))
        t.append(_vec("layernorms", 2 * h, "norm", i))
        if experts and step > 0 and (i + 1) % step == 0:
            t += [_linear("router", experts, h, "replicated", "router", i, quant=False),
                  _linear("experts.gate_up", 2 * inter, h, "expert_column", "experts", i,
                          count=experts),
                  _linear("experts.down", h, inter, "expert_row", "experts", i, count=experts)]
            t += _dense_mlp(h, inter, i, part="shared")
        else:
            t += _dense_mlp(h, text.get("intermediate_size_mlp") or inter, i)
    t += _head(text, h, vocab, tied_default=False)
    if c.get("vision_config") and c.get("text_config"):
        t += _llama4_vision(c["vision_config"], h)
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa", num_experts=experts,
        experts_per_token=text.get("num_experts_per_tok") or 0,
        moe_intermediate=inter if experts else 0,
        intermediate_size=text.get("intermediate_size_mlp") or inter)


# --------------------------------------------------------------------------- Qwen3.5 hybrid


def _gated_deltanet(c: dict[str, Any], layer: int) -> list[Tensor]:
    """A Gated DeltaNet (linear attention) mixer, as Qwen3-Next / Qwen3.5 store it.

    With kh key heads of kd, vh value heads of vd: in_proj_qkv (2*kh*kd + vh*vd rows), in_proj_z
    (output gate, vh*vd), in_proj_b / in_proj_a (one beta / decay input per value head), a
    depthwise causal conv1d over the q/k/v channels (kernel taps each), dt_bias and A_log per
    value head, a gated RMSNorm of vd, out_proj back to hidden. vLLM splits all per-head pieces
    by TP (column); the norm is shared. A_log and the norm are FP32 in the checkpoints.
    """
    h = c["hidden_size"]
    kh, kd = c["linear_num_key_heads"], c["linear_key_head_dim"]
    vh, vd = c["linear_num_value_heads"], c["linear_value_head_dim"]
    conv = 2 * kh * kd + vh * vd
    return [_linear("linear_attn.in_proj_qkv", conv, h, "column", "attention", layer),
            _linear("linear_attn.in_proj_z", vh * vd, h, "column", "attention", layer),
            _linear("linear_attn.in_proj_ba", 2 * vh, h, "column", "attention", layer),
            Tensor("linear_attn.conv1d", conv, c["linear_conv_kernel_dim"], 1, "column",
                   "attention", layer),
            _vec("linear_attn.dt_bias", vh, "attention", layer, shard="column"),
            _vec("linear_attn.A_log", vh, "attention", layer, dtype="float32", shard="column"),
            _vec("linear_attn.norm", vd, "attention", layer, dtype="float32"),
            _linear("linear_attn.out_proj", h, vh * vd, "row", "attention", layer)]


def _qwen3_5_layer(c: dict[str, Any], layer: int, full: bool, loaded: bool = True
                   ) -> list[Tensor]:
    h = c["hidden_size"]
    experts = c.get("num_experts") or 0
    if full:
        t = _gqa_attention(c, layer, qk_norm="head", q_gate=bool(c.get("attn_output_gate")),
                           loaded=loaded)
    else:
        t = _gated_deltanet(c, layer)
    t.append(_vec("layernorms", 2 * h, "norm", layer, loaded=loaded))
    if experts and layer not in set(c.get("mlp_only_layers") or []):
        t += _moe_block(c, layer, experts, c["moe_intermediate_size"], loaded=loaded)
    else:
        t += _dense_mlp(h, c["intermediate_size"], layer, loaded=loaded)
    return t


def qwen3_next(c: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next: Qwen3.5's layer plan (gated delta-net with a full-attention layer every
    full_attention_interval, gated attention output, MoE with a gated shared expert) in an
    earlier config: the attention output gate is always on and there is no vision tower."""
    return qwen3_5({**c, "attn_output_gate": c.get("attn_output_gate", True)})


def qwen3_5(c: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 / Qwen3.6 (dense and MoE): Gated DeltaNet layers with a full-attention layer
    every full_attention_interval (gated q, per-head q/k norms), Qwen3-Next style MoE with a
    gated shared expert, a Qwen ViT, and MTP layers stored under mtp.* (an fc over
    [embedding; hidden] after two RMSNorms, full-attention decoder layers, a final norm; the
    embedding and lm_head are shared unless mtp_use_dedicated_embeddings). vLLM loads MTP only
    for speculative decoding, so it is stored-but-not-loaded.

    KV fields describe the full-attention layers; num_layers counts all decoder layers (the
    pipeline split needs them); layer_kinds tells the cache which layers hold a state instead.
    """
    text = _merged(c)
    h, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    n = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or n
    hd = text.get("head_dim") or h // n
    kinds = layer_kinds(c)
    experts = text.get("num_experts") or 0
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _qwen3_5_layer(text, i, kinds[i] == "full")
    t += _head(text, h, vocab, tied_default=False)
    if c.get("vision_config"):
        t += _qwen_vit(c["vision_config"])
    mtp = int(text.get("mtp_num_hidden_layers") or 0)
    if mtp:
        first = layers
        t += [_linear("mtp.fc", h, 2 * h, "column", "mtp", first, quant=False, loaded=False),
              _vec("mtp.norms", 3 * h, "mtp", first, loaded=False)]
        if text.get("mtp_use_dedicated_embeddings"):
            t.append(_linear("mtp.embed_tokens", vocab, h, "vocab", "mtp", first, quant=False,
                             loaded=False))
        for j in range(mtp):
            t += [Tensor(x.name, x.rows, x.cols, x.count, x.shard, "mtp", x.layer, x.quant,
                         x.dtype, x.heads, False)
                  for x in _qwen3_5_layer(text, layers + j, True, loaded=False)]
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa", num_experts=experts,
        experts_per_token=text.get("num_experts_per_tok") or 0,
        moe_intermediate=(text.get("moe_intermediate_size") or 0) if experts else 0,
        intermediate_size=text.get("intermediate_size") or 0, mtp_layers=mtp)


ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "deepseek_v2": deepseek,
    "deepseek_v3": deepseek,
    "deepseek_v32": deepseek,
    "kimi_k2": deepseek,
    "llama": decoder,
    "mistral": decoder,
    "qwen2": decoder,
    "qwen3": decoder,
    "mixtral": decoder,
    "qwen3_moe": decoder,
    "qwen2_moe": decoder,
    "mistral3": mistral3,
    "gemma2": gemma,
    "gemma3": gemma,
    "gemma3_text": gemma,
    "gpt_oss": gpt_oss,
    "minimax_m2": minimax_m2,
    "qwen3_next": qwen3_next,
    "qwen3_5": qwen3_5,
    "qwen3_5_text": qwen3_5,
    "qwen3_5_moe": qwen3_5,
    "qwen3_5_moe_text": qwen3_5,
    "phi3": decoder,
    "granite": decoder,
    "olmo2": decoder,
    "cohere": cohere,
    "cohere2": cohere,
    "glm4_moe": glm4_moe,
    "llama4": llama4,
    "llama4_text": llama4,
}
