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
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..inputs.hardware import GiB, Hardware, MiB
from ..inputs.model import ModelSpec
from ..paths import cache_dir, read_json_object, report_corrupt, update_json_object
from . import budget as B
from . import perf
from .mtp import Acceptance, draft_shape, speculative_shape  # noqa: F401 - re-exported
from .rebudget import rebudget
from .serving_flags import at_least, table

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
        return Acceptance(pinned, min(later, pinned), "your --mtp-acceptance")
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


def support(spec: ModelSpec, hw: Hardware, version: str) -> tuple[bool, str, str]:
    """(supported, reason, method name) for an MTP draft of `spec` on `hw` with `version`."""
    t = mtp_table()
    if not spec.mtp_layers:
        return False, f"{spec.name} stores no MTP layer (num_nextn_predict_layers is 0)", ""
    if not spec.architecture.startswith("deepseek"):
        return False, f"vlaunch models MTP for DeepSeek checkpoints, not {spec.architecture}", ""
    since = (t.get("min_version") or {}).get(spec.attention)
    if since is None:
        return False, f"no MTP support row for {spec.attention} attention", ""
    if not at_least(version, since):
        return False, f"vLLM {version} cannot load a {spec.attention} MTP draft (since {since})", ""
    for row in t.get("platforms", ()):
        if row["platform"] == hw.kind.platform:
            if not row["supported"]:
                return False, row["reason"], ""
            break
    else:
        return False, f"no MTP support row for the {hw.kind.platform} platform", ""
    method = next(r["method"] for r in t["methods"] if at_least(version, r["since"]))
    return True, "", method


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
    the rest of the checkpoint (budget.checkpoint_scale)."""
    total = sum(B.tensor_bytes(t, spec.quant, spec.dtype_bytes)
                * B.shard_fraction(t, layout, spec.vocab_size)
                for t in _mtp_tensors(spec, layout))
    return round(total * B.checkpoint_scale(spec))


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


def reassess(a: Any, shape: perf.EngineShape, workload: Any, slo: Any,
             concurrency: int | None) -> Any:
    """perfplan.assess's prediction for a changed engine shape (same candidate)."""
    from .perfplan import assessment_for

    return assessment_for(shape, workload, slo, concurrency, a.source, list(a.notes),
                          a.candidate)


# ----------------------------------------------------------------------------- decision


@dataclass
class Decision:
    enabled: bool = False
    k: int = 0
    method: str = ""
    pinned: bool = False
    acceptance: Acceptance | None = None
    cost: Cost | None = None
    reason: str = ""
    figure_on: str = ""
    figure_off: str = ""
    options: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.acceptance.tokens_per_step(self.k) if self.acceptance and self.k else 1.0

    def config_json(self) -> str:
        return json.dumps({"method": self.method, "num_speculative_tokens": self.k},
                          separators=(",", ":"))

    def vllm_args(self) -> list[str]:
        return ["--speculative-config", self.config_json()] if self.enabled else []

    def to_dict(self) -> dict[str, Any]:
        a = self.acceptance
        return {"enabled": self.enabled, "method": self.method or None,
                "num_speculative_tokens": self.k if self.enabled else 0,
                "pinned": self.pinned,
                "acceptance": {"first": a.first, "later": a.later, "source": a.source}
                if a else None,
                "tokens_per_step": round(self.tokens_per_step, 3) if self.enabled else 1.0,
                "cost_per_gpu": self.cost.to_dict() if self.cost else None,
                "reason": self.reason, "options": self.options}


def describe_cost(c: Cost) -> str:
    return (f"{c.weights_bytes / GiB:.2f} GiB of MTP weights, +{c.kv_bytes_per_token:,} B/token "
            f"of KV, {(c.activation_bytes + c.cudagraph_bytes) / MiB:,.0f} MiB of draft buffers "
            "and graphs per GPU")


