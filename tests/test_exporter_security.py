"""The exporter under attack (issue 23), on loopback only: a redirecting upstream, credentials
in --vllm-url, a stuck NVML, a flood of half-sent requests, and where it listens by default."""

from __future__ import annotations

import http.server
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher.observe import exporter as ex
from launcher.observe.scrapeclient import fetch_page, metrics_url
from launcher.observe.vllmpage import ScrapeError

PAGE = (b"# TYPE vllm:kv_cache_usage_perc gauge\n"
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')


class Upstream:
    """A loopback HTTP server: `routes` maps a path to (status, headers, body); it records the
    paths it was asked for."""

    def __init__(self, routes: dict[str, tuple[int, dict[str, str], bytes]]):
        self.routes, self.hits = routes, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                path = self.path.split("?", 1)[0]
                outer.hits.append(path)
                status, headers, body = outer.routes.get(path, (404, {}, b""))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture()
def upstreams():
    made: list[Upstream] = []

    def make(routes):
        u = Upstream(routes)
        made.append(u)
        return u

    yield make
    for u in made:
        u.close()


def test_a_redirect_to_another_host_or_port_is_not_followed(upstreams):
    elsewhere = upstreams({"/metrics": (200, {}, PAGE)})  # another port: another service
    vllm = upstreams({"/metrics": (302, {"Location": elsewhere.url + "/metrics"}, b"")})
    with pytest.raises(ScrapeError, match="another origin") as e:
        fetch_page(metrics_url(vllm.url), timeout_s=5)
    assert e.value.reason == "http_status"
    assert elsewhere.hits == []  # not fetched, not parsed
    scraped = ex.Exporter(vllm.url, gpu_reader=None, cache_ttl_s=0).render().decode()
    assert 'vlaunch_kv_cache_usage_ratio{' not in scraped and elsewhere.hits == []


def test_a_redirect_within_the_same_server_is_still_followed(upstreams):
    vllm = upstreams({})
    vllm.routes["/metrics"] = (307, {"Location": "/real/metrics"}, b"")
    vllm.routes["/real/metrics"] = (200, {}, PAGE)
    page = fetch_page(metrics_url(vllm.url), timeout_s=5)
    assert vllm.hits == ["/metrics", "/real/metrics"] and page is not None


def test_credentials_in_the_vllm_url_are_never_printed(upstreams, tmp_path):
    secret = secrets.token_hex(12)
    vllm = upstreams({"/metrics": (200, {}, PAGE)})
    with_creds = vllm.url.replace("http://", f"http://admin:{secret}@")
    exp = ex.Exporter(with_creds, gpu_reader=None, cache_ttl_s=0)
    assert secret not in exp.metrics_url
    assert secret not in exp.render().decode()
    dead = ex.Exporter(f"http://admin:{secret}@127.0.0.1:1", gpu_reader=None, cache_ttl_s=0)
    assert secret not in dead.render().decode()
    with pytest.raises(Exception) as e:
        metrics_url(f"ftp://admin:{secret}@host")
    assert secret not in str(e.value)
    # the standalone exporter's banner
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "exporter", "--vllm-url",
                             with_creds, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert "serving http://127.0.0.1:" in line, line  # loopback unless told
        port = re.search(r"127\.0\.0\.1:(\d+)/metrics", line).group(1)
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    assert secret not in line + rest


def test_a_stuck_nvml_stalls_one_scrape_not_every_one():
    release = threading.Event()
    calls = []

    def stuck():
        calls.append(1)
        release.wait(60)
        return []

    exp = ex.Exporter(None, gpu_reader=stuck, timeout_s=0.3, cache_ttl_s=1.0)
    try:
        took = []
        for _ in range(20):
            t0 = time.monotonic()
            exp.render()
            took.append(time.monotonic() - t0)
        assert len(calls) == 1  # one NVML call in flight, never a second one behind it
        assert max(took[1:]) < exp.timeout_s  # only the first scrape waited for it
        errors = [s.value for f in text_string_to_metric_families(exp.render().decode())
                  for s in f.samples if s.name == "vlaunch_scrape_errors_total"
                  and s.labels == {"target": "gpu", "reason": "read_failed"}]
        assert errors and errors[0] >= 20  # every stalled read is counted, none hidden
    finally:
        release.set()


def test_the_exporter_server_survives_a_flood_of_half_sent_requests():
    exp = ex.Exporter(None, gpu_reader=None)
    port = exp.start(0)
    before = threading.active_count()
    slow = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            slow.append(s)
        assert threading.active_count() <= before + 8  # bounded, not one per connection
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b"vlaunch_" in body
    finally:
        for s in slow:
            s.close()
        exp.stop()


def test_the_exporter_listens_on_loopback_unless_told():
    from launcher.cli import cli

    (bind,) = [p for p in cli.commands["exporter"].params if p.name == "bind"]
    assert bind.default == "127.0.0.1"
    exp = ex.Exporter(None, gpu_reader=None)
    port = exp.start(0)
    try:
        assert exp._server._server._listener.getsockname()[0] == "127.0.0.1"
        assert port > 0
    finally:
        exp.stop()


RELAYED = (b"# HELP vllm:num_requests_running Requests running.\n"
           b"# TYPE vllm:num_requests_running gauge\n"
           b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
           b"# TYPE vllm:kv_cache_usage_perc gauge\n"
           b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
           b"# HELP vlaunch_engine_up spoofed\n# TYPE vlaunch_engine_up gauge\n"
           b"vlaunch_engine_up 1.0\n"
           b'vllm:prompt_tokens_total{model_name="m"} 138.0')  # no final newline


def test_the_exporter_relays_vllms_page_so_prometheus_needs_only_its_port(upstreams,
                                                                          monkeypatch):
    """M5 (issue 31): Prometheus is let into the exporter's port only, so the exporter's page
    must carry vLLM's own series, fetched inside the pod; a vlaunch_* line in vLLM's page is
    not relayed (ours would appear twice, or be spoofed), and the joined page parses."""
    up = upstreams({"/metrics": (200, {}, RELAYED)})
    monkeypatch.delenv(ex.RELAY_ENV, raising=False)
    plain = ex.Exporter(up.url, gpu_reader=None).render().decode()
    assert "vllm:num_requests_running" not in plain  # off unless asked: no double counting
    monkeypatch.setenv(ex.RELAY_ENV, "1")
    page = ex.Exporter(up.url, gpu_reader=None).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    assert families["vllm:num_requests_running"].samples[0].value == 3.0
    assert "vllm:prompt_tokens" in families or "vllm:prompt_tokens_total" in families
    up_samples = [s for s in families["vlaunch_engine_up"].samples]
    assert len(up_samples) == 1 and "spoofed" not in page
    assert page.count("# TYPE vlaunch_engine_up") == 1
    assert page.endswith("\n")
    # vLLM down: our page alone, no stale relay
    dead = ex.Exporter("http://127.0.0.1:9", gpu_reader=None, relay_vllm=True, timeout_s=0.5)
    assert not re.search(r"^vllm:", dead.render().decode(), flags=re.M)
