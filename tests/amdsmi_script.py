"""A scripted `amdsmi` (AMD SMI's Python binding) for tests, as nvml_script.py is for NVML.

The real `launcher.inputs.amd_inventory` code runs unchanged against a module object installed
as `sys.modules["amdsmi"]`; its functions answer as AMD SMI's Python API reference documents:
`amdsmi_get_processor_handles()` a list of handles, `amdsmi_get_gpu_asic_info` a dict with
`market_name` and `target_graphics_version`, memory in bytes for `AmdSmiMemoryType.VRAM`,
`amdsmi_get_gpu_process_list` dicts with `pid`, `name` and `memory_usage.vram_mem`,
`amdsmi_topo_get_link_type` a dict of `hops` and `type` (2: XGMI, 1: PCIe), errors as
`AmdSmiLibraryException` with `err_info`, and `AmdSmiLibraryException` before `amdsmi_init`.
The GPU data is illustrative, shaped like real readings (an MI300X reports 205,822,885,888
bytes of VRAM, the catalog's figure), not captured ones.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field

MI300X_BYTES = 205_822_885_888
XGMI, PCIE = 2, 1


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int, err_info: str) -> None:
        super().__init__(f"{err_info} (code {err_code})")
        self.err_code, self.err_info = err_code, err_info


class AmdSmiMemoryType(enum.IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


@dataclass
class ScriptAMD:
    name: str = "AMD Instinct MI300X"
    gfx: str = "gfx942"
    total: int = MI300X_BYTES
    used: int = 300 << 20
    bdf: str = "0000:05:00.0"
    uuid: str = ""
    processes: list[dict] = field(default_factory=list)
    fail: set[str] = field(default_factory=set)  # function names that raise for this GPU


def module(gpus: list[ScriptAMD], links: dict[frozenset, int] | None = None,
           default_link: int = XGMI, init_error: str | None = None) -> types.ModuleType:
    """An `amdsmi` module over `gpus`; `links` pairs of indices -> link type (else default)."""
    m = types.ModuleType("amdsmi")
    state = {"init": False}
    links = links or {}

    def need_init():
        if not state["init"]:
            raise AmdSmiLibraryException(32, "AMDSMI_STATUS_NOT_INIT")

    def gpu(h, fn):
        need_init()
        g = gpus[h]
        if fn in g.fail:
            raise AmdSmiLibraryException(2, f"{fn} failed")
        return g

    def amdsmi_init(flags=None):
        if init_error:
            raise AmdSmiLibraryException(8, init_error)
        state["init"] = True

    def amdsmi_shut_down():
        state["init"] = False

    def amdsmi_get_processor_handles():
        need_init()
        return list(range(len(gpus)))

    def amdsmi_get_gpu_asic_info(h):
        g = gpu(h, "amdsmi_get_gpu_asic_info")
        return {"market_name": g.name, "target_graphics_version": g.gfx, "vendor_id": "0x1002",
                "device_id": "0x74a1"}

    def amdsmi_get_gpu_device_uuid(h):
        g = gpu(h, "amdsmi_get_gpu_device_uuid")
        return g.uuid or f"{h:02x}ff74a1-0000-1000-80f0-{h:012x}"

    def amdsmi_get_gpu_device_bdf(h):
        return gpu(h, "amdsmi_get_gpu_device_bdf").bdf

    def amdsmi_get_gpu_memory_total(h, mem_type):
        assert mem_type == AmdSmiMemoryType.VRAM
        return gpu(h, "amdsmi_get_gpu_memory_total").total

    def amdsmi_get_gpu_memory_usage(h, mem_type):
        assert mem_type == AmdSmiMemoryType.VRAM
        return gpu(h, "amdsmi_get_gpu_memory_usage").used

    def amdsmi_get_gpu_process_list(h):
        return list(gpu(h, "amdsmi_get_gpu_process_list").processes)

    def amdsmi_get_gpu_driver_info(h):
        gpu(h, "amdsmi_get_gpu_driver_info")
        return {"driver_name": "amdgpu", "driver_version": "6.10.5", "driver_date": "2025/01/01"}

    def amdsmi_topo_get_link_type(a, b):
        need_init()
        if a == b:
            return {"hops": 0, "type": 0}
        kind = links.get(frozenset((a, b)), default_link)
        return {"hops": 1 if kind == XGMI else 2, "type": kind}

    for name, value in list(locals().items()):
        if name.startswith("amdsmi_"):
            setattr(m, name, value)
    m.AmdSmiMemoryType = AmdSmiMemoryType
    m.AmdSmiException = AmdSmiException
    m.AmdSmiLibraryException = AmdSmiLibraryException
    return m


def mi300x_node(n: int = 8) -> list[ScriptAMD]:
    """An 8-GPU MI300X platform: every GPU one xGMI hop from every other."""
    return [ScriptAMD(bdf=f"0000:{0x05 + 0x20 * i:02x}:00.0") for i in range(n)]
