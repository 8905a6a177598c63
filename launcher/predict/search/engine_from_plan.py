"""The performance model's engine rebuilt from a plan (calibration records, checks).

Kept apart from `speed_decisions` so the performance models never import the planner: this module
loads the plan's model and hardware (plan_inputs.inputs_from_plan) and then builds the shape
with `request_model.engine_shape`, the one constructor every prediction uses.
"""

from __future__ import annotations

from ...deployment.plan import Deployment
from ..features.capabilities import version_traits
from ..memory.budget import Layout
from ..speed import request_model as perf
from .plan_inputs import inputs_from_plan


def shape_from_plan(d: Deployment,
                    constants: perf.Constants = perf.DEFAULT) -> perf.EngineShape | None:
    """The engine of plan `d` (its layout, KV cache and batch limits) with `constants`."""
    spec, hw, _ = inputs_from_plan(d)
    e, kv = d.engine, d.pool.kv_cache
    p = e.parallel
    layout = Layout(p.tp, p.pp, p.dp, p.expert_parallel, p.nodes)
    traits = version_traits(d.vllm_version)
    return perf.engine_shape(spec, hw, layout, kv.bytes_per_token, kv.tokens, e.max_num_seqs,
                             e.max_num_batched_tokens, e.enable_chunked_prefill, constants,
                             v0=traits.engine == "v0")
