"""The generated tiny model: DeepSeek-V3's shape rules, a true index, a working tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from launcher.run import tinymodel  # noqa: E402


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_config_keeps_deepseek_v3_rules(tiny_model: Path):
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    # The CPU MLA kernel needs a 576-wide latent.
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert cfg["topk_method"] == "noaux_tc"
    assert cfg["q_lora_rank"]
    assert cfg["num_hidden_layers"] > cfg["first_k_dense_replace"] >= 1
    assert "quantization_config" not in cfg
    assert cfg["torch_dtype"] == "bfloat16"


def test_index_total_size_is_the_true_byte_total(tiny_model: Path):
    from safetensors import safe_open

    index = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    total = 0
    seen = set()
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(tiny_model / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
                assert index["weight_map"][name] == shard
                seen.add(name)
    assert seen == set(index["weight_map"])
    assert index["metadata"]["total_size"] == total
    # Small enough to start fast.
    assert total < 64 << 20


def test_router_bias_for_every_moe_layer(tiny_model: Path):
    cfg = json.loads((tiny_model / "config.json").read_text())
    names = set(json.loads((tiny_model / "model.safetensors.index.json").read_text())["weight_map"])
    for i in range(cfg["num_hidden_layers"]):
        has_bias = f"model.layers.{i}.mlp.gate.e_score_correction_bias" in names
        assert has_bias == (i >= cfg["first_k_dense_replace"])


def test_transformers_loads_every_tensor(tiny_model: Path):
    """An independent reader (transformers' DeepseekV3) finds no missing or extra tensors."""
    transformers = pytest.importorskip("transformers")
    import torch

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model), dtype=torch.bfloat16, output_loading_info=True
    )
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]


def test_tokenizer_round_trip_and_chat_template(tiny_model: Path):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model))
    cfg = json.loads((tiny_model / "config.json").read_text())
    text = "Hello, world! Ünïcode 字 works too."
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < cfg["vocab_size"]
    assert tok.decode(ids) == text
    assert tok.eos_token_id == cfg["eos_token_id"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in chat and chat.endswith("<|assistant|>")


def test_deterministic(tmp_path: Path):
    a = tinymodel.ensure_tiny_model(tmp_path / "a")
    b = tinymodel.ensure_tiny_model(tmp_path / "b")
    assert _digest(a) == _digest(b)


def test_cached_until_generator_version_changes(tmp_path: Path, monkeypatch):
    out = tmp_path / "m"
    tinymodel.ensure_tiny_model(out)
    weights = out / "model-00001-of-00002.safetensors"
    weights.write_bytes(b"sentinel")  # a cached copy is trusted, not rewritten
    assert tinymodel.ensure_tiny_model(out) == out.resolve()
    assert weights.read_bytes() == b"sentinel"

    monkeypatch.setattr(tinymodel, "GENERATOR_VERSION", tinymodel.GENERATOR_VERSION + 1)
    tinymodel.ensure_tiny_model(out)
    assert weights.read_bytes() != b"sentinel"
    assert tinymodel.is_current(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.")]  # no temp left


def test_default_location_and_cli(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    assert tinymodel.main([]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == (tmp_path / "cache" / "models" / "tiny-deepseek-v3").resolve()
    assert (printed / "config.json").is_file()
    assert tinymodel.main(["-h"]) == 2
