"""MTP speculative decoding for DeepSeek-V3/R1: what the draft costs, what it buys, on or off.

DeepSeek-V3/R1/V3.1/V3.2 checkpoints store a multi-token-prediction layer after the decoder
(`model.layers.61`, part "mtp" in `inputs/arch.py`; vLLM skips it unless asked). With
`--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'` vLLM loads it as a
draft model and every decode step verifies 1 + k tokens per request.

Cost, each from vLLM 0.32.0's source:
- weights: the MTP layer's decoder block (MLA attention + MoE, sharded like any layer) plus
  eh_proj (a plain nn.Linear, replicated), enorm/hnorm and shared_head.norm
  (`model_executor/models/deepseek_mtp.py` DeepSeekMultiTokenPredictorLayer). Its
  shared_head.head is always replaced by the target's lm_head and its embed_tokens too when
  PP = 1 (`v1/spec_decode/llm_base_proposer.py` _maybe_share_lm_head, _maybe_share_embeddings);
  vLLM measures the load after `del`, so the copies do not count (`gpu_model_runner.load_model`
  under DeviceMemoryProfiler, which empties the cache first). The draft lives on the last
  pipeline stage only (`gpu_model_runner.__init__`: `if self.speculative_config and
  get_pp_group().is_last_rank`).
- KV cache: the MTP block's attention is one more MLA layer of the same spec, so it joins the
  same KV cache group (`llm_base_proposer.validate_same_kv_cache_group`): every block costs one
  more layer's page, i.e. KV bytes per token per GPU grow by one layer's `budget.kv_spec`.
  k > 1 reuses the same layer (`DeepSeekMultiTokenPredictor.forward`: spec_step_idx %
  num_mtp_layers), so the KV cost does not grow with k. The scheduler reserves k lookahead
  slots per request (`config/vllm.py` VllmConfig.num_lookahead_tokens).
- activations: MTP adds no scheduled tokens (`config/speculative.py`
  max_num_new_slots_for_drafting: 0 for mtp), but the proposer keeps persistent hidden-state
  and input-embedding buffers of max_num_batched_tokens rows (`SpecDecodeBaseProposer.__init__`).
- CUDA graphs: a uniform decode batch is 1 + k tokens per request, so vLLM captures up to
  min(max_num_seqs x (1 + k) x 2, 512) tokens plus the uniform decode sizes n x (1 + k)
  (`VllmConfig._set_cudagraph_sizes`); the drafter's one-layer graphs are captured beside them.

Gain: a step yields 1 + a1 x (1 - p^k) / (1 - p) tokens per request on average, a1 being the
first draft's acceptance and p the conditional acceptance of later drafts (profiles/serving.yaml
gives both with their sources; `--mtp-acceptance` replaces a1; `vlaunch tune` measures it). The
step itself verifies 1 + k tokens and runs k one-layer draft passes (`perf.decode_step_s`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...deployment.plan import Acceptance as PlanAcceptance
from ...deployment.plan import Reason, Speculative
from ...errors import InputError
from ...inputs.hardware import GiB, Hardware, MiB
from ...inputs.model import ModelSpec
from ...paths import cache_dir, read_json_object, report_corrupt, update_json_object
from ..memory import budget as B
from ..memory.kv_recut import rebudget
from ..speed.mtp import Acceptance, draft_shape, speculative_shape  # noqa: F401 - re-exported
from .serving_flags import at_least, table

ACCEPTANCE_PINNED = "your --mtp-acceptance"
"""The acceptance's source when the user gave it (a re-plan pins it back; a default is not)."""

DRAFT_BUFFER_COPIES = 2
"""Persistent draft buffers of max_num_batched_tokens x hidden in the model dtype: hidden_states
and inputs_embeds (llm_base_proposer.SpecDecodeBaseProposer.__init__)."""

DRAFT_INDEX_BYTES = 4 + 8 + 8
"""Per batched token: input_ids (int32), positions (int64) and the slot-mapping buffer (int64)
of the same proposer."""


