"""`vlaunch tune`'s candidates: the configurations worth an engine start, ranked by the planner.

Why from the planner: starting an engine costs minutes on a GPU node, so a blind grid is what
this avoids. Each candidate is `make_plan` over a variant of the knobs that need a restart
(max_num_seqs, max_num_batched_tokens, kv dtype, enforce-eager, MTP, the layout where the
hardware has one to choose), kept only when it is predicted to start, ranked by predicted
goodput. vLLM's defaults are always the baseline: a recommendation is worth its gain over what
a user gets without vlaunch. Pure: no engine, no I/O.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..deployment.argv import engine_argv
from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs import vllm_flags as F
from ..inputs.hardware import Hardware
from ..inputs.model import ModelSpec
from ..inputs.workload import SLO, Workload
from ..predict.search.planner import Pins, make_plan
from .serve import merge_args
from .vllmargs import arg_value


@dataclass
class TrialSpec:
    """One configuration to measure: vLLM's arguments and the plan that produced them."""

    name: str
    source: str  # baseline | planner | user
    vllm_args: list[str]
    env: dict[str, str]
    plan: Deployment
    predicted: dict[str, Any] | None = None
    pins: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return flags_key(self.vllm_args)


def flags_key(args: Sequence[str]) -> str:
    """The identity of a configuration: its flags, order-free, without the port."""
    pairs: list[tuple[str, str]] = []
    for a in args:
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            pairs.append((name, value if eq else ""))
        elif pairs:
            name, value = pairs[-1]
            pairs[-1] = (name, f"{value} {a}".strip())
    return " ".join(f"{n}={v}" if v else n for n, v in sorted(p for p in pairs
                                                                if p[0] != F.flag("port")))


_PLAN_KW: set[str] | None = None


def _plan_kwargs() -> set[str]:
    """make_plan's keyword arguments: the performance model's (workload, slo, objective) when
    the installed planner has them."""
    global _PLAN_KW
    if _PLAN_KW is None:
        _PLAN_KW = set(inspect.signature(make_plan).parameters)
    return _PLAN_KW


def plan_for(spec: ModelSpec, hw: Hardware, pins: Pins, workload: Workload, slo: SLO,
             objective: str):
    """make_plan for the workload, passing the performance model's inputs where supported."""
    kw: dict[str, Any] = {"suggest": False}
    wanted = {"workload": workload, "slo": slo, "objective": objective}
    kw.update({k: v for k, v in wanted.items() if k in _plan_kwargs()})
    return make_plan(spec, hw, pins, **kw)


def predicted_of(d: Deployment, workload: Workload) -> dict[str, Any]:
    """What the planner predicts for a plan: the performance model's knee when it has one, else
    a capacity proxy (requests the engine can hold at the workload's length, capped by
    max_num_seqs), which at least ranks the candidates the same way as their batch room."""
    perf = d.performance
    if perf is not None:
        knee = perf.knee or perf.at
        return {"source": perf.source, "goodput_rps": knee.requests_per_s,
                "concurrency": knee.concurrency,
                "output_tokens_per_s": knee.output_tokens_per_s,
                "tpot_ms": knee.tpot_ms, "ttft_ms": knee.ttft_ms,
                "score": float(knee.requests_per_s or 0.0)}
    per_request = workload.input_len + workload.output_len
    dp = d.engine.parallel.dp
    held = d.pool.kv_cache.tokens / max(1, per_request) * dp
    seqs = d.engine.max_num_seqs * dp
    return {"source": "capacity", "concurrency": round(min(held, seqs), 1),
            "score": float(min(held, seqs))}


def baseline_args(d: Deployment) -> list[str]:
    """vLLM's defaults for this model: the plan's arguments less every knob tune varies.

    Kept: the model, its name, the layout (a model that needs 8 GPUs does not start on one) and
    the memory sizing (vLLM's CPU default reserves 92% of RAM and refuses to start on a busy
    machine; a lowered GPU utilization is the free memory's, not a tuning choice).
    """
    args = engine_argv(d.engine)
    keep = ("model", "served_model_name", "tensor_parallel_size", "pipeline_parallel_size",
            "data_parallel_size", "max_model_len", "kv_cache_memory_bytes")
    values: dict[str, Any] = {k: arg_value(args, k) for k in keep}
    values["enable_expert_parallel"] = F.has(args, "enable_expert_parallel")
    util = arg_value(args, "gpu_memory_utilization")
    if util is not None and abs(float(util) - 0.92) > 1e-6:  # lowered for free memory
        values["gpu_memory_utilization"] = util
    return F.argv(values)


