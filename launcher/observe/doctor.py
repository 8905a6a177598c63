"""`vlaunch doctor`: why a vLLM start failed, which memory consumer to attack, and the fix.

Why: vLLM's own messages are good for KV sizing and poor for everything else. The real cause
of a failed start hides above "Engine core initialization failed. See root cause above",
repeated by every rank, in logs of tens of thousands of lines. A "CUDA out of memory" is a
budget problem: it has to be charged to a consumer (weights, KV cache, activations, CUDA
graphs, another process) before anyone can say which knob to turn.

How: `launcher.inputs.vllm_failures` reads the log (the table of vLLM's and NCCL's failure
messages, shared with serve and tune); this module turns each diagnosis into a fix. Fixes are
exact vLLM flags: from the log's own numbers (`log_fix`), and whenever the failed launch's
model and hardware are known (MODEL --gpus, --plan, or what the log says) every fix is run
through the planner with that launch's settings before it is shown: a fix the planner says
will not fit is replaced by one that does, or dropped with the planner's reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shlex
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..deployment.plan import Deployment
from ..errors import InputError
from ..inputs import vllm_flags as F
from ..inputs.hardware import parse_gpus
from ..inputs.model import load_model
from ..inputs.vllm_failures import Diagnosis, Facts, Report, scan_source, scan_text, to_failure
from ..predict.features.capabilities import CPU_ATTENTION_HEAD_SIZES
from ..predict.search.after_failure import merge_args, replan_pins
from ..predict.search.plan_inputs import inputs_from_plan
from ..predict.search.planner import Pins, make_plan
from ..term import PIPED_WIDTH, fit, shell_lines, wrap
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
    tp = int(facts.arg("tensor_parallel_size") or 1)
    return Fix([F.flag("tensor_parallel_size"), str(tp * 2)],
               explain=why + ["the weights fill the GPU even at a high utilization: split "
                              "them over twice the GPUs"])


def _fix_oom(d: Diagnosis, facts: Facts) -> Fix:
    util = _util(facts)
    c = d.consumer
    if c == "weights":
        tp = int(facts.arg("tensor_parallel_size") or 1)
        return Fix([F.flag("tensor_parallel_size"), str(tp * 2)],
                   explain=["out of memory while loading the weights: they do not fit on "
                            f"{tp} GPU(s) beside what else is there; split them over twice the "
                            "GPUs or use a quantized checkpoint"])
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


def _log_args(facts: Facts) -> list[str]:
    """vLLM's flags of the failed run, from its "non-default args", as far as the flag table
    lets the doctor suggest them: a log is anyone's text, and a `run:` line that copied its
    --trust-remote-code, --tool-parser-plugin /tmp/x.py, --allowed-local-media-path / or
    --host 0.0.0.0 would have the reader run them (issue 31 M3). The model goes first; the port
    is left to vlaunch serve (a free one unless fixed); a secret is named by its variable."""
    rest = {k: v for k, v in facts.args.items() if k not in ("model", "model_tag", "port")}
    return F.from_log_args(rest)


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
    """`args` with every flag in `fix` replacing the same flag (a fix wins)."""
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


# --- fixes checked by the planner --------------------------------------------------------------


@dataclass
class PlanContext:
    """What the deployment was planned for: model, hardware, pins and the plan itself."""

    spec: Any
    hardware: Any
    pins: Any
    plan: Any
    gpus: str  # the --gpus value that reproduces `hardware` on the command line
    goals: dict[str, Any] = field(default_factory=dict)
    source: str = "model"  # "model" (MODEL --gpus), "plan" (--plan) or "log" (what it says)


def context_from_plan(d: Deployment) -> PlanContext:
    """Model, hardware and pins of an emitted plan (as `vlaunch exec --replan` rebuilds them)."""
    spec, hw, pins = inputs_from_plan(d)
    g = d.hardware
    gpus = "cpu" if g.platform == "cpu" else f"{g.nodes}x{g.gpus_per_node}x{g.name}"
    return PlanContext(spec, hw, pins, make_plan(spec, hw, pins), gpus, source="plan")


def context_from_model(model: str, gpus: str | None, pins: Any, goals: dict[str, Any],
                       hardware: Any) -> PlanContext:
    spec = load_model(model)
    plan = make_plan(spec, hardware, pins, **goals)
    return PlanContext(spec, hardware, pins, plan, gpus or "", goals, "model")


def context_from_log(report: Report) -> PlanContext | None:
    """What the log itself says about the launch (its model, the device's memory, the engine
    it ran on), when that is enough to plan; None otherwise. The model must be a profile or a
    local folder (nothing is downloaded) and the device size printed by vLLM."""
    facts = report.facts
    model = facts.arg("model") or facts.arg("model_tag")
    if not isinstance(model, str):
        return None
    world = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = facts.arg(key)
        world *= value if isinstance(value, int) and value > 0 else 1
    total = next((d.numbers.get("total") for d in report.diagnoses
                  if isinstance(d.numbers.get("total"), (int, float))), None)
    if facts.cpu:
        gpus = "cpu"
    elif total:
        gpus = f"{world}x{total:g}GiB"
    else:
        return None
    try:
        with _offline():
            spec = load_model(model)
        hw = parse_gpus(gpus)
        pins = Pins()
        return PlanContext(spec, hw, pins, None, gpus, source="log")
    except InputError:
        return None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """The model as this machine has it (a folder, a profile, the HF cache) and never the Hub:
    reading a log must not reach the network (huggingface_hub's own HF_HUB_OFFLINE switch,
    which launcher.inputs.hub honours, set for the look-up and restored)."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


