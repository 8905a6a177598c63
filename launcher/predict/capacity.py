"""`vlaunch capacity`: how many GPUs, and what per month, for N users or R requests/s.

For each GPU option (a node shape such as 8xH200) the replica is exactly the plan `vlaunch plan`
makes for it (the same search, objective, SLO, MTP pin and candidate): its knee under the SLO
says what one replica serves (users: requests in flight; rps: Poisson arrivals under the knee),
and its figures are the plan's own. Replicas = ceil(load x (1 + headroom) / per-replica) +
spare. Prices are the catalog's list prices (dated, sourced) or the user's; they scale the
bill, never the count. When no option meets the SLO the answer names the closest miss.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..deployment.argv import engine_argv
from ..deployment.codec import to_json
from ..errors import InputError
from ..inputs.hardware import GiB, Hardware, kinds, parse_gpus
from ..inputs.model import ModelSpec
from ..inputs.workload import SLO, Workload
from . import budget as B
from . import perf
from .autoscaling import replicas_needed
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
    single_request: dict[str, float] | None = None  # one request alone (the closest-miss figure)
    vllm_args: list[str] | None = None  # the replica's command: `vlaunch plan`'s exactly

    @property
    def gpus_total(self) -> int | None:
        return self.replicas * self.hw.count if self.replicas is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "parallel": self.parallel, "kv_cache": {"dtype": self.kv_dtype},
                "max_model_len": self.max_model_len, "replicas": self.replicas,
                "gpus_total": self.gpus_total, "per_replica": self.per_replica,
                "binding": self.binding, "usd_per_gpu_hour": self.price,
                "price_source": self.price_source, "monthly_usd": _r(self.monthly_usd),
                "usd_per_million_output_tokens": _r(self.usd_per_m, 3),
                "source": self.source, "problem": self.problem or None,
                "curve": self.curve, "serving": self.serving,
                "single_request": self.single_request, "vllm_args": self.vllm_args}


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


def evaluate_option(spec: ModelSpec, gpus: str, load: Load, workload: Workload, slo: SLO,
                    pins: Pins, prices: dict[str, float], headroom: float,
                    spare: int, objective: str = "balanced") -> Option:
    """One GPU option: `vlaunch plan`'s plan for it, then replicas and the bill."""
    hw = parse_gpus(gpus)
    price = prices.get(hw.kind.name, hw.kind.price_usd_per_hour)
    source = ("your --price" if hw.kind.name in prices else
              f"list price, {hw.kind.price_source} ({hw.kind.price_date})"
              if hw.kind.price_usd_per_hour else "no price known: pass --price")
    opt = Option(gpus, hw, price, source)
    plan = make_plan(spec, hw, pins, suggest=False, workload=workload, objective=objective,
                     slo=slo)
    if not plan.fits:
        opt.problem = plan.chosen.problem or "does not fit"
        return opt
    a = plan.performance
    if a is None:
        opt.problem = f"no speed facts for {hw.kind.name} in the GPU catalog"
        return opt
    dep = plan.deployment()  # the typed plan: the same figures `vlaunch plan` prints
    perf_t, c = dep.performance, plan.chosen
    assert perf_t is not None  # the plan has an assessment (a), so it has its figures
    opt.parallel = {**to_json(dep.engine.parallel), "label": c.label()}
    opt.kv_dtype, opt.max_model_len, opt.source = c.kv_dtype, c.max_model_len, a.source
    opt.curve = to_json(perf_t.curve)
    opt.single_request = to_json(perf_t.single_request)
    opt.vllm_args = engine_argv(dep.engine)
    s = plan.serving
    opt.serving = {"mtp": s.mtp.k if s.mtp.enabled else 0, "mtp_reason": s.mtp.reason,
                   "all2all_backend": s.ep.backend if s.ep.applies else None}
    k = perf_t.knee
    if k is None:
        one = perf_t.single_request
        opt.problem = (f"the SLO is out of reach: one request alone sees TPOT "
                       f"{one.tpot_ms:.1f} ms, TTFT {one.ttft_ms:,.0f} ms")
        opt.binding = "slo"
        return opt
    opt.binding = perf_t.binding
    opt.per_replica = {"knee_concurrency": k.concurrency, "requests_per_s": k.requests_per_s,
                       "output_tokens_per_s": k.output_tokens_per_s,
                       "tpot_ms": k.tpot_ms, "ttft_ms": k.ttft_ms}
    # Users are a closed loop (the knee's concurrency); arrivals are Poisson, so a replica
    # takes the rate whose random peaks still fit under the knee (perf.open_loop_rate).
    open_rps = perf.open_loop_rate(a.shape, workload, k.concurrency)
    opt.per_replica["open_loop_requests_per_s"] = round(open_rps, 3)
    per = k.concurrency if load.users is not None else open_rps
    if per <= 0:
        opt.problem = "the knee is at one request: Poisson arrivals would queue past the SLO"
        return opt
    active = replicas_needed(load.users if load.users is not None else load.rps, per, headroom, 0)
    opt.replicas = active + spare
    if load.users is not None:
        served = perf.point(a.shape, workload, load.users / active).output_tokens_per_s
        served *= active
    else:
        served = float(load.rps) * workload.output_len
    if price:
        hourly = price * opt.gpus_total
        opt.monthly_usd = hourly * HOURS_PER_MONTH
        opt.usd_per_m = hourly / 3600 / served * 1e6 if served else None
    return opt


def closest_miss(options: list[Option], slo: SLO) -> Option | None:
    """The option nearest to meeting the SLO: one request alone, the worse of its TPOT and
    TTFT as a multiple of the SLO's."""
    def over(o: Option) -> float:
        one = o.single_request or {}
        return max(one.get("tpot_ms", math.inf) / slo.tpot_ms,
                   one.get("ttft_ms", math.inf) / slo.ttft_ms)

    missed = [o for o in options if o.single_request and o.replicas is None]
    return min(missed, key=over, default=None)


