"""`vlaunch capacity`: how many GPUs, and what per month, for N users or R requests/s.

For each GPU option (a shape one can rent, such as 8xH200: the catalog's node sizes, and trays of
an NVL72 within its NVLink domain) the replica is exactly the plan `vlaunch plan` makes for it
(the same search, objective, SLO, MTP pin and candidate): its knee under the SLO says what one
replica serves, and its figures are the plan's own. Users are a closed loop (the knee's requests
in flight); a rate is an open loop whose queue is the M/G/c model of predict/capacity/queueing.py: a
replica takes the largest rate whose queue wait plus prefill still meets the SLO's TTFT, always
below 100% busy. Replicas = ceil(load x (1 + headroom) / per-replica) + spare; each option
states its queue at the planned load (`at_load`). Prices are the catalog's list prices for that
shape (dated, sourced) or the user's (--price, --prices FILE); they scale the bill, never the
count. When nothing holds the model the answer says "does not fit"; when something fits but
misses the SLO it names the closest miss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...deployment.argv import engine_argv
from ...deployment.codec import to_json
from ...errors import InputError
from ...inputs.hardware import GiB, GPUKind, Hardware, kinds, parse_gpus
from ...inputs.model import ModelSpec
from ...inputs.workload import SLO, Workload
from ..memory import budget as B
from ..search.planner import Pins, make_plan
from ..speed import request_model as perf
from . import queueing
from .autoscaling import replicas_needed
from .prices import PriceBook, parse_prices

__all__ = ["Load", "Option", "default_options", "evaluate_option", "parse_prices",
           "plan_capacity", "render", "miss_message"]

HOURS_PER_MONTH = 730
"""8,760 hours / 12: how clouds bill a month."""


# Bounds on the load, far above any one deployment (the largest public APIs serve on the
# order of 1e5 requests/s across their fleets), low enough that replicas x price stays a
# finite number: --rps 1e308 once wrote Infinity into the JSON (issue 31).
MAX_RPS = 1e7
MAX_USERS = 10**9


@dataclass(frozen=True)
class Load:
    """Closed loop (`users`: each with one request in flight) or open loop (`rps`)."""

    users: int | None = None
    rps: float | None = None

    def validate(self) -> None:
        if (self.users is None) == (self.rps is None):
            raise InputError("give exactly one of --users N or --rps R")
        if self.users is not None and not 1 <= self.users <= MAX_USERS:
            raise InputError(f"--users must be a number of users from 1 to {MAX_USERS:,}, got "
                             f"{self.users:.3g}")
        if self.rps is not None and not (0 < self.rps <= MAX_RPS):  # NaN fails both
            raise InputError(f"--rps must be a request rate above 0 and at most {MAX_RPS:,.0f}, "
                             f"got {self.rps:.3g}")

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
    at_load: dict[str, float] | None = None  # one replica at the planned load: its queue
    fits: bool = False  # the model fits this shape (a miss is then the SLO's, not memory's)

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
                "single_request": self.single_request, "vllm_args": self.vllm_args,
                "at_load": self.at_load, "fits": self.fits}


def _r(x: float | None, nd: int = 0) -> float | None:
    return None if x is None else round(x, nd)


def holds(kind: GPUKind, gpus: int, spec: ModelSpec) -> bool:
    """Whether `gpus` of `kind` can hold the weights with room for a KV cache: the coarse
    filter before a plan (budget.holds_roughly)."""
    return B.holds_roughly(spec, kind.total_bytes, gpus)


def default_options(spec: ModelSpec) -> list[list[str]]:
    """Per data-centre GPU (NVIDIA and AMD), the shapes one can rent whose memory can hold the
    weights with room for a KV cache (two nodes of the largest size when one cannot); the best
    of each GPU's shapes is reported."""
    out = []
    for kind in kinds():
        if not kind.datacenter or kind.platform not in ("cuda", "rocm"):
            continue
        shapes = [g for g in kind.replica_shapes() if holds(kind, parse_gpus(g).count, spec)]
        if not shapes and kind.nvlink_domain <= kind.max_per_node \
                and holds(kind, 2 * kind.max_per_node, spec):
            shapes = [f"2x{kind.max_per_node}x{kind.name}"]
        if shapes:
            out.append(shapes[:2])  # the smallest two that hold it: bigger only costs more
    return out


