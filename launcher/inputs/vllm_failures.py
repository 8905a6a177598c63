"""Why a vLLM start failed, from its log: the table of vLLM's failure messages and one scan.

Why here, below both `run` and `observe`: `serve` and `tune` (run) retry on what a failed start
says, and `vlaunch doctor` (observe) explains it to a person. Both read the same table, so it
lives in one module that imports neither (before, vllmlog called the doctor, which called
serve, which called vllmlog). The fixes, which need the planner, stay in the doctor.

How: one pass over the log, line by line (`Scanner.feed`), in bounded memory:
1. every line's vLLM prefix ("(Worker_TP3 pid=42) ERROR 05-20 10:04:12 [file.py:1] ") is split
   off, giving the process (the rank) and the level;
2. phase marker lines move the start-up phase forward (`PHASES`, `_MARKERS`);
3. error-looking lines are matched against `RULES`, a table of vLLM's failure messages taken
   from vLLM's source, 0.6.0 to 0.32.0 (file and function cited per rule, with the wording of
   each release line), and NCCL's own WARN lines. Lines that only wrap another error ("See
   root cause above") never count as a cause or a rank;
4. the same failure on several ranks is one `Diagnosis` with `ranks` = how many.
`Report.diagnoses` is ordered by where each failure first appeared: the first is the root
cause. Nothing matched: one `unknown` diagnosis with the lines that look like the error.

A folder's logs are read oldest first as one stream (serve's vllm-RUN-attemptN.log), so the last
launch is the one diagnosed; logs of different nodes of one deployment are not merged.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import mmap
import os
import re
import stat
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..errors import InputError
from . import vllm_flags

# Start-up phases in vLLM's order. A phase can be skipped (CPU captures no graphs); it never
# goes backwards within one start. "serving" is after the API server came up.
PHASES = ("starting", "loading_weights", "profiling", "kv_cache", "capturing_graphs", "ready",
          "serving")
CONSUMERS = ("weights", "kv_cache", "activations", "cuda_graphs", "co_tenant", "none")

MAX_LINE = 8192  # longer lines are cut: a config dump must not make one line cost megabytes
MAX_EVIDENCE = 6  # evidence lines kept per diagnosis
MAX_UNKNOWN = 8  # error-looking lines kept for an `unknown` diagnosis

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
_NCCL = re.compile(r"^([\w.-]+):(\d+):\d+ \[\d+\] NCCL ")
# uvicorn's own "INFO:     Started server process" / "WARNING:  ..." lines.
# Indented text, after vLLM's prefix or at the start: a traceback frame or source line.
# Python source as a traceback quotes it: a statement, a call, a string literal.
_SOURCE = re.compile(r"(?:raise|assert|return|File|if|elif|with|for|yield|await)\b|[fr]?[\"'(\[]"
                     r"|[\w.]+\s*(?:=|\()|\^|~")
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
    if rank is None and " NCCL " in text and (n := _NCCL.match(text)):
        rank = f"{n.group(1)}:{n.group(2)}"  # NCCL's own "host:pid:tid [dev] NCCL WARN ..."
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
            or head.startswith(("INFO:", "WARNING:", "DEBUG:", "INFO ", "WARNING ", "DEBUG ")))


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


_CONFIG_REPR = re.compile(r"\b(KVTransferConfig)\(")
MAX_CONFIG_REPR = 4000
"""Longest config repr read (characters): vLLM 0.32's KVTransferConfig prints ~300."""


