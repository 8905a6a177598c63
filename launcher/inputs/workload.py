"""What the deployment will be asked to do: request lengths, the SLO, the objective.

A plan is only "fast" for a workload. The planner needs the mean prompt and answer lengths (the
prefill and decode work per request), the service-level objective a request must meet (time to
first token, time per output token after it) and what to maximise. Presets name common shapes
so a user need not know their token counts; the plan always says which lengths it assumed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..errors import InputError

PRESETS: dict[str, tuple[int, int, str]] = {
    "chat": (1024, 256, "assistant chat: 1,024 prompt tokens, 256 answer tokens"),
    "rag": (8192, 256, "retrieval-augmented answers: 8,192 prompt tokens, 256 answer tokens"),
    "reasoning": (1024, 4096, "reasoning models thinking aloud: 1,024 prompt, 4,096 answer"),
    "agent": (16384, 512, "tool-using agents with long histories: 16,384 prompt, 512 answer"),
    "batch": (1024, 1024, "offline batch jobs: 1,024 prompt, 1,024 answer"),
}
DEFAULT_PRESET = "chat"

OBJECTIVES = ("throughput", "latency", "balanced")
DEFAULT_OBJECTIVE = "balanced"

DEFAULT_TTFT_MS = 2000.0
DEFAULT_TPOT_MS = 50.0
"""Interactive defaults: a first token within 2 s and 20 tokens/s per user (50 ms per token),
faster than people read; the SLO the capacity lesson this product grew from used."""


@dataclass(frozen=True)
class Workload:
    """Mean tokens per request; `assumed` when the user gave neither lengths nor a preset."""

    input_len: int
    output_len: int
    name: str = "custom"
    assumed: bool = False
    synchronized: bool = False
    """Every request has exactly these lengths and the clients start together, as benchmark
    clients (vllm bench serve's random dataset) do: the requests then move in waves. Real users
    arrive at random times with varied lengths: staggered (False)."""

    def describe(self) -> str:
        text = f"{self.input_len:,} prompt + {self.output_len:,} answer tokens per request"
        if self.name != "custom":
            text += f" ({self.name})"
        return text + (" - assumed, none given: pass --workload or --input-len/--output-len"
                       if self.assumed else "")


@dataclass(frozen=True)
class SLO:
    """Time to first token and mean time per output token a request must meet."""

    ttft_ms: float = DEFAULT_TTFT_MS
    tpot_ms: float = DEFAULT_TPOT_MS

    def met(self, ttft_ms: float, tpot_ms: float) -> bool:
        return ttft_ms <= self.ttft_ms and tpot_ms <= self.tpot_ms

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_ms:,.0f} ms, TPOT <= {self.tpot_ms:,.1f} ms"


def resolve_workload(input_len: int | None = None, output_len: int | None = None,
                     preset: str | None = None) -> Workload:
    """Explicit lengths win over the preset's; nothing given means the chat preset, assumed."""
    for flag, value in (("--input-len", input_len), ("--output-len", output_len)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be a positive number of tokens, got {value}")
    if preset is not None and preset not in PRESETS:
        raise InputError(f"unknown --workload '{preset}'; choose one of {', '.join(PRESETS)}")
    name = preset or DEFAULT_PRESET
    d_in, d_out, _ = PRESETS[name]
    assumed = preset is None and input_len is None and output_len is None
    if preset is None and (input_len is not None or output_len is not None):
        name = "custom"
    return Workload(input_len or d_in, output_len or d_out, name, assumed)


def fit_to_context(w: Workload, context: int) -> Workload:
    """An assumed workload (nobody asked for it) that would not fit `context` is scaled down to
    it, both lengths in proportion; a workload the user gave is returned as it is (the planner
    refuses it: a request longer than the context can never be served)."""
    need = w.input_len + w.output_len
    if not w.assumed or need <= context or context < 2:
        return w
    out = max(1, min(w.output_len * context // need, context - 1))
    return dataclasses.replace(w, input_len=context - out, output_len=out)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*$")


def _duration_ms(text: str, key: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise InputError(f"malformed --slo value {key}={text!r}: give a number with s or ms, "
                         "e.g. ttft=2s,tpot=50ms")
    value = float(m.group(1)) * (1000.0 if m.group(2) == "s" else 1.0)
    if value <= 0:
        raise InputError(f"--slo {key} must be more than 0, got {text!r}")
    return value


def parse_slo(text: str | None) -> SLO:
    """`ttft=2s,tpot=50ms` (either key may be left out: its default stays)."""
    if not text:
        return SLO()
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot"):
            raise InputError(f"malformed --slo {text!r}: use ttft=2s,tpot=50ms (keys ttft, tpot; "
                             "units s or ms)")
        values[f"{key}_ms"] = _duration_ms(value, key)
    return SLO(**values)


def check_objective(objective: str | None) -> str:
    objective = objective or DEFAULT_OBJECTIVE
    if objective not in OBJECTIVES:
        raise InputError(f"unknown --objective '{objective}'; choose one of "
                         f"{', '.join(OBJECTIVES)}")
    return objective
