"""Serving from step times: TPOT, TTFT, throughput, the knee under an SLO. Pure functions.

`step.py` times one engine step from operator rooflines; this module turns steps into requests:

- DP: `C` requests in flight spread over the DP engines as whole numbers (ceil / floor); the
  busiest engine sets TPOT and TTFT. Engines of a MoE model under DP step in lockstep (vLLM
  pads idle ranks with dummy batches), so every rank takes the busiest rank's step time.
- decode: b running requests (at most max_num_seqs, or what the KV cache holds at full length)
  gain 1 / (tokens per step) step per output token; with MTP a step yields more than one.
- prefill: a prompt of L tokens runs in chunks of the token budget (chunked prefill), each
  chunk's attention over the whole prefix before it; without chunked prefill (V0) the prompt is
  a step of its own. The steps a prompt rides in are its own TTFT; the time it adds to them is
  what it costs the other requests.
- TTFT = own prefill + per-request cost + the wait behind OTHER prompts, which depends on the
  client (CLIENTS; the plan names the one it assumed):
  - closed-loop: staggered users, each sending its next request when one completes; a request
    arriving while other prompts are prefilled waits rho / (1 - rho) x half a prompt (M/D/1,
    rho the others' prefill share of engine time);
  - bench-synchronised: `vllm bench serve --max-concurrency N` with fixed lengths: N clients
    start together. A prefill-first scheduler (V0, or no chunked prefill) pauses decodes for
    prompts, so the clients stay in waves: half the others' prompts land before the first
    token, every wave. Under chunked prefill only the first wave is one: afterwards client i's
    next prompt arrives as client i-1's has been prefilled (their finishing steps are as far
    apart as their first tokens were), so it waits for no other prompt; the first wave's
    queue is then spread over the run's prompts / N waves;
  - poisson: open-loop arrivals at a rate; in flight what Little's law gives at that rate.
  The others' prompts that do not delay the first token ride in the decode steps (TPOT), so
  a request's life holds each of them once. A lone request: its own prefill plus fixed costs.
- closed loop: concurrency C gives, by Little's law, C / (TTFT + (output - 1) x TPOT)
  requests per second; beyond the running limit the rest queue for a slot. The API servers'
  serial per-request work (Constants.frontend_us) caps requests/s: tiny outputs hit it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from ...deployment.plan import Point
from ...inputs.workload import SLO, Workload
from .step import (
    DEFAULT,
    Constants,
    EngineShape,
    engine_shape,
    stage_step,
    step_s,
    touched_fraction,
)

__all__ = ["DEFAULT", "Constants", "EngineShape", "engine_shape", "touched_fraction",
           "OperatingPoint", "point", "knee", "curve", "binding", "decode_step_s", "prefill_step_s",
           "prompt_s", "running_limit", "max_running", "open_loop_rate", "Calibration",
           "scaled", "calibrate", "value_range", "HELD_OUT_SPREAD", "CLIENTS", "client_of",
           "bench_point", "poisson_point", "closed_loop_point", "burst_point", "recompute_s",
           "BENCH_PROMPTS"]

CLIENTS = ("bench-synchronised", "poisson", "closed-loop")
"""The clients a prediction can assume: benchmark clients started together on fixed lengths
(`--concurrency`), open-loop Poisson arrivals (`capacity --rps`), staggered users in a closed
loop (the knee under the SLO, `capacity --users`). A one-shot burst (`burst_point`, request
rate inf) is the bench client's first wave alone."""

BENCH_PROMPTS = 1000
"""Prompts `vllm bench serve` sends unless told otherwise (benchmarks/datasets/datasets.py
DEFAULT_NUM_PROMPTS): how many waves a synchronised run spreads its first wave over."""


def client_of(w: Workload) -> str:
    """The client `point` assumes for workload `w`."""
    return "bench-synchronised" if w.synchronized else "closed-loop"

MAX_RHO = 0.95
"""Cap on the other prompts' share of engine time in the staggered TTFT queueing term."""