def config_reprs_as_dicts(text: str) -> str:
    """vLLM prints a config object among the non-default args as its dataclass repr
    (`'kv_transfer_config': KVTransferConfig(kv_connector='NixlConnector', ..., kv_role=
    'kv_both', ...)`: api_utils.py logs the parsed namespace), which no literal reader takes;
    rewrite each as the dict of its literal fields so the other args still read. Parsed, never
    run (`ast.parse`); a field whose value is no literal is left out; bounded in length."""
    out, pos = [], 0
    for m in _CONFIG_REPR.finditer(text):
        if m.start() < pos:
            continue
        depth, i, quote = 1, m.end(), ""
        while i < len(text) and depth and i - m.end() < MAX_CONFIG_REPR:
            ch = text[i]
            if quote:
                quote = "" if ch == quote and text[i - 1] != "\\" else quote
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            i += 1
        if depth:  # unbalanced or too long (or inside a string): left as it is
            continue
        fields: dict[str, Any] = {}
        with contextlib.suppress(SyntaxError, ValueError, RecursionError, MemoryError):
            call = ast.parse("f(" + text[m.end():i - 1] + ")", mode="eval").body
            for kw in getattr(call, "keywords", []):
                with contextlib.suppress(ValueError, SyntaxError, TypeError):
                    fields[str(kw.arg)] = ast.literal_eval(kw.value)
        out += [text[pos:m.start()], repr(fields)]
        pos = i
    return "".join(out) + text[pos:]