def shape_problem(hw: Hardware) -> str:
    """Why a --gpus option is not a shape one can rent ('' when it is)."""
    kind = hw.kind
    if not kind.datacenter and not kind.prices:
        return ""  # a workstation card or a size: any count the user has
    if f"{hw.gpus_per_node}x{kind.name}" in kind.replica_shapes() and (
            hw.nodes == 1 or hw.gpus_per_node == kind.max_per_node):
        return ""
    sizes = "/".join(str(n) for n in kind.node_sizes)
    domain = (f", in an NVLink domain of {kind.nvlink_domain}"
              if kind.nvlink_domain > kind.max_per_node else "")
    return (f"{hw.count} {kind.name} is not a shape one can rent: a node holds {sizes}"
            f"{domain}; try {kind.replica_shapes()[-1]}")


def evaluate_option(spec: ModelSpec, gpus: str, load: Load, workload: Workload, slo: SLO,
                    pins: Pins, prices: PriceBook | dict[str, float], headroom: float,
                    spare: int, objective: str = "balanced") -> Option:
    """One GPU option: `vlaunch plan`'s plan for it, then replicas, their queue and the bill."""
    hw = parse_gpus(gpus)
    book = prices if isinstance(prices, PriceBook) else PriceBook(flat=dict(prices))
    price = book.price(hw.kind, hw.count)
    opt = Option(gpus, hw, price.usd_per_hour, price.source)
    opt.problem = shape_problem(hw)
    if opt.problem:
        return opt
    plan = make_plan(spec, hw, pins, suggest=False, workload=workload, objective=objective,
                     slo=slo)
    if not plan.fits:
        opt.problem = "does not fit: " + (plan.chosen.problem or "the model is too big")
        return opt
    opt.fits = True
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
    mtp, ep = s.speculative, s.ep_backend
    opt.serving = {"mtp": mtp.num_speculative_tokens, "mtp_reason": mtp.reason.text,
                   "all2all_backend": ep.backend if ep.applies else None}
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
    knee = (k.concurrency, k.requests_per_s, k.ttft_ms)
    per = _per_replica(a.shape, workload, slo, knee, load)
    opt.per_replica["open_loop_requests_per_s"] = round(
        per if load.rps is not None else _per_replica(a.shape, workload, slo, knee,
                                                       Load(rps=1.0)), 3)
    if per <= 0:
        opt.problem = ("even a trickle of Poisson arrivals queues past the SLO's TTFT: the "
                       "knee's prefill leaves no time to wait")
        return opt
    active = replicas_needed(load.users if load.users is not None else load.rps, per, headroom, 0,
                             closed=load.users is not None)
    opt.replicas = active + spare
    opt.at_load = at_load(a.shape, workload, knee, load, active)
    if load.users is not None:
        served = perf.point(a.shape, workload, load.users / active).output_tokens_per_s
        served *= active
    else:
        served = float(load.rps) * workload.output_len
    if opt.price:
        hourly = opt.price * opt.gpus_total
        opt.monthly_usd = hourly * HOURS_PER_MONTH
        opt.usd_per_m = hourly / 3600 / served * 1e6 if served else None
    return opt


def _ttft_s(shape: perf.EngineShape, w: Workload, in_flight: float) -> float:
    """Prefill time (TTFT without queueing) with `in_flight` requests in the engine."""
    return perf.point(shape, w, max(1.0, in_flight)).ttft_ms / 1e3


def _per_replica(shape: perf.EngineShape, w: Workload, slo: SLO,
                 knee: tuple[float, float, float], load: Load) -> float:
    """What one replica takes: users, the knee's concurrency (closed loop: no queue); a rate,
    the largest Poisson rate whose M/G/c wait plus the prefill at that load meets the SLO's
    TTFT (open loop), strictly under the knee's throughput (100% busy)."""
    conc, rps_k, _ = knee
    if load.users is not None:
        return conc
    servers = max(1, int(conc))
    return queueing.max_rate(servers, rps_k, lambda q: slo.ttft_ms / 1e3 - _ttft_s(
        shape, w, q.utilization * conc))


