"""The planner: the composer of one search and one prediction, and the explanations.

Inputs: a `ModelSpec`, a `Hardware`, the user's pinned flags, the workload, SLO and objective.
`make_plan` hands every candidate (layout, KV dtype, context, batch limits, chunked prefill,
MTP drafts) to the search (`search.py`), which judges each for memory and speed at exactly the
flags it would emit and ranks them under the same conditions (`rank.py`). The best becomes the
plan; its assessment is the single prediction the text, JSON, plot and `vlaunch capacity` read;
each runner-up is the best version of another layout with the figure it lost on. Every choice
carries its reason, read from the judged candidates.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ...deployment.plan import Reason, Startup
from ...errors import InputError
from ...inputs.hardware import GiB, Hardware, MiB
from ...inputs.model import ModelSpec
from ...inputs.workload import SLO, Workload, check_objective, fit_to_context, resolve_workload
from ..capacity import plan_scaling as scaleplan
from ..features import ep_backend, eplb, serving
from ..features.capabilities import (
    VersionTraits,
    batch_defaults,
    default_vllm_version,
    fp8_kv_support,
    gate_reason,
    platform_env,
    version_traits,
)
from ..memory import budget as B
from ..memory.candidate_memory import (  # noqa: F401 - the planner's public names, kept for its callers
    CPU_MEMORY_FRACTION,
    CUDA_CONTEXT_BYTES,
    MIN_CONTEXT,
    Candidate,
    evaluate,
    layouts,
    tp_allowed,
)
from ..speed.speed_decisions import FP8_MARGIN
from . import rank, search
from .alternatives import suggestions
from .pins import KV_DTYPES, Pins, origin_data, said  # noqa: F401 - the planner's public names, kept for its callers


@dataclass
class Plan:
    model: ModelSpec
    hardware: Hardware
    chosen: Candidate
    vllm_version: str
    chunked_prefill: bool
    kv_pinned: bool
    reasons: list[Reason] = field(default_factory=list)
    warnings: list[Reason] = field(default_factory=list)
    suggestions: list[Reason] = field(default_factory=list)
    alternatives: list[Candidate] = field(default_factory=list)
    enforce_eager: bool = False
    performance: Any = None  # perfplan.Assessment of the chosen candidate
    assessments: dict[int, Any] = field(default_factory=dict)  # id(candidate) -> Assessment
    objective: str = "balanced"
    workload: Workload | None = None
    slo: SLO | None = None
    why_not: dict[int, Reason] = field(default_factory=dict)  # id(runner-up) -> what it lost on
    drafts: dict[int, int] = field(default_factory=dict)  # id(runner-up) -> its MTP draft tokens
    serving: Any = None  # deployment.plan.Serving: MTP, parsers, all-to-all backend
    concurrency: int | None = None  # the operating point the user asked for (--concurrency)
    judged: int = 0  # candidates the search judged for memory
    timed: int = 0  # of those, judged for speed too
    startup: Startup | None = None  # one replica's (plan_scaling.attach)
    autoscaling: Any = None  # autoscaling.Autoscaling of the pool (scaleplan.attach)

    @property
    def fits(self) -> bool:
        return self.chosen.fits

    @property
    def distributed_executor_backend(self) -> str:
        return "mp"

    def vllm_args(self) -> list[str]:
        """vLLM's arguments for this plan; empty when it does not fit (nothing to run)."""
        from ...deployment.argv import engine_argv

        return engine_argv(self.deployment().engine) if self.fits else []

    def env(self) -> dict[str, str]:
        # Big checkpoints load for many minutes; vLLM's engine-ready wait defaults to 600 s.
        load_s = max(600, int(B.weights_bytes(self.model) / (200 * MiB)))
        env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(load_s)}
        if not self.hardware.is_cpu and version_traits(self.vllm_version).has("startup_plan"):
            # vLLM (0.26+) records its measured KV memory per model/hardware fingerprint and
            # reuses it on the next boot (the CPU worker does not implement it).
            env["VLLM_ENABLE_STARTUP_PLAN"] = "1"
            root = os.environ.get("VLLM_CACHE_ROOT") or (
                os.path.join(os.environ["HF_HOME"], "vllm") if os.environ.get("HF_HOME") else "")
            if root:  # keep vLLM's measurements next to the model cache (a PVC in Kubernetes)
                env["VLLM_CACHE_ROOT"] = root
        if self.serving is not None:
            env.update(ep_backend.env(self.serving.ep_backend))
        return env | platform_env(self.hardware, self.model.attention)[0]

    def deployment(self) -> Any:
        """The plan as the frozen Deployment every command reads (deployment/plan.py)."""
        from .assemble import deployment

        return deployment(self)

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON: the codec's dump of its Deployment."""
        from ...deployment.codec import dump

        return dump(self.deployment())


