"""What GPUs this process can use, read through NVML (nvidia-ml-py, `import pynvml`).

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
    to plan anyway.
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

import concurrent.futures as cf
import contextlib
import dataclasses
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import InputError
from ..term import fit
from .hardware import GiB, Hardware, kind_for_nvml_name

try:  # nvidia-ml-py is a declared dependency; a broken install still gets the one-line error
    import pynvml
except ImportError:  # pragma: no cover - exercised only on a broken install
    pynvml = None

HOW_TO_PLAN_ANYWAY = "pass --gpus 8xH200, or --gpus cpu for the CPU engine"
DEFAULT_TIMEOUT_S = 5.0

# Errors after which a GPU is unusable whichever call raised them.
_FATAL_CODES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_UNKNOWN",
                "NVML_ERROR_UNINITIALIZED", "NVML_ERROR_TIMEOUT")
# nvidia-smi topo's words for nvmlDeviceGetTopologyCommonAncestor levels.
_TOPOLOGY_NAMES = {0: "INT", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_TOPOLOGY_MEANING = {
    "INT": "the same board", "PIX": "one PCIe switch", "PXB": "several PCIe switches",
    "PHB": "a PCIe host bridge", "NODE": "PCIe within one NUMA node",
    "SYS": "PCIe across CPU sockets",
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
        }


# ---------------------------------------------------------------------------------------------
# The module-level NVML session: handles and static facts, read once.


@dataclass
class _Mig:
    slot: int
    handle: object
    uuid: str
    name: str


@dataclass
class _GPU:
    """Static facts of one physical GPU, cached for the NVML session."""

    index: int
    handle: object = None
    uuid: str = ""
    name: str = ""
    cc: str = ""
    bus_id: str | None = None
    mig_enabled: bool = False
    mig_pending: bool | None = None
    migs: list[_Mig] = field(default_factory=list)
    links: list[tuple[str, int]] = field(default_factory=list)  # (remote bus id, remote type)
    ready: bool = False  # static facts read
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    mem_v2: bool = True  # False once the driver answered v2 with an error


class _DaemonPool:
    """Worker threads for NVML calls that never keep the interpreter from exiting.

    concurrent.futures' pool joins its (non-daemon) workers at exit, so one NVML call that
    never returns would hang `vlaunch` on the way out. These are daemon threads; a new one
    starts when none is idle, so a stuck call costs one thread, never the next reading.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._workers = 0

    def submit(self, fn) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._idle == 0:
                self._workers += 1
                threading.Thread(target=self._work, name=f"vlaunch-nvml-{self._workers}",
                                 daemon=True).start()
            else:
                self._idle -= 1
        self._queue.put((fut, fn))
        return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the waiting reader
                    fut.set_exception(e)
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Ask every worker to end (a stuck one ends when its call returns)."""
        with self._lock:
            n, self._workers, self._idle = self._workers, 0, 0
        for _ in range(n):
            self._queue.put(None)


@dataclass
class _Session:
    driver_version: str = ""
    cuda_driver_version: str = ""
    gpus: list[_GPU] = field(default_factory=list)
    topology: dict[tuple[int, int], str] = field(default_factory=dict)
    pool: _DaemonPool | None = None
    stuck: dict[object, float] = field(default_factory=dict)  # key -> since (monotonic)
    notes: list[str] = field(default_factory=list)


_lock = threading.Lock()
_session: _Session | None = None
_init_thread: threading.Thread | None = None


def shutdown() -> None:
    """Forget the cached handles and shut NVML down (the next read initialises again)."""
    global _session
    with _lock:
        s, _session = _session, None
    if s is None:
        return
    if s.pool is not None:
        s.pool.shutdown()
    with contextlib.suppress(Exception):  # shutting down must not fail the caller
        pynvml.nvmlShutdown()


def _err(e: BaseException) -> str:
    """`Not Supported`-style text for an NVML error, the message otherwise."""
    try:
        return str(e) or type(e).__name__
    except Exception:  # noqa: BLE001 - NVMLError.__str__ may itself call NVML
        return type(e).__name__


def _code(e: BaseException) -> int | None:
    return getattr(e, "value", None) if pynvml and isinstance(e, pynvml.NVMLError) else None


def _is(e: BaseException, *names: str) -> bool:
    code = _code(e)
    return code is not None and any(code == getattr(pynvml, n, object()) for n in names)


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


def _no_gpu(why: str) -> InputError:
    return NoGPUError(why)


def _init_message(e: BaseException) -> str:
    if _is(e, "NVML_ERROR_LIBRARY_NOT_FOUND"):
        return "the NVML library (libnvidia-ml.so.1) is not installed"
    if _is(e, "NVML_ERROR_DRIVER_NOT_LOADED"):
        return "the NVIDIA driver is not loaded"
    if _is(e, "NVML_ERROR_NO_PERMISSION"):
        return "no permission to open the NVIDIA devices"
    if _is(e, "NVML_ERROR_LIB_RM_VERSION_MISMATCH"):
        return "the NVML library and the loaded driver differ in version (reboot or reload)"
    return f"NVML did not start ({_err(e)})"


def _run(pool: _DaemonPool, s: _Session, key: object, fn):
    """Submit `fn` unless its previous run is stuck; returns a future or an error string."""
    if key in s.stuck:
        since = time.monotonic() - s.stuck[key]
        return f"NVML has not answered for {since:.0f} s"
    fut = pool.submit(fn)

    def _done(_f, key=key):
        s.stuck.pop(key, None)

    fut.add_done_callback(_done)
    return fut


def _await(s: _Session, key: object, fut, deadline: float):
    """(result, None) or (None, error text); marks `key` stuck when the deadline passes."""
    if isinstance(fut, str):
        return None, fut
    try:
        return fut.result(timeout=max(0.0, deadline - time.monotonic())), None
    except cf.TimeoutError:
        s.stuck.setdefault(key, time.monotonic())
        if fut.done():  # finished between the timeout and now
            s.stuck.pop(key, None)
            return _await(s, key, fut, deadline)
        return None, "NVML did not answer in time"
    except Exception as e:  # noqa: BLE001 - recorded, never raised
        return None, _err(e)


def _start(timeout_s: float) -> _Session:
    """Initialise NVML once (under the deadline) and read the system-wide facts."""
    global _session
    if pynvml is None:
        raise _no_gpu("the nvidia-ml-py package is not installed")
    if _session is not None:
        return _session

    def init() -> _Session:
        pynvml.nvmlInit()
        try:
            return facts()
        except BaseException:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            raise

    def facts() -> _Session:
        s = _Session()
        try:
            s.driver_version = str(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as e:
            s.notes.append(f"driver version: {_err(e)}")
        try:
            v = int(pynvml.nvmlSystemGetCudaDriverVersion())
            s.cuda_driver_version = f"{v // 1000}.{(v % 1000) // 10}"
        except pynvml.NVMLError as e:
            s.notes.append(f"CUDA driver version: {_err(e)}")
        s.gpus = [_GPU(index=i) for i in range(int(pynvml.nvmlDeviceGetCount()))]
        return s

    global _init_thread
    if _init_thread is not None and _init_thread.is_alive():
        raise _no_gpu("NVML is still starting from an earlier call (driver busy or hung)")
    box: dict = {}

    def target() -> None:
        try:
            box["s"] = init()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["e"] = e

    t = threading.Thread(target=target, name="vlaunch-nvml-init", daemon=True)
    t.start()
    _init_thread = t
    t.join(timeout_s)
    if t.is_alive():
        raise _no_gpu(f"NVML did not start within {timeout_s:g} s (driver busy or hung)")
    if "e" in box:
        e = box["e"]
        if pynvml is not None and isinstance(e, pynvml.NVMLError):
            raise _no_gpu(_init_message(e)) from None
        raise _no_gpu(f"NVML did not start ({_err(e)})") from None
    s = box["s"]
    s.pool = _DaemonPool()
    _session = s
    return s


def _read_static(g: _GPU) -> None:
    """Handle, identity, MIG layout and NVLink links of one GPU: facts that do not change."""
    g.handle = pynvml.nvmlDeviceGetHandleByIndex(g.index)
    g.uuid = str(pynvml.nvmlDeviceGetUUID(g.handle))
    g.name = str(pynvml.nvmlDeviceGetName(g.handle))
    g.notes = []
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(g.handle)
        g.cc = f"{major}.{minor}"
    except pynvml.NVMLError as e:
        _optional(g, "compute capability", e)
    try:
        g.bus_id = _bus_id(pynvml.nvmlDeviceGetPciInfo(g.handle))
    except pynvml.NVMLError as e:
        _optional(g, "PCI info", e)
    g.mig_enabled, g.migs = False, []
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(g.handle)
        g.mig_enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
        g.mig_pending = pending == pynvml.NVML_DEVICE_MIG_ENABLE
        if g.mig_pending != g.mig_enabled:
            g.notes.append(f"GPU {g.index}: MIG mode change pending until the GPU is reset")
    except pynvml.NVMLError as e:
        if not _is(e, "NVML_ERROR_NOT_SUPPORTED"):
            _optional(g, "MIG mode", e)
    if g.mig_enabled:
        g.migs = _read_migs(g)
    g.links = [] if g.mig_enabled else _read_links(g)
    g.ready, g.error = True, None


def _read_migs(g: _GPU) -> list[_Mig]:
    """The MIG instances of a GPU in MIG mode; empty slots answer NOT_FOUND."""
    migs = []
    for slot in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(g.handle))):
        try:
            h = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(g.handle, slot)
        except pynvml.NVMLError as e:
            if _is(e, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                continue
            raise
        migs.append(_Mig(slot=slot, handle=h, uuid=str(pynvml.nvmlDeviceGetUUID(h)),
                         name=str(pynvml.nvmlDeviceGetName(h))))
    if not migs:
        g.notes.append(f"GPU {g.index} has MIG on but no MIG instances: create some "
                       "(nvidia-smi mig -cgi ... -C) or turn MIG off")
    return migs


def _read_links(g: _GPU) -> list[tuple[str, int]]:
    """Active NVLink links: (remote PCI bus id, remote device type) per link."""
    links = []
    for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if not pynvml.nvmlDeviceGetNvLinkState(g.handle, link):
                continue
        except pynvml.NVMLError as e:
            if _is(e, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                break  # no NVLink, or past this GPU's last link
            if _fatal(e):
                raise
            _optional(g, f"NVLink {link} state", e)
            continue
        try:
            remote = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(g.handle, link))
        except pynvml.NVMLError as e:
            if _fatal(e):
                raise
            _optional(g, f"NVLink {link} remote", e)
            continue
        try:
            kind = int(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(g.handle, link))
        except pynvml.NVMLError:
            kind = pynvml.NVML_NVLINK_DEVICE_TYPE_UNKNOWN
        links.append((remote, kind))
    return links


def _bus_id(pci) -> str:
    """Normalised PCI bus id: NVML pads the domain to 8 digits in some places, 4 in others."""
    raw = pci.busId
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    text = text.rstrip("\x00").strip().lower()
    domain, _, rest = text.partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest and domain else text


def _fatal(e: BaseException) -> bool:
    return _is(e, *_FATAL_CODES)


def _optional(g: _GPU, what: str, e: BaseException) -> None:
    if _fatal(e):
        raise e
    g.notes.append(f"GPU {g.index}: {what}: {_err(e)}")


def _memory(handle, g: _GPU) -> tuple[int, int, int, int]:
    """(total, free, used, reserved): v2 splits out driver-reserved memory where it can."""
    if g.mem_v2 and hasattr(pynvml, "nvmlMemory_v2"):
        try:
            m = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            return int(m.total), int(m.free), int(m.used), int(m.reserved)
        except pynvml.NVMLError as e:
            if _fatal(e):
                raise
            g.mem_v2 = False  # old driver or not on this handle: v1 from now on
    m = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return int(m.total), int(m.free), int(m.used), 0


def _processes(handle, where: str, errors: list[str]) -> list[Process]:
    try:
        raw = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError as e:
        if _fatal(e):
            raise
        if not _is(e, "NVML_ERROR_NOT_SUPPORTED"):
            errors.append(f"{where}: processes: {_err(e)}")
        return []
    procs = []
    for p in raw:
        try:
            name = str(pynvml.nvmlSystemGetProcessName(p.pid))
        except pynvml.NVMLError:
            name = ""  # gone, or in another PID namespace
        used = getattr(p, "usedGpuMemory", None)
        procs.append(Process(pid=int(p.pid), name=name or f"pid {p.pid}",
                             used_bytes=None if used is None else int(used)))
    return procs


def _read_dynamic(g: _GPU, mig: _Mig | None) -> tuple[Device, list[str]]:
    """Memory and processes of one GPU or MIG instance: read on every call."""
    errors: list[str] = []
    handle = g.handle if mig is None else mig.handle
    dev = Device(index=g.index, uuid=g.uuid if mig is None else mig.uuid,
                 name=g.name if mig is None else mig.name, compute_capability=g.cc,
                 mig_enabled=g.mig_enabled, mig_parent_uuid=None if mig is None else g.uuid,
                 mig_index=None if mig is None else mig.slot, bus_id=g.bus_id)
    where = f"GPU {dev.label}"
    try:
        dev.total_bytes, dev.free_bytes, dev.used_bytes, dev.reserved_bytes = _memory(handle, g)
        dev.processes = _processes(handle, where, errors)
    except pynvml.NVMLError as e:
        dev.error = _err(e)
    return dev, errors


# ---------------------------------------------------------------------------------------------
# Visibility: which devices this process (and the engine it starts) may use.


def _units(gpus: list[_GPU]) -> list[tuple[_GPU, _Mig | None]]:
    out: list[tuple[_GPU, _Mig | None]] = []
    for g in gpus:
        if g.ready and g.mig_enabled:
            out.extend((g, m) for m in g.migs)
        else:
            out.append((g, None))
    return out


def _match(token: str, units, gpus: list[_GPU], *, prefix: bool):
    """The units one visibility entry names, or None when it names nothing."""
    t = token.strip()
    low = t.lower()
    if low.startswith("gpu-"):
        hits = [g for g in gpus if g.uuid and (g.uuid.lower() == low or
                                               (prefix and g.uuid.lower().startswith(low)))]
        if len(hits) != 1:
            return None
        return [u for u in units if u[0] is hits[0]]
    if low.startswith("mig-"):
        hits = [u for u in units if u[1] is not None and (
            u[1].uuid.lower() == low or (prefix and u[1].uuid.lower().startswith(low)))]
        return hits if len(hits) == 1 else None
    gi, sep, mi = t.partition(":")
    if not gi.isdigit() or (sep and not mi.isdigit()):
        return None
    hits = [u for u in units if u[0].index == int(gi) and (not sep or (u[1] is not None and
                                                                        u[1].slot == int(mi)))]
    return hits or None


def _apply_visibility(gpus: list[_GPU], notes: list[str]):
    """(units in CUDA order, restricting variable or None)."""
    units = _units(gpus)
    restricted: list[str] = []
    nv = os.environ.get("NVIDIA_VISIBLE_DEVICES")
    if nv is not None:
        value = nv.strip()
        if value.lower() in ("", "none", "void"):
            return [], f"NVIDIA_VISIBLE_DEVICES={nv}"
        if value.lower() != "all":
            tokens = [t for t in value.split(",") if t.strip()]
            if all(t.strip().isdigit() for t in tokens) and len(tokens) == len(gpus):
                pass  # the container runtime already mounted exactly these, renumbered from 0
            else:
                keep = []
                for t in tokens:
                    hits = _match(t, units, gpus, prefix=False)
                    if hits is None:
                        notes.append(f"NVIDIA_VISIBLE_DEVICES entry '{t.strip()}' matches no GPU")
                        continue
                    keep.extend(u for u in hits if u not in keep)
                units = keep
                restricted.append(f"NVIDIA_VISIBLE_DEVICES={nv}")
    cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda is not None:
        restricted.append(f"CUDA_VISIBLE_DEVICES={cuda}")
        ordered: list = []
        for t in cuda.split(","):
            hits = _match(t, units, gpus, prefix=True) if t.strip() else None
            if hits is None:
                if t.strip():
                    notes.append(f"CUDA_VISIBLE_DEVICES entry '{t.strip()}' matches no visible "
                                 "GPU; CUDA ignores it and every entry after it")
                break
            ordered.extend(u for u in hits if u not in ordered)
        units = ordered
    return units, " ".join(restricted) or None


# ---------------------------------------------------------------------------------------------
# Reading.


def read_inventory(timeout_s: float = DEFAULT_TIMEOUT_S, refresh: bool = False) -> Inventory:
    """Read every visible GPU now. See the module docstring for what is read and how."""
    with _lock:
        s = _start(timeout_s)
        deadline = time.monotonic() + timeout_s
        pool = s.pool
        # 1. Static facts, once per GPU (again for a GPU whose facts could not be read).
        todo = [g for g in s.gpus if refresh or not g.ready]
        futs = {g.index: _run(pool, s, ("static", g.index), lambda g=g: _read_static(g))
                for g in todo}
        for g in todo:
            _, error = _await(s, ("static", g.index), futs[g.index], deadline)
            if error is not None:
                g.ready, g.error = False, error
        if refresh:
            s.topology.clear()
        # 2. Visibility, then memory and processes of the visible devices only.
        errors = list(s.notes)
        units, visibility = _apply_visibility(s.gpus, errors)
        shown = {g.index for g, _ in units}
        for g in s.gpus:  # what NVML said about a GPU, unless the user hid that GPU
            if visibility is None or g.index in shown:
                errors.extend(g.notes)
        hidden = len(_units(s.gpus)) - len(units)
        dyn = {}
        for g, m in units:
            key = ("dyn", g.index, None if m is None else m.slot)
            if g.ready:
                dyn[key] = _run(pool, s, key, lambda g=g, m=m: _read_dynamic(g, m))
        devices: list[Device] = []
        for cuda_index, (g, m) in enumerate(units):
            key = ("dyn", g.index, None if m is None else m.slot)
            if not g.ready:
                dev = Device(index=g.index, uuid=g.uuid, name=g.name or "unknown GPU",
                             error=g.error or "not read")
            else:
                result, error = _await(s, key, dyn[key], deadline)
                if result is None:
                    dev = _unread(g, m, error)
                else:
                    dev, errs = result
                    errors.extend(errs)
            dev.cuda_index = cuda_index
            if dev.error:
                errors.append(f"GPU {dev.label}: {dev.error}")
            devices.append(dev)
        _connect(s, devices, deadline, errors)
    if not s.gpus:
        raise _no_gpu("NVML sees no GPU on this machine")
    if not devices:
        if visibility:
            raise _no_gpu(f"{visibility} hides all {len(_units(s.gpus))} devices")
        raise _no_gpu("; ".join(errors) or "NVML shows no usable device")
    return Inventory(driver_version=s.driver_version, cuda_driver_version=s.cuda_driver_version,
                     devices=devices, errors=errors, hidden=hidden, visibility=visibility)


def _unread(g: _GPU, m: _Mig | None, error: str | None) -> Device:
    return Device(index=g.index, uuid=g.uuid if m is None else m.uuid,
                  name=g.name if m is None else m.name, compute_capability=g.cc,
                  mig_enabled=g.mig_enabled, mig_parent_uuid=None if m is None else g.uuid,
                  mig_index=None if m is None else m.slot, bus_id=g.bus_id,
                  error=error or "not read")


def _connect(s: _Session, devices: list[Device], deadline: float, errors: list[str]) -> None:
    """Fill nvlink_peers and topology between the visible whole GPUs.

    A link whose far end is another GPU's bus id joins the two; a link to an NVSwitch puts the
    GPU on the node's switch fabric, where every GPU reaches every other (HGX boards). Pairs
    without NVLink get NVML's PCIe common ancestor, read once and cached.
    """
    whole = [d for d in devices if d.mig_index is None and d.error is None]
    by_index = {g.index: g for g in s.gpus}
    switch = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    on_fabric = {d.index for d in whole
                 if any(kind == switch for _, kind in by_index[d.index].links)}
    pcie_pairs = []
    for a, b in itertools.combinations(whole, 2):
        ga, gb = by_index[a.index], by_index[b.index]
        direct = (any(bus == b.bus_id for bus, _ in ga.links) or
                  any(bus == a.bus_id for bus, _ in gb.links))
        if direct or (a.index in on_fabric and b.index in on_fabric):
            a.topology[b.index] = b.topology[a.index] = "NV"
        elif (a.index, b.index) in s.topology:
            a.topology[b.index] = b.topology[a.index] = s.topology[(a.index, b.index)]
        else:
            pcie_pairs.append((a, b))
    if pcie_pairs:
        def read_levels() -> dict[tuple[int, int], str]:
            out = {}
            for a, b in pcie_pairs:
                try:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(
                        by_index[a.index].handle, by_index[b.index].handle)
                    out[(a.index, b.index)] = _TOPOLOGY_NAMES.get(int(level), f"L{level}")
                except pynvml.NVMLError as e:
                    errors.append(f"GPU {a.index}-{b.index}: topology: {_err(e)}")
            return out

        fut = _run(s.pool, s, ("topology",), read_levels)
        levels, error = _await(s, ("topology",), fut, deadline)
        if error is not None:
            errors.append(f"topology: {error}")
        for (i, j), level in (levels or {}).items():
            s.topology[(i, j)] = level
            for a, b in pcie_pairs:
                if (a.index, b.index) == (i, j):
                    a.topology[j], b.topology[i] = level, level
    for d in whole:
        d.nvlink_peers = sorted(k for k, v in d.topology.items() if v == "NV")


# ---------------------------------------------------------------------------------------------
# From an inventory to the Hardware the planner plans on.


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


def detect_hardware(inv: Inventory | None = None, count: int | None = None) -> Hardware:
    """The Hardware of this machine's visible GPUs, sized by the one with the least free memory.

    Plans on FREE memory, not the card's size: a co-tenant's memory, the driver's reservation
    and MIG slicing are gone before vLLM starts, and vLLM refuses to start when the memory it
    was told to take is not free.
    """
    inv = inv if inv is not None else read_inventory()
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
                                   compute_capability=min(ccs, key=float) if ccs else None)
        counts = ", ".join(f"{sum(d.name == n for d in chosen)}x {n}" for n in names)
        notes.append(f"mixed GPUs ({counts}): planning on the smallest free memory, GPU "
                     f"{limit.label} ({limit.name}, {_gib(limit.free_bytes)} free), and on the "
                     "features all of them have")
        if os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
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
                    free_bytes=limit.free_bytes, source="nvml", notes=tuple(notes),
                    devices=tuple(chosen))


# ---------------------------------------------------------------------------------------------
# `vlaunch gpus`: the table.

_BAR_WIDTH = 20


def _ranges(ids: list[int]) -> str:
    """`0-2,4-7`: peers of a GPU on an 8-GPU board fit in a column."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(ids)), key=lambda p: p[1] - p[0]):
        nums = [n for _, n in run]
        out.append(str(nums[0]) if len(nums) == 1 else f"{nums[0]}-{nums[-1]}")
    return ",".join(out) or "-"


