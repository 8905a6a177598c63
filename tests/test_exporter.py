"""The exporter against a fake vLLM HTTP server that serves vLLM 0.32-shaped /metrics.

The page is rendered by prometheus_client (the library vLLM itself uses) with vLLM's family
names and labels (`model_name`, `engine`; `vllm:cache_config_info` carrying CacheConfig fields
as labels), so the parser sees the same exposition a real server sends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import types
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from launcher.deployment import plan as P
from launcher.deployment.codec import dump
from launcher.deployment.plan import PerGpuBudget
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.observe import exporter as ex
from launcher.observe import scrapeclient, vllmpage
from launcher.predict.search.planner import Pins, make_plan

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-deepseek-v3"

def _plan() -> P.Deployment:
    """A real plan with the figures these tests check: DP2 of a tiny model, 77,672 KV tokens
    (268,435,456 bytes) per engine, max concurrency 75.85 at 1,024 tokens."""
    base = make_plan(load_model("llama-3.1-8b"), parse_gpus("2xH200"),
                     Pins(tp=1, dp=2, vllm_version="0.32.0")).deployment()
    pool = base.pool
    engine = dataclasses.replace(pool.engine, model="/models/tiny", max_model_len=1024,
                                 kv_cache_dtype="auto")
    kv = dataclasses.replace(pool.kv_cache, dtype="auto", memory_bytes=268_435_456,
                             tokens=77_672)
    per_gpu = PerGpuBudget(requested_bytes=135_000_000_000, weights_bytes=60_000_000,
                           activation_bytes=900_000_000, cudagraph_bytes=300_000_000,
                           non_torch_bytes=400_000_000, kv_cache_bytes=268_435_456)
    pool = dataclasses.replace(pool, engine=engine, kv_cache=kv, per_gpu=per_gpu,
                               max_concurrency=75.85)
    model = dataclasses.replace(base.model, name=MODEL, weights_bytes=60_000_000,
                                path="/models/tiny")
    return dataclasses.replace(base, model=model, pools=(pool,))


PLAN = _plan()


def vllm_page(usage: list[float], *, size_tokens: list[int | None] | None = None,
              blocks_per_engine: int = 1213, block_size: int = 64, old_names: bool = False,
              start_time: float | None = None, mem_bytes: str = "None",
              max_concurrency: str | None = "75.85") -> str:
    """vLLM's /metrics for len(usage) DP engines, as PrometheusStatLogger lays it out."""
    reg = CollectorRegistry()
    n = len(usage)
    lab = ["model_name"] if old_names else ["model_name", "engine"]
    kv_name = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    kv = Gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", lab, registry=reg)
    running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", lab,
                    registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", lab,
                    registry=reg)
    preempt = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      lab, registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token.",
                     lab, buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                   0.75, 1.0, 2.5, 5.0), registry=reg)
    # Info-style gauge: one label per CacheConfig attribute, plus `engine`; all strings.
    sizes = size_tokens if size_tokens is not None else [blocks_per_engine * block_size] * n
    info_keys = ["block_size", "gpu_memory_utilization", "swap_space", "cache_dtype",
                 "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
                 "prefix_caching_hash_algo", "cpu_offload_gb", "calculate_kv_scales",
                 "kv_sharing_fast_prefill", "mamba_cache_dtype", "kv_offloading_size",
                 "num_gpu_blocks", "num_cpu_blocks", "kv_cache_size_tokens",
                 "kv_cache_max_concurrency", "kv_cache_memory_bytes", "engine"]
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 info_keys, registry=reg)
    for e in range(n):
        lv = [MODEL] if old_names else [MODEL, str(e)]
        kv.labels(*lv).set(usage[e])
        running.labels(*lv).set(3)
        waiting.labels(*lv).set(1)
        preempt.labels(*lv).inc(0)
        for v in (0.003, 0.05, 0.2):
            ttft.labels(*lv).observe(v)
        info.labels(
            str(block_size), "0.9", "4", "auto", "None", "None", "True", "sha256", "0", "False",
            "False", "auto", "None", str(blocks_per_engine * n), "None", str(sizes[e]),
            str(max_concurrency), mem_bytes, str(e),
        ).set(1)
    text = generate_latest(reg).decode()
    if start_time is not None:
        text += ("# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
                 "# TYPE process_start_time_seconds gauge\n"
                 f"process_start_time_seconds {start_time}\n")
    return text


