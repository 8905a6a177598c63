"""Supervision faults of issue 13 (items 1-11), each through the fake vLLM server.

`tests/fake_vllm.py` stands in for vLLM (VLAUNCH_VLLM_COMMAND points the runner at it), so
`serve`, `exec` and the multi-node paths run their real code in a few seconds per test: signals
to the supervisor, a second run in the same folder, a full disk, a slow terminal, a proxy,
flags after `--`, a drain on stop, Ray's commands, a missing vLLM and the served names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from launcher.deployment.codec import dump
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.search.planner import Pins
from launcher.run import logpump
from launcher.run.drain import DEFAULT_STOP_TIMEOUT_S, drain_seconds, with_drain
from launcher.run.multinode import build_launch
from launcher.run.procgroup import pids_in_group
from launcher.run.runner import VllmRunner
from launcher.run.serve import run_node, serve
from launcher.run.vllmargs import free_port, port_answers, serve_both_names

FAKE = Path(__file__).with_name("fake_vllm.py")
REPO = Path(__file__).resolve().parents[1]
FAKE_COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} serve"
PROXIES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
           "no_proxy", "NO_PROXY")
KV_KEYS = ("VLLM_API_KEY",)
SMALL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16", "head_dim": 64,
}


@pytest.fixture()
def env(monkeypatch, tmp_path: Path):
    """The fake engine as vLLM, a private cache, no proxies; `env(mode, **knobs)` sets
    FAKE_VLLM_MODE and FAKE_VLLM_<KNOB> for this test (and the processes it starts)."""
    monkeypatch.setenv("VLAUNCH_VLLM_COMMAND", FAKE_COMMAND)
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    for k in (*PROXIES, *KV_KEYS):
        monkeypatch.delenv(k, raising=False)

    def set_mode(mode: str = "ready", **knobs: object) -> None:
        monkeypatch.setenv("FAKE_VLLM_MODE", mode)
        for k, v in knobs.items():
            monkeypatch.setenv(f"FAKE_VLLM_{k.upper()}", str(v))

    set_mode()
    return set_mode


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    """A local model folder (config only: the fake engine loads nothing)."""
    d = tmp_path / "models" / "small"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(SMALL_CONFIG))
    return d


def _last_command(lines: list[str]) -> str:
    """The command a dry run printed (after its "would run" label, or the last one), its
    backslash-continued lines joined."""
    lines = [x for text in lines for x in text.split("\n")]
    labels = [n for n, x in enumerate(lines) if "would run" in x]
    if labels:
        i = end = labels[-1] + 1
        while end < len(lines) - 1 and lines[end].endswith(" \\"):
            end += 1
        return " ".join(x.strip().removesuffix("\\").strip() for x in lines[i:end + 1])
    i = len(lines) - 1
    while i > 0 and lines[i - 1].endswith(" \\"):
        i -= 1
    return " ".join(x.strip().removesuffix("\\").strip() for x in lines[i:])


def _serve(model: Path, gpus: str = "cpu", pins: Pins | None = None, extra=(), **kw):
    """serve() in-process; returns (result, printed lines)."""
    lines: list[str] = []
    kw.setdefault("metrics_port", None)
    kw.setdefault("startup_timeout", 20)
    kw.setdefault("stop_timeout", 5)
    result = serve(load_model(str(model)), parse_gpus(gpus), pins or Pins(), list(extra),
                   out=lines.append, **kw)
    return result, lines


class Vlaunch:
    """`vlaunch ARGS` in a subprocess (its own session), its output collected as it comes."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", *args], cwd=cwd, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text)
            if m:
                return m
            if self.proc.poll() is not None:
                time.sleep(0.2)
                m = re.search(pattern, self.text)
                assert m, f"exited {self.proc.returncode} before {pattern!r}:\n{self.text}"
                return m
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{self.text}")

    def finish(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _wait_for_file(path: Path, timeout: float = 30) -> None:
    """A handshake from the fake engine (FAKE_VLLM_INFLIGHT_FILE and the like)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"the fake engine never wrote {path}"
        time.sleep(0.05)


def _fake_pids(path: Path, timeout: float = 20) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            server, child = path.read_text().split()
            return int(server), int(child)
        time.sleep(0.05)
    raise AssertionError("the fake engine never started")


def _gone(pids: tuple[int, ...], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pids_in_group(p) or _alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _lessons(tmp_path: Path) -> dict:
    path = tmp_path / "cache" / "capabilities.json"
    return json.loads(path.read_text()) if path.exists() else {}


# --- items 1 and 2: a signal ends the run, with 128 + signal, and teaches nothing -----------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_smoke_request_ends_the_run_without_restart_or_lesson(env, model, tmp_path,
                                                                           sig):
    inflight = tmp_path / "inflight"
    env("slow_smoke", delay=30, inflight_file=inflight)
    v = Vlaunch("serve", str(model), "--gpus", "cpu", "--kv-cache-dtype", "fp8", "--no-metrics",
                "--stop-timeout", "1", "--log-dir", str(tmp_path), cwd=tmp_path)
    v.wait_for(r"vLLM is ready; planned vs actual")
    _wait_for_file(inflight)  # the fake has the smoke request (it answers in 30 s)
    os.kill(v.proc.pid, sig)
    assert v.finish() == 128 + sig, v.text
    assert "restarting" not in v.text and "attempt 2" not in v.text, v.text
    assert _lessons(tmp_path) == {}, "a signal is no evidence about fp8"
    assert len(list(tmp_path.glob("vllm-*-attempt*.log"))) == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_during_startup_exits_128_plus_signal_and_stops_vllm(env, model, tmp_path, sig):
    env("hang", pid_file=tmp_path / "pids")
    v = Vlaunch("serve", str(model), "--gpus", "cpu", "--no-metrics", "--stop-timeout", "5",
                "--log-dir", str(tmp_path), cwd=tmp_path)
    pids = _fake_pids(tmp_path / "pids")
    v.wait_for(r"loading_weights")
    os.kill(v.proc.pid, sig)
    assert v.finish() == 128 + sig, v.text  # 143, 130, 129; never 241
    assert f"stopped by {signal.Signals(sig).name}" in v.text
    assert _gone(pids, 10)


def test_sigterm_while_serving_exits_143(env, model, tmp_path):
    env("ready", pid_file=tmp_path / "pids")
    v = Vlaunch("serve", str(model), "--gpus", "cpu", "--no-metrics", "--stop-timeout", "5",
                "--log-dir", str(tmp_path), cwd=tmp_path)
    v.wait_for(r"serving on http://")
    pids = _fake_pids(tmp_path / "pids")
    os.kill(v.proc.pid, signal.SIGTERM)
    assert v.finish() == 143, v.text
    assert _gone(pids, 10)


@pytest.mark.parametrize("error, lesson", [
    ("RuntimeError: expected scalar type BFloat16 but found Float8_e4m3fn", True),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", False),
])
def test_smoke_failure_is_an_fp8_lesson_only_when_the_error_says_fp8(env, model, tmp_path,
                                                                      error, lesson):
    env(f"smoke_fail:{error}")
    result, lines = _serve(model, pins=Pins(kv_cache_dtype="fp8"), log_dir=tmp_path)
    text = "\n".join(lines)
    assert result.exit_code == 1, text
    learnt = _lessons(tmp_path)
    if lesson:
        assert [v["supported"] for v in learnt.values()] == [False], learnt
        assert "restarting with --kv-cache-dtype auto" in text
        assert result.attempts[1].args[result.attempts[1].args.index("--kv-cache-dtype") + 1] \
            == "auto"
    else:
        assert learnt == {}, learnt
        assert len(result.attempts) == 1 and "restarting" not in text
        assert "illegal memory access" in text  # its cause is shown


# --- item 3: vLLM dies with its supervisor; an orphan's port is not ours ---------------------


def test_vllm_dies_with_a_killed_supervisor(env, model, tmp_path):
    env("ready", pid_file=tmp_path / "pids")
    v = Vlaunch("serve", str(model), "--gpus", "cpu", "--no-metrics", "--stop-timeout", "5",
                "--log-dir", str(tmp_path), cwd=tmp_path)
    v.wait_for(r"serving on http://")
    pids = _fake_pids(tmp_path / "pids")
    os.kill(v.proc.pid, signal.SIGKILL)  # no handler runs: the watchdog must act
    v.finish()
    try:
        assert _gone(pids, 15), "vLLM outlived its supervisor"
    finally:  # never leave the orphan behind, even when the test fails
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture()
def orphan(tmp_path: Path):
    """A fake vLLM left running on a port by 'an earlier run' (not our child)."""
    port = free_port()
    env = {**os.environ, "FAKE_VLLM_MODE": "ready"}
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "orphan", "--port", str(port),
                             "--served-model-name", "small"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not port_answers("127.0.0.1", port):
        assert time.monotonic() < deadline and proc.poll() is None, "orphan did not start"
        time.sleep(0.05)
    yield port
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_port_that_already_answers_is_refused_before_starting(env, model, tmp_path, orphan):
    with pytest.raises(InputError, match=f"port {orphan} already answers"):
        _serve(model, port=orphan, log_dir=tmp_path)
    assert not list(tmp_path.glob("vllm-*.log")), "nothing may be started"
    v = Vlaunch("serve", str(model), "--gpus", "cpu", "--no-metrics", "--port", str(orphan),
                "--log-dir", str(tmp_path), cwd=tmp_path)
    assert v.finish() == 2
    assert "already answers" in v.text and "Traceback" not in v.text


def test_readiness_is_checked_against_our_own_child(env, tmp_path, orphan):
    env("hang")  # our child never binds; the orphan answers /health and /v1/models
    r = VllmRunner(["--model", "small", "--port", str(orphan)], log_path=tmp_path / "v.log",
                   poll_interval=0.1, grace_period=2)
    with r:
        r.start()
        out = r.wait_ready(timeout=3)
    assert not out.ready and out.reason == "timeout"
    assert r.foreign_listener


# --- item 4: a log per attempt; only this attempt's bytes are read ---------------------------


SHORTAGE = ("ValueError: To serve at least one request with the model's max seq len (2048), "
            "(0.01 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(0.01 GiB). Based on the available memory, the estimated maximum model length is "
            "1024. Try increasing `gpu_memory_utilization` or decreasing `max_model_len`")


def test_a_second_run_in_the_same_log_dir_does_not_read_the_first(env, model, tmp_path):
    env(f"exit:{SHORTAGE}")
    first, lines = _serve(model, log_dir=tmp_path, max_attempts=1)
    assert first.exit_code == 1 and "estimated maximum model length" in "\n".join(lines)
    env("ready", lifetime=1)
    second, lines = _serve(model, log_dir=tmp_path, max_attempts=3)
    text = "\n".join(lines)
    assert [a.outcome for a in second.attempts] == ["serving"], text
    assert "re-planning" not in text and "failed" not in text
    logs = sorted(tmp_path.glob("vllm-*-attempt1.log"))
    assert len(logs) == 2 and len({p.name.split("-attempt")[0] for p in logs}) == 2


def test_runner_reads_only_its_own_bytes_of_an_existing_log(env, tmp_path):
    log = tmp_path / "shared.log"
    log.write_text(f"(EngineCore pid=1) ERROR [core.py:1510] {SHORTAGE}\n"
                   "(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 7 "
                   "tokens, Maximum concurrency for 1,024 tokens per request: 1.00x\n")
    env("exit:RuntimeError: something else entirely")
    r = VllmRunner(["--model", "m"], log_path=log, poll_interval=0.1, grace_period=2)
    with r:
        r.start()
        out = r.wait_ready(timeout=20)
    assert out.reason == "exited"
    assert "something else entirely" in out.failure.message
    assert "KV cache is needed" not in r.log_text()
    assert log.read_text().startswith("(EngineCore pid=1) ERROR")  # appended, not replaced


# --- item 5: the pump never stops draining; logs are bounded ---------------------------------


def _runner(tmp_path: Path, **kw) -> VllmRunner:
    kw.setdefault("log_path", tmp_path / "v.log")
    return VllmRunner(["--model", "m"], poll_interval=0.1, grace_period=2, **kw)


def test_a_full_disk_does_not_stall_vllm(env, tmp_path):
    env("flood", flood_lines=30000)
    r = _runner(tmp_path, log_path="/dev/full")  # every write: ENOSPC
    with r:
        r.start()
        out = r.wait_ready(timeout=30)
        assert out.ready, out.log_tail
        assert r.log_write_errors > 0
        assert r.read_actual().allocation.kv_cache_tokens == 28928  # from the lines in memory


def test_a_slow_terminal_does_not_stall_vllm(env, tmp_path):
    env("flood", flood_lines=30000)
    seen: list[str] = []

    def slow_echo(line: str) -> None:
        seen.append(line)
        time.sleep(0.5)

    r = _runner(tmp_path, echo=slow_echo)
    with r:
        r.start()
        assert r.wait_ready(timeout=30).ready
        assert r.echo_dropped > 0 and len(seen) < 100
    assert "flood done: 30000 lines" in r.log_text()


def test_the_log_is_rotated_and_read_back_in_bounded_pieces(env, tmp_path, monkeypatch):
    monkeypatch.setattr(logpump, "LOG_HEAD_BYTES", 64 << 10)
    monkeypatch.setattr(logpump, "LOG_TAIL_BYTES", 64 << 10)
    env("flood", flood_lines=30000)  # about 3.5 MB
    r = _runner(tmp_path, log_max_bytes=1 << 20)
    with r:
        r.start()
        assert r.wait_ready(timeout=30).ready
        actual = r.read_actual()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["v.log", "v.log.1"]
    assert all((tmp_path / f).stat().st_size <= (1 << 20) for f in files)
    assert actual.allocation.kv_cache_tokens == 28928
    assert len(r.log_text()) < (64 << 10) * 2 + 200
    assert "version 0.32.0" in r.log_text()  # the head is kept in memory


# --- item 6: local endpoints bypass proxies --------------------------------------------------


def test_readiness_and_exporter_ignore_a_proxy(env, model, tmp_path, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: any request sent there fails
    for k in ("http_proxy", "HTTP_PROXY", "https_proxy"):
        monkeypatch.setenv(k, dead)
    v = Vlaunch("serve", str(model), "--gpus", "cpu", "--metrics-port", "0", "--startup-timeout",
                "20", "--stop-timeout", "5", "--log-dir", str(tmp_path), cwd=tmp_path)
    try:
        v.wait_for(r"serving on http://", timeout=30)
        url = v.wait_for(r"metrics on (http://\S+/metrics)").group(1)
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + 15
        body = ""
        while time.monotonic() < deadline and not re.search(r"^vlaunch_engine_up\S* 1", body,
                                                            re.M):
            body = direct.open(url, timeout=5).read().decode()
            time.sleep(0.3)
        assert re.search(r"^vlaunch_engine_up\S* 1", body, re.M), body[:3000]
    finally:
        os.kill(v.proc.pid, signal.SIGTERM)
        assert v.finish() == 143


# --- item 7: flags after -- that change how vLLM is reached; layout flags are pins -----------


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if subprocess.run(["which", "openssl"], capture_output=True).returncode:
        pytest.skip("openssl is needed to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key, cert


@pytest.mark.parametrize("how", ["api-key", "VLLM_API_KEY", "host", "root-path", "tls"])
def test_flags_that_change_how_vllm_is_reached_are_used(env, tmp_path, monkeypatch, how):
    args = ["--model", "m"]
    if how == "api-key":
        args += ["--api-key", "s3cret"]
    elif how == "VLLM_API_KEY":
        monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    elif how == "host":
        args += ["--host", "127.0.0.2"]  # loopback, but not 127.0.0.1
    elif how == "root-path":
        args += ["--root-path", "/llm/"]
    else:
        key, cert = _self_signed(tmp_path)
        args += ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    r = VllmRunner(args, log_path=tmp_path / "v.log", poll_interval=0.1, grace_period=2)
    with r:
        r.start()
        assert r.wait_ready(timeout=20).ready, r.log_text()[-2000:]
        assert r.smoke_test(max_tokens=2).ok
        assert r.read_actual().num_blocks == 28928 // 16
    if how == "tls":
        assert r.base_url.startswith("https://")


def test_layout_flags_after_dashdash_are_pins(env, model, tmp_path):
    result, lines = _serve(model, gpus="2xH100", extra=["--tensor-parallel-size", "2"],
                           dry_run=True)
    command = result.command
    assert command.count("--tensor-parallel-size") == 1
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert result.plan["parallel"]["tp"] == 2
    assert not any("(yours) replaces" in line for line in lines)
    with pytest.raises(InputError, match="--tp 2 is not possible"):
        _serve(model, gpus="1xH100", extra=["-tp", "2"], dry_run=True)
    with pytest.raises(InputError, match="disagree"):
        _serve(model, gpus="2xH100", pins=Pins(tp=1), extra=["--tensor-parallel-size=2"],
               dry_run=True)
    with pytest.raises(InputError, match="whole number"):
        _serve(model, gpus="2xH100", extra=["--pipeline-parallel-size", "two"], dry_run=True)


def test_layout_pin_after_dashdash_is_executed(env, model, tmp_path):
    env("ready", lifetime=1, argv_file=tmp_path / "argv.json")
    result, lines = _serve(model, gpus="2xH100", extra=["--tensor-parallel-size", "2"],
                           log_dir=tmp_path)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv.count("--tensor-parallel-size") == 1
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2", lines


# --- item 8: a configurable drain before SIGKILL ---------------------------------------------


def test_stop_timeout_default_and_vllm_drain_flag():
    assert DEFAULT_STOP_TIMEOUT_S == 120
    assert drain_seconds(120) == 110 and drain_seconds(0) == 0
    args = with_drain(["--model", "m"], "0.32.0", 120)
    assert args[-2:] == ["--shutdown-timeout", "110"]
    assert with_drain(["--model", "m"], "0.17.1", 120) == ["--model", "m"]  # no such flag yet
    mine = ["--model", "m", "--shutdown-timeout", "7"]
    assert with_drain(mine, "0.32.0", 120) == mine


@pytest.mark.parametrize("stop_timeout, drain, killed", [(1, 30, True), (10, 1, False)])
def test_stop_timeout_bounds_the_drain(env, model, tmp_path, stop_timeout, drain, killed):
    env("slow_drain", drain=drain, pid_file=tmp_path / "pids", argv_file=tmp_path / "argv")
    v = Vlaunch("serve", str(model), "--gpus", "cpu", "--no-metrics", "--stop-timeout",
                str(stop_timeout), "--log-dir", str(tmp_path), cwd=tmp_path)
    v.wait_for(r"serving on http://")
    pids = _fake_pids(tmp_path / "pids")
    argv = json.loads((tmp_path / "argv").read_text())
    assert argv[argv.index("--shutdown-timeout") + 1] == str(drain_seconds(stop_timeout))
    t0 = time.monotonic()
    os.kill(v.proc.pid, signal.SIGTERM)
    assert v.finish() == 143, v.text
    took = time.monotonic() - t0
    assert ("did not stop within" in v.text) is killed, v.text
    assert took < stop_timeout + 5
    if not killed:
        assert took >= drain  # it was allowed to finish draining
    assert _gone(pids, 5)


# --- item 9: the Ray paths run the right commands --------------------------------------------


def _ray_plan(model: Path):
    """A real two-node plan (TP4 x PP2 on 2x4xH100) on Ray."""
    import dataclasses

    from launcher.predict.search.planner import make_plan

    d = make_plan(load_model(str(model)), parse_gpus("2x4xH100"), Pins(tp=4, pp=2)).deployment()
    engine = dataclasses.replace(d.engine, distributed_executor_backend="ray")
    return dataclasses.replace(d, pools=(dataclasses.replace(d.pool, engine=engine),))


@pytest.fixture()
def fake_ray(tmp_path: Path, monkeypatch):
    """A `ray` on PATH that records each call; `ray start --head` fails when RAY_FAIL is set."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "ray-calls"
    (bin_dir / "ray").write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "if '--head' in sys.argv and os.environ.get('RAY_FAIL'):\n"
        "    sys.stderr.write('ConnectionError: ray head could not bind port 6379\\n')\n"
        "    sys.exit(1)\n"
        "import time; time.sleep(float(os.environ.get('RAY_SLEEP') or 0))\n")
    (bin_dir / "ray").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return lambda: [json.loads(x) for x in calls.read_text().splitlines()] \
        if calls.exists() else []


