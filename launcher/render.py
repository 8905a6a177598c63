"""Plans as text a person reads: the verdict, the per-GPU budget bar, reasons, the command.

The edge where a Deployment (launcher/deployment) becomes prose: every figure is read from the
typed plan, the same object `--format json` dumps.
"""

from __future__ import annotations

import shlex

from .deployment import plan as P
from .deployment.argv import engine_argv, pool_argv
from .inputs.hardware import GiB
from .predict.features.capabilities import serve_argv
from .redact import redact_args, redact_env

_SEGMENTS = (("weights_bytes", "W", "weights"), ("activation_bytes", "A", "activations"),
             ("cudagraph_bytes", "G", "CUDA graphs"), ("non_torch_bytes", "N", "non-torch"),
             ("kv_cache_bytes", "K", "KV cache"))


def budget_bar(per_gpu: P.PerGpuBudget, total: int, width: int = 60) -> list[str]:
    """A stacked bar of one GPU: each consumer's share of the card's total, then headroom.

    Each segment's length is its share clamped to what is left of `width`, so a consumer many
    times the card (a nonsense config, a plan that does not fit) fills the bar instead of
    allocating a string as long as its ratio."""
    bar, used = "", 0
    for key, char, _ in _SEGMENTS:
        n = getattr(per_gpu, key)
        share = max(0.0, n / total) if total > 0 else 0.0
        bar += char * min(width - len(bar), round(min(share, 1.0) * width))
        used += n
    bar += "." * (width - len(bar))
    legend = "  ".join(f"{char}={name} {getattr(per_gpu, key) / GiB:.2f}"
                       for key, char, name in _SEGMENTS)
    head = max(0, total - used)
    return [f"[{bar}] {total / GiB:.1f} GiB", f"{legend}  .=headroom {head / GiB:.2f} GiB"]


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def plan_text(d: P.Deployment, command: bool | list[str] = True) -> str:
    """The text form of a plan (the Deployment `--format json` dumps). What will happen comes
    first (the verdict, why it does not fit, the warnings, the command or what would fit),
    then the figures, then the reasons: a reader sees what to act on before forty lines of
    why. `command`: the plan's own command (True), none (False), or these lines in its place
    (what a dry run will run)."""
    m, g = d.model, d.hardware
    gpus = "cpu" if g.platform == "cpu" else (
        f"{g.nodes}x{g.gpus_per_node}x{g.name}" if g.nodes > 1 else f"{g.count}x{g.name}")
    lines = [f"{m.name} on {gpus} ({g.source}): " + ("FITS" if d.fits else "DOES NOT FIT")]
    if not d.fits and d.problem:
        lines.append(f"  why it does not fit: {d.problem}")
    lines += _items("warnings", d.warnings)
    if d.fits and command:
        lines += command if isinstance(command, list) else _command_lines(d)
    lines += _items("what would fit", d.suggestions)
    lines += _figures(d)
    lines += performance_lines(d)
    lines += scaling_lines(d.pool, pooled=d.kind == "disaggregated")
    lines += _items("why", d.reasons)
    return "\n".join(lines)


def _items(title: str, items: tuple[P.Reason, ...]) -> list[str]:
    """A heading only above something to read."""
    texts = [x.text for x in items if x.text.strip()]
    return [f"  {title}:", *(f"    - {x}" for x in texts)] if texts else []


def _command_lines(d: P.Deployment) -> list[str]:
    if d.kind == "disaggregated":
        return pool_lines(d)
    if d.hardware.nodes > 1:
        return ["  commands (one per node; vlaunch exec builds them from the LeaderWorkerSet "
                "environment):", *_node_commands(d)]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in redact_env(dict(d.pool.env)).items())
    return ["  command:", f"    {env} " + shlex.join(vllm_command_of(d))]


def vllm_command_of(d: P.Deployment) -> list[str]:
    """The plan's vLLM command in the form its vLLM version takes (`vllm serve MODEL ...`, the
    model positional; the API server module with --model before `vllm serve` existed)."""
    return serve_argv(d.vllm_version, redact_args(engine_argv(d.engine)))


