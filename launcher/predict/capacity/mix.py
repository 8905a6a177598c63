"""`vlaunch capacity --mix`: the cheapest fleet of several GPU types for a length histogram.

Why a mix: a GPU's cost per request depends on the request's lengths. Short chat turns are
cheap on a small card whose bandwidth is all a short decode needs; long prompts want the big
card's compute and KV room. Serving each length bucket on the type that is cheapest for it can
beat the best single type (the Melange paper, Griggs et al. 2024, and AIBrix's GPU optimizer,
which solve the same problem as an integer program).

The program. Buckets b (prompt/output lengths, share s_b of the rate R) and GPU options g
(a rentable shape with a price p_g per replica-hour). r_gb is what one replica of g takes of
bucket b alone: the open-loop rate `capacity` sizes by (the M/G/c queue of queueing.py
under the SLO). Variables: x_gb in [0, 1], the share of bucket b that g serves, and n_g, whole
replicas of g. Minimise sum_g p_g n_g subject to sum_g x_gb = 1 for every bucket and
sum_b x_gb s_b R (1 + headroom) / r_gb <= n_g for every g: a replica's time is shared across
the buckets it serves in proportion to their load (the linear packing Melange makes; a replica
serving two buckets at once batches them together, which this neither credits nor charges).
Solved with HiGHS through scipy.optimize.milp, imported here only, so `vlaunch plan` stays light.

Routing in production is the gateway's job: it estimates each request's prompt tokens (and its
max_tokens) and sends the request to the pool that serves its bucket, splitting a bucket that
two pools share by the solved shares (weighted routes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import InputError
from ...inputs.hardware import gpu_kind, parse_gpus
from ...inputs.model import ModelSpec
from ...inputs.workload import PRESETS, SLO, Workload
from ...paths import read_small_text
from ..search.planner import Pins
from .capacity import HOURS_PER_MONTH, Load, evaluate_option, holds, plan_capacity
from .prices import PriceBook

ROUTING = ("route by length at the gateway: estimate each request's prompt tokens (and its "
           "max_tokens) and send it to the pool serving its bucket, splitting a shared bucket by "
           "the shares above (weighted routes; with the Gateway API Inference Extension, one "
           "InferencePool per GPU type behind an HTTPRoute whose rules match a length header the "
           "gateway sets)")


@dataclass(frozen=True)
class Bucket:
    """Requests of one prompt/output length, `share` of all arrivals."""

    input_len: int
    output_len: int
    share: float

    def workload(self) -> Workload:
        return Workload(self.input_len, self.output_len, "custom", False)


def buckets_from_file(path: str) -> list[Bucket]:
    """`--lengths FILE` (YAML, launcher/schemas/profiles/lengths.json): a list of
    {input_len, output_len, share} or {workload: PRESET, share}; shares are normalised."""
    import yaml

    from ...profile_check import SCHEMAS, problems

    try:
        data: Any = yaml.safe_load(read_small_text(path))  # a FIFO or /dev/zero: refused
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or "not UTF-8 text"
        raise InputError(f"--lengths {path}: cannot read it ({why})") from None
    except yaml.YAMLError:
        raise InputError(f"--lengths {path}: not YAML; see {SCHEMAS / 'lengths.json'}") from None
    found = problems(data, "lengths")
    if found:
        raise InputError(f"--lengths {path}: {found[0]}; see {SCHEMAS / 'lengths.json'} for "
                         "what it may hold")
    out = []
    for row in data["lengths"]:
        if "workload" in row:
            i, o, _ = PRESETS[row["workload"]]
        else:
            i, o = row["input_len"], row["output_len"]
        out.append(Bucket(int(i), int(o), float(row["share"])))
    total = sum(b.share for b in out)
    return [Bucket(b.input_len, b.output_len, b.share / total) for b in out]


def mean_workload(buckets: list[Bucket]) -> Workload:
    """The histogram's share-weighted mean lengths (what the single-type table plans for)."""
    i = sum(b.input_len * b.share for b in buckets)
    o = sum(b.output_len * b.share for b in buckets)
    return Workload(max(1, round(i)), max(1, round(o)), "custom", False)


