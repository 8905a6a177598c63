"""The planner's decisions as the typed Deployment every command reads (deployment/plan.py).

`make_plan` works on mutable candidates while it searches; once it has chosen, this builds the
frozen Deployment of one `aggregated` pool from the chosen candidate, its assessment and its
serving decisions. The serving decisions (MTP, parsers, all-to-all) and the autoscaling arrive
as the plan's own types (deployment/plan.py), made by their models; the performance figures and
the start-up, which have one serialisation of their own, are read through the codec's typed
reader, so their figures are computed once.
"""

from __future__ import annotations

from typing import Any

from ...deployment import plan as D
from ..features import ep_backend, serving_flags
from ..memory import budget as B
from ..speed import speed_decisions


def _model(m: Any) -> D.ModelRef:
    return D.ModelRef(name=m.name, hf_id=m.hf_id, architecture=m.architecture,
                      params=B.param_count(m),
                      weights_bytes=round(B.weights_bytes(m) * B.checkpoint_scale(m)),
                      quantization=m.quant.method, path=m.path, max_context=m.max_context,
                      attention=m.attention, **m.provenance())


def _hardware(hw: Any) -> D.HardwareRef:
    return D.HardwareRef(name=hw.kind.name, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                         total_bytes=hw.total_bytes, free_bytes=hw.free_bytes, source=hw.source,
                         compute_capability=hw.kind.compute_capability,
                         platform=hw.kind.platform)


def _parallel(L: Any) -> D.Parallel:
    return D.Parallel(L.tp, L.pp, L.dp, L.expert_parallel, L.nodes)


def _engine(plan: Any) -> D.EngineConfig:
    c, m, s = plan.chosen, plan.model, plan.serving
    spec = par = ep = None
    enable_reasoning = False
    eplb = s.eplb if s is not None and s.eplb is not None and s.eplb.enabled else None
    if s is not None:
        if s.speculative.enabled:
            spec = D.SpeculativeConfig(s.speculative.method,
                                       s.speculative.num_speculative_tokens)
        par = s.parsers
        if ep_backend.vllm_args(s.ep_backend):
            ep = s.ep_backend.backend
        enable_reasoning = bool(par.reasoning_parser) and serving_flags.needs_enable_reasoning(
            plan.vllm_version)
    return D.EngineConfig(
        model=m.path or m.hf_id, parallel=_parallel(c.layout), max_model_len=c.max_model_len,
        kv_cache_dtype=c.kv_dtype, gpu_memory_utilization=round(c.utilization, 4),
        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
        platform=plan.hardware.kind.platform,
        served_model_name=m.name if m.path else None,
        revision=m.revision if not m.path and m.revision else None,
        kv_cache_memory_bytes=c.kv_memory if plan.kv_pinned else None,
        enable_chunked_prefill=plan.chunked_prefill, enforce_eager=plan.enforce_eager,
        speculative_config=spec, all2all_backend=ep,
        enable_reasoning=enable_reasoning,
        reasoning_parser=par.reasoning_parser if par else None,
        tool_call_parser=par.tool_call_parser if par else None,
        enable_auto_tool_choice=bool(par and par.tool_call_parser
                                     and par.enable_auto_tool_choice),
        chat_template=par.chat_template if par else None,
        tokenizer_mode=par.tokenizer_mode if par else None,
        enable_eplb=eplb is not None,
        num_redundant_experts=eplb.num_redundant_experts if eplb is not None else None)


def _kv(plan: Any) -> D.KVCache:
    c = plan.chosen
    return D.KVCache(dtype=c.kv_dtype, bytes_per_token=c.kv_bytes_per_token,
                     block_size=c.block_size, memory_bytes=c.kv_memory, tokens=c.tokens,
                     blocks=c.blocks, pinned=plan.kv_pinned,
                     layer_kinds=dict(c.cache.get("kinds", {})), groups=c.cache.get("groups", 1),
                     blocks_per_request=c.cache.get("blocks_per_request"),
                     bytes_per_block=c.cache.get("block_bytes"))


def _per_gpu(c: Any) -> D.PerGpuBudget:
    return D.PerGpuBudget(requested_bytes=c.requested, weights_bytes=c.weights,
                          activation_bytes=c.activation, cudagraph_bytes=c.cudagraph,
                          non_torch_bytes=c.non_torch, kv_cache_bytes=c.kv_memory)


def _performance(plan: Any, a: Any) -> D.Performance | None:
    if a is None or plan.workload is None or plan.slo is None:
        return None
    return speed_decisions.performance(a, plan.workload, plan.concurrency)


def _alternative(plan: Any, c: Any) -> D.Alternative:
    L = c.layout
    a = plan.assessments.get(id(c))
    return D.Alternative(
        label=c.label(), parallel=_parallel(L), kv_cache=D.KVTokens(c.kv_dtype, c.tokens),
        max_concurrency=round(c.concurrency, 2), fits=c.fits,
        num_speculative_tokens=plan.drafts.get(id(c), 0), max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        performance=_performance(plan, a) if a else None, summary=c.summary(),
        why_not=plan.why_not[id(c)])  # rank.lost_on, for every runner-up the plan keeps


def deployment(plan: Any) -> D.Deployment:
    """The planner's `Plan` as the frozen Deployment of one aggregated pool."""
    c, hw = plan.chosen, plan.hardware
    perf = _performance(plan, plan.performance)
    serving = plan.serving
    stages = tuple(D.Stage(s["layers"], s["weights_bytes"], s["kv_cache_bytes"])
                   for s in c.stages) if c.layout.pp > 1 else ()
    pool = D.Pool(role="aggregated", replicas=1, gpus_per_replica=hw.count,
                  nodes_per_replica=hw.nodes, engine=_engine(plan), env=plan.env(),
                  kv_cache=_kv(plan), per_gpu=_per_gpu(c),
                  max_concurrency=round(c.concurrency, 2), performance=perf, serving=serving,
                  per_stage=stages,
                  autoscaling=plan.autoscaling,
                  startup=plan.startup)
    w, slo = plan.workload, plan.slo
    return D.Deployment(
        fits=plan.fits, model=_model(plan.model), hardware=_hardware(hw),
        vllm_version=plan.vllm_version, objective=plan.objective,
        workload=D.Workload(w.input_len, w.output_len, w.name, w.assumed) if w else None,
        slo=D.SLO(slo.ttft_ms, slo.tpot_ms) if slo else None, kind="aggregated",
        pools=(pool,), performance=perf, candidates=D.SearchCounts(plan.judged, plan.timed),
        problem=c.problem or None, reasons=tuple(plan.reasons),
        warnings=tuple(plan.warnings), suggestions=tuple(plan.suggestions),
        runners_up=tuple(_alternative(plan, a) for a in plan.alternatives))
