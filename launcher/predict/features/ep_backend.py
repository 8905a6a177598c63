"""Which all-to-all moves tokens to their experts under DP + EP, and what it needs.

vLLM uses an all-to-all only when data parallel ranks share expert-parallel MoE layers
(`config/parallel.py` ParallelConfig.use_all2all: data_parallel_size > 1, or sequence-parallel
MoE, which also needs DP > 1). The backend is `--all2all-backend` (the VLLM_ALL2ALL_BACKEND
environment variable before it), default `allgather_reducescatter` in vLLM 0.32.0
(ParallelConfig.all2all_backend; the managers are in
`distributed/device_communicators/all2all.py`):

- allgather_reducescatter (AgRsAll2AllManager): NCCL collectives, nothing to install; every
  token goes to every rank, which NVLink absorbs inside a node and InfiniBand pays across nodes;
- deepep_low_latency (DeepEPLLAll2AllManager): DeepEP's RDMA kernels for decode, CUDA graphs
  stay on; needs the `deep_ep` package built with NVSHMEM, and GPUDirect RDMA over InfiniBand
  (or RoCE) across nodes;
- deepep_high_throughput (DeepEPHTAll2AllManager): DeepEP's NVLink + RDMA forwarding kernels
  for prefill; vLLM turns CUDA graphs off with it (`config/compilation.py`);
- pplx: removed; 0.32.0 falls back to allgather_reducescatter with a warning.

The choice follows the published guidance in `profiles/serving.yaml`: inside one node the
default; across nodes DeepEP's low-latency kernels for decode-heavy or latency work, its
high-throughput kernels for prefill-heavy throughput work. A backend whose package this image
lacks (`importlib.util.find_spec`, or `VLAUNCH_IMAGE_PACKAGES` naming what the target image has
when planning elsewhere) is never emitted: the plan keeps the default and says what to install.
DeepEP's NVSHMEM buffers (VLLM_DEEPEP_BUFFER_SIZE_MB, 1 GiB, and the RDMA buffer across nodes)
are allocated at the first all-to-all of vLLM's profiling run, so they come off the KV cache.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from typing import Any

from ...deployment.plan import EPBackend, Reason
from ...errors import InputError
from ...inputs import vllm_flags
from ...inputs.hardware import GiB, MiB
from ..search.pins import origin_data, said
from .serving_flags import at_least, table

ENV_VAR = "VLLM_ALL2ALL_BACKEND"
IMAGE_PACKAGES_ENV = "VLAUNCH_IMAGE_PACKAGES"
"""Comma-separated Python modules the serving image has, when the plan is made elsewhere (a
laptop planning for a cluster); unset: what this Python environment can import."""

FP8_SCALE_BLOCK = 128
"""DeepEP's low-latency dispatch sends fp8 tokens with one fp32 scale per 128 values."""


def ep_table() -> dict[str, Any]:
    return table()["ep_backends"]


def available_packages(names: list[str]) -> dict[str, bool]:
    """Whether each Python module is importable in the image (never imported here)."""
    declared = os.environ.get(IMAGE_PACKAGES_ENV)
    if declared is not None:
        have = {x.strip() for x in declared.split(",") if x.strip()}
        return {n: n in have for n in names}
    out = {}
    for n in names:
        try:
            out[n] = importlib.util.find_spec(n) is not None
        except (ImportError, ValueError):
            out[n] = False
    return out


def default_backend(version: str) -> str:
    """vLLM's own backend for this version ('' before any was selectable)."""
    return next((r["backend"] for r in ep_table()["defaults"] if at_least(version, r["since"])),
                "")


def selector(version: str) -> str:
    """'flag' (--all2all-backend) or 'env' (VLLM_ALL2ALL_BACKEND) for this version."""
    for r in ep_table()["selector"]:
        if at_least(version, r["since"]):
            return str(r["style"])
    return "none"


