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

from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs import vllm_flags as F
from ..inputs.hardware import parse_gpus
from ..inputs.model import load_model
from ..inputs.vllm_failures import Diagnosis, Report, to_failure
from ..inputs.vllm_loglines import Facts
from ..predict.features.capabilities import (
    batch_defaults,
    default_vllm_version,
    serve_argv,
    version_traits,
)
from ..predict.search.after_failure import replan_pins
from ..predict.search.plan_inputs import inputs_from_plan
from ..predict.search.planner import Pins, make_plan
from .doctor_logfix import shell_join, vllm_command_from_log

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


def context_from_plan(d: Deployment) -> PlanContext:
    """Model, hardware and pins of an emitted plan (as `vlaunch exec --replan` rebuilds them)."""
    spec, hw, pins = inputs_from_plan(d)
    g = d.hardware
    gpus = "cpu" if g.platform == "cpu" else f"{g.nodes}x{g.gpus_per_node}x{g.name}"
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
        if total and not facts.cpu:  # vLLM and torch print CUDA's total, not NVML's
            hw = dataclasses.replace(hw, cuda_total_bytes=int(total * (1 << 30)))
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


# The failed launch's vLLM arguments ("non-default args") that are planner pins: the flag
# table's pins the doctor may suggest, by dest, and by every spelling (--tensor-parallel-size,
# -tp, vlaunch's --tp); expert parallelism is read (a layout fact of what ran), never suggested.
_SUGGESTED = tuple(f for f in F.pins() if f.suggest and f.pin)
_READ = (*_SUGGESTED, F.BY_DEST["enable_expert_parallel"])
_ARG_PINS = {f.dest: f.pin.field for f in _READ if f.pin}
_FLAG_PINS = {n: f.pin.field for f in _READ if f.pin for n in (*f.names, f.pin.option)}
_PIN_KIND = {f.pin.field: f.kind for f in _READ if f.pin}
# Every decision a fix may change, and its vLLM flag: `fix:` names each one that differs from
# the failed launch, `run:` pins every one.
DECISIONS = tuple((F.BY_DEST[dest].pin.field, F.flag(dest)) for dest in (  # type: ignore[union-attr]
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "enable_expert_parallel", "max_model_len", "kv_cache_dtype", "gpu_memory_utilization",
    "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens", "enforce_eager"))
_VLAUNCH_OPTIONS = {f.pin.field: f.pin.option for f in _READ if f.pin}  # -> vlaunch option


def launch_pins(ctx: PlanContext, facts: Facts) -> Any:
    """The pins of the launch that failed: the context's, with every setting the log shows it
    ran with on top (its "non-default args", the max model len it used, its vLLM version), and,
    where the log lists its non-default args, every other decision at vLLM's default (KV in
    the model's dtype, one GPU per engine, the version's utilization and batch limits): a fix
    is checked against exactly what ran, never against what the planner would have chosen
    (a fix that fits only because the planner picks fp8 KV names --kv-cache-dtype fp8)."""
    changes: dict[str, Any] = {}
    for key, pin in _ARG_PINS.items():
        value = facts.arg(key)
        if value is not None and value is not False:
            changes[pin] = value
    used = facts.number("max_model_len")
    if "max_model_len" not in changes and used and (facts.args or ctx.pins.max_model_len is None):
        changes["max_model_len"] = int(used)
    version = facts.version
    if version and ctx.pins.vllm_version is None:
        changes["vllm_version"] = version.split("+")[0]
    if facts.args:  # "non-default args" lists every non-default: an absent one was vLLM's,
        # whatever a plan or the command line said (the log is what ran)
        for name, value in _vllm_defaults(ctx, changes, facts).items():
            changes.setdefault(name, value)
    pins = dataclasses.replace(ctx.pins, **changes)
    try:
        pins.validate()
    except InputError:
        return ctx.pins
    return pins


