"""A scripted NVML at the binding's function level, for tests and the inventory benchmark.

The real `launcher.inputs.inventory` code runs unchanged: only the `pynvml` module's functions are
replaced (`nvmlInit`, `nvmlDeviceGetMemoryInfo`, ...). They answer the way the real binding does:
the same ctypes structures (`c_nvmlMemory_v2_t`, `nvmlPciInfo_t`), the same friendly process
objects, `pynvml.NVMLError` subclasses with the real error codes, `Uninitialized` before
`nvmlInit`, `NotSupported` / `InvalidArgument` where a driver answers so. The GPU data below is
illustrative, shaped like real readings (an H200 reports 143771 MiB total), not captured ones.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field

import pynvml

MiB = 1 << 20


@dataclass
class ScriptProcess:
    pid: int
    name: str | None  # None: nvmlSystemGetProcessName answers NOT_FOUND
    used_mib: int


@dataclass
class ScriptMig:
    slot: int
    uuid: str
    name: str
    total_mib: int
    used_mib: int = 0
    processes: list[ScriptProcess] = field(default_factory=list)


@dataclass
class ScriptGPU:
    name: str
    uuid: str
    total_mib: int
    bus_id: str  # as NVML formats it: 00000000:18:00.0
    used_mib: int = 0
    reserved_mib: int = 0
    cc: tuple[int, int] = (9, 0)
    processes: list[ScriptProcess] = field(default_factory=list)
    nvlink_count: int = 0  # links the chip has (18 on H100/H200, 12 on A100); 0: no NVLink
    nvlinks: list[tuple[str, int]] = field(default_factory=list)  # active: (remote bus, type)
    mig_mode: int | None = None  # None: MIG not supported; 0 off; 1 on
    mig_slots: int = 7
    migs: list[ScriptMig] = field(default_factory=list)
    fail: dict[str, int] = field(default_factory=dict)  # pynvml function -> NVML error code
    hang: dict[str, threading.Event] = field(default_factory=dict)  # function -> released by


@dataclass(frozen=True)
class _Handle:
    """Opaque like the real c_nvmlDevice_t: the code under test must not look inside."""

    gpu: int
    slot: int | None = None


def _raise(code: int):
    raise pynvml.NVMLError(code)


class NVMLScript:
    """The scripted machine. `calls` counts every binding call, by function name."""

    def __init__(self, gpus: list[ScriptGPU], *, driver: str = "570.133.20",
                 cuda: int = 12080, init_error: int | None = None, memory_v2: bool = True,
                 topology: dict[frozenset, int] | None = None,
                 default_topology: int = pynvml.NVML_TOPOLOGY_SYSTEM):
        self.gpus = gpus
        self.driver = driver
        self.cuda = cuda
        self.init_error = init_error
        self.memory_v2 = memory_v2
        self.topology = topology or {}
        self.default_topology = default_topology
        self.calls: Counter[str] = Counter()
        self.initialised = 0

    # -- plumbing ------------------------------------------------------------------------------

    def _enter(self, fn: str, handle: _Handle | None = None) -> ScriptGPU | None:
        self.calls[fn] += 1
        if fn not in ("nvmlInit", "nvmlErrorString") and not self.initialised:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        gpu = self.gpus[handle.gpu]
        if fn in gpu.hang:
            gpu.hang[fn].wait()
        if fn in gpu.fail:
            _raise(gpu.fail[fn])
        return gpu

    def functions(self) -> dict:
        names = [n for n in dir(self) if n.startswith("nvml")]
        return {n: getattr(self, n) for n in names}

    def install(self, setattr_fn) -> None:
        """Replace pynvml's functions, e.g. `script.install(monkeypatch.setattr)`."""
        for name, fn in self.functions().items():
            setattr_fn(pynvml, name, fn)

    @contextlib.contextmanager
    def installed(self):
        """Outside pytest: install, and put the real binding back afterwards."""
        saved = {name: getattr(pynvml, name) for name in self.functions()}
        self.install(setattr)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(pynvml, name, fn)

    # -- system ----------------------------------------------------------------------------------

    def nvmlInit(self):
        self._enter("nvmlInit")
        if self.init_error is not None:
            _raise(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlErrorString(self, result):
        self.calls["nvmlErrorString"] += 1
        return f"scripted NVML error {result}"

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self):
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlSystemGetProcessName(self, pid):
        self._enter("nvmlSystemGetProcessName")
        for gpu in self.gpus:
            for p in gpu.processes + [p for m in gpu.migs for p in m.processes]:
                if p.pid == pid and p.name is not None:
                    return p.name
        _raise(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    # -- devices ---------------------------------------------------------------------------------

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if "nvmlDeviceGetHandleByIndex" in gpu.fail:
            _raise(gpu.fail["nvmlDeviceGetHandleByIndex"])
        return _Handle(index)

    def _mig(self, gpu: ScriptGPU, handle: _Handle) -> ScriptMig | None:
        if handle.slot is None:
            return None
        return next(m for m in gpu.migs if m.slot == handle.slot)

    def nvmlDeviceGetUUID(self, handle):
        gpu = self._enter("nvmlDeviceGetUUID", handle)
        mig = self._mig(gpu, handle)
        return gpu.uuid if mig is None else mig.uuid

    def nvmlDeviceGetName(self, handle):
        gpu = self._enter("nvmlDeviceGetName", handle)
        mig = self._mig(gpu, handle)
        return gpu.name if mig is None else mig.name

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        gpu = self._enter("nvmlDeviceGetCudaComputeCapability", handle)
        return gpu.cc

    def nvmlDeviceGetPciInfo(self, handle):
        gpu = self._enter("nvmlDeviceGetPciInfo", handle)
        return _pci(gpu.bus_id)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._enter("nvmlDeviceGetMemoryInfo", handle)
        mig = self._mig(gpu, handle)
        total, used, reserved = ((gpu.total_mib, gpu.used_mib, gpu.reserved_mib) if mig is None
                                 else (mig.total_mib, mig.used_mib, 0))
        if version:
            if not self.memory_v2:  # the driver lacks nvmlDeviceGetMemoryInfo_v2
                _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            m = pynvml.c_nvmlMemory_v2_t()
            m.version = version
            m.total, m.reserved, m.used = total * MiB, reserved * MiB, used * MiB
            m.free = (total - reserved - used) * MiB
            return m
        m = pynvml.c_nvmlMemory_t()  # v1 counts the driver's reservation as used
        m.total, m.used = total * MiB, (used + reserved) * MiB
        m.free = (total - reserved - used) * MiB
        return m

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        gpu = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        mig = self._mig(gpu, handle)
        out = []
        for p in gpu.processes if mig is None else mig.processes:
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid, info.usedGpuMemory = p.pid, p.used_mib * MiB
            out.append(pynvml.nvmlStructToFriendlyObject(info))
        return out

    def nvmlDeviceGetMigMode(self, handle):
        gpu = self._enter("nvmlDeviceGetMigMode", handle)
        if gpu.mig_mode is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [gpu.mig_mode, gpu.mig_mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        gpu = self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        if gpu.mig_mode is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        gpu = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if not gpu.mig_mode:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not any(m.slot == index for m in gpu.migs):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return _Handle(handle.gpu, index)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        gpu = self._enter("nvmlDeviceGetNvLinkState", handle)
        if gpu.nvlink_count == 0:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= gpu.nvlink_count:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if link < len(gpu.nvlinks) else 0

    def _link(self, gpu: ScriptGPU, link: int) -> tuple[str, int]:
        if link >= len(gpu.nvlinks):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        gpu = self._enter("nvmlDeviceGetNvLinkRemotePciInfo", handle)
        return _pci(self._link(gpu, link)[0])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        gpu = self._enter("nvmlDeviceGetNvLinkRemoteDeviceType", handle)
        return self._link(gpu, link)[1]

    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2):
        self._enter("nvmlDeviceGetTopologyCommonAncestor", device1)
        self._enter("nvmlDeviceGetTopologyCommonAncestor", device2)
        self.calls["nvmlDeviceGetTopologyCommonAncestor"] -= 1  # one call, two handles checked
        key = frozenset((device1.gpu, device2.gpu))
        return self.topology.get(key, self.default_topology)


def _pci(bus_id: str):
    info = pynvml.nvmlPciInfo_t()
    info.busId = bus_id.encode()
    return info


# -- machines ----------------------------------------------------------------------------------

H200_MIB = 143771
GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH


def uuid(n: int, prefix: str = "GPU") -> str:
    return f"{prefix}-{n:08x}-1c2d-4e5f-8a9b-{n * 7919:012x}"


_HGX_BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]