def _run_node(launch, plan, tmp_path, **kw) -> tuple[int, list[str]]:
    lines: list[str] = []
    rc = run_node(launch, plan, port=None, metrics_port=None, metrics_bind="127.0.0.1",
                  log_dir=tmp_path, verbose=False, startup_timeout=20, stop_timeout=5,
                  out=lines.append, **kw)
    return rc, lines


def test_ray_worker_runs_ray_start_not_vllm(env, model, tmp_path, fake_ray):
    plan = _ray_plan(model)
    launch = build_launch(plan, environ={}, role="worker", leader_address="10.0.0.1")
    rc, lines = _run_node(launch, plan, tmp_path, dry_run=True)
    words = [w for w in _last_command(lines).split()
             if not re.match(r"^[A-Z_]+=", w)]  # after the env
    assert rc == 0 and words == ["ray", "start", "--address=10.0.0.1:6379", "--block"]
    _run_node(launch, plan, tmp_path, dry_run=False)
    assert fake_ray() == [["start", "--address=10.0.0.1:6379", "--block"]]


def test_a_worker_serves_its_gpus_for_the_probes_and_no_engine_series(env, model, tmp_path,
                                                                       fake_ray, monkeypatch):
    """Issue 31: worker pods had no probes. A headless worker's vlaunch serves an exporter
    page (its GPUs) the manifests probe; it carries no engine series (there is no API to
    scrape, so vlaunch_engine_up would be 0 and page EngineDown) and no plan series."""
    monkeypatch.setenv("RAY_SLEEP", "30")
    plan = _ray_plan(model)
    launch = build_launch(plan, environ={}, role="worker", leader_address="10.0.0.1")
    lines: list[str] = []
    pages: list[str] = []

    def scrape() -> None:  # run_node must own the main thread (it forwards signals)
        end = time.monotonic() + 30
        url = None
        while url is None and time.monotonic() < end:
            url = next((ln.split(" on ", 1)[1] for ln in lines if "worker metrics" in ln), None)
            time.sleep(0.05)
        if url:
            pages.append(urllib.request.urlopen(url, timeout=10).read().decode())  # noqa: S310
        for pid in [p for p in psutil.pids() if _is_fake_ray(p, tmp_path)]:
            os.kill(pid, signal.SIGTERM)  # end the fake `ray start --block`

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    run_node(launch, plan, port=None, metrics_port=0, metrics_bind="127.0.0.1",
             log_dir=tmp_path, verbose=False, startup_timeout=20, stop_timeout=5,
             out=lines.append, dry_run=False)
    t.join(30)
    assert pages, lines
    samples = [ln for ln in pages[0].splitlines() if ln and not ln.startswith("#")]
    assert samples and not any(ln.startswith(("vlaunch_engine_up", "vlaunch_engine_starting",
                                              "vlaunch_plan", "vlaunch_kv"))
                               for ln in samples), samples


