"""vlaunch's exporter beside a running vLLM: started with the engine, told what it reported.

Apart from serve.py (the supervision) because both `serve` and each node of a multi-node
`exec` start one, the leader's with the engine's series and a headless worker's with its GPUs
only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..deployment.plan import Deployment
from ..predict.memory.budget import GiB
from .emit import startup_deadline_s


def start_exporter(base_url: str, plan: Deployment, port: int, bind: str,
                    out: Callable[[str], None], startup_timeout: float | None = None):
    """The exporter beside a start: its "starting" phase lasts as long as this attempt may
    (a user's longer --startup-timeout must not end it early and fire VlaunchEngineDown)."""
    from ..observe.exporter import Exporter

    exp = Exporter(vllm_url=base_url, plan=plan,
                   startup_timeout_s=startup_timeout or startup_deadline_s)
    try:
        bound = exp.start(port=port, bind=bind)
    except Exception as e:  # a busy port must not take the engine down
        out(f"vlaunch: metrics exporter not started: {e}")
        return None
    out(f"vlaunch: metrics on http://{bind}:{bound}/metrics (vLLM's own at {base_url}/metrics)")
    sys.stdout.flush()
    return exp


def start_worker_exporter(port: int, bind: str, out: Callable[[str], None]) -> Any:
    """A headless worker's exporter: its node's GPUs only. No engine series (it has no API to
    scrape: vlaunch_engine_up would read 0 and page EngineDown) and no plan series (the
    leader's say it once). It gives the worker's pod a page to probe and Prometheus the
    memory of GPUs no other target reports (issue 31: worker pods had no probes)."""
    from ..observe.exporter import Exporter

    exp = Exporter(vllm_url=None, plan=None)
    try:
        bound = exp.start(port=port, bind=bind)
    except Exception as e:  # a busy port must not take the worker down
        out(f"vlaunch: worker metrics not started: {e}")
        return None
    out(f"vlaunch: worker metrics (GPUs) on http://{bind}:{bound}/metrics")
    return exp


def set_actual(exp: Any, actual: Any) -> None:
    """Hand the exporter what vLLM reported at start-up."""
    alloc = actual.allocation
    exp.set_actual(kv_tokens=actual.kv_cache_tokens, kv_memory_bytes=actual.kv_cache_memory_bytes,
                   weights_bytes=int(alloc.weights_gib * GiB) if alloc.weights_gib else None,
                   num_blocks=actual.num_blocks, block_size=actual.block_size)
