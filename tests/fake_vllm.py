"""A fake vLLM server for the fake-engine tests: `python tests/fake_vllm.py serve MODEL --port P`.

It behaves like `vllm serve` where vlaunch's supervisor looks: it takes vLLM's flags (unknown
ones are ignored), prints vLLM 0.32-style log lines (the ones launcher/run/vllmlog.py and the
doctor read), starts a child in its process group (like EngineCore), and answers /health,
/v1/models, /v1/completions and /metrics, honouring `--host`, `--served-model-name` (several
names), `--api-key`/VLLM_API_KEY (401 on /v1 without it), `--ssl-keyfile`/`--ssl-certfile`
and `--root-path` (routes answered only under the prefix, as a path-routing proxy forwards them:
stricter than vLLM, so a client that ignores the prefix is caught). SIGTERM/SIGINT shut it down
(exit 0).

FAKE_VLLM_MODE picks the behaviour, comma-separated where they combine:
- ready (default): starts in a fraction of a second and serves.
- hang: prints the first lines, then never binds the port.
- exit:<text>: prints an engine-core error line "<text>" and vLLM's wrapper, exits 1 (the rest
  of the mode string is the text).
- slow_smoke: a completion takes FAKE_VLLM_DELAY seconds (default 30).
- smoke_fail:<text>: completions answer 500 and the log gets an ERROR line "<text>".
- slow_drain: on SIGTERM it keeps serving in-flight requests for FAKE_VLLM_DRAIN seconds
  (default 30) before exiting 0.
- flood: prints FAKE_VLLM_FLOOD_LINES lines (default 100,000) before binding the port.
Other knobs: FAKE_VLLM_ARGV_FILE (write argv there as JSON), FAKE_VLLM_PID_FILE (write
"server_pid child_pid"), FAKE_VLLM_KV_TOKENS (the KV size it reports, default 28,928),
FAKE_VLLM_LIFETIME (exit 0 that many seconds after answering its first completion, so an
in-process `serve()` returns once it is serving; with FAKE_VLLM_LIFETIME_FROM=ready, after first
listing its models, for a supervisor that sends no completion),
FAKE_VLLM_INFLIGHT_FILE (written, with the request's model name, once a completion is accepted
and in flight: the handshake a test waits for instead of sleeping and hoping),
FAKE_VLLM_KV_PER_REQUEST (KV usage each running request adds, default 0). Completions in
flight beyond `--max-num-seqs` are reported as waiting, as vLLM's scheduler queues them.
P/D: a completion with kv_transfer_params {"do_remote_decode": true} answers the params a
decode engine needs (NixlConnector's shape); one carrying a remote_engine_id counts its
prompt's words in vllm:external_prefix_cache_hits_total, as a decode engine that loaded the KV
does.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

_VALUE_FLAGS_MANY = {"--served-model-name", "--api-key"}


def parse(argv: list[str]) -> tuple[str, dict[str, list[str]]]:
    """(model, {flag: values}) from `serve MODEL ...` or `--model MODEL ...`."""
    args = list(argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    model = None
    if args and not args[0].startswith("-"):
        model, args = args[0], args[1:]
    flags: dict[str, list[str]] = {}
    name = None
    for a in args:
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            flags[name] = [value] if eq else []
            if eq:
                name = None
        elif a.startswith("-") and not a[1:2].isdigit():
            name = a
            flags[name] = []
        elif name is not None:
            flags[name].append(a)
            if name not in _VALUE_FLAGS_MANY:
                name = None
    model = model or (flags.get("--model") or ["model"])[0]
    return model, flags


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def modes() -> dict[str, str]:
    raw = os.environ.get("FAKE_VLLM_MODE", "ready")
    out: dict[str, str] = {}
    parts = raw.split(",")
    for i, part in enumerate(parts):
        key, _, value = part.partition(":")
        if key in ("exit", "smoke_fail"):
            out[key] = ",".join([value, *parts[i + 1 :]])
            break
        out[key] = value
    return out


def main() -> int:  # noqa: C901, PLR0915 - one linear script, like the server it imitates
    model, flags = parse(sys.argv[1:])
    mode = modes()
    if os.environ.get("FAKE_VLLM_ARGV_FILE"):
        with open(os.environ["FAKE_VLLM_ARGV_FILE"], "w") as f:
            json.dump(sys.argv[1:], f)

    def one(name: str, default: str | None = None) -> str | None:
        v = flags.get(name)
        return v[0] if v else default

    port = int(one("--port", "8000") or 8000)
    host = one("--host", "0.0.0.0") or "0.0.0.0"
    names = flags.get("--served-model-name") or [model]
    keys = flags.get("--api-key") or ([os.environ["VLLM_API_KEY"]]
                                      if os.environ.get("VLLM_API_KEY") else [])
    root = (one("--root-path", "") or "").rstrip("/")
    pid = os.getpid()

    # A child in our process group, as vLLM's EngineCore is.
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", "import time; time.sleep(600)"])
    if os.environ.get("FAKE_VLLM_PID_FILE"):
        with open(os.environ["FAKE_VLLM_PID_FILE"], "w") as f:
            f.write(f"{pid} {child.pid}\n")

    stopping = threading.Event()
    in_flight = [0]
    max_seqs = int((flags.get("--max-num-seqs") or ["256"])[0])  # vLLM's default on a GPU
    kv_per_request = float(os.environ.get("FAKE_VLLM_KV_PER_REQUEST", "0"))
    lifetime_from: dict[str, float] = {}  # when FAKE_VLLM_LIFETIME started counting
    lock = threading.Lock()

    def on_signal(signum, frame):  # noqa: ARG001
        if stopping.is_set():
            return
        stopping.set()
        say(f"(APIServer pid={pid}) INFO [launcher.py:255] [shutdown] API server: shutdown "
            "triggered")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    say(f"(APIServer pid={pid}) INFO [api_utils.py:347]   version 0.32.0")
    say(f"(APIServer pid={pid}) INFO [api_utils.py:286] non-default args: {{'model': "
        f"'{model}'}}")
    say(f"(APIServer pid={pid}) INFO [model.py:2152] Using max model len "
        f"{one('--max-model-len', '4096')}")
    say(f"(EngineCore pid={child.pid}) INFO [core.py:133] Initializing a V1 LLM engine "
        f"(v0.32.0) with config: model='{model}'")
    say(f"(Worker pid={child.pid}) INFO [cpu_model_runner.py:68] Starting to load model "
        f"{model}...")
    if "hang" in mode:
        while not stopping.wait(0.2):
            pass
        child.kill()
        return 0
    if "exit" in mode:
        say(f"(EngineCore pid={child.pid}) ERROR [core.py:1510] {mode['exit']}")
        say(f"(EngineCore pid={child.pid}) ERROR [core.py:1510] EngineCore failed to start.")
        say("RuntimeError: Engine core initialization failed. See root cause above. Failed "
            "core proc(s): {'EngineCore': 1}")
        child.kill()
        return 1
    if "flood" in mode:
        n = int(os.environ.get("FAKE_VLLM_FLOOD_LINES", "100000"))
        filler = "x" * 80
        for i in range(n):
            sys.stdout.write(f"(Worker pid={child.pid}) DEBUG [flood.py:1] line {i} {filler}\n")
        sys.stdout.flush()
        say(f"(Worker pid={child.pid}) INFO [flood.py:2] flood done: {n} lines")
    tokens = int(os.environ.get("FAKE_VLLM_KV_TOKENS", "28928"))
    say(f"(Worker pid={child.pid}) INFO [cpu_model_runner.py:87] Warming up model for the "
        "compilation...")
    say(f"(Worker pid={child.pid}) INFO [cpu_worker.py:260] Explicitly set (0.09/9.21) GiB for "
        "KV cache on node 0.")
    say(f"(EngineCore pid={child.pid}) INFO [kv_cache_utils.py:2327] CPU KV cache size: "
        f"{tokens:,} tokens, Maximum concurrency for 1,024 tokens per request: 28.25x")

    metrics = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="'
        f'{tokens // 16}",kv_cache_size_tokens="{tokens}",kv_cache_memory_bytes="100000000",'
        'kv_cache_max_concurrency="28.25",gpu_memory_utilization="0.92"} 1.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{names[0]}"}} {{running}}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{names[0]}"}} {{waiting}}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{names[0]}"}} {{kv}}\n'
        "# TYPE process_start_time_seconds gauge\n"
        f"process_start_time_seconds {time.time():.3f}\n"
        "# TYPE vllm:external_prefix_cache_hits_total counter\n"
        f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="{names[0]}"}} '
        "{external}\n"
    )
    external = [0]  # prompt tokens "loaded" from a prefill engine (kv_transfer_params)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # noqa: ARG002 - vLLM logs as uvicorn does
            code = args[1] if len(args) > 1 else ""
            say(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - '
                f'"{self.command} {self.path} HTTP/1.1" {code}')

        def _send(self, code: int, body, ctype: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> str | None:
            path = self.path.split("?", 1)[0]
            if root:
                if not path.startswith(root + "/"):
                    self._send(404, {"detail": "Not Found"})
                    return None
                path = path[len(root):]
            if path.startswith("/v1") and keys:
                auth = self.headers.get("Authorization", "")
                if auth.partition(" ")[2] not in keys or not auth.lower().startswith("bearer"):
                    self._send(401, {"error": "Unauthorized"})
                    return None
            return path

        def do_GET(self):  # noqa: N802
            path = self._route()
            if path is None:
                return
            if path == "/health":
                self._send(200, "")
            elif path == "/v1/models":
                self._send(200, {"object": "list",
                                 "data": [{"id": n, "object": "model"} for n in names]})
                if os.environ.get("FAKE_VLLM_LIFETIME_FROM") == "ready":
                    lifetime_from.setdefault("t", time.monotonic())
            elif path == "/metrics":
                running = min(in_flight[0], max_seqs)  # beyond --max-num-seqs: queued
                kv = min(1.0, running * kv_per_request)
                page = (metrics.replace("{running}", str(running))
                        .replace("{waiting}", str(in_flight[0] - running))
                        .replace("{kv}", f"{kv:.4f}")
                        .replace("{external}", f"{external[0]:.1f}"))
                self._send(200, page, "text/plain")
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802
            path = self._route()
            if path is None:
                return
            n = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(n) or b"{}")
            if path != "/v1/completions":
                self._send(404, {"detail": "Not Found"})
                return
            if req.get("model") not in names:
                self._send(404, {"error": {"message": f"The model `{req.get('model')}` does "
                                           "not exist.", "code": 404}})
                return
            with lock:
                in_flight[0] += 1
            if os.environ.get("FAKE_VLLM_INFLIGHT_FILE"):
                with open(os.environ["FAKE_VLLM_INFLIGHT_FILE"], "w") as f:
                    f.write(str(req.get("model")))
            try:
                if "smoke_fail" in mode:
                    say(f"(EngineCore pid={child.pid}) ERROR [core.py:1180] {mode['smoke_fail']}")
                    self._send(500, {"error": {"message": "EngineCore encountered an issue. "
                                               "See stack trace for the root cause.",
                                               "code": 500}})
                    return
                if "slow_smoke" in mode:
                    time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "30")))
                k = int(req.get("max_tokens", 1))
                answer = {"model": names[0], "choices": [{"text": " x" * k}],
                          "usage": {"completion_tokens": k}}
                kv = req.get("kv_transfer_params")
                prompt_tokens = len(str(req.get("prompt", "")).split())
                if isinstance(kv, dict) and kv.get("do_remote_decode"):
                    # a prefill engine (NixlConnector's reply shape): where decode finds the KV
                    answer["kv_transfer_params"] = {"do_remote_prefill": True,
                                                    "remote_engine_id": f"fake-{port}",
                                                    "remote_block_ids": [0], "remote_port": port,
                                                    "prompt_tokens": prompt_tokens}
                elif isinstance(kv, dict) and kv.get("remote_engine_id"):
                    with lock:  # a decode engine: the prompt's KV counts as loaded
                        external[0] += int(kv.get("prompt_tokens", prompt_tokens))
                self._send(200, answer)
                lifetime_from.setdefault("t", time.monotonic())
            finally:
                with lock:
                    in_flight[0] -= 1

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # tens of clients connect at once (socketserver's default: 5)
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    srv = Server((host, port), Handler)
    if flags.get("--ssl-certfile"):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(one("--ssl-certfile") or "", one("--ssl-keyfile"))
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    scheme = "https" if flags.get("--ssl-certfile") else "http"
    say(f"(APIServer pid={pid}) INFO [entry.py:140] Starting vLLM server on "
        f"{scheme}://{host}:{port}")
    say("INFO:     Application startup complete.")
    lifetime = float(os.environ.get("FAKE_VLLM_LIFETIME", "0"))
    while not stopping.wait(0.2):
        began = lifetime_from.get("t")
        if lifetime > 0 and began is not None and time.monotonic() - began >= lifetime:
            break
    if "slow_drain" in mode:
        drain = float(os.environ.get("FAKE_VLLM_DRAIN", "30"))
        say(f"(APIServer pid={pid}) INFO [launcher.py:270] [shutdown] API server: stopping "
            f"engine client mode=drain timeout={drain:g}s")
        end = time.monotonic() + drain
        while time.monotonic() < end:
            time.sleep(0.1)
    else:
        deadline = time.monotonic() + 5
        while in_flight[0] and time.monotonic() < deadline:
            time.sleep(0.05)
    srv.shutdown()
    child.kill()
    say(f"(APIServer pid={pid}) INFO [launcher.py:280] [shutdown] API server: engine client "
        "stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
