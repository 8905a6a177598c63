"""`vlaunch tune`'s answer: which measured configuration wins, why, and how it is shown.

Why apart from the loop: choosing is a rule over what tune.json holds (the highest goodput at
the SLO knee, preferring a configuration's finest measurement, always compared with vLLM's
defaults), and the table and the plot read the same records; none of it needs an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..deployment.plan import Deployment
from ..inputs.workload import SLO
from ..term import table as term_table
from ..term import width as term_width

Trial = dict[str, Any]


def score(rec: Trial) -> float:
    """A trial's goodput at its knee (requests/s meeting the SLO); 0 when it has none."""
    knee = rec.get("knee") or {}
    return float(knee.get("goodput_rps") or 0.0)


def summary(r: Trial) -> dict[str, Any]:
    """A trial as tune.json's `baseline` / `recommended` name it."""
    k = r["knee"]
    return {"trial": r["name"], "rung": r["rung"], "source": r["source"],
            "vllm_args": r["vllm_args"], "concurrency": k["concurrency"],
            "knee_bounded": k["bounded"],
            "measured": {"output_tokens_per_s": k["output_tokens_per_s"],
                         "tpot_ms": k["tpot_ms"], "ttft_ms": k["ttft_ms"],
                         "goodput_rps": k["goodput_rps"],
                         "tpot_p99_ms": k["tpot_p99_ms"], "ttft_p99_ms": k["ttft_p99_ms"]}}


def why(best: Trial, base: Trial | None, measured: int, slo: SLO) -> str:
    """One sentence: what won, by how much over vLLM's defaults."""
    k = best["knee"]
    text = (f"highest goodput at the SLO knee of {measured} measured configuration(s): "
            f"{k['goodput_rps']:.2f} req/s meeting {slo.describe()} at "
            f"concurrency {k['concurrency']}")
    if base is None:
        return text + "; vLLM's defaults were not measured"
    if base is best:
        return text + "; vLLM's defaults were the best measured"
    b = base["knee"]
    gain = (k["goodput_rps"] / b["goodput_rps"] - 1) if b["goodput_rps"] else float("inf")
    return text + (f"; vLLM's defaults: {b['goodput_rps']:.2f} req/s at concurrency "
                   f"{b['concurrency']} ({gain:+.0%})")


def decide(trials: list[Trial], slo: SLO) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(baseline, recommended) summaries. Best: the highest goodput at the knee among ok trials,
    preferring the latest rung a configuration reached (its finest measurement)."""
    latest: dict[str, Trial] = {}
    for r in trials:
        if r["status"] == "ok" and r.get("knee") and (
                r["key"] not in latest or r["rung"] >= latest[r["key"]]["rung"]):
            latest[r["key"]] = r
    base = next((r for r in latest.values() if r["source"] == "baseline"), None)
    baseline = summary(base) if base else None
    if not latest:
        return baseline, None
    top_rung = max(r["rung"] for r in latest.values())
    finalists = [r for r in latest.values() if r["rung"] == top_rung] or list(latest.values())
    best = max(finalists, key=lambda r: (score(r), r["knee"]["output_tokens_per_s"] or 0.0,
                                         r["source"] == "baseline"))
    return baseline, {**summary(best), "why": why(best, base, len(latest), slo)}


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _v(v: Any, fmt: str = "") -> str:
    return "-" if v is None else format(v, fmt)


def table(trials: list[Trial]) -> list[str]:
    """One row per trial: knee, output tok/s, TTFT/TPOT p50/p99, goodput, status, and last the
    configuration (with the cause of a failure), which wraps under itself so the numbers stay
    aligned within the terminal's width (launcher.term)."""
    rows = [["#", "rung", "knee", "tok/s", "TTFT p50/p99", "TPOT p50/p99", "goodput", "status",
             "configuration"]]
    for i, r in enumerate(trials, 1):
        k = r.get("knee") or {}
        rows.append([str(i), str(r["rung"]), _v(k.get("concurrency")),
                     _v(k.get("output_tokens_per_s"), ".1f"),
                     ms(k.get("ttft_p50_ms")) + "/" + ms(k.get("ttft_p99_ms")),
                     ms(k.get("tpot_p50_ms")) + "/" + ms(k.get("tpot_p99_ms")),
                     _v(k.get("goodput_rps"), ".2f"), r["status"],
                     r["name"] + (f" ({r['cause'][:160]})" if r.get("cause") else "")])
    return term_table(rows, term_width(), right=range(7), gap=" ")


def plot(trials: list[Trial], plan_of: Callable[[Trial], Deployment | None], slo: SLO,
         path: Path, out: Callable[[str], None]) -> None:
    """Measured curves (tok/s and TPOT against concurrency) next to the model's, as PNG.
    `plan_of(trial)`: the plan whose predicted curve is drawn beside it (None: none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out("vlaunch: --plot needs matplotlib (pip install matplotlib); skipped")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in trials:
        pts = sorted((p for p in r["results"]), key=lambda p: p["concurrency"])
        if not pts:
            continue
        xs = [p["concurrency"] for p in pts]
        line = ax1.plot(xs, [p["output_tokens_per_s"] for p in pts], "o-",
                        label=r["name"][:40])[0]
        ax2.plot(xs, [p["tpot_ms"] for p in pts], "o-", color=line.get_color())
        plan = plan_of(r)
        curve = plan.performance.curve if plan is not None and plan.performance else ()
        if curve:
            cx = [c.concurrency for c in curve]
            ax1.plot(cx, [c.output_tokens_per_s for c in curve], "--",
                     color=line.get_color())
            ax2.plot(cx, [c.tpot_ms for c in curve], "--", color=line.get_color())
    ax2.axhline(slo.tpot_ms, color="grey", linestyle=":")
    for ax, label in ((ax1, "output tokens/s"), (ax2, "TPOT ms (mean)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
    ax1.legend(fontsize=7)
    fig.suptitle("measured (solid) vs model (dashed)")
    fig.savefig(path, dpi=100)
    out(f"plot: {path}")
