"""Live: two fake engines take a load that ramps up and down, a real Prometheus scrapes them and
one vlaunch exporter per engine (as in a pod), and the advisory replica count and the
ScaledObject's trigger queries, evaluated by that Prometheus, move as computed.

Every stage waits (bounded) for the engines to report the load the test put on them, then for
Prometheus to see it; what it asserts are the counts, never how long anything took.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_live_metrics import Prom, _Procs, _wait_http

from launcher.run.emit import trigger_queries
from launcher.run.vllmargs import free_port

pytestmark = pytest.mark.prometheus

REPO = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).resolve().parent / "fake_vllm.py"
HOLD_S = 12.0  # each completion stays in flight this long (FAKE_VLLM_DELAY)
KV_PER_REQUEST = 0.01


def _complete(base: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "x", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _in_flight(base: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _value(prom: Prom, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def _until(fn, want, timeout_s: float):
    """Poll fn() until it returns `want` (bounded); the last value either way."""
    end = time.monotonic() + timeout_s
    got = fn()
    while got != want and time.monotonic() < end:
        time.sleep(0.25)
        got = fn()
    return got


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (`make prometheus` installs Debian's)")
    tmp = tmp_path_factory.mktemp("autoscaling-live")
    env = {**os.environ, "VLAUNCH_CACHE_DIR": str(tmp / "cache")}
    plan_path = tmp / "plan.json"
    subprocess.run([sys.executable, "-m", "launcher.cli", "plan", str(tiny_model), "--gpus",
                    "cpu", "--format", "json", "-o", str(plan_path), "--users", "100"],
                   check=True, env=env, cwd=REPO, timeout=120)
    plan = json.loads(plan_path.read_text())
    target = plan["autoscaling"]["target_running_per_replica"]
    procs = _Procs()
    engines, exporters = [], []
    fake_env = {**env, "FAKE_VLLM_MODE": "slow_smoke", "FAKE_VLLM_DELAY": str(HOLD_S),
                "FAKE_VLLM_KV_PER_REQUEST": str(KV_PER_REQUEST)}
    try:
        for i in range(2):
            port, exp_port = free_port(), free_port()
            # max-num-seqs at the knee (what the balanced objective pins when the SLO binds), so
            # a load past one replica's capacity queues and the waiting trigger moves too
            engine = procs.start([sys.executable, str(FAKE), "serve", *plan["vllm_args"],
                                  "--max-num-seqs", str(target), "--port", str(port)],
                                 tmp / f"engine{i}.log", env=fake_env)
            exporter = procs.start([sys.executable, "-m", "launcher.cli", "exporter",
                                    "--vllm-url", f"http://127.0.0.1:{port}", "--plan",
                                    str(plan_path), "--port", str(exp_port),
                                    "--cache-ttl", "0"], tmp / f"exporter{i}.log", env=env,
                                   cwd=REPO)
            engines.append((f"http://127.0.0.1:{port}", engine, tmp / f"engine{i}.log"))
            exporters.append((f"http://127.0.0.1:{exp_port}", exporter, tmp / f"exporter{i}.log"))
        prom_port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                             "scrape_timeout": "1s"},
                  "scrape_configs": [
                      {"job_name": "vllm", "static_configs": [
                          {"targets": [u.removeprefix("http://") for u, _, _ in engines]}]},
                      {"job_name": "vlaunch", "static_configs": [
                          {"targets": [u.removeprefix("http://") for u, _, _ in exporters]}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = procs.start(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                            f"--storage.tsdb.path={tempfile.mkdtemp(dir=tmp)}",
                            f"--web.listen-address=127.0.0.1:{prom_port}"],
                           tmp / "prometheus.log")
        _wait_http(f"http://127.0.0.1:{prom_port}/-/ready", prom, 30, tmp / "prometheus.log")
        for url, proc, log in [*engines, *exporters]:
            _wait_http(f"{url}/metrics", proc, 30, log)
        yield {"plan": plan, "engines": [u for u, _, _ in engines],
               "prom": Prom(f"http://127.0.0.1:{prom_port}")}
    finally:
        procs.stop_all()


def test_desired_replicas_and_trigger_queries_follow_a_ramp(pool):
    plan, prom = pool["plan"], pool["prom"]
    a = plan["autoscaling"]
    target, waiting_target = a["target_running_per_replica"], a["target_waiting_per_replica"]
    seqs = target  # the engines run at most the knee's requests (see the fixture)
    model = plan["vllm_args"][plan["vllm_args"].index("--served-model-name") + 1] \
        if "--served-model-name" in plan["vllm_args"] else plan["vllm_args"][1]
    queries = trigger_queries('job="vllm"', replica_label="instance")  # no pods here
    seen = []
    # up, further up (past one replica's capacity and past max-num-seqs: requests queue), down
    for loads in ([target // 2, 0], [target + target // 2, target // 3], [0, 0]):
        threads = [threading.Thread(target=_complete, args=(url, model))
                   for url, n in zip(pool["engines"], loads, strict=True) for _ in range(n)]
        for t in threads:
            t.start()
        for url, n in zip(pool["engines"], loads, strict=True):
            assert _until(lambda u=url: _in_flight(u), float(n), 10) == n
        running = [min(n, seqs) for n in loads]
        waiting = [n - r for n, r in zip(loads, running, strict=True)]
        want = {
            # the exporters: ceil((running + waiting) / capacity) each, summed over the pool
            "desired": float(sum(math.ceil(n / target) for n in loads)),
            "capacity": float(target),
            # the ScaledObject's triggers, as KEDA reads them (AverageValue: the sum)
            "running": float(sum(running)), "waiting": float(sum(waiting)),
            "kv_usage": round(sum(r * KV_PER_REQUEST for r in running), 6),
        }
        exprs = {"desired": "sum(vlaunch_desired_replicas)",
                 "capacity": "max(vlaunch_replica_capacity_requests)",
                 **{k: f"round({q}, 0.000001)" for k, q in queries.items()}}
        got = _until(lambda ex=exprs: {k: _value(prom, e) for k, e in ex.items()}, want, HOLD_S)
        assert got == want, loads
        seen.append(got)
        for t in threads:
            t.join(timeout=HOLD_S + 30)
    # the replicas KEDA would ask for from the running and waiting triggers moved with the load
    keda = [max(math.ceil(s["running"] / target), math.ceil(s["waiting"] / waiting_target))
            for s in seen]
    assert keda[1] > keda[0] >= keda[2]
    desired = [s["desired"] for s in seen]
    assert desired[0] < desired[1] and desired[2] == 0, desired
    print("ramp:", seen)