class _QuietServer(ThreadingHTTPServer):
    """A fake upstream whose client (the exporter) gives up on purpose in the deadline tests:
    the broken pipe that follows is expected, and printing its traceback from a server thread
    would land in whatever test captures stderr next."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@dataclass
class FakeVllm:
    """A local HTTP server standing in for vLLM's API server; `mode` picks its behaviour."""

    body: str | bytes = ""  # bytes: sent as is (a 30 MB page is not re-encoded per request)
    mode: str = "ok"  # ok | slow | hold | trickle | http500 | garbage_http
    delay_s: float = 0.0
    hits: int = 0
    # mode "hold": a request sets `entered` and is answered only once `release` is set (a
    # handshake, so a test knows a fetch is in flight instead of sleeping and hoping)
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None
    paths: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_port}"

    def start(self, port: int = 0) -> FakeVllm:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                fake.hits += 1
                fake.paths.append(self.path)
                if fake.mode == "garbage_http":
                    self.wfile.write(b"this is not HTTP\r\n\r\n")
                    return
                if fake.mode == "slow":
                    time.sleep(fake.delay_s)
                if fake.mode == "hold":
                    fake.entered.set()
                    fake.release.wait(60)
                body = fake.body if isinstance(fake.body, bytes) else fake.body.encode()
                if fake.mode == "http500":
                    self.send_response(500)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if fake.mode == "trickle":
                    for i in range(0, len(body), 64):
                        self.wfile.write(body[i:i + 64])
                        self.wfile.flush()
                        time.sleep(fake.delay_s)
                else:
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def fake():
    f = FakeVllm(body=vllm_page([0.25, 0.5])).start()
    yield f
    f.stop()


def scrape(exp: ex.Exporter) -> dict[tuple[str, frozenset], float]:
    """Samples of one exporter scrape keyed by (name, labels)."""
    out = {}
    for fam in text_string_to_metric_families(exp.render().decode()):
        for s in fam.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names(samples: dict) -> set[str]:
    return {n for n, _ in samples}


ENGINE_SERIES = {"vlaunch_kv_cache_usage_ratio", "vlaunch_kv_cache_used_tokens"}


def test_healthy_engine_gives_usage_capacity_and_prediction_error(fake):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0)
    s = scrape(exp)
    cap = 1213 * 64
    assert value(s, "vlaunch_engine_up") == 1
    for engine, usage in (("0", 0.25), ("1", 0.5)):
        assert value(s, "vlaunch_kv_cache_usage_ratio", engine=engine) == usage
        assert value(s, "vlaunch_kv_cache_capacity_tokens", source="actual", engine=engine) == cap
        assert value(s, "vlaunch_kv_cache_used_tokens", engine=engine) == pytest.approx(usage * cap)
        assert value(s, "vlaunch_kv_cache_max_concurrency", source="actual",
                     engine=engine) == 75.85
        assert value(s, "vlaunch_prediction_error_ratio", quantity="kv_tokens",
                     engine=engine) == pytest.approx((cap - 77_672) / 77_672)
    assert value(s, "vlaunch_kv_cache_capacity_tokens", source="planned") == 77_672
    assert value(s, "vlaunch_kv_cache_capacity_bytes", source="planned") == 268_435_456
    assert value(s, "vlaunch_kv_cache_max_concurrency", source="planned") == 75.85
    # vLLM did not report KV bytes (kv_cache_memory_bytes None) and serve passed none: no series.
    assert not any(n == "vlaunch_kv_cache_capacity_bytes" and ("source", "actual") in lab
                   for n, lab in s)
    assert value(s, "vlaunch_scrape_errors_total", target="vllm", reason="unreachable") == 0
    assert value(s, "vlaunch_engine_restarts_total") == 0
    assert fake.paths and "name%5B%5D=vllm%3Akv_cache_usage_perc" in fake.paths[0]


