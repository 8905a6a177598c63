"""`make bench`: `vlaunch plan ORG/NAME` when the model is already known locally.

Two offline cases, each in a fresh temporary cache: the model in the HF cache (config.json and
safetensors headers in a snapshot, as vLLM's download leaves it, HF_HUB_OFFLINE=1), and the
model in vlaunch's own cache of an earlier Hub lookup. For each: the median wall time of the
whole command (the goal is under 0.3 s) and whether huggingface_hub was imported (it must not
be: only a lookup that reaches the network imports it). The import it avoids is timed too.
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT.parent / "shared" / "reference" / "model-configs" / \
    "meta-llama--Llama-3.1-8B-Instruct" / "config.json"
REPO = "bench-org/llama-3.1-8b"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# `vlaunch plan`, then report whether huggingface_hub was imported along the way.
PLAN = ("import sys\nfrom launcher.cli import main\n"
        f"sys.argv = ['vlaunch', 'plan', {REPO!r}, '--gpus', '1xH100', '--format', 'json',"
        " '-o', sys.argv[1]]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        "print(code, 'huggingface_hub' in sys.modules)\n")


def _config() -> dict:
    if CONFIG.is_file():
        return json.loads(CONFIG.read_text())
    return {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,  # 8B shape
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}


def _header_only_safetensors(cfg: dict) -> bytes:
    """A safetensors header with the model's real shapes (no tensor data: only headers are
    read)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    header: dict = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h]}
    for n in range(cfg["num_hidden_layers"]):
        for name, shape in (("q", [h, h]), ("k", [kv, h]), ("v", [kv, h]), ("o", [h, h]),
                            ("gate", [i, h]), ("up", [i, h]), ("down", [h, i]),
                            ("norms", [2 * h])):
            header[f"model.layers.{n}.{name}.weight"] = shape
    raw = json.dumps({k: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]}
                      for k, s in header.items()}).encode()
    return struct.pack("<Q", len(raw)) + raw


def _hf_cache(root: Path, cfg: dict) -> None:
    snap = root / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(cfg))
    (snap / "model.safetensors").write_bytes(_header_only_safetensors(cfg))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(COMMIT)


def _vlaunch_cache(root: Path, cfg: dict) -> None:
    folder = root / "hub" / REPO.replace("/", "--")
    folder.mkdir(parents=True)
    (folder / f"{COMMIT}.json").write_text(json.dumps(
        {"repo_id": REPO, "commit": COMMIT, "config": cfg,
         "params_by_dtype": {"BF16": 8_030_261_248}, "bytes": 16_060_522_496}))
    (folder / "refs.json").write_text(json.dumps({"main": COMMIT}))


def _lookup_ms(env: dict[str, str]) -> float:
    """load_model alone (config, weights metadata, ModelSpec), in one process, median of 20."""
    code = ("import statistics, time\nfrom launcher.inputs.model import load_model\n"
            "s = []\nfor _ in range(20):\n    t = time.perf_counter()\n"
            f"    load_model({REPO!r})\n    s.append(time.perf_counter() - t)\n"
            "print(statistics.median(s) * 1000)\n")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=False)
    try:
        return float(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return float("nan")


def _run(env: dict[str, str], out: Path, runs: int = 7,
         script: str = PLAN) -> tuple[float, str]:
    samples, last = [], ""
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", script, str(out)], env=env,
                           capture_output=True, text=True, check=False)
        samples.append(time.perf_counter() - t)
        last = (p.stdout.strip().splitlines() or [p.stderr.strip()[-200:]])[-1]
    return statistics.median(samples), last


def main() -> None:
    cfg = _config()
    base = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": "http://127.0.0.1:9"}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        _hf_cache(t / "hf", cfg)
        _vlaunch_cache(t / "vlaunch", cfg)
        cases = {
            "HF cache (HF_HUB_OFFLINE=1)": {**base, "HF_HUB_CACHE": str(t / "hf"),
                                            "VLAUNCH_CACHE_DIR": str(t / "empty"),
                                            "HF_HUB_OFFLINE": "1"},
            "vlaunch's Hub cache": {**base, "HF_HUB_CACHE": str(t / "no-hf"),
                                    "VLAUNCH_CACHE_DIR": str(t / "vlaunch")},
        }
        print(f"`vlaunch plan {REPO} --gpus 1xH100` (Llama-3.1-8B config), median of 7, "
              "goal under 300 ms:")
        profile, _ = _run({**base, "VLAUNCH_CACHE_DIR": str(t / "empty")}, t / "plan.json",
                          script=PLAN.replace(repr(REPO), "'llama-3.1-8b'"))
        print(f"  {'the built-in profile llama-3.1-8b':33} {profile * 1000:6.0f} ms  (reference)")
        for label, env in cases.items():
            median, last = _run(env, t / "plan.json")
            code, _, imported = last.partition(" ")
            lookup = _lookup_ms(env)
            print(f"  from {label:28} {median * 1000:6.0f} ms  exit {code}  "
                  f"huggingface_hub imported: {imported or '?'}; the lookup itself "
                  f"{lookup:.1f} ms")
        samples = []
        for _ in range(5):
            s = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import huggingface_hub.hf_api"],
                           capture_output=True, check=False)
            samples.append(time.perf_counter() - s)
        bare = statistics.median(
            [_timed([sys.executable, "-c", "pass"]) for _ in range(5)])
        print(f"  importing huggingface_hub.hf_api (only for a network lookup): "
              f"{(statistics.median(samples) - bare) * 1000:.0f} ms over a bare interpreter")


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=False)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
