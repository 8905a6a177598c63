"""deploy/kubernetes/overlays/deepseek-r1-pd-2x8xh200: a prefill and a decode Deployment planned by
their init containers (`vlaunch plan ... --role prefill|decode --emit /plan`), llm-d's routing
sidecar in the decode pods, an InferencePool with its endpoint picker, and NetworkPolicies that
open only the NIXL side channels (and the sidecars' prefill requests) between the pools.

Checked offline: kustomize builds it, the core kinds pass kubernetes-validate, the CRD-backed kinds
pass the published CRDs' schemas, every vlaunch container's args run through the real CLI, and the
generated parts are the plan's (deploy/kubernetes/generate.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_kubernetes import (
    CRD_FILES,
    K8S,
    K8S_VERSION,
    TINI,
    _crd_validator,
    _generator,
    _kustomize,
    _of_kind,
    _peer_matches,
    _selects,
    validate_custom_resources,
)

from launcher.cli import cli

NAME = "deepseek-r1-pd-2x8xh200"
FOLDER = K8S / "overlays" / NAME
POOLS = ("prefill", "decode")
SIDECAR = "ghcr.io/llm-d/llm-d-routing-sidecar"


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return _kustomize(FOLDER)


def _pool(objs: list[dict], role: str) -> dict:
    (d,) = [o for o in _of_kind(objs, "Deployment") if o["metadata"]["name"] == f"vlaunch-{role}"]
    return d


def _named(spec: dict, name: str, init: bool = False) -> dict:
    (c,) = [c for c in spec["initContainers" if init else "containers"] if c["name"] == name]
    return c


def _vlaunch_args(c: dict) -> list[str]:
    argv = c["command"] + c.get("args", [])
    assert argv[:3] == [*TINI, "vlaunch"], argv[:3]
    return argv[3:]


def _model(objs: list[dict]) -> str:
    (m,) = [cm["data"]["MODEL"] for cm in _of_kind(objs, "ConfigMap") if "MODEL" in cm["data"]]
    return m


def _generated_plan():
    gen = _generator()
    gpus, most = gen.PD_TARGETS[f"overlays/{NAME}"]
    return gen, gen.pd_plan_for(gen.kustomization_model(FOLDER), gpus, most)


def test_the_overlay_holds_both_pools_the_picker_and_no_single_engine(objs):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for role in POOLS:
        assert ("Deployment", f"vlaunch-{role}") in kinds
        assert ("ScaledObject", f"vlaunch-{role}") in kinds
        assert ("PodMonitor", f"vlaunch-{role}") in kinds
    assert {("InferencePool", "vlaunch-pd"), ("Deployment", "vlaunch-pd-epp"),
            ("Service", "vlaunch-pd-epp"), ("NetworkPolicy", "vlaunch-pd-kv")} <= kinds
    # base's single engine and what served it are gone
    for kind in ("Deployment", "ScaledObject", "PodMonitor", "Service"):
        assert (kind, "vlaunch") not in kinds, kind
    assert ("NetworkPolicy", "vlaunch-api") not in kinds
    assert _model(objs) == "deepseek-ai/DeepSeek-R1"


def test_core_objects_validate_against_kubernetes_schemas(objs):
    kv = pytest.importorskip("kubernetes_validate")
    checked = set()
    for obj in objs:
        if (obj["apiVersion"].split("/")[0], obj["kind"]) in CRD_FILES:
            continue
        kv.validate(obj, K8S_VERSION, strict=True)
        checked.add(obj["kind"])
    assert {"Deployment", "Service", "NetworkPolicy", "ConfigMap", "ServiceAccount", "Role",
            "RoleBinding", "PersistentVolumeClaim"} <= checked


def test_custom_resources_validate_against_published_crds(objs):
    kinds = validate_custom_resources(objs)
    assert kinds == {"InferencePool", "ScaledObject", "PodMonitor", "PrometheusRule"}
    (pool,) = _of_kind(objs, "InferencePool")
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPorts"] = [{"number": 70000}]
    assert list(_crd_validator("inference.networking.k8s.io", "InferencePool", "v1")
                .iter_errors(bad))
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failMode"] = "FailOpen"
    assert list(_crd_validator("inference.networking.k8s.io", "InferencePool", "v1")
                .iter_errors(bad))


def test_the_pool_routes_to_the_sidecars_and_its_picker_is_served(objs):
    (pool,) = _of_kind(objs, "InferencePool")
    (svc,) = [s for s in _of_kind(objs, "Service") if s["metadata"]["name"] == "vlaunch-pd-epp"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == svc["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"]}
    epp = _pool_by_name(objs, "vlaunch-pd-epp")
    assert _selects({"matchLabels": svc["spec"]["selector"]},
                    epp["spec"]["template"]["metadata"]["labels"])
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--pool-name") + 1] == pool["metadata"]["name"]
    assert epp["spec"]["replicas"] == 1  # the picker's load view is per process
    # its config carries the P/D plugins, mounted where --config-file reads it
    (cm,) = [m for m in _of_kind(objs, "ConfigMap")
             if m["metadata"]["name"].startswith("vlaunch-pd-epp-config")]
    (text,) = cm["data"].values()
    cfg = yaml.safe_load(text)
    types = {p["type"] for p in cfg["plugins"]}
    assert {"prefill-filter", "decode-filter", "pd-profile-handler",
            "prefill-header-handler"} <= types
    assert {p["name"] for p in cfg["schedulingProfiles"]} == set(POOLS)
    (vol,) = epp["spec"]["template"]["spec"]["volumes"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    # both pools are members (the picker names prefill pods in x-prefiller-host-port); every
    # member listens on the pool's target port: vLLM on prefill pods, the sidecar on decode pods
    for role in POOLS:
        tpl = _pool(objs, role)["spec"]["template"]
        assert _selects(pool["spec"]["selector"], tpl["metadata"]["labels"]), role
        assert tpl["metadata"]["labels"]["llm-d.ai/role"] == role
        ports = {p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
        assert {t["number"] for t in pool["spec"]["targetPorts"]} <= ports, role
    assert not _selects(pool["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])


def _pool_by_name(objs: list[dict], name: str) -> dict:
    (d,) = [o for o in _of_kind(objs, "Deployment") if o["metadata"]["name"] == name]
    return d


def test_decode_pods_run_the_routing_sidecar_in_front_of_vllm(objs):
    spec = _pool(objs, "decode")["spec"]["template"]["spec"]
    side = _named(spec, "routing-sidecar")
    assert side["image"].startswith(SIDECAR + ":")
    flags = dict(a.removeprefix("--").split("=", 1) for a in side["args"])
    exec_args = _vlaunch_args(_named(spec, "vllm"))
    vllm_port = int(exec_args[exec_args.index("--port") + 1])
    assert flags == {"port": "8000", "vllm-port": str(vllm_port), "connector": "nixlv2"}
    assert vllm_port != 8000
    assert {p["containerPort"] for p in side["ports"]} == {8000}
    assert not any(c["image"].startswith(SIDECAR)
                   for c in _pool(objs, "prefill")["spec"]["template"]["spec"]["containers"])


def _emit(objs: list[dict], role: str, out: Path, cache: Path):
    init = _named(_pool(objs, role)["spec"]["template"]["spec"], "plan", init=True)
    args = [_model(objs) if a == "$(MODEL)" else a for a in _vlaunch_args(init)]
    assert args[args.index("--role") + 1] == role and args[args.index("--emit") + 1] == "/plan"
    args[args.index("--emit") + 1] = str(out)
    r = CliRunner().invoke(cli, args, env={"VLAUNCH_CACHE_DIR": str(cache)})
    assert r.exit_code == 0, r.output
    return args


@pytest.mark.parametrize("role", POOLS)
def test_each_init_container_emits_its_pool_and_exec_runs_it(objs, role, tmp_path):
    """The init container's command, run offline into a folder, writes that pool's plan; the
    main container's command, run dry on it, starts that pool's engine."""
    args = _emit(objs, role, tmp_path / "plan", tmp_path / "cache")
    j = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert j["role"] == role and j["deployment"] == "disaggregated"
    gen, plan = _generated_plan()
    assert args[args.index("--gpus") + 1] == gen.PD_TARGETS[f"overlays/{NAME}"][0]
    # the ScaledObject the pod emits is the one committed under generated/ for its pool
    (emitted,) = yaml.safe_load_all((tmp_path / "plan" / "scaledobject.yaml").read_text())
    committed = {o["metadata"]["name"]: o for o in _of_kind(objs, "ScaledObject")}
    assert emitted == committed[f"vlaunch-{role}"]
    assert [p["autoscaling"] for p in j["pools"]] == [
        json.loads(json.dumps(p["autoscaling"])) for p in gen_dump(plan)["pools"]]
    server = _named(_pool(objs, role)["spec"]["template"]["spec"], "vllm")
    argv = _vlaunch_args(server)
    assert argv[:3] == ["exec", "--plan", "/plan/plan.json"]
    argv[2] = str(tmp_path / "plan" / "plan.json")
    argv[argv.index("--log-dir") + 1] = str(tmp_path / "logs")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in server["env"]
           if "fieldRef" in e.get("valueFrom", {})}
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "status.podIP"}
    r = CliRunner().invoke(cli, [*argv, "--dry-run"],
                           env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7"})
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split()).replace(" \\ ", " ")
    pool = j["pools"][[p["role"] for p in j["pools"]].index(role)]
    assert f"--max-num-seqs {pool['engine']['max_num_seqs']}" in flat
    assert "--kv-transfer-config" in flat and "NixlConnector" in flat
    assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={pool['env']['VLLM_NIXL_SIDE_CHANNEL_PORT']}" in flat


def gen_dump(plan):
    from launcher.deployment.codec import dump

    return dump(plan)


def test_generated_parts_are_the_plans(objs):
    gen, plan = _generated_plan()
    files = gen.pd_files()
    for path, text in files.items():
        assert path.read_text() == text, f"{path} is stale: run deploy/kubernetes/generate.py"
    t = gen.timing(_model(objs), gen.PD_TARGETS[f"overlays/{NAME}"][0])
    for role in POOLS:
        spec = _pool(objs, role)["spec"]["template"]["spec"]
        probe = _named(spec, "vllm")["startupProbe"]
        assert probe["failureThreshold"] * probe["periodSeconds"] >= t["budget_s"]
        assert spec["terminationGracePeriodSeconds"] == t["grace_s"]
        pool = next(p for p in plan.pools if p.role == role)
        so = next(o for o in _of_kind(objs, "ScaledObject")
                  if o["metadata"]["name"] == f"vlaunch-{role}")
        a = pool.autoscaling
        assert so["spec"]["maxReplicaCount"] == a.max_replicas == 2
        behaviour = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behaviour["scaleUp"]["stabilizationWindowSeconds"] == a.scale_up_stabilization_s
        names = {x["name"] for x in so["spec"]["triggers"]}
        assert names == ({"vllm-waiting", "vllm-running"} if role == "prefill"
                         else {"vllm-running", "vllm-kv-usage"})


# ---- NetworkPolicies between the pools ----------------------------------------------------------

GATEWAY = ("vlaunch-gateway", {"vlaunch-api-client": "true"})
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})


def _ports_match(rule_ports: list[dict] | None, port: int) -> bool:
    if not rule_ports:
        return True
    for rp in rule_ports:
        lo = rp.get("port")
        assert not isinstance(lo, str), "named ports: resolve them here first"
        hi = rp.get("endPort", lo)
        if rp.get("protocol", "TCP") == "TCP" and (lo is None or lo <= port <= hi):
            return True
    return False


def _allowed(policies: list[dict], dst: dict, src_ns: str, src: dict, port: int) -> bool:
    """NetworkPolicy ingress semantics for one TCP connection (endPort ranges included)."""
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    return any((not rule.get("from") or any(_peer_matches(q, src_ns, src, "vlaunch")
                                            for q in rule["from"]))
               and _ports_match(rule.get("ports"), port)
               for pol in selecting for rule in pol["spec"].get("ingress", []))


def _labels(objs: list[dict], name: str) -> dict:
    return _pool_by_name(objs, name)["spec"]["template"]["metadata"]["labels"]


def test_between_the_pools_only_the_side_channels_and_the_prefill_request_are_open(objs):
    policies = _of_kind(objs, "NetworkPolicy")
    _, plan = _generated_plan()
    pre = next(p for p in plan.pools if p.role == "prefill")
    base = int(pre.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    side = set(range(base, base + pre.engine.parallel.dp))  # one per local DP rank
    prefill, decode = _labels(objs, "vlaunch-prefill"), _labels(objs, "vlaunch-decode")
    epp = _labels(objs, "vlaunch-pd-epp")
    every = set(range(1, 65536))
    # decode -> prefill: the prefill engines' side channels and vLLM's port (the sidecar's
    # prefill request); no other port of 65,535
    opened = {p for p in every if _allowed(policies, prefill, "vlaunch", decode, p)}
    assert opened == side | {8000}, sorted(opened)[:20]
    # prefill -> decode: nothing (decode pulls the KV; its bytes ride RDMA, not the pod network)
    assert not any(_allowed(policies, decode, "vlaunch", prefill, p) for p in every)
    # a pod of neither pool gets none of it, and the labels do not work from elsewhere
    for port in side | {8000, 8200, 9400}:
        assert not _allowed(policies, prefill, "vlaunch", {"app": "other"}, port), port
        assert not _allowed(policies, prefill, "default", decode, port), port
    # the gateway reaches the decode sidecars and the picker, nothing else
    gw_ns, gw = GATEWAY
    assert _allowed(policies, decode, gw_ns, gw, 8000)
    assert _allowed(policies, epp, gw_ns, gw, 9002)
    for port in (8200, 9400, *side):
        assert not _allowed(policies, decode, gw_ns, gw, port), port
    for port in (8000, 9400, *side):
        assert not _allowed(policies, prefill, gw_ns, gw, port), port
    # the picker reads both pools' load on the pool's target port only
    for dst in (prefill, decode):
        assert _allowed(policies, dst, "vlaunch", epp, 8000)
        assert not any(_allowed(policies, dst, "vlaunch", epp, p) for p in (8200, *side))
    # Prometheus: each pool's exporter
    ns, prom = PROMETHEUS
    for dst in (prefill, decode):
        assert _allowed(policies, dst, ns, prom, 9400)
        assert not _allowed(policies, dst, ns, prom, 8000)


def test_the_policy_check_is_not_vacuous(objs):
    policies = _of_kind(objs, "NetworkPolicy")
    prefill, decode = _labels(objs, "vlaunch-prefill"), _labels(objs, "vlaunch-decode")
    kv = next(p for p in policies if p["metadata"]["name"] == "vlaunch-pd-kv")
    wide = copy.deepcopy(kv)
    wide["spec"]["ingress"][0]["ports"][0]["endPort"] = 6000
    assert _allowed([wide], prefill, "vlaunch", decode, 5999)
    assert not _allowed(policies, prefill, "vlaunch", decode, 5999)
    assert _allowed([], prefill, "vlaunch", decode, 5999)  # no policy: all open


def test_every_pod_is_hardened_and_only_the_engines_pin_memory(objs):
    """As base's pods: non-root, no privilege escalation, a read-only root, every capability
    dropped; the engines add back IPC_LOCK alone (UCX pins the memory it registers for RDMA).
    Each pool's pod asks for the GPUs one replica of its plan runs on."""
    _, plan = _generated_plan()
    gpus = {f"vlaunch-{p.role}": str(p.gpus_per_replica) for p in plan.pools}
    for d in _of_kind(objs, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, d["metadata"]["name"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            want = ["IPC_LOCK"] if c["name"] == "vllm" else None
            assert sc["capabilities"].get("add") == want, (d["metadata"]["name"], c["name"])
            assert c["resources"]["requests"]["memory"]
        if d["metadata"]["name"] != "vlaunch-pd-epp":
            assert spec["automountServiceAccountToken"] is False
            server = _named(spec, "vllm")
            assert server["resources"]["limits"]["rdma/ib"] == "1"
            assert server["resources"]["limits"]["nvidia.com/gpu"] == gpus[d["metadata"]["name"]]
