"""The doctor's fixes checked by the planner: the failed launch's settings (what the log shows it
ran with) plus the fix, planned; the first candidate that fits becomes the fix and its command.

Why a module of its own: checking needs the model, the hardware and the planner, which the
log-only fixes (`doctor_logfix`) never do; keeping them apart keeps serve's failure message
free of planning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..inputs.hardware import parse_gpus
from ..inputs.model import load_model
from ..inputs.vllm_failures import Diagnosis, Report, to_failure
from ..inputs.vllm_loglines import Facts
from ..predict.planner import Pins, inputs_from_plan, make_plan
from ..predict.replan import replan_pins
from .doctor_logfix import flag_of

# --- fixes checked by the planner --------------------------------------------------------------


@dataclass
class PlanContext:
    """What the deployment was planned for: model, hardware, pins and the plan itself."""

    spec: Any
    hardware: Any
    pins: Any
    plan: Any
    gpus: str  # the --gpus value that reproduces `hardware` on the command line
    goals: dict[str, Any] = field(default_factory=dict)
    source: str = "model"  # "model" (MODEL --gpus), "plan" (--plan) or "log" (what it says)


def context_from_plan(d: dict[str, Any]) -> PlanContext:
    """Model, hardware and pins of an emitted plan.json (as `vlaunch exec` rebuilds them)."""
    spec, hw, pins = inputs_from_plan(d)
    g = d["gpus"]
    gpus = "cpu" if g["platform"] == "cpu" else f"{g['nodes']}x{g['gpus_per_node']}x{g['name']}"
    return PlanContext(spec, hw, pins, make_plan(spec, hw, pins), gpus, source="plan")


def context_from_model(model: str, gpus: str | None, pins: Any, goals: dict[str, Any],
                       hardware: Any) -> PlanContext:
    spec = load_model(model)
    plan = make_plan(spec, hardware, pins, **goals)
    return PlanContext(spec, hardware, pins, plan, gpus or "", goals, "model")


def context_from_log(report: Report) -> PlanContext | None:
    """What the log itself says about the launch (its model, the device's memory, the engine
    it ran on), when that is enough to plan; None otherwise. The model must be a profile or a
    local folder (nothing is downloaded) and the device size printed by vLLM."""
    facts = report.facts
    model = facts.model
    if not isinstance(model, str):
        return None
    world = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = facts.arg(key)
        world *= value if isinstance(value, int) and value > 0 else 1
    total = next((d.numbers.get("total") for d in report.diagnoses
                  if isinstance(d.numbers.get("total"), (int, float))), None)
    if facts.cpu:
        gpus = "cpu"
    elif total:
        gpus = f"{world}x{total:g}GiB"
    else:
        return None
    try:
        with _offline():
            spec = load_model(model)
        hw = parse_gpus(gpus)
        pins = Pins()
        return PlanContext(spec, hw, pins, None, gpus, source="log")
    except InputError:
        return None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """The model as this machine has it (a folder, a profile, the HF cache) and never the Hub:
    reading a log must not reach the network (huggingface_hub's own HF_HUB_OFFLINE switch,
    which launcher.inputs.hub honours, set for the look-up and restored)."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


# The failed launch's vLLM arguments ("non-default args") that are planner pins.
_ARG_PINS = {"max_model_len": "max_model_len", "gpu_memory_utilization": "gpu_memory_utilization",
             "kv_cache_dtype": "kv_cache_dtype", "tensor_parallel_size": "tp",
             "pipeline_parallel_size": "pp", "data_parallel_size": "dp",
             "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
             "kv_cache_memory_bytes": "kv_cache_memory_bytes", "enforce_eager": "enforce_eager"}
_FLAG_PINS = {flag_of(k): v for k, v in _ARG_PINS.items()}
_FLAG_PINS.update({"--tp": "tp", "--pp": "pp", "--dp": "dp"})


def launch_pins(ctx: PlanContext, facts: Facts) -> Any:
    """The pins of the launch that failed: the context's, with every setting the log shows it
    ran with (its "non-default args", the max model len it used, its vLLM version) on top, so
    a fix is checked against what really ran, not against what the planner would choose."""
    changes: dict[str, Any] = {}
    if facts.args:  # "non-default args" lists every non-default: an absent one was vLLM's
        changes.update(tp=1, pp=1, dp=1,
                       expert_parallel=bool(facts.arg("enable_expert_parallel")))
        if not facts.arg("speculative_config"):
            changes.update(speculative=False, num_speculative_tokens=None)
    for key, pin in _ARG_PINS.items():
        value = facts.arg(key)
        if value is not None and value is not False:
            changes[pin] = value
    used = facts.number("max_model_len")
    if "max_model_len" not in changes and used and ctx.pins.max_model_len is None:
        changes["max_model_len"] = int(used)
    version = facts.numbers.get("vllm_version")
    if isinstance(version, str) and ctx.pins.vllm_version is None:
        changes["vllm_version"] = version.split("+")[0]
    pins = dataclasses.replace(ctx.pins, **changes)
    try:
        pins.validate()
    except InputError:
        return ctx.pins
    return pins