def test_plan_series(fake):
    s = scrape(ex.Exporter(fake.url, plan=PLAN, gpu_reader=None))
    for component, key in (("weights", "weights_bytes"), ("activation", "activation_bytes"),
                           ("cudagraph", "cudagraph_bytes"), ("non_torch", "non_torch_bytes"),
                           ("kv_cache", "kv_cache_bytes")):
        assert value(s, "vlaunch_plan_memory_bytes", component=component) == \
            getattr(PLAN.pool.per_gpu, key)
    assert value(s, "vlaunch_plan_info", model=MODEL, tp="1", pp="1", dp="2",
                 kv_cache_dtype="auto", max_model_len="1024", vllm_version="0.32.0") == 1


def test_every_family_has_help_text(fake):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=lambda: [
        {"index": 0, "uuid": "GPU-a", "used_bytes": 5, "free_bytes": 5, "total_bytes": 10}])
    exp.set_actual(weights_bytes=61_000_000)
    fams = {f.name: f for f in text_string_to_metric_families(exp.render().decode())}
    expected = {"vlaunch_kv_cache_usage_ratio", "vlaunch_kv_cache_capacity_tokens",
                "vlaunch_kv_cache_used_tokens", "vlaunch_kv_cache_capacity_bytes",
                "vlaunch_kv_cache_max_concurrency", "vlaunch_plan_memory_bytes",
                "vlaunch_prediction_error_ratio", "vlaunch_gpu_memory_bytes", "vlaunch_engine_up",
                "vlaunch_engine_restarts", "vlaunch_scrape_errors",
                "vlaunch_scrape_duration_seconds", "vlaunch_plan_info"}
    assert expected <= set(fams)
    for name in expected:
        assert len(fams[name].documentation) > 20, name


def test_capacity_falls_back_to_blocks_split_over_engines(fake):
    # Without kv_cache_size_tokens, num_gpu_blocks is the DP sum: each engine gets its share.
    fake.body = vllm_page([0.1, 0.2, 0.3, 0.4], size_tokens=[None] * 4, blocks_per_engine=500,
                          block_size=16)
    s = scrape(ex.Exporter(fake.url, plan=PLAN, gpu_reader=None))
    for e in "0123":
        assert value(s, "vlaunch_kv_cache_capacity_tokens", source="actual", engine=e) == 500 * 16


def test_old_vllm_metric_name_and_no_engine_label(fake):
    fake.body = vllm_page([0.75], old_names=True)
    s = scrape(ex.Exporter(fake.url, plan=PLAN, gpu_reader=None))
    assert value(s, "vlaunch_kv_cache_usage_ratio", engine="0") == 0.75


def test_serve_numbers_fill_what_vllm_does_not_report(fake):
    fake.body = vllm_page([0.5], size_tokens=[None], blocks_per_engine=0, max_concurrency=None)
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None)
    exp.set_actual(num_blocks=1000, block_size=64, kv_memory_bytes=300_000_000,
                   weights_bytes=66_000_000)
    s = scrape(exp)
    assert value(s, "vlaunch_kv_cache_capacity_tokens", source="actual", engine="0") == 64_000
    assert value(s, "vlaunch_kv_cache_used_tokens", engine="0") == 32_000
    assert value(s, "vlaunch_kv_cache_capacity_bytes", source="actual", engine="0") == 300_000_000
    # No concurrency label from vLLM: capacity / max_model_len, as vLLM computes it.
    assert value(s, "vlaunch_kv_cache_max_concurrency", source="actual",
                 engine="0") == pytest.approx(64_000 / 1024)
    assert value(s, "vlaunch_prediction_error_ratio", quantity="weights") == pytest.approx(0.1)
    with pytest.raises(TypeError):
        exp.set_actual(kv_tokenz=1)


def test_vllm_reported_kv_bytes(fake):
    fake.body = vllm_page([0.5], mem_bytes="268435456")
    s = scrape(ex.Exporter(fake.url, plan=PLAN, gpu_reader=None))
    assert value(s, "vlaunch_kv_cache_capacity_bytes", source="actual", engine="0") == 268435456


