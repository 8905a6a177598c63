"""Hand a plan from the planner to the process that runs it, through files.

In Kubernetes the planner runs as an init container and vLLM in the main container; the only
thing they share is a volume. So the plan goes there as three files:

- `plan.json`: the whole plan (the codec's dump of its Deployment), what `vlaunch exec`
  reads back (`load_plan`, the codec's load);
- `vllm-args`: vLLM's arguments, one per line, for a shell entrypoint or a human;
- `vllm.env`: the environment the plan asks for, as `KEY='value'` lines a shell can source.

Every file is written atomically (temp file in the same folder, then `os.replace`), and
`plan.json` is written last, so a reader that finds `plan.json` finds the other two complete
and never sees half a file, even if the planner is killed mid-write.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from ..deployment.argv import engine_argv
from ..deployment.codec import dump, load
from ..deployment.plan import Deployment
from ..errors import InputError
from ..paths import atomic_write

PLAN_FILE = "plan.json"
ARGS_FILE = "vllm-args"
ENV_FILE = "vllm.env"

# Kubernetes truncates a container's termination message at 4096 bytes; staying under it
# keeps the end of the message (our own marker) visible in `kubectl describe pod`.
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_MAX_BYTES = 4096
_TRUNCATED = "\n[...truncated]"

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Start-up time the Kubernetes manifests allow beyond vLLM's own attempts: `vlaunch exec`
# re-planning, the exporter coming up, and the kubelet's probe period.
STARTUP_MARGIN_S = 300


def _args_text(args: list[str]) -> str:
    for a in args:
        if "\n" in a or "\r" in a:
            raise InputError(f"vLLM argument {a!r} holds a line break; one argument per line")
    return "".join(f"{a}\n" for a in args)


def _env_text(env: Mapping[str, str]) -> str:
    lines = []
    for key in sorted(env):
        if not _ENV_KEY.match(key):
            raise InputError(f"environment name {key!r} is not valid; use letters, digits, _")
        lines.append(f"{key}={shlex.quote(str(env[key]))}\n")
    return "".join(lines)


def emit_plan(dep: Deployment, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the plan's three files into `out_dir`; return their paths (plan.json last).

    Everything is rendered before anything is written, so a plan that cannot be expressed
    (a bad env name, an argument with a line break) leaves the folder untouched.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--emit {out}: not a folder; give a folder for the plan files")
    rendered = [
        (ARGS_FILE, _args_text(engine_argv(dep.engine) if dep.fits else [])),
        (ENV_FILE, _env_text(dep.pool.env)),
        (PLAN_FILE, json.dumps(dump(dep), indent=2, sort_keys=True) + "\n"),
    ]
    out.mkdir(parents=True, exist_ok=True)
    return [atomic_write(out / name, text) for name, text in rendered]


def load_plan(path: str | os.PathLike[str]) -> Deployment:
    """Read a plan written by `emit_plan` (a plan.json, or the folder that holds one) as its
    Deployment; one line (an InputError) when it cannot be read or is not a plan."""
    p = Path(path)
    if p.is_dir():
        p = p / PLAN_FILE
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(
            f"no plan at {p}; write one with `vlaunch plan MODEL --emit DIR`"
        ) from None
    except OSError as e:
        raise InputError(f"cannot read plan {p}: {e.strerror}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"plan {p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return load(raw)
    except InputError as e:
        raise InputError(f"plan {p}: {e}") from None


STARTUP_SECONDS_BASE = 300
STARTUP_BYTES_PER_SECOND = 200 * (1 << 20)
"""Start-up deadline: 5 minutes plus the weights at 200 MiB/s (a slow network volume); a
DeepSeek-V3 FP8 load is given about an hour. A hang past it is a failure, not a wait."""


def startup_deadline_s(plan: Deployment) -> float:
    """Seconds one start-up attempt of `plan` may take before `serve`/`exec` call it a hang.

    `serve`'s own rule (a base plus the weights read at a slow volume's speed), in one place for
    the others that must agree with it: the exporter counts a silent engine as starting for
    this long, and the manifests' startupProbe allows every attempt this long.
    """
    return STARTUP_SECONDS_BASE + max(0, plan.model.weights_bytes) / STARTUP_BYTES_PER_SECOND


def startup_budget_s(plan: Deployment, attempts: int,
                     margin_s: float = STARTUP_MARGIN_S) -> float:
    """The whole start-up a supervisor may need for `plan`: every attempt to its deadline
    (a failed attempt is re-planned and retried), plus a margin for vlaunch itself. A
    startupProbe shorter than this kills a container that was still within its attempts."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    return attempts * startup_deadline_s(plan) + margin_s


def write_termination_message(text: str, path: str | os.PathLike[str] = TERMINATION_LOG) -> bool:
    """Leave `text` where Kubernetes shows it as the container's last state; True if written.

    Only writes when the file already exists: the kubelet creates it inside a pod, and
    outside one we must not create `/dev/termination-log`. Best effort by design: failing to
    explain a failure must not hide the failure itself, so write errors return False.
    """
    p = Path(path)
    if not p.exists():
        return False
    data = text.encode("utf-8")
    if len(data) > TERMINATION_MAX_BYTES:
        keep = TERMINATION_MAX_BYTES - len(_TRUNCATED.encode())
        data = data[:keep].decode("utf-8", errors="ignore").encode("utf-8") + _TRUNCATED.encode()
    try:
        with open(p, "wb") as f:
            f.write(data)
    except OSError:
        return False
    return True
