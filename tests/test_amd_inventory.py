"""AMD GPUs in the inventory through amdsmi, against the scripted binding (amdsmi_script.py)."""

from __future__ import annotations

import json
import sys

import pytest
from amdsmi_script import MI300X_BYTES, PCIE, ScriptAMD, mi300x_node, module
from click.testing import CliRunner
from schema_check import schema_errors

from launcher.cli import cli
from launcher.inputs import inventory
from launcher.inputs.devices import NoGPUError
from launcher.inputs.model import load_model
from launcher.predict.search.planner import Pins, make_plan


@pytest.fixture(autouse=True)
def no_nvidia(monkeypatch):
    """NVML finds no NVIDIA GPU (as on an AMD machine); no visibility variable is set."""
    def none(*_a, **_k):
        raise NoGPUError("NVML sees no GPU on this machine")

    monkeypatch.setattr(inventory, "read_nvml", none)
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)


def use(monkeypatch, m) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", m)


def test_an_mi300x_node_is_read_and_planned(monkeypatch):
    use(monkeypatch, module(mi300x_node()))
    inv = inventory.read_inventory()
    assert inv.platform == "rocm" and len(inv) == 8 and inv.driver_version == "6.10.5"
    d = inv.devices[3]
    assert d.name == "AMD Instinct MI300X" and d.compute_capability == "gfx942"
    assert d.total_bytes == MI300X_BYTES and d.free_bytes == MI300X_BYTES - (300 << 20)
    assert d.nvlink_peers == [0, 1, 2, 4, 5, 6, 7] and d.topology[0] == "XGMI"
    hw = inventory.detect_hardware(inv)
    assert hw.kind.name == "MI300X" and hw.kind.platform == "rocm" and hw.count == 8
    assert hw.source == "amdsmi" and hw.kind.nvlink and not hw.notes
    plan = make_plan(load_model("llama-3.1-70b"), hw, Pins(vllm_version="0.32.0"))
    assert plan.fits


def test_a_co_tenant_and_a_broken_gpu(monkeypatch):
    gpus = mi300x_node(4)
    gpus[1].processes = [{"pid": 4242, "name": "python3",
                          "memory_usage": {"vram_mem": 40 << 30, "gtt_mem": 0}}]
    gpus[1].used += 40 << 30
    gpus[2].fail = {"amdsmi_get_gpu_memory_total"}
    use(monkeypatch, module(gpus))
    inv = inventory.read_inventory()
    assert inv.devices[2].error and any("GPU 2" in e for e in inv.errors)
    assert inv.devices[1].processes[0].used_bytes == 40 << 30
    hw = inventory.detect_hardware(inv)
    assert hw.count == 3 and hw.free_bytes == inv.devices[1].free_bytes
    assert any("shared: pid 4242" in n for n in hw.notes)
    assert any("left out" in n for n in hw.notes)


def test_hip_visible_devices_selects_and_orders(monkeypatch):
    use(monkeypatch, module(mi300x_node()))
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "5,2")
    inv = inventory.read_inventory()
    assert [(d.index, d.cuda_index) for d in inv.devices] == [(5, 0), (2, 1)]
    assert inv.hidden == 6 and inv.visibility == "HIP_VISIBLE_DEVICES=5,2"


def test_gpus_without_xgmi_warn_a_tensor_parallel_group(monkeypatch):
    use(monkeypatch, module([ScriptAMD(), ScriptAMD(bdf="0000:85:00.0")], default_link=PCIE))
    hw = inventory.detect_hardware()
    assert not hw.kind.nvlink
    assert any("PCIe across CPU sockets" in n for n in hw.notes)


def test_without_amdsmi_the_nvml_reason_stands(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi raises ImportError
    with pytest.raises(NoGPUError) as e:
        inventory.read_inventory()
    assert "NVML sees no GPU" in str(e.value) and "AMD" not in str(e.value)


def test_amdsmi_that_does_not_start_is_one_line(monkeypatch):
    use(monkeypatch, module(mi300x_node(), init_error="AMDSMI_STATUS_DRM_ERROR"))
    r = CliRunner().invoke(cli, ["gpus"])
    assert r.exit_code == 2 and "AMD: amdsmi did not start" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_gpus_command_on_amd(monkeypatch):
    use(monkeypatch, module(mi300x_node(2)))
    r = CliRunner().invoke(cli, ["gpus", "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert schema_errors("gpus", d) == [] and d["platform"] == "rocm"
    r = CliRunner().invoke(cli, ["gpus"])
    assert r.exit_code == 0 and "ROCm" in r.output and "MI300X" in r.output


def test_rocm_plans_set_what_rocm_vllm_leaves_off():
    # vLLM's ROCm default runs without AITER (vllm/envs.py VLLM_ROCM_USE_AITER False); the plan
    # turns it on and says why; a CUDA plan is untouched.
    spec = load_model("deepseek-r1")
    from launcher.inputs.hardware import parse_gpus

    amd = make_plan(spec, parse_gpus("8xMI300X"), Pins(vllm_version="0.32.0")).to_dict()
    assert amd["env"]["VLLM_ROCM_USE_AITER"] == "1"
    assert any("VLLM_ROCM_USE_AITER=1" in r["text"] and "envs.py" in r["text"]
               for r in amd["reasons"])
    nv = make_plan(spec, parse_gpus("8xH200"), Pins(vllm_version="0.32.0")).to_dict()
    assert "VLLM_ROCM_USE_AITER" not in nv["env"]
    assert not any("AITER" in r["text"] for r in nv["reasons"])