# ----------------------------------------------------------------------------- search


def _version_notes(spec: ModelSpec, pins: Pins, traits: VersionTraits, reasons: list[Reason],
                   warnings: list[Reason]) -> None:
    """Say which vLLM the plan is for, and refuse what that version cannot do."""
    from ..features.capabilities import installed_vllm, table

    newest = str(table()["newest_modelled_vllm"])
    if traits.newer_than_modelled:
        warnings.append(Reason(
            "vllm.newer_than_modelled",
            f"vLLM {traits.version} is newer than the newest release vlaunch models "
            f"({newest}): planned with {newest}'s accounting",
            {"version": traits.version, "newest": newest}))
    if (o := pins.origin("vllm_version")) is not None:
        reasons.append(Reason(
            "vllm.version",
            f"vLLM {traits.version}: "
            + ("as given by --vllm-version" if o == "you" else said(o)),
            {"version": traits.version, "from": "pin", **origin_data(o)}))
    elif installed_vllm():
        reasons.append(Reason(
            "vllm.version",
            f"vLLM {traits.version}: the installed version",
            {"version": traits.version, "from": "installed"}))
    else:
        reasons.append(Reason(
            "vllm.version",
            f"vLLM {traits.version}: assumed (no vLLM is installed here; "
            "--vllm-version sets another)",
            {"version": traits.version, "from": "assumed"}))
    if spec.attention.startswith("mla") and not traits.has("mla_attention"):
        why = gate_reason("mla_attention", traits.version)
        raise InputError(f"{spec.name} uses MLA attention: {why}; plan for a newer "
                         "--vllm-version")
    if (pins.kv_cache_memory_bytes or pins.pin_kv_memory) \
            and not traits.has("kv_cache_memory_bytes"):
        raise InputError(f"{gate_reason('kv_cache_memory_bytes', traits.version)}: drop the "
                         "pinned KV size or plan for a newer --vllm-version")


def _utilization(hw: Hardware, pins: Pins, traits: VersionTraits,
                 warnings: list[Reason], reasons: list[Reason]) -> float:
    if hw.is_cpu:
        return CPU_MEMORY_FRACTION
    ceiling = math.floor(max(0, hw.free_bytes - CUDA_CONTEXT_BYTES) / hw.budget_total * 100) / 100
    if (o := pins.origin("gpu_memory_utilization")) is not None:
        u = pins.gpu_memory_utilization
        reasons.append(Reason(
            "gpu_memory_utilization.pinned",
            f"gpu-memory-utilization {u:.2f}: {said(o)}",
            {"value": u, **origin_data(o)}))
        if hw.source in ("nvml", "amdsmi") and u > ceiling:
            warnings.append(Reason(
                "gpu_memory_utilization.over_free",
                f"only {hw.free_bytes / GiB:.1f} GiB of {hw.total_bytes / GiB:.1f} GiB "
                f"is free: vLLM's start-up check needs free >= {u:.2f} x total; "
                f"{ceiling:.2f} would pass",
                {"value": u, "ceiling": ceiling, "free_bytes": hw.free_bytes,
                 "total_bytes": hw.total_bytes}))
        return u
    u = traits.default_gpu_memory_utilization
    if hw.source in ("nvml", "amdsmi") and ceiling < u:
        reasons.append(Reason(
            "gpu_memory_utilization.lowered",
            f"gpu-memory-utilization {ceiling:.2f}: lowered from vLLM's default {u:.2f} "
            f"because only {hw.free_bytes / GiB:.1f} GiB of "
            f"{hw.total_bytes / GiB:.1f} GiB is free (vLLM refuses to start when "
            "free < utilization x total)",
            {"value": ceiling, "default": u, "free_bytes": hw.free_bytes,
             "total_bytes": hw.total_bytes}))
        return max(0.01, ceiling)
    reasons.append(Reason(
        "gpu_memory_utilization.default",
        f"gpu-memory-utilization {u:.2f}: vLLM {traits.version}'s default, and the "
        "free memory allows it",
        {"value": u}))
    return u


