"""EPLB as a decision: vLLM's expert-parallel load balancer with its redundant experts, or not.

What it buys. Routing is skewed: under wide EP a few hot experts land on the same rank and that
rank receives far more tokens than the mean; every MoE layer then waits for it. TensorRT-LLM
measured DeepSeek-R1 at EP32 (blog 4, "Scaling Expert Parallelism in TensorRT-LLM", Table 1,
averaged over layers and decode iterations): the hottest rank received 1 + 1.564 = 2.56x the mean
routed tokens without EPLB, and 1 + 0.109 = 1.11x with 32 redundant experts (9 slots a rank):
the rank every layer waits for gets 1 - 1.109 / 2.564 = 57% fewer routed tokens (`HOT_RANK_CUT`).
The same blog: imbalance "can inherently" appear "when the EP size increases up to greater than
8", which is where this module turns EPLB on by itself (`WIDE_EP`). DeepSeek's own service runs
EPLB with redundant experts in its EP32 prefill and EP144 decode units (DeepSeek-V3 report;
deepseek-ai/EPLB).

What it costs. The redundant experts are weights on every GPU, taken from the KV cache
(memory/redundant_experts.py): one slot per rank for DeepSeek-V3/R1 is 2.38 GiB a GPU. What the
cut really costs is the batch the KV cache can hold: min(max-num-seqs, KV tokens / tokens per
request) requests an engine. Where max-num-seqs binds (the cache holds more than the engine
schedules) the cut costs nothing; where the cache binds it costs the tokens it takes.

The rule (auto): on when the engine is wide EP (MoE, expert parallel, EP = TP x DP above
`WIDE_EP`, one pipeline stage), its vLLM has both flags (read from the sdists:
inputs/vllm_flags.py), the platform runs EPLB (vLLM: CUDA, ROCm or XPU only, config/parallel.py
ParallelConfig), the all-to-all is not the prefill-only high-throughput kernel (the measured gain
is decode's), the engine still fits with the redundant experts, and the cut costs a smaller
share of the held batch than `HOT_RANK_CUT`, the share of the hot rank's routed tokens EPLB
removes: a MoE layer bound by its hottest rank runs its batch at most 2.564 / 1.109 = 2.31x
faster with EPLB, so a batch cut by less than 57% (kept above 1.109 / 2.564 = 43% of itself)
cannot lose more than the balance can win; a deeper cut can. The bound is generous (only the
MoE part of a step is balanced), which is why the rule is the break-even of the best case, not a
prediction. More memory never turns it off: a larger cache holds at least as large a share of
its batch after the same cut. `--eplb` / `--no-eplb` pin it. The performance model does not yet
count expert imbalance, so the plan's speed figures are the same either way; the gain and the
rule are stated in the reason's data, with their source.

One shape: the decision is `deployment.plan.EPLB` (frozen); its reason's text is rendered from
its code and data by `render`, the one renderer the planner, the search's problem line and
`exec --replan` share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...deployment.plan import EPLB, Reason
from ...errors import InputError
from ...inputs import vllm_flags as F
from ...inputs.hardware import GiB
from ..memory import redundant_experts as RX
from ..search.pins import Origin, origin_data, said

WIDE_EP = 8
"""EP sizes above this are wide EP, where EPLB is on unless pinned off (TensorRT-LLM blog 4:
imbalance appears "when the EP size increases up to greater than 8")."""

IMBALANCE = {"hottest_rank_over_mean_without": 2.564, "hottest_rank_over_mean_with": 1.109,
             "measured_ep": 32, "measured_slots_per_rank": 9, "model": "DeepSeek-R1",
             "source": "NVIDIA/TensorRT-LLM docs/source/blogs/tech_blog/"
                       "blog4_Scaling_Expert_Parallelism_in_TensorRT-LLM.md, Table 1"}
"""The load-imbalance figures the decision assumes (hottest rank's routed tokens / the mean)."""

HOT_RANK_CUT = 1 - (IMBALANCE["hottest_rank_over_mean_with"]
                    / IMBALANCE["hottest_rank_over_mean_without"])
"""The share of the hottest rank's routed tokens EPLB removes (1 - 1.109 / 2.564 = 0.567): the
most of its held batch an engine may give up to the redundant experts under auto."""

PLATFORMS = ("cuda", "rocm")
"""Where vLLM 0.32 runs EPLB among the platforms vlaunch plans (config/parallel.py: "only
supported on CUDA devices or ROCm devices or XPU devices")."""

NONE = EPLB(applies=False, enabled=False, pinned=False, ep_size=0, num_redundant_experts=0,
            slots_per_rank=0, bytes_per_gpu=0)
"""No EPLB decision (a dense model, or no candidate fits)."""


def _cost(d: Mapping[str, Any]) -> str:
    s = (f"{d['num_redundant_experts']} redundant experts ({d['slots_per_rank']} slots a rank), "
         f"{d['bytes_per_gpu'] / GiB:.2f} GiB a GPU")
    if "kv_tokens_before" in d:
        s += (f" from the KV cache ({d['kv_tokens_before']:,} -> {d['kv_tokens_after']:,} "
              "tokens an engine)")
    return s


def _gain() -> str:
    return (f"at EP{IMBALANCE['measured_ep']} the hottest rank got "
            f"{IMBALANCE['hottest_rank_over_mean_without']:.2f}x the mean routed tokens "
            f"without EPLB, {IMBALANCE['hottest_rank_over_mean_with']:.2f}x with "
            "(TensorRT-LLM blog 4, DeepSeek-R1); not yet in the speed figures")


def _batch(d: Mapping[str, Any]) -> str:
    return (f"the KV cache holds {d['batch_before']:,.1f} -> {d['batch_after']:,.1f} requests "
            f"of {d['request_tokens']:,} tokens (max-num-seqs {d['max_num_seqs']:,}), "
            f"{d['batch_cost_share']:.0%} fewer")


def _origin(d: Mapping[str, Any]) -> Origin:
    return "plan" if d.get("from_plan") else "you"


def why(d: Mapping[str, Any]) -> str:
    """The clause that says why EPLB is off (or cannot be on), from a reason's data alone."""
    c = d["cause"]
    if c == "not_moe":
        return "EPLB balances MoE experts and this model has none"
    if c == "platform":
        return (f"vLLM runs EPLB only on CUDA, ROCm or XPU GPUs, not {d['platform']} "
                "(config/parallel.py ParallelConfig)")
    if c == "version":
        return f"vLLM {d['version']} has no {d['flag']} (first in {d['since']})"
    if c == "no_expert_parallel":
        return ("EPLB balances expert-parallel MoE layers; this layout has none "
                "(vLLM: enable_expert_parallel and TP x DP > 1)")
    if c == "pipeline":
        return "EPLB is planned for one pipeline stage; this layout has PP > 1"
    if c == "pinned_off":
        return f"{said(_origin(d))} (--no-eplb)"
    if c == "narrow":
        return (f"EP{d['ep_size']} is not wide EP (above EP{d['wide_ep']} a hot rank appears; "
                f"TensorRT-LLM blog 4), so the {d['bytes_per_gpu'] / GiB:.2f} GiB a GPU of "
                "redundant experts stay KV cache")
    if c == "prefill_kernels":
        return ("a prefill-heavy engine (DeepEP high-throughput kernels); the measured gain is "
                f"decode's, the KV cache keeps the {d['bytes_per_gpu'] / GiB:.2f} GiB a GPU")
    if c == "misfit":
        return f"{_cost(d)} would leave too little: {d['problem']}"
    if c == "batch":
        return (f"{_cost(d)} would cost too much of the batch: {_batch(d)}, more than the "
                f"{d['hot_rank_cut']:.0%} of the hottest rank's routed tokens EPLB removes "
                f"({IMBALANCE['hottest_rank_over_mean_without']:.2f}x -> "
                f"{IMBALANCE['hottest_rank_over_mean_with']:.2f}x the mean, TensorRT-LLM blog 4)")
    raise ValueError(f"no EPLB cause {c!r}")


def render(code: str, d: Mapping[str, Any]) -> str:
    """An EPLB reason's text from its code and data: the one renderer of these reasons."""
    if code in ("eplb.none", "eplb.off"):
        return f"EPLB off: {why(d)}"
    if code != "eplb.on":
        raise ValueError(f"not an EPLB reason: {code!r}")
    if d["cause"] == "pinned":
        return f"EPLB on ({said(_origin(d))}, --eplb): {_cost(d)}; {_gain()}"
    return (f"EPLB on: wide EP{d['ep_size']}; {_cost(d)}; {_batch(d)}, under the "
            f"{d['hot_rank_cut']:.0%} of the hottest rank's routed tokens it removes; {_gain()}")


def _reason(code: str, **data: Any) -> Reason:
    return Reason(code, render(code, data), data)


def _unsupported(spec: Any, hw: Any, version: str) -> dict[str, Any] | None:
    """Why no layout of this model, platform and vLLM could run EPLB, as data (None: some
    could)."""
    if not spec.is_moe:
        return {"cause": "not_moe"}
    if hw.kind.platform not in PLATFORMS:
        return {"cause": "platform", "platform": hw.kind.platform}
    for dest in ("enable_eplb", "eplb_config"):
        if not F.available(dest, version):
            since, _ = F.releases(dest)
            return {"cause": "version", "version": version, "flag": F.flag(dest),
                    "since": since}
    return None


def check_pin(spec: Any, hw: Any, version: str, pinned: bool | None) -> None:
    """`--eplb` that no layout could honour is bad input (one line, exit 2), said before any
    candidate is judged."""
    if pinned and (d := _unsupported(spec, hw, version)) is not None:
        raise InputError(f"--eplb: {why(d)}; drop --eplb")


def blocked(d: EPLB, pinned: bool | None) -> bool:
    """Pinned on (`--eplb`) but this layout cannot run it: the candidate is out."""
    return bool(pinned) and not d.enabled


def problem(d: EPLB) -> str:
    """The misfit line of a candidate `blocked` rules out, from the decision's data."""
    assert d.reason is not None
    return f"--eplb pinned, but {why(d.reason.data)}"


def _who(pinned: bool | None, origin: Origin | None) -> dict[str, Any]:
    return origin_data(None if pinned is None else origin or "you")


def propose(spec: Any, hw: Any, layout: Any, version: str, pinned: bool | None,
            all2all: str | None, origin: Origin | None = None) -> EPLB:
    """EPLB before the memory is judged: whether it applies and is wanted, and its cost per GPU
    (`enabled` here means wanted: `settle` decides). A pin the engine cannot honour is bad
    input (one line, exit 2). `origin`: who pinned it (the user unless `exec --replan` took it
    from the emitted plan); the plan's `EPLB.pinned` is true either way, the reason's data
    `pinned` only for the user's."""
    ep = layout.tp * layout.dp
    d = dataclasses.replace(NONE, pinned=pinned is not None, ep_size=ep)
    base = {"ep_size": ep, **_who(pinned, origin)}
    lack = _unsupported(spec, hw, version)
    if lack is not None:
        if pinned:
            raise InputError(f"--eplb: {why(lack)}; drop --eplb")
        return dataclasses.replace(d, reason=_reason("eplb.none", **base, **lack)) \
            if spec.is_moe else d
    if not (layout.expert_parallel and ep > 1):  # this layout cannot: a pin on rules it out
        return dataclasses.replace(d, reason=_reason("eplb.none", **base,
                                                     cause="no_expert_parallel"))
    if layout.pp > 1:
        return dataclasses.replace(d, reason=_reason("eplb.none", **base, cause="pipeline"))
    r = RX.redundant_experts(spec.num_experts, ep)
    cost = {"num_redundant_experts": r,
            "slots_per_rank": RX.slots_per_rank(spec.num_experts, r, ep),
            "bytes_per_gpu": RX.bytes_per_gpu(spec, layout, r)}
    d = dataclasses.replace(d, applies=True, **cost)
    if pinned is False:
        return dataclasses.replace(d, reason=_reason("eplb.off", **base, cause="pinned_off",
                                                     **cost))
    if pinned:
        return dataclasses.replace(d, enabled=True)
    if ep <= WIDE_EP:
        return dataclasses.replace(d, reason=_reason("eplb.off", **base, cause="narrow",
                                                     wide_ep=WIDE_EP, **cost))
    if all2all == "deepep_high_throughput":
        return dataclasses.replace(d, reason=_reason("eplb.off", **base, cause="prefill_kernels",
                                                     all2all=all2all, **cost))
    return dataclasses.replace(d, enabled=True)


def held_batch(tokens: int, max_num_seqs: int, request_tokens: int) -> float:
    """Requests of `request_tokens` an engine holds at once: its KV tokens' worth, at most the
    max-num-seqs it schedules (a fraction, like vLLM's "Maximum concurrency")."""
    return min(float(max_num_seqs), tokens / max(1, request_tokens))


def settle(d: EPLB, before: Any, after: Any, workload: Any,
           origin: Origin | None = None) -> EPLB:
    """The decision once the redundant experts' bytes are cut from the KV cache: `before` and
    `after` are the candidate without and with them. Auto: on only if `after` fits and the cut
    costs a smaller share of the batch the KV cache holds than `HOT_RANK_CUT` (the module's
    rule); a pin is obeyed and the KV cache pays."""
    if not d.enabled:
        return d
    length = workload.input_len + workload.output_len
    held_before = held_batch(before.tokens, before.max_num_seqs, length)
    held_after = held_batch(after.tokens, before.max_num_seqs, length)
    share = 1 - held_after / held_before if held_before > 0 else 1.0
    data = {"ep_size": d.ep_size, **_who(True if d.pinned else None, origin),
            "num_redundant_experts": d.num_redundant_experts,
            "slots_per_rank": d.slots_per_rank, "bytes_per_gpu": d.bytes_per_gpu,
            "kv_tokens_before": before.tokens, "kv_tokens_after": after.tokens,
            "request_tokens": length, "max_num_seqs": before.max_num_seqs,
            "batch_before": round(held_before, 2), "batch_after": round(held_after, 2),
            "batch_cost_share": round(share, 4), "hot_rank_cut": round(HOT_RANK_CUT, 4),
            "rule": "on while batch_cost_share < hot_rank_cut "
                    "(1 - hottest_rank_over_mean_with / hottest_rank_over_mean_without)",
            "imbalance": IMBALANCE}
    if d.pinned:
        return dataclasses.replace(d, reason=_reason("eplb.on", **data, cause="pinned"))
    if not after.fits:
        return dataclasses.replace(d, enabled=False, reason=_reason(
            "eplb.off", **data, cause="misfit", problem=after.problem))
    if share >= HOT_RANK_CUT:
        return dataclasses.replace(d, enabled=False, reason=_reason("eplb.off", **data,
                                                                    cause="batch"))
    return dataclasses.replace(d, reason=_reason("eplb.on", **data, cause="wide_ep"))
