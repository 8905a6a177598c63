"""The queue an open-loop replica keeps: an M/G/c model of one vLLM engine.

Why M/G/c and not a simulation: capacity sizes every option at every rate it bisects over, and a
closed form is exact to print (the same rate always gives the same wait), monotone in the rate
(so a bisection finds the largest rate that meets the SLO) and costs microseconds. A simulation
would add sampling noise to a number the CLI prints and a test compares.

The model. A replica under `balanced` runs at most c = K requests at once (K: its knee under the
SLO; vLLM's --max-num-seqs is capped there), so it is c servers. Each request holds a slot for
its end-to-end time at the knee, 1/mu = K / R_K (Little's law on the knee's throughput R_K):
the slowest a slot ever turns over, so the model errs towards waiting longer. Arrivals are
Poisson at rate lambda. Waiting is Erlang C scaled by Allen and Cunneen's (1 + Cs^2) / 2 for a
general service time (exact for M/M/c, Cs^2 = 1; Cs^2 = 0 is fixed lengths, M/D/c). Output
lengths of chat traffic are about exponential (ShareGPT's coefficient of variation is near 1),
so Cs^2 = 1 unless a lengths histogram says otherwise.

References: A. O. Allen, "Probability, Statistics and Queueing Theory" (1978), the Allen-Cunneen
approximation; Erlang C as in any queueing text (e.g. Kleinrock, "Queueing Systems", vol. 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SERVICE_CS2 = 1.0
"""Squared coefficient of variation of a request's service time: 0 (every request the same
length) to about 1 (exponential output lengths, as chat traces show); above 1 for heavy tails."""


def erlang_c(servers: int, offered: float) -> float:
    """Probability an arrival waits in M/M/c with c servers and offered load a = lambda/mu
    (a < c). Computed through the Erlang B recursion, stable for thousands of servers."""
    if servers < 1:
        raise ValueError("servers must be at least 1")
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):  # Erlang B: B(k) = a B(k-1) / (k + a B(k-1))
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho + rho * b)


@dataclass(frozen=True)
class Queue:
    """One replica at an arrival rate: how busy it is and what a request waits."""

    rate: float  # requests/s arriving at this replica
    utilization: float  # lambda / (c mu): the share of slot-time in use; must stay below 1
    wait_s: float  # mean time in vLLM's waiting queue before the request is scheduled


def mgc(rate: float, servers: int, capacity_rps: float, cs2: float = SERVICE_CS2) -> Queue:
    """M/G/c at `rate` for `servers` slots that together complete `capacity_rps` when all are
    busy. At or above capacity the queue grows without bound: wait is infinite."""
    if servers < 1 or capacity_rps <= 0:
        raise ValueError("a replica needs at least one slot and a positive capacity")
    if not 0 <= cs2 <= 100:
        raise ValueError(f"service-time Cs^2 {cs2} is out of range")
    rho = rate / capacity_rps
    if rate <= 0:
        return Queue(0.0, 0.0, 0.0)
    if rho >= 1:
        return Queue(rate, rho, math.inf)
    mu = capacity_rps / servers
    wait = erlang_c(servers, rate / mu) / (servers * mu - rate) * (1 + cs2) / 2
    return Queue(rate, rho, wait)


def max_rate(servers: int, capacity_rps: float, wait_budget_s, cs2: float = SERVICE_CS2,
             steps: int = 40) -> float:
    """The largest arrival rate whose queue meets `wait_budget_s(queue) >= queue.wait_s`:
    `wait_budget_s` maps a Queue to the wait it may have (the SLO's TTFT less the prefill at
    that load). Bisection over (0, capacity): the wait grows with the rate, the budget does
    not; 40 halvings reach 1e-12 of the capacity. 0 when even a trickle misses."""
    lo, hi = 0.0, capacity_rps
    if mgc(capacity_rps * 1e-9, servers, capacity_rps, cs2).wait_s > wait_budget_s(
            mgc(capacity_rps * 1e-9, servers, capacity_rps, cs2)):
        return 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        q = mgc(mid, servers, capacity_rps, cs2)
        if q.wait_s <= wait_budget_s(q):
            lo = mid
        else:
            hi = mid
    return lo