def buffer_bytes(backend: str, cross_node: bool, hidden: int, experts: int) -> int:
    """DeepEP's buffers per GPU: the NVLink buffer (VLLM_DEEPEP_BUFFER_SIZE_MB) and the RDMA
    buffer - high-throughput: the same size again across nodes (DeepEPHTAll2AllManager
    _make_all2all_kwargs); low-latency: room for every expert's share of the dispatched tokens,
    double-buffered, at the larger of the fp8 dispatch and bf16 combine messages (an estimate
    of deep_ep.Buffer.get_low_latency_rdma_size_hint, which vlaunch cannot call)."""
    t = ep_table()
    nvl = int(t["deepep_buffer_mib"]) * MiB
    if backend == "deepep_high_throughput":
        return nvl + (nvl if cross_node else 0)
    if backend == "deepep_low_latency":
        tokens = int(t["low_latency_tokens_per_rank"])
        dispatch = hidden + hidden // FP8_SCALE_BLOCK * 4 + 16
        combine = hidden * 2 + 16
        return nvl + 2 * experts * tokens * max(dispatch, combine)
    return 0


NOT_APPLICABLE = EPBackend(applies=False, backend=None, vllm_default=None, pinned=False,
                           cross_node=False, packages=(), missing_packages=(), nvshmem=False,
                           cuda_graphs=True, buffer_bytes_per_gpu=0, reason=None)
"""No all-to-all: a dense model, or experts reached inside the TP group."""


def passed(c: EPBackend) -> str | None:
    """The backend the engine is given (None: vLLM's default holds, or none applies)."""
    if not c.applies or not c.backend or c.backend == c.vllm_default:
        return None
    return c.backend


def vllm_args(c: EPBackend) -> list[str]:
    b = passed(c)
    return vllm_flags.argv({"all2all_backend": b if c.selector == "flag" else None})


def env(c: EPBackend) -> dict[str, str]:
    b = passed(c)
    return {ENV_VAR: b} if b and c.selector == "env" else {}


def _usable(name: str, version: str) -> tuple[bool, str]:
    row = ep_table()["backends"].get(name)
    if row is None:
        known = ", ".join(sorted(ep_table()["backends"]))
        raise InputError(f"unknown --all2all-backend '{name}'; vlaunch knows: {known}")
    if not at_least(version, row.get("since")):
        return False, f"vLLM {version} has no {name} (since {row['since']})"
    if row.get("removed") and at_least(version, row["removed"]):
        return False, f"vLLM {version} removed {name} (in {row['removed']}): {row['reason']}"
    return True, ""


