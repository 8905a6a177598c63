"""The wide-EP decode overlay: one LeaderWorkerSet group is one replica of the plan's decode pool,
DP ranks over its nodes, and each pod's vLLM command has its ranks from the LWS environment.

tests/test_kubernetes.py runs every overlay check on it too (kustomize builds it;
kubernetes-validate passes the core kinds and the pod templates; the LeaderWorkerSet,
ScaledObject, PodMonitor and PrometheusRule validate against the CRDs in
../shared/reference/crds; hardening, probes, network policies). Here: what is particular to
wide EP - the group's shape against the plan, RDMA, IPC_LOCK, /dev/shm and the fabric's
environment, the decode pool's ScaledObject, and the ranks `build_launch` gives each pod of the
emitted plan, swept over shapes.
"""

from __future__ import annotations

import random

import pytest
import test_kubernetes as K
from click.testing import CliRunner
from plan_factory import deployment

from launcher.cli import cli
from launcher.deployment.argv import pool_argv
from launcher.errors import InputError
from launcher.paths import profiles_dir, read_yaml
from launcher.predict.capacity.autoscaling import trigger_thresholds
from launcher.run.emit import load_plan
from launcher.run.exec_plan import check_pool_plan
from launcher.run.multinode import build_launch

NAME = K.WIDE_EP
FOLDER = f"overlays/{NAME}"
LEADER = "vlaunch-decode-0.vlaunch-decode.default"


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return K._kustomize(K.K8S / FOLDER)


@pytest.fixture(scope="module")
def lws(objs) -> dict:
    (lws,) = K._of_kind(objs, "LeaderWorkerSet")
    return lws


def _templates(lws: dict) -> list[tuple[str, dict]]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return [("leader", t["leaderTemplate"]), ("worker", t["workerTemplate"])]


@pytest.fixture(scope="module")
def emitted(objs, lws, tmp_path_factory):
    """The plan folder the init container writes: its own argv, run here (the ConfigMap's
    model for $(MODEL), a fresh capability cache), then read back as `exec` reads it."""
    out = tmp_path_factory.mktemp("plan")
    args = K._argv(K._container(_templates(lws)[0][1]["spec"], "plan", init=True))[1:]
    args = [K._model(objs) if a == "$(MODEL)" else a for a in args]
    args[args.index("--emit") + 1] = str(out)
    env = {"VLAUNCH_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
    r = CliRunner().invoke(cli, args, env=env)
    assert r.exit_code == 0, r.output
    return args, load_plan(out)


def test_the_pods_plan_the_decode_pool_of_a_disaggregated_deployment(emitted):
    args, dep = emitted
    gpus, _ = K._generator().WIDE_EP_TARGETS[FOLDER]
    assert args[args.index("--gpus") + 1] == gpus
    assert args[args.index("--disaggregate") + 1] == "on"
    assert args[args.index("--role") + 1] == "decode" and "--eplb" not in args
    assert dep.kind == "disaggregated" and dep.role == "decode" and dep.pool.role == "decode"
    p = dep.engine.parallel
    assert p.expert_parallel and p.dp > 1 and p.nodes > 1  # DP ranks over nodes: wide EP
    assert p.tp * p.dp > 8 and dep.engine.enable_eplb  # EP16, EPLB with its redundant experts
    r = next(r for r in dep.reasons if r.code.startswith("eplb."))  # the planner's own choice
    assert r.code == "eplb.on" and r.data["pinned"] is False, r.text
    argv = pool_argv(dep.pool)
    assert "--enable-eplb" in argv and "--kv-transfer-config" in argv


def test_one_group_is_one_replica_of_the_decode_pool(lws, emitted):
    _, dep = emitted
    pool = dep.pool
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["size"] == pool.nodes_per_replica \
        == pool.engine.parallel.nodes
    assert "replicas" not in spec  # the ScaledObject owns the number of groups
    for role, t in _templates(lws):
        gpus = int(K._gpus(K._container(t["spec"], "vllm")))
        assert gpus == dep.hardware.gpus_per_node, role
        assert gpus * pool.nodes_per_replica == pool.gpus_per_replica, role
        run = K._argv(K._container(t["spec"], "vllm"))
        assert run[:4] == ["vlaunch", "exec", "--plan", "/plan/plan.json"]
        assert run[run.index("--role") + 1] == role
    assert spec["startupPolicy"] == "LeaderCreated"  # LWS_LEADER_ADDRESS resolves for workers
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_wide_ep_pods_get_rdma_ipc_lock_shm_and_the_fabric_env(lws):
    rdma = read_yaml(profiles_dir() / "serving.yaml")["ep_backends"]["kubernetes"]["rdma_resource"]
    for role, t in _templates(lws):
        spec = t["spec"]
        c = K._container(spec, "vllm")
        assert c["resources"]["limits"][rdma] == "1", role
        caps = c["securityContext"]["capabilities"]
        assert caps["add"] == ["IPC_LOCK"] and caps["drop"] == ["ALL"], role
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        vols = {v["name"]: v for v in spec["volumes"]}
        (shm,) = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert vols[shm]["emptyDir"]["medium"] == "Memory", role
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] \
            == "status.podIP", role
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA",
                     "NVSHMEM_REMOTE_TRANSPORT"):
            assert env[name]["value"], (role, name)
        # the init container plans on the same GPUs and needs no RDMA or capability
        init = K._container(spec, "plan", init=True)
        assert rdma not in init["resources"]["limits"]
        assert "add" not in init["securityContext"]["capabilities"]


