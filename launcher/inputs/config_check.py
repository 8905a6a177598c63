"""Sanity checks on a raw config.json before any shape is derived from it.

The architecture functions trust the numbers they read: a string where a count belongs ends in
a traceback deep in the planner, 0 KV heads silently becomes "as many as the attention heads"
(`x or n`), a negative layer count yields a plan for a model with no layers, and a billion
layers builds a billion tensor groups. Such a config is bad input: one line naming the key,
the value and what is accepted, exit 2. Only keys that are present are checked; a missing
required key is reported by the architecture function ("incomplete").
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import InputError

# Counts and sizes that must be whole numbers of at least 1 when given (null means "absent").
POSITIVE = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "intermediate_size",
    "moe_intermediate_size", "num_experts_per_tok", "experts_per_token",
    "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "index_n_heads", "index_head_dim", "linear_num_key_heads", "linear_key_head_dim",
    "linear_num_value_heads", "linear_value_head_dim", "linear_conv_kernel_dim",
    "moe_layer_freq", "decoder_sparse_step", "full_attention_interval",
    "sliding_window_pattern", "sliding_window", "depth", "num_heads", "patch_size",
    "spatial_merge_size", "temporal_patch_size", "image_size", "num_position_embeddings",
    "out_hidden_size", "in_channels", "num_channels",
    "intermediate_size_mlp", "attention_chunk_size", "vision_output_dim", "projector_input_dim",
    "projector_output_dim",
)
# Counts where 0 legitimately means "none" (dense models, no MTP, no shared expert).
NON_NEGATIVE = (
    "n_routed_experts", "num_local_experts", "num_experts", "n_shared_experts",
    "shared_expert_intermediate_size", "shared_intermediate_size", "first_k_dense_replace",
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "index_topk", "q_lora_rank",
    "interleave_moe_layer_step",  # Llama 4: 0 means no MoE layer
)
# Each layer becomes tensor groups: a bound keeps a nonsense config from exhausting memory.
# The deepest published decoders have a few hundred layers.
MAX_LAYERS = 4096
LAYER_KEYS = ("num_hidden_layers", "depth", "num_nextn_predict_layers", "mtp_num_hidden_layers")
# Far above any real dimension or context (10M tokens), low enough that byte counts stay
# finite as floats: JSON integers are unbounded.
MAX_SIZE = 1 << 40


# transformers' model_type values are identifiers ("deepseek_v3", "qwen3_5_moe_text"); one
# carrying anything else is printed in the plan and in errors, so it is refused (issue 31, M4).
_MODEL_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_config(cfg: dict[str, Any], name: str) -> None:
    """Raise InputError with one line when `cfg` (config.json contents) is not a model."""
    for section in (cfg, cfg.get("text_config"), cfg.get("vision_config")):
        kind = section.get("model_type") if isinstance(section, dict) else None
        if kind is not None and (not isinstance(kind, str) or not _MODEL_TYPE.match(kind)):
            _bad(name, "model_type", kind, "a name of letters, digits and _ . - "
                 "(at most 100), as transformers spells model types")
    sections = [("", cfg)]
    for sub in ("text_config", "vision_config"):
        value = cfg.get(sub)
        if value is not None and not isinstance(value, dict):
            _bad(name, sub, value, "an object")
        if value:
            sections.append((f"{sub}.", value))
    for prefix, section in sections:
        for key in POSITIVE + NON_NEGATIVE:
            value = section.get(key)
            if value is None:
                continue
            least = 1 if key in POSITIVE else 0
            if not _whole(value) or value < least:
                _bad(name, prefix + key, value,
                     "a whole number of at least 1" if least else "a whole number, 0 or more")
            limit = MAX_LAYERS if key in LAYER_KEYS else MAX_SIZE
            if value > limit:
                _bad(name, prefix + key, value, f"at most {limit:,}")
    _check_attention(cfg, name)
    _check_experts(cfg, name)
    _check_rope(cfg, name)
    _check_quantization(cfg.get("quantization_config"), name)


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bad(name: str, key: str, value: Any, accepted: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise InputError(f"config.json of {name}: {key} is {shown}; it must be {accepted}")


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys as the architecture functions see them."""
    return {**cfg, **(cfg.get("text_config") or {})}