# The failed launch's vLLM arguments ("non-default args") that are planner pins: the flag
# table's pins the doctor may suggest, by dest, and by every spelling (--tensor-parallel-size,
# -tp, vlaunch's --tp).
_SUGGESTED = tuple(f for f in F.pins() if f.suggest and f.pin)
_ARG_PINS = {f.dest: f.pin.field for f in _SUGGESTED if f.pin}
_FLAG_PINS = {n: f.pin.field for f in _SUGGESTED if f.pin for n in (*f.names, f.pin.option)}
_PIN_KIND = {f.pin.field: f.kind for f in _SUGGESTED if f.pin}


def launch_pins(ctx: PlanContext, facts: Facts) -> Any:
    """The pins of the launch that failed: the context's, with every setting the log shows it
    ran with (its "non-default args", the max model len it used, its vLLM version) on top, so
    a fix is checked against what really ran, not against what the planner would choose."""
    changes: dict[str, Any] = {}
    if facts.args:  # "non-default args" lists every non-default: an absent one was vLLM's
        changes.update(tp=1, pp=1, dp=1,
                       expert_parallel=bool(facts.arg("enable_expert_parallel")))
        if not facts.arg("speculative_config"):
            changes.update(speculative=False, num_speculative_tokens=None)
    for key, pin in _ARG_PINS.items():
        value = facts.arg(key)
        if value is not None and value is not False:
            changes[pin] = value
    used = facts.number("max_model_len")
    if "max_model_len" not in changes and used and ctx.pins.max_model_len is None:
        changes["max_model_len"] = int(used)
    version = facts.numbers.get("vllm_version")
    if isinstance(version, str) and ctx.pins.vllm_version is None:
        changes["vllm_version"] = version.split("+")[0]
    pins = dataclasses.replace(ctx.pins, **changes)
    try:
        pins.validate()
    except InputError:
        return ctx.pins
    return pins


def _with_flags(pins: Any, args: list[str]) -> Any | None:
    """`pins` with a fix's vLLM flags applied; None when a flag is not a planner decision."""
    changes: dict[str, Any] = {}
    i = 0
    while i < len(args):
        name = args[i]
        pin = _FLAG_PINS.get(name)
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        i += 2 if value is not None else 1
        if pin is None:
            return None
        kind = _PIN_KIND[pin]
        if kind == F.SWITCH:
            changes[pin] = True
        elif kind == F.FLOAT:
            changes[pin] = float(value or 0)
        elif kind == F.STR:
            changes[pin] = value
        else:
            changes[pin] = int(value or 0)
    return dataclasses.replace(pins, **changes)