def test_the_scaled_object_scales_the_groups_at_the_decode_pools_targets(objs, lws, emitted):
    _, dep = emitted
    (so,) = K._of_kind(objs, "ScaledObject")
    ref = so["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("LeaderWorkerSet", lws["metadata"]["name"])
    assert ref["apiVersion"] == lws["apiVersion"]
    a = dep.pool.autoscaling
    assert a is not None and a.role == "decode"
    got = {t["name"]: float(t["metadata"]["threshold"]) for t in so["spec"]["triggers"]}
    assert got == {f"vllm-{k.replace('_', '-')}": v for k, v in trigger_thresholds(a).items()}
    _, most = K._generator().WIDE_EP_TARGETS[FOLDER]
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == \
        (a.min_replicas, a.max_replicas) and a.max_replicas == most
    for _, t in _templates(lws):  # every pod plans with the ScaledObject's bound
        args = K._argv(K._container(t["spec"], "plan", init=True))
        assert int(args[args.index("--max-replicas") + 1]) == most
        assert args[args.index("--weights-from") + 1] == "volume"
    for q in (t["metadata"]["query"] for t in so["spec"]["triggers"]):
        assert 'pod=~"vlaunch-decode-[0-9]+"' in q  # the group's pods, LWS-named


def _env(index: int, size: int) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": LEADER, "LWS_GROUP_SIZE": str(size),
            "LWS_WORKER_INDEX": str(index), "POD_IP": f"10.0.0.{index + 1}",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": f"10.0.0.{index + 1}"}


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _check_ranks(dep, index: int) -> None:
    """What pod `index` of the group runs: the layout's DP ranks over its nodes."""
    p = dep.pool.engine.parallel
    local = p.dp // p.nodes
    launch = build_launch(dep, environ=_env(index, p.nodes))
    argv = launch.argv
    assert launch.node_rank == index and launch.nnodes == p.nodes
    assert _after(argv, "--data-parallel-size") == str(p.dp)
    assert _after(argv, "--data-parallel-size-local") == str(local)
    assert local * p.tp == dep.hardware.gpus_per_node  # the node's GPUs, no more, no fewer
    assert _after(argv, "--data-parallel-address") == LEADER
    assert "--enable-expert-parallel" in argv
    if index == 0:  # the leader: DP rank 0, the API server and the coordinator
        assert launch.role == "leader" and launch.serves_api
        assert "--headless" not in argv and "--data-parallel-start-rank" not in argv
    else:
        assert launch.role == "worker" and not launch.serves_api and "--headless" in argv
        assert _after(argv, "--data-parallel-start-rank") == str(index * local)
    assert "--nnodes" not in argv and "--node-rank" not in argv  # DP over nodes, not TP/PP
    assert launch.env["VLLM_HOST_IP"] == f"10.0.0.{index + 1}"


def test_each_pod_of_the_emitted_plan_gets_its_ranks(emitted):
    _, dep = emitted
    check_pool_plan(dep, environ=_env(0, dep.engine.parallel.nodes))  # exec takes this plan
    for index in range(dep.engine.parallel.nodes):
        _check_ranks(dep, index)
    with pytest.raises(InputError, match="LWS_GROUP_SIZE"):
        build_launch(dep, environ=_env(0, dep.engine.parallel.nodes + 1))
    with pytest.raises(InputError, match="expected 0"):
        build_launch(dep, environ=_env(dep.engine.parallel.nodes, dep.engine.parallel.nodes))


def test_ranks_over_hundreds_of_wide_ep_shapes():
    """start rank = index x size-local, the leader's address, headless on workers: for every
    LWS_WORKER_INDEX of every group shape (nodes x GPUs per node, TP inside a node)."""
    rng = random.Random(26)
    cases = 0
    for nodes in (2, 3, 4, 6, 8, 12, 16, 18):
        for gpn in (2, 4, 8):
            for tp in (t for t in (1, 2, 4, 8) if gpn % t == 0):
                dp = nodes * gpn // tp
                if dp < 2:
                    continue
                dep = deployment(tp=tp, dp=dp, ep=True, nodes=nodes, gpus_per_node=gpn,
                                 gpu="H200")
                for index in sorted({0, nodes - 1, rng.randrange(nodes)}):
                    _check_ranks(dep, index)
                    cases += 1
    assert cases > 150