def _is_fake_ray(pid: int, tmp_path: Path) -> bool:
    try:
        return str(tmp_path / "bin" / "ray") in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def test_ray_leader_starts_the_head_then_vllm(env, model, tmp_path, fake_ray):
    env("ready", lifetime=1, lifetime_from="ready", argv_file=tmp_path / "argv.json")
    plan = _ray_plan(model)
    launch = build_launch(plan, environ={}, role="leader", leader_address="127.0.0.1")
    rc, lines = _run_node(launch, plan, tmp_path, dry_run=False)
    assert fake_ray() == [["start", "--head", "--port=6379"]]
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["serve", str(model)]  # the model positionally, as `vllm serve` takes it
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"
    assert any("leader serving on http://" in line for line in lines), lines


def test_failing_ray_head_is_one_line(env, model, tmp_path, fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_FAIL", "1")
    plan = _ray_plan(model)
    launch = build_launch(plan, environ={}, role="leader", leader_address="127.0.0.1")
    rc, lines = _run_node(launch, plan, tmp_path, dry_run=False)
    assert rc == 1
    assert lines == ["vlaunch: `ray start --head --port=6379` failed with status 1: "
                     "ConnectionError: ray head could not bind port 6379"]


def test_exec_ray_head_failure_through_the_cli(env, model, tmp_path, fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_FAIL", "1")
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "127.0.0.1")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(dump(_ray_plan(model))))
    v = Vlaunch("exec", "--plan", str(plan), "--role", "leader", "--no-metrics",
                "--log-dir", str(tmp_path), cwd=tmp_path)
    assert v.finish() == 1, v.text
    assert "Traceback" not in v.text
    assert "`ray start --head --port=6379` failed with status 1" in v.text


