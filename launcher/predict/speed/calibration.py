"""What `vlaunch tune` measured, kept so later plans predict from it.

One record per engine configuration: model, GPU, count, layout, KV dtype and vLLM version (the
key), the measured points (concurrency, lengths, output tokens/s, TPOT, TTFT) and the
performance model's fixed, decode and prefill scales refitted to them at record time. A plan for the
same key says `source: measured`; a plan for another layout of the same model on the same
hardware and vLLM version borrows the scales (the engine's software overheads carry over, the
shapes are recomputed). Stored beside the capability lessons, written atomically.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from ...deployment.plan import Deployment
from ...paths import cache_dir, read_json_object, report_corrupt, update_json_object
from . import request_model as perf


def _store() -> Path:
    return cache_dir() / "calibration.json"


def _load() -> dict[str, Any]:
    return read_json_object(_store())


def family(model: str, gpu: str, vllm_version: str) -> str:
    """What a calibration carries over within: one model on one GPU kind and vLLM release."""
    return f"{model}|{gpu}|{vllm_version}"


def key(model: str, gpu: str, count: int, tp: int, pp: int, dp: int, ep: bool, kv_dtype: str,
        vllm_version: str) -> str:
    return (f"{family(model, gpu, vllm_version)}|{count}|tp{tp}pp{pp}dp{dp}"
            f"{'ep' if ep else ''}|{kv_dtype}")


def plan_key(d: Deployment) -> str:
    p, g = d.engine.parallel, d.hardware
    return key(d.model.name, g.name, g.count, p.tp, p.pp, p.dp, p.expert_parallel,
               d.pool.kv_cache.dtype, d.vllm_version)


def record(d: Deployment, points: list[dict[str, Any]], source: str,
           shape: perf.EngineShape | None) -> Path:
    """Add measured points for the engine of plan `d`, refit its scales, save atomically.
    `shape` is that engine as the performance model sees it (planshape.shape_from_plan; None:
    no speed facts, the points are kept unfitted)."""
    k = plan_key(d)
    engine = {"max_num_seqs": d.engine.max_num_seqs,
              "max_num_batched_tokens": d.engine.max_num_batched_tokens}

    def add(data: dict[str, Any]) -> None:
        # Merged with what is on disk now, under the cache's lock: another tune's points for
        # this engine, recorded meanwhile, are kept. A corrupt old entry starts afresh.
        entry = data.get(k)
        if not (isinstance(entry, dict) and isinstance(entry.get("points"), list)
                and all(isinstance(p, dict) for p in entry["points"])):
            entry = {"points": []}
        # Points of one layout from engines with other batch limits stay apart: the limits are
        # part of each point, and the fit replays every point on its own engine's limits.
        entry["points"] = _merge(entry["points"], [engine | p for p in points])
        entry.update(family=family(d.model.name, d.hardware.name, d.vllm_version),
                     source=source,
                     recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        cal = perf.calibrate(shape, entry["points"]) if shape else None
        if cal:
            entry.update(fixed_scale=cal.fixed_scale, roofline_scale=cal.roofline_scale,
                         prefill_scale=cal.prefill_scale, request_scale=cal.request_scale,
                         median_error=cal.median_error,
                         median_error_uncalibrated=cal.uncalibrated_error,
                         fit_loss=cal.loss, fit_loss_uncalibrated=cal.loss_uncalibrated)
        data[k] = entry

    return update_json_object(_store(), add)


def _merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Newer points replace older ones at the same concurrency and lengths."""
    def ident(p: dict[str, Any]) -> tuple:
        return (p.get("concurrency"), p.get("input_len"), p.get("output_len"),
                p.get("max_num_seqs"), p.get("max_num_batched_tokens"))

    merged = {ident(p): p for p in old}
    merged.update({ident(p): p for p in new})
    return sorted(merged.values(), key=lambda p: (p.get("concurrency") or 0))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _usable(k: str, entry: Any) -> bool:
    """A fitted record whose fields have the types `record` writes. Anything else is reported
    and skipped: the planner would scale every step time by it."""
    if not (isinstance(entry, dict) and entry.get("fixed_scale") is not None):
        return False  # points recorded without a fit yet: nothing to use, nothing wrong
    ok = (all(_number(entry.get(f)) and entry[f] > 0 for f in ("fixed_scale", "roofline_scale"))
          and all(_number(entry.get(f, 1.0)) and entry.get(f, 1.0) >= 0
                  for f in ("prefill_scale", "request_scale", "median_error",
                            "median_error_uncalibrated", "fit_loss", "fit_loss_uncalibrated"))
          and isinstance(entry.get("points", []), list)
          and all(isinstance(entry.get(f, ""), str) for f in ("family", "recorded_at")))
    if not ok:
        report_corrupt(_store(), f"entry {k!r} has a missing or non-numeric scale")
    return ok


def lookup(k: str) -> dict[str, Any] | None:
    """The record of exactly this engine, if any."""
    entry = _load().get(k)
    return entry if _usable(k, entry) else None


def lookup_family(fam: str) -> tuple[str, dict[str, Any]] | None:
    """Some record of the same model, GPU and vLLM release (the most recent), if any."""
    hits = [(k, v) for k, v in _load().items()
            if isinstance(v, dict) and v.get("family") == fam and _usable(k, v)]
    if not hits:
        return None
    return max(hits, key=lambda kv: kv[1].get("recorded_at", ""))