def _with_flags(pins: Any, args: list[str]) -> Any | None:
    """`pins` with a fix's vLLM flags applied; None when a flag is not a planner decision."""
    changes: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name = args[i]
        pin = _FLAG_PINS.get(name)
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        i += 2 if value is not None else 1
        if pin is None:
            return None
        if pin == "enforce_eager":
            changes[pin] = True
        elif pin in ("gpu_memory_utilization",):
            changes[pin] = float(value or 0)
        elif pin == "kv_cache_dtype":
            changes[pin] = value
        else:
            changes[pin] = int(value or 0)
    return dataclasses.replace(pins, **changes)


def _failure_of(d: Diagnosis) -> Any:
    """The diagnosis as the `Failure` that `replan_pins` understands."""
    return to_failure(d)


def _candidates(d: Diagnosis, ctx: PlanContext, pins: Any, plan: Any) -> Iterator[
        tuple[Any, str]]:
    """Pins that might fix the failure, best first: the log's own fix, vLLM's measured
    re-plan, then the planner's own choice of the decision the failure is about."""
    if d.fix_args:
        fixed = _with_flags(pins, d.fix_args)
        if fixed is not None:
            yield fixed, "the log's fix"
    if plan is not None:
        got = _replanned(d, ctx, pins, plan)
        if got is not None:
            yield got
    if d.cause in ("kv_cache_too_small", "no_kv_cache_memory"):
        if pins.gpu_memory_utilization is not None and pins.kv_cache_memory_bytes is None \
                and not ctx.hardware.is_cpu:
            yield (dataclasses.replace(pins, gpu_memory_utilization=None),
                   "the planner's utilization for this context")
        if pins.max_model_len is not None:
            yield (dataclasses.replace(pins, max_model_len=None),
                   "the longest context the planner fits")
    if d.cause in ("cuda_oom", "sampler_warmup_oom") and pins.max_num_seqs is not None:
        yield dataclasses.replace(pins, max_num_seqs=None), "the planner's --max-num-seqs"


def _replanned(d: Diagnosis, ctx: PlanContext, pins: Any, plan: Any) -> tuple[Any, str] | None:
    """New pins for the failure, from what the log measured; None when no pin helps."""
    if d.cause in ("kv_cache_too_small", "free_memory_below_utilization"):
        return replan_pins(pins, plan, _failure_of(d))
    if d.cause in ("cuda_oom", "no_kv_cache_memory") and d.consumer == "weights":
        return None
    if d.cause in ("cuda_oom", "no_kv_cache_memory") and d.consumer == "cuda_graphs" \
            and not ctx.hardware.is_cpu:
        return (dataclasses.replace(pins, enforce_eager=True),
                "CUDA graphs are the item that does not fit: run eager")
    if d.cause in ("cuda_oom", "sampler_warmup_oom"):
        return replan_pins(pins, plan, dataclasses.replace(_failure_of(d), kind="DEVICE_OOM"))
    if d.cause in ("kv_cache_dtype_unsupported", "invalid_kv_cache_dtype"):
        return (dataclasses.replace(pins, kv_cache_dtype="auto"), "KV cache in the model dtype")
    if d.cause == "max_model_len_exceeds_model":
        return (dataclasses.replace(pins, max_model_len=int(d.numbers["derived"])),
                "the model's own context")
    return None


_PIN_FLAGS = {"max_model_len": "--max-model-len", "kv_cache_dtype": "--kv-cache-dtype",
              "gpu_memory_utilization": "--gpu-memory-utilization",
              "max_num_seqs": "--max-num-seqs",
              "max_num_batched_tokens": "--max-num-batched-tokens",
              "kv_cache_memory_bytes": "--kv-cache-memory-bytes", "tp": "--tensor-parallel-size",
              "enforce_eager": "--enforce-eager"}


def _changed_flags(old: Any, new: Any, settled: Any) -> list[str]:
    """The vLLM flags of the decisions the fix changed (`old` -> `new`, a pin set or released
    to the planner), each with the value of the plan that was checked (`settled`)."""
    out: list[str] = []
    for name, flag in _PIN_FLAGS.items():
        value = getattr(settled, name)
        if getattr(old, name) == getattr(new, name) or value is None or value is False:
            continue
        out += [flag] if value is True else [flag, _fmt(name, value)]
    return out


def _fmt(name: str, value: Any) -> str:
    return f"{value:.2f}" if name == "gpu_memory_utilization" else str(value)


def _plan(ctx: PlanContext, pins: Any) -> Any | None:
    try:
        return make_plan(ctx.spec, ctx.hardware, pins, **ctx.goals)
    except InputError:
        return None


PLANNED_CAUSES = {"kv_cache_too_small", "no_kv_cache_memory", "free_memory_below_utilization",
                   "cuda_oom", "sampler_warmup_oom", "kv_cache_dtype_unsupported",
                   "invalid_kv_cache_dtype", "max_model_len_exceeds_model", "tp_not_divisible"}


