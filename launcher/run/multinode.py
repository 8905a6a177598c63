"""Turn a plan into the command each node of a multi-node deployment runs.

vLLM already knows how to span nodes; this module only picks the right one of its own
mechanisms for the plan and fills in the flags from the LeaderWorkerSet environment
(`LWS_LEADER_ADDRESS`, `LWS_GROUP_SIZE`, `LWS_WORKER_INDEX`). Flag names are vLLM 0.32.0's
(`vllm/engine/arg_utils.py`, `vllm/entrypoints/cli/serve.py`):

- mp executor, one model replica spanning nodes (TP/PP): every node runs `vllm serve` with
  `--nnodes N --node-rank R --master-addr LEADER`; nodes other than the leader add
  `--headless` (they run engine workers and no API server).
- mp, data parallel across nodes (DP, usually with expert parallel): every node runs
  `--data-parallel-size D --data-parallel-size-local L --data-parallel-address LEADER
  --data-parallel-rpc-port P`; the others add `--data-parallel-start-rank S --headless`.
- Ray executor: the leader starts a Ray head and vLLM with `--distributed-executor-backend
  ray`; the others only join the Ray cluster (`ray start --address=LEADER:6379 --block`).
  vLLM itself waits for the workers' GPUs to join its placement group.

Nothing here starts a process: the caller (`vlaunch exec`) runs `pre_commands` in order,
then replaces itself with `argv`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..deployment.argv import pool_argv
from ..deployment.plan import Deployment, Parallel, Pool
from ..errors import InputError
from ..inputs import vllm_flags as F
from .exec_check import plan_context
from .vllmargs import in_serve_form

LEADER, WORKER = "leader", "worker"
BACKENDS = ("mp", "ray")
VLLM_PROGRAM = ("vllm", "serve")
# vLLM's own default (ParallelConfig.data_parallel_rpc_port), passed explicitly because
# "all nodes must use the same port" and an explicit value survives a changed default.
DP_RPC_PORT = 29550
RAY_PORT = 6379

# Flags this module sets per node; a plan that already carries them would be ambiguous.
_NODE_DESTS = ("nnodes", "node_rank", "master_addr", "master_port", "headless",
               "data_parallel_size_local", "data_parallel_address", "data_parallel_rpc_port",
               "data_parallel_start_rank", "distributed_executor_backend")


def check_plan_env(env: Mapping[str, object],
                   environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The plan's environment, through the flag table's allow-list (vllm_flags.PLAN_ENV): a
    plan.json on a shared volume must not choose what vLLM loads (VLLM_NCCL_SO_PATH ...)."""
    return F.check_plan_env(env, environ)


def check_plan_flags(args: Sequence[str], ctx: F.PlanContext | None = None) -> None:
    """Every argument is a flag the table lets a plan carry, its value checked (no positionals,
    no other model, paths only inside the model's or the plan's folder)."""
    F.check_plan_args(args, ctx)


@dataclass(frozen=True)
class LwsEnv:
    """What the LeaderWorkerSet controller tells each pod about its group."""

    leader_address: str | None = None
    group_size: int | None = None
    worker_index: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> LwsEnv:
        return cls(
            leader_address=environ.get("LWS_LEADER_ADDRESS") or None,
            group_size=_env_int(environ, "LWS_GROUP_SIZE"),
            worker_index=_env_int(environ, "LWS_WORKER_INDEX"),
        )


@dataclass
class NodeLaunch:
    """What one node runs: `pre_commands` to completion, then `argv` in the foreground."""

    role: str  # leader | worker
    node_rank: int
    nnodes: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    pre_commands: list[list[str]] = field(default_factory=list)
    serves_api: bool = True  # False on headless/Ray workers: no /health to probe


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"{name}={raw!r} is not a whole number") from None


