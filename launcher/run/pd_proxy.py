"""The one-machine P/D proxy: one completion through a prefill engine, then a decode engine.

vLLM's disaggregated serving needs something in front of the two engines that follows its
protocol (vLLM's `toy_proxy_server.py` in examples/online_serving/disaggregated_serving, and
llm-d's routing sidecar in production):

1. the client's request goes to the prefill engine with `max_tokens` 1, no streaming, and
   `kv_transfer_params` `{"do_remote_decode": true, ...}`: the prefill engine computes the
   prompt's KV, keeps it for the decode engine (or writes it to the connector's store), and
   answers with the `kv_transfer_params` the decode side needs (NixlConnector: the remote
   engine id, block ids, host and port; ExampleConnector: none, the store is shared);
2. the same request goes to the decode engine with those `kv_transfer_params`; its answer,
   streamed or not, is relayed to the client as it arrives.

Both hops carry one `X-Request-Id`, as vLLM's proxy does. The proxy is bounded like the
exporter's server: at most `max_connections` clients (past that an immediate 503), a request must
arrive whole within `header_timeout_s` and `max_request_bytes`, each upstream hop has a connect
timeout and a total deadline, and a relayed stream that goes quiet for `idle_timeout_s` is cut.
An engine that refuses, errs or times out gets the client a JSON error (502 or 504), never a
hang. Production routing (several replicas, KV-aware picking) is llm-d's, not this proxy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

MAX_CONNECTIONS = 256
MAX_REQUEST_BYTES = 8 * 1024 * 1024  # a 100k-token prompt is ~0.4 MB of text; chat adds JSON
MAX_UPSTREAM_HEADER_BYTES = 64 * 1024
HEADER_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
PREFILL_TIMEOUT_S = 600.0  # a long prompt on a busy prefill engine; vLLM has no deadline of its own
IDLE_TIMEOUT_S = 300.0
MAX_PREFILL_ANSWER_BYTES = 16 * 1024 * 1024
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASS_THROUGH = ("/v1/models", "/health", "/metrics", "/version")

# What the prefill hop asks for (vLLM's toy proxy sends the same keys).
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None,
                     "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class Upstream:
    """One engine: where it listens, and the key it wants (vLLM's --api-key), if any."""

    host: str
    port: int
    api_key: str | None = None


@dataclass(frozen=True)
class Limits:
    max_connections: int = MAX_CONNECTIONS
    max_request_bytes: int = MAX_REQUEST_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    prefill_timeout_s: float = PREFILL_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S


class ProxyError(Exception):
    """An upstream failure the client hears about as `status` with a JSON body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 413: "Payload Too Large", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout"}


def error_response(status: int, message: str) -> bytes:
    """An OpenAI-style error body, the shape vLLM's own errors have."""
    body = json.dumps({"error": {"message": message, "type": "proxy_error",
                                 "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill hop's request: one token, no stream, and the ask to keep the KV for decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_params: Any) -> dict[str, Any]:
    """The decode hop's request: the client's own, with what the prefill engine handed over."""
    out = dict(body)
    if isinstance(kv_params, dict):
        out["kv_transfer_params"] = kv_params
    else:
        out.pop("kv_transfer_params", None)
    return out


@dataclass
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


async def _read_request(reader: asyncio.StreamReader, limits: Limits) -> _Request:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limits.header_timeout_s)
    except asyncio.TimeoutError as e:
        raise ProxyError(408, "request headers did not arrive in time") from e
    except asyncio.LimitOverrunError as e:
        raise ProxyError(413, "request headers too large") from e
    except asyncio.IncompleteReadError as e:
        raise ProxyError(400, "connection closed before the request was complete") from e
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3:
        raise ProxyError(400, "malformed request line")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ProxyError(400, "chunked request bodies are not accepted: send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError as e:
        raise ProxyError(400, "Content-Length is not a number") from e
    if length < 0 or length > limits.max_request_bytes:
        raise ProxyError(413, f"request body over {limits.max_request_bytes} bytes")
    try:
        body = await asyncio.wait_for(reader.readexactly(length), limits.header_timeout_s)
    except asyncio.TimeoutError as e:
        raise ProxyError(408, "request body did not arrive in time") from e
    except asyncio.IncompleteReadError as e:
        raise ProxyError(400, "connection closed before the request body was complete") from e
    return _Request(parts[0].upper(), parts[1], headers, body)


class _Hop:
    """One HTTP/1.1 exchange with an engine (Connection: close, so the body ends at EOF)."""

    def __init__(self, up: Upstream, limits: Limits) -> None:
        self.up, self.limits = up, limits
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, method: str, path: str, body: bytes, request_id: str) -> tuple[int, bytes]:
        """Send the request; return the status and the raw response head."""
        try:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(self.up.host, self.up.port), self.limits.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise ProxyError(502, f"engine at {self.up.host}:{self.up.port} refused: {e}") from e
        auth = f"Authorization: Bearer {self.up.api_key}\r\n" if self.up.api_key else ""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.up.host}:{self.up.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"X-Request-Id: {request_id}\r\n{auth}Connection: close\r\n\r\n")
        self.writer.write(head.encode("latin-1") + body)
        await self.writer.drain()
        try:
            raw = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as e:
            raise ProxyError(502, f"engine at {self.up.port} sent no valid answer") from e
        try:
            status = int(raw.split(b" ", 2)[1])
        except (IndexError, ValueError) as e:
            raise ProxyError(502, "engine sent a malformed status line") from e
        return status, raw

    async def read_all(self, cap: int) -> bytes:
        assert self.reader is not None
        data = await self.reader.read(cap + 1)
        chunks = [data]
        total = len(data)
        while data and total <= cap:
            data = await self.reader.read(cap + 1 - total)
            chunks.append(data)
            total += len(data)
        if total > cap:
            raise ProxyError(502, f"engine's answer over {cap} bytes")
        return b"".join(chunks)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _dechunk(raw_head: bytes, body: bytes) -> bytes:
    """The body of a response that may be chunked (vLLM's JSON answers are not, usually)."""
    if b"chunked" not in raw_head.lower():
        return body
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return bytes(out)


class PDProxy:
    """Serve the P/D protocol on host:port in front of one prefill and one decode engine.

    `start()` runs the asyncio loop in a daemon thread and returns once it listens;
    `server_port` is the bound port (0 asks the kernel); `shutdown()` stops it."""

    def __init__(self, prefill: Upstream, decode: Upstream, host: str = "127.0.0.1",
                 port: int = 0, limits: Limits | None = None) -> None:
        self.prefill, self.decode = prefill, decode
        self.host, self.port = host, port
        self.limits = limits or Limits()
        self.server_port = 0
        self.served = 0  # completions prefilled and handed to decode
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- life cycle
    def start(self) -> PDProxy:
        self._thread = threading.Thread(target=self._run, name="pd-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(
                self._client, self.host.strip("[]"), self.port, limit=MAX_UPSTREAM_HEADER_BYTES))
            self.server_port = self._server.sockets[0].getsockname()[1]
        except OSError as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            tasks = asyncio.all_tasks(loop)
            for t in tasks:  # clients still connected: end them before the loop goes
                t.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def shutdown(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # -- one client
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > self.limits.max_connections:
                writer.write(error_response(503, "proxy at its connection limit; retry"))
                await writer.drain()
                return
            try:
                req = await _read_request(reader, self.limits)
                await self._route(req, writer)
            except ProxyError as e:
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write(error_response(e.status, e.message))
                    await writer.drain()
        except (ConnectionError, OSError):
            pass  # the client went away; nothing to answer
        finally:
            self._open -= 1
            with contextlib.suppress(Exception):
                writer.close()

    async def _route(self, req: _Request, writer: asyncio.StreamWriter) -> None:
        path = req.path.split("?", 1)[0]
        if path in COMPLETION_PATHS:
            if req.method != "POST":
                raise ProxyError(405, f"{path} takes POST")
            await self._completion(path, req, writer)
        elif path in PASS_THROUGH and req.method == "GET":
            await self._relay(self.decode, "GET", req.path, b"", str(uuid.uuid4()), writer)
        else:
            raise ProxyError(404, f"no route {req.method} {path}")

    async def _completion(self, path: str, req: _Request, writer: asyncio.StreamWriter) -> None:
        try:
            body = json.loads(req.body or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise ProxyError(400, f"request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object")
        request_id = req.headers.get("x-request-id") or str(uuid.uuid4())
        kv_params = await self._prefill(path, body, request_id)
        payload = json.dumps(decode_body(body, kv_params)).encode()
        self.served += 1  # prefilled and handed to decode
        await self._relay(self.decode, "POST", path, payload, request_id, writer)

    async def _prefill(self, path: str, body: dict[str, Any], request_id: str) -> Any:
        hop = _Hop(self.prefill, self.limits)

        async def exchange() -> Any:
            status, head = await hop.send("POST", path, json.dumps(prefill_body(body)).encode(),
                                          request_id)
            raw = _dechunk(head, await hop.read_all(MAX_PREFILL_ANSWER_BYTES))
            if status != 200:
                said = raw[:300].decode("utf-8", "replace")
                raise ProxyError(502 if status >= 500 else status,
                                 f"prefill engine answered {status}: {said}")
            try:
                return json.loads(raw).get("kv_transfer_params")
            except (ValueError, AttributeError) as e:
                raise ProxyError(502, "prefill engine's answer is not a JSON object") from e

        try:
            return await asyncio.wait_for(exchange(), self.limits.prefill_timeout_s)
        except asyncio.TimeoutError as e:
            raise ProxyError(504, f"prefill engine did not answer in "
                                  f"{self.limits.prefill_timeout_s:g} s") from e
        finally:
            hop.close()

    async def _relay(self, up: Upstream, method: str, path: str, payload: bytes,
                     request_id: str, writer: asyncio.StreamWriter) -> None:
        """Copy the engine's answer to the client as it arrives (a stream stays a stream)."""
        hop = _Hop(up, self.limits)
        try:
            try:
                _, head = await asyncio.wait_for(hop.send(method, path, payload, request_id),
                                                 self.limits.idle_timeout_s)
            except asyncio.TimeoutError as e:
                raise ProxyError(504, "decode engine did not start answering in "
                                      f"{self.limits.idle_timeout_s:g} s") from e
            writer.write(head)
            assert hop.reader is not None
            while True:
                try:
                    chunk = await asyncio.wait_for(hop.reader.read(65536),
                                                   self.limits.idle_timeout_s)
                except asyncio.TimeoutError:
                    return  # headers are sent: cutting the connection is the only answer left
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
        finally:
            hop.close()

