"""The GPUs' memory as the exporter publishes it, read through a `gpu_reader` callable.

Why a callable: the exporter must not care how devices are read (NVML through
`launcher.inputs.inventory` by default, a fake in tests and the bench), and a machine without
NVML must give no GPU series at all rather than an error on every scrape.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 2.0  # one NVML read, as long as one fetch of vLLM's page


@dataclass(frozen=True)
class GpuRecord:
    """One GPU's memory as the exporter publishes it (bytes)."""

    index: int
    uuid: str
    used_bytes: int
    free_bytes: int
    total_bytes: int



GpuReader = Callable[[], Iterable[Any]]

_FIELD_NAMES = {
    "index": ("index", "gpu", "minor"),
    "uuid": ("uuid",),
    "used_bytes": ("used_bytes", "memory_used_bytes", "used"),
    "free_bytes": ("free_bytes", "memory_free_bytes", "free"),
    "total_bytes": ("total_bytes", "memory_total_bytes", "total"),
}


def _field(record: Any, key: str) -> Any:
    for name in _FIELD_NAMES[key]:
        value = record.get(name) if isinstance(record, Mapping) else getattr(record, name, None)
        if value is not None:
            return value
    return None


def to_gpu_record(record: Any) -> GpuRecord:
    """Normalise one device record (dict or object) from a gpu_reader; ValueError if unusable.

    Accepts the field spellings inventory modules commonly use, so the exporter does not have to
    change when the inventory's record type does.
    """
    values = {k: _field(record, k) for k in _FIELD_NAMES}
    if values["total_bytes"] is None or values["index"] is None:
        raise ValueError(f"GPU record without index/total memory: {record!r}")
    total = int(values["total_bytes"])
    used, free = values["used_bytes"], values["free_bytes"]
    used = int(used) if used is not None else total - int(free or 0)
    free = int(free) if free is not None else total - used
    return GpuRecord(int(values["index"]), str(values["uuid"] or ""), used, free, total)


def default_gpu_reader() -> GpuReader | None:
    """NVML through `launcher.inputs.inventory.read_inventory`, or None where that does not work.

    Probed once: on a machine without NVML there are no GPU series at all rather than an error
    counted on every scrape. Devices the inventory could not read (`error` set) are left out:
    their memory numbers would be zeros, not measurements.
    """
    try:
        read = importlib.import_module("..inputs.inventory", __package__).read_inventory
    except (ImportError, AttributeError):
        return None

    def reader() -> Iterable[Any]:
        result = read(timeout_s=DEFAULT_TIMEOUT_S)
        devices = getattr(result, "devices", None)
        if devices is None and isinstance(result, Mapping):
            devices = result.get("devices")
        devices = result if devices is None else devices
        return [d for d in devices if not _field_or_none(d, "error")]

    try:
        records = [to_gpu_record(r) for r in reader()]
    except Exception:  # NVML missing or failing in any of its many ways: no GPU metrics
        return None
    return reader if records else None


def _field_or_none(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, Mapping) else getattr(record, name, None)

