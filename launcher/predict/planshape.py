"""The performance model's engine rebuilt from an emitted plan (calibration records, checks).

Kept apart from `perfplan` so the performance models never import the planner: this module
re-plans (planner.inputs_from_plan) and then builds the shape with `perf.engine_shape`, the one
constructor every prediction uses.
"""

from __future__ import annotations

from typing import Any

from . import perf
from .budget import Layout
from .capabilities import version_traits
from .planner import inputs_from_plan


def shape_from_plan(d: dict[str, Any],
                    constants: perf.Constants = perf.DEFAULT) -> perf.EngineShape | None:
    """The engine of plan `d` (its layout, KV cache and batch limits) with `constants`."""
    spec, hw, _ = inputs_from_plan(d)
    p, kv = d["parallel"], d["kv_cache"]
    layout = Layout(p["tp"], p["pp"], p["dp"], bool(p["expert_parallel"]), p.get("nodes", 1))
    traits = version_traits(d["vllm_version"])
    return perf.engine_shape(spec, hw, layout, kv["bytes_per_token"], kv["tokens"],
                             d["max_num_seqs"], d["max_num_batched_tokens"],
                             bool(d["enable_chunked_prefill"]), constants,
                             v0=traits.engine == "v0")
