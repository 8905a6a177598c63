"""Check the budget model against what vLLM printed at start-up in public logs.

Each row of the observations (`tests/fixtures/validation/startup-observations.csv`, vendored
from the shared `validation/vllm-startup-observations.csv`) records a real start-up: model,
GPU, vLLM version, settings, and what vLLM measured. A row is predicted with the same planner
code as any plan, at that row's vLLM version and engine; rows whose checkpoint config is not
available (AWQ repacks, vision models we cannot count) are reported as skipped, with why.
Used by `make bench` (the table), by tests (the tolerances) and by perf_validation (the
model lookup); not part of the package.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import InputError
from launcher.inputs.hardware import Hardware, gpu_kind
from launcher.inputs.model import ModelSpec, load_model
from launcher.predict.features.capabilities import version_traits
from launcher.predict.memory.budget import GiB, Layout
from launcher.predict.search.planner import Pins, evaluate

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "validation"
CSV = FIXTURES / "startup-observations.csv"
CONFIGS = FIXTURES / "model-configs"


@dataclass
class RowResult:
    row_id: str
    model: str
    quantity: str  # weights_gib | kv_tokens | available_kv_gib | kv_bytes_per_token
    predicted: float
    observed: float

    @property
    def error(self) -> float:
        return (self.predicted - self.observed) / self.observed if self.observed else 0.0


def _num(text: str) -> float | None:
    m = re.match(r"\s*([\d.]+)", text or "")
    return float(m.group(1)) if m else None


def version_of(text: str) -> str:
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", text or "")
    if not m:
        raise InputError(f"no version in '{text}'")
    v = m.group(1)
    return v if v.count(".") == 2 else v + ".0"


def find_model(name: str, config_dirs: Path | Sequence[Path]) -> ModelSpec:
    """A profile of ours, else `<dir>/<org>--<name>/config.json` from one of `config_dirs`
    (a single path: the shared data's root, whose reference/model-configs and
    validation/corpus hold them)."""
    if isinstance(config_dirs, Path):
        config_dirs = (config_dirs / "reference" / "model-configs",
                       config_dirs / "validation" / "corpus")
    try:
        return load_model(name)
    except InputError:
        pass
    folder = name.replace("/", "--").lower()
    short = folder.split("--")[-1]
    for base in config_dirs:
        for d in sorted(base.glob("*/config.json")):
            got = d.parent.name.lower()
            if got == folder or ("/" not in name and got.split("--")[-1].startswith(short)):
                return load_model(str(d.parent))
    raise InputError(f"no config for {name}")


def predict_row(row: dict[str, str], config_dirs: Sequence[Path]) -> list[RowResult]:
    """Predict one start-up; raises InputError with the reason when the row is not expressible."""
    quant = row["weights_dtype_or_quant"].lower()
    if "awq" in quant or "dummy" in quant:
        raise InputError(f"{row['model']}: checkpoint config not available ({quant})")
    spec = find_model(row["model"], config_dirs)
    kind = gpu_kind(row["gpu_class"].split()[0].replace("(inferred)", ""))
    total_gib = _num(row["gpu_total_mem_reported_gib"])
    total = int(total_gib * GiB) if total_gib else kind.total_bytes
    tp, pp = int(_num(row["tp"]) or 1), int(_num(row["pp"]) or 1)
    hw = Hardware(kind=kind, nodes=1, gpus_per_node=tp * pp, total_bytes=total,
                  free_bytes=total, source="validation",
                  cuda_total_bytes=total if total_gib else None)  # the log's own (CUDA) total
    version = version_of(row["vllm_version"])
    traits = version_traits(version)
    engine = "v0" if "V0" in row["engine"] else "v1"
    settings = row.get("evidence", "") + " " + row.get("env", "")
    align = 128 if "VLLM_MLA_CUDA_MEM_ALIGN_KV_CACHE=1" in settings or \
        (engine == "v0" and traits.mla_cache_align) else 0
    traits = dataclasses.replace(traits, engine=engine, mla_cache_align=align)
    util = _num(row["gpu_memory_utilization"]) or traits.default_gpu_memory_utilization
    mml = _num(row["max_model_len"])
    seqs = _num(row["max_num_seqs"]) or (256 if engine == "v0" else None)
    pins = Pins(tp=tp, pp=pp, max_model_len=int(mml) if mml else None,
                max_num_seqs=int(seqs) if seqs else None,
                max_num_batched_tokens=int(_num(row["max_num_batched_tokens"]) or 0) or None,
                enforce_eager="true" in row["enforce_eager"].lower(),
                block_size=int(_num(row["block_size"]) or 0) or None, vllm_version=version)
    layout = Layout(tp=tp, pp=pp)
    kv_dtype = row["kv_cache_dtype"] or "auto"
    if kv_dtype == "auto (bf16)":
        kv_dtype = "auto"
    c = evaluate(spec, hw, layout, kv_dtype, util, traits, pins, chunked=engine == "v1")
    out = []
    if _num(row["weights_gib"]):
        out.append(RowResult(row["row_id"], row["model"], "weights_gib", c.weights / GiB,
                             _num(row["weights_gib"])))
    kv_tokens = _num(row["kv_tokens"])
    blocks = _num(row["gpu_blocks"])
    if kv_tokens:
        out.append(RowResult(row["row_id"], row["model"], "kv_tokens", c.tokens, kv_tokens))
    elif blocks:
        out.append(RowResult(row["row_id"], row["model"], "kv_tokens", c.tokens,
                             blocks * c.block_size))
    elif _num(row["available_kv_gib"]):
        # vLLM printed the memory, not the tokens: tokens follow from it one to one.
        out.append(RowResult(row["row_id"], row["model"], "available_kv_gib",
                             c.kv_memory / GiB, _num(row["available_kv_gib"])))
    derived = _num(row["derived_kv_bytes_per_token_per_gpu"])
    if derived:
        out.append(RowResult(row["row_id"], row["model"], "kv_bytes_per_token",
                             c.kv_bytes_per_token, derived))
    return out


def run(csv_path: Path = CSV, config_dirs: Sequence[Path] = (CONFIGS,)
        ) -> tuple[list[RowResult], list[tuple[str, str]]]:
    """All rows: (results, skipped rows with the reason)."""
    results, skipped = [], []
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            try:
                results += predict_row(row, config_dirs)
            except InputError as e:
                skipped.append((row["row_id"], str(e)))
    return results, skipped


def table(results: list[RowResult], skipped: list[tuple[str, str]]) -> str:
    lines = [f"{'row':6} {'model':38} {'quantity':20} {'predicted':>14} {'observed':>14} "
             f"{'error':>8}"]
    for r in results:
        lines.append(f"{r.row_id:6} {r.model[:38]:38} {r.quantity:20} {r.predicted:>14,.2f} "
                     f"{r.observed:>14,.2f} {r.error:>+8.1%}")
    for row_id, why in skipped:
        lines.append(f"{row_id:6} skipped: {why}")
    return "\n".join(lines)
