"""The serving post-pass: parsers, the EP all-to-all backend and MTP, decided on a chosen plan.

The planner picks the layout, KV dtype and batch limits first; these three decisions then take
the plan as it is (`make_plan` calls `apply` once, after its own choices): the parsers change
no memory, the all-to-all backend's buffers and MTP's draft take theirs from the KV cache of
the chosen candidate (`rebudget`), and MTP is decided last, on the memory left, against the
performance model's prediction of that candidate. Each decision adds its reason, with its
numbers, to the plan's reasons, its flags to `vllm_args` and its environment to `env`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..inputs.hardware import GiB
from . import ep_backend, serving_flags, speculative
from .rebudget import rebudget


@dataclass
class Serving:
    parsers: serving_flags.ServingFlags = field(default_factory=serving_flags.ServingFlags)
    ep: ep_backend.Choice = field(default_factory=ep_backend.Choice)
    mtp: speculative.Decision = field(default_factory=speculative.Decision)

    def vllm_args(self) -> list[str]:
        return self.mtp.vllm_args() + self.ep.vllm_args() + self.parsers.vllm_args()

    def env(self) -> dict[str, str]:
        return self.ep.env()

    def to_dict(self) -> dict[str, Any]:
        return {"speculative": self.mtp.to_dict(), "parsers": self.parsers.to_dict(),
                "ep_backend": self.ep.to_dict()}


def apply(plan: Any, pins: Any, concurrency: int | None = None) -> Serving:
    """Decide the three features for `plan` (mutating its chosen candidate, performance,
    reasons and warnings) and return them."""
    s = Serving()
    s.parsers = serving_flags.decide(plan.model, plan.vllm_version,
                                     getattr(pins, "reasoning_parser", None),
                                     getattr(pins, "tool_call_parser", None),
                                     getattr(pins, "chat_template", None))
    plan.reasons.extend(s.parsers.reasons)
    plan.warnings.extend(s.parsers.warnings)
    c = plan.chosen
    if c.fits:
        s.ep = ep_backend.choose(plan.model, plan.hardware, c.layout, plan.objective,
                                 plan.workload, plan.vllm_version,
                                 getattr(pins, "all2all_backend", None))
        _apply_ep(plan, s.ep, concurrency, getattr(pins, "kv_cache_memory_bytes", None))
        if s.ep.reason:
            plan.reasons.append(s.ep.reason)
    s.mtp = speculative.decide(plan, pins, concurrency)
    if s.mtp.reason:
        plan.reasons.append(s.mtp.reason)
    return s


def _apply_ep(plan: Any, ep: ep_backend.Choice, concurrency: int | None,
              pinned_bytes: int | None) -> None:
    """Take DeepEP's buffers from the KV cache (and give back the CUDA graphs it turns off);
    a pinned backend whose package is missing makes the plan not startable."""
    c = plan.chosen
    if ep.applies and ep.backend is None:
        c.fits = False
        c.problem = ep.reason
        return
    if not ep.applies or (not ep.buffer_bytes and ep.cuda_graphs):
        return
    new = rebudget(plan.model, c, plan.kv_pinned, d_non_torch=ep.buffer_bytes,
                   d_cudagraph=0 if ep.cuda_graphs else -c.cudagraph, pinned_bytes=pinned_bytes)
    if not new.fits:
        ep.reason += (f"; but then {new.problem}: keeping vLLM's default {ep.default} "
                      "instead")
        ep.backend, ep.buffer_bytes, ep.cuda_graphs, ep.kubernetes = ep.default, 0, True, {}
        return
    ep.reason += f" (KV {c.tokens:,} -> {new.tokens:,} tokens per engine)"
    if ep.buffer_bytes and not ep.cuda_graphs:
        ep.reason += f"; graphs returned {c.cudagraph / GiB:.2f} GiB"
    plan.chosen = new
    a = plan.performance
    if a is not None and plan.workload is not None:
        shape = dataclasses.replace(a.shape, kv_tokens=new.tokens)
        na = speculative.reassess(a, shape, plan.workload, plan.slo, concurrency)
        na.candidate = new
        plan.performance = na
        plan.assessments[id(new)] = na


def pins_from_plan(d: dict[str, Any]) -> dict[str, Any]:
    """Every serving decision of an emitted plan as pins (`vlaunch exec`, tune's trials)."""
    out: dict[str, Any] = {}
    for mod in (speculative, serving_flags, ep_backend):
        out.update(mod.from_plan(d))
    return out