def _check_layout(p: Parallel, nodes: int) -> None:
    """The engine's layout in whole numbers of at least one (the codec checks a loaded plan;
    a Deployment made in code passes here too)."""
    for key, value in (("tp", p.tp), ("pp", p.pp), ("dp", p.dp), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"plan parallel.{key}={value!r}; expected a whole number >= 1")


def _check_plan_args(args: list[str]) -> None:
    """The per-node flags are added here at launch, never planned: an engine whose argv already
    held one would be ambiguous on every node."""
    parsed = F.parse(args)
    for dest in _NODE_DESTS:
        if dest in parsed.values:
            raise InputError(
                f"plan vllm_args already hold {parsed.given[dest]}; per-node flags are added at "
                "launch, not planned"
            )


def _resolve_node(
    nnodes: int, role: str | None, lws: LwsEnv, leader_address: str | None
) -> tuple[str, int, str]:
    """Role, node rank and leader address from --role and the LeaderWorkerSet environment."""
    if role not in (None, LEADER, WORKER):
        raise InputError(f"--role {role!r}; expected leader or worker")
    if lws.group_size is not None and lws.group_size != nnodes:
        raise InputError(
            f"LWS_GROUP_SIZE={lws.group_size} but the plan is for {nnodes} nodes; "
            f"set the LeaderWorkerSet size to {nnodes}"
        )
    rank = lws.worker_index
    if rank is None:
        if role == LEADER:
            rank = 0
        elif role == WORKER and nnodes == 2:
            rank = 1  # the only worker there is
        else:
            raise InputError(
                f"a {nnodes}-node plan needs this node's rank: set LWS_WORKER_INDEX "
                "(a LeaderWorkerSet does) or give --role leader|worker on 2 nodes"
            )
    if not 0 <= rank < nnodes:
        raise InputError(f"LWS_WORKER_INDEX={rank}; expected 0..{nnodes - 1} for {nnodes} nodes")
    actual = LEADER if rank == 0 else WORKER
    if role is not None and role != actual:
        raise InputError(f"--role {role} but LWS_WORKER_INDEX={rank} makes this node the {actual}")
    address = leader_address or lws.leader_address
    if not address:
        raise InputError(
            "a multi-node plan needs the leader's address: set LWS_LEADER_ADDRESS "
            "(a LeaderWorkerSet does)"
        )
    return actual, rank, address


