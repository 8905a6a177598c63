"""The metric families vlaunch exports, computed from one scrape's inputs (pure).

Why apart from the exporter: what a family means (its name, help, labels, and when a series is
left out instead of frozen) is the contract with dashboards and alerts; reading it should not
need the fetching, caching and threading around it. Each function takes what one scrape saw
and yields prometheus_client families.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..deployment.plan import Deployment
from .gpus import GpuRecord
from .vllmpage import VllmSnapshot

PLAN_COMPONENTS = {
    "weights": "weights_bytes",
    "activation": "activation_bytes",
    "cudagraph": "cudagraph_bytes",
    "non_torch": "non_torch_bytes",
    "kv_cache": "kv_cache_bytes",
}


@dataclass
class ActualNumbers:
    """What vLLM logged at start-up, handed over by `vlaunch serve` (per engine, per GPU)."""

    kv_tokens: int | None = None
    kv_memory_bytes: int | None = None
    weights_bytes: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None

    @property
    def capacity_tokens(self) -> int | None:
        if self.kv_tokens:
            return self.kv_tokens
        if self.num_blocks and self.block_size:
            return self.num_blocks * self.block_size
        return None


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    """Add a sample with its own label set (add_metric insists on the family's full set)."""
    family.add_sample(family.name, labels, value)


def _num(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _positive(v: float | None) -> float | None:
    return v if v is not None and v > 0 else None


def engine_families(
    plan: Deployment | None, snap: VllmSnapshot | None, actual: ActualNumbers, restarts: int,
    starting: bool,
) -> Iterator[Metric]:
    """Engine up/starting, restarts, and the KV cache per engine next to the plan's numbers."""
    if snap is not None:
        yield GaugeMetricFamily(
            "vlaunch_engine_up",
            "1 if vLLM's /metrics answered with the KV usage gauge on the last scrape, else 0.",
            value=1.0 if snap.ok else 0.0,
        )
        yield GaugeMetricFamily(
            "vlaunch_engine_starting",
            "1 while vLLM has not answered since it was (re)started and is within its "
            "start-up deadline (loading weights, compiling): engine_up 0 is expected then.",
            value=1.0 if starting else 0.0,
        )
    yield CounterMetricFamily(
        "vlaunch_engine_restarts",
        "Engine restarts: done by vlaunch serve, or seen as a new vLLM process start time.",
        value=restarts,
    )
    usage = GaugeMetricFamily(
        "vlaunch_kv_cache_usage_ratio",
        "Fraction of the KV cache in use (vllm:kv_cache_usage_perc), 0..1, per engine.",
        labels=["engine"],
    )
    used = GaugeMetricFamily(
        "vlaunch_kv_cache_used_tokens",
        "KV cache tokens in use: usage ratio x actual capacity, per engine.",
        labels=["engine"],
    )
    capacity = GaugeMetricFamily(
        "vlaunch_kv_cache_capacity_tokens",
        "KV cache capacity in tokens per engine: planned by vlaunch or actual from vLLM.",
        labels=["source", "engine"],
    )
    cap_bytes = GaugeMetricFamily(
        "vlaunch_kv_cache_capacity_bytes",
        "KV cache memory per GPU in bytes: planned by vlaunch or actual from vLLM.",
        labels=["source", "engine"],
    )
    concurrency = GaugeMetricFamily(
        "vlaunch_kv_cache_max_concurrency",
        "Requests of max_model_len tokens the KV cache holds at once, per engine.",
        labels=["source", "engine"],
    )
    error = GaugeMetricFamily(
        "vlaunch_prediction_error_ratio",
        "(actual - planned) / planned for the planner's predictions.",
        labels=["quantity", "engine"],
    )
    # Planned and per-GPU series have no `engine` label (the plan is the same for every
    # engine); Prometheus allows label sets to differ within a family.
    pool = plan.pool if plan is not None else None
    planned_tokens = _positive(pool.kv_cache.tokens) if pool else None
    planned_bytes = _positive(pool.per_gpu.kv_cache_bytes or pool.kv_cache.memory_bytes) \
        if pool else None
    planned_conc = _positive(pool.max_concurrency) if pool else None
    max_model_len = _positive(pool.engine.max_model_len) if pool else None
    if planned_tokens:
        _add(capacity, {"source": "planned"}, planned_tokens)
    if planned_bytes:
        _add(cap_bytes, {"source": "planned"}, planned_bytes)
    if planned_conc:
        _add(concurrency, {"source": "planned"}, planned_conc)
    planned_weights = _positive(pool.per_gpu.weights_bytes) if pool else None
    if planned_weights and actual.weights_bytes:
        _add(error, {"quantity": "weights"},
             (actual.weights_bytes - planned_weights) / planned_weights)
    # Engine-derived series exist only while the engine answers: dropped, never frozen.
    if snap is not None and snap.ok:
        for engine, s in sorted(snap.engines.items()):
            tokens = s.capacity_tokens or actual.capacity_tokens
            kv_bytes = s.capacity_bytes or actual.kv_memory_bytes
            conc = s.max_concurrency
            if conc is None and tokens and max_model_len:
                conc = tokens / max_model_len
            if s.usage_ratio is not None:
                usage.add_metric([engine], s.usage_ratio)
                if tokens:
                    used.add_metric([engine], s.usage_ratio * tokens)
            if tokens:
                capacity.add_metric(["actual", engine], tokens)
                if planned_tokens:
                    error.add_metric(
                        ["kv_tokens", engine], (tokens - planned_tokens) / planned_tokens
                    )
            if kv_bytes:
                cap_bytes.add_metric(["actual", engine], kv_bytes)
            if conc:
                concurrency.add_metric(["actual", engine], conc)
    yield from (usage, used, capacity, cap_bytes, concurrency, error)

def plan_families(plan: Deployment | None) -> Iterator[Metric]:
    """The plan's per-GPU memory budget and what it runs (nothing without a plan)."""
    if plan is None:
        return
    pool = plan.pool
    memory = GaugeMetricFamily(
        "vlaunch_plan_memory_bytes",
        "The plan's per-GPU memory budget by consumer, in bytes.",
        labels=["component"],
    )
    for component, key in PLAN_COMPONENTS.items():
        memory.add_metric([component], float(getattr(pool.per_gpu, key)))
    yield memory
    p = pool.engine.parallel
    info = {
        "model": plan.model.name, "tp": p.tp, "pp": p.pp, "dp": p.dp,
        "kv_cache_dtype": pool.kv_cache.dtype, "max_model_len": pool.engine.max_model_len,
        "vllm_version": plan.vllm_version,
    }
    plan_info = GaugeMetricFamily(
        "vlaunch_plan_info", "The plan this deployment runs (always 1).", labels=list(info)
    )
    plan_info.add_metric(["" if v is None else str(v) for v in info.values()], 1.0)
    yield plan_info

def scaling_families(plan: Deployment | None, snap: VllmSnapshot | None) -> Iterator[Metric]:
    """The plan's capacity per replica and the replicas the live load calls for, per pool.

    `vlaunch_replica_capacity_requests{role}` is the plan's `target_running_per_replica` (the
    requests in flight one replica holds at the SLO knee). `vlaunch_desired_replicas{role}` =
    ceil((running + waiting requests, summed over every engine this exporter scrapes) / that
    capacity): the replicas this load needs at the plan's figures, for an HPA or KEDA to scale
    on directly; summed over the pool's exporters it is the pool's count. It exists only while
    vLLM answers (dropped, never frozen), and not at all for a plan without autoscaling. The
    engines an exporter scrapes are its plan's pool's (the one `pool_view` put first). A pool of
    a disaggregated plan counts as its ScaledObject does: the largest ceil(metric / threshold)
    over its role's triggers (predict/capacity/autoscaling.py desired_replicas).
    """
    a = plan.pool.autoscaling if plan is not None else None
    if a is None or a.target_running_per_replica <= 0:
        return
    target, role = float(a.target_running_per_replica), a.role
    cap = GaugeMetricFamily(
        "vlaunch_replica_capacity_requests",
        "Requests in flight one replica holds within the SLO (the plan's "
        "autoscaling.target_running_per_replica), per pool role.", labels=["role"])
    cap.add_metric([role], target)
    yield cap
    slo = GaugeMetricFamily(
        "vlaunch_plan_slo_seconds",
        "The plan's per-request SLO (TTFT, and TPOT for vLLM's inter-token latency), seconds.",
        labels=["role", "quantity"])
    if plan.slo is not None:
        for quantity, ms in (("ttft", plan.slo.ttft_ms), ("tpot", plan.slo.tpot_ms)):
            slo.add_metric([role, quantity], ms / 1e3)
    yield slo
    desired = GaugeMetricFamily(
        "vlaunch_desired_replicas",
        "ceil((vllm:num_requests_running + vllm:num_requests_waiting over every scraped "
        "engine) / vlaunch_replica_capacity_requests): replicas the live load needs.",
        labels=["role"])
    if snap is not None and snap.ok:
        desired.add_metric([role], float(_desired(a, snap, target,
                                                  plan.kind == "disaggregated")))
    yield desired


def _desired(a: Any, snap: VllmSnapshot, target: float, pool: bool) -> int:
    """An aggregated replica: ceil((running + waiting) / capacity). A pool of a disaggregated
    plan: the ScaledObject's own arithmetic over its role's triggers
    (predict/capacity/autoscaling.py desired_replicas), on this replica's engines."""
    engines = list(snap.engines.values())
    if not pool:
        load = sum((s.running or 0.0) + (s.waiting or 0.0) for s in engines)
        return math.ceil(load / target - 1e-9)
    from ..predict.capacity.autoscaling import desired_replicas

    usage = [s.usage_ratio for s in engines if s.usage_ratio is not None]
    return desired_replicas(a, {"running": sum(s.running or 0.0 for s in engines),
                                "waiting": sum(s.waiting or 0.0 for s in engines),
                                "kv_usage": sum(usage) / len(usage) if usage else 0.0})


def gpu_families(gpus: list[GpuRecord]) -> Iterator[Metric]:
    """Used, free and total memory per device."""
    fam = GaugeMetricFamily(
        "vlaunch_gpu_memory_bytes",
        "GPU memory as NVML reports it: used, free and total bytes per device.",
        labels=["gpu", "uuid", "kind"],
    )
    for g in gpus:
        for kind, value in (("used", g.used_bytes), ("free", g.free_bytes),
                            ("total", g.total_bytes)):
            fam.add_metric([str(g.index), g.uuid, kind], value)
    yield fam

def self_families(
    snap: VllmSnapshot | None, errors: dict[tuple[str, str], int], dropped: dict[str, int],
    gpu_duration: float | None, *, scrapes_vllm: bool, reads_gpus: bool,
) -> Iterator[Metric]:
    """The exporter's own health: series dropped, errors and how long each read took."""
    if scrapes_vllm:
        drops = CounterMetricFamily(
            "vlaunch_exporter_dropped_series",
            "Series of vLLM's /metrics left out: a label longer than the exporter takes, or "
            "more series in a family than it takes (reason).",
            labels=["reason"],
        )
        for reason, n in sorted(dropped.items()):
            drops.add_metric([reason], n)
        yield drops
    errs = CounterMetricFamily(
        "vlaunch_scrape_errors",
        "Failed reads of vLLM's /metrics or of the GPUs, by target and reason.",
        labels=["target", "reason"],
    )
    for (target, reason), n in sorted(errors.items()):
        if target == "vllm" and not scrapes_vllm:
            continue
        if target == "gpu" and not reads_gpus:
            continue
        errs.add_metric([target, reason], n)
    yield errs
    dur = GaugeMetricFamily(
        "vlaunch_scrape_duration_seconds",
        "Seconds the last read of each target took (vLLM: fetch and parse).",
        labels=["target"],
    )
    if snap is not None:
        dur.add_metric(["vllm"], snap.duration_s)
    if reads_gpus and gpu_duration is not None:
        dur.add_metric(["gpu"], gpu_duration)
    yield dur
