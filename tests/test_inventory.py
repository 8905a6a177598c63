"""The NVML inventory, driven through a scripted NVML at the binding's function level.

`tests/nvml_script.py` replaces `pynvml`'s functions; everything in `launcher.inputs.inventory` runs
as it would against a driver. Expected numbers come from the script's inputs (MiB readings), not
from the implementation.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nvml_script as ns  # noqa: E402

from launcher.cli import cli  # noqa: E402
from launcher.errors import InputError  # noqa: E402
from launcher.inputs import inventory  # noqa: E402

MiB = ns.MiB


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    yield from ns.clean_inventory(monkeypatch)


def use(monkeypatch, script: ns.NVMLScript) -> ns.NVMLScript:
    script.install(monkeypatch.setattr)
    return script


# -- 8x H200 -----------------------------------------------------------------------------------

def test_h200_board_reads_every_gpu_with_v2_memory(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    inv = inventory.read_inventory()
    assert inv.driver_version == "570.133.20"
    assert inv.cuda_driver_version == "12.8"
    assert [d.index for d in inv.devices] == list(range(8))
    assert [d.cuda_index for d in inv.devices] == list(range(8))
    for d, g in zip(inv.devices, s.gpus, strict=True):
        assert d.uuid == g.uuid
        assert d.name == "NVIDIA H200"
        assert d.total_bytes == 143771 * MiB
        assert d.reserved_bytes == g.reserved_mib * MiB
        assert d.used_bytes == g.used_mib * MiB
        assert d.free_bytes == (143771 - g.reserved_mib - g.used_mib) * MiB
        assert d.compute_capability == "9.0"
        assert d.mig_enabled is False and d.mig_parent_uuid is None
        assert d.error is None
        assert d.bus_id == g.bus_id.lower()[4:]
    assert inv.errors == []


def test_h200_nvswitch_fabric_makes_all_gpus_peers(monkeypatch):
    use(monkeypatch, ns.hgx_h200())
    inv = inventory.read_inventory()
    for d in inv.devices:
        assert d.nvlink_peers == [i for i in range(8) if i != d.index]
    assert inventory.nvlink_connected(inv.devices, range(8))
    assert inventory.tp_group_warning(inv.devices, range(8)) is None


def test_h200_co_tenant_is_named_and_limits_the_plan(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    inv = inventory.read_inventory()
    tenant = inv.devices[3].processes
    assert [(p.pid, p.name, p.used_bytes) for p in tenant] == [(41977, "python3", 20480 * MiB)]
    hw = inventory.detect_hardware(inv)
    g3 = s.gpus[3]
    assert hw.source == "nvml"
    assert hw.kind.name == "H200"
    assert hw.count == 8 and hw.nodes == 1
    assert hw.total_bytes == 143771 * MiB
    assert hw.free_bytes == (143771 - g3.reserved_mib - g3.used_mib) * MiB
    assert hw.kind.nvlink is True
    assert len(hw.devices) == 8
    shared = [n for n in hw.notes if "GPU 3" in n]
    assert shared and "41977" in shared[0] and "python3" in shared[0] and "20.00 GiB" in shared[0]


def test_detect_hardware_first_count_gpus(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    hw = inventory.detect_hardware(count=2)
    g0 = s.gpus[0]
    assert hw.count == 2
    assert [d.index for d in hw.devices] == [0, 1]
    assert hw.free_bytes == (143771 - g0.reserved_mib - g0.used_mib) * MiB
    assert not any("41977" in n for n in hw.notes)  # the co-tenant is on GPU 3, not used
    with pytest.raises(InputError, match="asked for 9 GPUs but 8"):
        inventory.detect_hardware(count=9)


def test_nvml_initialised_once_handles_reused_memory_reread(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    first = inventory.read_inventory()
    s.gpus[5].used_mib += 1000  # an engine allocates between two polls
    second = inventory.read_inventory()
    assert s.calls["nvmlInit"] == 1
    assert s.calls["nvmlDeviceGetHandleByIndex"] == 8
    assert s.calls["nvmlDeviceGetUUID"] == 8
    # links read once, not per poll: 18 per H200 plus the probe past the last one
    assert s.calls["nvmlDeviceGetNvLinkState"] == 8 * (18 + 1)
    assert s.calls["nvmlDeviceGetMemoryInfo"] == 16
    assert second.devices[5].free_bytes == first.devices[5].free_bytes - 1000 * MiB
    inventory.shutdown()
    assert s.initialised == 0  # nvmlShutdown balanced the init
    inventory.read_inventory()
    assert s.calls["nvmlInit"] == 2


def test_memory_v1_when_driver_lacks_v2(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200(co_tenant=False))
    s.memory_v2 = False
    inv = inventory.read_inventory()
    g = s.gpus[0]
    d = inv.devices[0]
    assert d.reserved_bytes == 0
    assert d.used_bytes == (g.used_mib + g.reserved_mib) * MiB  # v1 counts the reservation
    assert d.free_bytes == (143771 - g.reserved_mib - g.used_mib) * MiB
    assert inv.errors == []
    inventory.read_inventory()
    # v2 is not retried on every poll once the driver said it lacks it
    assert s.calls["nvmlDeviceGetMemoryInfo"] == 8 * 2 + 8


# -- MIG -----------------------------------------------------------------------------------------

def test_mig_instances_are_the_devices(monkeypatch):
    s = use(monkeypatch, ns.a100_mig())
    inv = inventory.read_inventory()
    parent = s.gpus[0]
    assert [d.label for d in inv.devices] == ["0:0", "0:2"]
    big, small = inv.devices
    assert big.uuid == parent.migs[0].uuid and small.uuid == parent.migs[1].uuid
    assert big.mig_enabled and big.mig_parent_uuid == parent.uuid
    assert big.total_bytes == 40192 * MiB and small.total_bytes == 19968 * MiB
    assert big.free_bytes == (40192 - parent.migs[0].used_mib) * MiB
    assert [(p.pid, p.name) for p in big.processes] == [(5150, "trainer")]
    assert big.compute_capability == "8.0"
    assert big.nvlink_peers == []


def test_mig_plans_on_one_instance_not_the_card(monkeypatch):
    s = use(monkeypatch, ns.a100_mig())
    hw = inventory.detect_hardware()
    mig = s.gpus[0].migs[0]
    assert hw.count == 1
    assert hw.total_bytes == 40192 * MiB
    assert hw.free_bytes == (40192 - mig.used_mib) * MiB
    assert hw.kind.total_bytes == 40192 * MiB  # not the 80 GiB card
    assert "3g.40gb" in hw.kind.name
    assert any(n.startswith("MIG:") for n in hw.notes)
    with pytest.raises(InputError, match="MIG instances"):
        inventory.detect_hardware(count=2)


def test_mig_on_without_instances_is_explained(monkeypatch):
    s = ns.a100_mig()
    s.gpus[0].migs = []
    use(monkeypatch, s)
    with pytest.raises(InputError, match="GPU 0 has MIG on but no MIG instances") as e:
        inventory.detect_hardware()
    assert "--gpus cpu" in str(e.value)


# -- mixed ------------------------------------------------------------------------------------

def test_mixed_h100_a100_plans_on_smallest_and_common_features(monkeypatch):
    s = use(monkeypatch, ns.mixed_h100_a100())
    inv = inventory.read_inventory()
    assert [d.nvlink_peers for d in inv.devices] == [[1], [0], [3], [2]]
    assert inv.devices[0].topology[2] == "SYS"
    assert inv.devices[0].topology[1] == "NV"
    hw = inventory.detect_hardware(inv)
    a100 = s.gpus[2]
    assert hw.free_bytes == (81920 - a100.reserved_mib - a100.used_mib) * MiB
    assert hw.total_bytes == 81920 * MiB
    assert hw.kind.fp8 is False  # the A100s have none, so the plan cannot use it
    assert hw.kind.compute_capability == "8.0"
    assert hw.kind.nvlink is False
    notes = " | ".join(hw.notes)
    assert "mixed GPUs" in notes and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in notes
    assert "not all NVLink-connected" in notes


def test_tp_group_warning_names_the_path_and_a_better_group(monkeypatch):
    use(monkeypatch, ns.mixed_h100_a100())
    inv = inventory.read_inventory()
    assert inventory.nvlink_connected(inv.devices, [0, 1])
    assert not inventory.nvlink_connected(inv.devices, [1, 2])
    warning = inventory.tp_group_warning(inv.devices, [1, 2])
    assert "GPU 1 and GPU 2" in warning and "across CPU sockets" in warning
    # the H100 pair has more free memory at its weakest member than the A100 pair
    assert warning.endswith("CUDA_VISIBLE_DEVICES=0,1")
    assert inventory.nvlink_group(inv.devices, 2) == [0, 1]
    assert inventory.nvlink_group(inv.devices, 3) is None


def test_pcie_topology_read_once(monkeypatch):
    s = use(monkeypatch, ns.mixed_h100_a100())
    inventory.read_inventory()
    inventory.read_inventory()
    assert s.calls["nvmlDeviceGetTopologyCommonAncestor"] == 4  # the 4 cross pairs, once


# -- visibility -----------------------------------------------------------------------------------

def test_cuda_visible_devices_by_index_keeps_cuda_order(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    inv = inventory.read_inventory()
    assert [(d.index, d.cuda_index) for d in inv.devices] == [(3, 0), (1, 1)]
    assert inv.hidden == 6
    assert inv.devices[0].nvlink_peers == [1]  # only visible peers
    assert s.calls["nvmlDeviceGetMemoryInfo"] == 2  # hidden GPUs are not polled


def test_cuda_visible_devices_by_uuid_prefix(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{s.gpus[6].uuid},{s.gpus[2].uuid[:13]}")
    inv = inventory.read_inventory()
    assert [d.index for d in inv.devices] == [6, 2]


def test_cuda_visible_devices_invalid_entry_ends_the_list(monkeypatch):
    use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-nope,2")
    inv = inventory.read_inventory()
    assert [d.index for d in inv.devices] == [1]
    assert any("GPU-nope" in e for e in inv.errors)


def test_cuda_visible_devices_by_mig_uuid(monkeypatch):
    s = use(monkeypatch, ns.a100_mig())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", s.gpus[0].migs[1].uuid)
    inv = inventory.read_inventory()
    assert [d.uuid for d in inv.devices] == [s.gpus[0].migs[1].uuid]
    assert inventory.detect_hardware(inv).total_bytes == 19968 * MiB


@pytest.mark.parametrize("value", ["", "-1"])
def test_cuda_visible_devices_hiding_everything(monkeypatch, value):
    use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    with pytest.raises(InputError, match="CUDA_VISIBLE_DEVICES") as e:
        inventory.read_inventory()
    assert "--gpus 8xH200" in str(e.value)


@pytest.mark.parametrize("value", ["none", "void", ""])
def test_nvidia_visible_devices_none(monkeypatch, value):
    use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", value)
    with pytest.raises(InputError, match="NVIDIA_VISIBLE_DEVICES"):
        inventory.read_inventory()


def test_nvidia_visible_devices_uuids_and_all(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", f"{s.gpus[4].uuid},{s.gpus[5].uuid}")
    assert [d.index for d in inventory.read_inventory().devices] == [4, 5]
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    assert len(inventory.read_inventory().devices) == 8


def test_nvidia_visible_devices_indices(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "2,5")  # host view: pick GPUs 2 and 5
    assert [d.index for d in inventory.read_inventory().devices] == [2, 5]
    # inside a pod: the runtime mounted exactly the listed GPUs and NVML renumbered them
    s.gpus[:] = s.gpus[:2]
    inventory.shutdown()
    assert [d.index for d in inventory.read_inventory().devices] == [0, 1]


def test_nvidia_then_cuda_visible_devices(monkeypatch):
    s = use(monkeypatch, ns.hgx_h200())
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", ",".join(g.uuid for g in s.gpus[4:]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,5")  # 1 is not in the pod: the list ends
    with pytest.raises(InputError):
        inventory.read_inventory()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,4")
    assert [d.index for d in inventory.read_inventory().devices] == [5, 4]


# -- failures -------------------------------------------------------------------------------

def test_gpu_lost_mid_query_is_recorded_and_the_rest_read(monkeypatch):
    s = ns.hgx_h200()
    s.gpus[2].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    use(monkeypatch, s)
    inv = inventory.read_inventory()
    assert inv.devices[2].error == "GPU is lost"
    assert all(d.error is None for d in inv.devices if d.index != 2)
    assert all(d.total_bytes == 143771 * MiB for d in inv.devices if d.index != 2)
    assert any(e.startswith("GPU 2:") and "lost" in e for e in inv.errors)
    hw = inventory.detect_hardware(inv)
    assert hw.count == 7 and 2 not in [d.index for d in hw.devices]
    assert any("GPU 2" in n and "lost" in n for n in hw.notes)


def test_gpu_lost_while_reading_identity(monkeypatch):
    s = ns.hgx_h200()
    s.gpus[5].fail["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_GPU_IS_LOST
    use(monkeypatch, s)
    inv = inventory.read_inventory()
    assert inv.devices[5].error == "GPU is lost"
    assert [d.index for d in inv.devices if d.error is None] == [0, 1, 2, 3, 4, 6, 7]
    # GPUs whose peers include a lost one do not list it
    assert 5 not in inv.devices[0].nvlink_peers


def test_optional_facts_not_supported_do_not_fail_the_gpu(monkeypatch):
    s = ns.hgx_h200()
    s.gpus[1].fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    s.gpus[3].fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NO_PERMISSION
    s.gpus[4].fail["nvmlDeviceGetCudaComputeCapability"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    use(monkeypatch, s)
    inv = inventory.read_inventory()
    assert all(d.error is None for d in inv.devices)
    assert inv.devices[1].processes == [] and inv.devices[3].processes == []
    assert inv.devices[4].compute_capability == ""
    assert any(e.startswith("GPU 3: processes:") for e in inv.errors)
    assert not any(e.startswith("GPU 1:") for e in inv.errors)  # NOT_SUPPORTED is normal
    assert any(e.startswith("GPU 4: compute capability") for e in inv.errors)


def test_process_name_unknown_falls_back_to_pid(monkeypatch):
    s = ns.hgx_h200()
    s.gpus[3].processes[0].name = None
    use(monkeypatch, s)
    proc = inventory.read_inventory().devices[3].processes[0]
    assert proc.name == "pid 41977" and proc.used_bytes == 20480 * MiB


def test_a_hung_gpu_does_not_hang_the_read(monkeypatch):
    s = ns.hgx_h200()
    release = threading.Event()
    s.gpus[1].hang["nvmlDeviceGetMemoryInfo"] = release
    use(monkeypatch, s)
    try:
        inv = inventory.read_inventory(timeout_s=0.3)
        assert "did not answer" in inv.devices[1].error
        assert all(d.error is None for d in inv.devices if d.index != 1)
        again = inventory.read_inventory(timeout_s=0.3)
        assert "has not answered" in again.devices[1].error  # not asked again while stuck
    finally:
        release.set()
    del s.gpus[1].hang["nvmlDeviceGetMemoryInfo"]
    for _ in range(200):  # the stuck call returns; the GPU is read again after that
        inv = inventory.read_inventory(timeout_s=1.0)
        if inv.devices[1].error is None:
            break
        time.sleep(0.01)
    assert inv.devices[1].error is None


def test_a_call_that_never_returns_does_not_block_exit():
    """The CLI must exit even when a worker thread is stuck inside NVML for good."""
    here = str(Path(__file__).resolve().parent)
    code = (
        f"import sys, threading; sys.path.insert(0, {here!r})\n"
        "import nvml_script as ns; from launcher.inputs import inventory\n"
        "s = ns.hgx_h200(); s.gpus[0].hang['nvmlDeviceGetComputeRunningProcesses'] = "
        "threading.Event()\n"
        "s.install(setattr)\n"
        "print(inventory.read_inventory(timeout_s=0.3).devices[0].error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert "did not answer" in done.stdout


@pytest.mark.parametrize("code, words", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
])
def test_no_driver_is_one_line_input_error(monkeypatch, code, words):
    s = use(monkeypatch, ns.NVMLScript([], init_error=code))
    with pytest.raises(InputError) as e:
        inventory.read_inventory()
    msg = str(e.value)
    assert words in msg and "pass --gpus 8xH200, or --gpus cpu" in msg and "\n" not in msg
    s.init_error = None  # the driver got loaded: the next call initialises
    with pytest.raises(InputError, match="sees no GPU"):
        inventory.read_inventory()
    assert s.calls["nvmlInit"] == 2


def test_real_binding_without_nvml_library():
    """On a machine with no libnvidia-ml, the real pynvml path ends in the same error."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has an NVML library")
    with pytest.raises(InputError, match="NVML library"):
        inventory.read_inventory()


