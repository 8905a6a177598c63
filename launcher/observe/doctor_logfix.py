"""The doctor's fixes from the log alone: each diagnosis' vLLM flags and environment from the
numbers the log printed and the arguments it ran with, and the command that reruns it.

Why a module of its own: these fixes need nothing but the log (serve prints them when a start
fails, with no model or hardware to plan against); `doctor_plancheck` then checks them with
the planner when the launch's model and hardware are known.
"""

from __future__ import annotations

import math
import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..inputs import vllm_flags as F
from ..inputs.vllm_failures import Diagnosis, Report
from ..inputs.vllm_loglines import Facts
from ..predict.features.capabilities import CPU_ATTENTION_HEAD_SIZES, serve_argv
from ..predict.search.after_failure import merge_args
from .fix_ranges import out_of_range

DEFAULT_UTILIZATION = 0.92  # vllm/config/cache.py CacheConfig.gpu_memory_utilization (0.32.0)

# --- fixes from the log alone ------------------------------------------------------------------

# vLLM flag -> vlaunch serve's pin option (launcher/cli/options.py), for the flags the doctor
# may suggest (the flag table's safe set).
_VLAUNCH_PINS = {f.name: f.pin.option for f in F.pins() if f.suggest and f.pin}


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
    if "needed" not in n:  # V0's wording: the tokens the cache holds, no GiB
        held = int(n["kv_tokens"])
        return Fix([F.flag("max_model_len"), str(held)],
                   explain=[f"one request at --max-model-len {asked:,} needs more KV cache than "
                            f"vLLM had: it holds {held:,} tokens", f"{held:,} tokens is the "
                            "longest context that fits (or raise --gpu-memory-utilization)"])
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
    if facts.arg("kv_cache_memory_bytes"):  # a pinned cache: the pin is what to raise
        why.append(f"or keep {asked:,} tokens with --kv-cache-memory-bytes "
                   f"{_needed_bytes(n, facts):d}, if the device has that much beside the "
                   "weights (`vlaunch doctor LOG MODEL --gpus ...` checks it)")
    return Fix([F.flag("max_model_len"), str(length)], explain=why)


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
        return Fix([F.flag("kv_cache_memory_bytes"), str(size)],
                   explain=why + [f"the KV cache asked for {_gib(kv)}; 90% of what is free fits"])
    util = _floor2(free / total - 0.01)
    if util <= 0.05:
        return Fix(explain=why + ["too little is free for any utilization: stop the other "
                                  "process or use another GPU"])
    return Fix([F.flag("gpu_memory_utilization"), f"{util:.2f}"],
               explain=why + [f"--gpu-memory-utilization {n.get('util')} asks for "
                              f"{n.get('requested')} GiB; {util:.2f} is "
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
        return Fix([F.flag("max_num_batched_tokens"), str(max(256, tokens // 2))],
                   explain=why + ["the profiling batch's activations are the biggest item; "
                                  "half the prefill token budget halves them"])
    if util < 0.95:
        return Fix([F.flag("gpu_memory_utilization"), f"{min(0.95, util + 0.05):.2f}"],
                   explain=why + ["the weights fill the budget; a higher utilization leaves "
                                  "room for KV, more GPUs (--tensor-parallel-size) more so"])
    fix = _more_gpus(facts, "the weights fill the GPU even at a high utilization")
    return Fix(fix.args, explain=why + fix.explain)


NODE_GPUS = 8  # GPUs of one HGX/DGX node (H100, H200, B200): the most one NVLink domain holds


def _more_gpus(facts: Facts, why: str) -> Fix:
    """Weights that do not fit: twice the tensor-parallel GPUs while one node holds them; the
    log names no hardware, so beyond NODE_GPUS it names no layout (a node cannot hold it) and
    points at the planner, which says what would: more nodes, another GPU, quantization."""
    tp = int(facts.arg("tensor_parallel_size") or 1)
    pp = int(facts.arg("pipeline_parallel_size") or 1)
    text = why.format(world=tp * pp)
    if tp * 2 * pp <= NODE_GPUS:
        return Fix([F.flag("tensor_parallel_size"), str(tp * 2)],
                   explain=[f"{text}; split them over twice the GPUs (if the node has "
                            f"{tp * 2 * pp}) or use a quantized checkpoint"])
    return Fix(explain=[f"{text}, and {tp * 2 * pp} GPUs are more than one node holds: more "
                        "nodes, another GPU or a quantized checkpoint; `vlaunch doctor LOG "
                        "MODEL --gpus ...` says which fits (vlaunch plan's 'what would fit')"])


def _fix_oom(d: Diagnosis, facts: Facts) -> Fix:
    util = _util(facts)
    c = d.consumer
    if c == "weights":
        return _more_gpus(facts, "out of memory while loading the weights: they do not fit on "
                                 "{world} GPU(s) beside what else is there")
    if c == "cuda_graphs":
        return Fix([F.flag("gpu_memory_utilization"), f"{_floor2(util - 0.05):.2f}"],
                   explain=["out of memory while capturing CUDA graphs: the KV cache left too "
                            "little for them; 0.05 less utilization leaves it to the graphs "
                            "(--enforce-eager drops the graphs, slower)"])
    if c == "kv_cache":
        return Fix([F.flag("gpu_memory_utilization"), f"{_floor2(util - 0.05):.2f}"],
                   explain=["out of memory while allocating the KV cache vLLM had sized: memory "
                            "changed after profiling; ask for 0.05 less"])
    if c == "co_tenant":
        return Fix(explain=["out of memory before vLLM loaded anything: another process holds "
                            "the GPU; free it or lower --gpu-memory-utilization to free/total"])
    tokens = int(facts.number("max_num_batched_tokens") or facts.arg("max_num_batched_tokens")
                 or 8192)
    return Fix([F.flag("max_num_batched_tokens"), str(max(256, tokens // 2))],
               explain=[f"out of memory in a forward pass ({d.phase}): activations scale with "
                        "the batch's tokens; half the prefill token budget"])


def _fix_sampler(d: Diagnosis, facts: Facts) -> Fix:
    reqs = int(d.numbers.get("num_reqs") or facts.arg("max_num_seqs") or 256)
    return Fix([F.flag("max_num_seqs"), str(max(1, reqs // 2))],
               explain=[f"the sampler's warm-up with {reqs} requests ran out of memory; it "
                        "scales with --max-num-seqs"])


def _fix_host_oom(d: Diagnosis, facts: Facts) -> Fix:
    why = [f"the kernel killed a vLLM process (SIGKILL, exit 137) during {d.phase}: host memory "
           "(RAM or the container's limit) ran out, not GPU memory"]
    if facts.cpu and d.consumer == "kv_cache" and facts.arg("kv_cache_memory_bytes"):
        half = int(facts.arg("kv_cache_memory_bytes")) // 2
        return Fix([F.flag("kv_cache_memory_bytes"), str(half)],
                   explain=why + ["on the CPU backend the KV cache lives in RAM: half of it"])
    return Fix(explain=why + ["raise the container's memory limit or load fewer shards at "
                              "once; no vLLM flag changes what the weights need"])


def _fix_kv_dtype(d: Diagnosis, facts: Facts) -> Fix:
    dtype = d.numbers.get("dtype") or facts.arg("kv_cache_dtype") or "fp8"
    return Fix([F.flag("kv_cache_dtype"), "auto"],
               explain=[f"no attention kernel here takes a {dtype} KV cache; auto stores it in "
                        "the model's dtype (half the tokens of fp8)"])


def _fix_bad_kv_dtype(d: Diagnosis, facts: Facts) -> Fix:
    return Fix([F.flag("kv_cache_dtype"), "auto"],
               explain=[f"'{d.numbers.get('dtype')}' is not a KV cache dtype vLLM knows; "
                        "auto is the model's dtype (fp8 halves the KV bytes where supported)"])


def _fix_port(d: Diagnosis, facts: Facts) -> Fix:
    port = facts.arg("port")
    start = int(port) + 1 if isinstance(port, int) else 8001
    free = next_free_port(start)
    return Fix([F.flag("port"), str(free)],
               explain=[f"port {port if port is not None else 8000} is taken by another "
                        f"process; {free} was free on this machine when diagnosed"])


def _fix_max_len(d: Diagnosis, facts: Facts) -> Fix:
    n = d.numbers
    return Fix([F.flag("max_model_len"), str(n["derived"])],
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
    return Fix([F.flag("tensor_parallel_size"), str(ok)],
               explain=[f"{heads} attention heads do not split over {tp} GPUs; {ok} is the "
                        "largest power of two below that divides them"])


def _explain_only(text: str) -> Callable[[Diagnosis, Facts], Fix]:
    def fix(d: Diagnosis, facts: Facts) -> Fix:
        return Fix(explain=[text.format(**{k: v for k, v in d.numbers.items()})])
    return fix


# vlaunch's own manifests mount a memory-backed /dev/shm (tests/test_doctor.py checks they still
# do, so this advice cannot go stale).
SHM_MANIFESTS = ("deploy/kubernetes/base/deployment.yaml",
                 "deploy/kubernetes/overlays/deepseek-r1-2x8xh100/leaderworkerset.yaml")


def _fix_nccl_shm(d: Diagnosis, facts: Facts) -> Fix:
    size = d.numbers.get("size")
    where = d.numbers.get("segment") or "/dev/shm"
    need = f" ({size / (1 << 20):.1f} MiB for {where})" if isinstance(size, int) else ""
    return Fix(explain=[
        f"NCCL could not create its shared-memory segment{need}: /dev/shm is full or too "
        "small (a container gets 64 MiB unless told otherwise)",
        "docker/podman: run with --shm-size=16g (or --ipc=host)",
        "Kubernetes: mount an emptyDir {medium: Memory, sizeLimit: 16Gi} at /dev/shm; "
        "vlaunch's manifests already do (" + ", ".join(SHM_MANIFESTS) + "), so a pod without "
        "it was not made from them",
        "no vLLM flag changes this; NCCL_SHM_DISABLE=1 avoids /dev/shm at a speed cost"])


def _fix_nccl_p2p(d: Diagnosis, facts: Facts) -> Fix:
    return Fix([F.flag("disable_custom_all_reduce")], env={"NCCL_P2P_DISABLE": "1"}, explain=[
        "the GPUs cannot map each other's memory (peer access: no NVLink/PCIe P2P between them, "
        "IOMMU or ACS on, or a VM that hides it); NCCL_P2P_DISABLE=1 makes NCCL go through "
        "host memory and --disable-custom-all-reduce stops vLLM's own P2P all-reduce",
        "`nvidia-smi topo -p2p r` shows which pairs support it"])


def _fix_nccl_ib(d: Diagnosis, facts: Facts) -> Fix:
    return Fix(explain=[
        "NCCL's InfiniBand/RoCE transport failed between nodes: check the links (`ibstat`, "
        "`ibv_devinfo`: State Active), that NCCL_IB_HCA names the cabled adapters, and on RoCE "
        "NCCL_IB_GID_INDEX (often 3); in Kubernetes the pod needs the RDMA device resources",
        "to confirm it is the fabric: NCCL_IB_DISABLE=1 falls back to TCP sockets (much "
        "slower); no vLLM flag changes the transport"])


def _fix_nccl_socket(d: Diagnosis, facts: Facts) -> Fix:
    return Fix(explain=[
        "NCCL's TCP connection between ranks failed or found no interface: set "
        "NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) to the interface the nodes reach each "
        "other on (`ip -br addr`; e.g. eth0, not lo or docker0), and open the ports between "
        "them (a NetworkPolicy or firewall drops them)",
        "the first rank that lost its peer is usually not the one that failed: read every "
        "node's log (vlaunch doctor on each)"])


def _fix_head_size(d: Diagnosis, facts: Facts) -> Fix:
    backend, sizes = CPU_ATTENTION_HEAD_SIZES["gqa"]
    return Fix(explain=[
        f"vLLM's CPU attention backend ({backend}) takes head sizes "
        f"{', '.join(map(str, sizes))}; this model's is {d.numbers.get('head_dim')}, so the "
        "engine starts and fails at its first request",
        "no flag changes a model's head size: serve it on a GPU, or a model whose head size is "
        "in the list (`vlaunch plan MODEL --gpus cpu` refuses one that is not)"])


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
        "NCCL failed between ranks and printed no line naming why (its WARN lines name /dev/shm,"
        " InfiniBand, sockets or peer access); rerun with NCCL_DEBUG=WARN to see them"),
    "nccl_shared_memory": _fix_nccl_shm,
    "nccl_peer_access": _fix_nccl_p2p,
    "nccl_infiniband": _fix_nccl_ib,
    "nccl_socket": _fix_nccl_socket,
    "cpu_attention_head_size": _fix_head_size,
    "quantization_unsupported": _explain_only(
        "this GPU (capability {cur}) is below what the {method} kernels need ({min}): use a "
        "checkpoint in another quantization or a newer GPU"),
    "missing_module": _explain_only(
        "Python module '{module}' is missing from vLLM's environment: install the package "
        "that provides it there"),
    "gpu_unavailable": _explain_only(
        "vLLM found no usable GPU: no NVIDIA driver, a driver too old for this CUDA, or no "
        "device visible to the process (CUDA_VISIBLE_DEVICES, the container's --gpus / "
        "nvidia.com/gpu resource); `nvidia-smi` in the same environment shows which; no vLLM "
        "flag changes this"),
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
        try:
            fix = make(d, report.facts)
        except (ValueError, OverflowError, ZeroDivisionError):  # numbers no engine printed
            fix = Fix(explain=["the log's numbers for this failure do not parse as sizes; no "
                               "fix is computed from them"])
        bad = out_of_range(fix.args)
        if bad is not None:  # a nonsense log: say so, never print it as a command
            fix = Fix(env=fix.env, explain=fix.explain + [
                f"the log's numbers give {bad}, outside what vLLM accepts; they are not a "
                "real engine's, so no flag is suggested"])
        d.fix_args, d.fix_env = fix.args, fix.env
        d.explain = fix.explain + d.explain
        d.serve_command = serve_command_from_log(report.facts, fix)
        d.vllm_command = vllm_command_from_log(report.facts, fix.args, fix.env)


def _log_args(facts: Facts) -> list[str]:
    """vLLM's flags of the failed run, from its "non-default args", as far as the flag table
    lets the doctor suggest them: a log is anyone's text, and a `run:` line that copied its
    --trust-remote-code, --tool-parser-plugin /tmp/x.py, --allowed-local-media-path / or
    --host 0.0.0.0 would have the reader run them (issue 31 M3). The model goes first; the port
    is left to vlaunch serve (a free one unless fixed); a secret is named by its variable. The
    layout's expert parallelism and MTP config are kept (checked values, part of what ran)."""
    rest = {k: v for k, v in facts.args.items() if k not in ("model", "model_tag", "port")}
    return F.from_log_args(rest, keep=("enable_expert_parallel", "speculative_config"))


# vLLM arguments whose values are secrets (as "non-default args" names them), and the
# environment variable a command reads instead: the flag table's secrets.
SECRET_ARGS = {f.dest: str(f.secret_env) for f in F.flags() if f.secret}
_SECRET_MARK = F.SECRET_MARK


def shell_join(words: list[str]) -> str:
    """`shlex.join`, except that a secret's placeholder becomes "$VARIABLE" (expanded by the
    shell that runs the command, so the value never appears in the doctor's output)."""
    return " ".join(f'"${w[len(_SECRET_MARK):]}"' if w.startswith(_SECRET_MARK)
                    else shlex.quote(w) for w in words)


def _override(args: list[str], fix: list[str]) -> list[str]:
    """`args` with every flag in `fix` replacing the same flag (a fix wins); a fix that turns
    a switch off (`--no-enforce-eager`) drops the switch (off is vLLM's default)."""
    off = {f"--{f[5:]}" for f in fix if f.startswith("--no-")}
    kept = [a for a in args if a not in off]
    return merge_args(kept, [f for f in fix if not f.startswith("--no-")])[0]


def vllm_command_from_log(facts: Facts, fix_args: list[str], env: dict[str, str]) -> str | None:
    """The `vllm serve` command of the failed launch (its "non-default args", the model as it
    named it) with the fix's flags on top and its environment in front, in the form the log's
    vLLM version takes (`serve_argv`): what a user who runs vLLM without vlaunch pastes."""
    model = facts.model
    if not model or not (fix_args or env):
        return None
    argv = serve_argv(facts.version, [F.flag("model"), str(model),
                                      *_override(_log_args(facts), fix_args)])
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + shell_join(argv)


def serve_command_from_log(facts: Facts, fix: Fix) -> str | None:
    """The `vlaunch serve` command that runs the failed configuration with the fix applied:
    vlaunch's own pins where it has one, everything else after `--`."""
    model = facts.model
    if not model or not (fix.args or fix.env):
        return None
    args = _override(_log_args(facts), fix.args)
    pins, rest = _split_pins(args)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in fix.env.items())
    cmd = ["vlaunch", "serve", str(model), *pins] + (["--", *rest] if rest else [])
    return (env + " " if env else "") + shell_join(cmd)


def _split_pins(args: list[str]) -> tuple[list[str], list[str]]:
    pins: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        name = args[i]
        value = [args[i + 1]] if i + 1 < len(args) and not args[i + 1].startswith("--") else []
        i += 1 + len(value)
        if name == F.flag("served_model_name"):
            continue  # vlaunch serve names the model after its folder
        target = pins if name in _VLAUNCH_PINS or name == F.flag("port") else rest
        target += [_VLAUNCH_PINS.get(name, name), *value]
    return pins, rest