def _assert_engine_series_dropped(s: dict) -> None:
    assert value(s, "vlaunch_engine_up") == 0
    assert not names(s) & ENGINE_SERIES
    for n, lab in s:
        assert ("source", "actual") not in lab, n
        assert ("quantity", "kv_tokens") not in lab, n
    # What does not come from the engine stays: the plan, and the exporter keeps serving.
    assert value(s, "vlaunch_kv_cache_capacity_tokens", source="planned") == 77_672
    assert value(s, "vlaunch_plan_info", model=MODEL, tp="1", pp="1", dp="2",
                 kv_cache_dtype="auto", max_model_len="1024", vllm_version="0.32.0") == 1


def test_engine_down_drops_series_not_freezes(fake):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0)
    before = scrape(exp)
    assert value(before, "vlaunch_kv_cache_usage_ratio", engine="1") == 0.5
    fake.stop()
    s = scrape(exp)
    _assert_engine_series_dropped(s)
    assert value(s, "vlaunch_scrape_errors_total", target="vllm", reason="unreachable") == 1
    scrape(exp)
    s = scrape(exp)
    assert value(s, "vlaunch_scrape_errors_total", target="vllm", reason="unreachable") == 3


@pytest.mark.parametrize(
    ("mode", "body", "reason"),
    [
        ("ok", 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} not-a-number\n', "malformed"),
        ("ok", 'vllm:kv_cache_usage_perc{engine="0" 0.5\n', "malformed"),
        ("ok", "<html><body>502 Bad Gateway</body></html>", "missing_metrics"),
        ("ok", "", "missing_metrics"),
        ("http500", "", "http_status"),
        ("garbage_http", "", "malformed"),
    ],
)
def test_malformed_answers(fake, mode, body, reason):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0)
    assert value(scrape(exp), "vlaunch_engine_up") == 1
    fake.mode, fake.body = mode, body
    s = scrape(exp)
    _assert_engine_series_dropped(s)
    assert value(s, "vlaunch_scrape_errors_total", target="vllm", reason=reason) == 1


@pytest.mark.parametrize("mode", ["slow", "trickle"])
def test_slow_vllm_times_out(fake, mode):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0, timeout_s=0.3)
    fake.body = vllm_page([0.5] * 8)  # big enough that trickling it takes many seconds
    fake.mode, fake.delay_s = mode, 1.0 if mode == "slow" else 0.05
    s = scrape(exp)
    _assert_engine_series_dropped(s)
    assert value(s, "vlaunch_scrape_errors_total", target="vllm", reason="timeout") == 1


def test_recovers_after_outage(fake):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0)
    port = fake.server.server_port
    fake.stop()
    assert value(scrape(exp), "vlaunch_engine_up") == 0
    again = FakeVllm(body=vllm_page([0.9])).start(port)
    try:
        s = scrape(exp)
        assert value(s, "vlaunch_engine_up") == 1
        assert value(s, "vlaunch_kv_cache_usage_ratio", engine="0") == 0.9
    finally:
        again.stop()


def test_restarts_counted_from_start_time_and_from_serve(fake):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0)
    fake.body = vllm_page([0.1], start_time=1000.0)
    scrape(exp)
    scrape(exp)
    fake.body = vllm_page([0.1], start_time=2000.0)
    assert value(scrape(exp), "vlaunch_engine_restarts_total") == 1
    exp.record_restart()
    assert value(scrape(exp), "vlaunch_engine_restarts_total") == 2


def test_cache_ttl_reuses_one_fetch(fake):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=60)
    scrape(exp)
    fake.body = vllm_page([0.99, 0.99])
    s = scrape(exp)
    assert fake.hits == 1
    assert value(s, "vlaunch_kv_cache_usage_ratio", engine="0") == 0.25


def test_gpu_series_and_gpu_failures(fake):
    total = 150_754_820_096
    state = {"fail": False}

    class Dev:  # attribute-style records, as an inventory dataclass would give
        def __init__(self, i: int):
            self.index, self.uuid = i, f"GPU-{i}"
            self.used_bytes, self.free_bytes, self.total_bytes = 100, total - 100, total

    def reader():
        if state["fail"]:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return [Dev(i) for i in range(8)]

    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=reader, cache_ttl_s=0)  # no GPU cache
    s = scrape(exp)
    for i in range(8):
        assert value(s, "vlaunch_gpu_memory_bytes", gpu=str(i), uuid=f"GPU-{i}", kind="total") \
            == total
        assert value(s, "vlaunch_gpu_memory_bytes", gpu=str(i), uuid=f"GPU-{i}", kind="used") == 100
    state["fail"] = True
    s = scrape(exp)
    assert "vlaunch_gpu_memory_bytes" not in names(s)
    assert value(s, "vlaunch_scrape_errors_total", target="gpu", reason="read_failed") == 1
    assert value(s, "vlaunch_engine_up") == 1


