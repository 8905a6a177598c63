"""What would fit instead, when a plan does not: more GPUs, another GPU, a shorter context, a
quantized checkpoint or a distill, each planned for real and stated with its own numbers.

Kept apart from the planner (which it calls back through `plan_fn`, so no import circle) because
it is a second question: not "how to run this here" but "what to run, or where, instead".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ...deployment.plan import Reason
from ...errors import InputError
from ...inputs.hardware import GiB, Hardware, kinds
from ...inputs.model import ModelSpec, Quant, list_profiles
from ..memory import budget as B
from .pins import Pins

PlanFn = Callable[..., Any]
"""planner.make_plan's signature: (spec, hw, pins, suggest=...) -> Plan."""


def _try(plan_fn: PlanFn, spec: ModelSpec, hw: Hardware, pins: Pins) -> Any | None:
    try:
        plan = plan_fn(spec, hw, pins, suggest=False)
    except InputError:
        return None
    return plan if plan.fits else None


def _brief(plan: Any) -> str:
    c = plan.chosen
    return (f"{c.label()}, {c.weights / GiB:.1f} GiB weights per GPU, "
            f"{c.tokens:,} KV tokens, {c.max_model_len:,}-token context, "
            f"{c.concurrency:.1f} concurrent")


def other_gpus(plan_fn: PlanFn, spec: ModelSpec, hw: Hardware, pins: Pins,
               most: int = 3) -> list[Reason]:
    """Other data-centre GPUs one node of which holds the model (DeepSeek-V3 misses 8xH100,
    8xH200 fits), cheapest replica at list price first, each with its plan and price."""
    found: list[tuple[float, Reason]] = []
    for k in kinds():
        n = next((n for n in k.node_sizes if B.holds_roughly(spec, k.total_bytes, n)), 0)
        plan = (_try(plan_fn, spec, Hardware(k, 1, n, k.total_bytes, k.total_bytes), pins)
                if k.datacenter and k.name != hw.kind.name and n else None)
        if plan:
            p = k.price_for(n)
            text = (f"another GPU: {n}x{k.name} fits ({_brief(plan)}), "
                    + (f"list ${p.usd_per_hour:.2f}/GPU-hour ({p.source}, {p.date})"
                       if p else "no list price"))
            data = {"gpus": f"{n}x{k.name}", "usd_per_gpu_hour": p.usd_per_hour if p else None,
                    "price_source": p.source if p else None}
            found.append((p.usd_per_hour * n if p else math.inf,
                          Reason("suggest.other_gpu", text, data)))
    return [r for _, r in sorted(found, key=lambda t: t[0])[:most]]


def suggestions(spec: ModelSpec, hw: Hardware, pins: Pins, plan_fn: PlanFn) -> list[Reason]:
    """Ranked alternatives that do fit, each with its own numbers; `plan_fn` is the planner's
    `make_plan` (passed in, so this module never imports the planner that calls it)."""
    out: list[Reason] = []
    free_pins = dataclasses.replace(pins, tp=None, pp=None, dp=None)
    if not hw.is_cpu:
        per_node = max(hw.gpus_per_node, hw.kind.max_per_node)
        options = [(1, n) for n in hw.kind.node_sizes if hw.nodes == 1 and hw.gpus_per_node < n]
        options += [(n, per_node) for n in (2, 3, 4) if n > hw.nodes]
        for nodes, gpn in options:
            bigger = dataclasses.replace(hw, nodes=nodes, gpus_per_node=gpn)
            plan = _try(plan_fn, spec, bigger, free_pins)
            if plan:
                layout = f"{nodes}x{gpn}x{hw.kind.name}" if nodes > 1 else f"{gpn}x{hw.kind.name}"
                out.append(Reason("suggest.more_gpus", f"more GPUs: {layout} fits ({_brief(plan)})"
                           + (" across nodes" if nodes > 1 else ""), {"gpus": layout}))
                break
    if not hw.is_cpu:
        out += other_gpus(plan_fn, spec, hw, free_pins)
    if pins.max_model_len:
        relaxed = plan_fn(spec, hw, dataclasses.replace(pins, max_model_len=None),
                            suggest=False)
        if relaxed.fits:
            out.append(Reason(
                "suggest.shorter_context",
                f"shorter context: --max-model-len {relaxed.chosen.max_model_len:,} fits "
                f"({_brief(relaxed)})",
                {"max_model_len": relaxed.chosen.max_model_len}))
    if spec.quant.method in ("none", "fp8_block", "fp8_channel"):
        quant = Quant("int4_group", 4, 128)
        q_spec = dataclasses.replace(spec, quant=quant, name=f"{spec.name}-awq",
                                     checkpoint_bytes=None)
        plan = _try(plan_fn, q_spec, hw, free_pins)
        if plan:
            out.append(Reason(
                "suggest.quantized",
                f"a quantized variant: an AWQ/GPTQ int4 checkpoint of {spec.name} "
                f"({B.weights_bytes(q_spec) / GiB:.0f} GiB) fits ({_brief(plan)})",
                {"weights_bytes": B.weights_bytes(q_spec)}))
    if spec.architecture.startswith("deepseek"):
        distills = [p for p in list_profiles() if p.distill_of]
        distills.sort(key=lambda p: B.param_count(p), reverse=True)
        for d in distills:
            plan = _try(plan_fn, d, hw, Pins(vllm_version=pins.vllm_version))
            if plan:
                out.append(Reason(
                    "suggest.distill",
                    f"an R1 distill: {d.name} ({B.param_count(d) / 1e9:.1f}B) fits "
                    f"({_brief(plan)})",
                    {"model": d.name}))
                break
    if not out:
        out.append(Reason(
            "suggest.none",
            "nothing close fits this hardware; try a larger GPU class"))
    return out

