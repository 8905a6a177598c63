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
import functools
from dataclasses import dataclass
from typing import Any

from ...deployment.plan import EPBackend, Reason, Serving, Speculative
from ...errors import InputError
from ..search import rank, search
from ..search.pins import Origin, origin_data, said
from ..speed import request_model as perf
from . import ep_backend, eplb, serving_flags, speculative


@dataclass
class DraftChoices:
    """The draft counts the search tries, and how MTP stands before any candidate is judged."""

    drafts: list[int]
    acceptance: speculative.Acceptance | None = None
    method: str = ""
    pinned_on: bool = False
    pinned_off: bool = False
    unsupported: Reason | None = None  # why no draft is possible here
    origin: Origin | None = None  # who pinned MTP (the user, or the emitted plan under --replan)


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
    names = [n for n, v in (("speculative", want), ("num_speculative_tokens", k_pin))
             if v is not None]
    origin: Origin | None = None if not names else (
        "plan" if names[0] in getattr(pins, "from_plan", frozenset()) else "you")
    ok, why, method = speculative.support(spec, hw, version)
    if not ok:
        return DraftChoices([0], pinned_on=pinned_on, unsupported=why, origin=origin)
    if want is False:
        return DraftChoices([0], method=method, pinned_off=True, origin=origin)
    acc = speculative.acceptance(getattr(pins, "mtp_acceptance", None), spec.name)
    ks = [k_pin] if k_pin else [int(x) for x in speculative.mtp_table()["candidates"]]
    return DraftChoices(ks if pinned_on else [0, *ks], acc, method, pinned_on, origin=origin)


def apply(plan: Any, pins: Any, goal: Any, res: Any, best: Any, mtp: DraftChoices) -> Serving:
    """The chosen candidate's serving features as the plan's `Serving`, each decision's reason
    data (mutates the plan's reasons and warnings: the same Reason objects, not copies)."""
    flags = serving_flags.decide(plan.model, plan.vllm_version,
                                 getattr(pins, "reasoning_parser", None),
                                 getattr(pins, "tool_call_parser", None),
                                 getattr(pins, "chat_template", None),
                                 getattr(pins, "from_plan", frozenset()))
    plan.reasons.extend(flags.parsers.reasons)
    plan.warnings.extend(flags.warnings)
    ep = ep_backend.NOT_APPLICABLE
    if best.fits:
        ep = _chosen_ep(best)
        if ep.reason is not None:
            plan.reasons.append(ep.reason)
    lb = best.eplb if best.fits else eplb.NONE
    if lb.reason is not None:
        plan.reasons.append(lb.reason)
    spec = decision(plan, goal, res, best, mtp)
    plan.reasons.append(spec.reason)
    return Serving(speculative=spec, parsers=flags.parsers, ep_backend=ep,
                   eplb=lb)


def _chosen_ep(best: Any) -> EPBackend:
    """The all-to-all the chosen candidate was judged with, and what the search then learnt of
    it: a backend whose buffers left nothing (`ep_note`) falls back to vLLM's default."""
    ep = best.ep
    if not ep.applies or ep.reason is None:
        return ep
    r = ep.reason
    if best.ep_note:
        return dataclasses.replace(
            ep, backend=ep.vllm_default, buffer_bytes_per_gpu=0, cuda_graphs=True,
            kubernetes=None, reason=Reason(
                "all2all.fell_back", f"{r.text}; but then {best.ep_note}: keeping vLLM's "
                f"default {ep.vllm_default} instead",
                {**r.data, "wanted": ep.backend, "backend": ep.vllm_default, "buffer_bytes": 0,
                 "cause": r.code}))
    return ep  # its reason already says what its buffers take from the KV cache