def apply_plan_fixes(report: Report, ctx: PlanContext) -> None:
    """Run every fix through the planner with the failed launch's own settings: the first
    candidate (the log's fix, the measured re-plan, the planner's own choice) that the
    planner says fits becomes the fix, and the `fix:` flags and the `run:` command come from
    the same pins. A fix the planner says will not fit is never shown."""
    if not any(d.cause in PLANNED_CAUSES for d in report.diagnoses):
        return  # nothing the planner decides (a port, a missing module): no plan to make
    pins = launch_pins(ctx, report.facts)
    failed = _plan(ctx, pins)
    for d in report.diagnoses:
        if d.cause not in PLANNED_CAUSES:
            continue
        d.explain = [_checked_alternative(x, ctx, pins) for x in d.explain]
        refused: list[str] = []
        for new, why in _candidates(d, ctx, pins, failed):
            plan = _plan(ctx, new)
            if plan is None or not _fits(plan):
                if plan is not None and why == "the log's fix":
                    refused.append(f"the log's fix ({shlex.join(d.fix_args)}) does not fit by "
                                   f"vlaunch's planner: {_problem(plan)}")
                continue
            settled = _settled(new, plan)
            d.fix_args = _changed_flags(pins, new, settled)
            d.explain = ([f"checked by vlaunch's planner ({_SOURCES[ctx.source]}): {why}"]
                         + refused + d.explain)
            d.serve_command = serve_command_from_pins(ctx, settled, d.fix_env)
            break
        else:
            d.explain = refused + d.explain + [
                "vlaunch's planner found no fix that fits this model on this hardware with "
                "these settings"]
            d.fix_args, d.serve_command = [], None


def _fits(plan: Any) -> bool:
    """The planner's verdict, and every GPU's consumers within the card: a pinned KV size is
    what vLLM allocates (it skips profiling), so one larger than the card is an OOM even
    where a planner release takes the pin on trust."""
    if not plan.fits:
        return False
    d = plan.to_dict()
    g = d["per_gpu"]
    used = sum(g.get(k, 0) for k in ("weights_bytes", "activation_bytes", "cudagraph_bytes",
                                      "non_torch_bytes", "kv_cache_bytes"))
    return plan.hardware.is_cpu or used <= d["gpus"]["total_bytes"]


def _problem(plan: Any) -> str:
    if not plan.fits:
        return plan.chosen.problem
    d = plan.to_dict()
    g = d["per_gpu"]
    return (f"the pinned KV cache ({g['kv_cache_bytes'] / (1 << 30):.1f} GiB) and weights "
            f"({g['weights_bytes'] / (1 << 30):.1f} GiB) exceed the "
            f"{d['gpus']['total_bytes'] / (1 << 30):.1f} GiB card")


_ALTERNATIVE = re.compile(r"--kv-cache-memory-bytes (\d+)")


def _checked_alternative(line: str, ctx: PlanContext, pins: Any) -> str:
    """An explanation that offers another flag (a KV size for the asked context) keeps the
    offer only when the planner says it fits; otherwise it says why not."""
    m = _ALTERNATIVE.search(line)
    if m is None:
        return line
    plan = _plan(ctx, dataclasses.replace(pins, kv_cache_memory_bytes=int(m.group(1))))
    if plan is not None and _fits(plan):
        return line + " (checked: the planner fits it)"
    why = _problem(plan) if plan is not None else "the planner refused the settings"
    return (f"--kv-cache-memory-bytes {int(m.group(1)):,} for the asked context does not fit "
            f"by vlaunch's planner: {why}")


_SOURCES = {"model": "the model and GPUs given", "plan": "the plan given",
            "log": "the model, memory and vLLM version the log shows"}


def _settled(pins: Any, plan: Any) -> Any:
    """The pins with each pinned decision set to what the plan made of it (the planner may
    raise --max-num-batched-tokens to the context on CPU), and every decision the fix leaves
    to the planner pinned to the plan's choice, so the command runs exactly the checked plan."""
    c = plan.chosen
    made = {"tp": c.layout.tp, "pp": c.layout.pp, "dp": c.layout.dp,
            "max_model_len": c.max_model_len, "kv_cache_dtype": c.kv_dtype,
            "gpu_memory_utilization": round(c.utilization, 2), "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens}
    keep = {k: v for k, v in made.items() if getattr(pins, k) is not None}
    for name in ("max_model_len", "gpu_memory_utilization"):  # the decisions fixes are about
        keep.setdefault(name, made[name])
    if pins.kv_cache_memory_bytes is not None:
        keep.pop("gpu_memory_utilization", None)
    return dataclasses.replace(pins, **keep)


def serve_command_from_pins(ctx: PlanContext, pins: Any, env: dict[str, str]) -> str:
    args = ["vlaunch", "serve", ctx.spec.path or ctx.spec.hf_id or ctx.spec.name]
    if ctx.gpus:
        args += ["--gpus", ctx.gpus]
    for name in ("tp", "pp", "dp", "max_model_len", "kv_cache_dtype", "gpu_memory_utilization",
                 "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(pins, name)
        if value is not None:
            args += [flag_of(name), _fmt(name, value)]
    if pins.enforce_eager:
        args.append("--enforce-eager")
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + shlex.join(args)