@dataclass
class Facts:
    """What the log says about the run, beyond the error: its arguments and measurements."""

    numbers: dict[str, float] = field(default_factory=dict)
    cpu: bool = False
    args_text: str = ""  # vLLM's "non-default args: {...}", parsed only when a fix reads it

    @functools.cached_property
    def args(self) -> dict[str, Any]:
        with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
            value = ast.literal_eval(config_reprs_as_dicts(self.args_text)) \
                if self.args_text else None
            if isinstance(value, dict):
                # a number no flag takes (utilization 1.02, a 1e26 context) is nonsense from a
                # broken or hostile log: read as absent, so no fix or pin is made from it
                return {k: v for k, v in value.items()
                        if vllm_flags.sane_log_value(str(k), v)}
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
        r"(?: Based on the available memory,(?: the estimated maximum model length is "
        r"(?P<estimate>\d+))?)?"
        r"|The model's max seq len \((?P<max_model_len_v0>\d+)\) is larger than the maximum "
        r"number of tokens that can be stored in KV cache \((?P<kv_tokens>\d+)\)"),
        "kv_cache", "KV_SHORTAGE",
        "V1: v1/core/kv_cache_utils.py check_enough_kv_cache_memory (_check_enough_kv_cache_"
        "memory in 0.32.0): 0.7.x \"models's ... (X GB KV cache is needed ... (Y GB)\" without an "
        "estimate; 0.8.x \"GiB\" and \"Based on the available memory,\" with the estimate lost "
        "(an f-string bug of 0.8.5); 0.9 to 0.25 \"models's\" with \"the estimated maximum model "
        "length is N\"; 0.26 on \"model's\". V0 (0.6.0 to 0.10.x): worker/worker.py "
        "raise_if_cache_size_invalid and worker/cpu_worker.py _validate_num_cpu_blocks \"The "
        "model's max seq len (X) is larger than the maximum number of tokens that can be stored "
        "in KV cache (Y)\""),
    Rule("no_kv_cache_memory", _r(r"No available memory for the cache blocks"),
         "by_budget", "NO_KV_MEMORY",
         "v1/core/kv_cache_utils.py (all V1 releases, 0.7 to 0.32; from 0.14 with a link to "
         "conserving_memory, from 0.26 noting the flag also sizes CPU memory); V0 (0.6 to 0.10): "
         "worker/worker.py raise_if_cache_size_invalid, worker/cpu_worker.py "
         "_validate_num_cpu_blocks (\"Try increasing `VLLM_CPU_KVCACHE_SPACE`\")"),
    Rule("free_memory_below_utilization", _r(
        r"(?:Free|Available) memory on (?:device|node)(?: (?P<device>[^\s(]+))? "
        r"\((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on (?:startup|kv cache allocation) is "
        r"less than (?:desired (?:GPU|CPU) memory utilization \((?P<util>[\d.]+), "
        r"(?P<requested>[\d.]+) GiB\)|the engine's budget after excluding external process's "
        r"weights \((?P<util2>[\d.]+), (?P<requested2>[\d.]+) GiB\)|requested memory for kv "
        r"\((?P<kv_requested>[\d.]+)(?:/[\d.]+)? GiB\))"),
        "co_tenant", "INSUFFICIENT_FREE_MEMORY",
        "v1/worker/gpu_worker.py Worker.init_device \"Free memory on device (X/Y GiB) on startup "
        "is less than desired GPU memory utilization (U, R GiB)\" (0.9 to 0.11); "
        "v1/worker/utils.py request_memory with the device name (0.14 to 0.32); "
        "v1/worker/cpu_worker.py \"Available memory on node N ... desired CPU memory "
        "utilization\" (0.20 on) and determine_available_memory (CPU)"),
    Rule("memory_changed_during_profiling", _r(
        r"Error in memory profiling\. Initial free memory (?P<initial>[\d.]+)(?: GiB)?, "
        r"current free memory (?P<current>[\d.]+)"),
        "co_tenant", "OTHER",
        "assertion in Worker.determine_available_memory: V0 worker/worker.py (0.6 to 0.10, "
        "raw bytes, \"the GPU memory was not properly cleaned up\"); V1 v1/worker/gpu_worker.py "
        "(0.9 on, GiB, \"other processes sharing the same container release GPU memory\"); "
        "v1/worker/xpu_worker.py keeps raw bytes",
        transient=True, phase="profiling"),
    Rule("sampler_warmup_oom", _r(
        r"CUDA out of memory occurred when warming up (?:sampler|pooler)(?: \([^)]*\))? with "
        r"(?P<num_reqs>\d+) dummy requests"),
        "activations", "DEVICE_OOM",
        "v1/worker/gpu_model_runner.py GPUModelRunner._dummy_sampler_run (0.8 on) and "
        "_dummy_pooler_run (0.9: \"pooler with\"; 0.10 on: \"pooler (task=...) with\")",
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
    Rule("nccl_shared_memory", _r(
        r"Error while (?:creating|attaching to) shared memory segment (?P<segment>\S+)"
        r"(?: \(size (?P<size>\d+)\))?|failed to extend (?P<segment2>\S+) to (?P<size2>\d+) "
        r"bytes|failed to create shared memory file (?P<segment3>\S+)"
        r"|Call to posix_fallocate failed"),
        "none", "OTHER",
        "NCCL src/misc/shmutils.cc ncclShmOpen WARN \"Error while creating shared memory "
        "segment %s (size %ld)\", \"Error: failed to extend %s to %ld bytes\" (posix_fallocate "
        "in NCCL before 2.12): /dev/shm is full or too small (a container's 64 MiB default)"),
    Rule("nccl_peer_access", _r(
        r"peer access is not supported between these two devices|cudaErrorPeerAccessUnsupported"
        r"|peer mapping resources exhausted|P2P/IPC .* failed|failed to open CUDA IPC handle"),
        "none", "OTHER",
        "NCCL's CUDACHECK WARN \"Cuda failure 'peer access is not supported between these two "
        "devices'\" (cudaDeviceEnablePeerAccess in the P2P transport, src/transport/p2p.cc)"),
    Rule("nccl_infiniband", _r(
        r"NCCL WARN NET/IB\w*\s*:\s*(?P<ib>.+)|Got completion from peer \S+ with "
        r"(?:error|status)[ =]?(?P<status>\w+)|ibv_(?:modify_qp|create_qp|reg_mr\w*|poll_cq|"
        r"open_device)\w* failed"),
        "none", "OTHER",
        "NCCL src/transport/net_ib.cc WARN \"NET/IB : Got completion from peer %s with error %d"
        "\" and the ibv_* wrappers (src/misc/ibvwrap.cc \"Call to ibv_... failed\")"),
    Rule("nccl_socket", _r(
        r"NCCL WARN (?:NET/Socket|Net|Bootstrap|socket\w*|misc/socket)\w*\s*:\s*"
        r"(?P<socket>[^\n]*(?:[Cc]onnect|[Cc]onnection|interface|recv|send|[Tt]imeout)[^\n]*)"
        r"|socketProgress(?:Opt)?: (?:Call to recv|Connection closed by remote peer)"
        r"|Bootstrap : no socket interface found"),
        "none", "OTHER",
        "NCCL src/misc/socket.cc (\"socketProgress: Connection closed by remote peer %s\", "
        "\"Connect to %s failed\") and src/bootstrap.cc \"Bootstrap : no socket interface "
        "found\""),
    Rule("cpu_attention_head_size", _r(
        r"Unsupported CPU attention configuration: head_dim=(?P<head_dim>\d+)"),
        "none", "OTHER",
        "vLLM's CPU attention kernel (csrc/cpu, _C.abi3.so of vllm-cpu 0.32.0) at the first "
        "request; the sizes it takes: v1/attention/backends/cpu_attn.py "
        "CPUAttentionBackend.get_supported_head_sizes", phase="serving"),
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
        r"The quantization method (?P<method>\S+(?: \+ \S+)?) is not supported for the current "
        r"GPU\. "
        r"Minimum capability: (?P<min>\d+)\. Current capability: (?P<cur>\d+)"),
        "weights", "OTHER",
        "model_executor/model_loader/loader.py _get_quantization_config (0.6) and config/vllm.py "
        "VllmConfig._get_quantization_config (0.32), same wording; layers/quantization/"
        "moe_wna16.py \"moe_wna16 + awq\" (0.11 on)", phase="starting"),
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
        r"Timed out waiting for engine core processes to start\..*?Waited (?P<waited>\d+)s"
        r"|Timed out waiting for engines to send ?initial message on input socket"),
        "none", "OTHER",
        "v1/engine/core_client.py MPClient.__init__: \"Timed out waiting for engine core "
        "processes to start ... Waited Ns\" (0.20 on, VLLM_ENGINE_READY_TIMEOUT_S); "
        "\"Timed out waiting for engines to send initial message on input socket\" (0.11, 0.14)"),
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
_NCCL_SPECIFIC = {"nccl_shared_memory", "nccl_peer_access", "nccl_infiniband", "nccl_socket"}
# Fixed text every match of a rule contains (one of): a line holding none of a rule's keys is not
# searched with its pattern, and a line holding no key at all is not searched with any (keeps a
# 50,000-line log well under a second). tests/test_doctor.py checks every fixture line a rule
# matches holds one of its keys.
RULE_KEYS: dict[str, tuple[str, ...]] = {
    "kv_cache_too_small": ("max seq len",),
    "no_kv_cache_memory": ("cache blocks",),
    "free_memory_below_utilization": ("memory on ",),
    "memory_changed_during_profiling": ("Error in memory profiling",),
    "sampler_warmup_oom": ("out of memory occurred when warming up",),
    "cuda_oom": ("out of memory", "OutOfMemoryError", "not enough GPU memory"),
    "host_oom_killed": ("-9", "137", "OOMKilled", "Killed", "oom-kill"),
    "nccl_timeout": ("Watchdog", "NCCL"),
    "nccl_shared_memory": ("shared memory", "failed to extend", "posix_fallocate"),
    "nccl_peer_access": ("peer access", "PeerAccess", "peer mapping", "IPC"),
    "nccl_infiniband": ("NET/IB", "completion from peer", "ibv_"),
    "nccl_socket": ("NCCL WARN", "socketProgress", "Bootstrap"),
    "cpu_attention_head_size": ("head_dim=",),
    "nccl_error": ("NCCL error", "nccl", "DistBackendError"),
    "kv_cache_dtype_unsupported": ("kv_cache_dtype", "FP8 KV", "fp8e4nv", "Float8_e"),
    "invalid_kv_cache_dtype": ("--kv-cache-dtype: invalid choice",),
    "quantization_unsupported": ("The quantization method",),
    "missing_module": ("No module named",),
    "port_in_use": ("ddress already in use",),
    "model_not_found": ("Repo id must be", "is not a local folder", "RepositoryNotFoundError",
                        "Repository Not Found", "Invalid repository ID"),
    "hub_unreachable": ("huggingface.co", "outgoing traffic", "LocalEntryNotFoundError",
                        "Max retries exceeded"),
    "hub_access_denied": ("GatedRepoError", "gated repo", "401 Client Error"),
    "engine_ready_timeout": ("Timed out waiting for engine",),
    "max_model_len_exceeds_model": ("User-specified max_model_len",),
    "tp_not_divisible": ("must be divisible by tensor parallel size",),
    "invalid_argument": (": error: ",),
}
_RULE_HINT = re.compile("|".join(re.escape(k) for k in
                                 dict.fromkeys(k for keys in RULE_KEYS.values() for k in keys)))


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
                "numbers": json_numbers(self.numbers), "first_line": self.first_line}