def _bar(d: Device, color: bool) -> str:
    taken = (d.total_bytes - d.free_bytes) / d.total_bytes if d.total_bytes else 0.0
    n = min(_BAR_WIDTH, round(taken * _BAR_WIDTH))
    if taken > 0 and n == 0:
        n = 1
    fill = "#" * n
    if color:
        import click  # only the CLI asks for colour

        fill = click.style(fill, fg="green" if taken < 0.5 else "yellow" if taken < 0.8 else "red")
    return f"[{fill}{'.' * (_BAR_WIDTH - n)}]"


def render_table(inv: Inventory, color: bool = False, width: int | None = None) -> str:
    """The `vlaunch gpus` text: one row per device, problems listed under the table.

    With `width` (the terminal's, launcher.term) a row that would run past it lists its
    processes as a count and their total memory instead of one by one, so the columns stay
    aligned; the problems under the table wrap with a hanging indent."""
    def g(n: int) -> str:
        return f"{n / GiB:.1f}"

    head = ["GPU", "NAME", "GiB used/free/total", "CC", "MIG", "PROCESSES", "NVLINK"]
    rows = []
    bars = []
    listed: list[str] = []
    for d in inv.devices:
        name = d.name.replace("NVIDIA ", "")
        if d.error:
            rows.append([d.label, name, f"error: {d.error}", d.compute_capability or "-", "-",
                         "-", "-"])
            bars.append(" " * (_BAR_WIDTH + 2))
            listed.append("-")
            continue
        procs = ", ".join(f"{p.pid} {p.name} {_gib(p.used_bytes)}" for p in d.processes) or "-"
        listed.append(f"{len(d.processes)} processes, "
                      f"{_gib(sum(p.used_bytes for p in d.processes))}"
                      if len(d.processes) > 1 else procs)
        mem = f"{g(d.total_bytes - d.free_bytes)}/{g(d.free_bytes)}/{g(d.total_bytes)}"
        rows.append([d.label, name, mem, d.compute_capability or "-",
                     "on" if d.mig_enabled else "off", procs,
                     "-" if d.mig_index is not None else _ranges(d.nvlink_peers)])
        bars.append(_bar(d, color))

    def widths_of(rs: list[list[str]]) -> list[int]:
        return [max(len(r[i]) for r in [head, *rs]) for i in range(len(head))]

    def too_wide(ws: list[int], bar: bool) -> bool:
        return width is not None and sum(ws) + 2 * (len(ws) - 1) + (_BAR_WIDTH + 4) * bar > width

    widths = widths_of(rows)
    if too_wide(widths, True):  # first the process lists, then the bar, give way
        for r, short in zip(rows, listed, strict=True):
            if len(r[5]) > len(short):
                r[5] = short
        widths = widths_of(rows)
    show_bar = not too_wide(widths, True)

    def line(cells: list[str], bar: str) -> str:
        parts = [c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        if show_bar:
            parts.insert(2, bar)  # the bar is always _BAR_WIDTH + 2 visible characters
        return "  ".join(parts).rstrip()

    seen = f"{len(inv.devices)} device{'s' if len(inv.devices) != 1 else ''}"
    if inv.hidden:
        seen += f" ({inv.hidden} hidden by {inv.visibility})"
    elif inv.visibility:
        seen += f" ({inv.visibility})"
    out = [f"driver {inv.driver_version or '?'}  CUDA {inv.cuda_driver_version or '?'}  {seen}",
           line(head, "USE".ljust(_BAR_WIDTH + 2))]
    out += [line(r, b) for r, b in zip(rows, bars, strict=True)]
    notes = [f"! {e}" for e in inv.errors]
    out += fit(notes, width) if width is not None else notes
    return "\n".join(out)
