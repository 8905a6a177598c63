"""Vision encoders as tensor groups: SigLIP (Gemma 3), Pixtral (Mistral 3), Qwen's ViT
(Qwen3-VL, Qwen3.5) and Llama 4's. Kept apart from the language models in arch.py: a tower is
read from vision_config alone and shared by several families.
"""

from __future__ import annotations

from typing import Any

from .tensor_group import Tensor

# --------------------------------------------------------------------------- vision towers
# Vision towers are small next to their language models (0.4-0.6 B). vLLM tensor-parallelises
# some of them (SigLIP, Qwen's ViT), but they are described here as part="vision",
# shard="replicated", layer=None (first pipeline stage): a slight over-estimate per rank.


def vision_linear(name: str, out: int, inp: int, count: int, bias: bool) -> list[Tensor]:
    t = [Tensor(name, out, inp, count, "replicated", "vision", None, quant=False)]
    if bias:
        t.append(Tensor(name + ".bias", out, 1, count, "replicated", "vision", None))
    return t


def vit_blocks(depth: int, h: int, inter: int, norms: int, bias: bool,
                gated: bool) -> list[Tensor]:
    """`depth` pre-norm ViT blocks: q/k/v/o (h x h each), an MLP (gated: gate+up+down) and
    `norms` norm vectors of h per block (LayerNorm weight+bias counts as 2)."""
    t = vision_linear("vision.qkv", 3 * h, h, depth, bias)
    t += vision_linear("vision.o", h, h, depth, bias)
    t += vision_linear("vision.fc1", (2 if gated else 1) * inter, h, depth, bias)
    t += vision_linear("vision.fc2", h, inter, depth, bias)
    t.append(Tensor("vision.norms", norms * h, 1, depth, "replicated", "vision", None))
    return t


def siglip_tower(v: dict[str, Any]) -> list[Tensor]:
    """SigLIP vision encoder (Gemma3): conv patch embedding with bias, learned position
    embedding over (image_size / patch_size)^2 patches, LayerNorm (weight+bias) x2 per block,
    biased linears, a post-LayerNorm, and an optional attention-pooling head."""
    h, inter, ch = v["hidden_size"], v["intermediate_size"], v.get("num_channels", 3)
    p = v["patch_size"]
    patches = (v["image_size"] // p) ** 2
    t = vision_linear("vision.patch_embed", h, ch * p * p, 1, True)
    t.append(Tensor("vision.position_embedding", patches, h, 1, "replicated", "vision", None))
    t += vit_blocks(v["num_hidden_layers"], h, inter, norms=4, bias=True, gated=False)
    t.append(Tensor("vision.post_layernorm", 2 * h, 1, 1, "replicated", "vision", None))
    if v.get("vision_use_head", False):  # probe + multi-head attention pooling + LN + MLP
        t.append(Tensor("vision.head.probe", h, 1, 1, "replicated", "vision", None))
        t += vision_linear("vision.head.in_proj", 3 * h, h, 1, True)
        t += vision_linear("vision.head.out_proj", h, h, 1, True)
        t.append(Tensor("vision.head.layernorm", 2 * h, 1, 1, "replicated", "vision", None))
        t += vision_linear("vision.head.fc1", inter, h, 1, True)
        t += vision_linear("vision.head.fc2", h, inter, 1, True)
    return t


def pixtral_tower(v: dict[str, Any]) -> list[Tensor]:
    """Pixtral vision encoder (Mistral3): bias-free conv patch embedding, RMSNorm ln_pre, blocks
    with two RMSNorms, bias-free attention and a gated SiLU MLP; rotary (2-D) positions, so no
    position table."""
    h, inter, ch, p = v["hidden_size"], v["intermediate_size"], v.get("num_channels", 3), \
        v["patch_size"]
    t = vision_linear("vision.patch_conv", h, ch * p * p, 1, False)
    t.append(Tensor("vision.ln_pre", h, 1, 1, "replicated", "vision", None))
    t += vit_blocks(v["num_hidden_layers"], h, inter, norms=2, bias=False, gated=True)
    return t


def qwen_vit(v: dict[str, Any]) -> list[Tensor]:
    """Qwen3-VL / Qwen3.5 vision tower: Conv3d patch embedding (temporal x patch x patch, with
    bias), learned position table, LayerNorm blocks with biased linears, and patch mergers that
    concatenate spatial_merge_size^2 neighbours and project to the LM width (one final merger,
    plus one per deepstack index with its norm after the shuffle)."""
    h, inter = v["hidden_size"], v["intermediate_size"]
    p, tp, ch = v["patch_size"], v.get("temporal_patch_size", 2), v.get("in_channels", 3)
    m = v.get("spatial_merge_size", 2)
    merged, out = h * m * m, v["out_hidden_size"]
    t = vision_linear("vision.patch_embed", h, ch * tp * p * p, 1, True)
    t.append(Tensor("vision.pos_embed", v["num_position_embeddings"], h, 1, "replicated",
                    "vision", None))
    t += vit_blocks(v["depth"], h, inter, norms=4, bias=True, gated=False)

    def merger(norm_width: int) -> list[Tensor]:
        return ([Tensor("vision.merger.norm", 2 * norm_width, 1, 1, "replicated", "vision",
                        None)]
                + vision_linear("vision.merger.fc1", merged, merged, 1, True)
                + vision_linear("vision.merger.fc2", out, merged, 1, True))

    t += merger(h)
    for _ in v.get("deepstack_visual_indexes") or []:
        t += merger(merged)
    return t


def llama4_vision(v: dict[str, Any], text_hidden: int) -> list[Tensor]:
    """Llama 4's vision encoder: an unfolded-conv patch embedding (no bias), a class token, a
    position table over (image_size / patch_size)^2 + 1 patches, LayerNorms before and after
    the blocks, biased ViT blocks, a pixel-shuffle MLP (intermediate -> projector_input_dim ->
    projector_output_dim, no biases) and the projector to the text width (vision_output_dim
    -> hidden, no bias)."""
    h, inter, ch, p = v["hidden_size"], v["intermediate_size"], v.get("num_channels", 3), \
        v["patch_size"]
    patches = (v["image_size"] // p) ** 2 + 1
    t = vision_linear("vision.patch_embedding", h, ch * p * p, 1, False)
    t += [Tensor("vision.class_embedding", h, 1, 1, "replicated", "vision", None),
          Tensor("vision.positional_embedding", patches, h, 1, "replicated", "vision", None),
          Tensor("vision.layernorm_pre+post", 4 * h, 1, 1, "replicated", "vision", None)]
    t += vit_blocks(v["num_hidden_layers"], h, inter, norms=4, bias=True, gated=False)
    pin, pout = v["projector_input_dim"], v["projector_output_dim"]
    t += vision_linear("vision.adapter.fc1", pin, inter, 1, False)
    t += vision_linear("vision.adapter.fc2", pout, pout, 1, False)
    t += vision_linear("projector.linear_1", text_hidden, v["vision_output_dim"], 1, False)
    return t