def _kv_choices(spec: ModelSpec, hw: Hardware, pins: Pins, version: str,
                reasons: list[Reason], warnings: list[Reason]) -> tuple[list[str], str]:
    """KV dtypes worth evaluating, and why fp8 is or is not among them."""
    supported, why = fp8_kv_support(hw, spec.attention, version)
    if pins.kv_cache_dtype and (o := pins.origin("kv_cache_dtype")) is not None:
        reasons.append(Reason(
            "kv_cache_dtype.pinned",
            f"kv-cache-dtype {pins.kv_cache_dtype}: {said(o)}",
            {"value": pins.kv_cache_dtype, **origin_data(o)}))
        if pins.kv_cache_dtype.startswith("fp8") and not supported:
            warnings.append(Reason(
                "kv_cache_dtype.fp8_unsupported",
                f"fp8 KV is not supported here: {why}"))
        return [pins.kv_cache_dtype], why
    if supported:
        return ["auto", "fp8"], why
    reasons.append(Reason(
        "kv_cache_dtype.no_fp8",
        f"kv-cache-dtype auto ({spec.dtype}): fp8 not chosen because {why}",
        {"value": "auto"}))
    return ["auto"], why


def _check_request(spec: ModelSpec, pins: Pins, workload: Workload) -> None:
    """A request longer than the context can never be served: refuse it, naming both."""
    need = workload.input_len + workload.output_len
    ctx = pins.max_model_len or spec.max_context
    if need > ctx and not workload.assumed:
        where = "the pinned --max-model-len" if pins.max_model_len else f"{spec.name}'s context"
        raise InputError(f"one request of {workload.input_len:,} prompt + "
                         f"{workload.output_len:,} answer tokens = {need:,} tokens is longer than "
                         f"{where} of {ctx:,} tokens; shorten --input-len/--output-len"
                         + ("" if pins.max_model_len else " or plan another model"))


