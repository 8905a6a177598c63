"""The GPUs one inventory reading found, whatever library read them (NVML or AMD SMI), and
what the planner asks of them: which talk over a fast fabric, and the Hardware to plan on.

Why its own module: the readers (nvml_inventory.py, amd_inventory.py) fill these records and
the planner, the exporter and `vlaunch gpus` read them; none of those needs to know which
vendor's library answered.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field

from ..errors import InputError
from .hardware import GiB, Hardware, kind_for_nvml_name

HOW_TO_PLAN_ANYWAY = "pass --gpus 8xH200, or --gpus cpu for the CPU engine"
_TOPOLOGY_MEANING = {
    "INT": "the same board", "PIX": "one PCIe switch", "PXB": "several PCIe switches",
    "PHB": "a PCIe host bridge", "NODE": "PCIe within one NUMA node",
    "SYS": "PCIe across CPU sockets", "XGMI": "AMD Infinity Fabric (xGMI)",
}



@dataclass
class Process:
    """A compute process on a GPU: a co-tenant whose memory the plan cannot use."""

    pid: int
    name: str
    used_bytes: int | None  # None where NVML cannot tell (WDDM, missing permission)


@dataclass
class Device:
    """One GPU, or one MIG instance, as the engine would see it."""

    index: int
    uuid: str
    name: str
    total_bytes: int = 0
    free_bytes: int = 0
    used_bytes: int = 0
    reserved_bytes: int = 0
    compute_capability: str = ""
    mig_enabled: bool = False
    mig_parent_uuid: str | None = None
    processes: list[Process] = field(default_factory=list)
    nvlink_peers: list[int] = field(default_factory=list)
    error: str | None = None
    cuda_index: int | None = None
    mig_index: int | None = None
    bus_id: str | None = None
    topology: dict[int, str] = field(default_factory=dict)  # peer index -> NV | PIX | ... | SYS

    @property
    def label(self) -> str:
        """`3`, or `3:1` for MIG instance 1 of GPU 3 (NVIDIA_VISIBLE_DEVICES' notation)."""
        return f"{self.index}" if self.mig_index is None else f"{self.index}:{self.mig_index}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["topology"] = {str(k): v for k, v in self.topology.items()}
        return d


@dataclass
class Inventory:
    """Everything one reading found. `devices` holds only what this process may use."""

    driver_version: str
    cuda_driver_version: str
    devices: list[Device]
    errors: list[str] = field(default_factory=list)
    hidden: int = 0  # GPUs / MIG instances NVML shows that the visibility variables exclude
    visibility: str | None = None  # which variable restricted the view, as `NAME=value`
    platform: str = "cuda"  # cuda (read through NVML) | rocm (through amdsmi)

    def __iter__(self):
        """Iterating an Inventory yields its devices: pollers (the exporter) treat it as a list."""
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def to_dict(self) -> dict:
        return {
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "devices": [d.to_dict() for d in self.devices],
            "errors": list(self.errors),
            "hidden": self.hidden,
            "visibility": self.visibility,
            "platform": self.platform,
        }



class NoGPUError(InputError):
    """No GPU NVML can read; `why` says what failed. The message tells a planning command to
    pass --gpus; `vlaunch gpus`, which takes no --gpus, words its own (`no_gpu_for_gpus`)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"no usable NVIDIA GPU: {why}; {HOW_TO_PLAN_ANYWAY}")
        self.why = why


def no_gpu_for_gpus(e: NoGPUError) -> InputError:
    """The `vlaunch gpus` wording: it only reads NVML, so it points at the commands that take
    --gpus instead of suggesting a flag it rejects."""
    return InputError(f"no usable NVIDIA GPU: {e.why}; `vlaunch gpus` lists what NVML sees "
                      "and there is nothing to list; to plan without a GPU: vlaunch plan MODEL "
                      "--gpus 8xH200 (or --gpus cpu)")


def _no_gpu(why: str) -> NoGPUError:
    return NoGPUError(why)


def _by_index(devices) -> dict[int, Device]:
    return {d.index: d for d in devices if d.mig_index is None}


def nvlink_connected(devices, indices) -> bool:
    """True when every pair among `indices` (Device.index) talks over NVLink; one GPU is."""
    known = _by_index(devices)
    idx = list(dict.fromkeys(indices))
    if any(i not in known for i in idx):
        return False
    return all(j in known[i].nvlink_peers for i, j in itertools.combinations(idx, 2))


def nvlink_group(devices, size: int) -> list[int] | None:
    """The fully NVLink-connected set of `size` GPUs with the most free memory at its weakest
    member (ties: lowest indices), or None. Where a TP group should be placed."""
    usable = [d for d in devices if d.mig_index is None and d.error is None]
    best: tuple[int, list[int]] | None = None
    for combo in itertools.combinations(usable, size):
        ids = [d.index for d in combo]
        if size > 1 and not nvlink_connected(usable, ids):
            continue
        score = min(d.free_bytes for d in combo)
        if best is None or score > best[0]:
            best = (score, ids)
    return None if best is None else best[1]


def tp_group_warning(devices, indices) -> str | None:
    """The plan warning for a tensor-parallel group that is not fully NVLink-connected."""
    idx = list(dict.fromkeys(indices))
    if len(idx) < 2 or nvlink_connected(devices, idx):
        return None
    known = _by_index(devices)
    for i, j in itertools.combinations(idx, 2):
        if i in known and j not in known[i].nvlink_peers:
            level = known[i].topology.get(j)
            how = _TOPOLOGY_MEANING.get(level or "", "an unknown path")
            msg = (f"GPUs {','.join(map(str, idx))} are not all NVLink-connected (GPU {i} and "
                   f"GPU {j} talk over {how}); tensor-parallel all-reduce will be slower")
            group = nvlink_group(devices, len(idx))
            if group:
                msg += ("; NVLink-connected instead: "
                        f"CUDA_VISIBLE_DEVICES={','.join(map(str, group))}")
            return msg
    return f"GPUs {','.join(map(str, idx))}: not all are visible GPUs, NVLink unknown"


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"



def _cc_order(cc: str) -> float:
    """Compute capabilities compare as numbers; an AMD gfx target sorts first (no CUDA CC)."""
    try:
        return float(cc)
    except ValueError:
        return 0.0


def hardware_of(inv: Inventory, count: int | None = None, source: str = "nvml") -> Hardware:
    """The Hardware of this machine's visible GPUs, sized by the one with the least free memory.

    Plans on FREE memory, not the card's size: a co-tenant's memory, the driver's reservation
    and MIG slicing are gone before vLLM starts, and vLLM refuses to start when the memory it
    was told to take is not free.
    """
    usable = [d for d in inv.devices if d.error is None]
    if not usable:
        why = "; ".join(f"GPU {d.label}: {d.error}" for d in inv.devices) or "none visible"
        raise _no_gpu(f"no visible GPU could be read ({why})")
    notes: list[str] = []
    broken = [d for d in inv.devices if d.error is not None]
    if broken:
        notes.append("left out (could not be read): " +
                     "; ".join(f"GPU {d.label} {d.error}" for d in broken))
    if count is None:  # one engine uses one MIG instance: with MIG in view, plan on one
        count = 1 if any(d.mig_parent_uuid for d in usable) else len(usable)
    if count < 1:
        raise InputError(f"GPU count must be at least 1, got {count}")
    if count > len(usable):
        raise InputError(f"asked for {count} GPUs but {len(usable)} usable "
                         f"{'is' if len(usable) == 1 else 'are'} visible; "
                         f"use at most {len(usable)}, or {HOW_TO_PLAN_ANYWAY}")
    chosen = usable[:count]
    if count > 1 and any(d.mig_parent_uuid for d in chosen):
        raise InputError(f"asked for {count} GPUs but the visible ones include MIG instances, "
                         "which one engine cannot combine; use 1, or GPUs with MIG off")
    if chosen[0].mig_parent_uuid:
        notes.append(f"MIG: planning on one instance ({chosen[0].name}, "
                     f"{_gib(chosen[0].total_bytes)}), not the card; one engine uses one")
    limit = min(chosen, key=lambda d: d.free_bytes)
    kind = kind_for_nvml_name(limit.name, limit.total_bytes, limit.compute_capability or None)
    names = sorted({d.name for d in chosen})
    if len(names) > 1:
        kinds = [kind_for_nvml_name(d.name, d.total_bytes, d.compute_capability or None)
                 for d in chosen]
        ccs = [k.compute_capability for k in kinds if k.compute_capability]
        kind = dataclasses.replace(kind, fp8=all(k.fp8 for k in kinds),
                                   fp4=all(k.fp4 for k in kinds),
                                   compute_capability=min(ccs, key=_cc_order) if ccs else None)
        counts = ", ".join(f"{sum(d.name == n for d in chosen)}x {n}" for n in names)
        notes.append(f"mixed GPUs ({counts}): planning on the smallest free memory, GPU "
                     f"{limit.label} ({limit.name}, {_gib(limit.free_bytes)} free), and on the "
                     "features all of them have")
        if source == "nvml" and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            notes.append("set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA numbers mixed GPUs as "
                         "nvidia-smi does")
    for d in chosen:
        if d.processes:
            who = ", ".join(f"pid {p.pid} ({p.name}) {_gib(p.used_bytes)}" for p in d.processes)
            notes.append(f"GPU {d.label} is shared: {who}; planning on its "
                         f"{_gib(d.free_bytes)} free of {_gib(d.total_bytes)}")
    if count > 1:
        ids = [d.index for d in chosen]
        warning = tp_group_warning(usable, ids)
        if warning:
            notes.append(warning)
        kind = dataclasses.replace(kind, nvlink=warning is None)
    return Hardware(kind=kind, nodes=1, gpus_per_node=count, total_bytes=limit.total_bytes,
                    free_bytes=limit.free_bytes, source=source, notes=tuple(notes),
                    devices=tuple(chosen))


