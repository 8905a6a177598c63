"""One operator's time on one GPU, and one collective's: the roofline the step model sums.

An operator reads `bytes` from HBM and does `flops` of math; it takes whichever is slower at the
share of peak the kernel reaches:

    t = max(bytes / (HBM bandwidth x eff_bw), flops / (peak(dtype) x eff_compute))

A small-M GEMM (a decode step's few tokens) is therefore bandwidth-bound by construction: its
FLOPs are never inflated, the weights it must read set its time. A collective costs its latency
plus the bytes each rank moves over the link at the share of link bandwidth the algorithm
reaches. Pure arithmetic; the constants come from `step.Constants`.
"""

from __future__ import annotations


def roofline_s(bytes_read: float, flops: float, bandwidth: float, eff_bw: float, peak: float,
               eff_compute: float) -> float:
    """Seconds of one operator (or a group sharing one M): the slower of its two rooflines."""
    mem = bytes_read / (bandwidth * eff_bw) if bytes_read > 0 else 0.0
    comp = flops / (peak * eff_compute) if flops > 0 else 0.0
    return max(mem, comp)


def ring_allreduce_s(message_bytes: float, ranks: int, latency_s: float, bandwidth: float,
                     eff: float) -> float:
    """An all-reduce of `message_bytes` over `ranks` GPUs: latency plus the ring's 2 (n - 1) / n
    of the message over the link (vLLM's custom all-reduce inside NVLink moves the same bytes
    in one or two shots; NCCL's ring across nodes or PCIe)."""
    if ranks <= 1 or message_bytes <= 0:
        return 0.0
    return latency_s + 2.0 * (ranks - 1) / ranks * message_bytes / (bandwidth * eff)


def gather_s(total_bytes: float, ranks: int, latency_s: float, bandwidth: float,
             eff: float) -> float:
    """An all-gather or a reduce-scatter of `total_bytes` summed over `ranks` GPUs: each rank
    moves (n - 1) / n of it."""
    if ranks <= 1 or total_bytes <= 0:
        return 0.0
    return latency_s + (ranks - 1) / ranks * total_bytes / (bandwidth * eff)


def send_s(message_bytes: float, latency_s: float, bandwidth: float) -> float:
    """A point-to-point send (a pipeline hop)."""
    return latency_s + max(message_bytes, 0.0) / bandwidth
