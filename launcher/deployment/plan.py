"""The deployment plan as frozen, typed objects: what `vlaunch plan` decided, read by every command.

Frozen dataclasses, not pydantic: the plan must stay a light import (`vlaunch plan` and
`--help` import it), it adds no dependency, and it is the style of vLLM's own configs
(vllm/config/*.py). A `Deployment` is made once by the planner (predict/search/planner.py),
written and read only by the codec (`deployment.codec`), and rendered at the edge (render.py,
plot.py).

A deployment is one `aggregated` pool, or a `prefill` and a `decode` pool (disaggregated
serving, each with its side of the KV hand-off in `transfer`); a pool's autoscaling is the
next capability: its field is here and `None` until it exists. The free-form figures of a
decision (a reason's numbers, MTP's options) are `Mapping`s of JSON values; everything the
commands read is a typed field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["aggregated", "prefill", "decode"]
PoolRole = Literal["prefill", "decode"]
"""The pools of a disaggregated deployment; one of them is what an emitted folder runs."""
Kind = Literal["aggregated", "disaggregated"]
Objective = Literal["balanced", "throughput", "latency"]


@dataclass(frozen=True)
class Reason:
    """One explanation as data: a stable `code` a program may test, the numbers in `data`, and
    the `text` a person reads (rendered from the same numbers when the reason was made)."""

    code: str
    text: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelRef:
    """The model the plan was made for, and where its facts came from."""

    name: str
    hf_id: str | None
    architecture: str
    params: int
    weights_bytes: int
    quantization: str
    path: str | None
    max_context: int
    attention: str
    source: str
    estimate: str
    revision: str | None = None
    commit: str | None = None
    params_by_dtype: Mapping[str, int] | None = None
    checkpoint_params: int | None = None


@dataclass(frozen=True)
class HardwareRef:
    """The GPUs as the plan saw them: per-GPU memory of the card that limits, free included."""

    name: str
    nodes: int
    gpus_per_node: int
    total_bytes: int
    free_bytes: int
    source: str
    compute_capability: str | None
    platform: str

    @property
    def count(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """Mean tokens per request the plan was predicted for."""

    input_len: int
    output_len: int
    name: str | None
    assumed: bool


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class Point:
    """The deployment at `concurrency` requests in flight."""

    concurrency: float
    tpot_ms: float
    ttft_ms: float
    output_tokens_per_s: float
    requests_per_s: float


@dataclass(frozen=True)
class TpotRange:
    low: float
    high: float


@dataclass(frozen=True)
class Range:
    """What the operating point's figures may really be (the held-out spread)."""

    low: float
    high: float
    of: str
    tpot_ms: TpotRange
    basis: str
    ttft_ms: TpotRange | None = None


Client = Literal["bench-synchronised", "poisson", "closed-loop"]
"""Who sends the requests a figure assumes (launcher/predict/speed/request_model.py CLIENTS)."""


@dataclass(frozen=True)
class Performance:
    """Predicted service: the knee under the SLO, the operating point, the curve."""

    source: str
    at: Point
    knee: Point | None
    range: Range | None
    binding: str
    single_request: Point
    curve: tuple[Point, ...]
    notes: tuple[Reason, ...] = ()  # codes and renderers: deployment/notes.py
    asked_concurrency: int | None = None
    measured: Mapping[str, Any] | None = None  # what `vlaunch tune` measured at this point
    client: Client = "closed-loop"  # the client `at` assumes: bench-synchronised under
    # --concurrency (vllm bench serve --max-concurrency), else the knee's
    knee_client: Client = "closed-loop"  # the knee and the curve: staggered users


