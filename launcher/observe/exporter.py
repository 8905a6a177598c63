"""A Prometheus exporter that puts vLLM's KV cache next to what vlaunch planned for it.

Why a separate exporter: vLLM reports how full its KV cache is, but not how big the cache is in a
form a dashboard can use (capacity hides in the labels of `vllm:cache_config_info`), and nothing
in vLLM knows what the plan predicted. This module joins the three sources at scrape time:

- the plan (its typed Deployment): planned capacity, the per-GPU memory budget, plan info;
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

Parts: `scrapeclient` fetches vLLM's page within a deadline, `vllmpage` keeps and parses the
lines used, `gpus` reads device memory, `families` turns one scrape into metric families, and
`metrics_server` serves them. This module holds the state between scrapes: the cached snapshot
(one fetch shared by concurrent scrapes), counters, restarts and the start-up window.

Usable in-process (`vlaunch serve` builds an `Exporter`, calls `start()` and, once the engine
is up, `set_actual(...)` with the numbers vLLM logged) and standalone (`vlaunch exporter`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

from ..deployment.plan import Deployment
from ..errors import InputError
from .families import (
    ActualNumbers,
    engine_families,
    gpu_families,
    plan_families,
    scaling_families,
    self_families,
)
from .gpus import GpuReader, GpuRecord, default_gpu_reader, to_gpu_record
from .metrics_server import MetricsServer
from .scrapeclient import fetch_page, metrics_url
from .shared_read import SharedRead
from .vllmpage import DROP_REASONS, NEEDED_FAMILIES, ScrapeError, VllmSnapshot, parse_vllm_metrics

RELAY_ENV = "VLAUNCH_METRICS_RELAY"
DEFAULT_PORT = 9400
DEFAULT_BIND = "127.0.0.1"  # this machine only, unless the caller says otherwise
DEFAULT_TIMEOUT_S = 2.0
# Short enough that a dashboard never sees a value older than one Prometheus scrape interval,
# long enough that several Prometheus replicas scraping together hit vLLM once.
DEFAULT_CACHE_TTL_S = 1.0
# How long an engine that has not answered yet counts as starting when the caller gives no
# start-up deadline (the runner's default one).
DEFAULT_STARTUP_S = 900.0
VLLM_ERROR_REASONS = ("unreachable", "timeout", "http_status", "malformed", "missing_metrics")
GPU_ERROR_REASONS = ("read_failed",)


@dataclass
class _Flight:
    """A fetch in progress that concurrent scrapes wait for (set once, by its leader)."""

    done: threading.Event = field(default_factory=threading.Event)
    snap: VllmSnapshot | None = None


_JOIN_SLACK_S = 2.0


def pool_view(plan: Deployment | None, role: str | None) -> tuple[str | None, Deployment | None]:
    """The role this exporter labels its series with, and the plan with that role's pool first
    (the planned figures are that pool's). A pool's emitted folder (`plan --role R --emit DIR`)
    is the pool it names; a disaggregated plan without either is its first (prefill) pool; an
    aggregated plan keeps today's series, with no `role` label."""
    if plan is None:
        return role, None
    roles = [p.role for p in plan.pools]
    role = role or plan.role
    if role is None:
        return (roles[0] if plan.kind == "disaggregated" else None), plan
    if role not in roles:
        raise InputError(f"--role {role}: the plan has no {role} pool (it has "
                         f"{', '.join(roles)}); pass one of those")
    i = roles.index(role)
    return role, dataclasses.replace(plan, pools=(plan.pools[i], *plan.pools[:i],
                                                  *plan.pools[i + 1:]), role=role)


def with_role(families: list[Metric], role: str | None) -> Iterator[Metric]:
    """Every vlaunch series labelled with the pool's `role` (prefill, decode) when it has one."""
    for f in families:
        if role is not None:
            f.samples = [s._replace(labels={**s.labels, "role": role}) for s in f.samples]
        yield f


class Exporter:
    """The vlaunch collector plus its HTTP server. Thread-safe; one per deployment.

    `plan`: the Deployment it serves (None: only engine and GPU series). `vllm_url`: the vLLM API
    server (None: no engine series). `gpu_reader`: callable returning device records, None for no
    GPU series, or the string "auto" for `default_gpu_reader()`. `startup_timeout_s`: how long an
    engine that has not answered since the exporter started (or since `record_restart()`) counts
    as starting: seconds, or a function of the plan (`run.emit.startup_deadline_s`, one
    attempt's deadline, which follows a re-plan), or None for DEFAULT_STARTUP_S.
    """

    def __init__(
        self,
        vllm_url: str | None = None,
        plan: Deployment | None = None,
        gpu_reader: GpuReader | str | None = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cache_ttl_s: float = DEFAULT_CACHE_TTL_S,
        startup_timeout_s: float | Callable[[Deployment], float] | None = None,
        relay_vllm: bool | None = None,
        role: str | None = None,
    ):
        self.metrics_url = metrics_url(vllm_url) if vllm_url else None
        # Relaying: our page ends with vLLM's whole page, so Prometheus scrapes one port (the
        # exporter's) and vLLM's own port stays closed to it (issue 31, M5). None: as
        # VLAUNCH_METRICS_RELAY says (the manifests set it; off elsewhere, where Prometheus
        # scrapes vLLM itself and a relay would count every vllm:* series twice).
        self.relay = relay_vllm if relay_vllm is not None else \
            os.environ.get(RELAY_ENV, "").strip().lower() in ("1", "true", "yes", "on")
        # prometheus_client servers honour `name[]` and then render only these families; vLLM
        # 0.32's own /metrics route ignores it and sends everything, which the filter handles.
        query = urllib.parse.urlencode([("name[]", n) for n in NEEDED_FAMILIES])
        self._fetch_url = (self.metrics_url if self.relay else f"{self.metrics_url}?{query}") \
            if self.metrics_url else None
        self.role, self.plan = pool_view(plan, role)
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
        self._gpu_read: SharedRead | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server = MetricsServer(self.registry, self.render)

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
        return self._server.start(port, bind)

    def stop(self) -> None:
        """Stop the HTTP server (idempotent)."""
        self._server.stop()

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
            snap = parse_vllm_metrics(fetch_page(self._fetch_url, self.timeout_s,
                                                 keep_raw=self.relay))
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
        """Seconds a not-yet-answering engine counts as starting (see `startup_timeout_s`); a
        function of the plan is asked again only when the plan changes."""
        given = self.startup_timeout_s
        if given is None:
            return DEFAULT_STARTUP_S
        if not callable(given):
            return given
        plan = self.plan
        if plan is None:
            return DEFAULT_STARTUP_S
        if self._window is None or self._window[0] != id(plan):
            self._window = (id(plan), float(given(plan)))
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
        shared = self._gpu_read
        if shared is None or shared.reader is not self.gpu_reader:
            # One NVML read in flight at a time, shared by concurrent scrapes for the cache TTL;
            # a scrape waits for it at most timeout_s (a stuck NVML stalls one scrape, not all).
            shared = self._gpu_read = SharedRead(self.gpu_reader, ttl_s=self.cache_ttl_s,
                                                 timeout_s=self.timeout_s)
        t0 = time.perf_counter()
        try:
            records = [to_gpu_record(r) for r in shared.read()]
        except Exception:  # a GPU fell off the bus, NVML hiccup: count it, keep serving
            with self._lock:
                self._errors["gpu", "read_failed"] += 1
            records = []
        self._gpu_duration = time.perf_counter() - t0
        return records

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
        families = [*engine_families(self.plan, snap, actual, restarts, starting),
                    *plan_families(self.plan),
                    *scaling_families(self.plan, snap),
                    *(gpu_families(gpus) if self.gpu_reader is not None else ()),
                    *self_families(snap, errors, dropped, self._gpu_duration,
                                   scrapes_vllm=self.metrics_url is not None,
                                   reads_gpus=self.gpu_reader is not None)]
        yield from with_role(families, self.role)

    def render(self) -> bytes:
        """The exposition text the HTTP server sends: our families, then (when relaying) the
        page of vLLM's from the same cached fetch, so both describe one moment."""
        if not self.relay:
            return generate_latest(self.registry)
        snap = self._vllm_snapshot()  # collect() below reuses it (cached for cache_ttl_s)
        ours = generate_latest(self.registry)
        return ours + (snap.relayed or b"") if snap is not None and snap.ok else ours


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