def _failure_of(d: Diagnosis) -> Any:
    """The diagnosis as the `Failure` that `replan_pins` understands."""
    return to_failure(d)


def _candidates(d: Diagnosis, ctx: PlanContext, pins: Any, plan: Any) -> Iterator[
        tuple[Any, str]]:
    """Pins that might fix the failure, best first: the log's own fix, vLLM's measured
    re-plan, then the planner's own choice of the decision the failure is about."""
    if d.fix_args:
        fixed = _with_flags(pins, d.fix_args)
        if fixed is not None:
            yield fixed, "the log's fix"
    if plan is not None:
        got = _replanned(d, ctx, pins, plan)
        if got is not None:
            yield got
    if d.cause in ("kv_cache_too_small", "no_kv_cache_memory"):
        if pins.gpu_memory_utilization is not None and pins.kv_cache_memory_bytes is None \
                and not ctx.hardware.is_cpu:
            yield (dataclasses.replace(pins, gpu_memory_utilization=None),
                   "the planner's utilization for this context")
        if pins.max_model_len is not None:
            yield (dataclasses.replace(pins, max_model_len=None),
                   "the longest context the planner fits")
    if d.cause in ("cuda_oom", "sampler_warmup_oom") and pins.max_num_seqs is not None:
        yield dataclasses.replace(pins, max_num_seqs=None), "the planner's --max-num-seqs"


def _replanned(d: Diagnosis, ctx: PlanContext, pins: Any, plan: Any) -> tuple[Any, str] | None:
    """New pins for the failure, from what the log measured; None when no pin helps."""
    if d.cause in ("kv_cache_too_small", "free_memory_below_utilization"):
        return replan_pins(pins, plan, _failure_of(d))
    if d.cause in ("cuda_oom", "no_kv_cache_memory") and d.consumer == "weights":
        return None
    if d.cause in ("cuda_oom", "no_kv_cache_memory") and d.consumer == "cuda_graphs" \
            and not ctx.hardware.is_cpu:
        return (dataclasses.replace(pins, enforce_eager=True),
                "CUDA graphs are the item that does not fit: run eager")
    if d.cause in ("cuda_oom", "sampler_warmup_oom"):
        return replan_pins(pins, plan, dataclasses.replace(_failure_of(d), kind="DEVICE_OOM"))
    if d.cause in ("kv_cache_dtype_unsupported", "invalid_kv_cache_dtype"):
        return (dataclasses.replace(pins, kv_cache_dtype="auto"), "KV cache in the model dtype")
    if d.cause == "max_model_len_exceeds_model":
        return (dataclasses.replace(pins, max_model_len=int(d.numbers["derived"])),
                "the model's own context")
    return None


_PIN_FLAGS = {f.pin.field: f.name for f in _SUGGESTED if f.pin}  # Pins field -> vLLM flag
_PIN_OPTIONS = {f.pin.field: f.pin.option for f in _SUGGESTED if f.pin}  # -> vlaunch option


def _changed_flags(old: Any, new: Any, settled: Any) -> list[str]:
    """The vLLM flags of the decisions the fix changed (`old` -> `new`, a pin set or released
    to the planner), each with the value of the plan that was checked (`settled`)."""
    out: list[str] = []
    for name, flag in _PIN_FLAGS.items():
        value = getattr(settled, name)
        if getattr(old, name) == getattr(new, name) or value is None or value is False:
            continue
        out += [flag] if value is True else [flag, _fmt(name, value)]
    return out


def _fmt(name: str, value: Any) -> str:
    return f"{value:.2f}" if name == "gpu_memory_utilization" else str(value)


def _plan(ctx: PlanContext, pins: Any) -> Any | None:
    try:
        return make_plan(ctx.spec, ctx.hardware, pins, **ctx.goals)
    except InputError:
        return None


_PLANNED_CAUSES = {"kv_cache_too_small", "no_kv_cache_memory", "free_memory_below_utilization",
                   "cuda_oom", "sampler_warmup_oom", "kv_cache_dtype_unsupported",
                   "invalid_kv_cache_dtype", "max_model_len_exceeds_model", "tp_not_divisible"}