def test_mp_worker_runs_headless_vllm_and_refuses_a_layout_change(env, model, tmp_path):
    from launcher.predict.search.planner import make_plan

    plan = make_plan(load_model(str(model)), parse_gpus("2x4xH100"),
                     Pins(tp=4, pp=2)).deployment()
    launch = build_launch(plan, environ={}, role="worker", leader_address="10.0.0.1")
    rc, lines = _run_node(launch, plan, tmp_path, dry_run=True)
    words = _last_command(lines).split()
    assert rc == 0 and "--headless" in words and "--port" not in words
    assert words[words.index("serve") + 1] == str(model)
    with pytest.raises(InputError, match="layout is fixed"):
        _run_node(launch, plan, tmp_path, dry_run=True, extra=["--tensor-parallel-size", "8"])


# --- item 10: a failed start shows vLLM's last words and the doctor's diagnosis --------------


def test_no_vllm_installed_shows_the_cause(env, model, tmp_path, monkeypatch):
    # -S: no site-packages, so no vLLM, exactly as on a machine without it
    monkeypatch.setenv("VLAUNCH_VLLM_COMMAND",
                       f"{shlex.quote(sys.executable)} -S -m vllm.entrypoints.openai.api_server")
    result, lines = _serve(model, log_dir=tmp_path, max_attempts=1)
    text = "\n".join(lines)
    assert result.exit_code == 1
    assert "No module named 'vllm'" in text
    assert "doctor: missing_module" in text and "install the package" in text