def test_no_gpu_reader_no_gpu_series(fake):
    s = scrape(ex.Exporter(fake.url, plan=PLAN, gpu_reader=None))
    assert "vlaunch_gpu_memory_bytes" not in names(s)
    assert not any(("target", "gpu") in lab for _, lab in s)


def test_gpu_record_spellings():
    r = ex.to_gpu_record({"index": 3, "uuid": "GPU-x", "used": 40, "total": 100})
    assert (r.index, r.used_bytes, r.free_bytes, r.total_bytes) == (3, 40, 60, 100)
    with pytest.raises(ValueError):
        ex.to_gpu_record({"uuid": "GPU-x"})


def test_default_gpu_reader_follows_inventory(monkeypatch):
    broken = types.ModuleType("launcher.inputs.inventory")

    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    broken.read_inventory = lambda timeout_s=5.0: fail()
    monkeypatch.setitem(sys.modules, "launcher.inputs.inventory", broken)
    assert ex.default_gpu_reader() is None
    working = types.ModuleType("launcher.inputs.inventory")
    # The shape of launcher.inputs.inventory: Inventory.devices of Device records; an unreadable
    # device (error set) has zeros for memory and is left out.
    working.read_inventory = lambda timeout_s=5.0: types.SimpleNamespace(devices=[
        types.SimpleNamespace(index=0, uuid="GPU-0", used_bytes=1, free_bytes=9, total_bytes=10,
                              error=None),
        types.SimpleNamespace(index=1, uuid="GPU-1", used_bytes=0, free_bytes=0, total_bytes=0,
                              error="NVML_ERROR_GPU_IS_LOST")])
    monkeypatch.setitem(sys.modules, "launcher.inputs.inventory", working)
    reader = ex.default_gpu_reader()
    assert reader is not None
    assert [ex.to_gpu_record(r).uuid for r in reader()] == ["GPU-0"]


def test_no_plan_no_plan_series(fake):
    s = scrape(ex.Exporter(fake.url, gpu_reader=None))
    assert value(s, "vlaunch_kv_cache_usage_ratio", engine="0") == 0.25
    assert not names(s) & {"vlaunch_plan_info", "vlaunch_plan_memory_bytes"}
    assert not any(("source", "planned") in lab for _, lab in s)


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://x/metrics", "http://", ""])
def test_bad_vllm_url(url):
    with pytest.raises(InputError):
        ex.metrics_url(url)


def test_metrics_url_forms():
    assert ex.metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert ex.metrics_url("http://h:8000/metrics/") == "http://h:8000/metrics"


