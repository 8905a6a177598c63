"""The exporter's /metrics HTTP server: bounded threads, bounded time per client.

`prometheus_client.start_http_server` runs a thread per connection with no timeout, so 4,000
half-sent requests held 4,002 threads and ~1,000 idle connections made real scrapes time out.
Here one thread reads every request with a selector (an idle or dripping client costs a file
descriptor, not a thread), a request must arrive whole within `header_timeout_s` and
`max_request_bytes`, at most `max_connections` are open (at the cap the oldest client still
sending its request is dropped to make room, so a flood of idle connections cannot lock out a
real scrape, which sends its request at once), and a small fixed pool renders and writes the
answers, each write bounded by `write_timeout_s`.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format 0.0.4
MAX_CONNECTIONS = 64
HEADER_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 8192
WORKERS = 4
_TICK_S = 0.2
_PATHS = ("/metrics", "/")


def _response(status: str, body: bytes, head_only: bool = False) -> bytes:
    header = (f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("ascii")
    return header if head_only else header + body


class BoundedHttpServer:
    """Serve `render()` on GET /metrics at host:port. `server_port`, `shutdown()` and
    `server_close()` as socketserver's servers have them, so the exporter stops it the same
    way."""

    def __init__(self, render: Callable[[], bytes], host: str, port: int, *,
                 max_connections: int = MAX_CONNECTIONS,
                 header_timeout_s: float = HEADER_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S,
                 max_request_bytes: int = MAX_REQUEST_BYTES, workers: int = WORKERS) -> None:
        self.render = render
        self.max_connections = max(1, max_connections)
        self.header_timeout_s = header_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_request_bytes = max_request_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host.strip("[]"), port))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.server_port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # clients still sending their request, oldest first: socket -> (accepted at, bytes)
        self._reading: OrderedDict[socket.socket, tuple[float, bytearray]] = OrderedDict()
        self._answering = 0  # handed to the pool, not yet closed
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers),
                                        thread_name_prefix="vlaunch-metrics")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0  # connections closed unanswered (cap, timeout, oversize)

    def start(self) -> BoundedHttpServer:
        self._thread = threading.Thread(target=self._loop, name="vlaunch-metrics-accept",
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._reading) + self._answering

    # -- the selector loop --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=_TICK_S):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._expire(time.monotonic())

    def _drop(self, sock: socket.socket) -> None:
        self._reading.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()
        self.dropped += 1

    def _accept(self) -> None:
        for _ in range(64):  # a burst is taken in one go, but the loop still ticks
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, etc.: try again on the next tick
                return
            if self.open_connections >= self.max_connections:
                if not self._reading:  # every slot is being answered: no room
                    sock.close()
                    self.dropped += 1
                    continue
                self._drop(next(iter(self._reading)))  # the oldest still-silent client
            sock.setblocking(False)
            self._reading[sock] = (time.monotonic(), bytearray())
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        entry = self._reading.get(sock)
        if entry is None:
            return
        try:
            chunk = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(sock)
            return
        buf = entry[1]
        buf += chunk
        if b"\r\n\r\n" not in buf and b"\n\n" not in buf:
            if len(buf) > self.max_request_bytes:
                self._drop(sock)
            return
        self._reading.pop(sock, None)
        self._selector.unregister(sock)
        with self._lock:
            self._answering += 1
        try:
            self._pool.submit(self._answer, sock, bytes(buf))
        except RuntimeError:  # the pool is shut down
            self._finish(sock)

    def _expire(self, now: float) -> None:
        while self._reading:
            sock, (since, _) = next(iter(self._reading.items()))
            if now - since < self.header_timeout_s:
                return
            self._drop(sock)

    # -- answering (pool threads) -------------------------------------------------------------

    def _finish(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.close()
        with self._lock:
            self._answering -= 1

    def _answer(self, sock: socket.socket, request: bytes) -> None:
        try:
            line = request.split(b"\n", 1)[0].decode("latin-1").strip()
            parts = line.split()
            method = parts[0] if parts else ""
            path = parts[1].split("?", 1)[0] if len(parts) > 1 else ""
            if method not in ("GET", "HEAD"):
                out = _response("405 Method Not Allowed", b"GET /metrics\n")
            elif path not in _PATHS:
                out = _response("404 Not Found", b"GET /metrics\n")
            else:
                try:
                    out = _response("200 OK", self.render(), head_only=method == "HEAD")
                except Exception as e:  # a collector bug: say so, keep serving
                    out = _response("500 Internal Server Error",
                                    f"{type(e).__name__}\n".encode())
            self._send(sock, out)
        finally:
            self._finish(sock)

    def _send(self, sock: socket.socket, data: bytes) -> None:
        """Write within write_timeout_s in all: a client that reads a byte a minute is cut off."""
        deadline = time.monotonic() + self.write_timeout_s
        view = memoryview(data)
        try:
            while view:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                sock.settimeout(remaining)
                sent = sock.send(view[:65536])
                view = view[sent:]
        except OSError:
            return

    # -- stopping -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def server_close(self) -> None:
        self.shutdown()
        for sock in list(self._reading):
            self._drop(sock)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