def test_an_unknown_error_still_shows_vllms_last_lines(env, model, tmp_path):
    env("exit:ZeroDivisionError: a failure nobody has catalogued")
    result, lines = _serve(model, log_dir=tmp_path, max_attempts=1)
    text = "\n".join(lines)
    assert "a failure nobody has catalogued" in text
    assert "vLLM's last lines" in text and "Engine core initialization failed" in text


def test_a_missing_program_is_one_line(env, model, tmp_path, monkeypatch):
    monkeypatch.setenv("VLAUNCH_VLLM_COMMAND", str(tmp_path / "no-such-vllm") + " serve")
    result, lines = _serve(model, log_dir=tmp_path, max_attempts=1)
    assert result.exit_code == 127
    assert len(lines[-1].splitlines()) == 1 and "cannot run" in lines[-1]


# --- item 11: a local model answers to its short name and its path ---------------------------


def test_serve_both_names():
    args = ["--model", "/m/tiny", "--served-model-name", "tiny", "--port", "1"]
    assert serve_both_names(args) == ["--model", "/m/tiny", "--served-model-name", "tiny",
                                      "/m/tiny", "--port", "1"]
    hub = ["--model", "org/x"]
    assert serve_both_names(hub) == hub
    both = ["--model", "/m/tiny", "--served-model-name", "a", "b"]
    assert serve_both_names(both) == both


