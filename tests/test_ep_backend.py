"""The DP+EP all-to-all backend: choice per layout / objective / nodes, flags and env by
version, packages the image lacks, memory, and what the multi-node manifests carry."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_kubernetes import _kustomize

from launcher.deployment.codec import load
from launcher.errors import InputError
from launcher.inputs.hardware import GiB, MiB, parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import resolve_workload
from launcher.predict.features import ep_backend as EP
from launcher.predict.memory import budget as B
from launcher.predict.search.plan_inputs import inputs_from_plan
from launcher.predict.search.planner import Pins, make_plan

REPO = Path(__file__).resolve().parents[1]
R1 = load_model("deepseek-r1")
CHAT, RAG = resolve_workload(), resolve_workload(8192, 256)


@pytest.fixture
def with_deepep(monkeypatch):
    monkeypatch.setenv(EP.IMAGE_PACKAGES_ENV, "deep_ep")


@pytest.fixture
def without_deepep(monkeypatch):
    monkeypatch.setenv(EP.IMAGE_PACKAGES_ENV, "")


def _choose(gpus, layout, objective="balanced", workload=CHAT, version="0.32.0", pinned=None):
    return EP.choose(R1, parse_gpus(gpus), layout, objective, workload, version, pinned)


def test_no_all_to_all_without_data_parallel():
    c = _choose("8xH200", B.Layout(tp=8, expert_parallel=True))
    assert not c.applies and EP.vllm_args(c) == [] and "data parallel" in c.reason.text
    assert c.reason.code == "all2all.inside_tp"


def test_inside_one_node_the_default_collectives(with_deepep):
    c = _choose("8xH200", B.Layout(dp=8, expert_parallel=True))
    assert c.backend == "allgather_reducescatter" == c.vllm_default
    assert EP.vllm_args(c) == [] and EP.env(c) == {} and c.buffer_bytes_per_gpu == 0


def test_across_nodes_deepep_by_objective(with_deepep):
    L = B.Layout(dp=16, expert_parallel=True, nodes=2)
    ll = _choose("2x8xH200", L, "latency")
    assert ll.backend == "deepep_low_latency" and ll.cross_node and ll.cuda_graphs
    assert EP.vllm_args(ll) == ["--all2all-backend", "deepep_low_latency"]
    ht = _choose("2x8xH200", L, "throughput", RAG)
    assert ht.backend == "deepep_high_throughput" and not ht.cuda_graphs
    # decode-heavy throughput work still gets the low-latency kernels
    assert _choose("2x8xH200", L, "throughput", CHAT).backend == "deepep_low_latency"
    assert ll.kubernetes == {"rdma_resource": "rdma/ib", "ipc_lock": True, "shm_gib": 64}


def test_deepep_buffers():
    # high-throughput: NVLink buffer (VLLM_DEEPEP_BUFFER_SIZE_MB = 1024) + the same for RDMA
    assert EP.buffer_bytes("deepep_high_throughput", True, 7168, 256) == 2 * 1024 * MiB
    assert EP.buffer_bytes("deepep_high_throughput", False, 7168, 256) == 1024 * MiB
    # low-latency: 1 GiB + 2 x 256 experts x 256 tokens x max(7168 + 56 x 4 + 16,
    # 2 x 7168 + 16 = 14,352 B)
    assert EP.buffer_bytes("deepep_low_latency", True, 7168, 256) == (
        1024 * MiB + 2 * 256 * 256 * 14352)
    assert EP.buffer_bytes("allgather_reducescatter", True, 7168, 256) == 0


def test_missing_package_keeps_the_default_and_says_so(without_deepep):
    c = _choose("2x8xH200", B.Layout(dp=16, expert_parallel=True, nodes=2), "latency")
    assert c.backend == "allgather_reducescatter" and EP.vllm_args(c) == []
    assert "lacks deep_ep" in c.reason.text and "deepep_low_latency would suit" in c.reason.text
    assert c.reason.code == "all2all.missing_packages"
    assert c.reason.data["missing_packages"] == ["deep_ep"]
    assert c.reason.data["wanted"] == "deepep_low_latency"


def test_pinned_backend_the_image_lacks_is_not_a_start(without_deepep):
    d = make_plan(R1, parse_gpus("2x8xH200"),
                  Pins(dp=16, expert_parallel=True, all2all_backend="deepep_low_latency"),
                  suggest=False).to_dict()
    assert not d["fits"] and d["vllm_args"] == []
    assert "lacks deep_ep" in d["problem"]


def test_flag_or_env_by_version(with_deepep):
    L = B.Layout(dp=16, expert_parallel=True, nodes=2)
    old = _choose("2x8xH200", L, "latency", version="0.10.2")
    assert EP.vllm_args(old) == [] and EP.env(old) == {"VLLM_ALL2ALL_BACKEND":
                                                       "deepep_low_latency"}
    assert _choose("2x8xH200", L, version="0.8.5").applies is False
    with pytest.raises(InputError):
        _choose("2x8xH200", L, version="0.32.0", pinned="pplx")  # removed in 0.16
    with pytest.raises(InputError):
        _choose("2x8xH200", L, pinned="carrier_pigeon")


def test_plan_takes_deepep_buffers_from_kv_and_shows_why(with_deepep):
    pins = dict(dp=16, expert_parallel=True, speculative=False)
    base = make_plan(R1, parse_gpus("2x8xH200"), Pins(**pins, all2all_backend=
                     "allgather_reducescatter"), suggest=False, objective="latency").to_dict()
    plan = make_plan(R1, parse_gpus("2x8xH200"), Pins(**pins), suggest=False,
                     objective="latency")
    d = plan.to_dict()
    e = d["serving"]["ep_backend"]
    assert e["backend"] == "deepep_low_latency" and "--all2all-backend" in d["vllm_args"]
    assert d["per_gpu"]["non_torch_bytes"] - base["per_gpu"]["non_torch_bytes"] == (
        e["buffer_bytes_per_gpu"])
    assert d["kv_cache"]["tokens"] < base["kv_cache"]["tokens"]
    reason = next(r["text"] for r in d["reasons"]
                  if r["text"].startswith("all2all-backend deepep_low_latency"))
    assert "GiB of NVSHMEM buffers" in reason and "KV " in reason
    # said once, by the backend's own reason (not appended again by the serving decision)
    assert reason.count(f"{e['buffer_bytes_per_gpu'] / GiB:.2f} GiB") == 1, reason
    assert e["reason"]["text"] == reason
    assert e["buffer_bytes_per_gpu"] / GiB > 1
    # exec reproduces it
    spec, hw, p = inputs_from_plan(load(d))
    assert p.all2all_backend == "deepep_low_latency"


def test_high_throughput_gives_back_the_cuda_graph_memory(with_deepep):
    d = make_plan(R1, parse_gpus("2x8xH200"), Pins(dp=16, expert_parallel=True,
                  speculative=False), suggest=False, objective="throughput",
                  workload=RAG).to_dict()
    assert d["serving"]["ep_backend"]["backend"] == "deepep_high_throughput"
    assert d["per_gpu"]["cudagraph_bytes"] == 0


def test_deepep_overlay_carries_rdma_ipc_lock_and_shared_memory():
    objs = _kustomize(REPO / "deploy" / "kubernetes" / "overlays" / "deepseek-r1-2x8xh200-deepep")
    lws = next(o for o in objs if o["kind"] == "LeaderWorkerSet")
    t = EP.ep_table()["kubernetes"]
    for key in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][key]["spec"]
        init = next(c for c in pod["initContainers"] if c["name"] == "plan")
        assert "--all2all-backend" in init["args"] and "--dp" in init["args"]
        vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
        assert vllm["resources"]["limits"][t["rdma_resource"]]
        assert "IPC_LOCK" in vllm["securityContext"]["capabilities"]["add"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["sizeLimit"] == f"{t['shm_gib']}Gi"
