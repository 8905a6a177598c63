"""`vlaunch capacity --disaggregate auto|on`: disaggregated options priced beside aggregated ones.

For each GPU option the unit is the xPyD split `vlaunch plan --disaggregate on` builds on that
shape (predict/search/pd_pools.py: each pool's replica planned by the same search, x and y sized
by rate matching within the shape's GPUs). The load needs ceil(load x (1 + headroom) / per-unit)
+ spare units: a rate against the unit's requests/s (already held to the TTFT SLO by
`disagg.split`), a number of users against the requests the unit holds in flight (Little's law:
its rate x each request's time in the system, TTFT + (output - 1) x TPOT). A unit is billed for
the GPUs its pools use, at the option's price per GPU-hour. The answer says which deployment is
cheaper for the load, and by how much: the cheapest disaggregated option against the recommended
aggregated one (monthly dollars where both are priced, GPUs otherwise).
"""

from __future__ import annotations

import math
from typing import Any

from ...inputs.hardware import parse_gpus
from ...inputs.model import ModelSpec
from ...inputs.workload import SLO, Workload
from ..features.capabilities import default_vllm_version
from ..search import pd_pools as pools
from ..search.planner import make_plan
from .capacity import HOURS_PER_MONTH
from .prices import PriceBook


def unit_concurrency(o: pools.Option, w: Workload) -> float:
    """Requests one unit holds in flight at its rate (Little's law)."""
    return o.requests_per_s * (o.ttft_ms + max(w.output_len - 1, 0) * o.tpot_ms) / 1e3


def evaluate(spec: ModelSpec, gpus: str, load: Any, w: Workload, slo: SLO, pins: Any,
             book: PriceBook, headroom: float, spare: int) -> dict[str, Any]:
    """One GPU option as a disaggregated deployment: its unit, units for the load, the bill."""
    hw = parse_gpus(gpus)
    out: dict[str, Any] = {"gpus": gpus, "units": None, "gpus_total": None, "pools": [],
                           "per_unit": None, "monthly_usd": None,
                           "usd_per_million_output_tokens": None, "problem": None}
    if hw.is_cpu or hw.count < 2:
        out["problem"] = "one GPU cannot hold two pools"
        return out
    version = pins.vllm_version or default_vllm_version()
    connector = pools.default_connector(hw)
    splits, refused = pools.split_options(
        spec, hw, lambda h, role: make_plan(spec, h, pins, suggest=False, workload=w,
                                            objective="throughput", slo=slo),
        w, slo, connector, version)
    best = max(splits, key=lambda o: o.per_gpu, default=None)
    if best is None or best.split is None:
        out["problem"] = (refused[0] if refused and not splits else
                          "no prefill/decode split of this shape fits and meets the SLO")
        return out
    sp = best.split
    per = unit_concurrency(best, w) if load.users is not None else best.requests_per_s
    want = (load.users if load.users is not None else load.rps) * (1 + headroom)
    units = max(1, math.ceil(want / per - 1e-9)) + spare if per > 0 else None
    if units is None:
        out["problem"] = "the unit serves nothing at the SLO"
        return out
    price = book.price(hw.kind, hw.count)
    out.update({
        "units": units, "gpus_total": units * sp.gpus, "label": best.label,
        "pools": [{"role": "prefill", "replicas": units * sp.prefill_replicas,
                   "gpus_per_replica": best.prefill.hardware.count,
                   "layout": best.prefill.chosen.label()},
                  {"role": "decode", "replicas": units * sp.decode_replicas,
                   "gpus_per_replica": best.decode.hardware.count,
                   "layout": best.decode.chosen.label()}],
        "per_unit": {"gpus": sp.gpus, "requests_per_s": round(sp.requests_per_s, 4),
                     "concurrency": round(unit_concurrency(best, w), 2),
                     "output_tokens_per_s": round(sp.output_tokens_per_s, 1),
                     "ttft_ms": round(sp.ttft_ms, 1), "tpot_ms": round(sp.tpot_ms, 2),
                     "bound": sp.bound},
        "usd_per_gpu_hour": price.usd_per_hour, "price_source": price.source})
    if price.usd_per_hour:
        hourly = price.usd_per_hour * units * sp.gpus
        served = (load.rps * w.output_len if load.rps is not None else
                  load.users / unit_concurrency(best, w) * sp.output_tokens_per_s)
        out["monthly_usd"] = round(hourly * HOURS_PER_MONTH)
        out["usd_per_million_output_tokens"] = round(hourly / 3600 / served * 1e6, 3) \
            if served else None
    return out