def test_a_local_model_is_served_by_both_names(env, model, tmp_path):
    env("ready", lifetime=1, argv_file=tmp_path / "argv.json")
    result, lines = _serve(model, log_dir=tmp_path)
    argv = json.loads((tmp_path / "argv.json").read_text())
    i = argv.index("--served-model-name")
    assert argv[i + 1: i + 3] == ["small", str(model)]
    assert result.attempts[-1].outcome == "serving", lines


# --- a port that is not ours, closed -----------------------------------------------------------


def test_port_answers_is_false_for_a_closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        assert not port_answers("127.0.0.1", port)


def test_a_dry_run_shows_the_port_a_real_run_takes(env, model, tmp_path):
    """The port is chosen first, the same way for both (vLLM's default when free, else the
    first free one above it), then printed: what the dry run shows is what the real run
    started right after it passes to vLLM, also while something holds the default port."""
    import socket

    from launcher.run.vllmargs import DEFAULT_PORT, first_free_port

    def dry_port() -> int:
        _, lines = _serve(model, dry_run=True)
        words = _last_command(lines).split()
        return int(words[words.index("--port") + 1])

    def real_port() -> int:
        env("ready", lifetime=1, argv_file=tmp_path / "argv.json")
        _serve(model, log_dir=tmp_path)
        argv = json.loads((tmp_path / "argv.json").read_text())
        return int(argv[argv.index("--port") + 1])

    with contextlib.ExitStack() as held:
        for _ in range(2):  # the default, then the default held: the next free one
            shown = dry_port()
            assert shown == first_free_port() and shown == real_port()
            s = held.enter_context(socket.socket())
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", shown))
            s.listen()
            assert first_free_port() != shown
        assert first_free_port() >= DEFAULT_PORT