def _figures(d: P.Deployment) -> list[str]:
    """Model, layout, KV cache and the per-GPU budget: what the plan is made of."""
    m, g, pool = d.model, d.hardware, d.pool
    e, kv, p = pool.engine, pool.kv_cache, pool.engine.parallel
    lines = [f"  model: {m.architecture}, {_count(m.params)} params stored, "
             f"{m.weights_bytes / GiB:.2f} GiB loaded ({m.quantization}), "
             f"context {m.max_context:,}"]
    layout = f"TP {p.tp}, PP {p.pp}, DP {p.dp}" + (", EP" if p.expert_parallel else "")
    if d.fits:
        whose = f" ({pool.role} pool, one replica)" if d.kind == "disaggregated" else ""
        lines += [f"  layout{whose}: {layout}, {p.nodes} node(s)",
                  f"  max-model-len {e.max_model_len:,}, kv-cache-dtype {kv.dtype}, "
                  f"block {kv.block_size}, gpu-memory-utilization "
                  f"{e.gpu_memory_utilization:.2f}",
                  f"  KV cache: {kv.tokens:,} tokens per engine "
                  f"({kv.bytes_per_token:,} B/token per GPU), max concurrency "
                  f"{pool.max_concurrency:.2f}x at {e.max_model_len:,} tokens"]
    if d.fits and len(kv.layer_kinds) > 1:
        lines.append("  KV cache layers: " + ", ".join(f"{n} {k}" for k, n in
                                                        kv.layer_kinds.items())
                     + f" in {kv.groups} groups sharing one pool; one "
                     f"{e.max_model_len:,}-token request holds "
                     f"{kv.blocks_per_request or 0:,} blocks")
    if d.fits and pool.per_stage:
        lines.append("  pipeline stages (one rank each): " + "; ".join(
            f"{i}: {st.layers} layers, weights {st.weights_bytes / GiB:.1f} GiB, "
            f"KV {st.kv_cache_bytes / GiB:.1f} GiB" for i, st in enumerate(pool.per_stage)))
    lines.append("  per GPU (limiting rank):")
    lines += ["    " + x for x in budget_bar(pool.per_gpu, g.total_bytes)]
    lines.append(f"    vLLM may use {pool.per_gpu.requested_bytes / GiB:.2f} GiB "
                 f"of {g.total_bytes / GiB:.2f} GiB ({g.free_bytes / GiB:.2f} GiB free)")
    return lines


def scaling_lines(pool: P.Pool, pooled: bool = False) -> list[str]:
    """One replica's start-up and the pool's autoscaling targets (the plan's figures); `pooled`:
    each pool's line above already gave its own targets, so they are not said again."""
    st, a = pool.startup, (None if pooled else pool.autoscaling)
    out = []
    if st:
        terms = ", ".join(f"{k.replace('_', ' ')} {v:,.0f} s" for k, v in st.terms.items())
        out.append(f"  start-up ({st.source}, weights from {st.load_path}): "
                   f"{st.seconds:,.0f} s ({terms})")
    if a:
        out.append(f"  autoscaling ({a.role}): {a.min_replicas}-{a.max_replicas} replicas; per "
                   f"replica {a.target_running_per_replica} running, "
                   f"{a.target_waiting_per_replica} waiting, KV {a.kv_usage_threshold:.0%}; "
                   f"windows up {a.scale_up_stabilization_s:,} s, down "
                   f"{a.scale_down_stabilization_s:,} s")
        out += scaling_notes(a, "    ")
    return out


_SAID_BY_THE_BOUNDS = frozenset({"replicas.at_minimum", "replicas.rate_matched"})
"""Autoscaling notes the replica bounds already say (nothing asked: the pool stays as planned)."""


def scaling_notes(a: P.Autoscaling, indent: str) -> list[str]:
    """Why the pool has its bounds (a --users/--rps load, --max-replicas) and whether its windows
    were capped: the autoscaling notes a bare `min-max replicas` does not say."""
    return [f"{indent}{n.text}" for n in a.notes if n.code not in _SAID_BY_THE_BOUNDS]


def pool_lines(d: P.Deployment) -> list[str]:
    """A disaggregated plan's pools: each pool's replicas, layout, figures and one engine's
    command (the prefill pool is also what the lines above describe)."""
    out = [f"  pools ({sum(p.replicas * p.gpus_per_replica for p in d.pools)} GPUs):"]
    for p in d.pools:
        par, t, perf = p.engine.parallel, p.transfer, p.performance
        layout = f"TP {par.tp}, PP {par.pp}, DP {par.dp}" + (", EP" if par.expert_parallel
                                                            else "")
        out.append(f"    {p.role}: {p.replicas} x ({layout}; {p.gpus_per_replica} GPU(s)), "
                   f"KV {p.kv_cache.tokens:,} tokens per engine")
        if perf is not None:
            a = perf.at
            out.append(f"      {a.requests_per_s:.2f} req/s" + (
                f", TPOT {a.tpot_ms:.1f} ms, {a.output_tokens_per_s:,.0f} output tok/s"
                if p.role == "decode" else f", prefill {a.ttft_ms:,.0f} ms per prompt"))
        if t is not None:
            out.append(f"      KV hand-off: {t.connector} over {t.path}, "
                       f"{t.bytes_per_gpu / 1e6:,.1f} MB per GPU in {t.seconds * 1e3:.2f} ms")
        if (a := p.autoscaling) is not None:  # the pool's own triggers (its ScaledObject's)
            from .predict.capacity.autoscaling import trigger_thresholds

            what = {"running": "running", "waiting": "waiting", "kv_usage": "KV"}
            on = ", ".join(f"{what[k]} {v:.0%}" if k == "kv_usage" else f"{what[k]} {v:,.0f}"
                           for k, v in trigger_thresholds(a).items())
            out.append(f"      autoscaling: {a.min_replicas}-{a.max_replicas} replicas on "
                       f"{on} per replica; windows up {a.scale_up_stabilization_s:,} s, down "
                       f"{a.scale_down_stabilization_s:,} s")
            out += scaling_notes(a, "        ")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in redact_env(dict(p.env)).items())
        out.append(f"      {env} " + shlex.join(serve_argv(d.vllm_version,
                                                       redact_args(pool_argv(p)))))
    return out


