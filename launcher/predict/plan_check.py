"""The fields an emitted plan must carry before `exec`, the doctor or calibration rebuild from it.

`load_plan` only checks that a file is a plan-shaped object; a hand-edited or truncated
plan.json (no `parallel`, a count as text) would otherwise end in a KeyError deep in the
re-plan. This says which field is missing or wrong, in one line.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import InputError
from ..inputs import vllm_flags as F

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


# What `exec` takes from a plan besides the fields above, each through the flag table's check
# (issue 31: a plan.json on a shared volume is the attacker's text): (section path, field,
# the table's flag whose check applies, or a plain kind).
_EXEC_FIELDS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("serving", "parsers"), "reasoning_parser", "reasoning_parser"),
    (("serving", "parsers"), "tool_call_parser", "tool_call_parser"),
    (("serving", "parsers"), "chat_template", "chat_template"),
    (("serving", "parsers"), "tokenizer_mode", "tokenizer_mode"),
    (("serving", "ep_backend"), "backend", "all2all_backend"),
    (("kv_cache",), "dtype", "kv_cache_dtype"),
    (("model",), "revision", "revision"),
    (("model",), "commit", "revision"),
)
_EXEC_NUMBERS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("serving", "speculative"), "num_speculative_tokens", "whole"),
    (("serving", "speculative", "acceptance"), "first", "fraction"),
    (("performance",), "input_len", "count"),
    (("performance",), "output_len", "count"),
    (("performance", "slo"), "ttft_ms", "positive"),
    (("performance", "slo"), "tpot_ms", "positive"),
)


def _section(d: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    part: Any = d
    for key in path:
        part = part.get(key) if isinstance(part, dict) else None
    return part if isinstance(part, dict) else None


def _number_ok(kind: str, v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    if kind == "whole":
        return isinstance(v, int) and v >= 0
    if kind == "count":
        return isinstance(v, int) and v >= 1
    if kind == "fraction":
        return 0 <= v <= 1
    return v > 0


def check_exec_plan(d: dict[str, Any], plan_dir: str | None = None) -> None:
    """Everything `exec` takes from plan dict `d` into vLLM's argv or the re-plan: its own
    `vllm_args` through the flag table's allow-list (no other model, no flag the planner never
    writes), each serving field with its flag's value check (a chat template only inside the
    model's or the plan's folder, parsers and backends only as plain names) and each number it
    reads finite and in range. One line naming the field; never a traceback."""
    check_plan(d)
    fix = "re-emit it with `vlaunch plan MODEL --emit DIR`"
    ctx = F.plan_context(d, plan_dir)
    F.check_plan_args([str(a) for a in d["vllm_args"]], ctx)
    for path, name, dest in _EXEC_FIELDS:
        part = _section(d, path)
        value = part.get(name) if part else None
        if value is None or (dest.endswith("_parser") and value == "none"):
            continue
        why = F.check_value(dest, value, ctx)
        if why is not None:
            where = ".".join((*path, name))
            raise InputError(f"the plan's `{where}` is {str(value)[:64]!r}, which {why}; {fix}")
    for path, name, kind in _EXEC_NUMBERS:
        part = _section(d, path)
        if part is None or name not in part or part[name] is None:
            continue
        if not _number_ok(kind, part[name]):
            where = ".".join((*path, name))
            raise InputError(f"the plan's `{where}` is {part[name]!r:.40}; it must be a "
                             f"{'whole ' if kind in ('whole', 'count') else ''}number"
                             f"{' in [0, 1]' if kind == 'fraction' else ''}"
                             f"{' above 0' if kind in ('count', 'positive') else ''}; {fix}")
    version = d.get("vllm_version")
    if version is not None and not (isinstance(version, str) and _VERSION.fullmatch(version)):
        raise InputError(f"the plan's `vllm_version` is {version!r:.40}; it must be a release "
                         f"such as 0.32.0; {fix}")


_VERSION = re.compile(r"\d{1,4}(\.\d{1,6}){0,3}([.+-][A-Za-z0-9.+-]{1,40})?")
