"""MTP speculative decoding as performance: what a step with k drafts yields and costs. Pure.

A step with k drafts verifies 1 + k tokens per running sequence (the target's forward pass sees
B x (1 + k) tokens; each sequence's KV is still read once) and runs k draft passes of the MTP
layer (DeepSeek's single MTP module is reused for k > 1: vLLM's DeepSeekMultiTokenPredictor
.forward takes spec_step_idx % num_mtp_layers), each with its own fixed cost
(`Constants.draft_pass_us`). It yields on average

    tokens per step = 1 + sum over i <= k of P(drafts 1..i all accepted)

(vLLM logs these cumulative per-position rates; the accepted length is 1 + their sum). So at
equal load the speed-up, step(k = 0) x tokens per step / step(k), can never exceed tokens per
step, and it falls as concurrency rises: a larger batch pushes B x (1 + k) towards the GEMM
ridge and the verify step stops being free.

Default acceptance, from vLLM's own measurements of DeepSeek MTP:
- first draft 0.81: vllm-project/vllm PR #12755 (DeepSeek MTP, R1, k = 1) measured 81-82%;
- each later draft, given the one before accepted, 0.5: vllm-project/vllm PR #41044 logged
  per-position rates of 76.9-78.6% and 35.5-38.1% for DeepSeek MTP with k = 2 (0.46-0.49
  conditional). With these the model predicts 1.50/1.58/1.51x for k = 1/2/3 at one request
  where PR #13626 measured 1.33/1.53/1.61x, and 1.22x for k = 1 at 8 in flight where it
  measured 0.91x (`make bench` scores those rows; V0 engine, lengths not stated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...inputs.model import ModelSpec
from ...inputs.workload import Workload
from ..memory import budget as B
from .request_model import decode_step_s, point
from .step import EngineShape

FIRST_ACCEPTANCE = 0.81
"""vllm-project/vllm PR #12755: DeepSeek-R1 with one MTP draft accepts 81-82% (the low end)."""

LATER_ACCEPTANCE = 0.5
"""vllm-project/vllm PR #41044: per-position acceptance 76.9-78.6% then 35.5-38.1% with two
drafts, i.e. ~0.47 for the second given the first; rounded to 0.5."""

K_CHOICES = (0, 1, 2, 3)
"""Draft counts considered: vLLM's DeepSeek MTP sweeps (PR #13626) go to 3."""


@dataclass(frozen=True)
class Acceptance:
    """Acceptance of the first draft and of each later one given the previous was accepted."""

    first: float = FIRST_ACCEPTANCE
    later: float = LATER_ACCEPTANCE
    source: str = "vLLM PR #12755 (first draft), PR #41044 (later drafts)"

    def per_position(self, k: int) -> list[float]:
        """P(drafts 1..i all accepted) for i = 1..k: vLLM's logged per-position rates."""
        out, p = [], 1.0
        for i in range(k):
            p *= self.first if i == 0 else self.later
            out.append(p)
        return out

    def tokens_per_step(self, k: int) -> float:
        """Expected tokens a verified step yields per request: the bonus token plus each draft
        position accepted, a chain (a draft counts only if every one before it did)."""
        return 1.0 + sum(self.per_position(max(k, 0)))


def draft_shape(spec: ModelSpec, base: EngineShape, layout: B.Layout, kv_dtype: str
                ) -> EngineShape:
    """The MTP layer as an engine of its own: one (MoE) layer whose logits read the shared
    lm_head, on the target's TP/EP ranks (draft TP = target TP: SpeculativeConfig
    _verify_and_get_draft_tp)."""
    dense_b = expert_b = dense_p = expert_p = 0.0
    for t in spec.tensors:
        if t.part != "mtp" or t.name in ("mtp.embed_tokens", "mtp.head"):
            continue
        size = B.tensor_bytes(t, spec.quant, spec.dtype_bytes) * B.shard_fraction(
            t, layout, spec.vocab_size)
        if t.shard.startswith("expert"):
            expert_b += size
            expert_p += t.elements
        else:
            dense_b += size
            dense_p += t.elements if t.cols > 1 else 0
    # the shared lm_head: a vocab x hidden GEMM per draft token, on every TP rank's slice
    head = spec.vocab_size * spec.hidden_size
    dense_b += head * spec.dtype_bytes / layout.tp
    dense_p += head
    per_layer_attn = base.layers and base.attn_decode_flops / base.layers
    layers = max(spec.mtp_layers, 1)
    kv_layer = B.kv_spec(spec, kv_dtype, layout.tp).bytes_per_layer * layers
    return dataclasses.replace(
        base, pp=1, layers=layers, moe_layers=layers if expert_p else 0,
        dense_bytes=dense_b, expert_bytes=expert_b,
        dense_flops_per_token=2.0 * dense_p / layout.tp,
        expert_flops_per_token=(2.0 * expert_p * spec.experts_per_token / spec.num_experts
                                if spec.is_moe and spec.num_experts else 0.0),
        attn_decode_flops=per_layer_attn * layers, kv_bytes_per_token=kv_layer,
        cross_node_pp=False, spec_tokens=0, spec_yield=1.0, draft=None)


