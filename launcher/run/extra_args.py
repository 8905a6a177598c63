"""The user's vLLM flags after `--` (vlaunch serve MODEL -- FLAGS): which are planner pins.

Why a module of its own: a layout flag after `--` changes how many GPUs an engine needs, so it
must be planned with, never passed through behind the planner's back (issue 13, item 7); the
serve loop only asks for the pins and the flags left to pass on.
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from ..inputs import vllm_flags as F
from ..predict.search.planner import Pins
from .vllmargs import drop_flag

PARALLEL_FLAGS = (("tp", "tensor_parallel_size"), ("pp", "pipeline_parallel_size"),
                  ("dp", "data_parallel_size"))
"""vLLM flags that change how many GPUs an engine needs: after `--` they are pins for the
planner, never passed through behind its back (issue 13, item 7)."""


def parallel_flags(extra: list[str]) -> dict[str, tuple[str, int]]:
    """{pin: (flag as given, value)} for the layout flags in `extra`; InputError when a value
    is not a positive whole number."""
    found: dict[str, tuple[str, int]] = {}
    parsed = F.parse(extra)
    for key, dest in PARALLEL_FLAGS:
        if dest not in parsed.values:
            continue
        raw, name = parsed.values[dest], parsed.given[dest]
        try:
            value = int(raw)
        except (TypeError, ValueError):
            value = 0
        if value < 1:
            raise InputError(f"{name} {raw!r} after --: expected a whole number >= 1")
        found[key] = (name, value)
    return found


def pins_from_extra(pins: Pins, extra: list[str]) -> tuple[Pins, list[str], list[str]]:
    """Layout flags after `--` become pins (the plan is made with them, so a layout that needs
    more GPUs than exist is refused like `--tp` would be). Returns (pins, extra without them,
    notes)."""
    found = parallel_flags(extra)
    notes = []
    for key, (name, value) in found.items():
        mine = getattr(pins, key)
        if mine is not None and mine != value:
            raise InputError(f"--{key} {mine} (pinned) and {name} {value} after -- disagree; "
                             "give one")
        pins = dataclasses.replace(pins, **{key: value})
        for _, dest in PARALLEL_FLAGS:
            if F.spec_of(name) is F.BY_DEST[dest]:
                for n in F.BY_DEST[dest].names:
                    extra = drop_flag(extra, n)
        notes.append(f"{name} {value} after -- is a pin (--{key} {value}); planned with it")
    return pins, extra, notes