def test_http_server_keeps_serving_while_vllm_is_down(fake):
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0)
    port = exp.start(0, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert "vlaunch_engine_up 1.0" in urllib.request.urlopen(url, timeout=5).read().decode()
        fake.stop()
        for _ in range(3):
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            assert "vlaunch_engine_up 0.0" in text
        with pytest.raises(InputError):  # the port is taken now
            ex.Exporter(fake.url, gpu_reader=None).start(port, "127.0.0.1")
    finally:
        exp.stop()


def _vlaunch(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.parametrize(("args", "needle"), [
    (["--vllm-url", "not a url"], "--vllm-url"),
    (["--vllm-url", "http://127.0.0.1:1", "--plan", "/nonexistent/plan.json"], "no plan at"),
])
def test_cli_errors_are_one_line(args, needle):
    proc = _vlaunch("exporter", *args)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_serves_and_stops_on_sigterm(fake, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(dump(PLAN)))
    proc = _vlaunch("exporter", "--vllm-url", fake.url, "--plan", str(plan), "--port", "0",
                    "--bind", "127.0.0.1", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert m, line
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=10).read()
        samples = {(s.name, frozenset(s.labels.items())): s.value
                   for f in text_string_to_metric_families(text.decode()) for s in f.samples}
        assert value(samples, "vlaunch_kv_cache_usage_ratio", engine="1") == 0.5
        assert value(samples, "vlaunch_kv_cache_capacity_tokens", source="planned") == 77_672
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


# ---- the deadline covers the whole fetch (issue 13 item 16) ----------------------------------


class RawServer:
    """A TCP server that misbehaves below HTTP: `stall` accepts and never answers; `drip`
    sends a status line and headers one byte at a time, never finishing them."""

    def __init__(self, mode: str, byte_every_s: float = 0.05):
        self.mode, self.byte_every_s = mode, byte_every_s
        self.stop = threading.Event()
        self.finished = threading.Event()  # it got to the end of its misbehaviour (30 s / 500 s)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            if self.mode == "stall":
                if not self.stop.wait(30):
                    self.finished.set()
                return
            head = b"HTTP/1.1 200 OK\r\n" + b"X-Padding: " + b"x" * 10_000
            for i in range(len(head)):
                if self.stop.wait(self.byte_every_s):
                    return
                try:
                    conn.sendall(head[i:i + 1])
                except OSError:
                    return
            self.finished.set()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("mode", ["stall", "drip"])
def test_deadline_covers_headers(mode):
    # A server that drips its headers byte by byte never trips a per-read socket timeout:
    # only a deadline on the whole fetch ends the scrape on time.
    server = RawServer(mode)
    try:
        exp = ex.Exporter(server.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0, timeout_s=0.5)
        s = scrape(exp)
        cut_short = not server.finished.is_set()
    finally:
        server.close()
    # The scrape returned while the server was still misbehaving: the deadline ended it.
    assert cut_short, "the scrape outlasted the server's 30 s: no deadline on the whole fetch"
    _assert_engine_series_dropped(s)
    assert value(s, "vlaunch_scrape_errors_total", target="vllm", reason="timeout") == 1


def test_deadline_covers_name_resolution(monkeypatch):
    # getaddrinfo takes no timeout at all; a hung resolver must not hold the scrape.
    real = socket.getaddrinfo
    asked, answer = threading.Event(), threading.Event()

    def hung_resolver(host, *args, **kw):
        if host == "vllm.slow-dns.test":
            asked.set()
            answer.wait(60)  # answers only when the test says so
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", hung_resolver)
    exp = ex.Exporter("http://vllm.slow-dns.test:8000", gpu_reader=None, cache_ttl_s=0,
                      timeout_s=0.3)
    try:
        s = scrape(exp)
        assert asked.is_set(), "the fetch never resolved the name: the test proves nothing"
    finally:
        answer.set()
    assert value(s, "vlaunch_engine_up") == 0
    assert value(s, "vlaunch_scrape_errors_total", target="vllm", reason="timeout") == 1


@pytest.mark.parametrize("answers", [True, False], ids=["vllm answers", "vllm times out"])
def test_concurrent_scrapes_share_one_fetch(fake, monkeypatch, answers):
    """A scrape that arrives while a fetch is in flight waits for that fetch (one request to
    vLLM, one timeout at most), not for a lock and a fetch of its own (one timeout each)."""
    joined = threading.Event()

    class Done(threading.Event):
        """The fetch's "done" event, telling the test when a second scrape waits on it."""

        def wait(self, timeout: float | None = None) -> bool:
            joined.set()
            return super().wait(timeout)

    flight = ex._Flight
    monkeypatch.setattr(ex, "_Flight", lambda: flight(done=Done()))
    fake.mode = "hold"
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0,
                      timeout_s=30 if answers else 0.5)
    results: list[dict] = []
    first = threading.Thread(target=lambda: results.append(scrape(exp)))
    first.start()
    assert fake.entered.wait(30), "the first scrape never reached vLLM"
    second = threading.Thread(target=lambda: results.append(scrape(exp)))
    second.start()
    assert joined.wait(30), "the second scrape did not join the fetch in flight"
    if answers:
        fake.release.set()
    first.join(30)
    second.join(30)
    assert len(results) == 2
    assert fake.hits == 1
    for s in results:
        assert value(s, "vlaunch_engine_up") == (1 if answers else 0)


def test_set_actual_does_not_wait_for_a_slow_vllm(fake):
    """While a fetch is held in flight (vLLM has not answered and will not until released),
    serve's calls return: they never queue behind vLLM."""
    fake.mode = "hold"
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0, timeout_s=60)
    scraping = threading.Thread(target=exp.render)
    scraping.start()
    assert fake.entered.wait(30), "the scrape never reached vLLM"
    returned = threading.Event()

    def serve_calls() -> None:
        exp.set_actual(kv_tokens=1)
        exp.record_restart()
        returned.set()

    threading.Thread(target=serve_calls, daemon=True).start()
    held = returned.wait(30)
    assert scraping.is_alive(), "the fetch ended early: the test proves nothing"
    fake.release.set()
    scraping.join(30)
    assert held, "set_actual/record_restart waited for vLLM's answer"


