"""The user's pins: what the command line fixed, checked before any planning; the planner decides
the rest. Apart from the candidates' memory (memory/candidate_memory.py) because every stage
that plans (serve, tune, capacity, the doctor) builds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ...errors import InputError

KV_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")

Origin = Literal["you", "plan"]
"""Who fixed a pinned value: the user on the command line, or the emitted plan `exec --replan`
plans again from (every decision of it pinned; only the user's own keep "pinned by you")."""

_SAID = {"you": "pinned by you", "plan": "from the emitted plan"}


def said(origin: Origin) -> str:
    """A pin's origin in words: the one phrase every pinned reason's text uses."""
    return _SAID[origin]


def origin_data(origin: Origin | None) -> dict[str, Any]:
    """A pin's origin as reason data: `pinned` (the user's; what a program tests) and
    `from_plan` (the emitted plan's, under `exec --replan`)."""
    return {"pinned": origin == "you", **({"from_plan": True} if origin == "plan" else {})}


@dataclass(frozen=True)
class Pins:
    """What the user fixed on the command line; the planner decides the rest."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    expert_parallel: bool | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None
    vllm_version: str | None = None
    block_size: int | None = None
    pin_kv_memory: bool = False
    # serving features (predict/features/serving.py): None leaves the decision to the planner
    speculative: bool | None = None
    num_speculative_tokens: int | None = None
    mtp_acceptance: float | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None
    all2all_backend: str | None = None
    eplb: bool | None = None  # --eplb/--no-eplb (predict/features/eplb.py); None: the planner's
    from_plan: frozenset[str] = frozenset()
    """The fields above that `exec --replan` took from the emitted plan, not from the user
    (run/exec_plan.py replan_pins): their reasons say "from the emitted plan"."""

    def origin(self, *names: str) -> Origin | None:
        """Who fixed the first of `names` that is set (None: none is, the planner decides)."""
        for n in names:
            if getattr(self, n) is not None:
                return "plan" if n in self.from_plan else "you"
        return None

    def validate(self) -> None:
        for name in ("tp", "pp", "dp", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InputError(f"--max-model-len must be a positive number of tokens, "
                             f"got {self.max_model_len}")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise InputError(f"--gpu-memory-utilization must be in (0, 1], got {u}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_DTYPES:
            raise InputError(f"unknown --kv-cache-dtype '{self.kv_cache_dtype}'; accepted: "
                             f"{', '.join(KV_DTYPES)}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InputError("--kv-cache-memory-bytes must be positive")
