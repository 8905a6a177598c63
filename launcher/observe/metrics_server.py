"""The HTTP server that serves a registry's /metrics, started and stopped as one unit.

Why its own module: serving is the exporter's only exposure to the network, so binding, its
one-line error for a port in use, and a clean shutdown live in one place, apart from what is
served.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from ..errors import InputError
from .metrics_http import BoundedHttpServer


class MetricsServer:
    """The registry's /metrics over `metrics_http.BoundedHttpServer` (not prometheus_client's
    thread-per-connection server, which any slow or idle client could exhaust)."""

    def __init__(self, registry: CollectorRegistry,
                 render: Callable[[], bytes] | None = None) -> None:
        self.registry = registry
        self.render = render or (lambda: generate_latest(self.registry))
        self._server: BoundedHttpServer | None = None

    def start(self, port: int, bind: str) -> int:
        """Serve /metrics on bind:port; returns the port (useful with 0). InputError (one line)
        when the port cannot be had."""
        try:
            self._server = BoundedHttpServer(self.render, bind, port).start()
        except OSError as e:
            raise InputError(
                f"cannot listen on {bind}:{port} ({e.strerror or e}); "
                "pass a free --port / --metrics-port or another bind address"
            ) from None
        return self._server.server_port

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.server_close()
            self._server = None