def _vllm_defaults(ctx: PlanContext, known: dict[str, Any], facts: Facts) -> dict[str, Any]:
    """What vLLM ran with for every decision its "non-default args" leave out."""
    out: dict[str, Any] = {"tp": 1, "pp": 1, "dp": 1, "expert_parallel": False,
                           "kv_cache_dtype": "auto", "max_model_len": ctx.spec.max_context,
                           "enforce_eager": False, "kv_cache_memory_bytes": None}
    if not facts.arg("speculative_config"):
        out.update(speculative=False, num_speculative_tokens=None)
    version = known.get("vllm_version") or ctx.pins.vllm_version
    try:
        traits = version_traits(version or default_vllm_version())
    except InputError:
        return out
    hw = ctx.hardware
    out.update(gpu_memory_utilization=None, max_num_seqs=None, max_num_batched_tokens=None)
    if not hw.is_cpu:
        if "kv_cache_memory_bytes" not in known:
            out["gpu_memory_utilization"] = traits.default_gpu_memory_utilization
        world = int(known.get("tp", 1)) * int(known.get("pp", 1))
        tokens, seqs = batch_defaults(hw, world, traits.version)
        out.update(max_num_batched_tokens=tokens, max_num_seqs=seqs)
    return out


def _with_flags(pins: Any, args: list[str]) -> Any | None:
    """`pins` with a fix's vLLM flags applied; None when a flag is not a planner decision."""
    changes: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name = args[i]
        off = name.startswith("--no-") and f"--{name[5:]}" in _FLAG_PINS
        pin = _FLAG_PINS.get(f"--{name[5:]}" if off else name)
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        i += 2 if value is not None else 1
        if pin is None:
            return None
        kind = _PIN_KIND[pin]
        if kind == F.SWITCH:
            changes[pin] = not off
        elif kind == F.FLOAT:
            changes[pin] = float(value or 0)
        elif kind == F.STR:
            changes[pin] = value
        else:
            changes[pin] = int(value or 0)
    return dataclasses.replace(pins, **changes)


def _failure_of(d: Diagnosis) -> Any:
    """The diagnosis as the `Failure` that `replan_pins` understands."""
    return to_failure(d)


# A layout fix re-chooses TP, PP and DP on these GPUs; expert parallelism stays as it ran
# (the flag table keeps it out of the doctor's suggestions).
_LAYOUT_FREE = {"tp": None, "pp": None, "dp": None}


def _candidates(d: Diagnosis, ctx: PlanContext, pins: Any, plan: Any) -> Iterator[
        tuple[Any, str]]:
    """Pins that might fix the failure, best first: the log's own fix, vLLM's measured
    re-plan, then the planner's own choice of the decision the failure is about. The hardware
    is the context's: a layout is never one these GPUs cannot hold."""
    if d.fix_args:
        fixed = _with_flags(pins, d.fix_args)
        if fixed is not None:
            yield fixed, "the log's fix"
    if plan is not None:
        got = _replanned(d, ctx, pins, plan)
        if got is not None:
            yield got
    if d.cause in ("kv_cache_too_small", "no_kv_cache_memory", "free_memory_below_utilization"):
        if pins.gpu_memory_utilization is not None and pins.kv_cache_memory_bytes is None \
                and not ctx.hardware.is_cpu and d.cause != "free_memory_below_utilization":
            yield (dataclasses.replace(pins, gpu_memory_utilization=None),
                   "the planner's utilization for this context")
        if pins.max_model_len is not None:
            base = pins if plan is None else (_replanned(d, ctx, pins, plan) or (pins,))[0]
            yield (dataclasses.replace(base, max_model_len=None),
                   "the longest context the planner fits")
            if base.gpu_memory_utilization is not None and not ctx.hardware.is_cpu \
                    and base.kv_cache_memory_bytes is None:
                yield (dataclasses.replace(base, max_model_len=None, gpu_memory_utilization=None),
                       "the planner's utilization and the longest context it fits")
    if d.cause in ("kv_cache_dtype_unsupported", "invalid_kv_cache_dtype") \
            and pins.max_model_len is not None:
        yield (dataclasses.replace(pins, kv_cache_dtype="auto", max_model_len=None),
               "KV cache in the model dtype, at the longest context that fits")
    if d.cause in ("cuda_oom", "sampler_warmup_oom") and pins.max_num_seqs is not None:
        yield dataclasses.replace(pins, max_num_seqs=None), "the planner's --max-num-seqs"
    if d.consumer == "weights" or d.cause == "tp_not_divisible":
        yield (dataclasses.replace(pins, **_LAYOUT_FREE),
               "a layout of these GPUs that holds the weights")
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