HELD_OUT_SPREAD: dict[str, tuple[float, float]] = {
    "output_tokens_per_s": (-0.251, 0.688),
    "tpot_ms": (-0.056, 0.546),
    "ttft_ms": (-0.681, 0.249),
}
"""10th and 90th percentile of the relative error (predicted / measured - 1) of each quantity
when every publication's rows are predicted by constants fitted without them (`python
bench/perf_fit.py`, leave one source out). A prediction x then stands for a measurement
between x / (1 + high) and x / (1 + low): the plans' performance.range."""


def value_range(quantity: str, predicted: float) -> tuple[float, float]:
    """(low, high) of what a deployment predicted at `predicted` has measured, on the held-out
    spread of the published rows."""
    lo, hi = HELD_OUT_SPREAD[quantity]
    return predicted / (1 + hi), predicted / (1 + lo)


CHUNK_SAMPLES = 8
"""A long prompt's chunks are timed at this many evenly spaced positions and the mean scaled
to all of them (the step time varies smoothly with the prefix): plans stay fast."""


def decode_step_s(s: EngineShape, batch: float, ctx: float,
                  moe_tokens: float | None = None) -> float:
    """Seconds per output token for each of `batch` running requests at context `ctx`: one
    engine step over the tokens a step yields (1 without speculation)."""
    return step_s(s, max(batch, 1e-9), ctx, moe_tokens=moe_tokens) / s.spec_yield


def prefill_step_s(s: EngineShape, chunk: float, running: float, ctx: float,
                   prefix: float = 0.0) -> float:
    """One step that carries a `chunk`-token prompt piece (after `prefix` cached tokens of its
    prompt) beside `running` decodes at context `ctx`."""
    return step_s(s, running, ctx, chunk, prefix)


def _chunks(s: EngineShape, length: float, running: float) -> int:
    """How many steps a `length`-token prompt takes beside `running` decodes."""
    if not s.chunked_prefill or length <= 0:
        return 1
    budget = max(s.max_num_batched_tokens - running * (1 + s.spec_tokens), 1.0)
    return max(1, math.ceil(length / budget))


def _chunk_share(s: EngineShape, length: float, running: float) -> float:
    """Steps' worth of token budget a `length`-token prompt fills beside `running` decodes
    (fractional: the rest of its last step carries the next prompt)."""
    if not s.chunked_prefill:
        return 1.0
    budget = max(s.max_num_batched_tokens - running * (1 + s.spec_tokens), 1.0)
    return length / budget


def _mixed_step_s(s: EngineShape, length: float, running: float, ctx: float,
                  moe_tokens: float | None) -> float:
    """Seconds of a decode step that also fills the rest of its token budget with prompt
    tokens (halfway through a `length`-token prompt)."""
    piece = (max(s.max_num_batched_tokens - running * (1 + s.spec_tokens), 1.0)
             if s.chunked_prefill else length)
    prefix = max(length - min(piece, length), 0.0) / 2
    return step_s(s, max(running, 1e-9), ctx, piece, prefix,
                  moe_tokens=None if moe_tokens is None else moe_tokens + piece * s.dp)


def prompt_s(s: EngineShape, length: float, running: float, ctx: float) -> tuple[float, float]:
    """(the prompt's own steps, the time it adds to the running requests' steps) for a
    `length`-token prompt beside `running` decodes."""
    if length <= 0:
        return 0.0, 0.0
    if not s.chunked_prefill:  # a whole prompt is a step of its own (V0, MLA on CPU)
        own = step_s(s, 0.0, 0.0, length, 0.0)
        return own, own
    n = _chunks(s, length, running)
    chunk = length / n
    idx = range(n) if n <= CHUNK_SAMPLES else [
        round(i * (n - 1) / (CHUNK_SAMPLES - 1)) for i in range(CHUNK_SAMPLES)]
    steps = [step_s(s, running, ctx, chunk, i * chunk) for i in idx]
    own = sum(steps) / len(steps) * n
    base = step_s(s, running, ctx) if running > 0 else 0.0
    return own, max(own - n * base, 0.0)


