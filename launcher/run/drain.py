"""How long a stop may take, and how much of it vLLM spends draining in-flight requests.

Why: a stop that aborts answers half-way is a failed request for every client; one that waits
forever blocks a redeploy. vLLM drains on SIGTERM only when `--shutdown-timeout` is set, so the
supervisor adds it (where vLLM has it) inside its own stop timeout, leaving room for the
engine's shutdown before SIGKILL.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..inputs import vllm_flags as F
from .vllmargs import arg_value

DEFAULT_STOP_TIMEOUT_S = 120
"""Seconds between the stop signal and SIGKILL (`--stop-timeout`). vLLM drains in-flight
requests for most of it (`--shutdown-timeout`, see `drain_seconds`); two minutes lets a long
answer (thousands of tokens at tens of ms each) finish. A Kubernetes pod's
terminationGracePeriodSeconds must be at least this plus a few seconds."""

# `vllm serve --shutdown-timeout` (drain in-flight requests on SIGTERM; 0, its default, aborts
# them; vllm-project/vllm#34730): its first release is the flag table's (vllm_flags.py).


def _version_tuple(version: str | None) -> tuple[int, ...]:
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(x or 0) for x in m.groups()) if m else ()


def drain_seconds(stop_timeout: float) -> int:
    """vLLM's own drain time inside our stop timeout: room is left for its engine shutdown."""
    return max(0, int(stop_timeout - min(10.0, stop_timeout / 4)))


def with_drain(args: Sequence[str], vllm_version: str | None, stop_timeout: float) -> list[str]:
    """Add `--shutdown-timeout` so SIGTERM drains instead of aborting, where vLLM has it and
    the user did not set it."""
    out = list(args)
    if arg_value(out, "shutdown_timeout") is not None:
        return out
    if _version_tuple(vllm_version) and F.available("shutdown_timeout", str(vllm_version)):
        out += [F.flag("shutdown_timeout"), str(drain_seconds(stop_timeout))]
    return out