# What each message's numbers are called in JSON: the names the plan uses for the same things
# (max_model_len, gpu_memory_utilization, kv_cache.dtype, tp, ...), with the unit vLLM printed
# them in (vLLM prints GiB; the plan's byte counts are *_bytes).
_JSON_NAMES = {
    "needed": "needed_kv_gib", "available": "available_kv_gib",
    "estimate": "estimated_max_model_len", "kv_tokens": "kv_cache.tokens",
    "free": "free_gib", "total": "total_gib", "util": "gpu_memory_utilization",
    "requested": "requested_gib", "kv_requested": "kv_requested_gib",
    "initial": "initial_free_gib", "current": "current_free_gib",
    "num_reqs": "max_num_seqs", "asked": "max_model_len", "derived": "derived_max_model_len",
    "key": "config_key", "heads": "num_attention_heads", "dtype": "kv_cache.dtype",
    "method": "quantization", "min": "min_compute_capability", "cur": "compute_capability",
    "size": "shm_segment_bytes", "segment": "shm_segment", "waited": "waited_s",
    "unknown": "unknown_arguments", "module": "module", "model": "model", "unit": "unit",
}


def json_numbers(numbers: dict[str, Any]) -> dict[str, Any]:
    """A diagnosis' numbers under the JSON vocabulary's names ("a.b" nests as {"a": {"b"}});
    the profiling error's raw byte counts (V0) become GiB like the other releases print."""
    out: dict[str, Any] = {}
    for key, value in numbers.items():
        if key in ("initial", "current") and isinstance(value, (int, float)) and value > 1 << 20:
            value = round(value / (1 << 30), 2)
        name = _JSON_NAMES.get(key, key)
        head, _, tail = name.partition(".")
        if tail:
            out.setdefault(head, {})[tail] = value
        else:
            out[name] = value
    return out


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
        if len(self.evidence) < MAX_EVIDENCE:
            text = shown(line.text)
            if text not in self.evidence:
                self.evidence.append(text)