# ----------------------------------------------------------------------------- operating points


_PLAN_DIGITS = {"concurrency": 2, "tpot_ms": 2, "ttft_ms": 1, "output_tokens_per_s": 1,
                "requests_per_s": 3}
"""Decimals each of the plan's point figures keeps: the JSON's, and every sentence that quotes
one (rank.figure) reads the same rounded point."""


@dataclass(frozen=True)
class OperatingPoint(Point):
    """The deployment at `concurrency` requests in flight (all DP engines together), as the
    model predicts it: the plan's figures (`deployment.plan.Point`, unrounded, the fields
    inherited so they are declared once) and what the model also knows of the busiest engine,
    which the search reads (the knee's running batch sizes max_num_seqs, the limit and the
    bound name what binds) and the plan does not carry."""

    running: float  # on the busiest engine, actually decoding
    limit: str  # what caps `running`: none | max_num_seqs | kv_cache
    bound: str = "memory"  # what dominates the busiest engine's decode step: memory|compute|fixed

    def plan_point(self) -> Point:
        """The plan's own point at the decimals it prints: the one conversion."""
        return Point(**{f.name: round(getattr(self, f.name), _PLAN_DIGITS[f.name])
                        for f in dataclasses.fields(Point)})

    def to_dict(self) -> dict[str, Any]:
        """`plan_point` as JSON values (a reason's data, a speculative option's note)."""
        return dataclasses.asdict(self.plan_point())


def running_limit(s: EngineShape, w: Workload) -> tuple[float, str]:
    """How many requests one engine decodes at once: max_num_seqs, or the KV cache."""
    # Requests are admitted while blocks are free, then grow; once the cache is full vLLM
    # preempts, so what stays running is what fits at full length.
    full = w.input_len + w.output_len
    kv = s.kv_tokens / full if full else float("inf")
    if kv < s.max_num_seqs:
        return max(kv, 1.0), "kv_cache"
    return float(s.max_num_seqs), "max_num_seqs"


def _loads(concurrency: float, dp: int) -> list[tuple[int, float]]:
    """(engines, requests each), busiest first: whole requests where the count is whole."""
    c = max(concurrency, 1e-9)
    if dp <= 1:
        return [(1, c)]
    if abs(c - round(c)) > 1e-9:
        return [(dp, c / dp)]
    c = round(c)
    lo, extra = divmod(c, dp)
    out = [(extra, float(lo + 1))] if extra else []
    if lo:
        out.append((dp - extra, float(lo)))
    return out


@dataclass(frozen=True)
class _Engine:
    tpot: float
    ttft: float
    e2e: float
    running: float
    limit: str
    last: float = 0.0  # one wave of `running` sent together: when its last request completes


