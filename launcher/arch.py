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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tensor:
    """A group of `count` identical tensors of shape (rows, cols)."""

    name: str
    rows: int
    cols: int = 1
    count: int = 1
    shard: str = "replicated"  # column | row | kv | vocab | replicated | expert_column | expert_row
    part: str = "norm"
    layer: int | None = None
    quant: bool = False  # a linear weight the checkpoint's quantization format covers
    dtype: str | None = None  # stored dtype when it differs from the model's (fp32 biases)
    heads: int = 0  # kv: number of KV heads, for replication once TP exceeds them
    loaded: bool = True  # False: stored in the checkpoint, not loaded by vLLM (MTP)

    @property
    def elements(self) -> int:
        return self.rows * self.cols * self.count


def _linear(name: str, out: int, inp: int, shard: str, part: str, layer: int | None,
            count: int = 1, quant: bool = True, loaded: bool = True, heads: int = 0) -> Tensor:
    return Tensor(name, out, inp, count, shard, part, layer, quant, None, heads, loaded)


def _vec(name: str, size: int, part: str, layer: int | None, count: int = 1,
         dtype: str | None = None, loaded: bool = True, shard: str = "replicated") -> Tensor:
    return Tensor(name, size, 1, count, shard, part, layer, False, dtype, 0, loaded)


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
    for j in range(mtp):  # stored as model.layers.{layers + j}; vLLM skips it without MTP
        i = layers + j
        t += [Tensor(x.name, x.rows, x.cols, x.count, x.shard, "mtp", x.layer, x.quant, x.dtype,
                     x.heads, False) for x in block(i, loaded=False)]
        t += [_linear("mtp.eh_proj", h, 2 * h, "replicated", "mtp", i, quant=False, loaded=False),
              _vec("mtp.norms", 3 * h, "mtp", i, loaded=False),
              _linear("mtp.embed_tokens", vocab, h, "vocab", "mtp", i, quant=False, loaded=False),
              _linear("mtp.head", vocab, h, "vocab", "mtp", i, quant=False, loaded=False)]
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


def _gqa_attention(c: dict[str, Any], layer: int) -> list[Tensor]:
    h, n = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    bias = bool(c.get("attention_bias")) or c.get("model_type") == "qwen2"
    t = [_linear("q_proj", n * hd, h, "column", "attention", layer),
         _linear("k_proj", kv * hd, h, "kv", "attention", layer, heads=kv),
         _linear("v_proj", kv * hd, h, "kv", "attention", layer, heads=kv),
         _linear("o_proj", h, n * hd, "row", "attention", layer)]
    if bias:
        t += [_vec("q_proj.bias", n * hd, "attention", layer, shard="column"),
              Tensor("kv_proj.bias", 2 * kv * hd, 1, 1, "kv", "attention", layer, heads=kv)]
        if c.get("model_type") == "gpt_oss":
            t.append(_vec("o_proj.bias", h, "attention", layer))
    if c.get("model_type") in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"):
        t.append(_vec("q_norm+k_norm", 2 * hd, "attention", layer))
    return t


def _moe_block(c: dict[str, Any], layer: int, experts: int, inter: int) -> list[Tensor]:
    h = c["hidden_size"]
    t = [_linear("router", experts, h, "replicated", "router", layer, quant=False),
         _linear("experts.gate_up", 2 * inter, h, "expert_column", "experts", layer,
                 count=experts),
         _linear("experts.down", h, inter, "expert_row", "experts", layer, count=experts)]
    shared = c.get("shared_expert_intermediate_size") or 0
    if shared:  # qwen2_moe style shared expert with its own sigmoid gate
        t += _dense_mlp(h, shared, layer, part="shared")
        t.append(_linear("shared_expert_gate", 1, h, "replicated", "router", layer, quant=False))
    return t


def decoder(c: dict[str, Any]) -> dict[str, Any]:
    """Llama, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE: pre-norm GQA decoders."""
    c = {**c, **(c.get("text_config") or {})}
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    n = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or n
    hd = c.get("head_dim") or h // n
    experts = c.get("num_local_experts") or c.get("num_experts") or 0
    moe_inter = c.get("moe_intermediate_size") or c.get("intermediate_size")
    sparse_step = c.get("decoder_sparse_step", 1) or 1
    dense_only = set(c.get("mlp_only_layers") or [])
    t: list[Tensor] = [_linear("embed_tokens", vocab, h, "vocab", "embed", None, quant=False)]
    for i in range(layers):
        t += _gqa_attention(c, i)
        t.append(_vec("layernorms", 2 * h, "norm", i))
        if experts and i not in dense_only and (i + 1) % sparse_step == 0:
            t += _moe_block(c, i, experts, moe_inter)
        else:
            t += _dense_mlp(h, c["intermediate_size"], i)
    t.append(_vec("norm", h, "head", None))
    if not c.get("tie_word_embeddings", False):
        t.append(_linear("lm_head", vocab, h, "vocab", "head", None, quant=False))
    return dict(
        tensors=tuple(t), num_layers=layers, hidden_size=h, num_heads=n, num_kv_heads=kv,
        head_dim=hd, vocab_size=vocab, attention="gqa", num_experts=experts,
        experts_per_token=c.get("num_experts_per_tok") or 0,
        moe_intermediate=moe_inter if experts else 0,
        intermediate_size=c.get("intermediate_size") or 0)


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
}
