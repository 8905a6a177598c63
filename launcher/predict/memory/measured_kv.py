"""KV memory that vLLM measured on an earlier boot: ground truth for the next plan of that setup.

vLLM 0.32 persists its measured KV-cache memory when `VLLM_ENABLE_STARTUP_PLAN=1`, one JSON
file per worker under `VLLM_CACHE_ROOT/startup_plan/`, keyed by a fingerprint of its own
config that only vLLM can compute (the GPU worker writes it; the CPU worker does not). After a
successful start `vlaunch serve` reads the files vLLM's log names and records the smallest
value (every rank gets the smallest block count) under vlaunch's own key: the plan's decisions.
A later plan that makes the same decisions uses the measured bytes instead of the budget
model's estimate, and says so.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from ...deployment.plan import Deployment
from ...paths import (
    cache_dir,
    loads_json,
    read_json_object,
    read_small_text,
    report_corrupt,
    update_json_object,
)


def plan_key(d: Deployment) -> str:
    """A digest of everything a measured KV size depends on, from a plan (the same digest
    as before plans were typed: recorded rows keep their keys)."""
    m, g, e = d.model, d.hardware, d.engine
    p = e.parallel
    factors = {
        "model": m.path or m.hf_id, "quantization": m.quantization,
        "gpu": [g.name, g.count, g.nodes, g.total_bytes],
        "parallel": {"tp": p.tp, "pp": p.pp, "dp": p.dp, "expert_parallel": p.expert_parallel},
        "kv_dtype": d.pool.kv_cache.dtype, "gpu_memory_utilization": e.gpu_memory_utilization,
        "max_model_len": e.max_model_len, "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens, "enforce_eager": e.enforce_eager,
        "vllm_version": d.vllm_version,
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:20]


def _store() -> Path:
    return cache_dir() / "measured.json"


def _load() -> dict[str, Any]:
    return read_json_object(_store())


def lookup(key: str) -> dict[str, Any] | None:
    """The recorded measurement for this plan key, if any. A row of the wrong types (a bool or
    a negative byte count, text where a number belongs) is reported and not used: the plan
    would size the KV cache from it."""
    row = _load().get(key)
    if row is None:
        return None
    kv = row.get("kv_cache_memory_bytes") if isinstance(row, dict) else None
    if (isinstance(kv, int) and not isinstance(kv, bool) and kv > 0
            and all(isinstance(row.get(k, ""), str) for k in ("source", "recorded_at"))):
        return row
    report_corrupt(_store(), f"entry {key!r} has no positive integer kv_cache_memory_bytes")
    return None


def record(d: Deployment, kv_bytes: int, source: str) -> Path:
    """Remember vLLM's measured KV bytes for the plan `d` (atomically, under a lock: concurrent
    runs each keep their measurement)."""
    row = {"kv_cache_memory_bytes": int(kv_bytes), "source": source,
           "predicted_bytes": d.pool.kv_cache.memory_bytes,
           "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    key = plan_key(d)

    def add(data: dict[str, Any]) -> None:
        data[key] = row

    return update_json_object(_store(), add)


def read_startup_plans(paths: list[str]) -> int | None:
    """The smallest `kv_cache_memory_bytes` in vLLM's startup-plan files (None if unreadable)."""
    values = []
    for p in paths:
        try:
            value = loads_json(read_small_text(p)).get("kv_cache_memory_bytes")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            values.append(value)
    return min(values) if values else None