def test_loopback_bypasses_the_proxy(fake, monkeypatch):
    # A proxy cannot reach this machine's loopback: through one, a local vLLM looks down.
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    s = scrape(ex.Exporter(fake.url, plan=PLAN, gpu_reader=None))
    assert value(s, "vlaunch_engine_up") == 1
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.53"):
        assert scrapeclient._proxy_for("http", host) is None, host
    assert scrapeclient._proxy_for("http", "vllm.remote.test").port == 9


def test_remote_vllm_goes_through_the_proxy(fake, monkeypatch):
    # The fake stands in for the proxy: it receives the absolute URL of the remote server.
    monkeypatch.setenv("http_proxy", fake.url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    s = scrape(ex.Exporter("http://vllm.remote.test:8000", plan=PLAN, gpu_reader=None))
    assert value(s, "vlaunch_engine_up") == 1
    assert fake.paths[0].startswith("http://vllm.remote.test:8000/metrics?")


# ---- the start-up phase (issue 13 item 17) ---------------------------------------------------


def test_engine_is_starting_until_it_first_answers(fake):
    port = fake.server.server_port
    fake.stop()
    exp = ex.Exporter(f"http://127.0.0.1:{port}", plan=PLAN, gpu_reader=None, cache_ttl_s=0)
    s = scrape(exp)
    assert (value(s, "vlaunch_engine_up"), value(s, "vlaunch_engine_starting")) == (0, 1)
    again = FakeVllm(body=vllm_page([0.5])).start(port)
    try:
        s = scrape(exp)
        assert (value(s, "vlaunch_engine_up"), value(s, "vlaunch_engine_starting")) == (1, 0)
    finally:
        again.stop()
    # Down after it served: down, not starting (the alert fires).
    s = scrape(exp)
    assert (value(s, "vlaunch_engine_up"), value(s, "vlaunch_engine_starting")) == (0, 0)
    # serve restarts vLLM: starting again until the new engine answers.
    exp.record_restart()
    s = scrape(exp)
    assert (value(s, "vlaunch_engine_up"), value(s, "vlaunch_engine_starting")) == (0, 1)


def test_starting_ends_at_the_startup_deadline():
    exp = ex.Exporter("http://127.0.0.1:1", plan=PLAN, gpu_reader=None, cache_ttl_s=0,
                      timeout_s=0.2, startup_timeout_s=0.3)
    assert value(scrape(exp), "vlaunch_engine_starting") == 1
    time.sleep(0.4)
    s = scrape(exp)
    assert (value(s, "vlaunch_engine_up"), value(s, "vlaunch_engine_starting")) == (0, 0)


def test_startup_window_is_one_attempt_of_the_plan():
    from launcher.run import emit

    big = dataclasses.replace(PLAN, model=dataclasses.replace(PLAN.model,
                                                              weights_bytes=673_150_611_808))
    exp = ex.Exporter("http://127.0.0.1:1", plan=big, gpu_reader=None,
                      startup_timeout_s=emit.startup_deadline_s)
    want = emit.STARTUP_SECONDS_BASE + 673_150_611_808 / emit.STARTUP_BYTES_PER_SECOND
    assert exp._startup_window() == pytest.approx(want)  # ~3,510 s for DeepSeek-V3
    exp.plan = PLAN  # serve swaps the plan on a re-plan: the window follows it
    assert exp._startup_window() == pytest.approx(
        emit.STARTUP_SECONDS_BASE + 60_000_000 / emit.STARTUP_BYTES_PER_SECOND)
    assert ex.Exporter("http://127.0.0.1:1", gpu_reader=None)._startup_window() == \
        ex.DEFAULT_STARTUP_S


# ---- bounded labels and series (issue 13 item 18) --------------------------------------------


def _usage_line(engine: str, model: str = MODEL, value_: float = 0.5) -> str:
    return f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="{model}"}} {value_}\n'


