"""Refit the performance model's constants to the published rows (how perf.DEFAULT was set).

Coordinate descent over physically bounded ranges, minimising the larger of the two median
|log errors| (TPOT, output tokens/s) plus a small share of the mean, so no row is ignored.
Prints the best constants; copying them into `launcher/perf.py` is a reviewed change, not a
side effect. Run: .venv/bin/python bench/perf_fit.py
"""

from __future__ import annotations

import csv
import dataclasses
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.errors import InputError  # noqa: E402
from launcher.inputs.workload import Workload  # noqa: E402
from launcher.predict import (
    perf,  # noqa: E402
    perf_validation,  # noqa: E402
)

MEAN_WEIGHT = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
"""How much the mean |log error| counts beside the medians: 1.0 keeps the worst rows in view."""

CSV = Path(__file__).resolve().parents[2] / "shared" / "validation" / "vllm-perf-observations.csv"

BOUNDS = {  # physically plausible ranges; the fit never leaves them
    "bw_efficiency": (0.5, 0.95), "compute_efficiency": (0.2, 0.7),
    "prefill_efficiency": (0.2, 0.7), "layer_us": (5.0, 60.0), "moe_layer_us": (20.0, 300.0),
    "allreduce_us": (10.0, 100.0), "network_us": (40.0, 300.0), "step_us": (200.0, 3000.0),
    "gemm_m_half": (16.0, 256.0), "request_us": (5000.0, 60000.0),
}


def cases() -> list[tuple[str, perf.EngineShape, Workload, float, float | None, float | None]]:
    """(row, shape, workload, concurrency, observed TPOT, observed tok/s), shapes built once."""
    shared = CSV.resolve().parents[1]
    out = []
    with CSV.open() as f:
        for row in csv.DictReader(f):
            try:
                if " x input_len" in row["itl_ms_mean"]:
                    for r in perf_validation.itl_line(row, shared):
                        ctx = int(r.row_id.rsplit("@", 1)[1].rstrip("k")) * 1024
                        w = Workload(ctx, int(float(row["osl"])))
                        out.append((r.row_id, perf_validation.shape_for(row, shared, w), w, 1.0,
                                    r.observed, None))
                    continue
                w, conc = perf_validation.expressible(row)
                s = perf_validation.shape_for(row, shared, w)
            except InputError:
                continue
            burst = "request_rate=inf" in row["concurrency_or_request_rate"]
            tpot = None if burst else perf_validation.first_number(row["tpot_ms_mean"])
            out.append((row["id"], s, w, conc, tpot,
                        perf_validation.first_number(row["output_tok_s"])))
    return out


def score(constants: perf.Constants, data, old_fp8: float | None = None
          ) -> tuple[float, float, float]:
    """`old_fp8`: a trial value of capabilities.yaml's block_fp8_gemm_scale for the releases
    that carry one (the shapes built with a scale below 1)."""
    tp, tk = [], []
    for _, s, w, c, tpot, tput in data:
        scale = old_fp8 if old_fp8 is not None and s.gemm_scale < 1 else s.gemm_scale
        p = perf.point(dataclasses.replace(s, constants=constants, gemm_scale=scale), w, c)
        if tpot:
            tp.append(abs(math.log(p.tpot_ms / tpot)))
        if tput:
            tk.append(abs(math.log(p.output_tokens_per_s / tput)))
    m1, m2 = statistics.median(tp), statistics.median(tk)
    return max(m1, m2) + MEAN_WEIGHT * statistics.mean(tp + tk), m1, m2


def main() -> int:
    if not CSV.is_file():
        print(f"skipped: {CSV} not found")
        return 0
    data = cases()
    best = perf.DEFAULT
    best_score = score(best, data)
    print(f"start: objective {best_score[0]:.4f}, median |log err| TPOT {best_score[1]:.3f}, "
          f"tok/s {best_score[2]:.3f}")
    fp8 = next((s.gemm_scale for _, s, *_ in data if s.gemm_scale < 1), None)
    for _ in range(3):
        for name, (lo, hi) in BOUNDS.items():
            for i in range(13):
                value = lo * (hi / lo) ** (i / 12)
                trial = dataclasses.replace(best, **{name: value})
                sc = score(trial, data, fp8)
                if sc[0] < best_score[0] - 1e-6:
                    best, best_score = trial, sc
        if fp8 is not None:
            for i in range(13):
                value = 0.05 * 20 ** (i / 12)
                sc = score(best, data, value)
                if sc[0] < best_score[0] - 1e-6:
                    fp8, best_score = value, sc
    print(f"best:  objective {best_score[0]:.4f}, median |log err| TPOT {best_score[1]:.3f}, "
          f"tok/s {best_score[2]:.3f}")
    print(f"  block_fp8_gemm_scale (capabilities.yaml, vLLM < 0.8) = {fp8}")
    for f in dataclasses.fields(perf.Constants):
        print(f"  {f.name} = {getattr(best, f.name):.4g}   (now {getattr(perf.DEFAULT, f.name)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
