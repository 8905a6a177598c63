"""One slow read shared by every scrape: at most one call in flight, its answer reused briefly.

The exporter's GPU numbers come from NVML, which can hang (a GPU falling off the bus, a driver
reset): read on every scrape, 20 scrapes against a stuck NVML took a median 22 s and piled up
threads. `SharedRead` runs the reader in one background thread at a time, shares its answer
(or its error) for `ttl_s`, and gives a scrape at most `timeout_s` of waiting: a read that is
still stuck after that fails every scrape at once instead of stalling it, and no second reader
thread is started behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadTimeout(TimeoutError):
    """The shared read has been running longer than the caller may wait."""


class ReadFailed(RuntimeError):
    """The shared read raised; a fresh exception per caller, so that threads re-raising one
    shared object do not grow (and race on) its traceback."""


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


class SharedRead(Generic[T]):
    """`read()` returns the reader's answer, calling it at most once per `ttl_s` and never
    from two threads at once; errors are shared (and re-raised) like answers."""

    def __init__(self, reader: Callable[[], T], ttl_s: float = 1.0, timeout_s: float = 2.0):
        self.reader = reader
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.calls = 0  # reader calls started (for tests and the bench)
        self._lock = threading.Lock()
        self._flight: _Flight[T] | None = None
        self._last: _Flight[T] | None = None
        self._last_at = -float("inf")

    def _run(self, flight: _Flight[T]) -> None:
        try:
            flight.value = self.reader()
        except BaseException as e:  # shared with every waiting caller
            flight.error = e
        with self._lock:
            self._last, self._last_at = flight, time.monotonic()
            self._flight = None
        flight.done.set()

    def read(self) -> T:
        with self._lock:
            last = self._last
            if last is not None and time.monotonic() - self._last_at < self.ttl_s:
                flight = last
            else:
                flight = self._flight
                if flight is None:
                    flight = self._flight = _Flight()
                    self.calls += 1
                    threading.Thread(target=self._run, args=(flight,), daemon=True,
                                     name="vlaunch-shared-read").start()
        if not flight.done.is_set():
            remaining = flight.started + self.timeout_s - time.monotonic()
            if remaining <= 0 or not flight.done.wait(remaining):
                raise ReadTimeout(f"the read has run for {time.monotonic() - flight.started:.1f}s"
                                  f" (limit {self.timeout_s:g}s)")
        if flight.error is not None:
            e = flight.error
            raise ReadFailed(f"{type(e).__name__}: {e}") from None
        return flight.value  # type: ignore[return-value]