def _engine(s: EngineShape, w: Workload, load: float, moe_tokens: float | None,
            waves: float = 1.0) -> _Engine:
    """One engine with `load` requests in flight (closed loop); `waves`: how many times the
    synchronised clients' requests turn over in the run (prompts / concurrency)."""
    cap, why = running_limit(s, w)
    b = min(load, cap)
    ctx = w.input_len + w.output_len / 2
    t_dec = decode_step_s(s, b, ctx, moe_tokens)
    steps = max(w.output_len - 1, 1)
    others_n = max(b - 1.0, 0.0)
    own, _ = prompt_s(s, w.input_len, others_n, ctx)
    # The other prompts fill the token budget left beside the decodes, `share` steps' worth
    # each. Those steps that fall in this request's decode window are mixed steps: a fraction
    # f of its tokens come from one. When the prompts need more steps than the request has
    # tokens (long prompts, many running: prefill-bound) the rest run before its first token.
    share = _chunk_share(s, w.input_len, others_n)
    slots = others_n * share
    life = steps / s.spec_yield  # engine steps this request decodes in (fewer with MTP)
    dec_step = t_dec * s.spec_yield
    mixed = _mixed_step_s(s, w.input_len, b, ctx, moe_tokens) if slots > 0 else dec_step
    extra = max(mixed - dec_step, 0.0)  # what a step's prompt tokens add to it
    added = share * extra  # what one other prompt adds to the engine's time
    in_decode = min(slots, life) * extra
    before = max(slots - life, 0.0) * mixed
    request = s.constants.request_us * 1e-6
    boundary = t_dec / 2 if others_n > 0 else 0.0  # arriving mid-step waits for its end
    if w.synchronized and not s.chunked_prefill:
        # Fixed lengths, clients started together, a prefill-first scheduler: every wave's
        # prompts run before its decodes, as many per step as the token budget holds; a
        # request's first token comes when its group's step ends, its second when the wave's
        # last group's has.
        wave_ttft, wave = _wave_s(s, w.input_len, b, own)
        tpot = t_dec + max(wave - wave_ttft, 0.0) / steps
        ttft = wave_ttft + before + boundary + request
        last = wave + before + boundary + request + steps * t_dec
    elif w.synchronized:
        # Chunked prefill dissolves the waves after the first: the first wave's queue (half
        # the others' prompts) counts once in `waves`; later prompts arrive as the budget
        # they need frees up and ride in the others' decode steps.
        ramp = in_decode / 2 / max(waves, 1.0)
        tpot = t_dec + (in_decode - ramp) / steps
        ttft = own + ramp + before + boundary + request
        last = own + in_decode + before + boundary + request + steps * t_dec
    else:
        # Staggered users: a request arriving while other prompts are prefilled waits for
        # them (M/D/1: rho / (1 - rho) x half a prompt, rho their share of engine time); the
        # rest of the others' prompts ride in its decode steps. Either way each request's
        # life holds every other prompt once.
        cycle = steps * t_dec + b * added
        rho = min(in_decode / cycle, MAX_RHO) if cycle > 0 else 0.0
        wait = min(rho / (1 - rho) * added / 2, in_decode)
        tpot = t_dec + (in_decode - wait) / steps
        ttft = own + wait + before + boundary + request
        last = ttft + steps * tpot
    e2e = ttft + steps * tpot
    if load > b:  # the rest wait for a slot: Little's law on the closed loop
        ttft += (load - b) / (b / e2e)
        e2e = ttft + steps * tpot
    return _Engine(tpot, ttft, e2e, b, why if load >= cap else "none", last)


def _wave_s(s: EngineShape, length: float, wave: float, own: float) -> tuple[float, float]:
    """(mean time to a request's first token, time to the last one's) when `wave` prompts of
    `length` tokens arrive together at a prefill-first scheduler: groups of g = budget /
    length prompts per step (at least one), each group's step g prompts' work beyond the
    step's fixed part; the j-th group's requests get their first token after j steps."""
    g = max(1, min(math.floor(s.max_num_batched_tokens / max(length, 1.0)), math.ceil(wave)))
    empty = step_s(s, 0.0, 0.0)
    group = own + (g - 1) * max(own - empty, 0.0)
    n = max(wave, 1.0)
    full, rest = divmod(n, g)
    # sum over requests of their group's index, over the wave's n requests
    index_sum = g * full * (full + 1) / 2 + rest * (full + 1)
    return index_sum / n * group, math.ceil(n / g) * group


