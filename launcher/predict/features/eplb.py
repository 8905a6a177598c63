"""EPLB as a decision: vLLM's expert-parallel load balancer with its redundant experts, or not.

What it buys. Routing is skewed: under wide EP a few hot experts land on the same rank and that
rank receives far more tokens than the mean; every MoE layer then waits for it. TensorRT-LLM
measured DeepSeek-R1 at EP32 (blog 4, "Scaling Expert Parallelism in TensorRT-LLM", Table 1,
averaged over layers and decode iterations): the hottest rank received 1 + 1.564 = 2.56x the mean
routed tokens without EPLB, and 1 + 0.109 = 1.11x with 32 redundant experts (9 slots a rank),
2.31x less on the rank every layer waits for. The same blog: imbalance "can inherently" appear
"when the EP size increases up to greater than 8", which is where this module turns EPLB on by
itself (`WIDE_EP`). DeepSeek's own service runs EPLB with redundant experts in its EP32 prefill
and EP144 decode units (DeepSeek-V3 report; deepseek-ai/EPLB).

What it costs. The redundant experts are weights on every GPU, taken from the KV cache
(memory/redundant_experts.py): one slot per rank for DeepSeek-V3/R1 is 2.38 GiB a GPU.

The rule (auto): on when the engine is wide EP (MoE, expert parallel, EP = TP x DP above
`WIDE_EP`, one pipeline stage), its vLLM has both flags (read from the sdists:
inputs/vllm_flags.py), the platform runs EPLB (vLLM: CUDA, ROCm or XPU only, config/parallel.py
ParallelConfig), the all-to-all is not the prefill-only high-throughput kernel (the measured gain
is decode's), and the memory allows: after the cut the KV cache still holds the engine's batch
(max-num-seqs requests of the workload's length). `--eplb` / `--no-eplb` pin it. The performance
model does not yet count expert imbalance, so the plan's speed figures are the same either way;
the gain is stated in the reason's data, with its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...deployment.plan import Reason
from ...errors import InputError
from ...inputs import vllm_flags as F
from ...inputs.hardware import GiB
from ..memory import redundant_experts as RX

WIDE_EP = 8
"""EP sizes above this are wide EP, where EPLB is on unless pinned off (TensorRT-LLM blog 4:
imbalance appears "when the EP size increases up to greater than 8")."""

IMBALANCE = {"hottest_rank_over_mean_without": 2.564, "hottest_rank_over_mean_with": 1.109,
             "measured_ep": 32, "measured_slots_per_rank": 9, "model": "DeepSeek-R1",
             "source": "NVIDIA/TensorRT-LLM docs/source/blogs/tech_blog/"
                       "blog4_Scaling_Expert_Parallelism_in_TensorRT-LLM.md, Table 1"}
"""The load-imbalance figures the decision assumes (hottest rank's routed tokens / the mean)."""

PLATFORMS = ("cuda", "rocm")
"""Where vLLM 0.32 runs EPLB among the platforms vlaunch plans (config/parallel.py: "only
supported on CUDA devices or ROCm devices or XPU devices")."""


@dataclass
class Decision:
    """EPLB for one engine: whether it applies, whether it is on, and what it costs."""

    applies: bool = False
    enabled: bool = False
    pinned: bool = False
    ep_size: int = 0
    num_redundant_experts: int = 0
    slots_per_rank: int = 0
    bytes_per_gpu: int = 0
    blocked: bool = False  # pinned on, but this layout cannot run it: the candidate is out
    code: str = ""
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def reason(self) -> Reason | None:
        return Reason(self.code, self.text, dict(self.data)) if self.code else None

    def to_dict(self) -> dict[str, Any]:
        return {"applies": self.applies, "enabled": self.enabled, "pinned": self.pinned,
                "ep_size": self.ep_size, "num_redundant_experts": self.num_redundant_experts,
                "slots_per_rank": self.slots_per_rank, "bytes_per_gpu": self.bytes_per_gpu,
                "reason": {"code": self.code, "text": self.text, "data": dict(self.data)}
                if self.code else None}


def _off(d: Decision, code: str, text: str, **data: Any) -> Decision:
    d.enabled, d.code, d.text = False, code, text
    d.data = {"ep_size": d.ep_size, "pinned": d.pinned, **data}
    return d


def unsupported(spec: Any, hw: Any, version: str) -> str | None:
    """Why no layout of this model, platform and vLLM could run EPLB (None: some could)."""
    if not spec.is_moe:
        return "EPLB balances MoE experts and this model has none"
    if hw.kind.platform not in PLATFORMS:
        return (f"vLLM runs EPLB only on CUDA, ROCm or XPU GPUs, not {hw.kind.platform} "
                "(config/parallel.py ParallelConfig)")
    for dest in ("enable_eplb", "eplb_config"):
        if not F.available(dest, version):
            since, _ = F.releases(dest)
            return f"vLLM {version} has no {F.flag(dest)} (first in {since})"
    return None


def check_pin(spec: Any, hw: Any, version: str, pinned: bool | None) -> None:
    """`--eplb` that no layout could honour is bad input (one line, exit 2), said before any
    candidate is judged."""
    if pinned and (why := unsupported(spec, hw, version)) is not None:
        raise InputError(f"--eplb: {why}; drop --eplb")


def propose(spec: Any, hw: Any, layout: Any, version: str, pinned: bool | None,
            all2all: str | None) -> Decision:
    """EPLB before the memory is judged: whether it applies and is wanted, and its cost per GPU.
    A pin the engine cannot honour is bad input (one line, exit 2)."""
    ep = layout.tp * layout.dp
    d = Decision(pinned=pinned is not None, ep_size=ep)
    why_not = unsupported(spec, hw, version)
    if why_not is not None:
        if pinned:
            raise InputError(f"--eplb: {why_not}; drop --eplb")
        return _off(d, "eplb.none", f"EPLB off: {why_not}") if spec.is_moe else d
    layout_why = None  # this layout cannot: a pin on rules the layout out
    if not (layout.expert_parallel and ep > 1):
        layout_why = ("EPLB balances expert-parallel MoE layers; this layout has none "
                      "(vLLM: enable_expert_parallel and TP x DP > 1)")
    elif layout.pp > 1:
        layout_why = "EPLB is planned for one pipeline stage; this layout has PP > 1"
    if layout_why is not None:
        d.blocked = bool(pinned)
        return _off(d, "eplb.none", f"EPLB off: {layout_why}")
    d.applies = True
    d.num_redundant_experts = RX.redundant_experts(spec.num_experts, ep)
    d.slots_per_rank = RX.slots_per_rank(spec.num_experts, d.num_redundant_experts, ep)
    d.bytes_per_gpu = RX.bytes_per_gpu(spec, layout, d.num_redundant_experts)
    cost = {"num_redundant_experts": d.num_redundant_experts,
            "slots_per_rank": d.slots_per_rank, "bytes_per_gpu": d.bytes_per_gpu}
    if pinned is False:
        return _off(d, "eplb.off", "EPLB off: pinned by you (--no-eplb)", **cost)
    if pinned:
        d.enabled = True
        return d
    if ep <= WIDE_EP:
        return _off(d, "eplb.off", f"EPLB off: EP{ep} is not wide EP (above EP{WIDE_EP} a hot "
                    "rank appears; TensorRT-LLM blog 4), so the "
                    f"{d.bytes_per_gpu / GiB:.2f} GiB a GPU of redundant experts stay KV cache",
                    **cost)
    if all2all == "deepep_high_throughput":
        return _off(d, "eplb.off", "EPLB off: a prefill-heavy engine (DeepEP high-throughput "
                    "kernels); the measured gain is decode's, the KV cache keeps the "
                    f"{d.bytes_per_gpu / GiB:.2f} GiB a GPU", **cost)
    d.enabled = True
    return d


def settle(d: Decision, before: Any, after: Any, workload: Any) -> Decision:
    """The decision once the redundant experts' bytes are cut from the KV cache: `before` and
    `after` are the candidate without and with them. Auto: on only if `after` fits and still
    holds the engine's batch (max-num-seqs requests of the workload's length) in its KV cache."""
    if not d.enabled:
        return d
    need = before.max_num_seqs * (workload.input_len + workload.output_len)
    figures = {"num_redundant_experts": d.num_redundant_experts,
               "slots_per_rank": d.slots_per_rank, "bytes_per_gpu": d.bytes_per_gpu,
               "kv_tokens_before": before.tokens, "kv_tokens_after": after.tokens,
               "batch_tokens": need, "imbalance": IMBALANCE}
    cost = (f"{d.num_redundant_experts} redundant experts ({d.slots_per_rank} slots a rank), "
            f"{d.bytes_per_gpu / GiB:.2f} GiB a GPU from the KV cache "
            f"({before.tokens:,} -> {after.tokens:,} tokens an engine)")
    gain = (f"at EP{IMBALANCE['measured_ep']} the hottest rank got "
            f"{IMBALANCE['hottest_rank_over_mean_without']:.2f}x the mean routed tokens "
            f"without EPLB, {IMBALANCE['hottest_rank_over_mean_with']:.2f}x with "
            "(TensorRT-LLM blog 4, DeepSeek-R1); not yet in the speed figures")
    if d.pinned:
        d.code, d.text = "eplb.on", f"EPLB on (pinned by you, --eplb): {cost}; {gain}"
        d.data = {"ep_size": d.ep_size, "pinned": True, **figures}
        return d
    if not after.fits or after.tokens < need:
        why = (after.problem if not after.fits else
               f"the KV cache would hold {after.tokens:,} tokens, fewer than the "
               f"{before.max_num_seqs} x {workload.input_len + workload.output_len:,} "
               "the engine's batch needs")
        return _off(d, "eplb.off", f"EPLB off: {cost} would leave too little: {why}",
                    **figures)
    d.code = "eplb.on"
    d.text = f"EPLB on: wide EP{d.ep_size}; {cost}; {gain}"
    d.data = {"ep_size": d.ep_size, "pinned": False, **figures}
    return d
