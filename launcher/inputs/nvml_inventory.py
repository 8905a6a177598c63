"""NVIDIA GPUs read through NVML (nvidia-ml-py, `import pynvml`): the backend of
`launcher.inputs.inventory` for NVIDIA cards (amd_inventory.py is AMD's).

The planner needs the memory that is FREE now on the GPUs the engine will see, not the catalog
size: other tenants, MIG slicing and `CUDA_VISIBLE_DEVICES` all change it. The exporter polls
the same reading, so NVML is initialised once and its handles are kept in a module-level cache.
What one reading holds, and how visibility is applied, is described in inventory.py.

A call that fails for one GPU is recorded in that Device's ``error`` (the GPU is unusable) or,
for an optional fact (processes, NVLink, reserved memory), in ``Inventory.errors``; the other
GPUs are still read. The whole reading runs on worker threads under ``timeout_s``: a GPU that
does not answer in time is recorded as such and is not asked again until its stuck call
returns. Static facts (names, UUIDs, MIG layout, NVLink links, PCIe topology) are read once per
NVML session; ``shutdown()`` or ``refresh=True`` reads them again.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from .devices import Device, Inventory, NoGPUError, Process

try:  # nvidia-ml-py is a declared dependency; a broken install still gets the one-line error
    import pynvml
except ImportError:  # pragma: no cover - exercised only on a broken install
    pynvml = None

DEFAULT_TIMEOUT_S = 5.0

# Errors after which a GPU is unusable whichever call raised them.
_FATAL_CODES = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_UNKNOWN",
                "NVML_ERROR_UNINITIALIZED", "NVML_ERROR_TIMEOUT")
# nvidia-smi topo's words for nvmlDeviceGetTopologyCommonAncestor levels.
_TOPOLOGY_NAMES = {0: "INT", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

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



def _no_gpu(why: str) -> NoGPUError:
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


def read_nvml(timeout_s: float = DEFAULT_TIMEOUT_S, refresh: bool = False) -> Inventory:
    """Read every visible NVIDIA GPU now (inventory.read_inventory says what is read)."""
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