def verdict(options: list[dict[str, Any]], recommended: dict[str, Any] | None
            ) -> dict[str, Any]:
    """Which deployment the load is cheaper on: the cheapest disaggregated option against the
    recommended aggregated one, in dollars a month where both are priced, else in GPUs."""
    ok = [o for o in options if o["units"] is not None]
    if not ok:
        return {"wins": "aggregated" if recommended else None, "cheapest": None, "ratio": None,
                "by": None}

    def key(o: dict[str, Any]) -> tuple:
        return (o["monthly_usd"] is None, o["monthly_usd"] or 0, o["gpus_total"])

    best = min(ok, key=key)
    if recommended is None:
        return {"wins": "disaggregated", "cheapest": best["gpus"], "ratio": None, "by": None}
    priced = best["monthly_usd"] is not None and recommended["monthly_usd"] is not None
    by = "monthly_usd" if priced else "gpus_total"
    mine, theirs = best[by], recommended[by]
    wins = "disaggregated" if mine < theirs else "aggregated"
    return {"wins": wins, "cheapest": best["gpus"], "by": by,
            "ratio": round(max(mine, theirs) / min(mine, theirs), 3) if min(mine, theirs) else None}


def render_lines(d: dict[str, Any]) -> list[str]:
    """The disaggregated options as text lines under capacity's table."""
    pd = d.get("disaggregated")
    if not pd:
        return []
    lines = ["disaggregated (prefill + decode pools, NixlConnector):"]
    for o in pd["options"]:
        if o["units"] is None:
            lines.append(f"  {o['gpus']}: {o['problem']}")
            continue
        u = o["per_unit"]
        bill = f"${o['monthly_usd']:,}/month" if o["monthly_usd"] is not None else "no price"
        pools_text = " + ".join(f"{p['replicas']} {p['role']} x {p['layout']}"
                                for p in o["pools"])
        lines.append(f"  {o['gpus']}: {o['units']} unit(s) of {o['label']} = "
                     f"{o['gpus_total']} GPUs ({pools_text}); per unit "
                     f"{u['requests_per_s']:.2f} req/s, TTFT {u['ttft_ms']:,.0f} ms, TPOT "
                     f"{u['tpot_ms']:.1f} ms; {bill}")
    v = pd["verdict"]
    if v["wins"] and v["ratio"]:
        what = "$/month" if v["by"] == "monthly_usd" else "GPUs"
        lines.append(f"  {v['wins']} wins for this load: {v['ratio']:.2f}x fewer {what} "
                     f"(cheapest disaggregated: {v['cheapest']})")
    elif v["wins"]:
        lines.append(f"  {v['wins']} wins for this load")
    return lines


def add_disaggregated(d: dict[str, Any], spec: ModelSpec, load: Any, w: Workload, slo: SLO,
                      book: PriceBook, headroom: float, spare: int, pins: Any) -> dict[str, Any]:
    """Capacity's answer `d` with its GPU options priced as disaggregated deployments too (the
    options that hold the model), and the verdict."""
    shapes = [o["gpus"] for o in d["options"] if o["fits"]]
    options = [evaluate(spec, g, load, w, slo, pins, book, headroom, spare) for g in shapes]
    d["disaggregated"] = {"options": options, "verdict": verdict(options, d["recommended"])}
    return d
