"""The serving features of a plan: parsers, the EP all-to-all backend and MTP.

The parsers change no memory and are decided here on the chosen plan. The all-to-all backend
and MTP's draft change memory and speed, so the search judges them inside every candidate
(`search.memory` takes their buffers and the draft from the KV cache); this module says which
drafts the search tries (`draft_choices`) and, once the search has ranked its candidates, turns
the chosen one's backend and draft into flags and reasons with the figures of the judged
candidates - MTP's benefit at equal load and, separately, at the SLO knee.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...deployment.plan import Reason
from ...errors import InputError
from ...inputs.hardware import GiB
from ..search import rank, search
from ..speed import request_model as perf
from . import ep_backend, eplb, serving_flags, speculative


@dataclass
class Serving:
    parsers: serving_flags.ServingFlags = field(default_factory=serving_flags.ServingFlags)
    ep: ep_backend.Choice = field(default_factory=ep_backend.Choice)
    mtp: speculative.Decision = field(default_factory=speculative.Decision)
    eplb: eplb.Decision = field(default_factory=eplb.Decision)

    def env(self) -> dict[str, str]:
        return self.ep.env()

    def to_dict(self) -> dict[str, Any]:
        return {"speculative": self.mtp.to_dict(), "parsers": self.parsers.to_dict(),
                "ep_backend": self.ep.to_dict(), "eplb": self.eplb.to_dict()}


@dataclass
class DraftChoices:
    """The draft counts the search tries, and how MTP stands before any candidate is judged."""

    drafts: list[int]
    acceptance: speculative.Acceptance | None = None
    method: str = ""
    pinned_on: bool = False
    pinned_off: bool = False
    unsupported: str = ""


def draft_choices(spec: Any, hw: Any, pins: Any, version: str) -> DraftChoices:
    """0 (no MTP) and the table's draft counts, unless a pin or the platform decides."""
    want = getattr(pins, "speculative", None)
    k_pin = getattr(pins, "num_speculative_tokens", None)
    if k_pin is not None and k_pin < 1:
        raise InputError(f"--num-speculative-tokens must be at least 1, got {k_pin}")
    if k_pin is not None and want is False:
        raise InputError("--no-mtp and --num-speculative-tokens contradict each other; "
                         "drop one")
    pinned_on = want is True or k_pin is not None
    ok, why, method = speculative.support(spec, hw, version)
    if not ok:
        return DraftChoices([0], pinned_on=pinned_on, unsupported=why)
    if want is False:
        return DraftChoices([0], method=method, pinned_off=True)
    acc = speculative.acceptance(getattr(pins, "mtp_acceptance", None), spec.name)
    ks = [k_pin] if k_pin else [int(x) for x in speculative.mtp_table()["candidates"]]
    return DraftChoices(ks if pinned_on else [0, *ks], acc, method, pinned_on)


def apply(plan: Any, pins: Any, goal: Any, res: Any, best: Any, mtp: DraftChoices) -> Serving:
    """The chosen candidate's serving features as flags and reasons (mutates the plan's
    reasons and warnings)."""
    s = Serving()
    s.parsers = serving_flags.decide(plan.model, plan.vllm_version,
                                     getattr(pins, "reasoning_parser", None),
                                     getattr(pins, "tool_call_parser", None),
                                     getattr(pins, "chat_template", None))
    pinned = s.parsers.source == "pinned"
    plan.reasons.extend(Reason("parsers", r, {"pinned": pinned}) for r in s.parsers.reasons)
    plan.warnings.extend(Reason("parsers.missing", w) for w in s.parsers.warnings)
    if best.fits:
        s.ep = dataclasses.replace(best.ep)
        if s.ep.applies and best.ep_note:
            s.ep.reason += (f"; but then {best.ep_note}: keeping vLLM's default {s.ep.default} "
                            "instead")
            s.ep.backend, s.ep.buffer_bytes, s.ep.cuda_graphs, s.ep.kubernetes = (
                s.ep.default, 0, True, {})
        elif s.ep.applies and s.ep.buffer_bytes:
            s.ep.reason += f" ({s.ep.buffer_bytes / GiB:.2f} GiB of buffers per GPU, taken " \
                           "from the KV cache)"
        if s.ep.reason:
            plan.reasons.append(Reason("all2all_backend", s.ep.reason,
                                       {"backend": s.ep.backend, "pinned": s.ep.pinned,
                                        "buffer_bytes": s.ep.buffer_bytes}))
    if best.fits:
        s.eplb = dataclasses.replace(best.eplb)
        if (r := s.eplb.reason()) is not None:
            plan.reasons.append(r)
    s.mtp = decision(plan, goal, res, best, mtp)
    if s.mtp.reason:
        plan.reasons.append(Reason("mtp.on" if s.mtp.enabled else "mtp.off", s.mtp.reason,
                                   {"num_speculative_tokens": s.mtp.k if s.mtp.enabled else 0,
                                    "pinned": s.mtp.pinned}))
    return s