def point(s: EngineShape, w: Workload, concurrency: float,
          prompts: float = BENCH_PROMPTS) -> OperatingPoint:
    """Closed loop: `concurrency` clients, each sending its next request when one completes
    (synchronised benchmark clients when `w.synchronized`, sending `prompts` in all)."""
    loads = _loads(concurrency, s.dp)
    lockstep = s.dp > 1 and s.experts > 0
    cap = running_limit(s, w)[0]
    waves = max(prompts / max(concurrency, 1e-9), 1.0)
    moe = None
    if s.moe_group > 1:
        # the MoE group's experts see every rank's tokens; in lockstep at the busiest's pace
        moe = sum(n * min(x, cap) for n, x in loads) * (1 + s.spec_tokens)
    busiest = _engine(s, w, loads[0][1], moe, waves)
    rps = 0.0
    for n, x in loads:
        e = busiest if (lockstep or x == loads[0][1]) else _engine(s, w, x, moe, waves)
        rps += n * x / (busiest.e2e if lockstep else e.e2e)
    # The API servers do each request's serial host work one after another (one per DP rank
    # in vLLM 0.32): past their rate requests queue there, before their first token.
    frontend = s.constants.frontend_us * 1e-6 / s.dp
    if rps * frontend > 1.0:
        slow = rps * frontend
        rps /= slow
        busiest = dataclasses.replace(busiest, ttft=busiest.ttft + busiest.e2e * (slow - 1),
                                      e2e=busiest.e2e * slow)
    ctx = w.input_len + w.output_len / 2
    micro = max(busiest.running / s.pp, min(busiest.running, 1.0))
    st = stage_step(s, micro, ctx, moe_tokens=None if moe is None else moe / s.pp)
    parts = {"memory": st.memory, "compute": st.compute, "fixed": st.fixed}
    bound = max(parts, key=lambda k: parts[k])
    return OperatingPoint(concurrency, busiest.tpot * 1e3, busiest.ttft * 1e3,
                          rps * w.output_len, rps, busiest.running, busiest.limit, bound)


def bench_point(s: EngineShape, w: Workload, concurrency: float,
                prompts: float = BENCH_PROMPTS) -> OperatingPoint:
    """`vllm bench serve --max-concurrency N --num-prompts P` on `w`'s fixed lengths: the
    client `--concurrency` predicts (synchronised clients)."""
    return point(s, dataclasses.replace(w, synchronized=True), concurrency, prompts)


def burst_point(s: EngineShape, w: Workload, n: float) -> OperatingPoint:
    """`n` requests of `w`'s lengths sent at once (`vllm bench serve --request-rate inf`):
    throughput is n over the MAKESPAN - the last request's completion, the whole wave's
    prompts before its first token - not over the mean request's life as in a steady loop
    (a burst of tiny outputs is over by the time a loop would have reached its mean). Past
    the running limit the waves follow one another, and the requests admitted beyond what
    the cache holds at full length are preempted and recomputed (recompute_s). TTFT and TPOT
    are the first wave's means. The API servers' serial work caps it like any load."""
    w = dataclasses.replace(w, synchronized=True)
    load = math.ceil(max(n, 1.0) / s.dp)
    cap = running_limit(s, w)[0]
    moe = None
    if s.moe_group > 1:
        moe = min(load, cap) * s.dp * (1 + s.spec_tokens)
    e = _engine(s, w, min(load, cap), moe, 1.0)
    makespan = e.last * math.ceil(load / max(e.running, 1.0))
    makespan += recompute_s(s, w, load, cap)
    frontend = s.constants.frontend_us * 1e-6 / s.dp
    makespan = max(makespan, n * frontend)
    rps = n / makespan
    ctx = w.input_len + w.output_len / 2
    st = stage_step(s, max(e.running / s.pp, min(e.running, 1.0)), ctx,
                    moe_tokens=None if moe is None else moe / s.pp)
    parts = {"memory": st.memory, "compute": st.compute, "fixed": st.fixed}
    return OperatingPoint(n, e.tpot * 1e3, e.ttft * 1e3, rps * w.output_len, rps, e.running,
                          e.limit, max(parts, key=lambda k: parts[k]))


