"""`vlaunch capacity`: how many GPUs, and what per month, for N users or R requests/s.

For each GPU option (a node shape such as 8xH200) the planner and the performance model give
every layout's knee under the SLO; the replica is the layout that serves the most load there
(users: requests in flight; rps: requests per second), so a tighter SLO or more load can only
need more GPUs. Replicas = ceil(load x (1 + headroom) / per-replica) + spare. Prices are the
catalog's list prices (dated, sourced) or the user's; they scale the bill, never the count.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..inputs.hardware import GiB, Hardware, kinds, parse_gpus
from ..inputs.model import ModelSpec
from ..inputs.workload import SLO, Workload
from . import budget as B
from . import perf
from .planner import Pins, make_plan

HOURS_PER_MONTH = 730
"""8,760 hours / 12: how clouds bill a month."""

NODE_SHAPES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Load:
    """Closed loop (`users`: each with one request in flight) or open loop (`rps`)."""

    users: int | None = None
    rps: float | None = None

    def validate(self) -> None:
        if (self.users is None) == (self.rps is None):
            raise InputError("give exactly one of --users N or --rps R")
        if self.users is not None and self.users < 1:
            raise InputError(f"--users must be a positive number of users, got {self.users}")
        if self.rps is not None and not (self.rps > 0 and math.isfinite(self.rps)):
            raise InputError(f"--rps must be a positive request rate, got {self.rps}")

    def describe(self) -> str:
        return (f"{self.users:,} users, one request each in flight" if self.users is not None
                else f"{self.rps:,.2f} requests/s arriving")


@dataclass
class Option:
    gpus: str
    hw: Hardware
    price: float | None
    price_source: str
    parallel: dict[str, Any] | None = None
    kv_dtype: str = ""
    max_model_len: int = 0
    replicas: int | None = None
    per_replica: dict[str, float] | None = None
    binding: str = ""
    source: str = "model"
    monthly_usd: float | None = None
    usd_per_m: float | None = None
    problem: str = ""
    curve: list[dict[str, Any]] | None = None
    serving: dict[str, Any] | None = None  # MTP, all-to-all backend, parsers of the replica

    @property
    def gpus_total(self) -> int | None:
        return self.replicas * self.hw.count if self.replicas is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "parallel": self.parallel, "kv_cache_dtype": self.kv_dtype,
                "max_model_len": self.max_model_len, "replicas": self.replicas,
                "gpus_total": self.gpus_total, "per_replica": self.per_replica,
                "binding": self.binding, "usd_per_gpu_hour": self.price,
                "price_source": self.price_source, "monthly_usd": _r(self.monthly_usd),
                "usd_per_million_output_tokens": _r(self.usd_per_m, 3),
                "source": self.source, "problem": self.problem or None,
                "curve": self.curve, "serving": self.serving}


def _r(x: float | None, nd: int = 0) -> float | None:
    return None if x is None else round(x, nd)


_PRICE = re.compile(r"^\s*([A-Za-z0-9._-]+)\s*=\s*\$?(\d+(?:\.\d+)?)\s*$")


def parse_prices(items: tuple[str, ...] | list[str]) -> dict[str, float]:
    """`H200=3.50` (one per --price); keyed by the catalog's canonical name."""
    from ..inputs.hardware import gpu_kind

    out: dict[str, float] = {}
    for item in items:
        m = _PRICE.match(item)
        if not m:
            raise InputError(f"malformed --price {item!r}: use GPU=USD_PER_GPU_HOUR, e.g. "
                             "H200=3.50")
        value = float(m.group(2))
        if value <= 0:
            raise InputError(f"--price {item!r}: the price must be more than 0")
        out[gpu_kind(m.group(1)).name] = value
    return out


def default_options(spec: ModelSpec) -> list[list[str]]:
    """Per data-centre GPU, the node shapes whose memory can hold the weights with room for a
    KV cache (2x8 when one node of 8 cannot); the best of each GPU's shapes is reported."""
    need = B.weights_bytes(spec) * B.checkpoint_scale(spec)
    out = []
    for kind in kinds():
        if not kind.datacenter or kind.platform != "cuda":
            continue
        shapes = [f"{n}x{kind.name}" for n in NODE_SHAPES if kind.total_bytes * n * 0.85 > need]
        if not shapes and kind.total_bytes * 16 * 0.85 > need:
            shapes = [f"2x8x{kind.name}"]
        if shapes:
            out.append(shapes)
    return out