def mtp_table() -> dict[str, Any]:
    return table()["speculative"]["mtp"]


def acceptance(pinned: float | None = None, model: str | None = None) -> Acceptance:
    """A pin wins; then what `vlaunch tune` measured for this model; then the table's default."""
    t = mtp_table()["acceptance"]
    first, later = float(t["first"]), float(t["later"])
    if pinned is not None:
        if not 0 < pinned < 1:
            raise InputError(f"--mtp-acceptance must be a probability between 0 and 1, "
                             f"got {pinned}")
        return Acceptance(pinned, min(later, pinned), ACCEPTANCE_PINNED)
    seen = measured_for(model) if model else None
    if seen is not None:
        return Acceptance(seen["first"], seen.get("later", min(later, seen["first"])),
                          f"measured by vlaunch tune on {seen['source']} "
                          f"({seen.get('recorded_at', '?')}, "
                          f"acceptance length {seen.get('acceptance_length', 0):.2f})")
    return Acceptance(first, later, f"{t['first_source']}; later drafts: {t['later_source']}")


def _acceptance_store() -> Path:
    return cache_dir() / "mtp_acceptance.json"


def record_acceptance(model: str, measured: dict[str, Any], *, source: str) -> Path | None:
    """Keep what vLLM's benchmark measured for a model's MTP draft, for its next plans: the
    acceptance belongs to the model and its workload, not to the GPU or layout. `source`
    names the prompts it was measured on (natural text; `run/tune_acceptance.py`)."""
    if not (0 < float(measured.get("first", 0)) <= 1) or not source:
        return None
    entry: dict[str, Any] = {k: float(v) for k, v in measured.items()
                             if k in ("first", "later", "acceptance_length")}
    entry["source"] = source
    entry["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def add(data: dict[str, Any]) -> None:
        data[model] = entry

    return update_json_object(_acceptance_store(), add)


def measured_for(model: str) -> dict[str, Any] | None:
    """The recorded acceptance of `model`, if a well-formed one exists (a corrupt cache is
    reported and ignored). A record without a `source` was measured by an earlier vlaunch on
    random-token prompts, which inflate acceptance: ignored, not trusted."""
    entry = read_json_object(_acceptance_store()).get(model)
    if isinstance(entry, dict) and not (isinstance(entry.get("source"), str)
                                        and entry["source"]):
        return None
    ok = (isinstance(entry, dict)
          and all(isinstance(entry.get(f), (int, float)) and not isinstance(entry.get(f), bool)
                  and 0 < entry[f] <= 1 for f in ("first",))
          and all(isinstance(entry.get(f, 0.5), (int, float)) and 0 <= entry.get(f, 0.5) <= 1
                  for f in ("later",)))
    if entry is not None and not ok:
        report_corrupt(_acceptance_store(), f"entry {model!r} is not an acceptance record")
    return entry if ok else None


def support(spec: ModelSpec, hw: Hardware, version: str) -> tuple[bool, Reason | None, str]:
    """(supported, why not, method name) for an MTP draft of `spec` on `hw` with `version`."""
    t = mtp_table()
    if not spec.mtp_layers:
        return False, Reason("mtp.unsupported.no_layer", f"{spec.name} stores no MTP layer "
                             "(num_nextn_predict_layers is 0)", {"model": spec.name}), ""
    if not spec.architecture.startswith("deepseek"):
        return False, Reason("mtp.unsupported.architecture", "vlaunch models MTP for DeepSeek "
                             f"checkpoints, not {spec.architecture}",
                             {"architecture": spec.architecture}), ""
    since = (t.get("min_version") or {}).get(spec.attention)
    if since is None:
        return False, Reason("mtp.unsupported.attention", f"no MTP support row for "
                             f"{spec.attention} attention", {"attention": spec.attention}), ""
    if not at_least(version, since):
        return False, Reason("mtp.unsupported.version", f"vLLM {version} cannot load a "
                             f"{spec.attention} MTP draft (since {since})",
                             {"attention": spec.attention, "vllm_version": version,
                              "since": str(since)}), ""
    for row in t.get("platforms", ()):
        if row["platform"] == hw.kind.platform:
            if not row["supported"]:
                return False, Reason("mtp.unsupported.platform", row["reason"],
                                     {"platform": hw.kind.platform}), ""
            break
    else:
        return False, Reason("mtp.unsupported.platform", f"no MTP support row for the "
                             f"{hw.kind.platform} platform", {"platform": hw.kind.platform}), ""
    method = next(r["method"] for r in t["methods"] if at_least(version, r["since"]))
    return True, None, method


# ----------------------------------------------------------------------------- cost


def _mtp_tensors(spec: ModelSpec, layout: B.Layout) -> list[B.Tensor]:
    """The MTP tensors vLLM keeps loaded: not the head (shared with lm_head), not the embedding
    when it is shared (PP = 1)."""
    out = []
    for t in spec.tensors:
        if t.part != "mtp" or t.name == "mtp.head":
            continue
        if t.name == "mtp.embed_tokens" and layout.pp == 1:
            continue
        out.append(t)
    return out


def weight_bytes(spec: ModelSpec, layout: B.Layout) -> int:
    """MTP weights on one GPU of the last pipeline stage (all of them live there), scaled like
    the rest of the checkpoint (budget.checkpoint_scale). Memoized per layout: the search asks
    for it once per draft candidate."""
    def compute() -> int:
        total = sum(B.tensor_bytes(t, spec.quant, spec.dtype_bytes)
                    * B.shard_fraction(t, layout, spec.vocab_size)
                    for t in _mtp_tensors(spec, layout))
        return round(total * B.checkpoint_scale(spec))

    return B.memo("mtp_weights", spec, layout, compute)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, layout: B.Layout) -> int:
    """One more layer of the model's own KV spec per MTP layer, on every TP rank (MLA)."""
    return B.kv_spec(spec, kv_dtype, layout.tp).bytes_per_layer * spec.mtp_layers