def make_plan(spec: ModelSpec, hw: Hardware, pins: Pins | None = None,
              suggest: bool = True, *, workload: Workload | None = None,
              objective: str | None = None, slo: SLO | None = None,
              concurrency: int | None = None, scaling: Any = None,
              load_path: str | None = None) -> Plan:
    """Plan a deployment of `spec` on `hw` honouring `pins`, for `workload` under `slo`, ranked
    by `objective`, its pool sized by `scaling` (autoscaling.ScalingAsk) with weights read over
    `load_path`; never raises for a misfit. The composer: the search judges every candidate
    (predict/search/search.py), the best one becomes the plan, its assessment is the plan's single
    prediction, and every reason is read from the judged candidates."""
    pins = pins or Pins()
    pins.validate()
    workload = workload or resolve_workload()
    objective = check_objective(objective)
    slo = slo or SLO()
    if concurrency is not None and concurrency < 1:
        raise InputError(f"--concurrency must be a positive integer, got {concurrency}")
    version = pins.vllm_version or default_vllm_version()
    traits = version_traits(version)
    eplb.check_pin(spec, hw, version, pins.eplb)  # a pin no layout could honour: exit 2
    reasons: list[Reason] = []
    warnings: list[Reason] = [Reason("hardware.note", n) for n in hw.notes]
    _version_notes(spec, pins, traits, reasons, warnings)
    # ROCm: where its vLLM defaults differ from what its recipes run
    env_set, why_env = platform_env(hw, spec.attention)
    reasons += [Reason("platform_env", text, {"env": dict(env_set)}) for text in why_env]
    if spec.commit:
        where = {"hf-cache": "the local HF cache", "vlaunch-cache": "vlaunch's cache of the Hub",
                 "hub": "the Hub"}.get(spec.source, spec.source)
        reasons.append(Reason(
            "model.commit",
            f"model {spec.hf_id} at commit {spec.commit[:12]}"
            + (f" (revision {spec.revision})" if spec.revision else "")
            + f", from {where}"
            + (": weights from the safetensors metadata" if spec.params_by_dtype
            else ""),
            {"hf_id": spec.hf_id, "commit": spec.commit, "source": spec.source}))
    if spec.estimate == "generic":
        warnings.append(Reason(
            "model.generic_estimate",
            f"{spec.name}: model_type '{spec.architecture}' is not in vlaunch's "
            "tables; shapes are a generic decoder estimate from config.json"
            + (", weights from the safetensors metadata" if spec.checkpoint_bytes
            else ""),
            {"architecture": spec.architecture}))
    if pins.max_model_len and pins.max_model_len > spec.max_context:
        raise InputError(f"--max-model-len {pins.max_model_len:,} exceeds {spec.name}'s context "
                         f"of {spec.max_context:,} tokens (vLLM refuses it without "
                         "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    _check_request(spec, pins, workload)
    fitted = fit_to_context(workload, pins.max_model_len or spec.max_context)
    if fitted != workload:
        reasons.append(Reason(
            "workload.fitted",
            f"the assumed workload ({workload.input_len:,} + {workload.output_len:,} "
            f"tokens) is longer than the {fitted.input_len + fitted.output_len:,}-"
            f"token context: predicted at {fitted.input_len:,} + "
            f"{fitted.output_len:,}",
            {"input_len": fitted.input_len, "output_len": fitted.output_len}))
        workload = fitted
    scale = B.checkpoint_scale(spec)
    if abs(scale - 1) > 0.01:
        warnings.append(Reason(
            "weights.checkpoint_index",
            f"the checkpoint index holds {spec.checkpoint_bytes / GiB:.2f} GiB but "
            f"config.json counts {B.weights_bytes(spec, False) / GiB:.2f} GiB; "
            "weights are sized from the index (the ground truth)",
            {"checkpoint_bytes": spec.checkpoint_bytes}))
    util = _utilization(hw, pins, traits, warnings, reasons)
    dtypes, fp8_why = _kv_choices(spec, hw, pins, version, reasons, warnings)
    chunked = not (hw.is_cpu and spec.attention.startswith("mla")) and traits.engine == "v1"
    static_pin = ((hw.is_cpu and traits.has("kv_cache_memory_bytes"))
                  or bool(pins.kv_cache_memory_bytes))
    mtp = serving.draft_choices(spec, hw, pins, version)
    goal = search.Goal(spec, hw, pins, traits, util, workload, slo, objective, concurrency,
                       chunked, static_pin, dtypes, mtp.drafts, mtp.acceptance, mtp.pinned_on)
    res = search.search(goal)
    if res.judged:
        best = res.judged[0]
    elif res.misfits:
        best = res.misfits[0]
    else:
        raise InputError(f"no parallel layout of {spec.name} matches {hw.describe()} with "
                         "the pinned --tp/--pp/--dp")
    pinned = static_pin or (pins.pin_kv_memory and best.fits)
    runner_ups = [search.finish(goal, j) for j in _runner_ups(res, best)]
    search.finish(goal, best)
    plan = Plan(spec, hw, best.cand, version, chunked, pinned, reasons, warnings,
                alternatives=[j.cand for j in runner_ups], enforce_eager=pins.enforce_eager,
                performance=best.perf, objective=objective, workload=workload, slo=slo,
                concurrency=concurrency, judged=res.count, timed=res.timed)
    plan.assessments = {id(j.cand): j.perf for j in [best, *runner_ups]}
    target = pins.max_model_len or spec.max_context
    plan.why_not = {id(j.cand): rank.lost_on(j, best, objective, target) for j in runner_ups}
    plan.drafts = {id(j.cand): j.knobs.draft for j in runner_ups}
    if pins.pin_kv_memory and not hw.is_cpu:
        warnings.append(Reason(
            "kv_cache.pin_kv_memory",
            "--pin-kv-memory: vLLM ignores gpu-memory-utilization and skips its "
            "memory profiling; only the plan's margins for activations, graphs and "
            "non-torch memory protect the start-up"))
    if best.fits:
        _kv_reason(goal, res, best, fp8_why, reasons, warnings)
        _batch_reasons(goal, res, best, reasons)
    plan.serving = serving.apply(plan, pins, goal, res, best, mtp)
    plan.judged, plan.timed = goal.counts
    if not pinned and plan.chosen.fits:  # keyed by the final flags, serving ones included
        _apply_measured(plan)
    _explain(plan, pins)
    _explain_speed(plan)
    if suggest and not best.fits:
        plan.suggestions = suggestions(spec, hw, pins, make_plan)
    scaleplan.attach(plan, scaling, load_path)
    return plan


def _runner_ups(res: Any, best: Any, n: int = 5) -> list[Any]:
    """The best version of every other layout (fitting ones first, then misfits)."""
    seen = {best.knobs.layout}
    out = []
    for j in [*res.judged, *res.fitting, *res.misfits]:
        if j.knobs.layout not in seen:
            seen.add(j.knobs.layout)
            out.append(j)
    return out[:n]


def _kv_reason(goal: Any, res: Any, best: Any, fp8_why: str, reasons: list[Reason],
               warnings: list[Reason]) -> None:
    """Why this KV dtype, against the best candidate with the other one."""
    if goal.pins.kv_cache_dtype or len(goal.dtypes) == 1:
        return
    mine = best.knobs.kv_dtype
    cond = ""
    other = max((j for j in res.judged if j.knobs.kv_dtype != mine), key=lambda j: j.value,
                default=None) or next((j for j in res.fitting if j.knobs.kv_dtype != mine), None)
    if other is not None and other.knobs.draft != best.knobs.draft:
        # the same conditions: the best of each dtype with the same draft (none if need be)
        same = [j for j in res.judged if j.knobs.draft == best.knobs.draft]
        if not any(j.knobs.kv_dtype != mine for j in same):
            same = [j for j in res.judged if j.knobs.draft == 0]
        mine_j = max((j for j in same if j.knobs.kv_dtype == mine), key=lambda j: j.value,
                     default=None)
        other_j = max((j for j in same if j.knobs.kv_dtype != mine), key=lambda j: j.value,
                      default=None)
        if mine_j is not None and other_j is not None:
            best, other = mine_j, other_j
            cond = "" if best.knobs.draft else " (both without MTP)"
    accuracy = Reason("kv_cache_dtype.fp8_accuracy",
                      "fp8 KV without calibrated scales (k/v scale 1.0) can cost accuracy; "
                      "check your evals or pin --kv-cache-dtype auto")
    o_name = "bf16" if mine == "fp8" else "fp8"
    if other is None or min(other.cand.max_model_len, best.cand.max_model_len) \
            < best.cand.max_model_len:
        held = (f"holds only {other.cand.max_model_len:,} tokens of context" if other
                else "holds no whole request")
        reasons.append(Reason(
            "kv_cache_dtype.context",
            f"kv-cache-dtype {mine}: {o_name} KV {held} ({fp8_why})"
            if mine == "fp8" else f"kv-cache-dtype auto: fp8 KV {held}",
            {"value": mine}))
        if mine == "fp8":
            warnings.append(accuracy)
        return
    a, b = best.perf, other.perf
    if a is None or b is None:
        reasons.append(Reason(
            "kv_cache_dtype.no_speed_figure",
            f"kv-cache-dtype {mine}: no speed figure to justify fp8 on this GPU",
            {"value": mine}))
        return
    s_a, s_b = a.score(goal.objective, goal.hw.count), b.score(goal.objective, goal.hw.count)
    if mine == "fp8":
        gain = (s_a - s_b) / abs(s_b) if s_b else 0.0
        reasons.append(Reason(
            "kv_cache_dtype.faster",
            f"kv-cache-dtype fp8: {rank.headline(a, goal.objective)} vs "
            f"{rank.headline(b, goal.objective)} with bf16 KV{cond} ({gain:+.0%}, "
            "over the "
            f"{FP8_MARGIN:.0%} margin for its accuracy risk)",
            {"value": "fp8", "gain": round(gain, 4)}))
        warnings.append(accuracy)
    else:
        gain = (s_b - s_a) / abs(s_a) if s_a else 0.0
        mtp = f", MTP {other.knobs.draft}" if other.knobs.draft else ""
        reasons.append(Reason(
            "kv_cache_dtype.no_gain",
            f"kv-cache-dtype auto: bf16 KV already holds the context; fp8 KV's best "
            f"({other.cand.label()}{mtp}){cond} would change "
            f"the objective's figure by {gain:+.0%} (under the {FP8_MARGIN:.0%} "
            "margin that would justify its accuracy risk)",
            {"value": "auto", "gain": round(gain, 4)}))


def _batch_reasons(goal: Any, res: Any, best: Any, reasons: list[Reason]) -> None:
    """max-num-seqs and max-num-batched-tokens: what the search chose and against what."""
    k, c, a = best.knobs, best.cand, best.perf
    p = goal.pins
    if best.capped_from is not None and a is not None:
        over = _point_note(goal, best, best.capped_from)
        knee = a.knee.concurrency if a.knee is not None else None
        waits = (f"; the knee, {knee:,.0f} in flight, is where that wait reaches the TTFT SLO"
                 if knee is not None else "")
        reasons.append(Reason(
            "max_num_seqs.knee",
            f"max-num-seqs {c.max_num_seqs:,} per engine: the most requests that decode at "
            "once within the SLO; beyond it requests queue (TTFT grows) instead of slowing "
            f"every running one{waits}; {best.capped_from:,} would let {over}",
            {"value": c.max_num_seqs, "uncapped": best.capped_from, "knee": knee}))
    elif best.trimmed_from is not None and p.max_num_seqs is None:
        reasons.append(Reason(
            "max_num_seqs.kv_trimmed",
            f"max-num-seqs {c.max_num_seqs:,} per engine: the KV cache caps the running "
            f"requests below it anyway; {best.trimmed_from:,} would take KV memory for "
            "sampler buffers and CUDA graphs it never uses",
            {"value": c.max_num_seqs, "untrimmed": best.trimmed_from}))
    elif k.max_num_seqs is not None and p.max_num_seqs is None:
        reasons.append(Reason(
            "max_num_seqs.kv_limited",
            f"max-num-seqs {c.max_num_seqs:,} per engine: vLLM's default batch "
            "leaves too little KV memory for the context",
            {"value": c.max_num_seqs}))
    if p.max_num_batched_tokens is None and k.chunked and not goal.hw.is_cpu:
        default = batch_defaults(goal.hw, k.layout.tp * k.layout.pp, goal.traits.version)[0]
        tokens = c.max_num_batched_tokens
        if tokens == default:
            reasons.append(Reason(
                "max_num_batched_tokens.default",
                f"max-num-batched-tokens {default:,}: vLLM's default, the best of "
                f"the chunk sizes tried ({', '.join(map(str, search.CHUNK_CHOICES))})",
                {"value": default}))
            return
        twin = search.memory(goal, dataclasses.replace(
            k, max_num_batched_tokens=max(default, k.max_num_seqs or 0) or None))
        if not search.serves(goal, twin):
            reasons.append(Reason(
                "max_num_batched_tokens.default_misfits",
                f"max-num-batched-tokens {tokens:,}: at vLLM's default {default:,} "
                f"this candidate does not fit ({twin.cand.problem or 'no memory'})",
                {"value": tokens, "default": default}))
            return
        search.speed(goal, twin, full=False)
        if a is None or twin.perf is None:
            return
        ours, theirs = rank.headline(a, goal.objective), rank.headline(twin.perf, goal.objective)
        more = (f", {c.tokens - twin.cand.tokens:+,} KV tokens per engine"
                if c.tokens != twin.cand.tokens else "")
        reasons.append(Reason(
            "max_num_batched_tokens.faster",
            f"max-num-batched-tokens {tokens:,}: {ours} vs {theirs} at vLLM's "
            f"default {default:,} (same other flags{more})",
            {"value": tokens, "default": default}))


def _point_note(goal: Any, j: Any, seqs: int) -> str:
    """What `seqs` running requests per engine would do to the chosen engine's latency."""
    from ..speed import request_model as perf

    a = j.perf
    n = seqs * a.shape.dp
    shape = dataclasses.replace(a.shape, max_num_seqs=max(a.shape.max_num_seqs, seqs))
    p = perf.point(shape, goal.workload, n)
    return f"TPOT reach {p.tpot_ms:.0f} ms and TTFT {p.ttft_ms:,.0f} ms at {n:,} in flight"


def _explain_speed(plan: Plan) -> None:
    a, w = plan.performance, plan.workload
    r = plan.reasons
    if w is not None:
        r.insert(0, Reason(
            "workload",
            f"workload: {w.describe()}; objective {plan.objective}; SLO "
            f"{plan.slo.describe() if plan.slo else '-'}",
            {"input_len": w.input_len, "output_len": w.output_len, "objective": plan.objective}))
    r.insert(1, Reason(
        "search.counts",
        f"searched {plan.judged:,} candidates (layout x KV dtype x batch limits x "
        f"drafts) for memory, timed the {plan.timed:,} that fit and hold the context",
        {"judged": plan.judged, "timed": plan.timed}))
    if a is None:
        if plan.fits:
            r.append(Reason(
                "performance.none",
                "no performance prediction: the GPU catalog has no bandwidth/FLOPS for "
                f"{plan.hardware.kind.name}; layouts ranked by memory alone",
                {"gpu": plan.hardware.kind.name}))
        return
    r.insert(2, Reason(
        "performance.predicted",
        f"predicted ({a.source}): {rank.figure(a, plan.objective)}; binding: {a.binding}",
        {"source": a.source, "binding": a.binding}))
    r.extend(a.notes)  # the same Reasons as performance.notes (deployment/notes.py)



def _apply_measured(plan: Plan) -> None:
    """Use the KV memory vLLM measured on an earlier boot of exactly these decisions."""
    from ..memory import measured_kv as measured

    row = measured.lookup(measured.plan_key(plan.deployment()))
    if row is None:
        return
    c = plan.chosen
    page = c.cache.get("block_bytes") or c.block_size * c.kv_bytes_per_token
    per_request = c.cache.get("blocks_per_request") or math.ceil(c.max_model_len / c.block_size)
    predicted = c.kv_memory
    c.blocks = row["kv_cache_memory_bytes"] // page
    c.kv_memory = c.blocks * page
    c.cache["engine_concurrency"] = c.blocks / per_request
    c.tokens = int(c.blocks / per_request * c.max_model_len)
    if max(0, c.blocks - 1) < per_request:
        c.fits = False
        c.problem = (f"vLLM measured {c.kv_memory / GiB:.2f} GiB of KV cache at its last start "
                     f"of this plan: fewer than {c.max_model_len:,} tokens")
    plan.reasons.append(Reason(
        "kv_cache.measured",
        f"KV cache {c.kv_memory / GiB:.2f} GiB: measured by vLLM at an earlier "
        f"start of this exact plan ({row.get('source', 'startup plan')}, "
        f"{row.get('recorded_at', '?')}); the budget model alone predicted "
        f"{predicted / GiB:.2f} GiB",
        {"memory_bytes": c.kv_memory, "predicted_bytes": predicted}))


def _explain(plan: Plan, pins: Pins) -> None:
    c, spec = plan.chosen, plan.model
    r = plan.reasons
    if c.fits:
        o = pins.origin("tp", "pp", "dp") if pins.tp or pins.pp or pins.dp else None
        r.insert(0, Reason(
            "layout",
            f"layout {c.label()}: {c.summary().split(': ', 1)[1]}"
            + {"you": " (pinned)", "plan": f" ({said('plan')})", None: ""}[o],
            {"label": c.label(), **origin_data(o)}))
        if plan.performance is None:  # with a performance model the runner-ups are listed there
            for other in plan.alternatives[:3]:
                r.append(Reason("layout.not", f"not {other.summary()}", {"label": other.label()}))
    if pins.max_model_len and (o := pins.origin("max_model_len")) is not None:
        r.append(Reason(
            "max_model_len.pinned",
            f"max-model-len {c.max_model_len:,}: {said(o)}",
            {"value": c.max_model_len, **origin_data(o)}))
    elif c.fits and c.max_model_len == spec.max_context:
        r.append(Reason(
            "max_model_len.full",
            f"max-model-len {c.max_model_len:,}: the model's full context fits",
            {"value": c.max_model_len}))
    elif c.fits:
        r.append(Reason(
            "max_model_len.largest",
            f"max-model-len {c.max_model_len:,}: the largest that fits (full context "
            f"{spec.max_context:,} does not)",
            {"value": c.max_model_len, "full": spec.max_context}))
    if plan.chunked_prefill:
        r.append(Reason(
            "chunked_prefill.on",
            f"chunked prefill on (max-num-batched-tokens {c.max_num_batched_tokens:,}, "
            f"max-num-seqs {c.max_num_seqs:,}): prompts ride in decode steps instead of "
            "stalling them",
            {"max_num_batched_tokens": c.max_num_batched_tokens, "max_num_seqs": c.max_num_seqs}))
    else:
        r.append(Reason(
            "chunked_prefill.off",
            f"chunked prefill off: vLLM turns it off for MLA on the {plan.hardware.kind.name}"
            " platform"))
    if plan.kv_pinned:
        r.append(Reason(
            "kv_cache.pinned",
            f"KV cache pinned to {c.kv_memory:,} bytes with --kv-cache-memory-bytes "
            f"({c.blocks:,} blocks of {c.block_size} tokens)",
            {"memory_bytes": c.kv_memory, "blocks": c.blocks, "block_size": c.block_size}))
    if c.layout.tp > 1 and spec.attention.startswith("mla"):
        r.append(Reason(
            "kv_cache.mla_per_rank",
            "MLA keeps one latent per token on every TP rank: the KV cache is not split "
            "by TP"))