def _metric(a: Any, load: Load, workload: Workload) -> float:
    if a is None or a.knee is None:
        return -1.0
    if load.users is not None:
        return a.knee.concurrency
    return perf.open_loop_rate(a.shape, workload, a.knee.concurrency)


def evaluate_option(spec: ModelSpec, gpus: str, load: Load, workload: Workload, slo: SLO,
                    pins: Pins, prices: dict[str, float], headroom: float,
                    spare: int) -> Option:
    hw = parse_gpus(gpus)
    price = prices.get(hw.kind.name, hw.kind.price_usd_per_hour)
    source = ("your --price" if hw.kind.name in prices else
              f"list price, {hw.kind.price_source} ({hw.kind.price_date})"
              if hw.kind.price_usd_per_hour else "no price known: pass --price")
    opt = Option(gpus, hw, price, source)
    plan = make_plan(spec, hw, pins, suggest=False, workload=workload, objective="throughput",
                     slo=slo)
    if not plan.fits:
        opt.problem = plan.chosen.problem or "does not fit"
        return opt
    best = max((a for a in plan.assessments.values() if a is not None
                and a.candidate.max_model_len >= plan.chosen.max_model_len),
               key=lambda a: _metric(a, load, workload), default=None)
    if best is None:
        opt.problem = f"no speed facts for {hw.kind.name} in the GPU catalog"
        return opt
    c = best.candidate
    L = c.layout
    opt.parallel = {"tp": L.tp, "pp": L.pp, "dp": L.dp, "expert_parallel": L.expert_parallel,
                    "nodes": L.nodes, "label": c.label()}
    opt.kv_dtype, opt.max_model_len, opt.source = c.kv_dtype, c.max_model_len, best.source
    opt.curve = [p.to_dict() for p in best.curve]
    opt.serving = _serving_summary(plan, c)
    if best.knee is None:
        opt.problem = (f"the SLO is out of reach: one request alone sees TPOT "
                       f"{best.single.tpot_ms:.1f} ms, TTFT {best.single.ttft_ms:,.0f} ms")
        opt.binding = "slo"
        return opt
    k = best.knee
    opt.binding = best.binding
    opt.per_replica = {"max_concurrency": round(k.concurrency, 1),
                       "requests_per_s": round(k.requests_per_s, 3),
                       "output_tokens_per_s": round(k.output_tokens_per_s, 1),
                       "tpot_ms": round(k.tpot_ms, 1), "ttft_ms": round(k.ttft_ms, 0)}
    # Users are a closed loop (the knee's concurrency); arrivals are Poisson, so a replica
    # takes the rate whose random peaks still fit under the knee (perf.open_loop_rate).
    open_rps = perf.open_loop_rate(best.shape, workload, k.concurrency)
    opt.per_replica["open_loop_requests_per_s"] = round(open_rps, 3)
    per = k.concurrency if load.users is not None else open_rps
    if per <= 0:
        opt.problem = "the knee is at one request: Poisson arrivals would queue past the SLO"
        return opt
    want = (load.users if load.users is not None else load.rps) * (1 + headroom)
    active = max(1, math.ceil(want / per - 1e-9))
    opt.replicas = active + spare
    if load.users is not None:
        served = perf.point(best.shape, workload, load.users / active).output_tokens_per_s
        served *= active
    else:
        served = float(load.rps) * workload.output_len
    if price:
        hourly = price * opt.gpus_total
        opt.monthly_usd = hourly * HOURS_PER_MONTH
        opt.usd_per_m = hourly / 3600 / served * 1e6 if served else None
    return opt


def _serving_summary(plan: Any, c: Any) -> dict[str, Any] | None:
    """The replica's serving features: decided for the plan's chosen layout (MTP's memory and
    speed are in that candidate and its curve); a runner-up layout runs without them."""
    s = getattr(plan, "serving", None)
    if s is None:
        return None
    if c is not plan.chosen:
        return {"mtp": 0, "all2all_backend": None, "note": "serving features are decided for "
                "the planner's chosen layout; this replica's layout runs without MTP"}
    return {"mtp": s.mtp.k if s.mtp.enabled else 0, "mtp_reason": s.mtp.reason,
            "all2all_backend": s.ep.backend if s.ep.applies else None,
            "vllm_args": s.vllm_args()}


