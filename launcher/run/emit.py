"""Hand a plan from the planner to the process that runs it, through files.

In Kubernetes the planner runs as an init container and vLLM in the main container; the only
thing they share is a volume. So the plan goes there as three files:

- `plan.json`: the whole plan (the codec's dump of its Deployment), what `vlaunch exec`
  reads back (`load_plan`, the codec's load);
- `vllm-args`: vLLM's arguments, one per line, for a shell entrypoint or a human;
- `vllm.env`: the environment the plan asks for, as `KEY='value'` lines a shell can source;
- `scaledobject.yaml`: a KEDA ScaledObject per pool, from the plan's `autoscaling` (when the
  plan has a knee to derive it from).

A disaggregated plan is emitted one pool per folder (`vlaunch plan ... --role prefill|decode
--emit DIR`, `pool_plan`): plan.json holds the whole deployment, so every pod of either pool
plans and agrees on the same one, plus `role`, the pool this folder runs; the other files are
that pool's (its argv with its `--kv-transfer-config`, its environment, its ScaledObject).

Every file is written atomically (temp file in the same folder, then `os.replace`), and
`plan.json` is written last, so a reader that finds `plan.json` finds the other two complete
and never sees half a file, even if the planner is killed mid-write.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..deployment.argv import pool_argv
from ..deployment.codec import dump, load
from ..deployment.plan import Autoscaling, Deployment, Pool
from ..errors import InputError
from ..paths import atomic_write, loads_json, read_small_text, warn_if_foreign, warn_if_open_folder
from ..predict.capacity.autoscaling import trigger_thresholds
from ..predict.capacity.startup_time import NETWORK_VOLUME_BYTES_PER_S

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


ROLES = ("prefill", "decode")


SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"


def pool_plan(dep: Deployment, role: str) -> Deployment:
    """The plan as the folder of its `role` pool holds it: the whole deployment, with `role`
    naming the pool it runs (its `pool`, `engine` and top-level JSON keys are then that pool's).
    One line when the plan has no such pool: an aggregated plan has no roles to run.

    A pool's folder runs apart from the other pool (its own pod or machine), so no pool keeps a
    loopback side-channel host (a one-node split's, right only when `vlaunch serve` runs both
    engines on one host): each engine advertises its own address, set where it runs
    (`exec_plan.check_pool_plan` asks for it)."""
    if role not in ROLES:
        raise InputError(f"--role {role}: a pool of a disaggregated plan is one of "
                         f"{', '.join(ROLES)}")
    if dep.kind != "disaggregated":
        why = ("it does not fit" if not dep.fits else
               "disaggregation does not win here (see its reasons)")
        raise InputError(f"--role {role}: the plan is aggregated ({why}), so it has no {role} "
                         "pool; pass --disaggregate on to split it, or drop --role to run the "
                         "one aggregated engine")
    if role not in {p.role for p in dep.pools}:
        raise InputError(f"--role {role}: the plan has no {role} pool (it has "
                         f"{', '.join(p.role for p in dep.pools)})")
    apart = tuple(dataclasses.replace(p, env={k: v for k, v in p.env.items()
                                              if k != SIDE_CHANNEL_HOST}) for p in dep.pools)
    return dataclasses.replace(dep, role=role, pools=apart)


def emitted_pools(dep: Deployment) -> tuple[Pool, ...]:
    """The pools a folder of this plan runs: the one its `role` names, else every pool."""
    return (dep.pool,) if dep.role is not None else dep.pools


def emit_plan(dep: Deployment, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write the plan's files into `out_dir`; return their paths (plan.json last).

    Everything is rendered before anything is written, so a plan that cannot be expressed
    (a bad env name, an argument with a line break) leaves the folder untouched. A
    disaggregated plan is written one pool at a time (`pool_plan`): one engine per folder.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--emit {out}: not a folder; give a folder for the plan files")
    if dep.kind == "disaggregated" and dep.role is None:
        raise InputError("--emit writes one pool's files (one pod's engine); pass --role "
                         "prefill or --role decode to emit that pool of the disaggregated plan")
    rendered = [
        (ARGS_FILE, _args_text(pool_argv(dep.pool) if dep.fits else [])),
        (ENV_FILE, _env_text(dep.pool.env)),
        *([(SCALEDOBJECT_FILE, scaled_objects_text(dep))]
          if any(p.autoscaling for p in emitted_pools(dep)) else []),
        (PLAN_FILE, json.dumps(dump(dep), indent=2, sort_keys=True) + "\n"),
    ]
    out.mkdir(parents=True, exist_ok=True)
    warn_if_open_folder(out)
    return [atomic_write(out / name, text) for name, text in rendered]


def load_plan(path: str | os.PathLike[str]) -> Deployment:
    """Read a plan written by `emit_plan` (a plan.json, or the folder that holds one) as its
    Deployment; one line (an InputError) when it cannot be read or is not a plan."""
    p = Path(path)
    if p.is_dir():
        p = p / PLAN_FILE
    try:
        text = read_small_text(p)  # a FIFO or /dev/zero is refused, never waited on or read
    except FileNotFoundError:
        raise InputError(
            f"no plan at {p}; write one with `vlaunch plan MODEL --emit DIR`"
        ) from None
    except OSError as e:
        raise InputError(f"cannot read plan {p}: {e.strerror}; give the plan.json that "
                         "`vlaunch plan --emit DIR` wrote") from None
    except UnicodeDecodeError:
        raise InputError(f"plan {p} is not UTF-8 text, so not a vlaunch plan") from None
    warn_if_foreign(p)
    try:
        raw = loads_json(text)
    except json.JSONDecodeError as e:
        raise InputError(f"plan {p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return load(raw)
    except InputError as e:
        raise InputError(f"plan {p}: {e}") from None


STARTUP_SECONDS_BASE = 300
STARTUP_BYTES_PER_SECOND = NETWORK_VOLUME_BYTES_PER_S  # capacity/startup_time.py: one number
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
    from ..printable import printable

    p = Path(path)
    if not p.exists():
        return False
    data = printable(text).encode("utf-8")  # kubectl describe prints it to a terminal
    if len(data) > TERMINATION_MAX_BYTES:
        keep = TERMINATION_MAX_BYTES - len(_TRUNCATED.encode())
        data = data[:keep].decode("utf-8", errors="ignore").encode("utf-8") + _TRUNCATED.encode()
    try:
        with open(p, "wb") as f:
            f.write(data)
    except OSError:
        return False
    return True


# --- KEDA ScaledObject -------------------------------------------------------------------------

SCALEDOBJECT_FILE = "scaledobject.yaml"
PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
"""The Service the Prometheus Operator creates for its Prometheus (`prometheus-operated`)."""

# vLLM's own gauges (vllm/v1/metrics/loggers.py); never the removed vllm:gpu_cache_usage_perc.
RUNNING, WAITING, KV_USAGE = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                              "vllm:kv_cache_usage_perc")
# The pods that serve the API: a Deployment's (NAME-<hash>-<id>) or an LWS group's leader
# (NAME-<group>; its workers, NAME-<group>-<index>, export no request gauges).
POD_PATTERNS = {"Deployment": "{name}-[a-z0-9]+-[a-z0-9]+", "LeaderWorkerSet": "{name}-[0-9]+"}
TARGET_API = {"Deployment": "apps/v1", "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1"}


def trigger_queries(selector: str, replica_label: str = "pod") -> dict[str, str]:
    """The PromQL of each trigger, summed over the pool (KEDA's AverageValue divides the sum by
    the replicas): requests running, requests waiting, and each replica's mean KV usage over its
    engines (the series of one `replica_label` value) summed over replicas."""
    return {"running": f"sum({RUNNING}{{{selector}}})",
            "waiting": f"sum({WAITING}{{{selector}}})",
            "kv_usage": f"sum(avg by ({replica_label}) ({KV_USAGE}{{{selector}}}))"}


def scaled_object(a: Autoscaling | None, name: str = "vlaunch", kind: str = "Deployment",
                  namespace: str | None = None,
                  prometheus_url: str = PROMETHEUS_URL) -> dict[str, Any]:
    """A keda.sh/v1alpha1 ScaledObject that scales the workload `kind`/`name` of one pool on
    vLLM's gauges, at the pool's `autoscaling` targets and windows."""
    if a is None:
        raise InputError("the plan has no `autoscaling` (it does not fit, or has no SLO knee); "
                         "re-plan with a reachable --slo")
    if kind not in POD_PATTERNS:
        raise InputError(f"cannot scale a {kind}; one of {', '.join(POD_PATTERNS)}")
    name = name if a.role == "aggregated" else f"{name}-{a.role}"  # one workload per pool
    selector = f'pod=~"{POD_PATTERNS[kind].format(name=name)}"'
    if namespace:
        selector = f'namespace="{namespace}", {selector}'
    queries = trigger_queries(selector)
    # the pool role's triggers (a prefill pool on its queue, a decode pool on its batch and
    # KV): the same thresholds the exporter's vlaunch_desired_replicas divides by
    thresholds = trigger_thresholds(a)
    meta: dict[str, Any] = {"name": name,
                            "labels": {"app.kubernetes.io/name": "vlaunch",
                                       "app.kubernetes.io/component": a.role}}
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": TARGET_API[kind], "kind": kind, "name": name},
            "minReplicaCount": a.min_replicas, "maxReplicaCount": a.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_s},
                "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_s}}}},
            "triggers": [{"type": "prometheus", "name": f"vllm-{key.replace('_', '-')}",
                          "metricType": "AverageValue",
                          "metadata": {"serverAddress": prometheus_url, "query": q,
                                       "threshold": f"{thresholds[key]:g}"}}
                         for key, q in queries.items() if key in thresholds],
        },
    }


def scaled_objects_text(dep: Deployment, **kw: Any) -> str:
    """The ScaledObject of each pool of the plan (of a pool's folder: its pool) that has
    autoscaling, as YAML documents."""
    import yaml

    header = ("# GENERATED by vlaunch from the plan's autoscaling (launcher/run/emit.py): the\n"
              "# thresholds are the replica's capacity at the SLO knee, the windows its\n"
              "# start-up.\n")
    return header + yaml.safe_dump_all([scaled_object(p.autoscaling, **kw)
                                        for p in emitted_pools(dep) if p.autoscaling],
                                       sort_keys=False, width=100)