def speculative_shape(spec: ModelSpec, shape: EngineShape, layout: B.Layout, kv_dtype: str,
                      k: int, acc: Acceptance) -> EngineShape:
    """The engine with MTP: k drafts verified per step, the expected yield, the draft's passes;
    a decode batch is at most max_num_batched_tokens / (1 + k) requests (the scheduler counts
    every draft token against the token budget)."""
    if k <= 0:
        return dataclasses.replace(shape, spec_tokens=0, spec_yield=1.0, draft=None)
    seqs = min(shape.max_num_seqs, max(1, shape.max_num_batched_tokens // (1 + k)))
    return dataclasses.replace(shape, spec_tokens=k, spec_yield=acc.tokens_per_step(k),
                               draft=draft_shape(spec, shape, layout, kv_dtype),
                               max_num_seqs=seqs)


def with_drafts(shape: EngineShape, draft: EngineShape, k: int, acc: Acceptance
                ) -> EngineShape:
    """`shape` verifying k drafts of an already built draft layer (k = 0: no speculation)."""
    if k <= 0:
        return dataclasses.replace(shape, spec_tokens=0, spec_yield=1.0, draft=None)
    seqs = min(shape.max_num_seqs, max(1, shape.max_num_batched_tokens // (1 + k)))
    return dataclasses.replace(shape, spec_tokens=k, spec_yield=acc.tokens_per_step(k),
                               draft=draft, max_num_seqs=seqs)


def step_speedup(shape: EngineShape, draft: EngineShape, k: int, acc: Acceptance,
                 batch: float, ctx: float) -> float:
    """Decode speed-up at equal load (the same `batch` sequences at context `ctx`): time per
    output token without drafts over time per output token with k drafts. Never above
    tokens per step, since a step with drafts costs at least a step without."""
    off = decode_step_s(with_drafts(shape, draft, 0, acc), batch, ctx)
    on = decode_step_s(with_drafts(shape, draft, k, acc), batch, ctx)
    return off / on


IN_FLIGHT = (1, 4, 8, 16, 32, 64, 128, 256)
"""Sequences in flight over a whole deployment at which the equal-load curve is read: the
loads published MTP sweeps report (vLLM PR #13626: 1 and 8; the Gaudi fork's PR #1264: 4, 32,
128, 256)."""


def equal_load_curve(shape: EngineShape, draft: EngineShape, k: int, acc: Acceptance,
                     ctx: float, in_flight: tuple[int, ...] = IN_FLIGHT
                     ) -> tuple[tuple[int, float], ...]:
    """(sequences in flight over the deployment, equal-load speed-up) at context `ctx`: the
    one computation `make bench` prints and tests/test_perf_physics.py holds to its
    properties. Each DP rank carries in_flight / DP of them (DP ranks decode whole requests)."""
    return tuple((c, step_speedup(shape, draft, k, acc, c / shape.dp, ctx)) for c in in_flight)


def largest_rise(curve: tuple[tuple[int, float], ...], past: int = 16) -> float:
    """The largest step-to-step rise of an equal-load curve from `past` in flight on (issue
    28's property allows 3%: more sequences in flight never make a verified token cheaper)."""
    xs = [x for c, x in curve if c >= past]
    return max((b / a - 1 for a, b in zip(xs, xs[1:], strict=False)), default=0.0)


def choose_k(shape: EngineShape, draft: EngineShape, acc: Acceptance, workload: Workload,
             concurrency: float, ks: tuple[int, ...] = K_CHOICES) -> tuple[int, float]:
    """(k, output tokens/s) with the most output tokens/s at `concurrency`: more drafts at low
    load, fewer or none once verifying them costs more than they yield (as vLLM's own
    speculative-k sweeps find)."""
    best = (0, -1.0)
    for k in ks:
        tput = point(with_drafts(shape, draft, k, acc), workload, concurrency).output_tokens_per_s
        if tput > best[1] * (1 + 1e-9):
            best = (k, tput)
    return best