def apply_plan_fixes(report: Report, ctx: PlanContext) -> None:
    """Run every fix through the planner with the failed launch's own settings: the first
    candidate (the log's fix, the measured re-plan, the planner's own choice) that the
    planner says fits becomes the fix, and the `fix:` flags and the `run:` command come from
    the same pins. A fix the planner says will not fit is never shown."""
    if not any(d.cause in _PLANNED_CAUSES for d in report.diagnoses):
        return  # nothing the planner decides (a port, a missing module): no plan to make
    pins = launch_pins(ctx, report.facts)
    failed = _plan(ctx, pins)
    for d in report.diagnoses:
        if d.cause not in _PLANNED_CAUSES:
            continue
        d.explain = [_checked_alternative(x, ctx, pins) for x in d.explain]
        refused: list[str] = []
        for new, why in _candidates(d, ctx, pins, failed):
            plan = _plan(ctx, new)
            if plan is None or not _fits(plan):
                if plan is not None and why == "the log's fix":
                    refused.append(f"the log's fix ({shlex.join(d.fix_args)}) does not fit by "
                                   f"vlaunch's planner: {_problem(plan)}")
                continue
            settled = _settled(new, plan)
            d.fix_args = _changed_flags(pins, new, settled)
            d.explain = ([f"checked by vlaunch's planner ({_SOURCES[ctx.source]}): {why}"]
                         + refused + d.explain)
            d.serve_command = serve_command_from_pins(ctx, settled, d.fix_env)
            break
        else:
            d.explain = refused + d.explain + [
                "vlaunch's planner found no fix that fits this model on this hardware with "
                "these settings"]
            d.fix_args, d.serve_command = [], None


def _fits(plan: Any) -> bool:
    """The planner's verdict, and every GPU's consumers within the card: a pinned KV size is
    what vLLM allocates (it skips profiling), so one larger than the card is an OOM even
    where a planner release takes the pin on trust."""
    if not plan.fits:
        return False
    dep = plan.deployment()
    g = dep.pool.per_gpu
    used = (g.weights_bytes + g.activation_bytes + g.cudagraph_bytes + g.non_torch_bytes
            + g.kv_cache_bytes)
    return plan.hardware.is_cpu or used <= dep.hardware.total_bytes


def _problem(plan: Any) -> str:
    if not plan.fits:
        return plan.chosen.problem
    dep = plan.deployment()
    g = dep.pool.per_gpu
    return (f"the pinned KV cache ({g.kv_cache_bytes / (1 << 30):.1f} GiB) and weights "
            f"({g.weights_bytes / (1 << 30):.1f} GiB) exceed the "
            f"{dep.hardware.total_bytes / (1 << 30):.1f} GiB card")


_ALTERNATIVE = re.compile(r"--kv-cache-memory-bytes (\d+)")


def _checked_alternative(line: str, ctx: PlanContext, pins: Any) -> str:
    """An explanation that offers another flag (a KV size for the asked context) keeps the
    offer only when the planner says it fits; otherwise it says why not."""
    m = _ALTERNATIVE.search(line)
    if m is None:
        return line
    plan = _plan(ctx, dataclasses.replace(pins, kv_cache_memory_bytes=int(m.group(1))))
    if plan is not None and _fits(plan):
        return line + " (checked: the planner fits it)"
    why = _problem(plan) if plan is not None else "the planner refused the settings"
    return (f"--kv-cache-memory-bytes {int(m.group(1)):,} for the asked context does not fit "
            f"by vlaunch's planner: {why}")


_SOURCES = {"model": "the model and GPUs given", "plan": "the plan given",
            "log": "the model, memory and vLLM version the log shows"}


