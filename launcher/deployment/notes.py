"""The plan's notes as data: `Performance.notes`, `Autoscaling.notes` and `Alternative.why_not`.

Each is a `plan.Reason` whose `code` is one of `RENDERERS` (a closed set a program may test),
whose `data` holds the figures as the plan's JSON carries them (rounded where the JSON rounds),
and whose `text` is that code's renderer applied to that data, once, when the reason is made
(`note`). So the sentence a person reads and the numbers a script reads cannot disagree: both
come from one dict, and `render` rebuilds the sentence from a loaded plan's data alone.

The producers build the data (predict/speed/speed_decisions.py: a calibration; predict/search/
pd_pools.py: a split's rate match and its pools' de-ratings; predict/capacity/autoscaling.py: the
replica bounds and the stabilization cap; predict/search/rank.py: why a runner-up lost); this
module only words it. Each renderer reads only its own code's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .plan import Reason

Data = Mapping[str, Any]


# ----------------------------------------------------------------------------- performance


def _calibrated(d: Data) -> str:
    scope = "this engine" if d["scope"] == "engine" else "another layout on this hardware"
    return (f"performance calibrated from {d['points']} measured point(s) of {scope} "
            f"(vlaunch tune, {d['recorded_at']}; fit error {d['median_error']:.0%})")


def _rate_matched(d: Data) -> str:
    units = f", {d['units']} units of it" if d["units"] > 1 else ""
    return (f"rate-matched {d['prefill_replicas']}P{d['decode_replicas']}D{units}: "
            f"{d['bound']} binds; the KV hand-off moves {d['bytes_per_gpu'] / 1e6:,.1f} MB per "
            f"GPU over {d['path']} in {d['transfer_ms']:.2f} ms")


def _handshake(d: Data) -> str:
    return (f"{d['connector']}'s handshake, ~{d['handshake_s']:.0f} s per prefill-decode pair "
            "on the first request, is not in TTFT")


def _prefill_rate(d: Data) -> str:
    return f"prompts/s of the pool, de-rated by {d['derate']:g}; TTFT's prefill term"


def _decode_rate(d: Data) -> str:
    return f"requests/s of the pool at the TPOT SLO, de-rated by {d['derate']:g}"


# ----------------------------------------------------------------------------- autoscaling


def _at_minimum(d: Data) -> str:
    return ("replicas: no --max-replicas, --users or --rps: the pool stays at its minimum of "
            f"{d['min_replicas']}")


def _rate_matched_replicas(d: Data) -> str:
    return ("replicas: no --max-replicas, --users or --rps: the pool stays at its "
            f"rate-matched {d['replicas']}")


def _max_replicas(d: Data) -> str:
    return f"replicas: {d['min_replicas']} to --max-replicas {d['max_replicas']}"


def _for_load(d: Data) -> str:
    return (f"replicas: {d['load']:g} {d['unit']} at {d['per_replica']:,.2f} per replica "
            f"(+{d['headroom']:.0%} headroom, {d['spare']} spare): {d['replicas']}")


def _windows_capped(d: Data) -> str:
    return (f"start-up {d['startup_s']:,.0f} s is longer than the {d['max_window_s']} s "
            "stabilization window the HPA accepts: windows capped there")


# ----------------------------------------------------------------------------- runner-ups


def figure(d: Data) -> str:
    """One assessment's deciding figure (`figure_data`'s keys): the objective's number in words,
    as the runner-ups' verdicts and the `performance.predicted` reason quote it."""
    if d["objective"] == "latency":
        return f"TPOT {d['single_tpot_ms']:.1f} ms for one request"
    if d.get("output_tokens_per_s") is None:
        return f"misses the SLO even alone (TPOT {d['single_tpot_ms']:.1f} ms)"
    return (f"{d['output_tokens_per_s']:,.0f} output tok/s at {d['concurrency']:,.0f} "
            f"concurrent within the SLO (TPOT {d['tpot_ms']:.1f} ms, TTFT "
            f"{d['ttft_ms']:,.0f} ms)")


def headline(d: Data) -> str:
    """The deciding number alone (`figure_data`'s keys)."""
    if d["objective"] == "latency":
        return f"TPOT {d['single_tpot_ms']:.1f} ms"
    if d.get("output_tokens_per_s") is None:
        return "misses the SLO"
    return f"{d['output_tokens_per_s']:,.0f} output tok/s"


def _lost_on_speed(d: Data) -> str:
    return f"{figure(d)}; chosen: {headline(d['chosen'])}"


def _shorter_context(d: Data) -> str:
    return (f"holds only {d['max_model_len']:,} tokens of context (chosen: "
            f"{d['chosen_max_model_len']:,})")


def _no_prediction(d: Data) -> str:
    return f"fewer concurrent sequences ({d['concurrent_sequences']:.1f})"


def _does_not_fit(d: Data) -> str:
    return str(d["problem"])


RENDERERS: dict[str, Callable[[Data], str]] = {
    # Performance.notes
    "performance.calibrated": _calibrated,
    "disaggregated.rate_matched": _rate_matched,
    "disaggregated.handshake": _handshake,
    "pool.prefill_rate": _prefill_rate,
    "pool.decode_rate": _decode_rate,
    # Autoscaling.notes
    "replicas.at_minimum": _at_minimum,
    "replicas.rate_matched": _rate_matched_replicas,
    "replicas.max_replicas": _max_replicas,
    "replicas.for_load": _for_load,
    "windows.capped": _windows_capped,
    # Alternative.why_not
    "runner_up.slower": _lost_on_speed,
    "runner_up.shorter_context": _shorter_context,
    "runner_up.no_prediction": _no_prediction,
    "runner_up.does_not_fit": _does_not_fit,
}
"""Every code a note or a runner-up's verdict may carry, and the one renderer of its text."""

PERFORMANCE_CODES = frozenset({"performance.calibrated", "disaggregated.rate_matched",
                               "disaggregated.handshake", "pool.prefill_rate",
                               "pool.decode_rate"})
AUTOSCALING_CODES = frozenset({"replicas.at_minimum", "replicas.rate_matched",
                               "replicas.max_replicas", "replicas.for_load", "windows.capped"})
RUNNER_UP_CODES = frozenset({"runner_up.slower", "runner_up.shorter_context",
                             "runner_up.no_prediction", "runner_up.does_not_fit"})
"""Which field each code belongs to (docs/json.md lists them)."""


def render(code: str, data: Data) -> str:
    """The sentence of `code` for `data` (KeyError: a code outside RENDERERS)."""
    return RENDERERS[code](data)


def note(code: str, **data: Any) -> Reason:
    """A note as data: `code`, its figures, and the text its renderer makes of them."""
    if code not in RENDERERS:
        raise ValueError(f"no renderer for note code {code!r}")
    return Reason(code, render(code, data), data)
