"""What GPUs this process can use: NVIDIA's through NVML (nvml_inventory.py), AMD's through
amdsmi (amd_inventory.py) when NVML finds no NVIDIA GPU. The records are devices.py's, the
`vlaunch gpus` table gpu_table.py's; this module is the one door the rest of vlaunch uses.

The planner needs the memory that is FREE now on the GPUs the engine will see, not the catalog
size: other tenants, MIG slicing and `CUDA_VISIBLE_DEVICES` all change it. The exporter polls
the same reading, so NVML is initialised once and its handles are kept in a module-level cache.

API
---
``read_inventory(timeout_s=5.0, refresh=False) -> Inventory``
    One reading of every visible GPU: ``Inventory{driver_version, cuda_driver_version,
    devices: list[Device], errors: list[str], hidden, visibility}``. ``Device{index, uuid, name,
    total_bytes, free_bytes, used_bytes, reserved_bytes, compute_capability, mig_enabled,
    mig_parent_uuid, processes: list[Process{pid, name, used_bytes}], nvlink_peers, error,
    cuda_index, mig_index, bus_id, topology}``. With MIG on, the MIG instances are the devices
    (memory of the instance, not the card). ``index`` is NVML's index of the physical GPU (what
    nvidia-smi prints; the parent's for a MIG instance); ``cuda_index`` is the ordinal the engine
    will see; ``nvlink_peers`` and ``topology`` use ``index``. A call that fails for one GPU is
    recorded in that Device's ``error`` (the GPU is unusable) or, for an optional fact (processes,
    NVLink, reserved memory), in ``Inventory.errors``; the other GPUs are still read. The whole
    reading runs on worker threads under ``timeout_s``: a GPU that does not answer in time is
    recorded as such and is not asked again until its stuck call returns.
    No NVML library / no driver / no visible GPU raises ``InputError`` with one line saying how
    to plan anyway. With no NVIDIA GPU, AMD GPUs are read through amdsmi (``platform: rocm``;
    ``nvlink_peers`` then lists xGMI peers, ``topology`` says ``XGMI``).
``detect_hardware(inv=None, count=None) -> Hardware``
    The ``launcher.inputs.hardware.Hardware`` the planner plans on: all visible devices (or
    the first ``count``), sized by the one with the least FREE memory; mixed GPUs, co-tenant
    processes, MIG and missing NVLink are explained in ``notes``.
``nvlink_connected(devices, indices) -> bool``, ``nvlink_group(devices, size)``,
``tp_group_warning(devices, indices)``
    Whether a set of GPUs is fully NVLink-connected, the best such set of a given size, and the
    warning a plan prints when a tensor-parallel group is not.
``render_table(inv, color=False) -> str``
    The ``vlaunch gpus`` table; ``Inventory.to_dict()`` is its ``--format json`` (stable keys).
``shutdown()``
    Drops the cached handles and calls ``nvmlShutdown``. Static facts (names, UUIDs, MIG layout,
    NVLink links, PCIe topology) are read once per NVML session; call ``shutdown()`` or pass
    ``refresh=True`` after reconfiguring MIG. Memory and processes are read on every call.

Visibility: ``NVIDIA_VISIBLE_DEVICES`` (set by the NVIDIA container runtime for a Kubernetes
pod or ``docker --gpus``: ``all``, ``none``, ``void``, indices, ``GPU-``/``MIG-`` UUIDs, ``G:M``)
is applied first; a list of indices as long as the GPUs NVML shows is taken as already applied
by the runtime (inside the container NVML renumbers from 0). ``CUDA_VISIBLE_DEVICES`` (indices,
unique ``GPU-`` UUID prefixes, ``MIG-`` UUIDs) then selects and orders devices the way CUDA
does: an entry that matches nothing ends the list. Indices are taken in PCI bus order, which is
CUDA's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (noted for mixed GPUs, as vLLM warns too).
"""

from __future__ import annotations

from .devices import (  # noqa: F401 - the inventory's public names, kept for its callers
    HOW_TO_PLAN_ANYWAY,
    Device,
    Inventory,
    NoGPUError,
    Process,
    hardware_of,
    no_gpu_for_gpus,
    nvlink_connected,
    nvlink_group,
    tp_group_warning,
)
from .gpu_table import render_table  # noqa: F401 - `vlaunch gpus`
from .hardware import Hardware
from .nvml_inventory import DEFAULT_TIMEOUT_S, read_nvml
from .nvml_inventory import shutdown as _shutdown_nvml


def read_inventory(timeout_s: float = DEFAULT_TIMEOUT_S, refresh: bool = False) -> Inventory:
    """Read every visible GPU now: NVIDIA's through NVML; when NVML has no NVIDIA GPU to show,
    AMD's through amdsmi. With neither, the NVML reason stands (and AMD's, where amdsmi is
    installed but found nothing)."""
    try:
        return read_nvml(timeout_s, refresh)
    except NoGPUError as nvidia:
        from . import amd_inventory

        try:
            return amd_inventory.read_amd()
        except NoGPUError as amd:
            if "not installed" in amd.why:
                raise nvidia from None
            raise NoGPUError(f"{nvidia.why}; AMD: {amd.why}") from None


def detect_hardware(inv: Inventory | None = None, count: int | None = None) -> Hardware:
    """The Hardware of this machine's visible GPUs, sized by the one with the least free memory.

    Plans on FREE memory, not the card's size: a co-tenant's memory, the driver's reservation
    and MIG slicing are gone before vLLM starts, and vLLM refuses to start when the memory it
    was told to take is not free.
    """
    inv = inv if inv is not None else read_inventory()
    return hardware_of(inv, count, "amdsmi" if inv.platform == "rocm" else "nvml")


def shutdown() -> None:
    """Forget the cached NVML handles (amdsmi is opened and closed per reading)."""
    _shutdown_nvml()