def _check_attention(cfg: dict[str, Any], name: str) -> None:
    c = _text(cfg)
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise InputError(f"config.json of {name}: num_attention_heads {heads} is not a multiple "
                         f"of num_key_value_heads {kv}; each KV head serves a whole group of "
                         "query heads")
    hidden = c.get("hidden_size")
    if heads and hidden and c.get("head_dim") is None and hidden < heads:
        raise InputError(f"config.json of {name}: hidden_size {hidden} is smaller than "
                         f"num_attention_heads {heads} and no head_dim is given (head size 0)")


def _check_experts(cfg: dict[str, Any], name: str) -> None:
    c = _text(cfg)
    experts = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts")
    per_token = c.get("num_experts_per_tok") or c.get("experts_per_token")
    if experts and per_token and per_token > experts:
        raise InputError(f"config.json of {name}: {per_token} experts per token but only "
                         f"{experts} experts")


def _check_rope(cfg: dict[str, Any], name: str) -> None:
    for prefix, section in (("", cfg), ("text_config.", cfg.get("text_config") or {})):
        rope = section.get("rope_scaling")
        if rope is None:
            continue
        if not isinstance(rope, dict):
            _bad(name, prefix + "rope_scaling", rope, "an object or null")
        factor = rope.get("factor")
        if factor is not None and (not isinstance(factor, (int, float))
                                   or isinstance(factor, bool) or not factor > 0):
            _bad(name, prefix + "rope_scaling.factor", factor, "a number above 0")
        orig = rope.get("original_max_position_embeddings")
        if orig is not None and (not _whole(orig) or orig < 1):
            _bad(name, prefix + "rope_scaling.original_max_position_embeddings", orig,
                 "a whole number of at least 1")


def _pair(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(_whole(x) and x > 0 for x in value))


def _check_quantization(qc: Any, name: str) -> None:
    """The fields `model._quant_of` reads, with the types it needs."""
    if not qc:
        return
    if not isinstance(qc, dict):
        _bad(name, "quantization_config", qc, "an object")
    block = qc.get("weight_block_size")
    if block and not _pair(block):
        _bad(name, "quantization_config.weight_block_size", block,
             "two positive whole numbers, e.g. [128, 128]")
    for key in ("bits", "w_bit"):
        if qc.get(key) is not None and (not _whole(qc[key]) or qc[key] < 1):
            _bad(name, f"quantization_config.{key}", qc[key], "a whole number of at least 1")
    for key in ("group_size", "q_group_size"):  # GPTQ writes -1 for one group per channel
        if qc.get(key) is not None and (not _whole(qc[key]) or qc[key] == 0 or qc[key] < -1):
            _bad(name, f"quantization_config.{key}", qc[key], "a positive whole number or -1")
    groups = qc.get("config_groups")
    if groups is None:
        return
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        _bad(name, "quantization_config.config_groups", groups, "an object of objects")
    for gname, group in groups.items():
        w = group.get("weights")
        where = f"quantization_config.config_groups.{gname}.weights"
        if w is None:
            continue
        if not isinstance(w, dict):
            _bad(name, where, w, "an object")
        if w.get("num_bits") is not None and (not _whole(w["num_bits"]) or w["num_bits"] < 1):
            _bad(name, f"{where}.num_bits", w["num_bits"], "a whole number of at least 1")
        if w.get("group_size") is not None and (not _whole(w["group_size"])
                                                or w["group_size"] < 1):
            _bad(name, f"{where}.group_size", w["group_size"], "a whole number of at least 1")
        if w.get("block_structure") and not _pair(w["block_structure"]):
            _bad(name, f"{where}.block_structure", w["block_structure"],
                 "two positive whole numbers, e.g. [128, 128]")