@dataclass(frozen=True)
class Parallel:
    tp: int
    pp: int
    dp: int
    expert_parallel: bool
    nodes: int


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config as the plan passes it."""

    method: str
    num_speculative_tokens: int


@dataclass(frozen=True)
class EngineConfig:
    """One engine: its layout and the value of every vLLM flag the plan sets (None: not
    passed, vLLM's default holds). `engine_argv` (deployment.argv) turns it into vLLM's argv."""

    model: str
    parallel: Parallel
    max_model_len: int
    kv_cache_dtype: str
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    platform: str
    served_model_name: str | None = None
    revision: str | None = None
    kv_cache_memory_bytes: int | None = None
    enable_chunked_prefill: bool = False
    enforce_eager: bool = False
    speculative_config: SpeculativeConfig | None = None
    all2all_backend: str | None = None
    enable_reasoning: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    chat_template: str | None = None
    tokenizer_mode: str | None = None
    distributed_executor_backend: str = "mp"
    enable_eplb: bool = False  # vLLM's expert-parallel load balancer (predict/features/eplb.py)
    num_redundant_experts: int | None = None  # --eplb-config's, with enable_eplb


@dataclass(frozen=True)
class KVCache:
    dtype: str
    bytes_per_token: int
    block_size: int
    memory_bytes: int
    tokens: int
    blocks: int
    pinned: bool
    layer_kinds: Mapping[str, int] = field(default_factory=dict)
    groups: int = 1
    blocks_per_request: int | None = None
    bytes_per_block: int | None = None


@dataclass(frozen=True)
class PerGpuBudget:
    """One GPU's memory as the plan divides it (the limiting rank): the stacked bar."""

    requested_bytes: int
    weights_bytes: int
    activation_bytes: int
    cudagraph_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int


@dataclass(frozen=True)
class Acceptance:
    first: float
    later: float
    source: str


@dataclass(frozen=True)
class Speculative:
    """MTP as the search decided it, with the figures that decided it."""

    enabled: bool
    method: str | None
    num_speculative_tokens: int
    pinned: bool
    acceptance: Acceptance | None
    tokens_per_step: float
    cost_per_gpu: Mapping[str, int] | None
    reason: Reason
    options: tuple[Mapping[str, Any], ...] = ()
    equal_load: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Parsers:
    reasoning_parser: str | None
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    chat_template: str | None
    tokenizer_mode: str | None
    source: str
    reasons: tuple[Reason, ...] = ()


Selector = Literal["flag", "env", "none"]
"""How a vLLM release takes the all-to-all backend: `--all2all-backend`, VLLM_ALL2ALL_BACKEND,
or not at all (profiles/serving.yaml `ep_backends.selector`)."""


@dataclass(frozen=True)
class EPBackend:
    """The expert-parallel all-to-all backend decision (predict/features/ep_backend.py makes
    it; `backend` is passed only when it differs from `vllm_default`, the `selector` way)."""

    applies: bool
    backend: str | None
    vllm_default: str | None
    pinned: bool
    cross_node: bool
    packages: tuple[str, ...]
    missing_packages: tuple[str, ...]
    nvshmem: bool
    cuda_graphs: bool
    buffer_bytes_per_gpu: int
    reason: Reason | None
    kubernetes: Mapping[str, Any] | None = None
    selector: Selector = "flag"


@dataclass(frozen=True)
class EPLB:
    """The expert-parallel load balancer decision (predict/features/eplb.py): on or off, its
    redundant experts and the bytes they take from each GPU's KV cache, and why."""

    applies: bool
    enabled: bool
    pinned: bool
    ep_size: int
    num_redundant_experts: int
    slots_per_rank: int
    bytes_per_gpu: int
    reason: Reason | None = None


@dataclass(frozen=True)
class Serving:
    speculative: Speculative
    parsers: Parsers
    ep_backend: EPBackend
    eplb: EPLB | None = None


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's share of the limiting GPU (PP > 1)."""

    layers: int
    weights_bytes: int
    kv_cache_bytes: int


@dataclass(frozen=True)
class Startup:
    """One replica's start-up, term by term (startup_time.py), or as `serve`/`tune` measured
    it from vLLM's log phases (source "measured")."""

    seconds: float
    source: Literal["model", "measured"]
    load_path: Literal["local", "volume", "hub"]
    terms: Mapping[str, float]
    assumptions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Autoscaling:
    """A pool's autoscaling targets, derived from one replica's SLO knee and start-up
    (predict/capacity/autoscaling.py): what the KEDA ScaledObject and the exporter use."""

    role: Role
    target_running_per_replica: int
    target_waiting_per_replica: int
    kv_usage_threshold: float
    prefill_backlog_s: float | None
    min_replicas: int
    max_replicas: int
    scale_up_stabilization_s: int
    scale_down_stabilization_s: int
    startup_s: float
    basis: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[Reason, ...] = ()  # codes and renderers: deployment/notes.py


@dataclass(frozen=True)
class KVTransfer:
    """One pool's side of the prefill->decode KV hand-off
    (predict/search/pd_pools.py): the connector's
    `--kv-transfer-config` object as the engine is given it, and the hand-off's figures (the
    prompt's KV bytes per GPU over `path`, the seconds TTFT pays, the connector's one-time
    handshake per prefill-decode pair)."""

    connector: str
    kv_role: str
    buffer_device: str
    config: Mapping[str, Any]
    path: str  # nvlink | xgmi | pcie inside a node, rdma across nodes
    bytes_per_gpu: int
    seconds: float
    handshake_s: float


@dataclass(frozen=True)
class Pool:
    """A set of identical engines with one role: the one `aggregated` pool, or the `prefill`
    and `decode` pools of a disaggregated deployment (each replica one engine)."""

    role: Role
    replicas: int
    gpus_per_replica: int
    nodes_per_replica: int
    engine: EngineConfig
    env: Mapping[str, str]
    kv_cache: KVCache
    per_gpu: PerGpuBudget
    max_concurrency: float
    performance: Performance | None
    serving: Serving | None
    per_stage: tuple[Stage, ...] = ()
    autoscaling: Autoscaling | None = None  # issue 27 (predict/capacity/autoscaling.py)
    startup: Startup | None = None  # issue 27 (predict/capacity/startup_time.py)
    transfer: KVTransfer | None = None  # a prefill or decode pool's side of the hand-off


@dataclass(frozen=True)
class KVTokens:
    dtype: str
    tokens: int


@dataclass(frozen=True)
class Alternative:
    """A runner-up: the best version of another layout, with the figure it lost on (`why_not`:
    a Reason of deployment/notes.py's RUNNER_UP_CODES, the chosen plan's figure in its data)."""

    label: str
    parallel: Parallel
    kv_cache: KVTokens
    max_concurrency: float
    fits: bool
    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    performance: Performance | None
    summary: str
    why_not: Reason


@dataclass(frozen=True)
class SearchCounts:
    judged: int
    timed: int


@dataclass(frozen=True)
class Deployment:
    """The whole plan: what runs where, what it is predicted to do, and why."""

    fits: bool
    model: ModelRef
    hardware: HardwareRef
    vllm_version: str
    objective: Objective
    workload: Workload | None
    slo: SLO | None
    kind: Kind
    pools: tuple[Pool, ...]
    performance: Performance | None
    candidates: SearchCounts
    problem: str | None = None
    reasons: tuple[Reason, ...] = ()
    warnings: tuple[Reason, ...] = ()
    suggestions: tuple[Reason, ...] = ()
    runners_up: tuple[Alternative, ...] = ()
    tuned: Mapping[str, Any] | None = None  # `vlaunch tune`'s pick: its trial and measurement
    role: PoolRole | None = None
    """The pool of a disaggregated plan that this copy runs (`vlaunch plan --role R --emit DIR`:
    one folder per pool, each holding the whole plan so that every pod of either pool agrees on
    it); None: the whole plan, nothing chosen."""

    @property
    def pool(self) -> Pool:
        """The pool this plan runs: the one `role` names, else the first (the aggregated one, or
        the prefill pool of a disaggregated plan). The top-level keys of the JSON mean this
        one, so a pool's folder reads like an aggregated plan of that pool."""
        if self.role is not None:
            for p in self.pools:
                if p.role == self.role:
                    return p
        return self.pools[0]

    @property
    def gpus(self) -> int:
        """Every GPU of every pool: what per-GPU figures divide by."""
        return sum(p.replicas * p.gpus_per_replica for p in self.pools)

    @property
    def engine(self) -> EngineConfig:
        return self.pool.engine