def at_load(shape: perf.EngineShape, w: Workload, knee: tuple[float, float, float],
            load: Load, active: int) -> dict[str, float]:
    """One of `active` replicas at the planned load: requests/s it receives, how busy its slots
    are, the mean queue wait and the TTFT a request sees, queueing included."""
    conc, rps_k, _ = knee
    if load.users is not None:  # closed loop: at most the knee in flight, nobody waits
        users = load.users / active
        p = perf.point(shape, w, users)
        return {"requests_per_s": round(p.requests_per_s, 3),
                "utilization": round(min(users / conc, 1.0), 4), "queue_wait_ms": 0.0,
                "ttft_ms": round(p.ttft_ms, 1)}
    q = queueing.mgc(float(load.rps) / active, max(1, int(conc)), rps_k)
    ttft = q.wait_s + _ttft_s(shape, w, q.utilization * conc)
    return {"requests_per_s": round(q.rate, 3), "utilization": round(q.utilization, 4),
            "queue_wait_ms": round(q.wait_s * 1e3, 1), "ttft_ms": round(ttft * 1e3, 1)}


def closest_miss(options: list[Option], slo: SLO) -> Option | None:
    """The option nearest to meeting the SLO: one request alone, the worse of its TPOT and
    TTFT as a multiple of the SLO's."""
    def over(o: Option) -> float:
        one = o.single_request or {}
        return max(one.get("tpot_ms", math.inf) / slo.tpot_ms,
                   one.get("ttft_ms", math.inf) / slo.ttft_ms)

    missed = [o for o in options if o.fits and o.single_request and o.replicas is None]
    return min(missed, key=over, default=None)


