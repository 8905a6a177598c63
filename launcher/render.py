"""Plans as text a person reads: the verdict, the per-GPU budget bar, reasons, the command."""

from __future__ import annotations

import shlex
from typing import Any

from .redact import redact_args, redact_env

GiB = 1 << 30

_SEGMENTS = (("weights_bytes", "W", "weights"), ("activation_bytes", "A", "activations"),
             ("cudagraph_bytes", "G", "CUDA graphs"), ("non_torch_bytes", "N", "non-torch"),
             ("kv_cache_bytes", "K", "KV cache"))


def budget_bar(per_gpu: dict[str, int], total: int, width: int = 60) -> list[str]:
    """A stacked bar of one GPU: each consumer's share of the card's total, then headroom.

    Each segment's length is its share clamped to what is left of `width`, so a consumer many
    times the card (a nonsense config, a plan that does not fit) fills the bar instead of
    allocating a string as long as its ratio."""
    bar, used = "", 0
    for key, char, _ in _SEGMENTS:
        share = max(0.0, per_gpu.get(key, 0) / total) if total > 0 else 0.0
        bar += char * min(width - len(bar), round(min(share, 1.0) * width))
        used += per_gpu.get(key, 0)
    bar += "." * (width - len(bar))
    legend = "  ".join(f"{char}={name} {per_gpu.get(key, 0) / GiB:.2f}"
                       for key, char, name in _SEGMENTS)
    head = max(0, total - used)
    return [f"[{bar}] {total / GiB:.1f} GiB", f"{legend}  .=headroom {head / GiB:.2f} GiB"]


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def plan_text(d: dict[str, Any]) -> str:
    """The text form of a plan dict (the same dict `--format json` prints)."""
    m, g, p, kv = d["model"], d["gpus"], d["parallel"], d["kv_cache"]
    gpus = "cpu" if g["platform"] == "cpu" else (
        f"{g['nodes']}x{g['gpus_per_node']}x{g['name']}" if g["nodes"] > 1
        else f"{g['count']}x{g['name']}")
    lines = [f"{m['name']} on {gpus} ({g['source']}): "
             + ("FITS" if d["fits"] else "DOES NOT FIT"),
             f"  model: {m['architecture']}, {_count(m['params'])} params stored, "
             f"{m['weights_bytes'] / GiB:.2f} GiB loaded ({m['quantization']}), "
             f"context {m['max_context']:,}"]
    layout = f"TP {p['tp']}, PP {p['pp']}, DP {p['dp']}" + (", EP" if p["expert_parallel"] else "")
    if d["fits"]:
        lines += [f"  layout: {layout}, {p['nodes']} node(s)",
                  f"  max-model-len {d['max_model_len']:,}, kv-cache-dtype {kv['dtype']}, "
                  f"block {kv['block_size']}, gpu-memory-utilization "
                  f"{d['gpu_memory_utilization']:.2f}",
                  f"  KV cache: {kv['tokens']:,} tokens per engine "
                  f"({kv['bytes_per_token']:,} B/token per GPU), max concurrency "
                  f"{d['max_concurrency']:.2f}x at {d['max_model_len']:,} tokens"]
    kinds = kv.get("layer_kinds") or {}
    if d["fits"] and len(kinds) > 1:
        lines.append("  KV cache layers: " + ", ".join(f"{n} {k}" for k, n in kinds.items())
                     + f" in {kv.get('groups', 1)} groups sharing one pool; one "
                     f"{d['max_model_len']:,}-token request holds "
                     f"{kv.get('blocks_per_request') or 0:,} blocks")
    if d["fits"] and d.get("per_stage"):
        lines.append("  pipeline stages (one rank each): " + "; ".join(
            f"{i}: {st['layers']} layers, weights {st['weights_bytes'] / GiB:.1f} GiB, "
            f"KV {st['kv_cache_bytes'] / GiB:.1f} GiB" for i, st in enumerate(d["per_stage"])))
    if not d["fits"] and d.get("problem"):
        lines.append(f"  why it does not fit: {d['problem']}")
    lines.append("  per GPU (limiting rank):")
    lines += ["    " + x for x in budget_bar(d["per_gpu"], g["total_bytes"])]
    lines.append(f"    vLLM may use {d['per_gpu']['requested_bytes'] / GiB:.2f} GiB "
                 f"of {g['total_bytes'] / GiB:.2f} GiB ({g['free_bytes'] / GiB:.2f} GiB free)")
    lines += performance_lines(d)
    lines += scaling_lines(d)
    for title, key in (("why", "reasons"), ("warnings", "warnings"),
                       ("what would fit", "suggestions")):
        items = [x for x in d.get(key) or () if str(x).strip()]
        if items:  # a heading only above something to read
            lines.append(f"  {title}:")
            lines += [f"    - {x}" for x in items]
    if d["fits"] and g["nodes"] > 1:
        lines += ["  commands (one per node; vlaunch exec builds them from the LeaderWorkerSet "
                  "environment):"] + _node_commands(d)
    elif d["fits"]:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in redact_env(d["env"]).items())
        lines.append("  command:")
        lines.append(f"    {env} vllm serve " + shlex.join(redact_args(d["vllm_args"])))
    return "\n".join(lines)