def _request_counts(max_reqs: int, ceiling: int) -> list[int]:
    """VllmConfig._set_cudagraph_sizes request_counts: 1, 2, 4, 8..248 by 8, 256.. by 16."""
    max_reqs = min(max_reqs, ceiling)
    counts = [n for n in (1, 2, 4) if n <= max_reqs]
    counts += list(range(8, min(max_reqs + 1, 256), 8))
    counts += list(range(256, max_reqs + 1, 16))
    return sorted(set(counts + [max_reqs]))


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, k: int,
                  ceiling: int = 512) -> list[int]:
    """The CUDA-graph capture sizes of vLLM 0.32.0 (VllmConfig._set_cudagraph_sizes) with k
    draft tokens per request (k = 0: no speculation)."""
    q = 1 + k
    top = min(max_num_seqs * q * 2, ceiling)
    if q > 1:
        uniform = sorted({n * q for n in _request_counts(max_num_seqs, ceiling) if n * q <= top})
    else:
        uniform = [max_num_seqs] if max_num_seqs <= top else []
    top = min(max_num_batched_tokens, top)
    sizes = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in uniform if s <= max_num_batched_tokens]
    return sorted(set(sizes))


@dataclass(frozen=True)
class Cost:
    """What an MTP draft with k tokens adds on one GPU of the last stage."""

    k: int
    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    cudagraph_bytes: int
    lookahead_tokens: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def cost(spec: ModelSpec, cand: Any, k: int) -> Cost:
    """The draft's cost for a planner Candidate (its layout, KV dtype, batch limits)."""
    L = cand.layout
    act = (DRAFT_BUFFER_COPIES * spec.hidden_size * spec.dtype_bytes + DRAFT_INDEX_BYTES) \
        * cand.max_num_batched_tokens if cand.activation else 0
    graphs = 0
    if cand.cudagraph:
        seqs, tokens = cand.max_num_seqs, cand.max_num_batched_tokens
        base, spec_sizes = capture_sizes(seqs, tokens, 0), capture_sizes(seqs, tokens, k)
        # budget.CUDAGRAPH_PER_CAPTURE per extra size, and the drafter's one-layer graphs at
        # its share of a full graph for every size
        draft_share = spec.mtp_layers / max(1, spec.num_layers)
        graphs = max(0, round((len(spec_sizes) - len(base)) * B.CUDAGRAPH_PER_CAPTURE
                              + len(spec_sizes) * B.CUDAGRAPH_PER_CAPTURE * draft_share))
    return Cost(k, weight_bytes(spec, L), kv_bytes_per_token(spec, cand.kv_dtype, L), act,
                graphs, k)


