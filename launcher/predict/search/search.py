"""The search: explicit candidates, each judged for memory and speed at exactly its own flags.

A candidate is a `Knobs`: the parallel layout, KV dtype, max-model-len, max-num-batched-tokens,
max-num-seqs, chunked prefill and MTP draft tokens. `judge` runs the budget model on exactly
those flags (the EP all-to-all backend's buffers and the draft's memory included) and then the
performance model on the engine those flags start - never a figure borrowed from a neighbour.

The search prunes by memory first (what does not fit, or cannot hold one request of the
workload, is never timed), then ranks the rest under one set of conditions (the same workload,
SLO and concurrency for all; `rank.value`). For the balanced and latency objectives
max-num-seqs is capped at each candidate's SLO knee, and the capped candidate is judged again at
its own flags. Nothing here imports the planner: the planner composes this module.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ...deployment.plan import EPLB, EPBackend
from ...inputs.hardware import Hardware
from ...inputs.model import ModelSpec
from ...inputs.workload import SLO, Workload
from ..features import ep_backend, eplb, speculative
from ..features.capabilities import VersionTraits, batch_defaults
from ..memory import budget as B
from ..memory.candidate_memory import Candidate, evaluate, layouts
from ..memory.kv_recut import rebudget
from ..speed import request_model as perf
from ..speed import speed_decisions as perfplan
from .pins import Pins
from .rank import context_rank, value

CHUNK_CHOICES = (2048, 4096, 8192, 16384)
"""max-num-batched-tokens the search tries with chunked prefill (vLLM's default added); those
below the engine's max-num-seqs are skipped (vLLM refuses them). Small chunks keep a mixed
step short (TPOT) at the cost of more steps per prompt (TTFT)."""

LEAN_SEQS = (256, 128, 64, 32, 16)
"""max-num-seqs tried below vLLM's default only when the default cannot reach the target
context: fewer sequences shrink the sampler's buffers and CUDA graphs, leaving KV memory."""


@dataclass(frozen=True)
class Knobs:
    """One candidate: every decision that changes memory or speed (None: vLLM's default)."""

    layout: B.Layout
    kv_dtype: str
    max_model_len: int | None
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    chunked: bool
    draft: int = 0


@dataclass
class Goal:
    """The conditions every candidate is judged under (the same for all of them)."""

    spec: ModelSpec
    hw: Hardware
    pins: Pins
    traits: VersionTraits
    util: float
    workload: Workload
    slo: SLO
    objective: str
    concurrency: int | None
    chunked: bool
    kv_pinned: bool
    dtypes: list[str]
    drafts: list[int]
    acceptance: Any = None  # speculative.Acceptance when drafts are searched
    mtp_pinned: bool = False
    _ep: dict[B.Layout, EPBackend] = field(default_factory=dict)
    _constants: dict[tuple, Any] = field(default_factory=dict)
    _memory: dict[Knobs, Candidate] = field(default_factory=dict)
    counts: list[int] = field(default_factory=lambda: [0, 0])  # judged for memory, for speed

    def ep(self, layout: B.Layout) -> EPBackend:
        """The all-to-all backend a layout would run (decided per layout, once)."""
        if layout not in self._ep:
            self._ep[layout] = ep_backend.choose(self.spec, self.hw, layout, self.objective,
                                                 self.workload, self.traits.version,
                                                 self.pins.all2all_backend,
                                                 "all2all_backend" in self.pins.from_plan)
        return self._ep[layout]


@dataclass
class Judged:
    """A candidate with its verdicts: memory (`cand`) and speed (`perf`), both at its flags."""

    knobs: Knobs
    cand: Candidate
    perf: Any = None  # perfplan.Assessment
    ep: EPBackend = ep_backend.NOT_APPLICABLE
    ep_note: str = ""  # why the backend's buffers were not taken, when they were not
    eplb: EPLB = eplb.NONE
    mtp: speculative.Cost | None = None
    value: tuple = ()
    capped_from: int | None = None  # max-num-seqs before the cap at the SLO knee
    trimmed_from: int | None = None  # max-num-seqs before the KV-bound trim (throughput)

    @property
    def fits(self) -> bool:
        return self.cand.fits


@dataclass
class Result:
    judged: list[Judged]  # every candidate timed, best first
    misfits: list[Judged]  # the best misfit of each layout (for the why-not)
    fitting: list[Judged]  # every candidate that fits, longest context first (timed or not)
    count: int  # candidates judged for memory
    timed: int  # of those, judged for speed


def memory(goal: Goal, k: Knobs) -> Judged:
    """The budget model at exactly `k`'s flags: the candidate, then the EP backend's buffers,
    the MTP draft's weights, buffers, graphs and KV layer, and EPLB's redundant experts, each
    taken from the KV cache."""
    goal.counts[0] += 1
    pins = dataclasses.replace(goal.pins, max_model_len=k.max_model_len,
                               max_num_batched_tokens=k.max_num_batched_tokens,
                               max_num_seqs=k.max_num_seqs)
    key = dataclasses.replace(k, draft=0)
    if key not in goal._memory:  # a draft variant starts from its plain candidate's budget
        goal._memory[key] = evaluate(goal.spec, goal.hw, k.layout, k.kv_dtype, goal.util,
                                     goal.traits, pins, k.chunked)
    c = dataclasses.replace(goal._memory[key], cache=dict(goal._memory[key].cache))
    j = Judged(k, c)
    if not c.fits:
        return j
    ep = goal.ep(k.layout)
    j.ep = ep
    if ep.applies and ep.backend is None:
        c.fits, c.problem = False, ep.reason.text if ep.reason else "no all-to-all backend"
        return j
    if ep.applies and (ep.buffer_bytes_per_gpu or not ep.cuda_graphs):
        new = rebudget(goal.spec, c, goal.kv_pinned, d_non_torch=ep.buffer_bytes_per_gpu,
                       d_cudagraph=0 if ep.cuda_graphs else -c.cudagraph,
                       pinned_bytes=goal.pins.kv_cache_memory_bytes)
        if new.fits:
            c = j.cand = new
        else:  # the planner keeps vLLM's default backend for this layout
            j.ep_note = new.problem
    if k.draft:
        cost = speculative.cost(goal.spec, c, k.draft)
        c = j.cand = speculative.with_draft(goal.spec, c, cost, goal.kv_pinned,
                                            goal.pins.kv_cache_memory_bytes)
        j.mtp = cost
        if not c.fits:
            return j
    # last, so its before/after KV figures are the plan's own (the draft's memory already out)
    j.eplb, after = _eplb(goal, k, c, ep)
    if eplb.blocked(j.eplb, goal.pins.eplb):
        c.fits, c.problem = False, eplb.problem(j.eplb)
    elif j.eplb.enabled:  # the redundant experts' weights come off the KV cache
        j.cand = after
    return j


def _eplb(goal: Goal, k: Knobs, c: Candidate, ep: EPBackend
          ) -> tuple[EPLB, Candidate]:
    """EPLB for `k`'s layout (features/eplb.py): proposed, then settled against the candidate
    with the redundant experts' bytes taken from its KV cache (one stage: EPLB needs PP 1).
    Returns the decision and the candidate it leaves (`c` itself when EPLB is off)."""
    d = eplb.propose(goal.spec, goal.hw, k.layout, goal.traits.version, goal.pins.eplb,
                     ep.backend if ep.applies else None, goal.pins.origin("eplb"))
    if not d.enabled:
        return d, c
    after = rebudget(goal.spec, c, goal.kv_pinned, extra_weights_last=d.bytes_per_gpu,
                     pinned_bytes=goal.pins.kv_cache_memory_bytes)
    return eplb.settle(d, c, after, goal.workload, goal.pins.origin("eplb")), after


def speed(goal: Goal, j: Judged, full: bool = True) -> Judged:
    """The performance model on the engine `j`'s flags start (the draft included). `full`:
    the curve and binding too; without it only the knee and one request alone (what ranking
    reads) - `finish` completes the candidates that are shown."""
    goal.counts[1] += 1
    c, k = j.cand, j.knobs
    key = (k.layout, k.kv_dtype)
    if key not in goal._constants:  # calibration is per layout and KV dtype: read it once
        goal._constants[key] = perfplan._constants_for(goal.spec, goal.hw, c,
                                                       goal.traits.version)
    constants, source, notes = goal._constants[key]
    shape = perf.engine_shape(goal.spec, goal.hw, k.layout, c.kv_bytes_per_token, c.tokens,
                              c.max_num_seqs, c.max_num_batched_tokens, k.chunked, constants,
                              v0=goal.traits.engine == "v0")
    if shape is not None and k.draft:
        shape = speculative.speculative_shape(goal.spec, shape, k.layout, k.kv_dtype, k.draft,
                                              goal.acceptance)
    if shape is None:
        j.perf = None
    elif full:
        j.perf = perfplan.assessment_for(shape, goal.workload, goal.slo, goal.concurrency,
                                         source, notes, c)
    else:
        w = goal.workload
        # latency ranks on one request alone; its knee is found when the candidate is shown
        knee = None if goal.objective == "latency" else perf.knee(shape, w, goal.slo)
        single = perf.point(shape, w, 1)
        j.perf = perfplan.Assessment(shape, knee, knee or single, [], "", single, source, notes,
                                     c)
    j.value = value(j, goal)
    return j


def _with_binding(goal: Goal, j: Judged) -> Any:
    """The knee and what binds there (all a cap needs), without the curve."""
    a = j.perf
    if a is None:
        return None
    if not a.binding:
        w = goal.workload
        if a.knee is None and goal.objective == "latency":
            a.knee = perf.knee(a.shape, w, goal.slo)
        a.binding = perf.binding(a.shape, w, a.knee, goal.slo)
    return a


def finish(goal: Goal, j: Judged) -> Judged:
    """The full assessment (curve, binding, the asked concurrency) of a candidate shown."""
    if j.perf is not None and not j.perf.curve and j.perf.shape is not None:
        a = j.perf
        j.perf = perfplan.assessment_for(a.shape, goal.workload, goal.slo, goal.concurrency,
                                         a.source, a.notes, j.cand)
    return j


def serves(goal: Goal, j: Judged) -> bool:
    """Fits, and one request of the workload fits its context."""
    w = goal.workload
    return j.fits and j.cand.max_model_len >= w.input_len + w.output_len


def _token_choices(goal: Goal, layout: B.Layout) -> list[int | None]:
    p = goal.pins
    if p.max_num_batched_tokens:
        return [p.max_num_batched_tokens]
    if not goal.chunked or goal.hw.is_cpu:
        return [None]
    default, seqs = batch_defaults(goal.hw, layout.tp * layout.pp, goal.traits.version)
    seqs = p.max_num_seqs or seqs
    # a chunk well past the prompt changes no step (one chunk a prompt either way) but takes
    # activation memory: chunks beyond the first that holds twice the prompt are dominated
    enough = next((c for c in CHUNK_CHOICES if c >= 2 * goal.workload.input_len),
                  CHUNK_CHOICES[-1])
    return sorted({c for c in CHUNK_CHOICES if seqs <= c <= enough} | {default})


LAYOUT_PRUNE = 0.5
"""A layout whose best plain candidate scores under this share of the best layout's, and is not
among the SHOWN best, is not varied further (its drafts are never judged)."""

SHOWN = 6
"""The chosen layout and the runner-ups the plan shows: always varied in full, so each is shown
at its best version."""

TOKEN_KEEP = 3
"""Chunk sizes of each layout and KV dtype that carry on to the draft variants: a draft moves
the best chunk (its verified tokens share the token budget and the TTFT a prompt's chunks
set), so the best three plain ones are varied (R1 on 8xH200 at 8,192 / 256: 2,048 with two
drafts beats 8,192 with one, though 8,192 is the best chunk without MTP)."""


def search(goal: Goal) -> Result:
    """Judge every candidate; the fitting ones best first.

    1. memory: every layout x KV dtype x chunk size (and leaner batches when vLLM's default
       batch cannot reach the context); what does not fit or hold one request stops here;
    2. context: only candidates at the longest context (up to the target) are timed;
    3. speed: each timed at its knee; layouts far behind the best are not varied further;
    4. drafts: MTP variants of each layout's best chunk sizes, judged from scratch;
    5. balanced/latency: each layout's best capped at its own SLO knee, judged again.
    """
    p, spec = goal.pins, goal.spec
    fitting: list[Judged] = []
    misfit: dict[B.Layout, Judged] = {}
    target = p.max_model_len or spec.max_context

    def keep(j: Judged) -> None:
        if serves(goal, j):
            fitting.append(j)
            return
        if j.fits:  # fits but cannot hold one request of the workload
            j.cand.fits = False
            j.cand.problem = (f"its {j.cand.max_model_len:,}-token context is shorter than one "
                              f"request of the workload")
        old = misfit.get(j.knobs.layout)
        if old is None or j.cand.max_model_len > old.cand.max_model_len:
            misfit[j.knobs.layout] = j

    for L in layouts(spec, goal.hw, p, goal.traits):
        for dtype in goal.dtypes:
            for tokens in _token_choices(goal, L):
                first = 0 if 0 in goal.drafts else goal.drafts[0]
                base = memory(goal, Knobs(L, dtype, p.max_model_len, tokens, p.max_num_seqs,
                                          goal.chunked, first))
                keep(base)
                if p.max_num_seqs is None and (not base.cand.fits
                                               or base.cand.max_model_len < target):
                    # vLLM's default batch cannot reach the context: try leaner ones
                    for lean in LEAN_SEQS:
                        if lean < base.cand.max_num_seqs and (tokens or lean) >= lean:
                            keep(memory(goal, Knobs(L, dtype, p.max_model_len, tokens, lean,
                                                    goal.chunked, first)))
    timed = [speed(goal, j, full=False) for j in _longest(fitting, target)]
    drafts = [d for d in goal.drafts if d and d != (0 if 0 in goal.drafts else goal.drafts[0])]
    if drafts and timed:
        top = max(j.value[2] for j in timed)
        best_of: dict[B.Layout, float] = {}
        for j in timed:
            best_of[j.knobs.layout] = max(best_of.get(j.knobs.layout, -math.inf), j.value[2])
        ranked = sorted(best_of, key=best_of.get, reverse=True)
        kept = {L for L, v in best_of.items() if _close(v, top)} | set(ranked[:SHOWN])
        seeds = _seeds(timed, kept)
        extra = []
        for j0 in seeds:
            for d in drafts:
                j = memory(goal, dataclasses.replace(j0.knobs, draft=d))
                n = len(fitting)
                keep(j)
                if len(fitting) > n:
                    extra.append(j)
        top = context_rank(timed[0].cand.max_model_len, target)
        timed += [speed(goal, j, full=False) for j in extra
                  if context_rank(j.cand.max_model_len, target) >= top]
    timed.sort(key=lambda j: j.value, reverse=True)
    if goal.objective in ("balanced", "latency") and p.max_num_seqs is None \
            and not goal.hw.is_cpu:  # the CPU engine sizes its KV by max-num-seqs: no cap
        timed = _capped(goal, timed)
    elif goal.objective == "throughput" and p.max_num_seqs is None and not goal.hw.is_cpu:
        timed = _kv_trimmed(goal, timed)
    return Result(timed, sorted(misfit.values(), key=lambda j: -j.cand.max_model_len),
                  sorted(fitting, key=lambda j: -j.cand.max_model_len),
                  goal.counts[0], goal.counts[1])


def _longest(js: list[Judged], target: int) -> list[Judged]:
    """Memory's verdict on context: the candidates at the longest context (up to the target);
    the others lose on context before any is timed."""
    if not js:
        return js
    top = max(context_rank(j.cand.max_model_len, target) for j in js)
    return [j for j in js if context_rank(j.cand.max_model_len, target) >= top]


def _close(v: float, top: float) -> bool:
    """Within LAYOUT_PRUNE of the best figure (scores may be negative: latency)."""
    if top > 0:
        return v >= top * LAYOUT_PRUNE
    return v >= top / LAYOUT_PRUNE


def _seeds(timed: list[Judged], layouts_kept: set) -> list[Judged]:
    """Each kept layout's best TOKEN_KEEP plain candidates, of its better KV dtype (after the
    fp8 margin): a draft moves both dtypes alike, so the other one is not varied."""
    dtype: dict[B.Layout, Judged] = {}
    for j in timed:
        if j.knobs.layout in layouts_kept and (j.knobs.layout not in dtype
                                               or j.value > dtype[j.knobs.layout].value):
            dtype[j.knobs.layout] = j
    groups: dict[tuple, list[Judged]] = {}
    for j in timed:
        if j.knobs.layout in dtype and j.knobs.kv_dtype == dtype[j.knobs.layout].knobs.kv_dtype:
            groups.setdefault((j.knobs.layout, j.knobs.kv_dtype), []).append(j)
    out = []
    for js in groups.values():
        js.sort(key=lambda j: j.value, reverse=True)
        out += js[:TOKEN_KEEP]
    return out


def _capped(goal: Goal, timed: list[Judged]) -> list[Judged]:
    """balanced/latency: each layout's best with max-num-seqs at its own SLO knee (overload
    then queues instead of breaking the SLO), judged again at that cap. The capped candidates
    rank among themselves first: the objective emits the cap, so an uncapped figure is never
    what a plan is chosen on."""
    out = []
    tops = _tops(timed)
    first = tops[0].knobs.layout if tops else None
    for j in [t for i, t in enumerate(tops) if t.knobs.layout == first
              or i == 0 or tops[i - 1].knobs.layout != t.knobs.layout]:
        a = _with_binding(goal, j)
        cap = perfplan.knee_seqs(a) if a is not None else None
        if cap is None or cap >= j.cand.max_num_seqs:
            out.append(j)
            continue
        tokens = max(j.cand.max_num_batched_tokens, cap)
        k = dataclasses.replace(j.knobs, max_num_seqs=cap, max_num_batched_tokens=tokens,
                                max_model_len=j.cand.max_model_len)
        capped = memory(goal, k)
        if serves(goal, capped):
            capped.capped_from = j.cand.max_num_seqs
            out.append(speed(goal, capped, full=False))
        else:
            out.append(j)
    out.sort(key=lambda j: j.value, reverse=True)
    shown = {id(j) for j in out}
    return out + [j for j in timed if id(j) not in shown]


def _kv_trimmed(goal: Goal, timed: list[Judged]) -> list[Judged]:
    """throughput: where the KV cache caps the running requests below max-num-seqs, the
    sequences past the cap only take sampler buffers and CUDA-graph memory from the KV cache.
    The top candidates are judged again at the smallest LEAN_SEQS batch that still holds the
    KV-bound running count, and kept beside the original when they serve more."""
    extra = []
    for j in _tops(timed):
        a = _with_binding(goal, j)
        if a is None or a.binding != "kv_cache" or a.knee is None:
            continue
        need = math.ceil(a.knee.running)
        seqs = min((x for x in LEAN_SEQS if x >= need), default=None)
        if seqs is None or seqs >= j.cand.max_num_seqs:
            continue
        k = dataclasses.replace(j.knobs, max_num_seqs=seqs,
                                max_num_batched_tokens=max(j.cand.max_num_batched_tokens, seqs),
                                max_model_len=j.cand.max_model_len)
        lean = memory(goal, k)
        if serves(goal, lean):
            lean.trimmed_from = j.cand.max_num_seqs
            extra.append(speed(goal, lean, full=False))
    out = timed + [j for j in extra if j.value > max(t.value for t in timed)]
    out.sort(key=lambda j: j.value, reverse=True)
    return out


def _tops(timed: list[Judged], n: int = 2) -> list[Judged]:
    """Each layout's best `n` candidates (timed is best first)."""
    seen: dict[B.Layout, int] = {}
    out = []
    for j in timed:
        if seen.get(j.knobs.layout, 0) < n:
            seen[j.knobs.layout] = seen.get(j.knobs.layout, 0) + 1
            out.append(j)
    return out

