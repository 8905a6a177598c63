"""AMD GPUs read through AMD SMI (`import amdsmi`, AMD's Python binding of libamd_smi): the
backend of `launcher.inputs.inventory` for Instinct cards, beside NVML's for NVIDIA.

Why amdsmi: it is what vLLM's ROCm platform itself asks (vllm/platforms/rocm.py imports
amdsmi_get_processor_handles, amdsmi_get_gpu_asic_info, amdsmi_get_gpu_memory_total and
amdsmi_topo_get_link_type, and RocmPlatform.is_fully_connected calls two GPUs fully connected
when the link is one hop of type 2, XGMI), so the planner sees the devices the engine will.
The binding needs ROCm's library at run time, so it is imported only here, only when NVML found
no NVIDIA GPU; without it the inventory says so in one line.

Calls, from AMD SMI's Python API reference: amdsmi_init / amdsmi_shut_down,
amdsmi_get_processor_handles, amdsmi_get_gpu_asic_info (market_name, target_graphics_version),
amdsmi_get_gpu_device_uuid, amdsmi_get_gpu_device_bdf, amdsmi_get_gpu_memory_total and
amdsmi_get_gpu_memory_usage with AmdSmiMemoryType.VRAM (bytes), amdsmi_get_gpu_process_list
(dicts: pid, name, memory_usage.vram_mem), amdsmi_get_gpu_driver_info (driver_version) and
amdsmi_topo_get_link_type (hops, type). A call that fails for one GPU is recorded on that
device (or, for an optional fact, in Inventory.errors); the other GPUs are still read.

Visibility: ROCm's HIP_VISIBLE_DEVICES (or ROCR_VISIBLE_DEVICES, then CUDA_VISIBLE_DEVICES,
which vLLM's ROCm platform keeps in step) as a list of indices selects and orders devices.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from .devices import Device, Inventory, NoGPUError, Process

XGMI_LINK = 2  # amdsmi's AmdSmiIoLinkType for XGMI (vllm/platforms/rocm.py: "type is 2 for XGMI")
_VISIBILITY = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def _import() -> Any:
    try:
        import amdsmi  # needs ROCm's libamd_smi: imported only on an AMD machine
    except ImportError:
        raise NoGPUError("no NVIDIA GPU, and the amdsmi package (ROCm) is not installed for "
                         "AMD GPUs") from None
    except OSError as e:  # the binding is there, its shared library is not
        raise NoGPUError(f"amdsmi cannot load ROCm's library ({e})") from None
    return amdsmi


def _err(e: BaseException) -> str:
    return str(getattr(e, "err_info", "") or e or type(e).__name__)


def read_amd(amdsmi: Any = None) -> Inventory:
    """Read every visible AMD GPU now: memory, processes, identity and xGMI links."""
    amdsmi = amdsmi or _import()
    try:
        amdsmi.amdsmi_init()
    except Exception as e:  # noqa: BLE001 - any failure to start is one line
        raise NoGPUError(f"amdsmi did not start ({_err(e)})") from None
    try:
        return _read(amdsmi)
    finally:
        with contextlib.suppress(Exception):  # shutting down must not fail the reading
            amdsmi.amdsmi_shut_down()


def _visible(count: int, errors: list[str]) -> tuple[list[int], str | None]:
    for var in _VISIBILITY:
        value = os.environ.get(var)
        if value is None:
            continue
        picked: list[int] = []
        for token in (t.strip() for t in value.split(",") if t.strip()):
            if not token.isdigit() or int(token) >= count:
                errors.append(f"{var}={value}: entry {token!r} is not a GPU index; the list "
                              "ends there")
                break
            picked.append(int(token))
        return picked, f"{var}={value}"
    return list(range(count)), None


def _read(amdsmi: Any) -> Inventory:
    handles = list(amdsmi.amdsmi_get_processor_handles())
    if not handles:
        raise NoGPUError("amdsmi sees no AMD GPU on this machine")
    errors: list[str] = []
    order, visibility = _visible(len(handles), errors)
    if not order:
        raise NoGPUError(f"{visibility} hides all {len(handles)} AMD GPUs")
    driver = ""
    try:
        driver = str(amdsmi.amdsmi_get_gpu_driver_info(handles[order[0]]).get("driver_version"))
    except Exception as e:  # noqa: BLE001 - optional fact
        errors.append(f"driver version: {_err(e)}")
    vram = amdsmi.AmdSmiMemoryType.VRAM
    devices = []
    for cuda_index, i in enumerate(order):
        h, dev = handles[i], Device(index=i, uuid="", name="AMD GPU", cuda_index=cuda_index)
        try:
            asic = amdsmi.amdsmi_get_gpu_asic_info(h)
            dev.name = str(asic.get("market_name") or dev.name)
            dev.compute_capability = str(asic.get("target_graphics_version") or "")
            dev.uuid = str(amdsmi.amdsmi_get_gpu_device_uuid(h))
            dev.total_bytes = int(amdsmi.amdsmi_get_gpu_memory_total(h, vram))
            dev.used_bytes = int(amdsmi.amdsmi_get_gpu_memory_usage(h, vram))
            dev.free_bytes = max(0, dev.total_bytes - dev.used_bytes)
        except Exception as e:  # noqa: BLE001 - this GPU is unusable, the others are read
            dev.error = _err(e)
            errors.append(f"GPU {i}: {dev.error}")
        for what, read in (("PCI address", lambda h=h: amdsmi.amdsmi_get_gpu_device_bdf(h)),
                           ("processes", lambda h=h: _processes(amdsmi, h))):
            try:
                value = read()
            except Exception as e:  # noqa: BLE001 - optional facts
                errors.append(f"GPU {i}: {what}: {_err(e)}")
                continue
            if what == "processes":
                dev.processes = value
            else:
                dev.bus_id = str(value)
        devices.append(dev)
    _links(amdsmi, handles, devices, errors)
    return Inventory(driver_version=driver, cuda_driver_version="", devices=devices,
                     errors=errors, hidden=len(handles) - len(order), visibility=visibility,
                     platform="rocm")


def _processes(amdsmi: Any, h: Any) -> list[Process]:
    out = []
    for p in amdsmi.amdsmi_get_gpu_process_list(h) or ():
        used = (p.get("memory_usage") or {}).get("vram_mem", p.get("mem"))
        out.append(Process(pid=int(p.get("pid", 0)), name=str(p.get("name") or "?"),
                           used_bytes=None if used is None else int(used)))
    return out


def _links(amdsmi: Any, handles: list, devices: list[Device], errors: list[str]) -> None:
    """xGMI peers (one hop, type XGMI: what vLLM's ROCm platform calls fully connected), the
    rest PCIe across the host ("SYS")."""
    whole = [d for d in devices if d.error is None]
    for n, a in enumerate(whole):
        for b in whole[n + 1:]:
            try:
                link = amdsmi.amdsmi_topo_get_link_type(handles[a.index], handles[b.index])
                xgmi = int(link["hops"]) == 1 and int(link["type"]) == XGMI_LINK
            except Exception as e:  # noqa: BLE001 - optional fact
                errors.append(f"GPU {a.index}-{b.index}: link type: {_err(e)}")
                continue
            a.topology[b.index] = b.topology[a.index] = "XGMI" if xgmi else "SYS"
    for d in whole:
        d.nvlink_peers = sorted(k for k, v in d.topology.items() if v == "XGMI")