def build_launch(
    dep: Deployment,
    environ: Mapping[str, str] | None = None,
    role: str | None = None,
    *,
    pool: Pool | None = None,
    program: Sequence[str] = VLLM_PROGRAM,
    leader_address: str | None = None,
    master_port: int | None = None,
    dp_rpc_port: int = DP_RPC_PORT,
    ray_port: int = RAY_PORT,
    plan_dir: str | None = None,
) -> NodeLaunch:
    """The command, environment and pre-commands for this node of one replica of `pool` (the
    deployment's first pool unless given: the aggregated one, or the decode pool of a
    disaggregated plan when the caller runs that one).

    The typed plan is the input (launcher/deployment/plan.py): the argv is the pool's own
    (`deployment.argv.pool_argv`), the layout its engine's, the node count its replica's, the
    GPUs per node and the vLLM release the deployment's. `environ` defaults to the process
    environment; `program` is how vLLM's `serve` is invoked in the image (`vllm serve` in the
    official one). `leader_address` overrides LWS_LEADER_ADDRESS (tests on loopback).
    `plan_dir`: the plan's folder, where a file the plan names (a chat template) may live,
    beside the model's own folder.
    """
    environ = os.environ if environ is None else environ
    pool = dep.pool if pool is None else pool
    if not dep.fits:
        raise InputError("the plan does not fit its GPUs, so it has no command to run; "
                         "re-run `vlaunch plan` for more or larger GPUs")
    e = pool.engine
    p = e.parallel
    nnodes = p.nodes  # the nodes one replica spans
    _check_layout(p, nnodes)
    tp, pp, dp = p.tp, p.pp, p.dp
    backend = e.distributed_executor_backend or "mp"
    if backend not in BACKENDS:
        raise InputError(f"distributed_executor_backend={backend!r}; expected mp or ray")
    args = pool_argv(pool)
    _check_plan_args(args)
    check_plan_flags(args, plan_context(dep, plan_dir))
    env = check_plan_env(pool.env, environ)
    serve = in_serve_form(program, args)  # `vllm serve MODEL`: the model positional
    backend_flag = F.argv({"distributed_executor_backend": "ray" if backend == "ray" else None})

    if nnodes == 1:
        if role == WORKER or (_env_int(environ, "LWS_WORKER_INDEX") or 0) != 0:
            raise InputError("the plan is for one node; there is no worker to run")
        return NodeLaunch(LEADER, 0, 1, serve + backend_flag, env)

    node_role, rank, leader = _resolve_node(
        nnodes, role, LwsEnv.from_environ(environ), leader_address
    )
    if environ.get("POD_IP"):
        # vLLM advertises get_ip() to its peers; in a pod that must be the pod IP.
        env.setdefault("VLLM_HOST_IP", environ["POD_IP"])
    gpus_per_node = dep.hardware.gpus_per_node

    if backend == "ray":
        if dp > 1:
            raise InputError(
                "data parallel across nodes is planned for the mp backend; "
                "set distributed_executor_backend to mp"
            )
        if node_role == WORKER:
            join = ["ray", "start", f"--address={leader}:{ray_port}", "--block"]
            return NodeLaunch(WORKER, rank, nnodes, join, env, serves_api=False)
        head = ["ray", "start", "--head", f"--port={ray_port}"]
        return NodeLaunch(LEADER, 0, nnodes, serve + backend_flag, env, [head])

    if dp == 1:
        world = tp * pp
        if world % nnodes:
            raise InputError(
                f"tp*pp={world} does not split evenly over {nnodes} nodes; "
                "plan a layout whose world size is a multiple of the node count"
            )
        _check_per_node(world // nnodes, gpus_per_node)
        flags = F.argv({"nnodes": nnodes, "node_rank": rank, "master_addr": leader,
                        "master_port": master_port})
    else:
        if dp % nnodes:
            raise InputError(
                f"data parallel size {dp} does not split evenly over {nnodes} nodes; "
                "plan a DP size that is a multiple of the node count"
            )
        local = dp // nnodes
        _check_per_node(local * tp * pp, gpus_per_node)
        flags = F.argv({"data_parallel_size_local": local, "data_parallel_address": leader,
                        "data_parallel_rpc_port": dp_rpc_port,
                        "data_parallel_start_rank": rank * local if node_role == WORKER
                        else None})
    flags += F.argv({"headless": node_role == WORKER})
    _check_release(flags, dep.vllm_version)
    return NodeLaunch(node_role, rank, nnodes, serve + flags, env, serves_api=node_role == LEADER)


def _check_release(flags: Sequence[str], version: object) -> None:
    """The per-node flags must exist in the plan's vLLM (--nnodes and --master-addr since 0.11.1,
    --headless and the --data-parallel-* address flags since 0.9.0: the flag table's releases);
    an older vLLM refuses them at start-up on every node."""
    if not isinstance(version, str) or not version:
        return
    for dest in F.parse(flags).values:
        if not F.available(dest, version):
            since, _ = F.releases(dest)
            raise InputError(f"vLLM {version} has no {F.flag(dest)} (first in {since}), which "
                             f"this multi-node layout needs; plan for vLLM {since} or newer "
                             "(--vllm-version)")


def _check_per_node(ranks: int, gpus_per_node: object) -> None:
    """vLLM puts world/nnodes ranks on each node; they must match the GPUs there."""
    if isinstance(gpus_per_node, int) and gpus_per_node > 0 and ranks != gpus_per_node:
        raise InputError(
            f"the layout puts {ranks} GPU ranks on each node but the plan's nodes have "
            f"{gpus_per_node} GPUs; re-run `vlaunch plan` for this hardware"
        )