def decide(plan: Any, pins: Any, concurrency: int | None = None) -> Decision:
    """Turn MTP on where the objective's figure gains at least the table's margin; a pin
    (--mtp / --no-mtp / --num-speculative-tokens) wins. Mutates the plan's chosen candidate
    and performance when MTP is on."""
    spec, hw, c = plan.model, plan.hardware, plan.chosen
    want = getattr(pins, "speculative", None)
    k_pin = getattr(pins, "num_speculative_tokens", None)
    if k_pin is not None and k_pin < 1:
        raise InputError(f"--num-speculative-tokens must be at least 1, got {k_pin}")
    if k_pin is not None and want is False:
        raise InputError("--no-mtp and --num-speculative-tokens contradict each other; "
                         "drop one")
    pinned_on = want is True or k_pin is not None
    ok, why, method = support(spec, hw, plan.vllm_version)
    d = Decision(method=method, pinned=want is not None or k_pin is not None)
    if not ok:
        d.reason = f"MTP off: {why}"
        if pinned_on:
            plan.warnings.append(f"MTP was asked for but is not possible: {why}")
        return d
    if want is False:
        d.reason = "MTP off: pinned by you (--no-mtp)"
        return d
    if not c.fits:
        d.reason = "MTP off: the plan does not fit without it"
        return d
    acc = acceptance(getattr(pins, "mtp_acceptance", None), spec.name)
    d.acceptance = acc
    ks = [k_pin] if k_pin else [int(x) for x in mtp_table()["candidates"]]
    a_off = plan.performance
    best: tuple[float, int, Any, Any, Cost] | None = None
    objective, gpus = plan.objective, hw.count
    for k in ks:
        cst = cost(spec, c, k)
        cand = with_draft(spec, c, cst, plan.kv_pinned,
                          getattr(pins, "kv_cache_memory_bytes", None))
        note = {"num_speculative_tokens": k, "tokens_per_step": round(acc.tokens_per_step(k), 3),
                "kv_tokens": cand.tokens, "fits": cand.fits}
        if not cand.fits or cand.tokens < 1:
            note["why_not"] = cand.problem
            d.options.append(note)
            continue
        a_on = None
        if a_off is not None and plan.workload is not None:
            shape = dataclasses.replace(a_off.shape, kv_tokens=cand.tokens,
                                        kv_bytes_per_token=cand.kv_bytes_per_token)
            a_on = reassess(a_off, speculative_shape(spec, shape, c.layout, c.kv_dtype, k, acc),
                            plan.workload, plan.slo, concurrency)
            a_on.candidate = cand
            note["figure"] = a_on.figure(objective)
            score = a_on.score(objective, gpus)
        else:
            score = float("-inf")
        d.options.append(note)
        if best is None or score > best[0]:
            best = (score, k, cand, a_on, cst)
    if best is None:
        d.reason = ("MTP off: the draft's memory would leave less than one request at "
                    f"{c.max_model_len:,} tokens" + (" (pinned on by you)" if pinned_on else ""))
        if pinned_on:
            plan.warnings.append(d.reason)
        return d
    score, k, cand, a_on, cst = best
    d.cost = cst
    if a_off is not None and a_on is not None:
        s_off = a_off.score(objective, gpus)
        gain = (score - s_off) / abs(s_off) if s_off else 0.0
        d.figure_on, d.figure_off = a_on.figure(objective), a_off.figure(objective)
        margin = float(mtp_table()["margin"])
        numbers = (f"with {k} draft token(s) ({acc.tokens_per_step(k):.2f} tokens per step at "
                   f"acceptance {acc.first:.2f}/{acc.later:.2f}): {d.figure_on}; without: "
                   f"{d.figure_off} ({gain:+.0%}); cost {describe_cost(cst)}, KV "
                   f"{c.tokens:,} -> {cand.tokens:,} tokens")
        if not pinned_on and gain < margin:
            d.cost, d.k = None, 0
            what = ("verifying the drafts costs more than they save" if gain < 0
                    else "too little gain for its memory")
            d.reason = f"MTP off: {numbers}; under the {margin:.0%} margin ({what})"
            return d
        d.reason = (f"MTP on ({'pinned by you' if pinned_on else f'objective {objective}'}): "
                    f"{numbers}; model only: no published vLLM MTP measurement checks this "
                    "speed-up and the acceptance is a default (vlaunch tune measures both)")
    elif not pinned_on:
        d.reason = ("MTP off: no performance prediction on this hardware to show a gain; "
                    "pin --mtp to use it")
        return d
    else:
        d.reason = (f"MTP on (pinned by you): {k} draft token(s); cost {describe_cost(cst)}, "
                    f"KV {c.tokens:,} -> {cand.tokens:,} tokens")
    d.enabled, d.k = True, k
    if a_on is not None:
        cand, a_on = _recap(plan, pins, c, cand, a_on, cst, acc, concurrency, d)
    _apply(plan, cand, a_on)
    return d


