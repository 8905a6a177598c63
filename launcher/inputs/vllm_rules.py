"""The table of vLLM's (and NCCL's) failure messages: each message's pattern, the memory
consumer it charges, the failure kind serve and tune retry on, and where vLLM prints it.

Why a module of its own: the table is data, read by the scan (`vllm_failures`) and checked
line by line against the fixtures (tests/test_doctor.py); it grows with every vLLM release
and must not drown the scan's logic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .vllm_loglines import Facts

CONSUMERS = ("weights", "kv_cache", "activations", "cuda_graphs", "co_tenant", "none")

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
    environment: bool = False  # the machine failed (an import, the driver), not the flags


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
        r"(?=.*?GPU \d+ has a total capacity of (?P<total>[\d.]+) GiB)?"
        r"(?:CUDA out of memory|torch\.(?:cuda\.)?OutOfMemoryError|CUDA error: out of memory"
        r"|Failed to load model - not enough GPU memory|HIP out of memory)"),
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
        r"(?: \(size (?P<size>\d+)\))?|failed to extend (?P<segment2>\S+?),?(?: to (?P<size2>\d+) "
        r"bytes)?(?:$|[\s,])|failed to create shared memory file (?P<segment3>\S+)"
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
        "none", "OTHER", "Python's import system", environment=True),
    Rule("gpu_unavailable", _r(
        r"Found no NVIDIA driver on your system|No CUDA GPUs are available"
        r"|CUDA driver initialization failed|The NVIDIA driver on your system is too old"
        r"|CUDA driver version is insufficient for CUDA runtime version"
        r"|no CUDA-capable device is detected|Failed to infer device type"
        r"|libcuda\.so[.\d]*: cannot open shared object file|CUDA initialization is blocked"),
        "none", "OTHER",
        "torch/cuda/__init__.py _lazy_init (\"Found no NVIDIA driver on your system\", \"No CUDA "
        "GPUs are available\", \"The NVIDIA driver on your system is too old\"), the CUDA "
        "runtime's cudaErrorNoDevice / cudaErrorInsufficientDriver, vLLM config/device.py "
        "DeviceConfig.__post_init__ \"Failed to infer device type\" (no platform found; 0.6 to "
        "0.32) and utils/torch_utils.py \"CUDA initialization is blocked\"",
        phase="starting", environment=True),
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
RULE_BY_CAUSE = {r.cause: r for r in RULES}
NCCL_SPECIFIC = {"nccl_shared_memory", "nccl_peer_access", "nccl_infiniband", "nccl_socket"}
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
    "gpu_unavailable": ("NVIDIA driver", "No CUDA GPUs", "CUDA driver", "CUDA-capable",
                        "infer device type", "libcuda", "CUDA initialization is blocked"),
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
RULE_HINT = re.compile("|".join(re.escape(k) for k in
                                 dict.fromkeys(k for keys in RULE_KEYS.values() for k in keys)))


def consumer_by_phase(phase: str, marker: str, cpu: bool) -> str:
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


def consumer_by_budget(facts: Facts) -> str:
    """The biggest non-KV line item the log measured: the one that left no room for KV."""
    items = {"weights": facts.number("weights_gib"),
             "cuda_graphs": facts.number("cudagraph_estimate_gib"),
             "activations": facts.number("activation_peak_gib")}
    known = {k: v for k, v in items.items() if v is not None}
    if known:
        return max(known, key=lambda k: known[k])
    return "kv_cache" if facts.cpu else "weights"