def _settled(pins: Any, plan: Any) -> Any:
    """The pins with each pinned decision set to what the plan made of it (the planner may
    raise --max-num-batched-tokens to the context on CPU), and every decision the fix leaves
    to the planner pinned to the plan's choice, so the command runs exactly the checked plan."""
    c = plan.chosen
    made = {"tp": c.layout.tp, "pp": c.layout.pp, "dp": c.layout.dp,
            "max_model_len": c.max_model_len, "kv_cache_dtype": c.kv_dtype,
            "gpu_memory_utilization": round(c.utilization, 2), "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens}
    keep = {k: v for k, v in made.items() if getattr(pins, k) is not None}
    for name in ("max_model_len", "gpu_memory_utilization"):  # the decisions fixes are about
        keep.setdefault(name, made[name])
    if pins.kv_cache_memory_bytes is not None:
        keep.pop("gpu_memory_utilization", None)
    return dataclasses.replace(pins, **keep)


def serve_command_from_pins(ctx: PlanContext, pins: Any, env: dict[str, str]) -> str:
    args = ["vlaunch", "serve", ctx.spec.path or ctx.spec.hf_id or ctx.spec.name]
    if ctx.gpus:
        args += ["--gpus", ctx.gpus]
    for name in ("tp", "pp", "dp", "max_model_len", "kv_cache_dtype", "gpu_memory_utilization",
                 "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
                 "enforce_eager"):
        value = getattr(pins, name)
        if value is True:  # a switch
            args.append(_PIN_OPTIONS[name])
        elif value is not None and value is not False:
            args += [_PIN_OPTIONS[name], _fmt(name, value)]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + shlex.join(args)


# --- entry points ------------------------------------------------------------------------------


def explain_log(text: str) -> Diagnosis | None:
    """The root cause of a failed start in `text` with its log-only fix (what serve prints when
    a start fails), or None when the log shows no error."""
    report = scan_text(text)
    apply_log_fixes(report)
    return report.root


def diagnose(source: str, ctx: PlanContext | None = None,
             stdin: TextIO | None = None) -> tuple[Report, list[str]]:
    """Read a log (file, folder or "-"), diagnose it, and compute each fix."""
    report, names = scan_source(source, stdin)
    apply_log_fixes(report)
    ctx = ctx or context_from_log(report)
    if ctx is not None:
        apply_plan_fixes(report, ctx)
    else:
        for d in report.diagnoses:
            if d.fix_args and d.cause in _PLANNED_CAUSES:
                d.explain.append("not checked by vlaunch's planner: pass MODEL --gpus ... or "
                                 "--plan to check this fix fits")
    return report, names


# --- rendering ---------------------------------------------------------------------------------


def render(report: Report, names: list[str], width: int = PIPED_WIDTH) -> str:
    """The report for people: the root cause first, each with evidence, fix and command, every
    line within `width` columns (long log lines wrap under their "|", reasons under their
    "-", the command continued with backslashes so it still pastes)."""
    src = ", ".join(names)
    out = fit([f"vlaunch doctor: {src} ({report.lines:,} lines; furthest phase: "
               f"{report.phase or 'none'})"], width)
    if not report.diagnoses:
        out += fit(["no failure found: vLLM printed no error this doctor knows or that looks "
                    "like one"], width)
        return "\n".join(out)
    for i, d in enumerate(report.diagnoses):
        title = "root cause" if i == 0 else "also"
        ranks = f", ranks: {d.ranks}" if d.ranks > 1 else ""
        out.append("")
        out += fit([f"{title}: {d.cause} (phase: {d.phase}, consumer: {d.consumer}{ranks}"
                    + (", transient" if d.transient else "") + ")"], width)
        for e in d.evidence[:4]:
            out += wrap(e[:600], width, indent="  | ", hang="  | ")
        for x in d.explain:
            out += fit([f"  - {x}"], width)
        if d.fix_args or d.fix_env:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in d.fix_env.items())
            fix = " ".join(filter(None, [env, shlex.join(d.fix_args)]))
            out += _labelled("fix", fix, width)
        if d.serve_command:
            out += _labelled("run", d.serve_command, width)
    return "\n".join(out)


def _labelled(label: str, command: str, width: int) -> list[str]:
    """`  fix: CMD`, the command wrapped with backslashes when it is wider than the text."""
    lines = shell_lines(command, width, indent=" " * (len(label) + 4))
    return [f"  {label}: " + lines[0].lstrip()] + lines[1:]
