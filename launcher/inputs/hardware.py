"""Hardware the planner plans for: the GPU catalog and `--gpus SPEC`.

The catalog is data (`profiles/gpus.yaml`); a spec like `2x8xH100` or `4x24GiB` becomes a
`Hardware` with the memory NVML would report. The inventory module builds the same object
from real NVML readings, so the planner never knows where its numbers came from.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field

from ..errors import InputError
from ..paths import profiles_dir, read_yaml

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ShapePrice:
    """A list price per GPU-hour for one replica shape (`gpus` GPUs), as its source sells it."""

    gpus: int
    usd_per_hour: float
    source: str
    date: str

    def describe(self) -> str:
        return f"list price, {self.source} ({self.date})"


@dataclass(frozen=True)
class GPUKind:
    """One catalog entry: what a card of this kind is, not how much of it is free."""

    name: str
    total_bytes: int
    compute_capability: str | None
    platform: str = "cuda"  # cuda | rocm | cpu
    fp8: bool = False
    fp4: bool = False
    nvlink: bool = False
    nvml_names: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    hbm_gbps: float | None = None  # peak memory bandwidth, GB/s
    bf16_tflops: float | None = None  # dense peak
    fp8_tflops: float | None = None  # dense peak; None: no native FP8 math
    nvlink_gbps: float | None = None  # per GPU, one direction; None: PCIe only
    network_gbps: float | None = None  # scale-out per GPU, for multi-node layouts
    datacenter: bool = False
    node_sizes: tuple[int, ...] = (1, 2, 4, 8)  # GPUs per node as sold (catalog `node.sizes`)
    nvlink_domain: int = 1  # GPUs sharing one NVLink/xGMI fabric (72 in an NVL72 rack)
    gemm_m_half: float | None = None  # rows where GEMMs reach half speed; None: perf default
    prices: tuple[ShapePrice, ...] = ()
    cuda_total_bytes: int | None = None  # what torch.cuda.mem_get_info reports as total

    @property
    def max_per_node(self) -> int:
        """GPUs one node (server or tray) holds; more needs NODESxCOUNT."""
        return max(self.node_sizes)

    def price_for(self, gpus: int) -> ShapePrice | None:
        """The catalog's list price for a replica of `gpus` GPUs: the row for that shape, else
        (a multi-node replica of whole priced nodes) the row for one such node."""
        rows = {p.gpus: p for p in self.prices}
        if gpus in rows:
            return rows[gpus]
        whole = [n for n in rows if n == self.max_per_node and gpus % n == 0]
        return rows[whole[0]] if whole else None

    def replica_shapes(self) -> list[str]:
        """The `--gpus` specs one can rent for a replica: each node size; for an NVLink domain
        wider than a node (NVL72 trays), 1, 2, 4, 8 and 16 nodes of the largest size (the
        domain's 18 trays hold 72: a 16-tray replica is the largest power of two)."""
        out = [f"{n}x{self.name}" for n in sorted(self.node_sizes)]
        per = self.max_per_node
        if self.nvlink_domain > per:
            out += [f"{k}x{per}x{self.name}" for k in (2, 4, 8, 16)
                    if k * per <= self.nvlink_domain]
        return out

    @property
    def cc(self) -> float | None:
        """Compute capability as a number (9.0), None for CPU/ROCm targets."""
        try:
            return float(self.compute_capability) if self.compute_capability else None
        except ValueError:
            return None


@dataclass(frozen=True)
class Hardware:
    """What the plan runs on. Memory figures are per GPU, for the GPU that limits."""

    kind: GPUKind
    nodes: int
    gpus_per_node: int
    total_bytes: int
    free_bytes: int
    source: str = "spec"  # spec | nvml | amdsmi | system
    notes: tuple[str, ...] = field(default=())
    devices: tuple = field(default=())  # inventory devices, when read through NVML
    cuda_total_bytes: int | None = None  # CUDA's total when a log says it (else derived)

    @property
    def budget_total(self) -> int:
        """The total vLLM multiplies by --gpu-memory-utilization: CUDA's (torch.cuda.
        mem_get_info, v1/worker/utils.py request_memory), a little below NVML's total on NVIDIA
        cards (H100: 79.18 vs 79.65 GiB). ROCm and the CPU engine report one total."""
        if self.cuda_total_bytes:
            return self.cuda_total_bytes
        if self.kind.platform != "cuda":
            return self.total_bytes
        if self.kind.cuda_total_bytes and self.total_bytes == self.kind.total_bytes:
            return self.kind.cuda_total_bytes
        return round(self.total_bytes * (1 - cuda_reserved_fraction()))

    @property
    def count(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def is_cpu(self) -> bool:
        return self.kind.platform == "cpu"

    def describe(self) -> str:
        layout = f"{self.gpus_per_node}x{self.kind.name}"
        if self.nodes > 1:
            layout = f"{self.nodes}x{layout}"
        if self.is_cpu:
            layout = "cpu"
        total, free = self.total_bytes / GiB, self.free_bytes / GiB
        return f"{layout} ({total:.2f} GiB each, {free:.2f} GiB free)"


@functools.lru_cache(maxsize=1)
def catalog() -> dict[str, GPUKind]:
    """The GPU catalog keyed by upper-cased name and aliases."""
    path = profiles_dir() / "gpus.yaml"
    data = read_yaml(path)
    kinds: dict[str, GPUKind] = {}
    for name, row in data["gpus"].items():
        kind = GPUKind(
            name=name,
            total_bytes=int(row["total_mib"]) * MiB,
            compute_capability=str(row.get("compute_capability") or "") or None,
            platform=row.get("platform", "cuda"),
            fp8=bool(row.get("fp8")),
            fp4=bool(row.get("fp4")),
            nvlink=bool(row.get("nvlink")),
            nvml_names=tuple(row.get("nvml_names") or ()),
            aliases=tuple(row.get("aliases") or ()),
            **_perf_fields(row),
        )
        for key in (name, *kind.aliases):
            kinds[_key(key)] = kind
    return kinds


def _perf_fields(row: dict) -> dict:
    """The catalog's speed and price facts (absent for cards known only by size)."""
    out: dict = {k: (float(row[k]) if row.get(k) is not None else None)
                 for k in ("hbm_gbps", "bf16_tflops", "fp8_tflops", "nvlink_gbps",
                           "network_gbps")}
    out["datacenter"] = bool(row.get("datacenter"))
    if row.get("gemm_m_half"):
        out["gemm_m_half"] = float(row["gemm_m_half"])
    if row.get("node"):
        out["node_sizes"] = tuple(sorted(int(n) for n in row["node"]["sizes"]))
        out["nvlink_domain"] = int(row["node"]["nvlink_domain"])
    if row.get("cuda_total_mib"):
        out["cuda_total_bytes"] = int(row["cuda_total_mib"]) * MiB
    out["prices"] = tuple(ShapePrice(int(p["gpus"]), float(p["usd_per_hour"]), str(p["source"]),
                                     str(p["date"])) for p in row.get("prices") or ())
    return out


@functools.lru_cache(maxsize=1)
def cuda_reserved_fraction() -> float:
    """Share of NVML's total that CUDA does not report (profiles/gpus.yaml), for NVIDIA cards
    whose CUDA total no log has shown."""
    data = read_yaml(profiles_dir() / "gpus.yaml")
    return float(data.get("cuda_reserved_fraction") or 0.0)


@functools.lru_cache(maxsize=1)
def cpu_engine_row() -> dict:
    """The CPU engine's rough speed facts (profiles/gpus.yaml, cpu_engine)."""
    data = read_yaml(profiles_dir() / "gpus.yaml")
    return dict(data.get("cpu_engine") or {})


def kinds() -> list[GPUKind]:
    """Each catalog GPU once, in file order."""
    seen: dict[str, GPUKind] = {}
    for kind in catalog().values():
        seen.setdefault(kind.name, kind)
    return list(seen.values())


def _key(name: str) -> str:
    return re.sub(r"[\s_-]", "", name.upper())


def gpu_kind(name: str) -> GPUKind:
    """Look a GPU up by catalog name or alias, case-insensitively."""
    kind = catalog().get(_key(name))
    if kind is None:
        names = sorted({k.name for k in catalog().values()})
        raise InputError(f"unknown GPU '{name}'; known: {', '.join(names)}, cpu, "
                         "or a size like 24GiB")
    return kind


def kind_for_nvml_name(nvml_name: str, total_bytes: int, cc: str | None) -> GPUKind:
    """The catalog entry NVML's device name matches, or an ad-hoc kind built from the reading."""
    for kind in catalog().values():
        if nvml_name in kind.nvml_names:
            return kind
    short = nvml_name.replace("NVIDIA ", "").replace("GeForce ", "")
    return GPUKind(name=short, total_bytes=total_bytes, compute_capability=cc,
                   fp8=bool(cc and _cc_at_least(cc, 8.9)), nvml_names=(nvml_name,))


def _cc_at_least(cc: str, value: float) -> bool:
    try:
        return float(cc) >= value
    except ValueError:
        return False


MAX_GPU_BYTES = 16 * 1024 * GiB  # 16 TiB: far beyond any card; a bigger size is a typo
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(GIB|GB|MIB)$")


def sized_kind(text: str) -> GPUKind:
    """A card known only by its size (`24GiB`): CUDA, no FP8, no NVLink assumed."""
    m = _SIZE.match(text.upper())
    if not m:
        raise InputError(f"bad GPU size '{text}': use e.g. 24GiB, 80GB or 81559MiB")
    value, unit = float(m.group(1)), m.group(2)
    if value <= 0:
        raise InputError(f"bad GPU size '{text}': the memory must be more than 0")
    scale = {"GIB": GiB, "GB": 10**9, "MIB": MiB}[unit]
    if not value * scale <= MAX_GPU_BYTES:  # also catches a digit string that floats to inf
        raise InputError(f"bad GPU size '{text[:40]}': at most {MAX_GPU_BYTES // GiB:,} GiB "
                         "per card")
    return GPUKind(name=text, total_bytes=int(value * scale), compute_capability=None)


def system_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine's RAM, from /proc/meminfo."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, info.get("MemAvailable", total)


def cpu_hardware() -> Hardware:
    """The CPU engine: plans on system memory (vLLM's CPU backend sizes KV from RAM)."""
    total, free = system_memory()
    kind = GPUKind(name="cpu", total_bytes=total, compute_capability=None, platform="cpu",
                   **_perf_fields(cpu_engine_row()))
    return Hardware(kind=kind, nodes=1, gpus_per_node=1, total_bytes=total, free_bytes=free,
                    source="system")


_SPEC = re.compile(r"^(?:(\d+)\s*[xX*]\s*)?(?:(\d+)\s*[xX*]\s*)?([A-Za-z0-9][A-Za-z0-9._-]*)$")
# What any spec may describe, whatever the card: no host holds more GPUs than this (the catalog's
# max_per_node is the tighter, per-card limit), and no single deployment plan spans more.
# Beyond them a spec is a typo, and planning it would only search layouts nobody can run.
MAX_GPUS_PER_NODE = 64
MAX_CLUSTER_GPUS = 65536
_MAX_DIGITS = 9  # counts beyond this are refused before int() (and its 4300-digit limit)


def parse_gpus(spec: str) -> Hardware:
    """`8xH200`, `2x8xH100` (nodes x GPUs per node), `1xRTX4090`, `4x24GiB`, `H100`, `cpu`."""
    text = spec.strip()
    if text.lower() == "cpu":
        return cpu_hardware()
    m = _SPEC.match(text)
    if not m:
        raise InputError(f"malformed --gpus '{spec}': use COUNTxNAME (8xH200), "
                         "NODESxCOUNTxNAME (2x8xH100), COUNTxSIZE (4x24GiB) or cpu")
    first, second, name = m.group(1), m.group(2), m.group(3)
    if any(g and len(g.lstrip("0")) > _MAX_DIGITS for g in (first, second)):
        raise InputError(f"--gpus {spec[:80]}: a count that large is not a cluster; at most "
                         f"{MAX_CLUSTER_GPUS:,} GPUs in all")
    if second is not None:
        nodes, per_node = int(first), int(second)
    else:
        nodes, per_node = 1, int(first) if first else 1
    if nodes < 1 or per_node < 1:
        raise InputError(f"malformed --gpus '{spec}': counts must be at least 1")
    if nodes * per_node > MAX_CLUSTER_GPUS:
        raise InputError(f"--gpus {spec}: {nodes * per_node:,} GPUs; vlaunch plans at most "
                         f"{MAX_CLUSTER_GPUS:,} GPUs in all (NODESxCOUNTxNAME, e.g. 2x8xH100)")
    kind = sized_kind(name) if _SIZE.match(name.upper()) else gpu_kind(name)
    # An explicit node count lifts the per-card board size only for a card known by its size
    # alone (1x16x24GiB: a larger server); a catalog card's node is what the catalog says.
    most = MAX_GPUS_PER_NODE if _SIZE.match(name.upper()) else kind.max_per_node
    if second is not None and per_node > most:
        nodes_needed = -(-nodes * per_node // most)
        raise InputError(f"--gpus {spec}: one node holds at most {most} {kind.name}; "
                         f"write more nodes, e.g. {nodes_needed}x{most}x{kind.name}")
    if second is None and per_node > kind.max_per_node:
        # A size-only card (24GiB) has no catalog entry: the usual 8-GPU board is assumed,
        # and a bigger server is written with an explicit node count (1x16x24GiB).
        nodes_needed = -(-per_node // kind.max_per_node)
        raise InputError(f"--gpus {spec}: one node holds at most {kind.max_per_node} "
                         f"{kind.name}; write nodes x GPUs per node, e.g. "
                         f"{nodes_needed}x{kind.max_per_node}x{kind.name}"
                         + (f" (or 1x{per_node}x{kind.name} for one larger server)"
                            if _SIZE.match(name.upper()) else ""))
    return Hardware(kind=kind, nodes=nodes, gpus_per_node=per_node,
                    total_bytes=kind.total_bytes, free_bytes=kind.total_bytes, source="spec")
