"""A Prometheus exporter that puts vLLM's KV cache next to what vlaunch planned for it.

Why a separate exporter: vLLM reports how full its KV cache is, but not how big the cache is in a
form a dashboard can use (capacity hides in the labels of `vllm:cache_config_info`), and nothing
in vLLM knows what the plan predicted. This module joins the three sources at scrape time:

- the plan (a `Plan.to_dict()` dict): planned capacity, the per-GPU memory budget, plan info;
- vLLM's own `/metrics` (fetched on every scrape of ours, cached for a short TTL): usage ratio and
  actual capacity per engine (the `engine` label is vLLM's DP engine index);
- the GPUs, through a `gpu_reader` callable (NVML via `launcher.inputs.inventory` by default).

Values are computed in `collect()` (a custom Collector), so nothing is ever frozen: when vLLM is
down, slow or answers garbage, `vlaunch_engine_up` is 0, the engine-derived series disappear
instead of repeating their last value, an error is counted, and the exporter keeps serving.
Until vLLM first answers after a (re)start, within one start-up attempt's deadline,
`vlaunch_engine_starting` is 1: a long model load is not an outage (the EngineDown alert
ignores it). Each fetch of vLLM's page is bounded as a whole (name resolution to last byte) by
`timeout_s`, concurrent scrapes share one fetch, and what is taken from the page is bounded
(line length, series per family, label length), with what was left out counted.

Usable in-process (`vlaunch serve` builds an `Exporter`, calls `start()` and, once the engine
is up, `set_actual(...)` with the numbers vLLM logged) and standalone (`vlaunch exporter`).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import importlib
import ipaddress
import math
import re
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from ..errors import InputError

DEFAULT_PORT = 9400
DEFAULT_BIND = "0.0.0.0"
DEFAULT_TIMEOUT_S = 2.0
# Short enough that a dashboard never sees a value older than one Prometheus scrape interval,
# long enough that several Prometheus replicas scraping together hit vLLM once.
DEFAULT_CACHE_TTL_S = 1.0
# How long an engine that has not answered yet counts as starting when there is no plan to
# derive it from (the runner's default start-up deadline).
DEFAULT_STARTUP_S = 900.0
# vLLM's /metrics with many engines and histograms is a few hundred KB; anything far larger is
# not a vLLM metrics page and is refused rather than parsed.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Bounds on what is taken from vLLM's page (issue 13 item 18): a line of a family we use is a
# few hundred bytes (cache_config_info, two dozen short labels), an engine label a DP index.
# Beyond these the series is dropped and counted, so a broken or hostile page cannot make a
# scrape slow (the text parser needs ~0.1 s per MB) or the exporter's own output unbounded.
MAX_LINE_BYTES = 8192
MAX_SERIES_PER_FAMILY = 1024
MAX_LABEL_CHARS = 128
DROP_REASONS = ("label_too_long", "too_many_series")
# Redirects followed within one deadline (vLLM's own /metrics does not redirect; a proxy may).
MAX_REDIRECTS = 3
# Fetch threads that may still be blocked (in a resolver that ignores our deadline) before new
# fetches are refused outright instead of piling up more threads.
MAX_STUCK_FETCHES = 8
_READ_CHUNK = 65536

USAGE_FAMILIES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
CACHE_INFO_FAMILY = "vllm:cache_config_info"
START_TIME_FAMILY = "process_start_time_seconds"
_NEEDED = (*USAGE_FAMILIES, CACHE_INFO_FAMILY, START_TIME_FAMILY)

# Only the lines of the families above (samples and their HELP/TYPE) are handed to the parser:
# vLLM's page is mostly histogram buckets we do not use, and parsing all of it took ~60 ms for 8
# engines. A pattern that starts with a literal newline lets `re` skip between lines quickly.
_NEEDED_LINES = re.compile(
    rb"\n((?:# (?:HELP|TYPE) )?("
    + b"|".join(re.escape(n.encode()) for n in _NEEDED)
    + rb")[ {][^\n]*)"
)
_NEEDED_START = re.compile(rb"(?:# (?:HELP|TYPE) )?(?:"
                           + b"|".join(re.escape(n.encode()) for n in _NEEDED) + rb")[ {]")


PLAN_COMPONENTS = {
    "weights": "weights_bytes",
    "activation": "activation_bytes",
    "cudagraph": "cudagraph_bytes",
    "non_torch": "non_torch_bytes",
    "kv_cache": "kv_cache_bytes",
}
VLLM_ERROR_REASONS = ("unreachable", "timeout", "http_status", "malformed", "missing_metrics")
GPU_ERROR_REASONS = ("read_failed",)


@dataclass(frozen=True)
class GpuRecord:
    """One GPU's memory as the exporter publishes it (bytes)."""

    index: int
    uuid: str
    used_bytes: int
    free_bytes: int
    total_bytes: int