# Terminal control characters (an escape sequence in a log must not repaint the reader's
# terminal) and Unicode's bidirectional overrides (they reorder what is shown).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# The flag table's secrets, as "non-default args" prints them ('api_key': '...') and as a
# command line gives them, abbreviations argparse accepts included (`--api-ke K`).
_SECRETS = [f for f in vllm_flags.flags() if f.secret]
_SECRET_TEXT = re.compile(
    "('(?:" + "|".join(f.dest for f in _SECRETS) + r")':\s*)(?:\[[^\]]*\]|'[^']*')|(--(?:"
    + "|".join(re.escape(f.name[2:i]) for f in _SECRETS for i in range(len(f.name), 2, -1))
    + r")[= ])\S+")


def shown(text: str) -> str:
    """A log line as evidence may show it: control characters escaped (\\x1b), and the values
    of --api-key and --hf-token (as vLLM's "non-default args" prints them) hidden."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                        else f"\\u{ord(m.group()):04x}", text)
    return _SECRET_TEXT.sub(lambda m: (m.group(1) + "'***'") if m.group(1)
                            else m.group(2) + "***", text)


_ALIAS = re.compile(r"(?:_v0|\d)$")  # "model2", "max_model_len_v0": another wording's group
_INT = re.compile(r"-?\d+")
_DEC = re.compile(r"-?\d+\.\d*")


def _value(text: str) -> Any:
    """A number the message printed, as a number (JSON shows numbers as numbers); else text."""
    if _INT.fullmatch(text):
        return int(text)
    if _DEC.fullmatch(text):
        return float(text)
    return text


def _numbers(m: re.Match[str]) -> dict[str, Any]:
    """The named groups a message matched, under one name per fact whichever wording printed
    it, numbers converted."""
    out: dict[str, Any] = {}
    for k, v in m.groupdict().items():
        if v is not None:
            out.setdefault(_ALIAS.sub("", k), _value(v))
    return out


def _rank_count(ranks: set[str]) -> int:
    """Distinct processes that failed this way; the API server and unprefixed lines (which echo
    an engine's error) count only when no engine or worker reported it."""
    named = {r for r in ranks if r and not r.startswith("APIServer")}
    # one process, two names: vLLM's "Worker_TP0:300" and NCCL's "host:300" (by process id)
    return max(1, len({r.rsplit(":", 1)[-1] if r.rsplit(":", 1)[-1].isdigit() else r
                       for r in named}))


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
                "model": _model_of(self.facts)}