def _node_commands(d: P.Deployment) -> list[str]:
    from .run.multinode import build_launch

    out = []
    nodes = d.hardware.nodes
    for rank in (0, 1):
        env = {"LWS_LEADER_ADDRESS": "LEADER_IP", "LWS_GROUP_SIZE": str(nodes),
               "LWS_WORKER_INDEX": str(rank)}
        launch = build_launch(d, env)
        who = "leader (node 0)" if rank == 0 else (
            "worker (node 1)" + ("; nodes 2 and up differ only in their rank" if nodes > 2 else ""))
        out.append(f"    {who}:")
        out += [f"      {shlex.join(redact_args(pre))}" for pre in launch.pre_commands]
        env_text = " ".join(f"{k}={shlex.quote(v)}"
                            for k, v in sorted(redact_env(launch.env).items()))
        out.append(f"      {env_text} {shlex.join(redact_args(launch.argv))}")
    return out


def curve_table(perf: P.Performance, slo: P.SLO, indent: str = "    ") -> list[str]:
    """The throughput-latency curve of staggered users as a small table, the knee marked (the
    asked --concurrency point is printed apart: its clients are synchronised)."""
    knee = perf.knee.concurrency if perf.knee else None
    out = [f"{indent}{'in flight':>10} {'TPOT ms':>9} {'TTFT ms':>10} {'output tok/s':>13}"
           f"  ({perf.knee_client} users)"]
    for p in perf.curve:
        mark = []
        if p.concurrency == knee:
            mark.append("knee")
        if p.tpot_ms > slo.tpot_ms or p.ttft_ms > slo.ttft_ms:
            mark.append("misses SLO")
        out.append(f"{indent}{p.concurrency:>10,.0f} {p.tpot_ms:>9.1f} "
                   f"{p.ttft_ms:>10,.0f} {p.output_tokens_per_s:>13,.0f}  "
                   + ", ".join(mark))
    return out


def performance_lines(d: P.Deployment) -> list[str]:
    perf, w, slo = d.performance, d.workload, d.slo
    if not d.fits or perf is None or w is None or slo is None:
        return []
    lines = [f"  performance ({perf.source}; {w.input_len:,} in / {w.output_len:,} "
             f"out per request; SLO TTFT {slo.ttft_ms:,.0f} ms, TPOT {slo.tpot_ms:.0f} ms; "
             f"objective {d.objective}):"]
    k = perf.knee
    if k:
        r = perf.range
        likely = f" (likely {r.low:,.0f}-{r.high:,.0f})" if r is not None else ""
        lines.append(f"    knee: {k.concurrency:,.0f} in flight{_running(d, k)}, "
                     f"{k.output_tokens_per_s:,.0f} output tok/s{likely}, "
                     f"{k.requests_per_s:.2f} req/s, TPOT {k.tpot_ms:.1f} ms, "
                     f"TTFT {k.ttft_ms:,.0f} ms (bound by {perf.binding})")
        # the notes the reasons below do not already give (a split's rate match, its hand-off)
        lines += [f"    {n.text}" for n in perf.notes if n not in d.reasons]
    else:
        one = perf.single_request
        lines.append(f"    the SLO is out of reach even for one request (TPOT "
                     f"{one.tpot_ms:.1f} ms, TTFT {one.ttft_ms:,.0f} ms)")
    at = perf.at
    if perf.asked_concurrency:
        # --concurrency: what `vllm bench serve --max-concurrency N` would measure, the JSON's
        # performance.at under the client it names
        lines.append(f"    at --concurrency {at.concurrency:,.0f} ({perf.client} clients, as "
                     f"vllm bench serve --max-concurrency runs them): TPOT {at.tpot_ms:.1f} ms, "
                     f"TTFT {at.ttft_ms:,.0f} ms, {at.output_tokens_per_s:,.0f} output tok/s")
    lines += curve_table(perf, slo)
    alts = [a for a in d.runners_up if a.fits]
    if alts:
        lines.append("    runner-ups:")
        lines += [f"      {alt_label(a)}: {a.why_not.text}" for a in alts]
    return lines


def _running(d: P.Deployment, k: P.Point) -> str:
    """How the knee's requests split when max-num-seqs binds: that many decode at once (the
    batch cap, per engine times engines), the rest wait in vLLM's queue. The knee is the load;
    max-num-seqs is the batch, never a second knee."""
    seqs, dp = d.engine.max_num_seqs, d.engine.parallel.dp or 1
    if seqs * dp >= k.concurrency:
        return ""
    running = seqs * dp
    return (f" ({running:,} running at max-num-seqs {seqs:,}"
            + (f" x {dp} engines" if dp > 1 else "")
            + f", {k.concurrency - running:,.0f} queued)")


def alt_label(a: P.Alternative) -> str:
    """A runner-up as the plan shows it: layout, KV dtype and MTP (its best version)."""
    k = a.num_speculative_tokens
    return f"{a.label} (kv {a.kv_cache.dtype}, " + (f"MTP {k})" if k else "no MTP)")