def decision(plan: Any, goal: Any, res: Any, best: Any, mtp: DraftChoices
             ) -> speculative.Decision:
    """MTP as the search decided it, with the figures that decided it."""
    d = speculative.Decision(method=mtp.method, pinned=mtp.pinned_on or mtp.pinned_off,
                             acceptance=mtp.acceptance)
    if mtp.unsupported:
        d.reason = f"MTP off: {mtp.unsupported}"
        if mtp.pinned_on:
            plan.warnings.append(Reason("mtp.unsupported", "MTP was asked for but is not "
                                        f"possible: {mtp.unsupported}"))
        return d
    if mtp.pinned_off:
        d.reason = "MTP off: pinned by you (--no-mtp)"
        return d
    if not best.fits:
        d.reason = ("MTP off: no candidate fits" if not mtp.pinned_on else
                    "MTP off: no candidate with the draft fits (pinned on by you)")
        if mtp.pinned_on:
            plan.warnings.append(Reason("mtp.no_fit", d.reason))
        return d
    for k in mtp.drafts:
        j = max((x for x in res.judged if x.knobs.draft == k), key=lambda x: x.value,
                default=None)
        note: dict[str, Any] = {"num_speculative_tokens": k, "fits": j is not None}
        if k and mtp.acceptance is not None:
            note["tokens_per_step"] = round(mtp.acceptance.tokens_per_step(k), 3)
        if j is not None:
            note["kv_tokens"] = j.cand.tokens
            note["layout"] = j.cand.label()
            if j.perf is not None:
                note["figure"] = rank.figure(j.perf, goal.objective)
        d.options.append(note)
    k = best.knobs.draft
    offs = [x for x in res.judged if x.knobs.draft == 0]
    ons = [x for x in res.judged if x.knobs.draft]
    off = max(offs, key=lambda x: x.value, default=None)
    on = best if k else max(ons, key=lambda x: x.value, default=None)
    if not k:
        if on is None or on.perf is None or best.perf is None:
            d.reason = ("MTP off: no performance prediction on this hardware to show a gain; "
                        "pin --mtp to use it" if best.perf is None else
                        "MTP off: no candidate with the draft holds the context")
            return d
        search.finish(goal, on)
        gain = _gain(goal, on.perf, best.perf)
        margin = float(speculative.mtp_table()["margin"])
        what = ("verifying the drafts costs more than they save" if gain < 0
                else "too little gain for its memory")
        d.reason = (f"MTP off: its best ({on.knobs.draft} draft token(s), {on.cand.label()}): "
                    f"{rank.headline(on.perf, goal.objective)} vs "
                    f"{rank.headline(best.perf, goal.objective)} "
                    f"without ({gain:+.0%}); under the {margin:.0%} margin ({what})")
        return d
    d.enabled, d.k, d.cost = True, k, best.mtp
    acc = mtp.acceptance
    head = (f"MTP on ({'pinned by you' if mtp.pinned_on else f'objective {goal.objective}'}): "
            f"{k} draft token(s), {acc.tokens_per_step(k):.2f} tokens per step at acceptance "
            f"{acc.first:.2f}/{acc.later:.2f}; cost {speculative.describe_cost(best.mtp)}")
    if best.perf is None:
        d.reason = head
        return d
    twin = _no_draft_twin(goal, best)
    parts = [head]
    if twin is not None and twin.perf is not None:
        # The gain MTP itself brings: the same requests in flight, the same flags, TPOT with
        # and without the draft. It leads; the knee's figure below mixes it with the SLO.
        a = best.perf
        n = a.knee.concurrency if a.knee else 1
        on_d = (a.knee or a.single).to_dict()  # the plan's own point: the JSON's figures
        off_d = perf.point(twin.perf.shape, goal.workload, n).to_dict()
        d.equal_load = {"concurrency": on_d["concurrency"], "with": on_d, "without": off_d}
        speedup = off_d["tpot_ms"] / on_d["tpot_ms"] if on_d["tpot_ms"] else 1.0
        d.equal_load["speedup"] = round(speedup, 3)
        parts[0] = head.replace(": ", f": {speedup:.2f}x faster tokens at equal load, ", 1)
        parts.append(f"at equal load ({n:,.0f} in flight, same flags without the draft): "
                     f"TPOT {on_d['tpot_ms']:.1f} vs {off_d['tpot_ms']:.1f} ms, "
                     f"{on_d['output_tokens_per_s']:,.0f} vs {off_d['output_tokens_per_s']:,.0f} "
                     "output tok/s")
    if off is not None and off.perf is not None:
        search.finish(goal, off)
        gain = _gain(goal, best.perf, off.perf)
        on_k, off_k = best.perf.knee, off.perf.knee
        why = (f": mostly the SLO's effect - faster tokens keep {on_k.concurrency:,.0f} "
               f"requests in flight within it where {off_k.concurrency:,.0f} fit without MTP"
               if on_k and off_k and on_k.concurrency != off_k.concurrency else "")
        parts.append(f"at the SLO knee: {rank.headline(best.perf, goal.objective)} vs "
                     f"{rank.headline(off.perf, goal.objective)} for the best plan without MTP "
                     f"({off.cand.label()}, {gain:+.0%}){why}")
    parts.append("model only: vLLM's published MTP speed-ups (PR #13626, V0) check it at 1 and "
                 "8 in flight, and the acceptance is a default (vlaunch tune measures both)")
    d.reason = "; ".join(parts)
    return d


def _gain(goal: Any, a: Any, b: Any) -> float:
    sa, sb = a.score(goal.objective, goal.hw.count), b.score(goal.objective, goal.hw.count)
    return (sa - sb) / abs(sb) if sb else 0.0


def _no_draft_twin(goal: Any, j: Any) -> Any:
    """The chosen candidate's exact flags without the draft, judged (for equal-load figures)."""
    twin = search.memory(goal, dataclasses.replace(j.knobs, draft=0))
    return search.speed(goal, twin, full=False) if twin.fits else None