def _model_of(facts: Facts) -> dict[str, str] | None:
    """The log's model as the plan's JSON names it (`model.name`), or None."""
    name = facts.arg("model") or facts.arg("model_tag")
    return {"name": str(name)} if name else None


class Scanner:
    """One pass over a log in bounded memory: feed lines, then `report()`."""

    def __init__(self) -> None:
        self.count = 0
        self.launches = 0
        self.vllm_seen = False  # a line naming vLLM (what makes a stream a vLLM log)
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
        if not self.vllm_seen:
            self.vllm_seen = ("vllm" in raw.lower() or "EngineCore" in raw
                              or "(APIServer" in raw or "api_server.py" in raw)
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
        if raw[:1].isspace() or "]  " in raw or "] \t" in raw:
            # A traceback's frame or source line ("    raise ValueError(...)"): neither an
            # error message nor a marker; the message itself follows as "ValueError: ...".
            # An indented message (pydantic's "  Value error, ...") still counts.
            if _SOURCE.match(raw.split("] ", 1)[-1].strip()) or not _RULE_HINT.search(raw):
                return
            hint = True
        else:
            hint = _RULE_HINT.search(raw) is not None
        line = split_line(self.count, raw)
        content = line.content
        if not content:
            return
        if line.level not in ("ERROR", "CRITICAL") and not line.indented \
                and _has_context(content):
            self._context(content)
        if not line.errorish:
            return
        if hint and self._match(line):
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
        content = line.content
        for rule in RULES:
            if line.wrapper and not rule.on_wrappers and "Worker failed with error" not in \
                    content:
                continue
            for key in RULE_KEYS[rule.cause]:
                if key in content:
                    break
            else:
                continue
            m = rule.pattern.search(content)
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
        hits = dict(self.hits)
        specific = [h for h in hits.values() if h.rule.cause in _NCCL_SPECIFIC]
        if specific:  # NCCL's own WARN line says why; torch's "NCCL error" only that it failed
            for key in [k for k, h in hits.items() if h.rule.cause == "nccl_error"]:
                generic = hits.pop(key)
                first = min(specific, key=lambda h: h.first_line)
                first.first_line = min(first.first_line, generic.first_line)
                first.ranks |= generic.ranks
                first.wrapped_only = first.wrapped_only and generic.wrapped_only
        diagnoses = [self._diagnosis(h) for h in sorted(hits.values(), key=_order)]
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
            if shown(x.text) not in seen:
                seen.append(shown(x.text))
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
MAX_BYTES = 256 << 20  # read at most the last 256 MiB of a log: the failure is at its end
_HEAD = 65536  # a vLLM log names vLLM in its first 64 KiB (the banner, the version line)


def _mentions_vllm(head: bytes) -> bool:
    """vLLM's name, its engine or API server process, or the usage line of its entry point
    (vllm/entrypoints/openai/api_server.py, whose argparse errors name nothing else)."""
    return (b"vllm" in head.lower() or b"EngineCore" in head or b"(APIServer" in head
            or b"api_server.py" in head)


