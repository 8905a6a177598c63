"""`vlaunch tune`'s measurement rules: how many engine starts per rung, where the SLO knee is,
and when one measurement is not enough.

Why apart from the loop: these are the decisions a reader checks against the statistics (a
knee within a resolution, a verdict that would flip within +-10% of the SLO measured again,
repeated points pooled), and they are pure, so tested without an engine.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..inputs.workload import SLO

THRESHOLD = 0.9
"""The SLO is met at a concurrency when at least this share of completed requests met both the
TTFT and the TPOT objective (vLLM's goodput counts them); 90% leaves room for one slow request
in ten, the usual way an SLO is written."""

RESOLUTION = (1.5, 1.25)
"""Bisection stops when the first failing concurrency is within this factor of the last passing
one: coarse in the early rungs (many candidates), fine in the last. 1.25 keeps 1.5x the knee beyond
the first failure, so "1.5x misses the SLO" can be checked."""

FRAGILE_TOLERANCE = 0.1
FRAGILE_SHARE = 0.25
"""A point is measured again only when its verdict is fragile: the share meeting the SLO is
within this of the threshold, and moving every request 10% would flip it (a point where 30%
met is a clear miss, however many requests sit near the limit)."""


def utc_now() -> str:
    """Now, as tune.json records times (UTC, ISO 8601, seconds)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def rung_sizes(n: int, max_starts: int, eta: int = 2, rungs: int | None = None) -> list[int]:
    """Engine starts per rung of successive halving, at most `max_starts` in all.

    About a third of the starts are kept for promotions (restarting the best of a rung to
    measure it more finely); the rest go to rung 0, which gets at least two starts (the
    baseline and one candidate) whenever there are two. `rungs=1` spends every start on rung 0.
    """
    if n < 1 or max_starts < 1:
        return []
    reserve = 0 if rungs == 1 or max_starts < 3 else max_starts // 3
    first = min(n, max_starts - reserve)
    sizes = [first]
    left = max_starts - first
    while left > 0 and sizes[-1] > 1 and (rungs is None or len(sizes) < rungs):
        size = min(math.ceil(sizes[-1] / eta), left)
        if size >= sizes[-1]:
            size = sizes[-1] - 1
        sizes.append(size)
        left -= size
    return sizes


# ----------------------------------------------------------------------------- knee search


@dataclass
class KneeSearch:
    """Doubling, then bisection, for the largest concurrency that meets the SLO.

    `probe(c) -> bool` measures one concurrency. State lives on the object so that a search
    cut short (budget, Ctrl-C) still says what it found: `lo` (the knee so far, 0 when even
    the smallest concurrency missed), `hi` (the first failing concurrency, None if none).
    """

    probe: Callable[[int], bool]
    max_concurrency: int
    resolution: float = 1.25
    hint: int | None = None
    lo: int = 0
    hi: int | None = None
    verdicts: dict[int, bool] = field(default_factory=dict)

    def _check(self, c: int) -> bool:
        if c not in self.verdicts:
            self.verdicts[c] = self.probe(c)
        ok = self.verdicts[c]
        if ok and c > self.lo:
            self.lo = c
        if not ok and (self.hi is None or c < self.hi):
            self.hi = c
        return ok

    def run(self) -> tuple[int, int | None]:
        top = max(1, self.max_concurrency)
        start = min(top, max(1, self.hint or 1))
        if self._check(start):
            c = start
            while c < top:
                c = min(top, c * 2)
                if not self._check(c):
                    break
        else:
            c = start // 2
            while c >= 1 and not self._check(c):
                c //= 2
            if self.lo == 0:
                return self.lo, self.hi
        while self.hi is not None and self.lo and self.hi - self.lo > 1 \
                and self.hi / self.lo > self.resolution:
            mid = max(self.lo + 1, min(self.hi - 1, round(math.sqrt(self.lo * self.hi))))
            self._check(mid)
        return self.lo, self.hi

    @property
    def bounded(self) -> bool:
        """True when a failing concurrency was seen (the knee is a knee, not the cap)."""
        return self.hi is not None


def fragile(point: dict[str, Any], slo: SLO, threshold: float = THRESHOLD,
            tolerance: float = FRAGILE_TOLERANCE) -> bool:
    """Would the verdict flip if every request were `tolerance` faster or slower? Then the
    spread is too large for one measurement and the point is repeated."""
    raw = point.get("raw") or {}
    ttfts, lats, outs = raw.get("ttfts"), raw.get("latencies"), raw.get("output_lens")
    if not (ttfts and lats and outs) or not (len(ttfts) == len(lats) == len(outs)):
        fraction = point.get("slo_fraction", 0.0)
        return threshold - tolerance < fraction < min(1.0, threshold + tolerance)
    done = [(t, (lat - t) / (n - 1) if n > 1 else 0.0)
            for t, lat, n in zip(ttfts, lats, outs, strict=True) if n and t is not None]
    if not done:
        return False

    def share(scale: float) -> float:
        ttft_s, tpot_s = slo.ttft_ms * scale / 1000, slo.tpot_ms * scale / 1000
        return sum(1 for t, p in done if t <= ttft_s and p <= tpot_s) / len(done)

    near = abs(point.get("slo_fraction", 0.0) - threshold) <= FRAGILE_SHARE
    return near and (share(1 - tolerance) >= threshold) != (share(1 + tolerance) >= threshold)


def flat_point(s: dict[str, Any], slo: SLO, threshold: float, repeat: int) -> dict[str, Any]:
    """A loadgen summary as one row of `results` (and a calibration point)."""
    met = s["completed"] > 0 and s["failed"] == 0 and s["slo_fraction"] >= threshold
    return {"concurrency": s["concurrency"], "input_len": s["input_len"],
            "output_len": s["output_len"], "num_prompts": s["num_prompts"],
            "output_tokens_per_s": s["output_tokens_per_s"],
            "requests_per_s": s["requests_per_s"], "goodput_rps": s["goodput_rps"],
            "tpot_ms": s["tpot_ms"]["mean"], "ttft_ms": s["ttft_ms"]["mean"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "completed": s["completed"], "failed": s["failed"],
            "good_requests": s["good_requests"], "slo_fraction": s["slo_fraction"],
            "slo_met": met, "repeat": repeat, "at": utc_now(), "raw": s["raw"]}


def pooled(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated measurements of one concurrency as one: request counts add up, rates average."""
    if len(points) == 1:
        return points[0]
    n = len(points)
    out = dict(points[-1])
    for key in ("output_tokens_per_s", "requests_per_s", "goodput_rps", "tpot_ms", "ttft_ms",
                "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
        vals = [p[key] for p in points if p.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    out["completed"] = sum(p["completed"] for p in points)
    out["failed"] = sum(p["failed"] for p in points)
    out["good_requests"] = sum(p["good_requests"] for p in points)
    out["slo_fraction"] = round(out["good_requests"] / out["completed"], 4) if out[
        "completed"] else 0.0
    out["repeats"] = n
    return out


def knee_of(results: list[dict[str, Any]], search: KneeSearch) -> dict[str, Any] | None:
    """A trial's knee from its points: the largest concurrency that met the SLO (its pooled
    numbers), with the first miss; None when nothing was measured."""
    if not results:
        return None
    by_c: dict[int, list[dict[str, Any]]] = {}
    for p in results:
        by_c.setdefault(p["concurrency"], []).append(p)
    c = search.lo
    point = pooled(by_c[c]) if c in by_c else pooled(by_c[min(by_c)])
    return {
        "concurrency": c, "first_miss": search.hi, "bounded": search.bounded,
        "goodput_rps": point["goodput_rps"] if c else 0.0,
        "output_tokens_per_s": point["output_tokens_per_s"],
        "requests_per_s": point["requests_per_s"],
        "tpot_ms": point["tpot_ms"], "ttft_ms": point["ttft_ms"],
        "tpot_p50_ms": point["tpot_p50_ms"], "tpot_p99_ms": point["tpot_p99_ms"],
        "ttft_p50_ms": point["ttft_p50_ms"], "ttft_p99_ms": point["ttft_p99_ms"],
        "slo_fraction": point["slo_fraction"],
    }
