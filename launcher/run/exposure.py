"""Where vLLM listens, and a warning when that is beyond this machine without a key.

`vllm serve` without `--host` binds every interface (uvicorn's host None), so a server that
vlaunch started "to try a model" would answer the whole network. vlaunch passes
`--host 127.0.0.1` unless the user chose a host (vlaunch's `--host`, or `--host` after `--`).
A server that does listen beyond loopback without `--api-key` / VLLM_API_KEY is warned about;
even with a key vLLM leaves /invocations, /tokenize and /metrics open
(vllm/entrypoints/serve/middleware/authenticate.py), so the network is the real guard.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence

from ..inputs import vllm_flags as F
from .vllmargs import arg_value

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; a wildcard (0.0.0.0, ::) or any other name is not."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def with_host(args: Sequence[str], host: str | None = None) -> list[str]:
    """`args` with `--host` set: the user's own `--host` in `args` wins, then `host`, then
    loopback."""
    out = list(args)
    if arg_value(out, "host") is None:
        out += [F.flag("host"), host or LOOPBACK]
    return out


def has_api_key(args: Sequence[str], env: Mapping[str, str | None] | None = None) -> bool:
    """Will vLLM require a key? `--api-key`, or VLLM_API_KEY in the child's environment (the
    plan's env first, then ours, as the runner passes them)."""
    if arg_value(args, "api_key"):
        return True
    env = env or {}
    if "VLLM_API_KEY" in env:
        return bool(env["VLLM_API_KEY"])
    return bool(os.environ.get("VLLM_API_KEY"))


def exposure_warning(args: Sequence[str], env: Mapping[str, str | None] | None = None) -> \
        str | None:
    """One line when vLLM will listen beyond loopback with no key; None otherwise."""
    host = arg_value(args, "host")
    if host is not None and is_loopback(host):
        return None
    if has_api_key(args, env):
        return None
    where = "every interface" if host in (None, "", "0.0.0.0", "::") else host
    port = arg_value(args, "port") or "its port"
    return (f"warning: vLLM listens on {where} (port {port}) with no API key: anyone who can "
            "reach it can use the model; set VLLM_API_KEY, and firewall it (even with a key "
            "vLLM leaves /invocations, /tokenize and /metrics open)")