def test_exporter_reads_the_inventory(monkeypatch):
    """The exporter's default reader takes our records as they are (index, uuid, memory)."""
    from launcher.observe import exporter

    s = use(monkeypatch, ns.hgx_h200())
    reader = exporter.default_gpu_reader()
    assert reader is not None
    records = [exporter.to_gpu_record(r) for r in reader()]
    assert [r.index for r in records] == list(range(8))
    g3 = s.gpus[3]
    assert records[3].uuid == g3.uuid
    assert records[3].total_bytes == 143771 * MiB
    assert records[3].free_bytes == (143771 - g3.reserved_mib - g3.used_mib) * MiB


# -- CLI -------------------------------------------------------------------------------------------

def test_cli_gpus_table(monkeypatch):
    use(monkeypatch, ns.hgx_h200())
    result = CliRunner().invoke(cli, ["gpus"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("driver 570.133.20  CUDA 12.8  8 devices")
    rows = [ln for ln in lines if ln[:1].isdigit()]
    assert len(rows) == 8
    assert "41977 python3 20.00 GiB" in rows[3]
    assert rows[3].split()[-1] == "0-2,4-7"
    assert "\x1b[" not in result.output  # not a terminal: no colour


def test_cli_gpus_json(monkeypatch):
    s = use(monkeypatch, ns.mixed_h100_a100())
    result = CliRunner().invoke(cli, ["gpus", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["driver_version"] == "570.133.20"
    assert [d["uuid"] for d in data["devices"]] == [g.uuid for g in s.gpus]
    assert [d["total_bytes"] for d in data["devices"]] == [g.total_mib * MiB for g in s.gpus]
    assert data["devices"][0]["nvlink_peers"] == [1]
    assert data["devices"][0]["topology"]["2"] == "SYS"


def test_cli_gpus_table_shows_errors(monkeypatch):
    s = ns.hgx_h200()
    s.gpus[6].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    use(monkeypatch, s)
    result = CliRunner().invoke(cli, ["gpus"])
    assert result.exit_code == 0
    assert "error: GPU is lost" in result.output
    assert "! GPU 6: GPU is lost" in result.output


def test_cli_gpus_without_gpu_exits_2_with_one_line(monkeypatch):
    use(monkeypatch, ns.NVMLScript([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    result = CliRunner().invoke(cli, ["gpus", "--format", "json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vlaunch: error: no usable NVIDIA GPU")
    assert "--gpus cpu" in err[0]