@dataclass
class EngineSample:
    """What one vLLM engine (DP rank) reported in one scrape; None where it said nothing."""

    usage_ratio: float | None = None
    capacity_tokens: int | None = None
    capacity_bytes: int | None = None
    max_concurrency: float | None = None


@dataclass
class VllmSnapshot:
    """The result of one fetch of vLLM's /metrics: engines by their `engine` label, or an error."""

    ok: bool
    engines: dict[str, EngineSample] = field(default_factory=dict)
    start_time: float | None = None
    error: str | None = None
    duration_s: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)  # series left out, by reason


@dataclass
class _Flight:
    """A fetch in progress that concurrent scrapes wait for (set once, by its leader)."""

    done: threading.Event = field(default_factory=threading.Event)
    snap: VllmSnapshot | None = None


_JOIN_SLACK_S = 2.0


@dataclass
class ActualNumbers:
    """What vLLM logged at start-up, handed over by `vlaunch serve` (per engine, per GPU)."""

    kv_tokens: int | None = None
    kv_memory_bytes: int | None = None
    weights_bytes: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None

    @property
    def capacity_tokens(self) -> int | None:
        if self.kv_tokens:
            return self.kv_tokens
        if self.num_blocks and self.block_size:
            return self.num_blocks * self.block_size
        return None


