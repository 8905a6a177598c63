"""What an emitted plan was made from, for the commands that must plan again from it.

`vlaunch exec` runs a plan as it is; only `exec --replan`, the doctor (which plans the fix of
a failed launch with the same search) and tune's calibration (which rebuilds the performance
model's engine) need the planner's inputs back: the model at the plan's commit, the hardware
as the plan saw it (free memory included) and every decision pinned. They read them from the
typed Deployment (launcher/deployment), never from the JSON.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from ...deployment.plan import Deployment, Serving
from ...errors import InputError
from ...inputs.hardware import Hardware, parse_gpus
from ...inputs.model import ModelSpec, load_model
from ..features.serving_flags import NONE
from ..features.speculative import ACCEPTANCE_PINNED
from .pins import Pins


def serving_pins(s: Serving | None) -> dict[str, Any]:
    """The serving decisions (MTP, parsers, all-to-all backend) of a plan as pins."""
    if s is None:
        return {}
    out: dict[str, Any] = {}
    mtp = s.speculative
    if not mtp.enabled:
        out["speculative"] = False
    else:
        out.update(speculative=True, num_speculative_tokens=mtp.num_speculative_tokens)
        if mtp.acceptance is not None and mtp.acceptance.source == ACCEPTANCE_PINNED:
            out["mtp_acceptance"] = mtp.acceptance.first
    p = s.parsers
    out.update(reasoning_parser=p.reasoning_parser or NONE,
               tool_call_parser=p.tool_call_parser or NONE, chat_template=p.chat_template)
    ep = s.ep_backend
    if ep.applies and ep.backend and ep.backend != ep.vllm_default:
        out["all2all_backend"] = ep.backend
    if s.eplb is not None and s.eplb.applies:  # re-planned as decided, on or off
        out["eplb"] = s.eplb.enabled
    return out


def inputs_from_plan(dep: Deployment) -> tuple[ModelSpec, Hardware, Pins]:
    """The model, hardware and pins that re-plan exactly `dep`."""
    if not dep.fits:
        raise InputError(f"the plan does not fit ({dep.problem or 'no layout fits'}): there is "
                         "nothing to run or re-plan; plan again with `vlaunch plan`")
    m, g, pool = dep.model, dep.hardware, dep.pool
    e, kv = pool.engine, pool.kv_cache
    # the commit the plan was made from: re-planned from that config, offline from the cache
    ref = m.path or m.hf_id
    if ref is None:
        raise InputError("the plan's model has neither `path` nor `hf_id`; re-emit it with "
                         "`vlaunch plan MODEL --emit DIR`")
    spec = load_model(ref, None if m.path else (m.commit or m.revision))
    if m.commit and not m.path:  # vLLM still gets the revision the user gave
        spec = replace(spec, revision=m.revision)
    hw = parse_gpus("cpu" if g.platform == "cpu" else f"{g.nodes}x{g.gpus_per_node}x{g.name}")
    if g.platform != "cpu":
        hw = replace(hw, total_bytes=g.total_bytes, free_bytes=g.free_bytes, source=g.source)
    p = e.parallel
    pins = Pins(tp=p.tp, pp=p.pp, dp=p.dp, expert_parallel=p.expert_parallel,
                max_model_len=e.max_model_len, kv_cache_dtype=e.kv_cache_dtype,
                gpu_memory_utilization=None if kv.pinned else e.gpu_memory_utilization,
                kv_cache_memory_bytes=kv.memory_bytes if kv.pinned else None,
                max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                enforce_eager=e.enforce_eager, vllm_version=dep.vllm_version,
                **serving_pins(pool.serving))
    return spec, hw, pins


PINNED_BY = {
    "layout": ("tp", "pp", "dp", "expert_parallel"),
    "vllm.version": ("vllm_version",),
    "gpu_memory_utilization.pinned": ("gpu_memory_utilization",),
    "kv_cache_dtype.pinned": ("kv_cache_dtype",),
    "max_model_len.pinned": ("max_model_len",),
    "parsers.reasoning": ("reasoning_parser",),
    "parsers.tools": ("tool_call_parser",),
    "parsers.chat_template": ("chat_template",),
    "mtp": ("speculative", "num_speculative_tokens", "mtp_acceptance"),
    "all2all": ("all2all_backend",),
    "eplb": ("eplb",),
}
"""The pins behind each reason that can say "pinned by you" (by code, else by code family): a
reason the emitted plan marked `data.pinned` names the pins that were the user's."""


def user_pins(dep: Deployment) -> frozenset[str]:
    """The Pins fields the user fixed when `dep` was planned, read from its reasons' data."""
    out: set[str] = set()
    for r in dep.reasons:
        if r.data.get("pinned"):
            out.update(PINNED_BY.get(r.code) or PINNED_BY.get(r.code.split(".")[0], ()))
    return frozenset(out)


def replan_pins(dep: Deployment, pins: Pins) -> Pins:
    """`pins` (every decision of `dep`, from `inputs_from_plan`) with each pin the user did not
    give marked as the emitted plan's: the planner then says "from the emitted plan" where it
    would say "pinned by you", in the same sentence it always renders (`exec --replan`)."""
    every = frozenset(f.name for f in fields(Pins)) - {"from_plan"}
    return replace(pins, from_plan=every - user_pins(dep))
