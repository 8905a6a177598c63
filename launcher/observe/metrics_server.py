"""The HTTP server that serves a registry's /metrics, started and stopped as one unit.

Why its own module: serving is the exporter's only exposure to the network, so binding, its
one-line error for a port in use, and a clean shutdown live in one place, apart from what is
served.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

from ..errors import InputError


class MetricsServer:
    """prometheus_client's HTTP server for one registry, in a daemon thread."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, port: int, bind: str) -> int:
        """Serve /metrics on bind:port; returns the port (useful with 0). InputError (one line)
        when the port cannot be had."""
        try:
            self._server, self._thread = start_http_server(port, addr=bind, registry=self.registry)
        except OSError as e:
            raise InputError(
                f"cannot listen on {bind}:{port} ({e.strerror or e}); "
                "pass a free --port / --metrics-port or another bind address"
            ) from None
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