def plan_capacity(spec: ModelSpec, load: Load, workload: Workload, slo: SLO,
                  gpus: list[str] | None = None,
                  prices: PriceBook | dict[str, float] | None = None,
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
    book = prices if isinstance(prices, PriceBook) else PriceBook(flat=dict(prices or {}))
    groups = [[g] for g in gpus] if gpus else default_options(spec)
    if not groups:
        raise InputError(f"{spec.name} does not fit: no catalog GPU holds its "
                         f"{B.weights_bytes(spec) / GiB:.0f} GiB in one or two nodes (an NVL72 "
                         "domain's 16 trays); pass --gpus with more nodes, e.g. 4x8xH200")

    def cost(o: Option) -> tuple:
        return (o.replicas is None, o.monthly_usd is None,
                o.monthly_usd if o.monthly_usd is not None else o.gpus_total or 0,
                o.usd_per_m or 0.0, o.gpus_total or 0)

    opts = []
    for shapes in groups:  # one GPU kind: keep its cheapest replica shape
        tried = [evaluate_option(spec, g, load, workload, slo, pins, book, headroom,
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
            "closest_miss": miss.to_dict() if miss else None,
            "verdict": "ok" if ok else ("misses_slo" if any(o.fits for o in opts)
                                        else "does_not_fit")}


def render(d: dict[str, Any], cols: int = 100) -> str:
    """The capacity answer as text within `cols` columns (launcher/term.py)."""
    from ... import term

    slo = d["slo"]
    head = (f"{d['model']['name']}: {d['load']['describe']}; {d['input_len']:,} in / "
            f"{d['output_len']:,} out per request"
            + (" (assumed: pass --workload or --input-len/--output-len)"
               if d["assumed_workload"] else "")
            + f"; SLO TTFT {slo['ttft_ms']:,.0f} ms, TPOT {slo['tpot_ms']:.0f} ms; objective "
            f"{d['objective']}; MTP {d['mtp']}; headroom {d['headroom']:.0%}, spare {d['spare']}")
    rows = [["GPUs/replica", "layout", "MTP", "users", "rps", "binds", "replicas", "GPUs",
             "busy", "TTFT", "$/month", "$/Mtok"]]
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
                     f"{o['at_load']['utilization']:.0%}", f"{o['at_load']['ttft_ms']:,.0f}",
                     f"{o['monthly_usd']:,.0f}" if priced else "no price",
                     f"{o['usd_per_million_output_tokens']:,.3f}" if priced else "-"])
    lines = term.fit([head], cols)
    right = (2, 3, 4, 6, 7, 8, 9, 10, 11)
    if cols < 100:  # narrow: the binding limit is in the JSON; keep the numbers on one line
        rows = [r[:5] + r[6:] for r in rows]
        right = (2, 3, 4, 5, 6, 7, 8, 9, 10)
    if len(rows) > 1:
        lines += term.table(rows, cols, indent="  ", right=right,
                            gap=" " if cols < 100 else "  ")
    lines += term.fit(misses, cols)
    lines += term.fit([f"  price of {o['gpus']}: "
                       + (f"${o['usd_per_gpu_hour']:,.2f}/GPU-hour, " if o["usd_per_gpu_hour"]
                          else "") + o["price_source"] for o in d["options"]], cols)
    rec = d["recommended"]
    if rec:
        bill = (f"${rec['monthly_usd']:,.0f}/month at ${rec['usd_per_gpu_hour']:.2f}/GPU-hour "
                f"({rec['price_source']})" if rec["monthly_usd"] is not None else
                "no price known: pass --price")
        lines += term.fit([f"recommended: {rec['replicas']} x {rec['gpus']} "
                           f"({rec['parallel']['label']}, kv {rec['kv_cache']['dtype']}) = "
                           f"{rec['gpus_total']} GPUs, {bill}; performance source: "
                           f"{rec['source']}"], cols)
        q = rec["at_load"]
        model = ("M/G/c queue, Poisson arrivals" if d["load"]["rps"] is not None
                 else "closed loop: nobody queues")
        lines += term.fit([f"  at the planned load each replica gets {q['requests_per_s']:,.2f} "
                           f"requests/s, {q['utilization']:.0%} busy: queue wait "
                           f"{q['queue_wait_ms']:,.0f} ms, TTFT {q['ttft_ms']:,.0f} ms with "
                           f"queueing (SLO {slo['ttft_ms']:,.0f} ms; {model})"], cols)
        mtp_reason = (rec.get("serving") or {}).get("mtp_reason")
        if mtp_reason:
            lines += term.fit([f"  - {mtp_reason}"], cols)
    elif d["verdict"] == "does_not_fit":
        lines.append("recommended: none - the model does not fit any option")
    else:
        lines.append("recommended: none - every option that fits misses the SLO")
    lines += term.fit(["prices are list prices of the named providers on the stated dates, "
                       "not quotes; the model's predictions are checked with `vlaunch tune` on "
                       "the real engine"], cols)
    return "\n".join(lines)


def miss_message(d: dict[str, Any]) -> str:
    """One line for exit 3: no option meets the SLO, and the closest miss."""
    m, slo = d.get("closest_miss"), d["slo"]
    if d.get("verdict") == "does_not_fit" or not m:
        return ("the model does not fit any GPU option; see the table for why, or pass --gpus "
                "with a larger shape")
    one = m["single_request"]
    return (f"every GPU option that fits misses the SLO (TTFT {slo['ttft_ms']:,.0f} ms, TPOT "
            f"{slo['tpot_ms']:.0f} ms); closest: {m['gpus']} ({m['parallel']['label']}), one "
            f"request alone sees TPOT {one['tpot_ms']:.1f} ms, TTFT {one['ttft_ms']:,.0f} ms; "
            "relax --slo or shorten the workload")


def capacity_json(d: dict[str, Any]) -> str:
    """The capacity document as JSON, which has no Infinity or NaN (a parser downstream would
    refuse the file): a figure that overflowed is one line, never written."""
    import json

    try:
        return json.dumps(d, indent=2, allow_nan=False)
    except ValueError:
        raise InputError("the capacity figures overflow (a load or price too large to count); "
                         "give a smaller --rps, --users or --price") from None
