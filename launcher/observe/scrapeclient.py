"""The exporter's HTTP client for vLLM's /metrics: one GET, bounded as a whole by a deadline.

Why its own client rather than urllib's: a socket timeout bounds each blocking call, not the
exchange, so a server that accepts and then drips its headers a byte at a time, or a resolver
that hangs, could hold a scrape far past its deadline. Here the exchange runs on a worker
thread, the caller waits at most `timeout_s`, and the socket is shut down on the way out. A
proxy from the environment is used as urllib would, except for loopback (a proxy cannot reach
this machine's own loopback). Failures are `ScrapeError`s with a reason the exporter counts.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import ipaddress
import re
import socket
import threading
import time
import urllib.parse
import urllib.request

from ..errors import InputError
from .vllmpage import READ_CHUNK, ScrapeError, VllmPage

# vLLM's /metrics with many engines and histograms is a few hundred KB; anything far larger is
# not a vLLM metrics page and is refused rather than parsed.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Redirects followed within one deadline (vLLM's own /metrics does not redirect; a proxy may).
MAX_REDIRECTS = 3
# Fetch threads that may still be blocked (in a resolver that ignores our deadline) before new
# fetches are refused outright instead of piling up more threads.
MAX_STUCK_FETCHES = 8


def without_credentials(url: str) -> str:
    """`url` with any `user:password@` removed: what vlaunch may print or keep."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def metrics_url(vllm_url: str) -> str:
    """`http://host:8000` (or with a trailing `/metrics`) -> the /metrics URL; InputError else.

    Credentials embedded in the URL (`http://user:pw@host`) are dropped here, so that no
    message, log line or label can ever show them: vLLM's /metrics needs none, and the fetch
    never sent them (a proxy's own credentials come from the proxy variables, as before)."""
    url = vllm_url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
        raise InputError(
            f"--vllm-url {without_credentials(vllm_url)[:200]!r} is not an http(s) URL; "
            "pass the server's base URL, e.g. http://127.0.0.1:8000"
        )
    url = without_credentials(url)
    return url if url.endswith("/metrics") else url + "/metrics"


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default



_fetch_slots = threading.BoundedSemaphore(MAX_STUCK_FETCHES)
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _proxy_for(scheme: str, host: str) -> urllib.parse.SplitResult | None:
    """The proxy urllib would use for `host`, except on loopback: a proxy cannot reach this
    machine's own loopback, so through one a local vLLM would look down (issue 13 item 6)."""
    if _is_loopback(host):
        return None
    proxy = urllib.request.getproxies().get(scheme)
    if not proxy or urllib.request.proxy_bypass(host):
        return None
    return urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")


class _Exchange:
    """One GET of vLLM's page, run in a worker thread so that the caller's deadline covers all
    of it: name resolution (which no socket timeout bounds), connect, TLS, headers, body.
    `abort()` shuts the socket down so a worker blocked in a read ends at once."""

    def __init__(self, url: str, deadline: float, timeout_s: float,
                 keep_raw: bool = False) -> None:
        self.url = url
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.page = VllmPage(keep_raw=keep_raw)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def run(self) -> None:
        try:
            self._get()
        except BaseException as e:  # handed to the caller, who classifies it
            self.error = e
        finally:
            self.done.set()
            if self._conn is not None:
                self._conn.close()
            _fetch_slots.release()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _check(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or self._aborted:
            raise ScrapeError("timeout", f"{self.url} took longer than {self.timeout_s:g}s")
        return remaining

    def _open(self, url: str) -> http.client.HTTPResponse:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        proxy = _proxy_for(parts.scheme, host)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = {"Accept": "text/plain"}
        https = parts.scheme == "https"
        timeout = self._check()
        if proxy is None:
            conn_cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
            conn = conn_cls(host, parts.port, timeout=timeout)
        else:
            auth = {}
            if proxy.username:
                token = f"{urllib.parse.unquote(proxy.username)}:" \
                        f"{urllib.parse.unquote(proxy.password or '')}"
                auth["Proxy-Authorization"] = "Basic " + base64.b64encode(token.encode()).decode()
            proxy_port = proxy.port or (443 if proxy.scheme == "https" else 80)
            if https:  # CONNECT through the proxy, TLS end to end
                conn = http.client.HTTPSConnection(proxy.hostname or "", proxy_port,
                                                   timeout=timeout)
                conn.set_tunnel(host, parts.port, headers=auth)
            else:  # a plain proxy takes the absolute URL
                conn = http.client.HTTPConnection(proxy.hostname or "", proxy_port,
                                                  timeout=timeout)
                headers.update(auth)
                path = url
        with self._lock:
            if self._aborted:
                self._check()
            self._conn = conn
        conn.connect()
        self._check()
        conn.request("GET", path, headers=headers)
        return conn.getresponse()

    def _get(self) -> None:
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            resp = self._open(url)
            location = resp.getheader("Location")
            if resp.status in (301, 302, 303, 307, 308) and location:
                url = urllib.parse.urljoin(url, location)
                if _origin(url) != _origin(self.url):
                    # Another host, port or scheme is not the vLLM we were pointed at: a page
                    # from there would be parsed as its metrics (and a loopback-only service
                    # reached on the exporter's behalf). Same-origin moves are still followed.
                    raise ScrapeError("http_status", f"{self.url} redirects to another origin "
                                      f"({without_credentials(url)[:200]}); not followed")
                with self._lock:
                    conn, self._conn = self._conn, None
                if conn is not None:
                    conn.close()
                continue
            if resp.status != 200:
                raise ScrapeError("http_status", f"{url} answered HTTP {resp.status}")
            size = 0
            while True:
                self._check()
                chunk = resp.read1(READ_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ScrapeError("malformed", f"{url} sent more than {MAX_BODY_BYTES} bytes")
                self.page.feed(chunk)
            self.page.close()
            return
        raise ScrapeError("http_status", f"{self.url} redirected more than {MAX_REDIRECTS} times")


def fetch_page(url: str, timeout_s: float, keep_raw: bool = False) -> VllmPage:
    """GET `url` and keep the lines the exporter uses, all within `timeout_s`.

    The deadline covers the whole exchange, not each blocking call: a server that accepts and
    then says nothing, drips its headers a byte at a time or trickles its body, and a resolver
    that hangs, all end the fetch at `timeout_s` with ScrapeError("timeout").
    """
    deadline = time.monotonic() + timeout_s
    if not _fetch_slots.acquire(blocking=False):
        raise ScrapeError("timeout", f"{MAX_STUCK_FETCHES} earlier fetches have not returned yet")
    exchange = _Exchange(url, deadline, timeout_s, keep_raw)
    try:
        threading.Thread(target=exchange.run, name="vlaunch-exporter-fetch", daemon=True).start()
    except BaseException:
        _fetch_slots.release()
        raise
    if not exchange.done.wait(timeout_s):
        exchange.abort()
        raise ScrapeError("timeout", f"{url} took longer than {timeout_s:g}s")
    e = exchange.error
    if e is None:
        return exchange.page
    if isinstance(e, ScrapeError):
        raise e
    if isinstance(e, http.client.HTTPException):
        raise ScrapeError("malformed", f"{url} broke HTTP ({type(e).__name__})") from None
    if isinstance(e, TimeoutError) or "timed out" in str(e):
        raise ScrapeError("timeout", f"{url} took longer than {timeout_s:g}s") from None
    if isinstance(e, OSError):
        raise ScrapeError("unreachable", f"{url}: {e.strerror or e}") from None
    raise ScrapeError("malformed", f"{url}: {type(e).__name__}: {e}") from None