def hgx_h200(co_tenant: bool = True) -> NVMLScript:
    """8x H200 on an HGX board: 18 NVLinks per GPU, all to the 4 NVSwitches."""
    switches = [f"00000000:{b}:00.0" for b in ("05", "06", "07", "08")]
    gpus = []
    for i, bus in enumerate(_HGX_BUSES):
        gpus.append(ScriptGPU(
            name="NVIDIA H200", uuid=uuid(0x200 + i), total_mib=H200_MIB,
            bus_id=f"00000000:{bus.upper()}:00.0", used_mib=1, reserved_mib=552, cc=(9, 0),
            nvlink_count=18, nvlinks=[(switches[k % 4], SWITCH) for k in range(18)], mig_mode=0))
    if co_tenant:
        gpus[3].processes = [ScriptProcess(pid=41977, name="python3", used_mib=20480)]
        gpus[3].used_mib += 20480
    return NVMLScript(gpus)


def a100_mig() -> NVMLScript:
    """One A100-SXM4-80GB in MIG mode with a 3g.40gb and a 2g.20gb instance (slot 1 empty)."""
    parent = "GPU-a1000000-0000-4000-8000-000000000001"
    name = "NVIDIA A100-SXM4-80GB"
    migs = [
        ScriptMig(slot=0, uuid="MIG-3a3a3a3a-0000-5000-9000-000000000000",
                  name=f"{name} MIG 3g.40gb", total_mib=40192, used_mib=12,
                  processes=[ScriptProcess(pid=5150, name="trainer", used_mib=8192)]),
        ScriptMig(slot=2, uuid="MIG-2b2b2b2b-0000-5000-9000-000000000002",
                  name=f"{name} MIG 2g.20gb", total_mib=19968, used_mib=6),
    ]
    migs[0].used_mib += 8192
    gpu = ScriptGPU(name=name, uuid=parent, total_mib=81920, bus_id="00000000:07:00.0",
                    reserved_mib=0, cc=(8, 0), nvlink_count=12, mig_mode=1, migs=migs)
    return NVMLScript([gpu])