def mix_options(spec: ModelSpec, gpus: list[str], book: PriceBook) -> list[str]:
    """Each --gpus item as a rentable shape: a bare name (H100) becomes its smallest priced
    shape that holds the model (else its smallest); an unknown name is one line, exit 2."""
    out = []
    for item in gpus:
        if item[:1].isdigit():  # a shape (8xH100, 2x8xH100)
            out.append(item)
            continue
        kind = gpu_kind(item)
        shapes = [g for g in kind.replica_shapes() if holds(kind, parse_gpus(g).count, spec)]
        if not shapes:
            raise InputError(f"--mix: no shape of {kind.name} holds {spec.name}; name a shape "
                             f"(e.g. 2x{kind.max_per_node}x{kind.name}) or another GPU")
        priced = [g for g in shapes if book.price(kind, parse_gpus(g).count).usd_per_hour]
        out.append((priced or shapes)[0])
    if len(set(out)) < 2:
        raise InputError("--mix needs at least two GPU types: --gpus A,B,...")
    return out


def plan_capacity_mix(spec: ModelSpec, load: Load, workload: Workload, slo: SLO,
                      gpus: list[str] | None, book: PriceBook, headroom: float, spare: int,
                      pins: Pins, *, objective: str = "balanced",
                      lengths: str | None = None) -> dict[str, Any]:
    """`capacity --mix`: each type's single-type answer for the histogram's mean lengths (the
    table), and under `mix` the cheapest fleet of those types for the histogram itself."""
    if load.rps is None:
        raise InputError("--mix sizes an open-loop rate: pass --rps R (not --users)")
    buckets = (buckets_from_file(lengths) if lengths else
               [Bucket(workload.input_len, workload.output_len, 1.0)])
    options = mix_options(spec, gpus or [], book)
    if lengths:
        workload = mean_workload(buckets)
    d = plan_capacity(spec, load, workload, slo, options, book, headroom, spare, pins,
                      objective=objective)
    d["mix"] = plan_mix(spec, float(load.rps), buckets, options, slo, pins, book, headroom,
                        objective)
    return d


def plan_mix(spec: ModelSpec, rps: float, buckets: list[Bucket], gpus: list[str], slo: SLO,
             pins: Pins, book: PriceBook, headroom: float, objective: str) -> dict[str, Any]:
    """The cheapest fleet (integer replicas of each option) that serves every bucket within
    the SLO, the best single option for comparison, and what the mix saves."""
    rates: dict[str, list[float]] = {}  # option -> r_gb per bucket (0: cannot serve it)
    hourly: dict[str, float] = {}
    for g in gpus:
        row = []
        for b in buckets:
            o = evaluate_option(spec, g, Load(rps=1.0), b.workload(), slo, pins, book, 0.0, 0,
                                objective)
            if o.price is None:
                raise InputError(f"--mix: {o.price_source}")
            hourly[g] = o.price * o.hw.count
            row.append((o.per_replica or {}).get("open_loop_requests_per_s", 0.0)
                       if o.replicas is not None else 0.0)
        rates[g] = row
    loads = [rps * b.share * (1 + headroom) for b in buckets]
    singles = {g: _single(rates[g], loads) for g in gpus}
    best = min((g for g in gpus if singles[g] is not None),
               key=lambda g: singles[g] * hourly[g], default=None)
    n, x = solve(gpus, buckets, rates, loads, hourly)
    best_monthly = round(singles[best] * hourly[best] * HOURS_PER_MONTH) if best else None
    total = sum(loads)
    pools = [{"gpus": g, "replicas": n[g],
              "share": round(sum(x[g][j] * loads[j] for j in range(len(buckets))) / total, 4),
              "buckets": [round(x[g][j], 4) for j in range(len(buckets))],
              "monthly_usd": round(n[g] * hourly[g] * HOURS_PER_MONTH)}
             for g in gpus if n[g] > 0]
    monthly = sum(p["monthly_usd"] for p in pools)  # the pools' own figures, summed
    return {"buckets": [{"input_len": b.input_len, "output_len": b.output_len,
                         "share": round(b.share, 4)} for b in buckets],
            "per_replica_requests_per_s": {g: [round(r, 3) for r in rates[g]] for g in gpus},
            "pools": pools, "monthly_usd": monthly,
            "best_single": ({"gpus": best, "replicas": singles[best],
                             "monthly_usd": best_monthly} if best else None),
            "saving_vs_best_single_usd": (best_monthly - monthly if best_monthly is not None
                                          else None),
            "solver": "HiGHS MILP (scipy.optimize.milp)", "routing": ROUTING}