def choose(spec: Any, hw: Any, layout: Any, objective: str, workload: Any, version: str,
           pinned: str | None = None, from_plan: bool = False) -> EPBackend:
    """The backend for this layout, objective and workload, or why none applies (`from_plan`:
    the pin came from the emitted plan under `exec --replan`, not from the user)."""
    if not (spec.is_moe and layout.expert_parallel and layout.dp > 1):
        return NOT_APPLICABLE if not spec.is_moe else replace(NOT_APPLICABLE, reason=Reason(
            "all2all.inside_tp", "no all-to-all backend: experts are reached inside the TP "
            "group (vLLM uses an all-to-all only with data parallel + expert parallel)",
            {"tp": layout.tp, "dp": layout.dp, "expert_parallel": layout.expert_parallel}))
    t = ep_table()
    style = selector(version)
    default = default_backend(version)
    c = replace(NOT_APPLICABLE, applies=True, vllm_default=default or None, selector=style,
                pinned=pinned is not None, cross_node=layout.tp * layout.dp > hw.gpus_per_node)
    if style == "none":
        return replace(c, applies=False, reason=Reason(
            "all2all.unselectable", f"vLLM {version} has no selectable all-to-all backend",
            {"vllm_version": version}))
    where = ("across nodes (the EP group spans " f"{layout.nodes} nodes)" if c.cross_node
             else "inside one node (NVLink)")
    ratio = workload.input_len / max(1, workload.output_len) if workload else 1.0
    if pinned:
        ok, why = _usable(pinned, version)
        if not ok:
            raise InputError(f"--all2all-backend {pinned}: {why}")
        want, why_want = pinned, said("plan" if from_plan else "you")
    elif not c.cross_node:
        want, why_want = default, f"EP {where}: vLLM's default collectives ride NVLink"
    elif objective == "throughput" and ratio >= float(t["prefill_heavy_ratio"]):
        want = "deepep_high_throughput"
        why_want = (f"EP {where}, objective throughput and a prefill-heavy workload "
                    f"({workload.input_len:,} in / {workload.output_len:,} out)")
    else:
        want = "deepep_low_latency"
        why_want = f"EP {where}, objective {objective}: decode steps dominate"
    who = origin_data(None if pinned is None else "plan" if from_plan else "you")
    data: dict[str, Any] = {"backend": want, **who, "cross_node": c.cross_node,
                            "nodes": layout.nodes, "objective": objective,
                            "vllm_default": default}
    row = t["backends"][want]
    ok, why = _usable(want, version)
    if not ok:
        return replace(c, backend=default, reason=Reason(
            "all2all.unusable", f"all2all-backend {default} (vLLM's default): {want} wanted "
            f"({why_want}) but {why}", {**data, "backend": default, "wanted": want,
                                       "vllm_version": version}))
    packages = tuple(row.get("packages") or ())
    missing = tuple(p for p, ok in available_packages(list(packages)).items() if not ok)
    if missing:
        hint = (f"this image lacks {', '.join(missing)} (DeepEP built against NVSHMEM: "
                "vLLM's tools/ep_kernels install script); set "
                f"{IMAGE_PACKAGES_ENV} when planning for another image")
        data.update(wanted=want, missing_packages=list(missing))
        if pinned:
            return replace(c, backend=None, packages=packages, missing_packages=missing,
                           reason=Reason("all2all.pinned_missing_packages",
                                         f"all2all-backend {want} pinned, but {hint}: vLLM "
                                         "would fail to start", {**data, "backend": None}))
        return replace(c, backend=default, missing_packages=missing, reason=Reason(
            "all2all.missing_packages", f"all2all-backend {default} (vLLM's default): {want} "
            f"would suit ({why_want}) but {hint}", {**data, "backend": default}))
    c = replace(c, backend=want, packages=packages, nvshmem=bool(row.get("nvshmem")),
                cuda_graphs=bool(row.get("cuda_graphs", True)),
                buffer_bytes_per_gpu=buffer_bytes(want, c.cross_node, spec.hidden_size,
                                                  spec.num_experts))
    extra = []
    if c.buffer_bytes_per_gpu:
        extra.append(f"{c.buffer_bytes_per_gpu / GiB:.2f} GiB of NVSHMEM buffers per GPU come "
                     "off the KV cache")
    if not c.cuda_graphs:
        extra.append("CUDA graphs off (vLLM disables them with this backend): decode runs "
                     "eager")
    if c.nvshmem and c.cross_node:
        k8s = t["kubernetes"]
        c = replace(c, kubernetes={"rdma_resource": k8s["rdma_resource"],
                                   "ipc_lock": k8s["ipc_lock"], "shm_gib": k8s["shm_gib"]})
        extra.append(f"needs GPUDirect RDMA between the nodes ({k8s['rdma_resource']} "
                     "devices, IPC_LOCK for NVSHMEM's pinned memory)")
    flag = (f"--all2all-backend {want}" if style == "flag" else f"{ENV_VAR}={want}")
    return replace(c, reason=Reason(
        "all2all.chosen", f"all2all-backend {want} "
        f"({flag if want != default else 'vLLM default'}): {why_want}; {row['reason']}"
        + ("; " + "; ".join(extra) if extra else ""),
        {**data, "buffer_bytes": c.buffer_bytes_per_gpu, "cuda_graphs": c.cuda_graphs,
         "selector": style}))