def with_draft(spec: ModelSpec, cand: Any, c: Cost, kv_pinned: bool,
               pinned_bytes: int | None = None) -> Any:
    """A copy of the planner Candidate with the draft's memory taken from its KV cache: its
    weights, buffers, graphs and one KV layer on the last stage (rebudget.rebudget), and the
    context check with vLLM's k lookahead slots per request."""
    out = rebudget(spec, cand, kv_pinned, extra_weights_last=c.weights_bytes,
                   extra_layers_last=spec.mtp_layers, d_activation=c.activation_bytes,
                   d_cudagraph=c.cudagraph_bytes, pinned_bytes=pinned_bytes)
    usable = max(0, out.blocks - 1) * out.block_size
    if usable < cand.max_model_len + c.lookahead_tokens:
        out.fits = False
        out.problem = (f"with the MTP draft the KV cache holds {usable:,} tokens for one "
                       f"request, less than {cand.max_model_len:,} + {c.lookahead_tokens} "
                       "lookahead")
    return out


# ----------------------------------------------------------------------------- speed




# ----------------------------------------------------------------------------- decision


def decided(*, enabled: bool, k: int, method: str, pinned: bool,
            acceptance: Acceptance | None, cost: Cost | None, reason: Reason,
            options: tuple[dict[str, Any], ...] = (), equal_load: dict[str, Any] | None = None
            ) -> Speculative:
    """MTP as the plan carries it (deployment/plan.py `Speculative`, its fields declared there
    once): k and the tokens per step only when on, the acceptance and cost with their figures."""
    a = acceptance
    return Speculative(
        enabled=enabled, method=method or None, num_speculative_tokens=k if enabled else 0,
        pinned=pinned,
        acceptance=PlanAcceptance(a.first, a.later, a.source) if a else None,
        tokens_per_step=round(a.tokens_per_step(k), 3) if enabled and a and k else 1.0,
        cost_per_gpu=cost.to_dict() if cost else None, reason=reason, options=options,
        equal_load=equal_load)


def describe_cost(c: Cost) -> str:
    return (f"{c.weights_bytes / GiB:.2f} GiB of MTP weights, +{c.kv_bytes_per_token:,} B/token "
            f"of KV, {(c.activation_bytes + c.cudagraph_bytes) / MiB:,.0f} MiB of draft buffers "
            "and graphs per GPU")


def measured_acceptance(raw: dict[str, Any]) -> dict[str, float] | None:
    """What vLLM's benchmark measured (vllm/benchmarks/serve.py: spec_decode_acceptance_length,
    per_position_acceptance_rates), as the first draft's acceptance and the conditional
    acceptance of the later ones."""
    length = raw.get("spec_decode_acceptance_length")
    rates = raw.get("spec_decode_per_position_acceptance_rates") or raw.get(
        "per_position_acceptance_rates")
    if not length:
        return None
    out: dict[str, float] = {"acceptance_length": float(length)}
    if isinstance(rates, list) and rates:
        r = [float(x) / (100.0 if float(x) > 1 else 1.0) for x in rates]
        out["first"] = r[0]
        if len(r) > 1 and r[0] > 0:
            out["later"] = math.prod(r[i] / r[i - 1] for i in range(1, len(r)) if r[i - 1] > 0) \
                ** (1 / (len(r) - 1))
    return out
