"""vLLM's HTTP API as the supervisor sees it: health, served models, one smoke completion, and
what the engine allocated.

Why its own module: reaching vLLM follows vLLM's own flags (`--host`, `--port`, `--api-key` or
VLLM_API_KEY, `--ssl-certfile` for https, `--root-path`), and every call must have a timeout
and bypass any proxy (the server is our own child). HTTP uses only urllib.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import vllmlog
from .vllmargs import arg_value


@dataclass
class SmokeResult:
    """One short completion: did the server produce tokens?"""

    ok: bool
    seconds: float
    status: int | None = None
    text: str | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class Actual:
    """What the running engine allocated: its log lines plus `vllm:cache_config_info`."""

    allocation: vllmlog.Allocation
    cache_config: vllmlog.CacheConfigInfo | None
    kv_cache_tokens: int | None
    num_blocks: int | None
    block_size: int | None
    kv_cache_memory_bytes: int | None
    max_concurrency: float | None

    def to_dict(self) -> dict[str, object]:
        d = dict(self.__dict__)
        d["allocation"] = self.allocation.to_dict()
        d["cache_config"] = dict(self.cache_config.labels) if self.cache_config else None
        return d


# The paths vLLM checks the key on (vllm/entrypoints/serve/middleware/authenticate.py
# GUARDED_PREFIX); every other path is sent without it.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def api_key(args: Sequence[str], env: Mapping[str, str | None]) -> str | None:
    """vLLM's key: `--api-key` (first one), else VLLM_API_KEY as vLLM will see it (`env` is
    what we add to, or remove from, our own environment)."""
    key = arg_value(args, "api_key")
    if key is not None:
        return key
    if "VLLM_API_KEY" in env:
        return env["VLLM_API_KEY"] or None
    return os.environ.get("VLLM_API_KEY") or None


class Endpoint:
    """Where and how one vLLM server is reached, and the calls the supervisor makes."""

    def __init__(self, host: str, port: int, model_name: str, args: Sequence[str],
                 env: Mapping[str, str | None], http_timeout: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.model_name = model_name
        self.http_timeout = http_timeout
        self.scheme = "https" if arg_value(args, "ssl_certfile") is not None else "http"
        self.root_path = (arg_value(args, "root_path") or "").rstrip("/")
        self.api_key = api_key(args, env)
        url_host = f"[{host}]" if ":" in host else host
        self.origin = f"{self.scheme}://{url_host}:{port}"
        self.base_url = self.origin + self.root_path
        self._opener = self._make_opener()

    def _make_opener(self) -> urllib.request.OpenerDirector:
        """No proxy (our own child is local, whatever http_proxy says); with TLS, accept the
        server's certificate (self-signed on loopback; the listener is checked to be ours)."""
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if self.scheme == "https":
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            handlers.append(urllib.request.HTTPSHandler(context=ctx))
        return urllib.request.build_opener(*handlers)

    def request(self, path: str, data: bytes | None, timeout: float) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key and path.startswith(GUARDED_PREFIXES):
            # Only where vLLM checks it: /health and /metrics never carry the key.
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                     method="POST" if data is not None else "GET")
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read() if e.fp else b""

    def get(self, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        return self.request(path, None, timeout or self.http_timeout)

    def post_json(self, path: str, body: dict, timeout: float) -> tuple[int, dict]:
        code, raw = self.request(path, json.dumps(body).encode(), timeout)
        try:
            return code, json.loads(raw or b"{}")
        except ValueError:
            return code, {"error": raw.decode("utf-8", "replace")}

    # --- readiness ---------------------------------------------------------------------------

    def healthy(self) -> bool:
        """GET /health is 200. With a root path, a server that routes only un-prefixed paths
        (the root path is for a proxy) is then reached without it. OSError when unreachable."""
        status, _ = self.get("/health")
        if status == 404 and self.root_path:
            self.base_url = self.origin
            status, _ = self.get("/health")
            if status != 200:
                self.base_url = self.origin + self.root_path
        return status == 200

    def serves_model(self) -> bool:
        """GET /v1/models lists our model. OSError/ValueError when it cannot be read."""
        status, body = self.get("/v1/models")
        if status != 200:
            return False
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
        return self.model_name in ids

    # --- checks on a running server ----------------------------------------------------------

    def smoke_test(self, prompt: str, max_tokens: int, timeout: float,
                   interrupted: Callable[[], int | None]) -> SmokeResult:
        """One short greedy completion through /v1/completions.

        The request runs on a helper thread so that a signal (`interrupted()` not None) ends
        the wait at once; the result then says so and is no evidence about vLLM.
        """
        t0 = time.monotonic()
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0}
        box: dict[str, object] = {}

        def call() -> None:
            try:
                box["resp"] = self.post_json("/v1/completions", body, timeout)
            except (OSError, ValueError) as e:
                box["error"] = str(e)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        while worker.is_alive():
            signum = interrupted()
            if signum is not None:
                name = signal.Signals(signum).name
                return SmokeResult(False, round(time.monotonic() - t0, 3),
                                   error=f"interrupted by {name}")
            worker.join(timeout=0.1)
        seconds = round(time.monotonic() - t0, 3)
        if "error" in box:
            return SmokeResult(False, seconds, error=str(box["error"]))
        status, resp = box["resp"]  # type: ignore[misc]
        choices = resp.get("choices") or []
        usage = resp.get("usage") or {}
        tokens = usage.get("completion_tokens")
        ok = status == 200 and bool(choices) and bool(tokens)
        return SmokeResult(
            ok=ok,
            seconds=seconds,
            status=status,
            text=choices[0].get("text") if choices else None,
            completion_tokens=tokens,
            error=None if ok else json.dumps(resp)[:2000],
        )

    def metrics_text(self) -> str:
        status, body = self.get("/metrics")
        if status != 200:
            raise OSError(f"GET /metrics returned {status}")
        return body.decode("utf-8", "replace")

    def read_actual(self, log_text: str) -> Actual:
        """What vLLM allocated: the log's numbers, overridden by /metrics where it has them."""
        alloc = vllmlog.parse_allocation(log_text)
        info = None
        with contextlib.suppress(OSError, ValueError):
            info = vllmlog.parse_cache_config_info(self.metrics_text())

        def pick(metric, logged):
            return metric if metric is not None else logged

        return Actual(
            allocation=alloc,
            cache_config=info,
            kv_cache_tokens=pick(info and info.kv_cache_size_tokens, alloc.kv_cache_tokens),
            num_blocks=info.num_gpu_blocks if info else None,
            block_size=pick(info and info.block_size, alloc.block_size),
            kv_cache_memory_bytes=info.kv_cache_memory_bytes if info else None,
            max_concurrency=pick(info and info.kv_cache_max_concurrency, alloc.max_concurrency),
        )
