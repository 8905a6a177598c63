"""The memory vLLM's expert-parallel load balancer (EPLB) takes on each GPU: its redundant experts.

With `--enable-eplb` and `--eplb-config '{"num_redundant_experts": R}'` every MoE layer holds
E + R physical experts instead of E (fused_moe/layer.py determine_expert_counts:
global_num_experts = num_experts + num_redundant_experts), spread evenly over the EP ranks:
each rank gets (E + R) / EP of them (deepseek_v2.py DeepseekV2MoE: n_local_physical_experts =
n_physical_experts // ep_size; fused_moe/expert_map_manager.py determine_expert_map), and EPLB's
rebalancing needs the split to be exact (distributed/eplb/policy/default.py
rebalance_experts_hierarchical: `num_physical_experts % num_gpus == 0`). The copies are ordinary
expert weights loaded at start-up, so vLLM's profiling counts them as weights and they come off
the KV cache, rank by rank.

Per GPU that is (E + R) / EP - ceil(E / EP) more expert slots per MoE layer (the limiting rank
already holds ceil(E / EP) without EPLB: memory/budget.py shard_fraction), times one expert's
bytes over every MoE layer the engine loads. For DeepSeek-V3/R1 in block FP8 one expert is
58 layers x 3 x 7168 x 2048 weights + their fp32 scales = 2,554,954,752 bytes (2.38 GiB; vLLM's
EP guide: "approximately 2.4 GB for one redundant expert per EP rank").
"""

from __future__ import annotations

import math

from ...inputs.model import ModelSpec
from .budget import Layout, tensor_bytes

EXPERT_SHARDS = ("expert_column", "expert_row")


def expert_bytes(spec: ModelSpec) -> int:
    """Bytes of one routed expert summed over every MoE layer the engine loads (its gate, up and
    down projections with their quantization scales): what one more slot per layer costs."""
    total = 0.0
    for t in spec.tensors:
        if t.loaded and t.part == "experts" and t.shard in EXPERT_SHARDS and t.count:
            total += tensor_bytes(t, spec.quant, spec.dtype_bytes) / t.count
    return round(total)


def redundant_experts(num_experts: int, ep: int) -> int:
    """The fewest redundant experts (at least one) with E + R a multiple of EP, EPLB's exact
    split: R = EP x ceil((E + 1) / EP) - E. When EP divides E that is one more slot on every
    rank (DeepSeek's 256 experts: 32 at EP32, 9 slots a rank, the case whose balance
    TensorRT-LLM measured; 16 at EP16; 64 at EP64); otherwise it fills the ranks that held one
    expert fewer, and the limiting rank holds no more than without EPLB."""
    if num_experts < 1 or ep < 1:
        raise ValueError(f"experts {num_experts} and EP size {ep} must be at least 1")
    return ep * math.ceil((num_experts + 1) / ep) - num_experts


def slots_per_rank(num_experts: int, redundant: int, ep: int) -> int:
    """Physical experts per MoE layer on each EP rank with `redundant` copies (an exact split)."""
    if (num_experts + redundant) % ep:
        raise ValueError(f"{num_experts} + {redundant} experts do not split over {ep} EP ranks")
    return (num_experts + redundant) // ep


def extra_slots(num_experts: int, redundant: int, ep: int) -> int:
    """Expert slots per MoE layer the limiting GPU holds beyond its share without EPLB."""
    return slots_per_rank(num_experts, redundant, ep) - math.ceil(num_experts / ep)


def bytes_per_gpu(spec: ModelSpec, layout: Layout, redundant: int) -> int:
    """The redundant experts' bytes on the limiting GPU: extra slots x one expert's bytes over
    all MoE layers (EP size = TP x DP, vLLM's EP group)."""
    ep = layout.tp * layout.dp
    return extra_slots(spec.num_experts, redundant, ep) * expert_bytes(spec)