def _recap(plan: Any, pins: Any, c: Any, cand: Any, a_on: Any, cst: Cost, acc: Acceptance,
           concurrency: int | None, d: Decision) -> tuple[Any, Any]:
    """balanced/latency cap max_num_seqs at the SLO knee (planner._tune_batch); MTP moves the
    knee, so the cap is set again at the knee of the engine with the draft, the candidate
    re-budgeted at that cap (planner.evaluate: the sampler and graphs depend on it)."""
    from . import perfplan
    from .capabilities import batch_defaults, version_traits
    from .planner import evaluate

    spec, hw = plan.model, plan.hardware
    if getattr(pins, "max_num_seqs", None) or plan.objective not in ("balanced", "latency") \
            or hw.is_cpu or plan.workload is None:
        return cand, a_on
    L = c.layout
    d_seqs = batch_defaults(hw, L.tp * L.pp)[1]
    free = reassess(a_on, dataclasses.replace(
        a_on.shape, max_num_seqs=max(1, min(d_seqs, c.max_num_batched_tokens // (1 + cst.k)))),
        plan.workload, plan.slo, concurrency)
    cap = perfplan.knee_seqs(free)
    if cap is None or cap == c.max_num_seqs:
        return cand, a_on
    tokens = max(c.max_num_batched_tokens, cap)
    traits = version_traits(plan.vllm_version)
    base = evaluate(spec, hw, L, c.kv_dtype, c.utilization, traits,
                    dataclasses.replace(pins, max_num_seqs=cap, max_num_batched_tokens=tokens,
                                        max_model_len=c.max_model_len),
                    plan.chunked_prefill)
    if not base.fits:
        return cand, a_on
    new_cost = cost(spec, base, cst.k)
    new = with_draft(spec, base, new_cost, plan.kv_pinned,
                     getattr(pins, "kv_cache_memory_bytes", None))
    if not new.fits:
        return cand, a_on
    shape = speculative_shape(spec, dataclasses.replace(
        a_on.shape, kv_tokens=new.tokens, kv_bytes_per_token=new.kv_bytes_per_token,
        max_num_seqs=cap, max_num_batched_tokens=tokens, spec_tokens=0, spec_yield=1.0,
        draft=None), L, c.kv_dtype, cst.k, acc)
    capped = reassess(a_on, shape, plan.workload, plan.slo, concurrency)
    capped.candidate = new
    if free.knee is not None:  # the service at the knee; beyond it requests queue
        capped.knee = perf.point(shape, plan.workload, free.knee.concurrency)
        if not concurrency:
            capped.at = capped.knee
        capped.curve = perf.curve(shape, plan.workload, tuple(
            x for x in (free.knee.concurrency, concurrency) if x))
        capped.binding = free.binding
    d.cost = new_cost
    d.reason += (f"; max-num-seqs {cap:,} per engine: the SLO knee with the draft (it was "
                 f"{c.max_num_seqs:,} without)")
    return new, capped


def _apply(plan: Any, cand: Any, a_on: Any) -> None:
    """The plan now runs the candidate with the draft, and predicts its speed."""
    plan.chosen = cand
    if a_on is not None:
        plan.assessments[id(cand)] = a_on
        plan.performance = a_on


def from_plan(d: dict[str, Any]) -> dict[str, Any]:
    """Pins that reproduce an emitted plan's MTP decision (`vlaunch exec`, tune)."""
    s = (d.get("serving") or {}).get("speculative") or {}
    if not s:
        return {}
    if not s.get("enabled"):
        return {"speculative": False}
    out: dict[str, Any] = {"speculative": True,
                           "num_speculative_tokens": int(s["num_speculative_tokens"])}
    acc = s.get("acceptance") or {}
    if acc.get("source") == "your --mtp-acceptance":
        out["mtp_acceptance"] = float(acc["first"])
    return out


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