def plan_capacity(spec: ModelSpec, load: Load, workload: Workload, slo: SLO,
                  gpus: list[str] | None = None, prices: dict[str, float] | None = None,
                  headroom: float = 0.2, spare: int = 0, pins: Pins | None = None
                  ) -> dict[str, Any]:
    """Every option, cheapest first; `recommended` is the cheapest that meets the SLO."""
    load.validate()
    if not 0 <= headroom <= 10:
        raise InputError(f"--headroom must be between 0 and 10 (a fraction), got {headroom}")
    if spare < 0:
        raise InputError(f"--spare must be 0 or more, got {spare}")
    pins = pins or Pins()
    groups = [[g] for g in gpus] if gpus else default_options(spec)
    if not groups:
        raise InputError(f"no catalog GPU holds {spec.name}'s "
                         f"{B.weights_bytes(spec) / GiB:.0f} GiB in up to 16 GPUs; pass --gpus")

    def cost(o: Option) -> tuple:
        return (o.replicas is None, o.monthly_usd is None,
                o.monthly_usd if o.monthly_usd is not None else o.gpus_total or 0,
                o.usd_per_m or 0.0, o.gpus_total or 0)

    opts = []
    for shapes in groups:  # one GPU kind: keep its cheapest replica shape
        tried = [evaluate_option(spec, g, load, workload, slo, pins, prices or {}, headroom,
                                 spare) for g in shapes]
        opts.append(min(tried, key=lambda o: (*cost(o), o.hw.count)) if len(tried) > 1
                    else tried[0])

    opts.sort(key=cost)
    ok = [o for o in opts if o.replicas is not None and o.monthly_usd is not None]
    return {"model": spec.name, "load": {"users": load.users, "rps": load.rps,
                                         "describe": load.describe()},
            "workload": {"input_len": workload.input_len, "output_len": workload.output_len,
                         "name": workload.name, "assumed": workload.assumed},
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "headroom": headroom, "spare": spare, "hours_per_month": HOURS_PER_MONTH,
            "options": [o.to_dict() for o in opts],
            "recommended": ok[0].to_dict() if ok else None}


def render(d: dict[str, Any]) -> str:
    w, slo = d["workload"], d["slo"]
    lines = [f"{d['model']}: {d['load']['describe']}; {w['input_len']:,} in / "
             f"{w['output_len']:,} out per request"
             + (" (assumed: pass --workload or --input-len/--output-len)" if w["assumed"] else "")
             + f"; SLO TTFT {slo['ttft_ms']:,.0f} ms, TPOT {slo['tpot_ms']:.0f} ms; headroom "
             f"{d['headroom']:.0%}, spare {d['spare']}",
             f"  {'GPUs/replica':13} {'layout':12} {'per replica':>22} {'binds':>16} "
             f"{'replicas':>8} {'GPUs':>5} {'$/month':>11} {'$/M out tok':>11}"]
    for o in d["options"]:
        if o["replicas"] is None:
            lines.append(f"  {o['gpus']:13} {'-':12} {o['problem']}")
            continue
        pr = o["per_replica"]
        per = (f"{pr['max_concurrency']:,.0f} users/"
               f"{pr['open_loop_requests_per_s']:,.1f} rps")
        money = (f"{o['monthly_usd']:>11,.0f} {o['usd_per_million_output_tokens']:>11,.3f}"
                 if o["monthly_usd"] is not None else f"{'no price':>11} {'-':>11}")
        lines.append(f"  {o['gpus']:13} {o['parallel']['label']:12} {per:>22} "
                     f"{o['binding']:>16} {o['replicas']:>8} {o['gpus_total']:>5} {money}")
    rec = d["recommended"]
    if rec:
        lines.append(f"recommended: {rec['replicas']} x {rec['gpus']} ({rec['parallel']['label']},"
                     f" kv {rec['kv_cache_dtype']}) = {rec['gpus_total']} GPUs, "
                     f"${rec['monthly_usd']:,.0f}/month at ${rec['usd_per_gpu_hour']:.2f}/GPU-hour "
                     f"({rec['price_source']}); performance source: {rec['source']}")
    else:
        lines.append("recommended: none - no option meets the SLO with a known price")
    lines.append("prices are list prices of the named providers on the stated dates, not quotes; "
                 "the model's predictions are checked with `vlaunch tune` on the real engine")
    return "\n".join(lines)