class ScrapeError(Exception):
    """A failed fetch of vLLM's /metrics; `reason` is one of VLLM_ERROR_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def metrics_url(vllm_url: str) -> str:
    """`http://host:8000` (or with a trailing `/metrics`) -> the /metrics URL; InputError else."""
    url = vllm_url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
        raise InputError(
            f"--vllm-url {vllm_url!r} is not an http(s) URL; "
            "pass the server's base URL, e.g. http://127.0.0.1:8000"
        )
    return url if url.endswith("/metrics") else url + "/metrics"


# --- reading vLLM's page ----------------------------------------------------------------------


class VllmPage:
    """The lines of vLLM's page the exporter uses, kept within bounds while the page streams in.

    Fed chunk by chunk, it never holds more than one chunk, one partial line of at most
    MAX_LINE_BYTES and the kept lines: a 30 MB label is skipped as it arrives, not buffered.
    `dropped` counts, by reason, the series of the needed families that were left out.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES,
                 max_series: int = MAX_SERIES_PER_FAMILY) -> None:
        self.max_line = max_line
        self.max_series = max_series
        self.lines: list[str] = []
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self._series: dict[bytes, int] = {}
        self._partial = bytearray()
        self._skipping = False

    @classmethod
    def from_text(cls, text: str) -> VllmPage:
        page, data = cls(), text.encode("utf-8")
        for i in range(0, len(data), _READ_CHUNK):
            page.feed(data[i:i + _READ_CHUNK])
        page.close()
        return page

    def feed(self, chunk: bytes) -> None:
        if self._skipping:  # inside an over-long line: discard up to its end
            nl = chunk.find(b"\n")
            if nl < 0:
                return
            self._skipping = False
            chunk = chunk[nl + 1:]
        nl = chunk.rfind(b"\n")
        if nl < 0:
            self._partial += chunk
        else:
            region = bytes(self._partial) + chunk[:nl]
            self._partial = bytearray(chunk[nl + 1:])
            self._scan(region)
        if len(self._partial) > self.max_line:
            if _NEEDED_START.match(self._partial) and not self._partial.startswith(b"#"):
                self.dropped["label_too_long"] += 1
            self._partial.clear()
            self._skipping = True

    def close(self) -> None:
        if self._partial and not self._skipping:
            self._scan(bytes(self._partial))
        self._partial.clear()

    def _scan(self, region: bytes) -> None:
        for m in _NEEDED_LINES.finditer(b"\n" + region):
            line, name = m.group(1), m.group(2)
            sample = not line.startswith(b"#")
            if len(line) > self.max_line:
                if sample:
                    self.dropped["label_too_long"] += 1
                continue
            if sample:
                seen = self._series.get(name, 0)
                if seen >= self.max_series:
                    self.dropped["too_many_series"] += 1
                    continue
                self._series[name] = seen + 1
            try:
                self.lines.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                raise ScrapeError("malformed", "vLLM /metrics is not UTF-8 text") from None


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

    def __init__(self, url: str, deadline: float, timeout_s: float) -> None:
        self.url = url
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.page = VllmPage()
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
                if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                    raise ScrapeError("http_status", f"{self.url} redirects to {url}")
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
                chunk = resp.read1(_READ_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ScrapeError("malformed", f"{url} sent more than {MAX_BODY_BYTES} bytes")
                self.page.feed(chunk)
            self.page.close()
            return
        raise ScrapeError("http_status", f"{self.url} redirected more than {MAX_REDIRECTS} times")


def fetch_page(url: str, timeout_s: float) -> VllmPage:
    """GET `url` and keep the lines the exporter uses, all within `timeout_s`.

    The deadline covers the whole exchange, not each blocking call: a server that accepts and
    then says nothing, drips its headers a byte at a time or trickles its body, and a resolver
    that hangs, all end the fetch at `timeout_s` with ScrapeError("timeout").
    """
    deadline = time.monotonic() + timeout_s
    if not _fetch_slots.acquire(blocking=False):
        raise ScrapeError("timeout", f"{MAX_STUCK_FETCHES} earlier fetches have not returned yet")
    exchange = _Exchange(url, deadline, timeout_s)
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


def _int_label(value: str | None) -> int | None:
    try:
        v = int(float(value)) if value not in (None, "", "None") else None
    except (TypeError, ValueError):
        return None
    return v if v is not None and v > 0 else None


def _float_label(value: str | None) -> float | None:
    try:
        v = float(value) if value not in (None, "", "None") else None
    except (TypeError, ValueError):
        return None
    return v if v is not None and math.isfinite(v) and v > 0 else None


@functools.lru_cache(maxsize=2)
def _parse_cache_info(info_text: str) -> dict[str, dict[str, str]]:
    """Labels of `vllm:cache_config_info` by engine. Memoised: the block is set once at engine
    start and never changes, while its two dozen labels per engine were most of the parse time.
    (At most MAX_SERIES_PER_FAMILY lines of MAX_LINE_BYTES each, so each entry is bounded.)"""
    infos: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(info_text):
        for s in family.samples:
            if s.name == CACHE_INFO_FAMILY:
                infos[s.labels.get("engine") or "0"] = s.labels
    return infos


def parse_vllm_metrics(page: VllmPage | str) -> VllmSnapshot:
    """Pick the usage ratio and the actual KV capacity per engine out of vLLM's exposition.

    Raises ScrapeError("malformed") if the needed families do not parse, and
    ScrapeError("missing_metrics") if no usage gauge is there (stats logging off, or not vLLM).
    Series beyond the bounds (MAX_*) are left out and counted in the snapshot's `dropped`.
    """
    if isinstance(page, str):
        page = VllmPage.from_text(page)
    dropped = dict(page.dropped)
    info_text = "\n".join(x for x in page.lines if CACHE_INFO_FAMILY in x) + "\n"
    other_text = "\n".join(x for x in page.lines if CACHE_INFO_FAMILY not in x) + "\n"
    usage: dict[str, dict[str, float]] = {n: {} for n in USAGE_FAMILIES}
    start_time: float | None = None
    try:
        infos = _parse_cache_info(info_text)
        for family in text_string_to_metric_families(other_text):
            for s in family.samples:
                if s.name in usage:
                    if not math.isfinite(s.value):
                        raise ValueError(f"{s.name} is {s.value}")
                    usage[s.name][s.labels.get("engine") or "0"] = s.value
                elif s.name == START_TIME_FAMILY:
                    start_time = s.value
    except ValueError as e:
        raise ScrapeError("malformed", f"vLLM /metrics does not parse: {e}") from None
    # The engine label becomes a label of ours: a long one is dropped, never re-exported.
    for series in (*usage.values(), infos):
        for engine in [e for e in series if len(e) > MAX_LABEL_CHARS]:
            del series[engine]
            dropped["label_too_long"] += 1
    ratios = next((usage[n] for n in USAGE_FAMILIES if usage[n]), None)
    if ratios is None:
        raise ScrapeError(
            "missing_metrics",
            "vLLM /metrics has no vllm:kv_cache_usage_perc (is --disable-log-stats set?)",
        )
    engines = {e: EngineSample(usage_ratio=min(max(v, 0.0), 1.0)) for e, v in ratios.items()}
    # num_gpu_blocks in cache_config_info is the front-end's sum over DP engines, while
    # kv_cache_size_tokens is per engine; split the sum when it is the only number there is.
    n_info = max(len(infos), 1)
    for engine, labels in infos.items():
        if engine not in engines and len(engines) >= MAX_SERIES_PER_FAMILY:
            dropped["too_many_series"] += 1
            continue
        sample = engines.setdefault(engine, EngineSample())
        tokens = _int_label(labels.get("kv_cache_size_tokens"))
        if tokens is None:
            blocks = _int_label(labels.get("num_gpu_blocks"))
            block_size = _int_label(labels.get("block_size"))
            if blocks and block_size:
                tokens = blocks * block_size // n_info
        sample.capacity_tokens = tokens
        sample.capacity_bytes = _int_label(labels.get("kv_cache_memory_bytes"))
        sample.max_concurrency = _float_label(labels.get("kv_cache_max_concurrency"))
    return VllmSnapshot(ok=True, engines=engines, start_time=start_time, dropped=dropped)


# --- reading the GPUs -------------------------------------------------------------------------

GpuReader = Callable[[], Iterable[Any]]

_FIELD_NAMES = {
    "index": ("index", "gpu", "minor"),
    "uuid": ("uuid",),
    "used_bytes": ("used_bytes", "memory_used_bytes", "used"),
    "free_bytes": ("free_bytes", "memory_free_bytes", "free"),
    "total_bytes": ("total_bytes", "memory_total_bytes", "total"),
}


def _field(record: Any, key: str) -> Any:
    for name in _FIELD_NAMES[key]:
        value = record.get(name) if isinstance(record, Mapping) else getattr(record, name, None)
        if value is not None:
            return value
    return None


def to_gpu_record(record: Any) -> GpuRecord:
    """Normalise one device record (dict or object) from a gpu_reader; ValueError if unusable.

    Accepts the field spellings inventory modules commonly use, so the exporter does not have to
    change when the inventory's record type does.
    """
    values = {k: _field(record, k) for k in _FIELD_NAMES}
    if values["total_bytes"] is None or values["index"] is None:
        raise ValueError(f"GPU record without index/total memory: {record!r}")
    total = int(values["total_bytes"])
    used, free = values["used_bytes"], values["free_bytes"]
    used = int(used) if used is not None else total - int(free or 0)
    free = int(free) if free is not None else total - used
    return GpuRecord(int(values["index"]), str(values["uuid"] or ""), used, free, total)


def default_gpu_reader() -> GpuReader | None:
    """NVML through `launcher.inputs.inventory.read_inventory`, or None where that does not work.

    Probed once: on a machine without NVML there are no GPU series at all rather than an error
    counted on every scrape. Devices the inventory could not read (`error` set) are left out:
    their memory numbers would be zeros, not measurements.
    """
    try:
        read = importlib.import_module("..inputs.inventory", __package__).read_inventory
    except (ImportError, AttributeError):
        return None

    def reader() -> Iterable[Any]:
        result = read(timeout_s=DEFAULT_TIMEOUT_S)
        devices = getattr(result, "devices", None)
        if devices is None and isinstance(result, Mapping):
            devices = result.get("devices")
        devices = result if devices is None else devices
        return [d for d in devices if not _field_or_none(d, "error")]

    try:
        records = [to_gpu_record(r) for r in reader()]
    except Exception:  # NVML missing or failing in any of its many ways: no GPU metrics
        return None
    return reader if records else None


def _field_or_none(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, Mapping) else getattr(record, name, None)


# --- the collector ----------------------------------------------------------------------------


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    """Add a sample with its own label set (add_metric insists on the family's full set)."""
    family.add_sample(family.name, labels, value)


def _num(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class Exporter:
    """The vlaunch collector plus its HTTP server. Thread-safe; one per deployment.

    `plan`: a plan dict (may be None: then only engine and GPU series). `vllm_url`: the vLLM API
    server (None: no engine series). `gpu_reader`: callable returning device records, None for no
    GPU series, or the string "auto" for `default_gpu_reader()`. `startup_timeout_s`: how long an
    engine that has not answered since the exporter started (or since `record_restart()`) counts
    as starting; None derives it from the plan as `serve` does (one attempt's deadline).
    """

    def __init__(
        self,
        vllm_url: str | None = None,
        plan: Mapping[str, Any] | None = None,
        gpu_reader: GpuReader | str | None = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cache_ttl_s: float = DEFAULT_CACHE_TTL_S,
        startup_timeout_s: float | None = None,
    ):
        self.metrics_url = metrics_url(vllm_url) if vllm_url else None
        # prometheus_client servers honour `name[]` and then render only these families; vLLM
        # 0.32's own /metrics route ignores it and sends everything, which the filter handles.
        query = urllib.parse.urlencode([("name[]", n) for n in _NEEDED])
        self._fetch_url = f"{self.metrics_url}?{query}" if self.metrics_url else None
        self.plan: Mapping[str, Any] = plan or {}
        self.gpu_reader = default_gpu_reader() if gpu_reader == "auto" else gpu_reader
        self.timeout_s = timeout_s
        self.cache_ttl_s = cache_ttl_s
        self.startup_timeout_s = startup_timeout_s
        self.actual = ActualNumbers()
        self._lock = threading.Lock()
        self._flight: _Flight | None = None
        self._snapshot: VllmSnapshot | None = None
        self._snapshot_at = -math.inf
        self._last_start_time: float | None = None
        self._restarts = 0
        self._errors = {("vllm", r): 0 for r in VLLM_ERROR_REASONS}
        self._errors.update({("gpu", r): 0 for r in GPU_ERROR_REASONS})
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        # Start-up: from now (or the last restart) until vLLM first answers, within a deadline.
        self._starting_since = time.monotonic()
        self._seen_up = False
        self._window: tuple[int, float] | None = None  # (id of the plan, its start-up deadline)
        self._gpu_duration: float | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- inputs from `vlaunch serve` --

    def set_actual(self, **numbers: int | None) -> None:
        """Record what vLLM logged at start-up: kv_tokens, kv_memory_bytes, weights_bytes,
        num_blocks, block_size (unknown keys are a programming error)."""
        with self._lock:
            for key, value in numbers.items():
                if not hasattr(self.actual, key):
                    raise TypeError(f"set_actual() got an unknown number {key!r}")
                setattr(self.actual, key, int(value) if value is not None else None)

    def record_restart(self) -> None:
        """Count an engine restart that the caller (the runner) performed; the new engine is
        starting until it answers (or its start-up deadline passes)."""
        with self._lock:
            self._restarts += 1
            self._starting_since = time.monotonic()
            self._seen_up = False
            # the new process's start time is this restart, not another one; and what the
            # previous engine allocated no longer describes anything
            self._last_start_time = None
            self.actual = ActualNumbers()

    # -- HTTP server --

    def start(self, port: int = DEFAULT_PORT, bind: str = DEFAULT_BIND) -> int:
        """Serve /metrics on bind:port in a daemon thread; returns the port (useful with 0)."""
        try:
            self._server, self._thread = start_http_server(port, addr=bind, registry=self.registry)
        except OSError as e:
            raise InputError(
                f"cannot listen on {bind}:{port} ({e.strerror or e}); "
                "pass a free --port / --metrics-port or another bind address"
            ) from None
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop the HTTP server (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -- scraping --

    def _vllm_snapshot(self) -> VllmSnapshot | None:
        """The cached snapshot, refreshed at most every cache_ttl_s (failures cached too, so a
        dead engine costs one timeout per TTL, not one per concurrent scrape).

        Scrapes that arrive while a fetch is in flight wait for that fetch instead of queueing
        behind a lock for fetches of their own: with a slow vLLM, N concurrent scrapes take one
        timeout, not N. No lock is held while fetching, so set_actual()/record_restart() and
        the HTTP server never wait behind vLLM.
        """
        if self._fetch_url is None:
            return None
        with self._lock:
            if self._snapshot is not None and \
                    time.monotonic() - self._snapshot_at < self.cache_ttl_s:
                return self._snapshot
            flight, leader = self._flight, self._flight is None
            if flight is None:
                flight = self._flight = _Flight()
        if not leader:
            # The leader's fetch ends by its deadline; the slack covers parsing a large page.
            if flight.done.wait(self.timeout_s + _JOIN_SLACK_S) and flight.snap is not None:
                return flight.snap
            with self._lock:
                self._errors["vllm", "timeout"] += 1
            return VllmSnapshot(ok=False, error="timeout: the fetch in flight did not finish")
        try:
            snap = self._fetch()
        finally:
            with self._lock:
                self._flight = None
        flight.snap = snap
        flight.done.set()
        return snap

    def _fetch(self) -> VllmSnapshot:
        """One fetch and parse of vLLM's page; counters, restarts and the cache updated."""
        assert self._fetch_url is not None
        t0 = time.perf_counter()
        reason = None
        try:
            snap = parse_vllm_metrics(fetch_page(self._fetch_url, self.timeout_s))
        except ScrapeError as e:
            snap, reason = VllmSnapshot(ok=False, error=str(e)), e.reason
        snap.duration_s = time.perf_counter() - t0
        with self._lock:
            if reason is not None:
                self._errors["vllm", reason] += 1
            for why, n in snap.dropped.items():
                self._dropped[why] += n
            if snap.ok:
                self._seen_up = True
            if snap.start_time is not None:
                if self._last_start_time is not None and snap.start_time != self._last_start_time:
                    self._restarts += 1
                self._last_start_time = snap.start_time
            self._snapshot, self._snapshot_at = snap, time.monotonic()
        return snap

    def _startup_window(self) -> float:
        """Seconds a not-yet-answering engine counts as starting: the caller's, else one start-up
        attempt's deadline for the plan (as `serve` computes it), else DEFAULT_STARTUP_S."""
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        plan = self.plan
        if self._window is None or self._window[0] != id(plan):
            window = DEFAULT_STARTUP_S
            if _num(self._plan("model", "weights_bytes")) is not None:
                from ..run.emit import startup_deadline_s

                window = startup_deadline_s(plan)
            self._window = (id(plan), window)
        return self._window[1]

    def _starting(self, snap: VllmSnapshot) -> bool:
        with self._lock:
            seen_up, since = self._seen_up, self._starting_since
        if snap.ok or seen_up:
            return False
        return time.monotonic() - since < self._startup_window()

    def _gpus(self) -> list[GpuRecord]:
        if self.gpu_reader is None:
            return []
        t0 = time.perf_counter()
        try:
            records = [to_gpu_record(r) for r in self.gpu_reader()]
        except Exception:  # a GPU fell off the bus, NVML hiccup: count it, keep serving
            with self._lock:
                self._errors["gpu", "read_failed"] += 1
            records = []
        self._gpu_duration = time.perf_counter() - t0
        return records

    # -- plan accessors --

    def _plan(self, *keys: str) -> Any:
        node: Any = self.plan
        for k in keys:
            if not isinstance(node, Mapping):
                return None
            node = node.get(k)
        return node

    def _planned_tokens(self) -> float | None:
        v = _num(self._plan("kv_cache", "tokens"))
        return v if v and v > 0 else None

    def _planned_kv_bytes(self) -> float | None:
        v = _num(self._plan("per_gpu", "kv_cache_bytes"))
        if v is None:
            v = _num(self._plan("kv_cache", "memory_bytes"))
        return v if v and v > 0 else None

    # -- the Collector protocol --

    def describe(self) -> Iterator[Metric]:
        """Nothing to pre-describe: every family is computed at scrape time."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        snap = self._vllm_snapshot()
        gpus = self._gpus()
        starting = self._starting(snap) if snap is not None else False
        with self._lock:
            actual = ActualNumbers(**vars(self.actual))
            restarts = self._restarts
            errors = dict(self._errors)
            dropped = dict(self._dropped)
        yield from self._engine_families(snap, actual, restarts, starting)
        yield from self._plan_families(snap, actual)
        yield from self._gpu_families(gpus)
        yield from self._self_families(snap, errors, dropped)

    def _engine_families(
        self, snap: VllmSnapshot | None, actual: ActualNumbers, restarts: int, starting: bool
    ) -> Iterator[Metric]:
        if snap is not None:
            yield GaugeMetricFamily(
                "vlaunch_engine_up",
                "1 if vLLM's /metrics answered with the KV usage gauge on the last scrape, else 0.",
                value=1.0 if snap.ok else 0.0,
            )
            yield GaugeMetricFamily(
                "vlaunch_engine_starting",
                "1 while vLLM has not answered since it was (re)started and is within its "
                "start-up deadline (loading weights, compiling): engine_up 0 is expected then.",
                value=1.0 if starting else 0.0,
            )
        yield CounterMetricFamily(
            "vlaunch_engine_restarts",
            "Engine restarts: done by vlaunch serve, or seen as a new vLLM process start time.",
            value=restarts,
        )
        usage = GaugeMetricFamily(
            "vlaunch_kv_cache_usage_ratio",
            "Fraction of the KV cache in use (vllm:kv_cache_usage_perc), 0..1, per engine.",
            labels=["engine"],
        )
        used = GaugeMetricFamily(
            "vlaunch_kv_cache_used_tokens",
            "KV cache tokens in use: usage ratio x actual capacity, per engine.",
            labels=["engine"],
        )
        capacity = GaugeMetricFamily(
            "vlaunch_kv_cache_capacity_tokens",
            "KV cache capacity in tokens per engine: planned by vlaunch or actual from vLLM.",
            labels=["source", "engine"],
        )
        cap_bytes = GaugeMetricFamily(
            "vlaunch_kv_cache_capacity_bytes",
            "KV cache memory per GPU in bytes: planned by vlaunch or actual from vLLM.",
            labels=["source", "engine"],
        )
        concurrency = GaugeMetricFamily(
            "vlaunch_kv_cache_max_concurrency",
            "Requests of max_model_len tokens the KV cache holds at once, per engine.",
            labels=["source", "engine"],
        )
        error = GaugeMetricFamily(
            "vlaunch_prediction_error_ratio",
            "(actual - planned) / planned for the planner's predictions.",
            labels=["quantity", "engine"],
        )
        # Planned and per-GPU series have no `engine` label (the plan is the same for every
        # engine); Prometheus allows label sets to differ within a family.
        planned_tokens = self._planned_tokens()
        planned_bytes = self._planned_kv_bytes()
        planned_conc = _num(self._plan("max_concurrency"))
        max_model_len = _num(self._plan("max_model_len"))
        if planned_tokens:
            _add(capacity, {"source": "planned"}, planned_tokens)
        if planned_bytes:
            _add(cap_bytes, {"source": "planned"}, planned_bytes)
        if planned_conc:
            _add(concurrency, {"source": "planned"}, planned_conc)
        planned_weights = _num(self._plan("per_gpu", "weights_bytes"))
        if planned_weights and actual.weights_bytes:
            _add(error, {"quantity": "weights"},
                 (actual.weights_bytes - planned_weights) / planned_weights)
        # Engine-derived series exist only while the engine answers: dropped, never frozen.
        if snap is not None and snap.ok:
            for engine, s in sorted(snap.engines.items()):
                tokens = s.capacity_tokens or actual.capacity_tokens
                kv_bytes = s.capacity_bytes or actual.kv_memory_bytes
                conc = s.max_concurrency
                if conc is None and tokens and max_model_len:
                    conc = tokens / max_model_len
                if s.usage_ratio is not None:
                    usage.add_metric([engine], s.usage_ratio)
                    if tokens:
                        used.add_metric([engine], s.usage_ratio * tokens)
                if tokens:
                    capacity.add_metric(["actual", engine], tokens)
                    if planned_tokens:
                        error.add_metric(
                            ["kv_tokens", engine], (tokens - planned_tokens) / planned_tokens
                        )
                if kv_bytes:
                    cap_bytes.add_metric(["actual", engine], kv_bytes)
                if conc:
                    concurrency.add_metric(["actual", engine], conc)
        yield from (usage, used, capacity, cap_bytes, concurrency, error)

    def _plan_families(self, snap: VllmSnapshot | None, actual: ActualNumbers) -> Iterator[Metric]:
        if not self.plan:
            return
        memory = GaugeMetricFamily(
            "vlaunch_plan_memory_bytes",
            "The plan's per-GPU memory budget by consumer, in bytes.",
            labels=["component"],
        )
        for component, key in PLAN_COMPONENTS.items():
            v = _num(self._plan("per_gpu", key))
            if v is not None:
                memory.add_metric([component], v)
        yield memory
        parallel = self._plan("parallel") or {}
        info = {
            "model": self._plan("model", "name"),
            "tp": parallel.get("tp") if isinstance(parallel, Mapping) else None,
            "pp": parallel.get("pp") if isinstance(parallel, Mapping) else None,
            "dp": parallel.get("dp") if isinstance(parallel, Mapping) else None,
            "kv_cache_dtype": self._plan("kv_cache", "dtype"),
            "max_model_len": self._plan("max_model_len"),
            "vllm_version": self._plan("vllm_version"),
        }
        plan_info = GaugeMetricFamily(
            "vlaunch_plan_info", "The plan this deployment runs (always 1).", labels=list(info)
        )
        plan_info.add_metric(["" if v is None else str(v) for v in info.values()], 1.0)
        yield plan_info

    def _gpu_families(self, gpus: list[GpuRecord]) -> Iterator[Metric]:
        if self.gpu_reader is None:
            return
        fam = GaugeMetricFamily(
            "vlaunch_gpu_memory_bytes",
            "GPU memory as NVML reports it: used, free and total bytes per device.",
            labels=["gpu", "uuid", "kind"],
        )
        for g in gpus:
            for kind, value in (("used", g.used_bytes), ("free", g.free_bytes),
                                ("total", g.total_bytes)):
                fam.add_metric([str(g.index), g.uuid, kind], value)
        yield fam

    def _self_families(
        self, snap: VllmSnapshot | None, errors: dict[tuple[str, str], int],
        dropped: dict[str, int],
    ) -> Iterator[Metric]:
        if self.metrics_url is not None:
            drops = CounterMetricFamily(
                "vlaunch_exporter_dropped_series",
                "Series of vLLM's /metrics left out: a label longer than the exporter takes, or "
                "more series in a family than it takes (reason).",
                labels=["reason"],
            )
            for reason, n in sorted(dropped.items()):
                drops.add_metric([reason], n)
            yield drops
        errs = CounterMetricFamily(
            "vlaunch_scrape_errors",
            "Failed reads of vLLM's /metrics or of the GPUs, by target and reason.",
            labels=["target", "reason"],
        )
        for (target, reason), n in sorted(errors.items()):
            if target == "vllm" and self.metrics_url is None:
                continue
            if target == "gpu" and self.gpu_reader is None:
                continue
            errs.add_metric([target, reason], n)
        yield errs
        dur = GaugeMetricFamily(
            "vlaunch_scrape_duration_seconds",
            "Seconds the last read of each target took (vLLM: fetch and parse).",
            labels=["target"],
        )
        if snap is not None:
            dur.add_metric(["vllm"], snap.duration_s)
        if self.gpu_reader is not None and self._gpu_duration is not None:
            dur.add_metric(["gpu"], self._gpu_duration)
        yield dur

    def render(self) -> bytes:
        """The exposition text, as the HTTP server would send it (for tests and the bench)."""
        return generate_latest(self.registry)


def run_forever(exporter: Exporter, port: int, bind: str, echo: Callable[[str], Any]) -> None:
    """Serve until SIGINT/SIGTERM; used by `vlaunch exporter`."""
    stop = threading.Event()
    actual_port = exporter.start(port, bind)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    source = exporter.metrics_url or "no vLLM"
    echo(f"vlaunch exporter: serving http://{bind}:{actual_port}/metrics (scraping {source})")
    try:
        stop.wait()
    finally:
        exporter.stop()
