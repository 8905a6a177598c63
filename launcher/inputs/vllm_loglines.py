"""One line of a vLLM log read: its prefix (process, level), the start-up phase it marks, and
the facts the fixes need (non-default args, measured memory, version, model).

Why a module of its own: the failure table (`vllm_rules`), the scan (`vllm_failures`) and the
reading of files (`vllm_logfiles`) all split lines the same way; one reading of vLLM's prefix
keeps them agreeing on which process printed a line and at what level.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
from dataclasses import dataclass, field
from typing import Any

from . import vllm_flags

PHASES = ("starting", "loading_weights", "profiling", "kv_cache", "capturing_graphs", "ready",
          "serving")

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
# NCCL's failure lines (src/include/debug.h WARN): "NCCL WARN" whatever prefix carries them.
NCCL_WARN = "NCCL WARN"
_NCCL = re.compile(r"^([\w.-]+):(\d+):\d+ \[\d+\] NCCL ")
# uvicorn's own "INFO:     Started server process" / "WARNING:  ..." lines.
# Indented text, after vLLM's prefix or at the start: a traceback frame or source line.
# Python source as a traceback quotes it: a statement, a call, a string literal.
SOURCE_LINE = re.compile(r"(?:raise|assert|return|File|if|elif|with|for|yield|await)\b"
                         r"|[fr]?[\"'(\[]|[\w.]+\s*(?:=|\()|\^|~")
_UVICORN_QUIET = re.compile(r"^(?:INFO|DEBUG|WARNING):\s")
# An exception line: "ValueError: ...", "torch.OutOfMemoryError: ...", "OSError: [Errno 98] ...".
EXCEPTION_LINE = re.compile(
    r"^((?:[\w]+\.)*[A-Z]\w*(?:Error|Exception|Exit|Timeout))(?::\s?(.*))?$")
# argparse: "api_server.py: error: argument --kv-cache-dtype: invalid choice: ..."
ARGPARSE_LINE = re.compile(r"^[\w.-]+: error: (.+)$")
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
        """Could this line report a failure? Quiet levels and uvicorn's INFO lines cannot,
        except NCCL's own WARN lines, which vLLM's logger may relay at any level (its workers'
        stderr through the "[nccl]" logger: "(VllmWorker rank=5 pid=733) WARNING ... [nccl]
        include/shm.h:28 NCCL WARN Error: failed to extend ...")."""
        if NCCL_WARN in self.content:
            return True
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
LAUNCH = "non-default args: "


def quiet_line(raw: str) -> bool:
    """A line at a level that never reports a failure (INFO, DEBUG, WARNING; uvicorn's too)."""
    head = raw[:200]
    if " ERROR " in head or " CRITICAL " in head or NCCL_WARN in raw:
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
_FACTS: tuple[tuple[str, tuple[str, ...], re.Pattern[str]], ...] = (
    ("weights_gib", ("Model loading took",),
     re.compile(r"Model loading took " + _FLOAT + r" ?GiB")),
    ("available_kv_gib", ("Available KV cache memory",),
     re.compile(r"Available KV cache memory: " + _FLOAT + r" ?GiB")),
    ("cudagraph_estimate_gib", ("Estimated CUDA graph memory",),
     re.compile(r"Estimated CUDA graph memory: " + _FLOAT + " GiB")),
    ("activation_peak_gib", ("torch peak memory increase",),
     re.compile(r"torch peak memory increase: " + _FLOAT + r" ?GiB")),
    ("max_model_len", ("Using max model len",), re.compile(r"Using max model len (\d+)")),
    ("max_num_batched_tokens", ("max_num_batched_tokens=",),
     re.compile(r"max_num_batched_tokens=(\d+)")),
)
# Text facts: the version and the model, from every line that names them (vLLM 0.32.0:
# entrypoints/serve/utils/api_utils.py log_version_and_model "vLLM server version %s, serving
# model %s" or its logo "version %s" / "model   %s", just before "non-default args";
# v1/engine/core.py "Initializing a V1 LLM engine (v%s) with config: model='...'" (V0:
# "Initializing an LLM engine (v%s)"); older API servers "vLLM API server version %s";
# v1/worker/gpu_model_runner.py and cpu_model_runner.py "Starting to load model %s...").
_TEXT_FACTS: tuple[tuple[str, tuple[str, ...], re.Pattern[str]], ...] = (
    ("vllm_version", ("version", "LLM engine (v"),
     re.compile(r"(?:LLM engine \(v|[Ss]erver version |\bversion\s+)(\d+\.\d+\.\d+[\w.+-]*)")),
    ("model", ("Starting to load model", "model='", "serving model", "model   "),
     re.compile(r"Starting to load model (\S+?)\.{3}|with config: model='([^']+)'"
                r"|serving model (\S+)|\s{2}model\s{3}(\S+)")),
)
_CPU_KEYS = ("CPU KV cache size", "Using CPU_", "for KV cache on node", "cpu_worker.py")
# Every fixed text a quiet line must hold to matter (a marker, a fact, a launch).
_CONTEXT_KEYS = tuple(dict.fromkeys(
    [k for _, _, keys in _MARKERS for k in keys]
    + [k for _, keys, _ in _FACTS + _TEXT_FACTS for k in keys] + list(_CPU_KEYS) + [LAUNCH]))


_CONTEXT = re.compile("|".join(re.escape(k) for k in _CONTEXT_KEYS))


def has_context(text: str) -> bool:
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

    numbers: dict[str, Any] = field(default_factory=dict)  # floats; "vllm_version" a string
    cpu: bool = False
    seen_model: str | None = None  # the model as a line named it (the args' own wins)
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
        if LAUNCH in content and (m := _ARGS.search(content)):
            self.args_text = m.group(1)
            self.__dict__.pop("args", None)
        for name, keys, pattern in _FACTS:
            if any(k in content for k in keys) and (m := pattern.search(content)) is not None:
                self.numbers[name] = float(m.group(1))
        for name, keys, pattern in _TEXT_FACTS:
            if any(k in content for k in keys) and (m := pattern.search(content)) is not None:
                text = next(g for g in m.groups() if g)
                if name == "model":
                    self.seen_model = text
                else:
                    self.numbers[name] = text
        if not self.cpu and any(k in content for k in _CPU_KEYS):
            self.cpu = True

    def arg(self, name: str) -> Any:
        return self.args.get(name)

    @property
    def model(self) -> str | None:
        """The launch's model: its "non-default args" (`model`, or `model_tag` for `vllm serve
        MODEL`), else the last line that named it."""
        name = self.args.get("model") or self.args.get("model_tag")
        return str(name) if name else self.seen_model

    @property
    def version(self) -> str | None:
        value = self.numbers.get("vllm_version")
        return value if isinstance(value, str) else None

    def number(self, name: str) -> float | None:
        value = self.numbers.get(name)
        return value if isinstance(value, (int, float)) else None