def recompute_s(s: EngineShape, w: Workload, load: float, cap: float) -> float:
    """Seconds a burst spends recomputing preempted requests. vLLM admits a request while
    its prompt's blocks are free (v1/core/sched/scheduler.py schedule; V0 the same), so a
    burst starts with A = min(load, max_num_seqs, KV / prompt) requests, more than the cap
    of what fits at full length (KV / (input + output)). As they grow together the cache
    holds R(L) = KV / L of them at length L; each one preempted at length L loses its blocks
    and is recomputed from its prompt and generated tokens when it runs again (preemption by
    recompute). From L1 = KV / A to the full length that is A - cap recomputations of
    KV x ln(full / L1) tokens in all (integral of L x KV / L^2 dL), each costing what a
    prompt of their mean length adds to the steps it rides in. Zero while A <= cap: the
    burst's requests fit at full length."""
    full = w.input_len + w.output_len
    if cap <= 0 or not s.kv_tokens or full <= 0:
        return 0.0
    admitted = min(load, float(s.max_num_seqs), s.kv_tokens / max(w.input_len + 1.0, 1.0))
    if admitted <= cap * (1 + 1e-9):
        return 0.0
    first = s.kv_tokens / admitted  # length at which the cache fills
    count = admitted - cap
    tokens = s.kv_tokens * math.log(full / first)
    length = tokens / count
    ctx = w.input_len + w.output_len / 2
    _, added = prompt_s(s, length, cap, ctx)
    cohorts = load / admitted  # every admitted cohort of the burst goes through it
    return cohorts * count * added


def closed_loop_point(s: EngineShape, w: Workload, users: float, think_s: float = 0.0
                      ) -> OperatingPoint:
    """`users` staggered users, each waiting `think_s` between a response and its next
    request: in flight C = users x E2E / (E2E + think) (Little's law on the loop), found by
    bisection (C's E2E rises with C, so the fixed point is unique)."""
    w = dataclasses.replace(w, synchronized=False)
    if users <= 0:
        raise ValueError("users must be positive")
    if think_s <= 0:
        return point(s, w, users)

    def in_flight(c: float) -> float:
        p = point(s, w, c)
        e2e = c / p.requests_per_s if p.requests_per_s > 0 else math.inf
        return users * e2e / (e2e + think_s)

    lo, hi = min(1e-6, users), users
    for _ in range(40):  # bounded: 2^-40 of the range
        mid = (lo + hi) / 2
        if in_flight(mid) > mid:
            lo = mid
        else:
            hi = mid
    return dataclasses.replace(point(s, w, max(lo, 1e-6)), concurrency=users)


def poisson_point(s: EngineShape, w: Workload, rate: float) -> OperatingPoint | None:
    """Open-loop Poisson arrivals at `rate` requests/s: the mean state of the engine, at the
    in-flight count C whose staggered closed loop serves exactly `rate` (Little: C = rate x
    E2E; the TTFT wait is already the M/D/1 of random arrivals). None when no C serves it:
    the queue grows without bound."""
    w = dataclasses.replace(w, synchronized=False)
    if rate <= 0:
        raise ValueError("rate must be positive")
    top = max(2.0, max_running(s, w))
    if point(s, w, top).requests_per_s < rate:
        return None
    lo, hi = 1e-6, top
    for _ in range(40):  # bounded bisection; requests/s rises with C
        mid = (lo + hi) / 2
        if point(s, w, mid).requests_per_s < rate:
            lo = mid
        else:
            hi = mid
    return point(s, w, hi)


def open_loop_rate(s: EngineShape, w: Workload, knee_concurrency: float) -> float:
    """Requests/s of Poisson arrivals the engine takes within the SLO.

    Closed-loop clients never arrive together; Poisson arrivals do. With requests in flight
    C = rate x E2E (Little), random arrivals push the in-flight count about sqrt(C) above its
    mean (square-root staffing, Halfin-Whitt), so the SLO holds while C + sqrt(C) <= the
    closed-loop knee K: C = ((sqrt(4K + 1) - 1) / 2)^2, at that C's rate."""
    if knee_concurrency <= 0:
        return 0.0
    c = ((math.sqrt(4 * knee_concurrency + 1) - 1) / 2) ** 2
    return point(s, w, max(c, 1e-6)).requests_per_s if c >= 1 else 0.0