def _info_line(engine: str) -> str:
    return ('vllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'enable_prefix_caching="True",gpu_memory_utilization="0.9",'
            f'kv_cache_size_tokens="4096",num_gpu_blocks="256",engine="{engine}"}} 1.0\n')


def test_twenty_thousand_engines_are_bounded_and_counted(fake):
    n = 20_000
    fake.body = ("# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
                 "# TYPE vllm:kv_cache_usage_perc gauge\n"
                 + "".join(_usage_line(str(e)) for e in range(n))
                 + "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                 "# TYPE vllm:cache_config_info gauge\n"
                 + "".join(_info_line(str(e)) for e in range(n))).encode()
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0, timeout_s=20)
    t0 = time.monotonic()
    text = exp.render()
    took = time.monotonic() - t0
    s = {(f.name, s.name, frozenset(s.labels.items())): s.value
         for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    kept = vllmpage.MAX_SERIES_PER_FAMILY
    usage = [k for k in s if k[1] == "vlaunch_kv_cache_usage_ratio"]
    capacity = [k for k in s if k[1] == "vlaunch_kv_cache_capacity_tokens"
                and ("source", "actual") in k[2]]
    assert len(usage) == kept and len(capacity) == kept
    dropped = {dict(k[2])["reason"]: v for k, v in s.items()
               if k[1] == "vlaunch_exporter_dropped_series_total"}
    assert dropped == {"too_many_series": 2 * (n - kept), "label_too_long": 0}
    assert value(scrape(exp), "vlaunch_engine_up") == 1
    assert took < 5.0, f"one scrape of 20,000 engines took {took:.1f}s"
    assert len(text) < 2_000_000


def test_a_30mb_label_is_skipped_in_bounded_memory_and_counted(fake):
    huge = "x" * (30 * 1024 * 1024)
    long_engine = "e" * (vllmpage.MAX_LABEL_CHARS + 1)
    fake.body = (vllm_page([0.25, 0.5]) + _usage_line("2", model=huge)
                 + _usage_line(long_engine)).encode()
    exp = ex.Exporter(fake.url, plan=PLAN, gpu_reader=None, cache_ttl_s=0, timeout_s=20)
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        s = scrape(exp)
        took = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert value(s, "vlaunch_engine_up") == 1
    assert value(s, "vlaunch_kv_cache_usage_ratio", engine="1") == 0.5
    assert not any(dict(lab).get("engine") in ("2", long_engine) for _, lab in s)
    assert value(s, "vlaunch_exporter_dropped_series_total", reason="label_too_long") == 2
    assert value(s, "vlaunch_exporter_dropped_series_total", reason="too_many_series") == 0
    # The 30 MB never sits in memory at once, nor goes through the text parser.
    assert peak < 8 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB while reading a 30 MB label"
    assert took < 5.0, f"{took:.1f}s"
    # Counted per fetch: a second scrape drops (and counts) it again.
    s = scrape(exp)
    assert value(s, "vlaunch_exporter_dropped_series_total", reason="label_too_long") == 4


def test_page_filter_across_chunk_boundaries():
    # The same page fed in every chunk size keeps the same lines and the same drops.
    page = (vllm_page([0.25, 0.5]) + _usage_line("9", model="y" * 20_000)
            + _usage_line("3")).encode()
    expected = None
    for size in (1, 7, 64, 4096, len(page)):
        f = vllmpage.VllmPage()
        for i in range(0, len(page), size):
            f.feed(page[i:i + size])
        f.close()
        got = (f.lines, f.dropped)
        expected = expected or got
        assert got == expected, size
    assert expected[1]["label_too_long"] == 1
    assert any('engine="3"' in line for line in expected[0])
