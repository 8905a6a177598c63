"""What a config says about the KV cache beyond the attention shapes: the kind of each decoder
layer (full, sliding window, chunked, linear state) and the sizes those kinds need.
predict/memory/kvcache.py turns them into vLLM's cache specs; arch.py describes the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def merged_config(c: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys overlaid by text_config: multimodal configs keep the LM's keys there."""
    return {**c, **(c.get("text_config") or {})}


def layer_kinds(cfg: dict[str, Any]) -> tuple[str, ...]:
    """Cache kind of each decoder layer: "full", "sliding", "chunked" or "linear".

    Where vLLM reads it: ``layer_types`` when the config has it (llama.py, gemma3.py,
    gpt_oss.py, qwen3_next.py); Gemma 2 alternates from a sliding first layer; Gemma 3 without
    layer_types has one full layer every sliding_window_pattern; a Mistral ``sliding_window``
    with no layer_types windows every layer (Attention takes cache_config.sliding_window);
    Llama 4 attends chunk-locally on every RoPE layer (llama4.py: not nope and
    attention_chunk_size); Qwen2's sliding switch; full_attention_interval for linear hybrids.
    launcher/predict/memory/kvcache.py turns the kinds into cache specs.
    """
    c = merged_config(cfg)
    layers = int(c["num_hidden_layers"])
    names = {"full_attention": "full", "sliding_attention": "sliding",
             "linear_attention": "linear", "chunked_attention": "chunked"}
    mt = str(c.get("model_type", ""))
    if c.get("layer_types"):
        return tuple(names.get(x, "full") for x in c["layer_types"][:layers])
    if mt == "gemma2":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    if mt.startswith("gemma3") or mt == "cohere2":
        every = int(c.get("sliding_window_pattern") or (4 if mt == "cohere2" else 6))
        return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))
    if mt.startswith("llama4") and c.get("attention_chunk_size"):
        nope = c.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(layers)]
        return tuple("chunked" if nope[i] else "full" for i in range(layers))
    if c.get("full_attention_interval"):
        every = int(c["full_attention_interval"])
        return tuple("full" if (i + 1) % every == 0 else "linear" for i in range(layers))
    if c.get("sliding_window") and c.get("use_sliding_window"):  # Qwen2-style switch
        return ("sliding",) * layers
    if mt in ("mistral", "mixtral") and c.get("sliding_window"):
        return ("sliding",) * layers
    return ("full",) * layers


@dataclass(frozen=True)
class CacheLayout:
    """What the KV cache needs from a config beyond the attention shapes: each layer's kind,
    the window / chunk sizes, and the gated delta-net state dims (key heads, key dim, value
    heads, value dim, conv kernel) with the dtype the checkpoint asks for its SSM state."""

    kinds: tuple[str, ...]
    window: int = 0
    chunk: int = 0
    linear: tuple[int, int, int, int, int] | None = None
    ssm_dtype: str | None = None  # mamba_ssm_dtype (Qwen3.5); None: the model dtype


def cache_layout(cfg: dict[str, Any]) -> CacheLayout:
    c = merged_config(cfg)
    kinds = layer_kinds(cfg)
    linear = None
    if "linear" in kinds:
        linear = (int(c["linear_num_key_heads"]), int(c["linear_key_head_dim"]),
                  int(c["linear_num_value_heads"]), int(c["linear_value_head_dim"]),
                  int(c["linear_conv_kernel_dim"]))
    return CacheLayout(kinds, int(c.get("sliding_window") or 0),
                       int(c.get("attention_chunk_size") or 0), linear,
                       c.get("mamba_ssm_dtype"))