def fix_flags(failed: Any, new: Any, settled: Any) -> list[str]:
    """Every vLLM flag whose value in the checked plan (`settled`) differs from the failed
    launch (`failed`): a fix names all it changes (KV dtype, context, layout, ...), never
    only the one its rule is about. A decision the log does not show (None) counts only when
    the fix itself set or released it (`new`)."""
    out: list[str] = []
    for name, flag in DECISIONS:
        before, after = getattr(failed, name), getattr(settled, name)
        if after is None or after == before or (before is None and getattr(new, name)
                                                 == getattr(failed, name)):
            continue
        if isinstance(after, bool):
            if after or before:
                out.append(flag if after else f"--no-{flag[2:]}")
            continue
        out += [flag, _fmt(name, after)]
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
    """Run every fix through the planner with exactly the failed launch's settings plus the
    fix: the first candidate (the log's fix, the measured re-plan, the planner's own choice)
    that the planner says fits becomes the fix; `fix:` names every flag that differs from the
    failed launch, and both `run:` commands (vlaunch serve with every decision pinned, and the
    failed launch's vllm serve with those flags on top) come from the same checked plan. A fix
    the planner says will not fit is never shown; where nothing fits these GPUs, the plan's
    own alternatives are (more nodes, another GPU, a quantized checkpoint)."""
    if not any(d.cause in PLANNED_CAUSES for d in report.diagnoses):
        return  # nothing the planner decides (a port, a missing module): no plan to make
    pins = launch_pins(ctx, report.facts)
    try:
        failed = make_plan(ctx.spec, ctx.hardware, pins, **ctx.goals)
    except InputError as e:
        failed = None
        if ctx.source == "log":  # what the log shows is all the planner knows: it cannot check
            _unchecked(report, f"not checked by vlaunch's planner: it refuses this launch's "
                               f"settings ({e})")
            return
    if failed is not None and _weights_misfit(failed) and _loaded(report):
        _unchecked(report, "not checked by vlaunch's planner: it predicts this launch does not "
                           f"fit these GPUs ({_problem(failed)}), yet the log shows the weights "
                           "loaded")
        return
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
            flags = fix_flags(pins, new, settled)
            if not flags and not d.fix_env:
                continue  # the launch's own settings: no fix
            d.fix_args = flags
            d.explain = ([f"checked by vlaunch's planner ({_SOURCES[ctx.source]}): {why}"]
                         + refused + d.explain)
            d.serve_command = serve_command_from_pins(ctx, settled, d.fix_env)
            d.vllm_command = (vllm_command_from_log(report.facts, d.fix_args, d.fix_env)
                              if report.facts.args else
                              _vllm_command_of_plan(plan, d.fix_env))
            break
        else:
            d.explain = refused + d.explain + _beyond_these_gpus(ctx, pins, failed)
            d.fix_args, d.serve_command, d.vllm_command = [], None, None


def _weights_misfit(plan: Any) -> bool:
    """The planner says the weights and their overhead alone exceed what vLLM may use (no KV
    cache or context could fit): candidates.py's "weights X GiB + overhead ..." verdict."""
    c = plan.chosen
    return not plan.fits and c.requested - c.weights - c.activation - c.cudagraph \
        - c.non_torch <= 0


def _loaded(report: Report) -> bool:
    """The log shows the weights loaded (it got to profiling or later)."""
    return report.phase in ("profiling", "kv_cache", "capturing_graphs", "ready", "serving")


def _unchecked(report: Report, why: str) -> None:
    """The planner cannot check this launch (it refuses what ran, or predicts that weights
    which loaded do not fit): the log's own fixes stay, unchecked, saying why, never replaced
    by the planner's alternatives to a launch it cannot model."""
    for d in report.diagnoses:
        if d.cause in PLANNED_CAUSES:
            d.explain.append(why)