def knob_variants(spec: ModelSpec, hw: Hardware, pins: Pins, base: Deployment,
                  layouts: list[Any]) -> Iterator[Pins]:
    """Pins for every combination of the restart knobs around the baseline plan's values.

    Knobs the user pinned stay pinned. fp8 KV is tried only where the planner's capability
    table says it works; enforce-eager only on GPUs (the CPU engine has no graphs to skip).
    """
    from ..predict.features.capabilities import fp8_kv_support

    seqs0, tokens0 = base.engine.max_num_seqs, base.engine.max_num_batched_tokens
    seqs = [pins.max_num_seqs] if pins.max_num_seqs else sorted(
        {max(1, seqs0 // 8), max(1, seqs0 // 4), max(1, seqs0 // 2), seqs0, seqs0 * 2})
    tokens = [pins.max_num_batched_tokens] if pins.max_num_batched_tokens else sorted(
        {tokens0 // 2, tokens0, tokens0 * 2} - {0})
    fp8_ok, _ = fp8_kv_support(hw, spec.attention, base.vllm_version)
    dtypes = [pins.kv_cache_dtype] if pins.kv_cache_dtype else (
        ["auto", "fp8"] if fp8_ok else ["auto"])
    eager = [True] if pins.enforce_eager else ([False] if hw.is_cpu else [False, True])
    for layout, s, t, dt, e, mtp in itertools.product(layouts, seqs, tokens, dtypes, eager,
                                                      mtp_variants(spec, hw, pins, base)):
        yield dataclasses.replace(pins, max_num_seqs=s, max_num_batched_tokens=t,
                                  kv_cache_dtype=dt, enforce_eager=e, **layout, **mtp)


def mtp_variants(spec: ModelSpec, hw: Hardware, pins: Pins,
                 base: Deployment) -> list[dict[str, Any]]:
    """MTP as a knob: off and each num_speculative_tokens of profiles/serving.yaml where the
    model has an MTP layer and the version and platform load it; a pin stays pinned."""
    from ..predict.features import speculative

    if pins.speculative is not None or pins.num_speculative_tokens:
        return [{}]
    if not speculative.support(spec, hw, base.vllm_version)[0]:
        return [{}]
    return [{"speculative": False}] + [{"speculative": True, "num_speculative_tokens": int(k)}
                                       for k in speculative.mtp_table()["candidates"]]


def _layout_pins(spec: ModelSpec, hw: Hardware, pins: Pins) -> list[dict[str, Any]]:
    from ..predict.search.planner import layouts

    if hw.is_cpu or pins.tp or pins.dp or pins.pp:
        return [{}]
    return [{"tp": L.tp, "pp": L.pp, "dp": L.dp, "expert_parallel": L.expert_parallel}
            for L in layouts(spec, hw, pins)]


def build_candidates(spec: ModelSpec, hw: Hardware, pins: Pins, workload: Workload, slo: SLO,
                     objective: str, user: Sequence[Sequence[str]] = ()
                     ) -> tuple[TrialSpec, list[TrialSpec], list[str]]:
    """(baseline, candidates ranked by predicted goodput, notes). Only plans that fit; the
    baseline's own flags are never a planner candidate twice."""
    context = workload.input_len + workload.output_len
    if pins.max_model_len is None:
        length = max(256, 1 << math.ceil(math.log2(context)))
        pins = dataclasses.replace(pins, max_model_len=min(length, spec.max_context))
    if pins.max_model_len < context:
        raise InputError(f"--max-model-len {pins.max_model_len:,} is shorter than the workload's "
                         f"{context:,} tokens per request")
    base_plan = plan_for(spec, hw, pins, workload, slo, objective)
    base = base_plan.deployment()
    if not base.fits:
        raise InputError(f"{spec.name} does not fit {hw.describe()}: {base.problem}; see "
                         "`vlaunch plan`")
    notes: list[str] = []
    defaults = defaults_plan(spec, hw, pins, base, workload, slo, objective, notes)
    baseline = TrialSpec("vLLM defaults", "baseline", baseline_args(defaults),
                         dict(defaults.pool.env), defaults, predicted_of(defaults, workload),
                         {"max_model_len": pins.max_model_len})
    seen = {baseline.key, flags_key(engine_argv(defaults.engine))}
    ranked: list[TrialSpec] = []
    for variant in knob_variants(spec, hw, pins, base, _layout_pins(spec, hw, pins)):
        try:
            plan = plan_for(spec, hw, variant, workload, slo, objective)
        except InputError:
            continue
        d = plan.deployment()
        if not d.fits or flags_key(engine_argv(d.engine)) in seen:
            continue
        args = engine_argv(d.engine)
        seen.add(flags_key(args))
        ranked.append(TrialSpec(_describe(d), "planner", args, dict(d.pool.env), d,
                                predicted_of(d, workload), _pins_dict(variant)))
    ranked = rank_candidates(ranked, base)
    users = []
    for i, flags in enumerate(user, 1):
        args, _ = merge_args(baseline.vllm_args, list(flags))
        if flags_key(args) in seen:
            notes.append(f"--candidate {shlex.join(flags)}: same flags as another candidate")
            continue
        seen.add(flags_key(args))
        # the trial runs the baseline's flags with yours on top; its plan stays the planner's
        # (tuned.extra_args carries your flags to `vlaunch exec`)
        users.append(TrialSpec(f"yours #{i}: {shlex.join(flags)}", "user", args,
                               dict(base.pool.env), base, None, {"extra_args": list(flags)}))
    return baseline, users + ranked, notes


def defaults_plan(spec: ModelSpec, hw: Hardware, pins: Pins, base: Deployment,
                  workload: Workload, slo: SLO, objective: str,
                  notes: list[str]) -> Deployment:
    """The plan of vLLM's defaults on the planner's layout: the scheduler limits `vllm serve`
    would pick (capabilities.batch_defaults), auto KV, no eager mode. Its dict is what the
    baseline's plan.json and calibration describe, so they match what was measured."""
    from ..predict.features.capabilities import batch_defaults

    p = base.engine.parallel
    tokens, seqs = batch_defaults(hw, p.tp * p.pp)
    layout = {} if hw.is_cpu else {"tp": p.tp, "pp": p.pp, "dp": p.dp,
                                   "expert_parallel": p.expert_parallel}
    vanilla = dataclasses.replace(
        pins, max_num_seqs=pins.max_num_seqs or seqs,
        max_num_batched_tokens=pins.max_num_batched_tokens or max(tokens, pins.max_model_len
                                                                  or 0),
        kv_cache_dtype=pins.kv_cache_dtype or "auto", **layout)
    try:
        d = plan_for(spec, hw, vanilla, workload, slo, objective).deployment()
        problem = d.problem
    except InputError as e:
        d, problem = None, str(e)
    if d is not None and d.fits:
        return d
    notes.append(f"vLLM's defaults do not fit ({problem}); the baseline keeps the "
                 "planner's scheduler limits and KV dtype")
    return base


def _changes(d: Deployment, base: Deployment) -> int:
    """How many knobs differ from the baseline plan: among equal predictions, fewer changes
    first (the prediction cannot tell them apart, so the smaller step is the safer one)."""
    a, b = d.engine, base.engine
    knobs = ("max_num_seqs", "max_num_batched_tokens", "enforce_eager", "parallel",
             "kv_cache_dtype")
    return sum(getattr(a, k) != getattr(b, k) for k in knobs) + (_mtp_k(d) != _mtp_k(base))


def _mtp_k(d: Deployment) -> int:
    s = d.engine.speculative_config
    return s.num_speculative_tokens if s else 0


def finished_first(cands: list[TrialSpec], done: set[str]) -> list[TrialSpec]:
    """The same order, but within each run of equal predicted scores the trials an earlier run
    finished come first: a calibration may make candidates tie, and resuming should not start
    an engine where a measurement exists."""
    out: list[TrialSpec] = []
    for _, group in itertools.groupby(cands, key=lambda t: (t.predicted or {}).get("score")):
        g = list(group)
        out += [t for t in g if t.key in done] + [t for t in g if t.key not in done]
    return out


def rank_candidates(cands: list[TrialSpec], base: Deployment) -> list[TrialSpec]:
    """By predicted goodput, but the best of every layout before the second of any: a layout
    question (TP8 vs DP8+EP) is the one a prediction is least sure of, so each gets measured."""
    def key(t: TrialSpec) -> tuple:
        return (-(t.predicted or {}).get("score", 0.0), _changes(t.plan, base), t.key)

    ordered = sorted(cands, key=key)
    firsts: dict[Any, TrialSpec] = {}
    for t in ordered:
        firsts.setdefault(t.plan.engine.parallel, t)
    leaders = sorted(firsts.values(), key=key)
    return leaders + [t for t in ordered if t not in leaders]


def _pins_dict(p: Pins) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(p).items() if v not in (None, False)}


def _describe(d: Deployment) -> str:
    e = d.engine
    p = e.parallel
    layout = f"TP{p.tp}" + (f"xDP{p.dp}" if p.dp > 1 else "") + (
        "+EP" if p.expert_parallel and p.dp * p.tp > 1 else "")
    text = (f"{layout} seqs={e.max_num_seqs} batched={e.max_num_batched_tokens} "
            f"kv={d.pool.kv_cache.dtype}")
    text += f" mtp={_mtp_k(d)}" if _mtp_k(d) else ""
    return text + (" eager" if e.enforce_eager else "")