def _single(rates: list[float], loads: list[float]) -> int | None:
    """Replicas of one option serving every bucket alone (None: a bucket it cannot serve)."""
    if any(r <= 0 for r, lam in zip(rates, loads, strict=True) if lam > 0):
        return None
    return max(1, math.ceil(sum(lam / r for r, lam in zip(rates, loads, strict=True)) - 1e-9))


def solve(gpus: list[str], buckets: list[Bucket], rates: dict[str, list[float]],
          loads: list[float], hourly: dict[str, float]) -> tuple[dict[str, int],
                                                                dict[str, list[float]]]:
    """The integer program of the module docstring. Variables: n_g (integer) then x_gb."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    G, J = len(gpus), len(buckets)
    nv = G + G * J

    def xi(g: int, j: int) -> int:
        return G + g * J + j

    c = np.zeros(nv)
    c[:G] = [hourly[g] for g in gpus]
    rows, lo, hi = [], [], []
    for j in range(J):  # every bucket fully served
        a = np.zeros(nv)
        for g in range(G):
            a[xi(g, j)] = 1.0
        rows.append(a)
        lo.append(1.0)
        hi.append(1.0)
    for g, name in enumerate(gpus):  # replicas cover the load assigned to them
        a = np.zeros(nv)
        a[g] = -1.0
        for j in range(J):
            r = rates[name][j]
            a[xi(g, j)] = loads[j] / r if r > 0 else 0.0
        rows.append(a)
        lo.append(-np.inf)
        hi.append(0.0)
    upper = np.ones(nv)
    upper[:G] = np.inf
    for g, name in enumerate(gpus):
        for j in range(J):
            if rates[name][j] <= 0:
                upper[xi(g, j)] = 0.0  # cannot serve this bucket within the SLO
    if any(all(upper[xi(g, j)] == 0 for g in range(G)) for j in range(J) if loads[j] > 0):
        raise InputError("--mix: no GPU option serves every length bucket within the SLO; "
                         "relax --slo or add a larger GPU")
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.r_[np.ones(G), np.zeros(G * J)],
               bounds=Bounds(np.zeros(nv), upper), options={"time_limit": 10.0})
    if res.x is None:
        raise InputError(f"--mix: the solver found no fleet ({res.message})")
    n = {name: int(round(res.x[g])) for g, name in enumerate(gpus)}
    x = {name: [max(0.0, float(res.x[xi(g, j)])) for j in range(J)]
         for g, name in enumerate(gpus)}
    return n, x


def render_mix(m: dict[str, Any], cols: int = 100) -> list[str]:
    """The mix as text lines: each pool, the bill, the saving, and how to route."""
    from ... import term

    hist = ", ".join(f"{b['input_len']:,}/{b['output_len']:,} x{b['share']:.0%}"
                     for b in m["buckets"])
    lines = [f"mix for the length histogram (in/out x share: {hist}):"]
    for p in m["pools"]:
        serves = ", ".join(f"{b['input_len']:,}/{b['output_len']:,}"
                           + (f" ({x:.0%})" if x < 0.9995 else "")
                           for b, x in zip(m["buckets"], p["buckets"], strict=True) if x > 5e-4)
        lines.append(f"  {p['replicas']} x {p['gpus']}: {p['share']:.0%} of requests "
                     f"(serves {serves}), ${p['monthly_usd']:,.0f}/month")
    best = m["best_single"]
    lines.append(f"  mix ${m['monthly_usd']:,.0f}/month"
                 + (f"; best single type {best['replicas']} x {best['gpus']} "
                    f"${best['monthly_usd']:,.0f}/month: the mix saves "
                    f"${m['saving_vs_best_single_usd']:,.0f}/month" if best else
                    "; no single type serves every bucket"))
    lines.append(f"  {m['routing']}")
    return term.fit(lines, cols)
