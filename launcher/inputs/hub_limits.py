"""Bounds on one Hub lookup: bytes per reply, bytes in all, requests, and a total deadline.

A lookup reads JSON (model info, config.json, an index) and safetensors headers, never
weights, so every reply is small: the Hub's model info for the largest repos is a few hundred
KiB, a config.json a few KiB, a safetensors header at most 25 MB (huggingface_hub's own
SAFETENSORS_MAX_HEADER_LENGTH). A server that answers more, forever, or one byte every few
seconds is hostile or broken; without these bounds it held `vlaunch plan` (and the init
container) for as long as it liked and filled the disk (issue 31, M1).

huggingface_hub makes every request through one shared httpx client; `installed()` wraps that
client's factory with an event hook on each request (deadline left, no compression, a socket
timeout no longer than the deadline) and on each reply (its declared length, then every chunk
as it arrives, counted against the caps). A drip-fed reply can stall inside one read of the
headers, where no hook runs, so `within_deadline` also runs the lookup in a worker thread and
stops waiting at the deadline: the command ends with one line, and the worker, should it ever
wake, finds the budget spent and stops at its next chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import InputError

__all__ = ["Budget", "MAX_REPLY_BYTES", "MAX_SHARDS", "MAX_TOTAL_BYTES", "DEADLINE_S",
           "installed", "within_deadline"]

T = TypeVar("T")

# A reply: above the 25 MB safetensors header bound huggingface_hub enforces, far above any
# config.json (KiB) or model info (hundreds of KiB for repos with thousands of files).
MAX_REPLY_BYTES = 32 << 20
# All replies of one lookup: the index and headers of MAX_SHARDS shards at their usual
# ~100 KiB (DeepSeek-V3's 163 shards read ~25 MiB), with room to spare.
MAX_TOTAL_BYTES = 256 << 20
# Shards: the largest public checkpoints use 163 (DeepSeek-V3) to 191 (Llama-3.1-405B);
# each costs one or two requests, so 3,000 made a lookup 3,007 requests (issue 31).
MAX_SHARDS = 1000
# The whole lookup: a cold lookup of a 163-shard repo takes a few seconds on a good link.
DEADLINE_S = 120.0
# One socket operation (connect, one read), as before.
SOCKET_TIMEOUT_S = 10.0


@dataclass
class Budget:
    """What one lookup may still spend; shared by the worker thread and its httpx hooks."""

    where: str  # the endpoint, for the one-line error (credentials already removed)
    deadline: float = field(default_factory=lambda: time.monotonic() + DEADLINE_S)
    total: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def left_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise InputError(f"the Hub at {self.where} took more than {DEADLINE_S:.0f} s to "
                             "answer one lookup; check the network or HF_ENDPOINT, or download "
                             "the model into the HF cache and set HF_HUB_OFFLINE=1")
        return left

    def spend(self, n: int, reply: int, url: str) -> None:
        with self.lock:
            self.total += n
            total = self.total
        if reply > MAX_REPLY_BYTES or total > MAX_TOTAL_BYTES:
            cap = MAX_REPLY_BYTES if reply > MAX_REPLY_BYTES else MAX_TOTAL_BYTES
            raise InputError(f"the Hub at {self.where} sent more than {cap >> 20} MiB "
                             f"for {_short(url)} (a lookup reads JSON and headers, never "
                             "weights); check HF_ENDPOINT")
        self.left_s()


def _short(url: str) -> str:
    """The path of a URL, without host or query (which may carry a signed token)."""
    from urllib.parse import urlsplit

    return urlsplit(url).path[:120] or "/"


def _counted(inner: Any, budget: Budget, url: str) -> Any:
    """A reply body that counts each chunk against the budget as it arrives (httpx checks the
    body is its SyncByteStream, so the class is made from it here, not at import)."""
    import httpx2

    class Counted(httpx2.SyncByteStream):
        def __init__(self) -> None:
            self.seen = 0

        def __iter__(self) -> Iterator[bytes]:
            for chunk in inner:
                self.seen += len(chunk)
                budget.spend(len(chunk), self.seen, url)
                yield chunk

        def close(self) -> None:
            inner.close()

    return Counted()


_active: Budget | None = None  # the lookup in progress (one per process at a time)


def _on_request(request: Any) -> None:
    budget = _active
    if budget is None:
        return
    t = min(SOCKET_TIMEOUT_S, budget.left_s())
    request.extensions["timeout"] = {"connect": t, "read": t, "write": t, "pool": t}
    request.headers["Accept-Encoding"] = "identity"  # counted bytes are the bytes kept


def _on_response(response: Any) -> None:
    budget = _active
    if budget is None:
        return
    url = str(response.request.url)
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # a compressed reply could inflate past every cap
        response.close()
        raise InputError(f"the Hub at {budget.where} sent {_short(url)} compressed "
                         f"({encoding[:20]}) though asked not to; check HF_ENDPOINT")
    declared = response.headers.get("content-length", "")
    # A HEAD reply has no body: its length is the file's (a 16 GB shard's, when huggingface_hub
    # asks whether model.safetensors exists), not bytes that will be sent.
    if response.request.method != "HEAD" and declared.strip().isdigit() \
            and int(declared) > MAX_REPLY_BYTES:
        response.close()  # refused before a byte of the body is read
        budget.spend(int(declared), int(declared), url)
    response.stream = _counted(response.stream, budget, url)


_factory_installed = False


def installed() -> None:
    """Make huggingface_hub's shared client count every request against the active budget."""
    global _factory_installed
    if _factory_installed:
        return
    from huggingface_hub.utils import _http

    base = _http.default_client_factory

    def factory() -> Any:
        client = base()
        hooks = client.event_hooks
        client.event_hooks = {"request": [*hooks.get("request", []), _on_request],
                              "response": [*hooks.get("response", []), _on_response]}
        return client

    _http.set_client_factory(factory)
    _factory_installed = True


def within_deadline(work: Callable[[], T], where: str) -> T:
    """`work()` under a fresh budget, given up at the deadline even if a read never returns."""
    global _active
    installed()
    budget = Budget(where)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result["error"] = e

    _active = budget
    worker = threading.Thread(target=run, name="vlaunch-hub-lookup", daemon=True)
    try:
        worker.start()
        worker.join(max(0.0, budget.deadline - time.monotonic()) + 0.5)
    finally:
        if not worker.is_alive():
            _active = None
        else:  # the worker is stuck in a read: spend its budget so it stops at the next chunk
            budget.deadline = 0.0
    if worker.is_alive():
        budget.left_s()  # raises the one line
    if "error" in result:
        raise result["error"]
    return result["value"]