def decision(plan: Any, goal: Any, res: Any, best: Any, mtp: DraftChoices) -> Speculative:
    """MTP as the search decided it, with the figures that decided it."""
    pinned = mtp.pinned_on or mtp.pinned_off
    who = origin_data(mtp.origin)  # the reasons' `pinned` is the user's (`from_plan`: the plan's)
    off = functools.partial(speculative.decided, enabled=False, k=0, method=mtp.method,
                            pinned=pinned, acceptance=mtp.acceptance, cost=None)
    if mtp.unsupported is not None:
        u = mtp.unsupported
        if mtp.pinned_on:
            plan.warnings.append(Reason("mtp.unsupported", "MTP was asked for but is not "
                                        f"possible: {u.text}", {**u.data, "cause": u.code}))
        return off(reason=Reason("mtp.off.unsupported", f"MTP off: {u.text}",
                                 {**u.data, "cause": u.code, **who}))
    if mtp.pinned_off:
        assert mtp.origin is not None
        return off(reason=Reason("mtp.off.pinned", f"MTP off: {said(mtp.origin)} (--no-mtp)",
                                 who))
    if not best.fits:
        r = Reason("mtp.off.no_fit", "MTP off: no candidate fits" if not mtp.pinned_on else
                   "MTP off: no candidate with the draft fits ("
                   + ("pinned on by you" if mtp.origin == "you" else
                      f"on {said('plan')}") + ")", who)
        if mtp.pinned_on:
            plan.warnings.append(dataclasses.replace(r, code="mtp.no_fit"))
        return off(reason=r)
    options = []
    for k in mtp.drafts:
        j = max((x for x in res.judged if x.knobs.draft == k), key=lambda x: x.value,
                default=None)
        note: dict[str, Any] = {"num_speculative_tokens": k, "fits": j is not None}
        if k and mtp.acceptance is not None:
            note["tokens_per_step"] = round(mtp.acceptance.tokens_per_step(k), 3)
        if j is not None:
            note["kv_tokens"] = j.cand.tokens
            note["layout"] = j.cand.label()
            if j.perf is not None:  # the deciding figure's numbers, then its sentence
                note["single_request"] = j.perf.single.to_dict()
                note["knee"] = j.perf.knee.to_dict() if j.perf.knee else None
                note["figure"] = rank.figure(j.perf, goal.objective)
        options.append(note)
    off = functools.partial(off, options=tuple(options))
    k = best.knobs.draft
    offs = [x for x in res.judged if x.knobs.draft == 0]
    ons = [x for x in res.judged if x.knobs.draft]
    without = max(offs, key=lambda x: x.value, default=None)
    on = best if k else max(ons, key=lambda x: x.value, default=None)
    if not k:
        if best.perf is None:
            return off(reason=Reason(
                "mtp.off.no_prediction", "MTP off: no performance prediction on this hardware "
                "to show a gain; pin --mtp to use it", who))
        if on is None or on.perf is None:
            return off(reason=Reason("mtp.off.no_context", "MTP off: no candidate with the "
                                     "draft holds the context", who))
        search.finish(goal, on)
        gain = _gain(goal, on.perf, best.perf)
        margin = float(speculative.mtp_table()["margin"])
        what = ("verifying the drafts costs more than they save" if gain < 0
                else "too little gain for its memory")
        return off(reason=Reason(
            "mtp.off.gain",
            f"MTP off: its best ({on.knobs.draft} draft token(s), {on.cand.label()}): "
            f"{rank.headline(on.perf, goal.objective)} vs "
            f"{rank.headline(best.perf, goal.objective)} without ({gain:+.0%}); under the "
            f"{margin:.0%} margin ({what})",
            {**who, "draft_tokens": on.knobs.draft,
             "layout": on.cand.label(), "gain": round(gain, 4), "margin": margin,
             "objective": goal.objective}))
    acc = mtp.acceptance
    data: dict[str, Any] = {**who, "num_speculative_tokens": k,
                            "tokens_per_step": round(acc.tokens_per_step(k), 3),
                            "acceptance_first": acc.first, "acceptance_later": acc.later,
                            "objective": goal.objective}
    lead = f"MTP on ({said(mtp.origin) if mtp.origin else f'objective {goal.objective}'})"
    what = (f"{k} draft token(s), {acc.tokens_per_step(k):.2f} tokens per step at acceptance "
            f"{acc.first:.2f}/{acc.later:.2f}; cost {speculative.describe_cost(best.mtp)}")
    head = f"{lead}: {what}"
    on_ = functools.partial(speculative.decided, enabled=True, k=k, method=mtp.method,
                            pinned=pinned, acceptance=acc, cost=best.mtp,
                            options=tuple(options))
    if best.perf is None:
        return on_(reason=Reason("mtp.on", head, data))
    twin = _no_draft_twin(goal, best)
    parts = [head]
    equal_load = None
    if twin is not None and twin.perf is not None:
        # The gain MTP itself brings: the same requests in flight, the same flags, TPOT with
        # and without the draft. It leads; the knee's figure below mixes it with the SLO.
        a = best.perf
        n = a.knee.concurrency if a.knee else 1
        on_d = (a.knee or a.single).to_dict()  # the plan's own point: the JSON's figures
        off_d = perf.point(twin.perf.shape, goal.workload, n).to_dict()
        speedup = off_d["tpot_ms"] / on_d["tpot_ms"] if on_d["tpot_ms"] else 1.0
        equal_load = {"concurrency": on_d["concurrency"], "with": on_d, "without": off_d,
                      "speedup": round(speedup, 3)}
        data["equal_load_speedup"] = round(speedup, 3)
        parts[0] = f"{lead}: {speedup:.2f}x faster tokens at equal load, {what}"
        parts.append(f"at equal load ({n:,.0f} in flight, same flags without the draft): "
                     f"TPOT {on_d['tpot_ms']:.1f} vs {off_d['tpot_ms']:.1f} ms, "
                     f"{on_d['output_tokens_per_s']:,.0f} vs {off_d['output_tokens_per_s']:,.0f} "
                     "output tok/s")
    if without is not None and without.perf is not None:
        search.finish(goal, without)
        gain = _gain(goal, best.perf, without.perf)
        on_k, off_k = best.perf.knee, without.perf.knee
        data["knee_gain"] = round(gain, 4)
        why = (f": mostly the SLO's effect - faster tokens keep {on_k.concurrency:,.0f} "
               f"requests in flight within it where {off_k.concurrency:,.0f} fit without MTP"
               if on_k and off_k and on_k.concurrency != off_k.concurrency else "")
        parts.append(f"at the SLO knee: {rank.headline(best.perf, goal.objective)} vs "
                     f"{rank.headline(without.perf, goal.objective)} for the best plan without "
                     f"MTP ({without.cand.label()}, {gain:+.0%}){why}")
    parts.append("model only: vLLM's published MTP speed-ups (PR #13626, V0) check it at 1 and "
                 "8 in flight, and the acceptance is a default (vlaunch tune measures both)")
    return on_(reason=Reason("mtp.on", "; ".join(parts), data), equal_load=equal_load)


def _gain(goal: Any, a: Any, b: Any) -> float:
    sa, sb = a.score(goal.objective, goal.hw.count), b.score(goal.objective, goal.hw.count)
    return (sa - sb) / abs(sb) if sb else 0.0


def _no_draft_twin(goal: Any, j: Any) -> Any:
    """The chosen candidate's exact flags without the draft, judged (for equal-load figures)."""
    twin = search.memory(goal, dataclasses.replace(j.knobs, draft=0))
    return search.speed(goal, twin, full=False) if twin.fits else None