def scaling_lines(d: dict[str, Any]) -> list[str]:
    """One replica's start-up and the pool's autoscaling targets (plan.json's figures)."""
    st, a = d.get("startup"), d.get("autoscaling")
    out = []
    if st:
        terms = ", ".join(f"{k.replace('_', ' ')} {v:,.0f} s" for k, v in st["terms"].items())
        out.append(f"  start-up ({st['source']}, weights from {st['load_path']}): "
                   f"{st['seconds']:,.0f} s ({terms})")
    if a:
        out.append(f"  autoscaling ({a['role']}): {a['min_replicas']}-{a['max_replicas']} "
                   f"replicas; per replica {a['target_running_per_replica']} running, "
                   f"{a['target_waiting_per_replica']} waiting, KV {a['kv_usage_threshold']:.0%}; "
                   f"windows up {a['scale_up_stabilization_s']:,} s, down "
                   f"{a['scale_down_stabilization_s']:,} s")
    return out


def _node_commands(d: dict[str, Any]) -> list[str]:
    from .run.multinode import build_launch

    out = []
    nodes = d["gpus"]["nodes"]
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


def curve_table(perf: dict[str, Any], indent: str = "    ") -> list[str]:
    """The throughput-latency curve as a small table; the knee and the asked point marked."""
    knee = (perf.get("knee") or {}).get("concurrency")
    at = perf.get("asked_concurrency")
    slo = perf["slo"]
    out = [f"{indent}{'in flight':>10} {'TPOT ms':>9} {'TTFT ms':>10} {'output tok/s':>13}"]
    for p in perf["curve"]:
        mark = []
        if p["concurrency"] == knee:
            mark.append("knee")
        if p["concurrency"] == at and at != knee:
            mark.append("asked")
        if p["tpot_ms"] > slo["tpot_ms"] or p["ttft_ms"] > slo["ttft_ms"]:
            mark.append("misses SLO")
        out.append(f"{indent}{p['concurrency']:>10,.0f} {p['tpot_ms']:>9.1f} "
                   f"{p['ttft_ms']:>10,.0f} {p['output_tokens_per_s']:>13,.0f}  "
                   + ", ".join(mark))
    return out


def performance_lines(d: dict[str, Any]) -> list[str]:
    perf = d.get("performance")
    if not d.get("fits") or not perf:
        return []
    slo = perf["slo"]
    lines = [f"  performance ({perf['source']}; {perf['input_len']:,} in / {perf['output_len']:,} "
             f"out per request; SLO TTFT {slo['ttft_ms']:,.0f} ms, TPOT {slo['tpot_ms']:.0f} ms; "
             f"objective {perf['objective']}):"]
    k = perf.get("knee")
    if k:
        r = perf.get("range") or {}
        likely = (f" (likely {r['low']:,.0f}-{r['high']:,.0f})"
                  if r.get("low") is not None and r.get("high") is not None else "")
        lines.append(f"    knee: {k['concurrency']:,.0f} in flight, "
                     f"{k['output_tokens_per_s']:,.0f} output tok/s{likely}, "
                     f"{k['requests_per_s']:.2f} req/s, TPOT {k['tpot_ms']:.1f} ms, "
                     f"TTFT {k['ttft_ms']:,.0f} ms (bound by {perf['binding']})")
    else:
        one = perf["single_request"]
        lines.append(f"    the SLO is out of reach even for one request (TPOT "
                     f"{one['tpot_ms']:.1f} ms, TTFT {one['ttft_ms']:,.0f} ms)")
    lines += curve_table(perf)
    alts = [a for a in d.get("alternatives") or [] if isinstance(a, dict) and a.get("fits")]
    if alts:
        lines.append("    runner-ups:")
        lines += [f"      {alt_label(a)}: {a['why_not']}" for a in alts]
    return lines


def alt_label(a: dict[str, Any]) -> str:
    """A runner-up as the plan shows it: layout, KV dtype and MTP (its best version)."""
    k = a.get("num_speculative_tokens") or 0
    return f"{a['label']} (kv {a['kv_cache']['dtype']}, " + (f"MTP {k})" if k else "no MTP)")
