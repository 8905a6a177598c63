"""`make demo`: the whole loop on this machine, on a tiny model the project generates itself.

0. decide for the real target: DeepSeek-R1 on 8xH200 by objective, and the GPUs and dollars
   for 500 users (the performance model; no GPU needed to plan);
1. generate (once, cached) a random-weight model with DeepSeek-V3's architecture;
2. `vlaunch serve` it on the CPU engine: plan, start, verify planned vs actual, smoke test;
3. send a few requests and read the KV gauges from vlaunch's exporter;
4. say where the metrics are, then stop vLLM cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.read().decode()


def _complete(base: str, model: str, prompt: str, max_tokens: int = 24) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback only
        return json.loads(r.read())["choices"][0]["text"]


def _decide() -> None:
    """What vlaunch would run on the real target, and what 500 users cost: plan + capacity."""
    from .inputs.hardware import parse_gpus
    from .inputs.model import load_model
    from .inputs.workload import SLO, resolve_workload
    from .predict.capacity import capacity
    from .predict.search.planner import make_plan

    spec, hw, w = load_model("deepseek-r1"), parse_gpus("8xH200"), resolve_workload(preset="chat")
    print("demo: $ vlaunch plan deepseek-r1 --gpus 8xH200 --workload chat --objective ...")
    for objective in ("throughput", "latency"):
        dep = make_plan(spec, hw, workload=w, objective=objective).deployment()
        perf, slo = dep.performance, dep.slo
        k, one = perf.knee, perf.single_request
        label = next(r for r in dep.reasons if r.code == "layout").data["label"]
        print(f"    {objective:10} -> {label}: {k.output_tokens_per_s:,.0f} output tok/s "
              f"at {k.concurrency:,.0f} in flight within TPOT {slo.tpot_ms:.0f} ms;"
              f" one request alone {one.tpot_ms:.1f} ms/token ({perf.source})")
    cap = capacity.plan_capacity(spec, capacity.Load(users=500), w, SLO(),
                                 ["8xH200", "8xB200", "2x8xH100"])
    rec = cap["recommended"]
    print("demo: $ vlaunch capacity deepseek-r1 --users 500 --gpus 8xH200,8xB200,2x8xH100")
    for o in cap["options"]:
        if o["replicas"]:
            print(f"    {o['gpus']:9} {o['parallel']['label']:12} {o['replicas']} replica(s), "
                  f"{o['gpus_total']} GPUs, ${o['monthly_usd']:,.0f}/month (list price)")
    if rec:
        print(f"    recommended: {rec['replicas']} x {rec['gpus']}")


def main() -> int:
    from .inputs import vllm_flags as F
    from .run.tinymodel import ensure_tiny_model

    _decide()

    model = Path(ensure_tiny_model())
    print(f"demo: tiny DeepSeek-V3-architecture model at {model}")
    workdir = Path(os.environ.get("VLAUNCH_DEMO_DIR", ".cache/demo"))
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launcher.cli", "serve", str(model), "--gpus", "cpu",
           F.BY_DEST["kv_cache_memory_bytes"].pin.option, str(256 << 20), "--metrics-port", "0",
           "--log-dir", str(workdir)]
    print("demo: $ vlaunch " + " ".join(cmd[3:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = metrics = None
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            print(line, end="", flush=True)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None and not (base and metrics):
        text = "".join(lines)
        m = re.search(r"serving on (http://\S+)", text)
        base = m.group(1) if m else None
        m = re.search(r"metrics on (http://\S+/metrics)", text)
        metrics = m.group(1) if m else None
        time.sleep(0.5)
    if not (base and metrics):
        print("demo: vlaunch serve did not come up; see the log above", flush=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return 1
    metrics = metrics.replace("0.0.0.0", "127.0.0.1")
    print("demo: the weights are random, so the text is noise; the point is the loop")
    for prompt in ("DeepSeek-V3 on eight H200s", "The KV cache holds", "vlaunch plans"):
        print(f"demo: completion for {prompt!r}: {_complete(base, model.name, prompt)!r}")
    print("demo: 16 concurrent 400-token requests; KV usage as vlaunch's exporter reports it:")
    load = [threading.Thread(target=_complete, args=(base, model.name, "load " * 60, 400))
            for _ in range(16)]
    for t in load:
        t.start()
    peak = 0.0
    while any(t.is_alive() for t in load):
        for line in _get(metrics).splitlines():
            if line.startswith("vlaunch_kv_cache_used_tokens"):
                used = float(line.rsplit(" ", 1)[1])
                if used > peak:
                    peak = used
                    print(f"    {line}")
        time.sleep(0.5)
    print(f"demo: peak KV tokens in use under load: {peak:,.0f}")
    print("demo: vlaunch gauges after the requests:")
    for line in _get(metrics).splitlines():
        if line.startswith(("vlaunch_kv_cache", "vlaunch_prediction_error", "vlaunch_engine_up")):
            print("   ", line)
    print(f"demo: vLLM's own metrics: {base}/metrics; vlaunch's: {metrics}")
    print("demo: Grafana dashboard deploy/grafana/vlaunch-dashboard.json, alerts "
          "deploy/prometheus/alerts.yaml")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(120)
    print(f"demo: stopped vLLM with SIGTERM; vlaunch exited {rc}, vLLM's own status")
    return 0


if __name__ == "__main__":
    sys.exit(main())
