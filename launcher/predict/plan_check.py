"""The fields an emitted plan must carry before `exec`, the doctor or calibration rebuild from it.

`load_plan` only checks that a file is a plan-shaped object; a hand-edited or truncated
plan.json (no `parallel`, a count as text) would otherwise end in a KeyError deep in the
re-plan. This says which field is missing or wrong, in one line.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError

_COUNT = "a whole number of at least 1"
_BYTES = "a whole number of bytes"

# section (None: the top level) -> field -> (check, what it must be)
_FIELDS: dict[str | None, dict[str, tuple[Any, str]]] = {
    None: {"max_model_len": ("count", _COUNT), "max_num_seqs": ("count", _COUNT),
           "max_num_batched_tokens": ("count", _COUNT),
           "gpu_memory_utilization": ("fraction", "a number in (0, 1]")},
    "model": {"hf_id": ("text", "text")},
    "gpus": {"name": ("text", "text"), "platform": ("text", "text"),
             "nodes": ("count", _COUNT), "gpus_per_node": ("count", _COUNT),
             "total_bytes": ("bytes", _BYTES), "free_bytes": ("bytes", _BYTES)},
    "parallel": {"tp": ("count", _COUNT), "pp": ("count", _COUNT), "dp": ("count", _COUNT),
                 "expert_parallel": ("flag", "true or false")},
    "kv_cache": {"dtype": ("text", "text"), "memory_bytes": ("bytes", _BYTES)},
}


def _ok(kind: str, v: Any) -> bool:
    whole = isinstance(v, int) and not isinstance(v, bool)
    if kind == "count":
        return whole and v >= 1
    if kind == "bytes":
        return whole and v >= 0
    if kind == "fraction":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1
    if kind == "flag":
        return isinstance(v, bool)
    return isinstance(v, str) and bool(v)


def check_plan(d: dict[str, Any]) -> None:
    """Raise InputError naming the first missing or mistyped field of plan dict `d`."""
    fix = "re-emit it with `vlaunch plan MODEL --emit DIR`"
    for section, fields in _FIELDS.items():
        part = d if section is None else d.get(section)
        if not isinstance(part, dict):
            raise InputError(f"the plan has no `{section}` object; {fix}")
        for name, (kind, what) in fields.items():
            where = name if section is None else f"{section}.{name}"
            if name not in part:
                raise InputError(f"the plan has no `{where}`; {fix}")
            if not _ok(kind, part[name]):
                raise InputError(f"the plan's `{where}` is {part[name]!r:.40}; it must be "
                                 f"{what}; {fix}")
    nodes = d["parallel"].get("nodes", 1)
    if not _ok("count", nodes):
        raise InputError(f"the plan's `parallel.nodes` is {nodes!r:.40}; it must be {_COUNT}; "
                         f"{fix}")