def _beyond_these_gpus(ctx: PlanContext, pins: Any, failed: Any) -> list[str]:
    """Nothing fits these GPUs with the launch's settings: what the planner says would (its
    `what would fit` for this launch: more nodes with the multi-node plan, another GPU, a
    quantized checkpoint or a smaller model), each with the command that plans it."""
    # the whole layout free, expert parallelism too: this is the plan's answer, not a fix flag
    plan = _plan(ctx, dataclasses.replace(pins, **_LAYOUT_FREE, expert_parallel=None)) or failed
    ideas = list(plan.suggestions) if plan is not None else []
    if not ideas:
        return ["vlaunch's planner found no fix that fits this model on this hardware with "
                "these settings"]
    out = ["vlaunch's planner found no fix that fits these GPUs with these settings; what "
           "would fit, as `vlaunch plan` says:"]
    model = ctx.spec.path or ctx.spec.hf_id or ctx.spec.name
    for idea in ideas:
        gpus = str(idea.data.get("gpus", "")) if idea.code == "suggest.more_gpus" else ""
        if gpus.count("x") >= 2:  # NODESxGPUSxKIND: the multi-node plan
            how = (f" (`vlaunch plan {shlex.quote(model)} --gpus {gpus} --emit DIR`, then "
                   "`vlaunch exec --plan DIR` on each node)")
        else:
            how = f" (`vlaunch serve {shlex.quote(model)} --gpus {gpus}`)" if gpus else ""
        out.append(f"{idea.text}{how}")
    return out


def _vllm_command_of_plan(plan: Any, env: dict[str, str]) -> str:
    """The checked plan's own vLLM command (no log arguments to start from)."""
    words = serve_argv(plan.vllm_version, list(plan.vllm_args()))
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**plan.env(), **env}.items())
    return (prefix + " " if prefix else "") + shell_join(words)


def _fits(plan: Any) -> bool:
    """The planner's verdict, and every GPU's consumers within the card: a pinned KV size is
    what vLLM allocates (it skips profiling), so one larger than the card is an OOM even
    where a planner release takes the pin on trust."""
    if not plan.fits:
        return False
    dep = plan.deployment()
    g = dep.pool.per_gpu
    used = (g.weights_bytes + g.activation_bytes + g.cudagraph_bytes + g.non_torch_bytes
            + g.kv_cache_bytes)
    return plan.hardware.is_cpu or used <= dep.hardware.total_bytes


def _problem(plan: Any) -> str:
    if not plan.fits:
        return plan.chosen.problem
    dep = plan.deployment()
    g = dep.pool.per_gpu
    return (f"the pinned KV cache ({g.kv_cache_bytes / (1 << 30):.1f} GiB) and weights "
            f"({g.weights_bytes / (1 << 30):.1f} GiB) exceed the "
            f"{dep.hardware.total_bytes / (1 << 30):.1f} GiB card")


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
    """Every decision at what the checked plan made of it (a pin as the planner took it, a
    released one as it chose), so the `run:` commands run exactly the checked plan."""
    c = plan.chosen
    made: dict[str, Any] = {
        "tp": c.layout.tp, "pp": c.layout.pp, "dp": c.layout.dp,
        "expert_parallel": c.layout.expert_parallel, "max_model_len": c.max_model_len,
        "kv_cache_dtype": c.kv_dtype, "gpu_memory_utilization": round(c.utilization, 2),
        "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
        "enforce_eager": bool(pins.enforce_eager or plan.enforce_eager)}
    if pins.kv_cache_memory_bytes is not None or plan.hardware.is_cpu:
        made["gpu_memory_utilization"] = pins.gpu_memory_utilization
    return dataclasses.replace(pins, **made)


def serve_command_from_pins(ctx: PlanContext, pins: Any, env: dict[str, str]) -> str:
    """`vlaunch serve MODEL --gpus G` with every decision of the checked plan pinned (and its
    vLLM version): pasted, it plans exactly that plan again."""
    args = ["vlaunch", "serve", ctx.spec.path or ctx.spec.hf_id or ctx.spec.name]
    if ctx.gpus:
        args += ["--gpus", ctx.gpus]
    for name, flag in DECISIONS:
        value = getattr(pins, name)
        option = _VLAUNCH_OPTIONS.get(name, flag)
        if name == "expert_parallel":
            if value is not None and ctx.spec.is_moe:  # a dense model has no experts
                option = _VLAUNCH_OPTIONS["expert_parallel"]  # the table's negatable pin
                args.append(option if value else f"--no-{option[2:]}")
        elif value is True:
            args.append(option)
        elif value is not None and value is not False:
            args += [option, _fmt(name, value)]
    if pins.speculative is False:
        args.append("--no-mtp")
    elif pins.speculative and pins.num_speculative_tokens:
        args += ["--num-speculative-tokens", str(pins.num_speculative_tokens)]
    if pins.vllm_version:
        args += ["--vllm-version", pins.vllm_version]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + shlex.join(args)
