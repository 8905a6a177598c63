"""`make bench`: what the hybrid KV cache changes. For each hybrid config in the shared corpus,
the requests at full context one GPU's cache holds as vLLM 0.32 groups the layers, against the
same memory counted as if every layer, state layers included, cached every token in 16-token
blocks (the budget model before it knew layer kinds). Same GPU, same flags: only the cache
accounting differs."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import spec_from_config
from launcher.predict.memory import kvcache as K
from launcher.predict.search.planner import Pins, make_plan

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "validation" / "corpus"
GPUS = "1xH200"


def main() -> None:
    if not CORPUS.is_dir():
        print(f"corpus not found at {CORPUS}; skipped")
        return
    print(f"Hybrid KV cache on {GPUS} (bf16 KV, full context): requests held, hybrid vs "
          "all-full")
    print(f"{'model':<34} {'kinds':<22} {'context':>9} {'hybrid':>8} {'all-full':>9} {'x':>6}")
    for folder in sorted(CORPUS.iterdir()):
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            continue
        spec = spec_from_config(json.loads(cfg_path.read_text()), folder.name)
        plan = make_plan(spec, parse_gpus(GPUS), Pins(kv_cache_dtype="auto", speculative=False),
                         suggest=False)
        c = plan.chosen
        kinds = c.cache.get("kinds", {})
        if len(kinds) < 2 and "sliding" not in kinds or not c.fits:
            continue
        per = max(x.per_token for x in c.pool_layers if not isinstance(x, K.State))
        full = [K.FullAttention(per)] * len(c.pool_layers)  # every layer as full attention
        pool = K.build_pool(full, 16)
        blocks = c.kv_memory // pool.bytes_per_block()
        d = K.Demand(c.max_model_len, c.demand.in_flight, c.demand.state_pages)
        flat = K.capacity(pool, blocks, d).concurrency
        label = ", ".join(f"{n} {k}" for k, n in kinds.items())
        ratio = c.concurrency / flat if flat else float("inf")
        print(f"{folder.name:<34} {label:<22} {c.max_model_len:>9,} {c.concurrency:>8.2f} "
              f"{flat:>9.2f} {ratio:>5.2f}x")
    print("(the engine test tests/test_hybrid_engine.py checks the hybrid count against vLLM)")


if __name__ == "__main__":
    main()