def mixed_h100_a100() -> NVMLScript:
    """Two H100s bridged to each other, two A100s bridged to each other, PCIe across pairs."""
    h, a = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
    buses = ["00000000:1B:00.0", "00000000:43:00.0", "00000000:52:00.0", "00000000:61:00.0"]
    gpus = [
        ScriptGPU(name=h, uuid=uuid(0x100), total_mib=81559, bus_id=buses[0], used_mib=1,
                  reserved_mib=527, nvlink_count=18, nvlinks=[(buses[1], GPU)] * 4),
        ScriptGPU(name=h, uuid=uuid(0x101), total_mib=81559, bus_id=buses[1], used_mib=1,
                  reserved_mib=527, nvlink_count=18, nvlinks=[(buses[0], GPU)] * 4),
        ScriptGPU(name=a, uuid=uuid(0xA00), total_mib=81920, bus_id=buses[2], used_mib=4,
                  reserved_mib=1080, cc=(8, 0), nvlink_count=12, nvlinks=[(buses[3], GPU)] * 4,
                  mig_mode=0),
        ScriptGPU(name=a, uuid=uuid(0xA01), total_mib=81920, bus_id=buses[3], used_mib=4,
                  reserved_mib=1080, cc=(8, 0), nvlink_count=12, nvlinks=[(buses[2], GPU)] * 4,
                  mig_mode=0),
    ]
    topo = {frozenset((0, 1)): pynvml.NVML_TOPOLOGY_NODE,
            frozenset((2, 3)): pynvml.NVML_TOPOLOGY_NODE}
    return NVMLScript(gpus, topology=topo, default_topology=pynvml.NVML_TOPOLOGY_SYSTEM)


def clean_inventory(monkeypatch) -> None:
    """Tests of the NVML inventory start and end without device-selection variables and with
    the inventory's NVML session closed (a generator for an autouse fixture)."""
    from launcher.inputs import inventory

    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)
    inventory.shutdown()
    yield
    inventory.shutdown()