def test_serve_records_the_start_up_and_the_next_plan_uses_it(env, model, tmp_path):
    """serve times the fake engine's phases to ready; a plan of the same setup then carries
    that start-up (source measured) and its autoscaling windows follow it."""
    from launcher.predict.search.planner import make_plan

    env("ready", lifetime=1)
    result, lines = _serve(model, log_dir=tmp_path, max_attempts=1)
    text = "\n".join(lines)
    assert [a.outcome for a in result.attempts] == ["serving"], text
    (line,) = [x for x in lines if "start-up took" in x]
    measured_s = float(line.split("start-up took ")[1].split(" s")[0])
    d = make_plan(load_model(str(model)), parse_gpus("cpu"), Pins()).to_dict()
    assert d["startup"]["source"] == "measured"
    assert d["startup"]["seconds"] == measured_s  # the figure serve printed
    assert "starting" in d["startup"]["terms"]
    assert d["autoscaling"]["scale_up_stabilization_s"] >= d["startup"]["seconds"]


def test_startup_phases_print_behind_a_bar_of_the_deadline_spent(env, model, tmp_path):
    """Each start-up phase line carries the share of `--startup-timeout` used so far (20 cells,
    to the nearest: the elapsed time it prints, over the deadline), in plain characters."""
    env("ready", lifetime=1)
    result, lines = _serve(model, log_dir=tmp_path, startup_timeout=20)
    phases = [x for x in lines if re.match(r"^  \[ *\d+\.\ds\] \[[#.]{20}\] \w+$", x)]
    assert [x.split()[-1] for x in phases][-1] == "ready", lines
    for x in phases:
        elapsed = float(re.search(r"\[ *([\d.]+)s\]", x).group(1))
        # the nearest cell of the unrounded time: half a cell, plus the 0.05 s it was rounded by
        assert abs(x.count("#") - min(1.0, elapsed / 20) * 20) <= 0.5 + 0.05 * 20 / 20
