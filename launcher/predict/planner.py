"""The planner: search layouts and settings, decide, and explain every decision.

Inputs: a `ModelSpec`, a `Hardware` and the user's pinned flags. For each parallel layout that
the model's heads allow (TP inside a node, PP across nodes, DP+EP for MoE) it runs the budget
model at the chosen KV dtype, utilization and batch sizes, then picks by the objective: the
target context first (the model's full context unless pinned), then the most concurrent
sequences at that context. Every choice carries its reason; losing layouts say why they lost.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..inputs.hardware import GiB, Hardware, MiB
from ..inputs.model import ModelSpec, Quant
from ..inputs.workload import SLO, Workload, check_objective, resolve_workload
from . import budget as B
from . import kvcache as K
from .capabilities import (
    VersionTraits,
    attention_support,
    batch_defaults,
    block_size,
    cpu_resets_ssm_dtype,
    default_vllm_version,
    fp8_kv_support,
    gate_reason,
    version_traits,
)
from .perfplan import FP8_MARGIN

CUDA_CONTEXT_BYTES = 600 * MiB
"""Memory the vLLM process itself takes (CUDA context, NCCL init) before it checks that free
memory covers its request (gpu_worker's start-up check measures after initialisation)."""

MIN_CONTEXT = 4096
"""The shortest context vlaunch calls serviceable when the user pins none (chat + tools)."""

CPU_MEMORY_FRACTION = 0.5
"""Share of free RAM the CPU engine may use for weights and KV (vLLM's former CPU default)."""

KV_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Pins:
    """What the user fixed on the command line; the planner decides the rest."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    expert_parallel: bool | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None
    vllm_version: str | None = None
    block_size: int | None = None
    pin_kv_memory: bool = False
    # serving features (launcher/predict/serving.py): None leaves the decision to the planner
    speculative: bool | None = None
    num_speculative_tokens: int | None = None
    mtp_acceptance: float | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None
    all2all_backend: str | None = None

    def validate(self) -> None:
        for name in ("tp", "pp", "dp", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InputError(f"--max-model-len must be a positive number of tokens, "
                             f"got {self.max_model_len}")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise InputError(f"--gpu-memory-utilization must be in (0, 1], got {u}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_DTYPES:
            raise InputError(f"unknown --kv-cache-dtype '{self.kv_cache_dtype}'; accepted: "
                             f"{', '.join(KV_DTYPES)}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InputError("--kv-cache-memory-bytes must be positive")


@dataclass
class Candidate:
    """One layout evaluated by the budget model, per GPU on the limiting rank."""

    layout: B.Layout
    kv_dtype: str
    block_size: int
    utilization: float
    requested: int
    weights: int
    activation: int
    cudagraph: int
    non_torch: int
    kv_memory: int
    kv_bytes_per_token: int
    blocks: int
    tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    fits: bool
    problem: str = ""
    stages: list[dict[str, int]] = field(default_factory=list)  # per PP stage, limiting rank
    cache: dict[str, Any] = field(default_factory=dict)  # kvcache.Pool facts for the plan
    pool_layers: tuple = field(default=(), repr=False)  # kvcache specs, one per layer
    demand: K.Demand = field(default=K.Demand(0, 0), repr=False)

    @property
    def concurrency(self) -> float:
        """Full-length requests the whole deployment holds (DP engines have their own caches):
        vLLM's "Maximum concurrency" per engine (pool blocks / blocks per request) x DP."""
        if not self.max_model_len:
            return 0.0
        per_engine = self.cache.get("engine_concurrency")
        if per_engine is None:
            per_engine = self.tokens / self.max_model_len
        return self.layout.dp * per_engine

    def label(self) -> str:
        L = self.layout
        parts = [f"TP{L.tp}"]
        if L.pp > 1:
            parts.append(f"PP{L.pp}")
        if L.dp > 1:
            parts.append(f"DP{L.dp}")
        text = "x".join(parts)
        return text + ("+EP" if L.expert_parallel else "")

    def summary(self) -> str:
        if not self.fits:
            return f"{self.label()}: {self.problem}"
        return (f"{self.label()}: {self.tokens:,} KV tokens per engine, "
                f"{self.concurrency:.1f} concurrent at {self.max_model_len:,} tokens")


@dataclass
class Plan:
    model: ModelSpec
    hardware: Hardware
    chosen: Candidate
    vllm_version: str
    chunked_prefill: bool
    kv_pinned: bool
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    alternatives: list[Candidate] = field(default_factory=list)
    enforce_eager: bool = False
    performance: Any = None  # perfplan.Assessment of the chosen candidate
    assessments: dict[int, Any] = field(default_factory=dict)  # id(candidate) -> Assessment
    objective: str = "balanced"
    workload: Workload | None = None
    slo: SLO | None = None
    why_not: dict[int, str] = field(default_factory=dict)  # id(runner-up) -> the figure it lost on
    serving: Any = None  # serving.Serving: MTP, parsers, all-to-all backend

    @property
    def fits(self) -> bool:
        return self.chosen.fits

    @property
    def distributed_executor_backend(self) -> str:
        return "mp"

    def vllm_args(self) -> list[str]:
        """vLLM's arguments for this plan; empty when it does not fit (nothing to run)."""
        if not self.fits:
            return []
        c, L = self.chosen, self.chosen.layout
        args = ["--model", self.model.path or self.model.hf_id]
        if self.model.path:
            args += ["--served-model-name", self.model.name]
        elif self.model.revision:  # the Hub revision as the user gave it, like the id
            args += ["--revision", self.model.revision]
        args += ["--tensor-parallel-size", str(L.tp)]
        if L.pp > 1:
            args += ["--pipeline-parallel-size", str(L.pp)]
        if L.dp > 1:
            args += ["--data-parallel-size", str(L.dp)]
        if L.expert_parallel:
            args.append("--enable-expert-parallel")
        args += ["--max-model-len", str(c.max_model_len), "--kv-cache-dtype", c.kv_dtype]
        if self.kv_pinned:
            args += ["--kv-cache-memory-bytes", str(c.kv_memory)]
        if not (self.kv_pinned and self.hardware.is_cpu):
            # With a pinned KV size vLLM skips profiling but still checks free memory against
            # utilization x total (v1/worker/gpu_worker.py Worker.init_device ->
            # v1/worker/utils.py request_memory): keep the utilization the plan chose.
            args += ["--gpu-memory-utilization", f"{c.utilization:.2f}"]
        args += ["--max-num-seqs", str(c.max_num_seqs),
                 "--max-num-batched-tokens", str(c.max_num_batched_tokens)]
        if self.chunked_prefill:
            args.append("--enable-chunked-prefill")
        if self.enforce_eager and not self.hardware.is_cpu:
            args.append("--enforce-eager")
        if self.serving is not None:
            args += self.serving.vllm_args()
        return args

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
            env.update(self.serving.env())
        return env

    def to_dict(self) -> dict[str, Any]:
        c, L, hw, m = self.chosen, self.chosen.layout, self.hardware, self.model
        return {
            "fits": self.fits,
            "model": {"name": m.name, "hf_id": m.hf_id, "architecture": m.architecture,
                      "params": B.param_count(m),
                      "weights_bytes": round(B.weights_bytes(m) * B.checkpoint_scale(m)),
                      "quantization": m.quant.method, "path": m.path,
                      "max_context": m.max_context, "attention": m.attention,
                      **m.provenance()},
            "gpus": {"name": hw.kind.name, "count": hw.count, "nodes": hw.nodes,
                     "gpus_per_node": hw.gpus_per_node, "total_bytes": hw.total_bytes,
                     "free_bytes": hw.free_bytes, "source": hw.source,
                     "compute_capability": hw.kind.compute_capability,
                     "platform": hw.kind.platform},
            "parallel": {"tp": L.tp, "pp": L.pp, "dp": L.dp,
                         "expert_parallel": L.expert_parallel, "nodes": L.nodes,
                         "distributed_executor_backend": self.distributed_executor_backend},
            "gpu_memory_utilization": round(c.utilization, 4),
            "max_model_len": c.max_model_len,
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "enable_chunked_prefill": self.chunked_prefill,
            "enforce_eager": self.enforce_eager,
            "kv_cache": {"dtype": c.kv_dtype, "bytes_per_token": c.kv_bytes_per_token,
                         "block_size": c.block_size, "memory_bytes": c.kv_memory,
                         "tokens": c.tokens, "blocks": c.blocks, "pinned": self.kv_pinned,
                         "layer_kinds": c.cache.get("kinds", {}),
                         "groups": c.cache.get("groups", 1),
                         "blocks_per_request": c.cache.get("blocks_per_request"),
                         "bytes_per_block": c.cache.get("block_bytes")},
            "per_gpu": {"requested_bytes": c.requested, "weights_bytes": c.weights,
                        "activation_bytes": c.activation, "cudagraph_bytes": c.cudagraph,
                        "non_torch_bytes": c.non_torch, "kv_cache_bytes": c.kv_memory},
            "max_concurrency": round(c.concurrency, 2),
            "per_stage": c.stages if L.pp > 1 else [],
            "vllm_version": self.vllm_version,
            "vllm_args": self.vllm_args(),
            "env": self.env(),
            "reasons": self.reasons,
            "warnings": self.warnings,
            "suggestions": self.suggestions,
            "alternatives": [self._alternative(a) for a in self.alternatives],
            "performance": self._performance(self.performance),
            "problem": c.problem or None,
            "serving": self.serving.to_dict() if self.serving is not None else None,
        }

    def _performance(self, a: Any) -> dict[str, Any] | None:
        from .perfplan import performance_dict

        if self.workload is None or self.slo is None:
            return None
        return performance_dict(a, self.objective, self.workload, self.slo)

    def _alternative(self, c: Candidate) -> dict[str, Any]:
        """A runner-up with the figure it lost on."""
        a = self.assessments.get(id(c))
        L = c.layout
        why = c.problem if not c.fits else self.why_not.get(id(c), "")
        return {"label": c.label(),
                "parallel": {"tp": L.tp, "pp": L.pp, "dp": L.dp,
                             "expert_parallel": L.expert_parallel, "nodes": L.nodes},
                "kv_cache": {"dtype": c.kv_dtype, "tokens": c.tokens},
                "max_concurrency": round(c.concurrency, 2), "fits": c.fits,
                "performance": self._performance(a) if a else None,
                "summary": c.summary(), "why_not": why}



# ----------------------------------------------------------------------------- search


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n): pairs (d, n // d) up to sqrt(n)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def tp_allowed(spec: ModelSpec, tp: int) -> str | None:
    """None when vLLM can shard this model over `tp` ranks, else why not."""
    if spec.num_heads % tp:
        return f"TP {tp} does not divide the {spec.num_heads} attention heads"
    kv = spec.num_kv_heads
    if spec.attention == "gqa" and kv % tp and tp % kv:
        return f"TP {tp} and the {kv} KV heads do not divide one another"
    return None


def _version_notes(spec: ModelSpec, pins: Pins, traits: VersionTraits, reasons: list[str],
                   warnings: list[str]) -> None:
    """Say which vLLM the plan is for, and refuse what that version cannot do."""
    from .capabilities import installed_vllm, table

    newest = str(table()["newest_modelled_vllm"])
    if traits.newer_than_modelled:
        warnings.append(f"vLLM {traits.version} is newer than the newest release vlaunch models "
                        f"({newest}): planned with {newest}'s accounting")
    if pins.vllm_version:
        reasons.append(f"vLLM {traits.version}: as given by --vllm-version")
    elif installed_vllm():
        reasons.append(f"vLLM {traits.version}: the installed version")
    else:
        reasons.append(f"vLLM {traits.version}: assumed (no vLLM is installed here; "
                       "--vllm-version sets another)")
    if spec.attention.startswith("mla") and not traits.has("mla_attention"):
        why = gate_reason("mla_attention", traits.version)
        raise InputError(f"{spec.name} uses MLA attention: {why}; plan for a newer "
                         "--vllm-version")
    if (pins.kv_cache_memory_bytes or pins.pin_kv_memory) \
            and not traits.has("kv_cache_memory_bytes"):
        raise InputError(f"{gate_reason('kv_cache_memory_bytes', traits.version)}: drop the "
                         "pinned KV size or plan for a newer --vllm-version")


def layouts(spec: ModelSpec, hw: Hardware, pins: Pins,
            traits: VersionTraits | None = None) -> list[B.Layout]:
    """Layouts over all GPUs. TP groups never straddle a node unless TP spans whole nodes
    (TP16 on 2x8: valid in vLLM, ranked against TP8 x PP2 by the model's cross-node
    all-reduce cost); PP stages inside a node or across nodes (vLLM places ranks TP-major,
    so a stage is a TP group); DP (+EP for MoE) as engines; an EP group never larger than the
    routed experts (vLLM cannot give a rank no expert)."""
    if hw.is_cpu:
        if (pins.tp or 1) > 1 or (pins.pp or 1) > 1 or (pins.dp or 1) > 1:
            raise InputError("the CPU engine is planned as one process: drop --tp/--pp/--dp "
                             "(or the parallel sizes after --)")
        return [B.Layout()]
    has_ep = traits is None or traits.has("expert_parallel")
    has_dp = traits is None or traits.has("data_parallel")
    if pins.expert_parallel and not has_ep:
        raise InputError(f"{gate_reason('expert_parallel', traits.version)}: drop "
                         "--expert-parallel or plan for a newer --vllm-version")
    if (pins.dp or 1) > 1 and not has_dp:
        raise InputError(f"{gate_reason('data_parallel', traits.version)}: drop --dp or plan "
                         "for a newer --vllm-version")
    total, per_node = hw.count, hw.gpus_per_node
    tps = _divisors(per_node) + [per_node * k for k in _divisors(hw.nodes) if k > 1]
    out = []
    for tp in tps:
        if pins.tp and tp != pins.tp or tp_allowed(spec, tp):
            continue
        for dp in _divisors(total // tp):
            pp = total // (tp * dp)
            if pins.pp and pp != pins.pp or pins.dp and dp != pins.dp:
                continue
            if dp > 1 and not has_dp:
                continue
            if pp > 1 and (dp > 1 or pp > spec.num_layers):
                continue
            if tp > per_node and dp > 1:
                continue
            ep = spec.is_moe and tp * dp > 1 and has_ep
            if pins.expert_parallel is not None:
                ep = pins.expert_parallel and spec.is_moe
            if ep and tp * dp > spec.num_experts:
                continue
            out.append(B.Layout(tp=tp, pp=pp, dp=dp, expert_parallel=ep, nodes=hw.nodes))
    if pins.tp and not out:
        why = tp_allowed(spec, pins.tp) or (f"TP {pins.tp} does not fit {per_node} GPUs per node "
                                            "with the pinned PP/DP")
        raise InputError(f"--tp {pins.tp} is not possible for {spec.name}: {why}")
    return out


def _utilization(hw: Hardware, pins: Pins, traits: VersionTraits,
                 warnings: list[str], reasons: list[str]) -> float:
    if hw.is_cpu:
        return CPU_MEMORY_FRACTION
    ceiling = math.floor(max(0, hw.free_bytes - CUDA_CONTEXT_BYTES) / hw.budget_total * 100) / 100
    if pins.gpu_memory_utilization is not None:
        u = pins.gpu_memory_utilization
        reasons.append(f"gpu-memory-utilization {u:.2f}: pinned by you")
        if hw.source == "nvml" and u > ceiling:
            warnings.append(f"only {hw.free_bytes / GiB:.1f} GiB of {hw.total_bytes / GiB:.1f} GiB "
                            f"is free: vLLM's start-up check needs free >= {u:.2f} x total; "
                            f"{ceiling:.2f} would pass")
        return u
    u = traits.default_gpu_memory_utilization
    if hw.source == "nvml" and ceiling < u:
        reasons.append(f"gpu-memory-utilization {ceiling:.2f}: lowered from vLLM's default {u:.2f} "
                       f"because only {hw.free_bytes / GiB:.1f} GiB of "
                       f"{hw.total_bytes / GiB:.1f} GiB is free (vLLM refuses to start when "
                       "free < utilization x total)")
        return max(0.01, ceiling)
    reasons.append(f"gpu-memory-utilization {u:.2f}: vLLM {traits.version}'s default, and the "
                   "free memory allows it")
    return u


def reported_tokens(blocks: int, block: int, length: int) -> int:
    """KV tokens as vLLM reports them: whole max-length requests' worth,
    blocks / cdiv(len, block) x len (kv_cache_utils); blocks x block when len is a multiple."""
    if not length or length % block == 0:
        return blocks * block
    return int(blocks / math.ceil(length / block) * length)


def cache_options(spec: ModelSpec, hw: Hardware, traits: VersionTraits) -> dict[str, Any]:
    """How this vLLM on this platform builds the layer caches (budget.layer_caches)."""
    ssm = None
    lay_dtype = str((spec.config.get("text_config") or spec.config).get("mamba_ssm_dtype") or "")
    if hw.is_cpu and cpu_resets_ssm_dtype() and lay_dtype not in ("float32",):
        ssm = 4  # platforms/cpu.py: AVX512-BF16 CPUs keep GDN's SSM state in float32
    return {"hybrid": traits.has("hybrid_kv_cache"), "mla_align": traits.mla_cache_align,
            "ssm_bytes": ssm, "plain_fp8_sparse": is_blackwell(hw)
            and traits.has("sparse_mla_plain_fp8")}


def is_blackwell(hw: Hardware) -> bool:
    """Data-center Blackwell (compute capability 10.x: B200, B300, GB200)."""
    cc = hw.kind.cc
    return hw.kind.platform == "cuda" and cc is not None and 10.0 <= cc < 11.0


def capture_cap(spec: ModelSpec, hw: Hardware, traits: VersionTraits) -> int:
    """vLLM's largest CUDA-graph capture size: 512, or 1024 on data-center Blackwell
    (config/vllm.py _set_cudagraph_sizes) and for gpt-oss (GptOssForCausalLMConfig)."""
    if spec.architecture == "gpt_oss" or (is_blackwell(hw)
                                           and traits.has("blackwell_capture_1024")):
        return 1024
    return 512


def concurrent_batches(hw: Hardware, layout: B.Layout, traits: VersionTraits) -> int:
    """Batches scheduled but not yet settled (VllmConfig.max_concurrent_batches): two with
    async scheduling, which vLLM turns on by default for one pipeline stage with the mp
    executor vlaunch uses (config/vllm.py); the pipeline depth otherwise. The CPU platform
    turns async scheduling off (platforms/cpu.py check_and_update_config): one batch."""
    if hw.is_cpu:
        return 1
    if layout.pp == 1 and traits.has("async_scheduling"):
        return 2
    return layout.pp


def state_pages(traits: VersionTraits) -> int:
    """State pages a request holds: prefix caching (on by default) puts Mamba-style layers in
    "align" mode, two pages (MambaModelConfig, MambaSpec.max_memory_usage_bytes)."""
    return 2 if traits.has("mamba_prefix_caching") else 1


def evaluate(spec: ModelSpec, hw: Hardware, layout: B.Layout, kv_dtype: str, util: float,
             traits: VersionTraits, pins: Pins, chunked: bool) -> Candidate:
    """Run the budget model for one layout; the result says whether and how well it fits."""
    block = pins.block_size or block_size(hw, spec.attention, kv_dtype)[0]
    world = layout.tp * layout.pp
    d_tokens, d_seqs = batch_defaults(hw, world, traits.version)
    seqs = pins.max_num_seqs or d_seqs
    stages = B.pp_stages(spec.num_layers, layout.pp)
    pool, layer_specs = B.kv_pool(spec, kv_dtype, layout.tp, block, **cache_options(
        spec, hw, traits))
    block = pool.block  # a state layer may have grown it (Platform._align_hybrid_block_size)
    limiting = max(stages, key=len)
    per_token = K.context_bytes_per_token([layer_specs[i] for i in limiting])
    scale = B.checkpoint_scale(spec)
    weights = [round(w * scale) for w in B.stage_weight_bytes(spec, layout)]
    full = spec.max_context
    target = pins.max_model_len or full

    tokens_cap = pins.max_num_batched_tokens or min(d_tokens, seqs * target)
    if not chunked:  # vLLM requires a whole max-length prompt per step without chunking
        tokens_cap = max(tokens_cap, target)
    demand = K.Demand(target, tokens_cap * concurrent_batches(hw, layout, traits),
                      state_pages(traits))
    profile_tokens = tokens_cap if chunked else max(tokens_cap, target)
    activation = B.activation_bytes(spec, layout, profile_tokens, seqs,
                                    sampler_sorts=not traits.has("sampler_no_sort"),
                                    moe_all_dp_tokens=True)
    eager = pins.enforce_eager or hw.is_cpu
    cudagraph = (B.cudagraph_bytes(spec, layout, seqs, tokens_cap, eager,
                                   full_and_piecewise=traits.has("full_and_piecewise"),
                                   cap=capture_cap(spec, hw, traits))
                 if traits.has("cudagraph_estimate") else 0)
    non_torch = 0 if hw.is_cpu else B.non_torch_bytes(layout,
                                                       traits.has("nccl_before_snapshot"))
    block_bytes = [pool.bytes_per_block(r if len(stages) > 1 else None) for r in stages]

    pinned = pins.kv_cache_memory_bytes
    if hw.is_cpu:
        requested = B.requested_bytes(hw.free_bytes, util)
        budget = requested - max(weights) - B.CPU_NON_KV_MARGIN
        # never more than the batch can use: every sequence at full length, and the null block
        want = (seqs * pool.blocks_per_request(demand) + 1) * max(block_bytes)
        avail = [pinned if pinned else min(budget, want)]
        activation = cudagraph = 0
    else:
        requested = B.requested_bytes(hw.budget_total, util)
        overhead = activation + cudagraph + non_torch
        avail = [pinned if pinned else requested - w - overhead for w in weights]
    if len(avail) == 1 and len(stages) > 1:
        avail = avail * len(stages)
    blocks = min(B.kv_blocks(a, bb) for a, bb in zip(avail, block_bytes, strict=True))
    kv_memory = blocks * max(block_bytes)
    on_stage = [r if len(stages) > 1 else None for r in stages]
    longest = min(K.longest_fitting(pool, a, demand, full, r)
                  for a, r in zip(avail, on_stage, strict=True)) if min(avail) > 0 else 0
    length = pins.max_model_len or longest
    cap = K.capacity(pool, blocks, K.Demand(length, demand.in_flight, demand.state_pages))
    tokens = cap.tokens
    problem = ""
    runs, why = attention_support(hw, spec.attention)
    if not runs:
        problem = why
    elif min(avail) <= 0:
        short = -min(avail)
        problem = (f"weights {max(weights) / GiB:.1f} GiB + overhead "
                   f"{(activation + cudagraph + non_torch) / GiB:.1f} GiB exceed the "
                   f"{requested / GiB:.1f} GiB vLLM may use per GPU by {short / GiB:.1f} GiB")
    elif longest < length:
        problem = (f"KV cache holds {longest:,} tokens for one request, less than one "
                   f"{length:,}-token request")
    elif not pins.max_model_len and length < min(MIN_CONTEXT, full):
        problem = f"only {longest:,} tokens of KV cache: below the {MIN_CONTEXT:,}-token minimum"
    seqs_final = pins.max_num_seqs or seqs
    if not problem and tokens_cap < seqs_final:
        problem = (f"max-num-batched-tokens {tokens_cap:,} is below max-num-seqs "
                   f"{seqs_final:,}: vLLM refuses that (SchedulerConfig)")
    stage_info = [{"layers": len(r), "weights_bytes": w, "kv_cache_bytes": blocks * bb}
                  for r, w, bb in zip(stages, weights, block_bytes, strict=True)]
    cache = {"kinds": pool.kinds(), "groups": len(pool.groups),
             "blocks_per_request": cap.blocks_per_request, "block_bytes": max(block_bytes),
             "engine_concurrency": cap.concurrency}
    return Candidate(layout, kv_dtype, block, util, requested, max(weights), activation,
                     cudagraph, non_torch, kv_memory, per_token, blocks, tokens, length,
                     seqs_final, tokens_cap, not problem, problem, stage_info, cache,
                     tuple(layer_specs), demand)


def _rank(c: Candidate) -> tuple:
    """Memory objective: fits; then context; then concurrent sequences; then fewer stages."""
    return (c.fits, c.max_model_len if c.fits else -c.weights, round(c.concurrency, 1),
            -c.layout.pp, -c.layout.dp, c.layout.tp)


def _speed_rank(c: Candidate, a: Any, objective: str, gpus: int) -> tuple:
    """Fits and context first (a plan never trades the target context for speed), then the
    objective's figure from the performance model, then the memory ranking."""
    score = a.score(objective, gpus) if a is not None else float("-inf")
    return (c.fits, c.max_model_len if c.fits else -c.weights, score, *_rank(c)[2:])


def _kv_choices(spec: ModelSpec, hw: Hardware, pins: Pins, version: str,
                reasons: list[str], warnings: list[str]) -> tuple[list[str], str]:
    """KV dtypes worth evaluating, and why fp8 is or is not among them."""
    supported, why = fp8_kv_support(hw, spec.attention, version)
    if pins.kv_cache_dtype:
        reasons.append(f"kv-cache-dtype {pins.kv_cache_dtype}: pinned by you")
        if pins.kv_cache_dtype.startswith("fp8") and not supported:
            warnings.append(f"fp8 KV is not supported here: {why}")
        return [pins.kv_cache_dtype], why
    if supported:
        return ["auto", "fp8"], why
    reasons.append(f"kv-cache-dtype auto ({spec.dtype}): fp8 not chosen because {why}")
    return ["auto"], why


def make_plan(spec: ModelSpec, hw: Hardware, pins: Pins | None = None,
              suggest: bool = True, *, workload: Workload | None = None,
              objective: str | None = None, slo: SLO | None = None,
              concurrency: int | None = None) -> Plan:
    """Plan a deployment of `spec` on `hw` honouring `pins`, for `workload` under `slo`, ranked
    by `objective`; never raises for a misfit."""
    from . import perfplan

    pins = pins or Pins()
    pins.validate()
    workload = workload or resolve_workload()
    objective = check_objective(objective)
    slo = slo or SLO()
    if concurrency is not None and concurrency < 1:
        raise InputError(f"--concurrency must be a positive integer, got {concurrency}")
    version = pins.vllm_version or default_vllm_version()
    traits = version_traits(version)
    reasons: list[str] = []
    warnings: list[str] = list(hw.notes)
    _version_notes(spec, pins, traits, reasons, warnings)
    if spec.commit:
        where = {"hf-cache": "the local HF cache", "vlaunch-cache": "vlaunch's cache of the Hub",
                 "hub": "the Hub"}.get(spec.source, spec.source)
        reasons.append(f"model {spec.hf_id} at commit {spec.commit[:12]}"
                       + (f" (revision {spec.revision})" if spec.revision else "")
                       + f", from {where}"
                       + (": weights from the safetensors metadata" if spec.params_by_dtype
                          else ""))
    if spec.estimate == "generic":
        warnings.append(f"{spec.name}: model_type '{spec.architecture}' is not in vlaunch's "
                        "tables; shapes are a generic decoder estimate from config.json"
                        + (", weights from the safetensors metadata" if spec.checkpoint_bytes
                           else ""))
    if pins.max_model_len and pins.max_model_len > spec.max_context:
        raise InputError(f"--max-model-len {pins.max_model_len:,} exceeds {spec.name}'s context "
                         f"of {spec.max_context:,} tokens (vLLM refuses it without "
                         "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    scale = B.checkpoint_scale(spec)
    if abs(scale - 1) > 0.01:
        warnings.append(f"the checkpoint index holds {spec.checkpoint_bytes / GiB:.2f} GiB but "
                        f"config.json counts {B.weights_bytes(spec, False) / GiB:.2f} GiB; "
                        "weights are sized from the index (the ground truth)")
    util = _utilization(hw, pins, traits, warnings, reasons)
    dtypes, fp8_why = _kv_choices(spec, hw, pins, version, reasons, warnings)
    chunked = not (hw.is_cpu and spec.attention.startswith("mla")) and traits.engine == "v1"
    gpus = hw.count
    assessed: dict[int, Any] = {}
    best_by_dtype: dict[str, list[Candidate]] = {}
    for dtype in dtypes:
        cands = [evaluate(spec, hw, L, dtype, util, traits, pins, chunked)
                 for L in layouts(spec, hw, pins, traits)]
        if not cands:
            raise InputError(f"no parallel layout of {spec.name} matches {hw.describe()} with "
                             "the pinned --tp/--pp/--dp")
        for c in cands:
            assessed[id(c)] = perfplan.assess(spec, hw, c, traits, chunked, workload, slo,
                                              concurrency)
        cands.sort(key=lambda c: _speed_rank(c, assessed[id(c)], objective, gpus), reverse=True)
        best_by_dtype[dtype] = cands
    kv_dtype = _decide_kv(best_by_dtype, assessed, objective, gpus, fp8_why, reasons, warnings,
                          pinned=bool(pins.kv_cache_dtype))
    cands = best_by_dtype[kv_dtype]
    best = cands[0]
    best = _tune_batch(spec, hw, best, assessed, traits, pins, chunked, util, workload, slo,
                       objective, concurrency, reasons)
    pinned = ((hw.is_cpu and traits.has("kv_cache_memory_bytes"))
              or bool(pins.kv_cache_memory_bytes) or (pins.pin_kv_memory and best.fits))
    plan = Plan(spec, hw, best, version, chunked, pinned, reasons, warnings,
                alternatives=cands[1:6], enforce_eager=pins.enforce_eager,
                performance=assessed.get(id(best)), assessments=assessed, objective=objective,
                workload=workload, slo=slo)
    plan.why_not = {id(c): _why_not(c, assessed.get(id(c)), best, assessed.get(id(best)),
                                     objective) for c in cands[1:6]}
    if pins.pin_kv_memory and not hw.is_cpu:
        warnings.append("--pin-kv-memory: vLLM ignores gpu-memory-utilization and skips its "
                        "memory profiling; only the plan's margins for activations, graphs and "
                        "non-torch memory protect the start-up")
    from . import serving

    plan.serving = serving.apply(plan, pins, concurrency)
    if not pinned and plan.chosen.fits:  # keyed by the final flags, serving ones included
        _apply_measured(plan)
    _explain(plan, cands, pins)
    _explain_speed(plan, cands, pins)
    if suggest and not best.fits:
        plan.suggestions = suggestions(spec, hw, pins)
    return plan


def _decide_kv(by_dtype: dict[str, list[Candidate]], assessed: dict[int, Any], objective: str,
               gpus: int, fp8_why: str, reasons: list[str], warnings: list[str],
               pinned: bool) -> str:
    """fp8 KV when bf16 cannot hold the target context, or when it raises the objective's
    figure by FP8_MARGIN; otherwise auto, with the numbers."""
    if pinned or len(by_dtype) == 1:
        return next(iter(by_dtype))
    auto, fp8 = by_dtype["auto"][0], by_dtype["fp8"][0]
    a_auto, a_fp8 = assessed.get(id(auto)), assessed.get(id(fp8))
    accuracy = ("fp8 KV without calibrated scales (k/v scale 1.0) can cost accuracy; "
                "check your evals or pin --kv-cache-dtype auto")
    if fp8.fits and (not auto.fits or fp8.max_model_len > auto.max_model_len):
        reasons.append("kv-cache-dtype fp8: needed - bf16 KV holds "
                       + (f"only {auto.max_model_len:,} tokens of context" if auto.fits
                          else "no whole request") + f" ({fp8_why})")
        warnings.append(accuracy)
        return "fp8"
    if a_auto is not None and a_fp8 is not None and auto.fits:
        s_auto, s_fp8 = a_auto.score(objective, gpus), a_fp8.score(objective, gpus)
        gain = (s_fp8 - s_auto) / abs(s_auto) if s_auto else 0.0
        if gain >= FP8_MARGIN:
            reasons.append(f"kv-cache-dtype fp8: {a_fp8.figure(objective)} vs "
                           f"{a_auto.figure(objective)} with bf16 ({gain:+.0%}, over the "
                           f"{FP8_MARGIN:.0%} margin)")
            warnings.append(accuracy)
            return "fp8"
        reasons.append(f"kv-cache-dtype auto: bf16 KV already holds the workload; fp8 would "
                       f"change the objective's figure by {gain:+.0%} (under the "
                       f"{FP8_MARGIN:.0%} margin that would justify its accuracy risk)")
        return "auto"
    reasons.append("kv-cache-dtype auto: bf16 KV holds the context; no speed figure to "
                   "justify fp8 on this GPU")
    return "auto"


def _tune_batch(spec: ModelSpec, hw: Hardware, best: Candidate, assessed: dict[int, Any],
                traits: VersionTraits, pins: Pins, chunked: bool, util: float,
                workload: Workload, slo: SLO, objective: str, concurrency: int | None,
                reasons: list[str]) -> Candidate:
    """max_num_seqs from the SLO knee, max_num_batched_tokens from the prefill/decode
    trade-off; re-checked by the budget model (both change the activation profile)."""
    from . import perfplan

    a = assessed.get(id(best))
    if a is None or not best.fits or hw.is_cpu:
        return best
    seqs = pins.max_num_seqs
    notes = []
    if seqs is None and objective in ("balanced", "latency"):
        k = perfplan.knee_seqs(a)
        if k is not None and k < best.max_num_seqs:
            over = perf_point_note(a, best.max_num_seqs, workload)
            seqs = k
            notes.append(f"max-num-seqs {k:,} per engine: the SLO knee ({slo.describe()} holds "
                         f"up to {a.knee.concurrency:,.0f} in flight); vLLM's "
                         f"{best.max_num_seqs:,} would let {over}")
    tokens = pins.max_num_batched_tokens
    if tokens is None and chunked:
        tokens, why = perfplan.choose_chunk(a, slo, best.max_num_batched_tokens)
        need = seqs or best.max_num_seqs
        if tokens < need:  # vLLM requires max_num_batched_tokens >= max_num_seqs
            tokens = need
            why += f", raised to max-num-seqs {need:,} (vLLM requires at least that)"
        notes.append(why)
    if seqs is None and (tokens is None or tokens == best.max_num_batched_tokens):
        reasons.extend(notes)
        return best
    tuned_pins = dataclasses.replace(pins, max_num_seqs=seqs or pins.max_num_seqs,
                                     max_num_batched_tokens=tokens or pins.max_num_batched_tokens)
    tuned = evaluate(spec, hw, best.layout, best.kv_dtype, util, traits, tuned_pins, chunked)
    if not tuned.fits or tuned.max_model_len < best.max_model_len:
        return best
    ta = perfplan.assess(spec, hw, tuned, traits, chunked, workload, slo, concurrency)
    if ta is not None and seqs != pins.max_num_seqs and a.knee is not None:
        # The cap sits at the knee: report the service there (beyond it requests queue) and
        # what bound it before the cap.
        from . import perf

        ta.knee = perf.point(ta.shape, workload, a.knee.concurrency)
        if not concurrency:
            ta.at = ta.knee
        ta.curve = perf.curve(ta.shape, workload,
                              tuple(x for x in (a.knee.concurrency, concurrency) if x))
        ta.binding = a.binding
    assessed[id(tuned)] = ta
    reasons.extend(notes)
    return tuned


def perf_point_note(a: Any, seqs: int, workload: Workload) -> str:
    """What vLLM's own limit would do to latency when that many requests arrive."""
    from . import perf

    n = seqs * a.shape.dp
    p = perf.point(a.shape, workload, n)
    return f"TPOT reach {p.tpot_ms:.0f} ms and TTFT {p.ttft_ms:,.0f} ms at {n:,} in flight"


def _why_not(c: Candidate, a: Any, best: Candidate, a_best: Any, objective: str) -> str:
    if not c.fits:
        return c.problem
    if c.max_model_len < best.max_model_len:
        return f"holds only {c.max_model_len:,} tokens of context"
    if a is None or a_best is None:
        return f"fewer concurrent sequences ({c.concurrency:.1f})"
    return f"{a.figure(objective)}; chosen: {a_best.headline(objective)}"


def _explain_speed(plan: Plan, cands: list[Candidate], pins: Pins) -> None:
    a, w = plan.performance, plan.workload
    r = plan.reasons
    if w is not None:
        r.insert(0, f"workload: {w.describe()}; objective {plan.objective}; SLO "
                 f"{plan.slo.describe() if plan.slo else '-'}")
    if a is None:
        if plan.fits:
            r.append("no performance prediction: the GPU catalog has no bandwidth/FLOPS for "
                     f"{plan.hardware.kind.name}; layouts ranked by memory alone")
        return
    r.insert(1, f"predicted ({a.source}): {a.figure(plan.objective)}; binding: {a.binding}")
    r.extend(a.notes)


def _apply_measured(plan: Plan) -> None:
    """Use the KV memory vLLM measured on an earlier boot of exactly these decisions."""
    from . import measured

    row = measured.lookup(measured.plan_key(plan.to_dict()))
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
    plan.reasons.append(f"KV cache {c.kv_memory / GiB:.2f} GiB: measured by vLLM at an earlier "
                        f"start of this exact plan ({row.get('source', 'startup plan')}, "
                        f"{row.get('recorded_at', '?')}); the budget model alone predicted "
                        f"{predicted / GiB:.2f} GiB")


def _explain(plan: Plan, cands: list[Candidate], pins: Pins) -> None:
    c, spec = plan.chosen, plan.model
    r = plan.reasons
    if c.fits:
        r.insert(0, f"layout {c.label()}: {c.summary().split(': ', 1)[1]}"
                 + (" (pinned)" if pins.tp or pins.pp or pins.dp else ""))
        if plan.performance is None:  # with a performance model the runner-ups are listed there
            for other in cands[1:4]:
                r.append(f"not {other.summary()}")
    if pins.max_model_len:
        r.append(f"max-model-len {c.max_model_len:,}: pinned by you")
    elif c.fits and c.max_model_len == spec.max_context:
        r.append(f"max-model-len {c.max_model_len:,}: the model's full context fits")
    elif c.fits:
        r.append(f"max-model-len {c.max_model_len:,}: the largest that fits (full context "
                 f"{spec.max_context:,} does not)")
    if plan.chunked_prefill:
        r.append(f"chunked prefill on (max-num-batched-tokens {c.max_num_batched_tokens:,}, "
                 f"max-num-seqs {c.max_num_seqs:,}): prompts ride in decode steps instead of "
                 "stalling them")
    else:
        r.append(f"chunked prefill off: vLLM turns it off for MLA on the {plan.hardware.kind.name}"
                 " platform")
    if plan.kv_pinned:
        r.append(f"KV cache pinned to {c.kv_memory:,} bytes with --kv-cache-memory-bytes "
                 f"({c.blocks:,} blocks of {c.block_size} tokens)")
    if c.layout.tp > 1 and spec.attention.startswith("mla"):
        r.append("MLA keeps one latent per token on every TP rank: the KV cache is not split "
                 "by TP")


def inputs_from_plan(d: dict[str, Any]) -> tuple[ModelSpec, Hardware, Pins]:
    """What an emitted plan was made from: its model, the hardware as the plan saw it (free
    memory included) and every decision pinned, so `exec`, the doctor and calibration re-plan
    exactly that plan."""
    from dataclasses import replace

    from ..inputs.hardware import parse_gpus
    from ..inputs.model import load_model
    from .plan_check import check_plan

    check_plan(d)  # one line naming a missing or mistyped field, not a KeyError
    m = d["model"]
    # the commit the plan was made from: exec re-plans that config, offline from the cache
    spec = load_model(m.get("path") or m["hf_id"],
                      None if m.get("path") else (m.get("commit") or m.get("revision")))
    if m.get("commit") and not m.get("path"):  # vLLM still gets the revision the user gave
        spec = replace(spec, revision=m.get("revision"))
    g = d["gpus"]
    hw = parse_gpus("cpu" if g["platform"] == "cpu" else
                    f"{g['nodes']}x{g['gpus_per_node']}x{g['name']}")
    if g["platform"] != "cpu":
        hw = replace(hw, total_bytes=g["total_bytes"], free_bytes=g["free_bytes"],
                     source=g.get("source", "plan"))
    p, kv = d["parallel"], d["kv_cache"]
    pins = Pins(tp=p["tp"], pp=p["pp"], dp=p["dp"], expert_parallel=p["expert_parallel"],
                max_model_len=d["max_model_len"], kv_cache_dtype=kv["dtype"],
                gpu_memory_utilization=None if kv.get("pinned") else d["gpu_memory_utilization"],
                kv_cache_memory_bytes=kv["memory_bytes"] if kv.get("pinned") else None,
                max_num_seqs=d["max_num_seqs"], max_num_batched_tokens=d["max_num_batched_tokens"],
                enforce_eager=bool(d.get("enforce_eager")), vllm_version=d.get("vllm_version"),
                **serving_pins(d))
    return spec, hw, pins


def serving_pins(d: dict[str, Any]) -> dict[str, Any]:
    """The serving decisions (MTP, parsers, all-to-all backend) of an emitted plan as pins."""
    from .serving import pins_from_plan

    return pins_from_plan(d)


# ----------------------------------------------------------------------------- suggestions


def _try(spec: ModelSpec, hw: Hardware, pins: Pins) -> Plan | None:
    try:
        plan = make_plan(spec, hw, pins, suggest=False)
    except InputError:
        return None
    return plan if plan.fits else None


def _brief(plan: Plan) -> str:
    c = plan.chosen
    return (f"{c.label()}, {c.weights / GiB:.1f} GiB weights per GPU, "
            f"{c.tokens:,} KV tokens, {c.max_model_len:,}-token context, "
            f"{c.concurrency:.1f} concurrent")


def suggestions(spec: ModelSpec, hw: Hardware, pins: Pins) -> list[str]:
    """Ranked alternatives that do fit, each with its own numbers."""
    out: list[str] = []
    free_pins = dataclasses.replace(pins, tp=None, pp=None, dp=None)
    if not hw.is_cpu:
        per_node = max(hw.gpus_per_node, 8) if hw.gpus_per_node < 8 else hw.gpus_per_node
        options = [(1, n) for n in (2, 4, 8) if hw.nodes == 1 and hw.gpus_per_node < n <= per_node]
        options += [(n, per_node) for n in (2, 3, 4) if n > hw.nodes]
        for nodes, gpn in options:
            bigger = dataclasses.replace(hw, nodes=nodes, gpus_per_node=gpn)
            plan = _try(spec, bigger, free_pins)
            if plan:
                layout = f"{nodes}x{gpn}x{hw.kind.name}" if nodes > 1 else f"{gpn}x{hw.kind.name}"
                out.append(f"more GPUs: {layout} fits ({_brief(plan)})"
                           + (" across nodes" if nodes > 1 else ""))
                break
    if pins.max_model_len:
        relaxed = make_plan(spec, hw, dataclasses.replace(pins, max_model_len=None),
                            suggest=False)
        if relaxed.fits:
            out.append(f"shorter context: --max-model-len {relaxed.chosen.max_model_len:,} fits "
                       f"({_brief(relaxed)})")
    if spec.quant.method in ("none", "fp8_block", "fp8_channel"):
        quant = Quant("int4_group", 4, 128)
        q_spec = dataclasses.replace(spec, quant=quant, name=f"{spec.name}-awq",
                                     checkpoint_bytes=None)
        plan = _try(q_spec, hw, free_pins)
        if plan:
            out.append(f"a quantized variant: an AWQ/GPTQ int4 checkpoint of {spec.name} "
                       f"({B.weights_bytes(q_spec) / GiB:.0f} GiB) fits ({_brief(plan)})")
    if spec.architecture.startswith("deepseek"):
        from ..inputs.model import list_profiles

        distills = [p for p in list_profiles() if p.distill_of]
        distills.sort(key=lambda p: B.param_count(p), reverse=True)
        for d in distills:
            plan = _try(d, hw, Pins(vllm_version=pins.vllm_version))
            if plan:
                out.append(f"an R1 distill: {d.name} ({B.param_count(d) / 1e9:.1f}B) fits "
                           f"({_brief(plan)})")
                break
    if not out:
        out.append("nothing close fits this hardware; try a larger GPU class")
    return out
