"""Pictures where a curve says more than numbers: throughput against latency.

matplotlib is an optional extra (`pip install 'vlaunch[plot]'`), imported only here and only
when a plot is asked for, so `vlaunch plan` stays light. Files are written atomically.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .deployment import plan as P
from .errors import InputError
from .render import alt_label

PLOT_MODE = 0o644
"""The mode of emitted files (paths.atomic_write), less the user's umask."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'vlaunch[plot]' (or "
                         "pip install matplotlib)") from None
    return plt


def _save(fig: Any, path: str) -> Path:
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"cannot write the plot {path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".png", dir=folder)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.chmod(tmp, PLOT_MODE & ~_umask())  # mkstemp's 0600 would hide it from the group
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _draw(ax: Any, curve: list[dict[str, Any]], label: str, knee: dict | None, **style) -> None:
    xs = [p["tpot_ms"] for p in curve]
    ys = [p["output_tokens_per_s"] for p in curve]
    ax.plot(xs, ys, marker="o", markersize=3, label=label, **style)
    if knee:
        ax.plot([knee["tpot_ms"]], [knee["output_tokens_per_s"]], marker="*", markersize=12,
                color=ax.lines[-1].get_color())


def _frame(ax: Any, slo: dict[str, float], title: str) -> None:
    ax.axvline(slo["tpot_ms"], color="grey", linestyle="--", linewidth=1)
    ax.text(slo["tpot_ms"], ax.get_ylim()[1] * 0.02, f" TPOT SLO {slo['tpot_ms']:.0f} ms",
            color="grey", fontsize=8)
    ax.set_xlabel("TPOT, ms per output token (lower is faster for each user)")
    ax.set_ylabel("output tokens/s, whole deployment")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _points(curve: Any) -> list[dict[str, float]]:
    """A curve as the drawing reads it: typed points (a plan) or capacity's JSON points."""
    return [p if isinstance(p, dict) else {"tpot_ms": p.tpot_ms,
                                           "output_tokens_per_s": p.output_tokens_per_s}
            for p in curve]


def plan_plot(d: P.Deployment, path: str) -> Path:
    """The chosen layout's curve (bold, knee starred) and each runner-up's."""
    perf, slo, w = d.performance, d.slo, d.workload
    if not d.fits:
        raise InputError("nothing to plot: the plan does not fit")
    if perf is None or slo is None or w is None:
        raise InputError("no performance prediction to plot (the GPU has no speed facts)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    p, pool = d.engine.parallel, d.pool
    label = f"TP{p.tp}" + (f"xPP{p.pp}" if p.pp > 1 else "") + (
        f"xDP{p.dp}" if p.dp > 1 else "") + ("+EP" if p.expert_parallel else "")
    spec = pool.engine.speculative_config
    k = spec.num_speculative_tokens if spec else 0
    _draw(ax, _points(perf.curve), f"{label} kv {pool.kv_cache.dtype}, "
          + (f"MTP {k}" if k else "no MTP") + " (chosen)", _points([perf.knee])[0]
          if perf.knee else None, linewidth=2.5)
    for alt in d.runners_up:
        if alt.performance is not None:
            ap = alt.performance
            _draw(ax, _points(ap.curve), alt_label(alt),
                  _points([ap.knee])[0] if ap.knee else None, linewidth=1, alpha=0.7)
    _frame(ax, {"tpot_ms": slo.tpot_ms}, f"{d.model.name} on {d.hardware.count}x"
           f"{d.hardware.name}: {w.input_len:,} in / {w.output_len:,} out ({perf.source})")
    out = _save(fig, path)
    plt.close(fig)
    return out


def capacity_plot(d: dict[str, Any], path: str) -> Path:
    """One curve per GPU option, per replica; the knee at the SLO starred."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for o in d["options"]:
        if o.get("curve"):
            per = o.get("per_replica") or {}
            knee = ({"tpot_ms": per["tpot_ms"], "output_tokens_per_s":
                     per["output_tokens_per_s"]} if per else None)
            _draw(ax, o["curve"], f"{o['gpus']} {o['parallel']['label']}", knee)
            drawn += 1
    if not drawn:
        plt.close(fig)
        raise InputError("no option has a performance curve to plot")
    _frame(ax, d["slo"], f"{d['model']['name']}: one replica per option")
    out = _save(fig, path)
    plt.close(fig)
    return out