def max_running(s: EngineShape, w: Workload) -> float:
    """Requests the whole deployment decodes at once at its limits."""
    return running_limit(s, w)[0] * s.dp


def knee(s: EngineShape, w: Workload, slo: SLO) -> OperatingPoint | None:
    """The largest whole concurrency that still meets the SLO; None if even 1 misses it.
    TTFT and TPOT never fall as concurrency rises, so a bisection finds it."""
    if not _meets(point(s, w, 1), slo):
        return None
    lo, hi = 1, max(2, int(max_running(s, w) * 2))
    if _meets(point(s, w, hi), slo):
        return point(s, w, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _meets(point(s, w, mid), slo):
            lo = mid
        else:
            hi = mid
    return point(s, w, lo)


def _meets(p: OperatingPoint, slo: SLO) -> bool:
    return slo.met(p.ttft_ms, p.tpot_ms)


def curve(s: EngineShape, w: Workload, extra: tuple[float, ...] = ()) -> list[OperatingPoint]:
    """Concurrency 1, 2, 4, ... to twice the running limit, plus `extra` levels."""
    top = max(2.0, max_running(s, w) * 2)
    levels = {float(2 ** i) for i in range(0, int(math.log2(top)) + 1)}
    levels |= {float(x) for x in extra if x and x > 0}
    return [point(s, w, c) for c in sorted(levels)]


def binding(s: EngineShape, w: Workload, k: OperatingPoint | None, slo: SLO) -> str:
    """What stops the deployment at its knee: the KV cache, max_num_seqs, or the SLO on TPOT or
    TTFT, with what dominates the step there (slo_tpot_memory: the step reads bytes; _compute:
    it does math; _fixed: launches, collectives and host costs)."""
    if k is None:
        return "slo"
    if k.limit == "kv_cache":
        return "kv_cache"
    if k.limit == "max_num_seqs":
        return "max_num_seqs"
    nxt = point(s, w, k.concurrency + 1)
    which = "tpot" if nxt.tpot_ms > slo.tpot_ms else "ttft"
    return f"slo_{which}_{nxt.bound}"


# ----------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    """Scales refitted from one engine's measured points (`vlaunch tune`): fixed costs, decode
    rooflines, prefill and the per-request overhead before the first token, each a multiplier
    on the time it models (1.0: as the model says)."""

    fixed_scale: float
    roofline_scale: float
    points: int
    median_error: float
    prefill_scale: float = 1.0
    request_scale: float = 1.0
    uncalibrated_error: float = 0.0
    """The same median |error| of output tokens/s with every scale at 1.0 (reported beside it;
    the fit minimises `loss`, so this one figure may move either way)."""
    loss: float = 0.0
    """The fit's objective at the fitted scales: weighted RMS of the log errors."""
    loss_uncalibrated: float = 0.0
    """The same objective with every scale at 1.0: the fit may never be worse than no fit."""


FIXED_FIELDS = ("layer_us", "moe_layer_us", "allreduce_us", "nccl_us", "network_us", "step_us",
                "v0_step_us", "draft_pass_us", "frontend_us", "spec_seq_us")


def scaled(c: Constants, cal: Calibration) -> Constants:
    """Constants with each group of costs scaled by a calibration (a time scale s divides an
    efficiency by s and multiplies a fixed cost by s). Every fixed cost and every efficiency
    moves: nothing is frozen into a shape."""
    f, r, p = cal.fixed_scale, cal.roofline_scale, cal.prefill_scale
    fixed = {name: getattr(c, name) * f for name in FIXED_FIELDS}
    return dataclasses.replace(
        c, **fixed, link_eff=c.link_eff / f, hbm_eff=c.hbm_eff / r,
        compute_eff=c.compute_eff / r, prefill_eff=c.prefill_eff / p,
        request_us=c.request_us * cal.request_scale)


PRIOR = 0.001
"""Weight of log(scale)^2 per scale in the calibration loss (a 2x scale costs as much as a 2%
error on one point): scales the points cannot tell apart stay near 1."""

CAL_GRID = tuple(2.0 ** i for i in range(-4, 5))
"""Scales tried: 1/16 to 16 in steps of 2 (the loss has separate valleys: prefill and decode
trade against each other), every combination of the first three, then refined one at a time."""


def calibrate(s: EngineShape, measured: list[dict[str, Any]]) -> Calibration | None:
    """Fit the fixed, decode, prefill and per-request scales that best predict measured output
    tokens/s (weighted double: capacity and goodput rest on it), TPOT and TTFT (half weight),
    in log space: a grid over the first three, then coordinate refinement of all four. Each
    point is replayed on its own engine limits (max_num_seqs, max_num_batched_tokens)."""
    pts = [m for m in measured if m.get("output_tokens_per_s") and m.get("concurrency")
           and m.get("input_len") and m.get("output_len")]
    if not pts:
        return None
    engines = []
    for m in pts:
        # tune measures with vLLM's benchmark on fixed lengths: synchronized clients
        w = Workload(int(m["input_len"]), int(m["output_len"]),
                     synchronized=bool(m.get("synchronized", True)))
        engines.append((m, w,
                        dataclasses.replace(
                            s, max_num_seqs=int(m.get("max_num_seqs") or s.max_num_seqs),
                            max_num_batched_tokens=int(m.get("max_num_batched_tokens")
                                                       or s.max_num_batched_tokens))))
    base = s.constants

    def errors(x: tuple[float, ...]) -> list[tuple[float, float, float]]:
        k = scaled(base, Calibration(x[0], x[1], 0, 0, x[2], x[3]))
        out = []
        for m, w, engine in engines:
            p = point(_with(engine, k), w, float(m["concurrency"]))
            out.append((math.log(p.output_tokens_per_s / m["output_tokens_per_s"]),
                        math.log(p.tpot_ms / m["tpot_ms"]) if m.get("tpot_ms") else 0.0,
                        math.log(p.ttft_ms / m["ttft_ms"]) if m.get("ttft_ms") else 0.0))
        return out

    def loss(x: tuple[float, ...]) -> float:
        fit = sum(2 * a * a + b * b + 0.5 * c * c for a, b, c in errors(x))
        # a weak pull towards the shipped constants: a scale the points cannot tell apart
        # stays at 1 instead of wandering to the edge of the grid
        return fit + PRIOR * sum(math.log(v) ** 2 for v in x)

    best: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    best_loss = loss(best)
    for x3 in itertools.product(CAL_GRID, repeat=3):
        x = (*x3, 1.0)
        value = loss(x)
        if value < best_loss:
            best, best_loss = x, value
    lo, hi = CAL_GRID[0] / 4, CAL_GRID[-1] * 4
    for steps in (CAL_GRID, 8, 8, 32, 128, 16, 64, 32, 128, 64, 256):
        for i in range(4):
            values = steps if isinstance(steps, tuple) else [
                min(max(best[i] * 2 ** (j / steps), lo), hi) for j in range(-8, 9)]
            for v in values:
                x = tuple(v if k == i else best[k] for k in range(4))
                value = loss(x)
                if value < best_loss:
                    best, best_loss = x, value

    def median_tput(x: tuple[float, ...]) -> float:
        tput = sorted(abs(math.expm1(a)) for a, _, _ in errors(x))
        return tput[len(tput) // 2]

    def rms(x: tuple[float, ...]) -> float:
        return math.sqrt(loss(x) / (3.5 * len(pts)))

    unit = (1.0, 1.0, 1.0, 1.0)
    return Calibration(best[0], best[1], len(pts), median_tput(best), best[2], best[3],
                       median_tput(unit), rms(best), rms(unit))


def _with(s: EngineShape, k: Constants) -> EngineShape:
    """The shape timed with constants `k`, its draft layer too."""
    return dataclasses.replace(s, constants=k)