def plan_capacity(spec: ModelSpec, load: Load, workload: Workload, slo: SLO,
                  gpus: list[str] | None = None, prices: dict[str, float] | None = None,
                  headroom: float = 0.2, spare: int = 0, pins: Pins | None = None,
                  objective: str = "balanced") -> dict[str, Any]:
    """Every option, cheapest first; `recommended` is the cheapest that meets the SLO (priced
    options before unpriced ones); `closest_miss` when none does."""
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
                                 spare, objective) for g in shapes]
        opts.append(min(tried, key=lambda o: (*cost(o), o.hw.count)) if len(tried) > 1
                    else tried[0])

    opts.sort(key=cost)
    ok = [o for o in opts if o.replicas is not None]
    miss = None if ok else closest_miss(opts, slo)
    return {"model": {"name": spec.name, "hf_id": spec.hf_id, "params": B.param_count(spec)},
            "objective": objective,
            "mtp": {True: "on", False: "off", None: "planner"}[pins.speculative],
            "load": {"users": load.users, "rps": load.rps,
                                         "describe": load.describe()},
            # the workload's names are the plan's (performance: input_len ... assumed_workload)
            "input_len": workload.input_len, "output_len": workload.output_len,
            "workload": workload.name, "assumed_workload": workload.assumed,
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "headroom": headroom, "spare": spare, "hours_per_month": HOURS_PER_MONTH,
            "options": [o.to_dict() for o in opts],
            "recommended": ok[0].to_dict() if ok else None,
            "closest_miss": miss.to_dict() if miss else None}


def render(d: dict[str, Any], cols: int = 100) -> str:
    """The capacity answer as text within `cols` columns (launcher/term.py)."""
    from .. import term

    slo = d["slo"]
    head = (f"{d['model']['name']}: {d['load']['describe']}; {d['input_len']:,} in / "
            f"{d['output_len']:,} out per request"
            + (" (assumed: pass --workload or --input-len/--output-len)"
               if d["assumed_workload"] else "")
            + f"; SLO TTFT {slo['ttft_ms']:,.0f} ms, TPOT {slo['tpot_ms']:.0f} ms; objective "
            f"{d['objective']}; MTP {d['mtp']}; headroom {d['headroom']:.0%}, spare {d['spare']}")
    rows = [["GPUs/replica", "layout", "MTP", "users", "rps", "binds", "replicas", "GPUs",
             "$/month", "$/Mtok"]]
    misses = []
    for o in d["options"]:
        if o["replicas"] is None:
            label = (o.get("parallel") or {}).get("label")
            misses.append(f"  {o['gpus']}" + (f" ({label})" if label else "") + ": "
                          + (o["problem"] or "no replica"))
            continue
        pr = o["per_replica"]
        priced = o["monthly_usd"] is not None
        rows.append([o["gpus"], o["parallel"]["label"],
                     str((o.get("serving") or {}).get("mtp") or "off"),
                     f"{pr['knee_concurrency']:,.0f}", f"{pr['open_loop_requests_per_s']:,.1f}",
                     o["binding"], str(o["replicas"]), str(o["gpus_total"]),
                     f"{o['monthly_usd']:,.0f}" if priced else "no price",
                     f"{o['usd_per_million_output_tokens']:,.3f}" if priced else "-"])
    lines = term.fit([head], cols)
    right = (2, 3, 4, 6, 7, 8, 9)
    if cols < 100:  # narrow: the binding limit is in the JSON; keep the numbers on one line
        rows = [r[:5] + r[6:] for r in rows]
        right = (2, 3, 4, 5, 6, 7, 8)
    if len(rows) > 1:
        lines += term.table(rows, cols, indent="  ", right=right,
                            gap=" " if cols < 100 else "  ")
    lines += term.fit(misses, cols)
    rec = d["recommended"]
    if rec:
        bill = (f"${rec['monthly_usd']:,.0f}/month at ${rec['usd_per_gpu_hour']:.2f}/GPU-hour "
                f"({rec['price_source']})" if rec["monthly_usd"] is not None else
                "no price known: pass --price")
        lines += term.fit([f"recommended: {rec['replicas']} x {rec['gpus']} "
                           f"({rec['parallel']['label']}, kv {rec['kv_cache']['dtype']}) = "
                           f"{rec['gpus_total']} GPUs, {bill}; performance source: "
                           f"{rec['source']}"], cols)
        mtp_reason = (rec.get("serving") or {}).get("mtp_reason")
        if mtp_reason:
            lines += term.fit([f"  - {mtp_reason}"], cols)
    else:
        lines.append("recommended: none - no option meets the SLO")
    lines += term.fit(["prices are list prices of the named providers on the stated dates, "
                       "not quotes; the model's predictions are checked with `vlaunch tune` on "
                       "the real engine"], cols)
    return "\n".join(lines)


def miss_message(d: dict[str, Any]) -> str:
    """One line for exit 3: no option meets the SLO, and the closest miss."""
    m, slo = d.get("closest_miss"), d["slo"]
    if not m:
        return "no GPU option fits the model; see the table for why"
    one = m["single_request"]
    return (f"no GPU option meets the SLO (TTFT {slo['ttft_ms']:,.0f} ms, TPOT "
            f"{slo['tpot_ms']:.0f} ms); closest: {m['gpus']} ({m['parallel']['label']}), one "
            f"request alone sees TPOT {one['tpot_ms']:.1f} ms, TTFT {one['ttft_ms']:,.0f} ms; "
            "relax --slo or shorten the workload")
