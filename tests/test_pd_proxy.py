"""The one-machine P/D proxy (launcher/run/pd_proxy.py) against stand-in engines on loopback:
the protocol's two hops, streaming, and errors, timeouts and bounds answered, never hung."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from launcher.run.pd_proxy import Limits, PDProxy, Upstream, decode_body, prefill_body


class _Engine(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, role: str, behaviour: str = "ok") -> None:
        self.role, self.behaviour, self.seen = role, behaviour, []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Engine

    def log_message(self, *a):  # noqa: ARG002
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._send(200, {"object": "list", "data": [{"id": "m"}], "role": self.server.role})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.headers.get("X-Request-Id"), body))
        b = self.server.behaviour
        if b == "hang":
            time.sleep(5)
            return
        if b == "fail":
            self._send(500, {"error": {"message": "EngineCore died"}})
            return
        if self.server.role == "prefill":
            self._send(200, {"choices": [{"text": "x"}],
                             "kv_transfer_params": {"remote_engine_id": "p0",
                                                    "remote_block_ids": [1, 2, 3]}})
            return
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {{\"i\": {i}}}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self._send(200, {"choices": [{"text": " a b"}], "usage": {"completion_tokens": 2}})


@contextmanager
def _deployment(prefill: str = "ok", decode: str = "ok", limits: Limits | None = None):
    engines = [_Engine("prefill", prefill), _Engine("decode", decode)]
    for e in engines:
        threading.Thread(target=e.serve_forever, daemon=True).start()
    proxy = PDProxy(Upstream("127.0.0.1", engines[0].server_port),
                    Upstream("127.0.0.1", engines[1].server_port), limits=limits).start()
    try:
        yield proxy, engines[0], engines[1]
    finally:
        proxy.shutdown()
        for e in engines:
            e.shutdown()
            e.server_close()


def _post(port: int, body: dict, timeout: float = 10) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_two_hops_follow_vllms_protocol():
    with _deployment() as (proxy, pre, dec):
        status, body = _post(proxy.server_port, {"model": "m", "prompt": "hi", "max_tokens": 9,
                                                 "stream": False})
        assert status == 200 and json.loads(body)["choices"][0]["text"] == " a b"
        (pid, p_body), = pre.seen
        (did, d_body), = dec.seen
        assert pid == did and pid  # one request id on both hops
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert p_body["kv_transfer_params"]["do_remote_decode"] is True
        assert d_body["max_tokens"] == 9  # the client's own request
        assert d_body["kv_transfer_params"] == {"remote_engine_id": "p0",
                                                "remote_block_ids": [1, 2, 3]}
        assert proxy.served == 1


def test_a_stream_is_relayed_as_it_arrives():
    with _deployment() as (proxy, _, dec):
        status, body = _post(proxy.server_port, {"model": "m", "prompt": "hi", "stream": True})
        assert status == 200
        assert body.count(b"data: ") == 4 and body.rstrip().endswith(b"[DONE]")
        assert dec.seen[0][1]["stream"] is True


def test_bodies_for_each_hop():
    body = {"model": "m", "messages": [], "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and body["stream"] is True  # the client's body untouched
    assert "kv_transfer_params" not in decode_body(body, None)
    assert decode_body(body, {"a": 1})["kv_transfer_params"] == {"a": 1}


@pytest.mark.parametrize(("prefill", "decode", "code"), [
    ("fail", "ok", 502), ("ok", "fail", 500), ("hang", "ok", 504)])
def test_engine_failures_are_answered(prefill, decode, code):
    limits = Limits(prefill_timeout_s=0.5, idle_timeout_s=0.5)
    with _deployment(prefill, decode, limits) as (proxy, _, _):
        t0 = time.monotonic()
        status, body = _post(proxy.server_port, {"model": "m", "prompt": "hi"})
        assert status == code
        assert time.monotonic() - t0 < 4  # bounded, not the engine's 5 s hang
        if code != 500:  # 500 is the decode engine's own answer, relayed as it came
            assert json.loads(body)["error"]["type"] == "proxy_error"


def test_a_dead_engine_is_a_502():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    proxy = PDProxy(Upstream("127.0.0.1", dead), Upstream("127.0.0.1", dead)).start()
    try:
        status, body = _post(proxy.server_port, {"model": "m", "prompt": "hi"})
        assert status == 502 and b"refused" in body
    finally:
        proxy.shutdown()


def test_bad_requests_and_bounds():
    with _deployment(limits=Limits(max_request_bytes=1000, header_timeout_s=0.5)) as (px, pre, _):
        req = urllib.request.Request(f"http://127.0.0.1:{px.server_port}/v1/completions",
                                     data=b"not json")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 400
        status, _ = _post(px.server_port, {"prompt": "x" * 2000})
        assert status == 413
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{px.server_port}/nowhere", timeout=5)
        assert e.value.code == 404
        # a client that sends half a request is dropped after header_timeout_s
        c = socket.create_connection(("127.0.0.1", px.server_port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        c.settimeout(3)
        assert b"408" in c.recv(200)
        c.close()
        assert pre.seen == []  # nothing malformed reached an engine
        with urllib.request.urlopen(f"http://127.0.0.1:{px.server_port}/v1/models",
                                    timeout=5) as r:
            assert json.loads(r.read())["role"] == "decode"  # listing comes from decode


def test_past_the_connection_cap_is_a_503():
    with _deployment(limits=Limits(max_connections=2, header_timeout_s=3)) as (px, _, _):
        held = [socket.create_connection(("127.0.0.1", px.server_port)) for _ in range(2)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", px.server_port))
        extra.settimeout(3)
        assert b"503" in extra.recv(200)
        for s in [*held, extra]:
            s.close()