def _regular(path: Path) -> bool:
    """A regular file: never a device (/dev/zero never ends), a FIFO (blocks), a socket."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def log_files(path: Path) -> list[Path]:
    """The vLLM logs in a folder: regular *.log/*.txt/*.out/*.err files that mention vLLM
    (first 64 KiB), oldest first so that a later restart's log is read last."""
    files = sorted({p for pat in _LOG_NAMES for p in path.glob(pat) if _regular(p)},
                   key=lambda p: (p.stat().st_mtime, p.name))
    out = []
    for p in files:
        with contextlib.suppress(OSError), p.open("rb") as f:
            if _mentions_vllm(f.read(_HEAD)):
                out.append(p)
    return out


def _lines_of(stream: TextIO, budget: list[int] | None = None) -> Iterator[str]:
    """Lines of a text stream, each at most MAX_LINE characters, without holding the file;
    with `budget` ([characters left]) it stops once that many have been read (stdin's cap)."""
    while True:
        chunk = stream.readline(MAX_LINE)
        if not chunk:
            return
        if not chunk.endswith("\n"):
            rest = chunk
            while rest and not rest.endswith("\n"):  # drop the remainder of an overlong line
                rest = stream.readline(MAX_LINE)
        if budget is not None:
            budget[0] -= len(chunk)
            if budget[0] < 0:
                return
        yield chunk


def _tail_start(size: int, m: Any) -> int:
    """Where reading a file of `size` bytes starts: at most MAX_BYTES before its end, on a
    line boundary."""
    if size <= MAX_BYTES:
        return 0
    cut = m.find(b"\n", size - MAX_BYTES)
    return size if cut < 0 else cut + 1


def _last_launch(path: Path) -> tuple[int, int, int] | None:
    """(offset, lines before it, launches before it) of the last launch in the file's tail,
    or None when the tail holds no launch. A restart resets the diagnosis (the last launch is
    the one diagnosed), so everything before the last launch only counts lines and launches:
    a crash-looping pod's 50,000 lines are then scanned from its last start."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            start = _tail_start(size, m)
            pos = m.rfind(_LAUNCH.encode(), start)
            if pos < 0:
                return None
            line = m.rfind(b"\n", start, pos) + 1 or start
            before = m[start:line]
            return line, before.count(b"\n"), before.count(_LAUNCH.encode())


def _open_at(path: Path, offset: int | None = None) -> TextIO:
    """The file as text from `offset`, or from at most MAX_BYTES before its end, starting at a
    whole line."""
    f = path.open("rb")
    if offset is None:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BYTES:
            f.seek(size - MAX_BYTES)
            f.readline()  # the rest of a line cut in half
    else:
        f.seek(offset)
    return io.TextIOWrapper(f, encoding="utf-8", errors="replace")


def _skip_to_last_launch(files: list[Path], scanner: Scanner) -> tuple[int, int | None]:
    """(index of the first file to read, offset in it) after skipping what precedes the last
    launch of the stream; the skipped lines and launches are counted into `scanner`."""
    for i in range(len(files) - 1, -1, -1):
        found = _last_launch(files[i])
        if found is None:
            continue
        offset, lines, launches = found
        for skipped in files[:i]:
            with _open_at(skipped) as stream:
                for raw in _lines_of(stream):
                    lines += 1
                    launches += _LAUNCH in raw
        scanner.count, scanner.launches = lines, launches
        scanner.vllm_seen = True
        return i, offset
    return 0, None


def scan_lines(lines: Iterable[str]) -> Report:
    scanner = Scanner()
    for raw in lines:
        scanner.feed(raw)
    return scanner.report()


def scan_text(text: str) -> Report:
    return scan_lines(io.StringIO(text))


def scan_source(source: str, stdin: TextIO | None = None) -> tuple[Report, list[str]]:
    """Diagnose a file, a folder of vLLM logs, or "-" (stdin). Returns (report, names read).

    Raises InputError for a missing, unreadable or non-regular path, an empty log, a file or
    stream that is not a vLLM log (the folder scan's rule: vLLM named in its first 64 KiB),
    or a folder without vLLM logs: one line that says what to pass instead. At most the last
    MAX_BYTES of a file (the first of stdin) are read.
    """
    if source == "-":
        stream = stdin if stdin is not None else _stdin()
        scanner = Scanner()
        for raw in _lines_of(stream, [MAX_BYTES]):
            scanner.feed(raw)
        report = scanner.report()
        names = ["<stdin>"]
        if report.lines and not scanner.vllm_seen:
            raise InputError("stdin is not a vLLM log (no vLLM line in it); pipe the log of a "
                             "vLLM start, e.g. kubectl logs POD | vlaunch doctor -")
    else:
        path = Path(source)
        if not path.exists():
            raise InputError(f"no such log: {source}; pass a vLLM log file, a folder of logs, "
                             "or - for stdin")
        if path.is_dir():
            files = log_files(path)
            if not files:
                raise InputError(f"no vLLM logs in {source} (looked for *.log, *.txt, *.out, "
                                 "*.err that mention vLLM)")
        elif not _regular(path):
            raise InputError(f"{source} is not a regular file (a device, FIFO or socket); pass "
                             "a vLLM log file, a folder of logs, or - for stdin")
        else:
            files = [path]
        scanner = Scanner()
        try:
            if files == [path]:
                with path.open("rb") as head:
                    first = head.read(_HEAD)
                if first and not _mentions_vllm(first):
                    raise InputError(f"{source} is not a vLLM log (no vLLM line in its "
                                     "first 64 KiB); pass the log of a vLLM start")
            start, offset = _skip_to_last_launch(files, scanner)
            for i, f in enumerate(files[start:]):
                with _open_at(f, offset if i == 0 else None) as stream:
                    for raw in _lines_of(stream):
                        scanner.feed(raw)
        except OSError as e:
            raise InputError(f"cannot read {e.filename or source}: {e.strerror or e}") from None
        except ValueError as e:  # mmap of a file that changed size while read
            raise InputError(f"cannot read {source}: {e}") from None
        report = scanner.report()
        names = [str(f) for f in files]
    if report.lines == 0:
        raise InputError(f"the log {names[0]} is empty; pass the log of a vLLM start")
    return report, names


def _stdin() -> TextIO:
    return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")




# --- what serve and tune retry on --------------------------------------------------------------

# Failure kinds: stable strings that the serve loop and tune compare against.
KV_SHORTAGE = "KV_SHORTAGE"
NO_KV_MEMORY = "NO_KV_MEMORY"
DEVICE_OOM = "DEVICE_OOM"
INSUFFICIENT_FREE_MEMORY = "INSUFFICIENT_FREE_MEMORY"
OTHER = "OTHER"


@dataclass
class Failure:
    """Why the engine did not come up, as far as its log tells (a root `Diagnosis` reduced to
    the kind and numbers re-planning reads)."""

    kind: str  # one of KV_SHORTAGE, NO_KV_MEMORY, DEVICE_OOM, INSUFFICIENT_FREE_MEMORY, OTHER
    message: str  # the line that told us (trimmed), for humans
    max_model_len: int | None = None
    needed_kv_gib: float | None = None
    available_kv_gib: float | None = None
    estimated_max_model_len: int | None = None
    free_gib: float | None = None
    total_gib: float | None = None
    requested_utilization: float | None = None
    requested_gib: float | None = None
    details: dict[str, str] = field(default_factory=dict)
    # The cause (RULES) and whether the same flags may be retried once (memory changed during
    # profiling, an NCCL timeout); a deterministic failure never is.
    cause: str | None = None
    transient: bool = False

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def to_failure(d: Diagnosis) -> Failure:
    """A diagnosis as the `Failure` serve's and tune's re-planning read."""
    n = d.numbers
    rule = _RULE_BY_CAUSE.get(d.cause)

    def num(key: str, conv: Callable[[Any], Any] = float) -> Any:
        return conv(n[key]) if n.get(key) is not None else None

    details = {"cause": d.cause, "consumer": d.consumer, "phase": d.phase}
    if d.cause == "unknown" and n.get("exception"):
        details["exception"] = n["exception"]
    if n.get("device"):
        details["device"] = n["device"]
    return Failure(
        kind=rule.kind if rule else "OTHER",
        message=_strip(d.evidence[0]) if d.evidence else d.cause,
        max_model_len=num("max_model_len", int), needed_kv_gib=num("needed"),
        available_kv_gib=num("available"),
        estimated_max_model_len=num("estimate", int) or num("kv_tokens", int),
        free_gib=num("free"), total_gib=num("total"),
        requested_utilization=num("util"), requested_gib=num("requested"),
        details=details, cause=d.cause, transient=d.transient)


def _strip(text: str) -> str:
    return split_line(0, text).content[:2000] or text[:2000]


def classify(text: str) -> Diagnosis | None:
    """The root cause of a failed start in `text`, or None when the log shows no error."""
    report = scan_text(text)
    return report.root
