"""Check the performance model against published vLLM serving measurements.

Each row of `shared/validation/vllm-perf-observations.csv` is one operating point of a real
deployment: model, GPU, layout, lengths, concurrency, and what was measured. A row is predicted
with the same budget and performance code as any plan (at the row's vLLM version: V0 engines
prefill a prompt in a step of its own and default to 256 sequences); rows the model cannot
express are reported with the reason. Used by `make bench` (the table) and by tests (the goal).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..inputs.hardware import Hardware, gpu_kind
from ..inputs.workload import Workload
from . import perf
from .budget import Layout
from .capabilities import version_traits
from .planner import Pins, evaluate
from .validation import find_model, version_of


@dataclass
class PerfResult:
    row_id: str
    quantity: str  # tpot_ms | output_tok_s
    predicted: float
    observed: float

    @property
    def error(self) -> float:
        return (self.predicted - self.observed) / self.observed


def first_number(text: str) -> float | None:
    m = re.match(r"\s*~?\s*(\d+(?:\.\d+)?(?:e-?\d+)?)", text or "")
    return float(m.group(1)) if m else None


def _concurrency(row: dict[str, str]) -> float:
    text = row["concurrency_or_request_rate"]
    m = re.search(r"max_concurrency=(\d+)", text)
    if m:
        return float(m.group(1))
    m = re.search(r"(?:batch of|batch:? all|offline, )\s*(\d+)", text)
    if m:
        return float(m.group(1))
    if "request_rate=inf" in text and first_number(row["num_prompts"]):
        return float(first_number(row["num_prompts"]) or 0)
    raise InputError(f"no closed-loop concurrency in '{text}' (open-loop rate or not stated)")


def _gpu(text: str) -> str:
    for token in re.split(r"[\s(]+", text):
        try:
            return gpu_kind(token).name
        except InputError:
            continue
    raise InputError(f"GPU '{text}' is not in the catalog")


def expressible(row: dict[str, str]) -> tuple[Workload, float]:
    """The row's workload and concurrency, or InputError saying why it cannot be predicted."""
    if row["engine"] != "vllm":
        raise InputError(f"comparison row ({row['engine']}), not vLLM")
    if "disaggregated" in row["notes"] or "Prefill-only" in row["notes"]:
        raise InputError("prefill/decode disaggregation (separate pools, DBO, DeepEP): "
                         "the model describes one engine serving both phases")
    isl, osl = first_number(row["isl"]), first_number(row["osl"])
    if not isl or not osl:
        raise InputError("input/output lengths not stated")
    if " x input_len" in row["tpot_ms_mean"]:
        raise InputError("a fitted line, predicted separately (itl_lines)")
    # random datasets have fixed lengths and the clients start together: waves
    synchronized = row["dataset"].strip().lower().startswith("random")
    return Workload(int(isl), int(osl), synchronized=synchronized), _concurrency(row)


def shape_for(row: dict[str, str], shared: Path, w: Workload,
              constants: perf.Constants = perf.DEFAULT) -> perf.EngineShape:
    spec = find_model(row["model"].split(" ")[0].split("(")[0], shared)
    kind = gpu_kind(_gpu(row["gpu"]))
    n = int(first_number(row["n_gpus"]) or 1)
    nodes = int(first_number(row["nodes"]) or 1)
    tp, pp = int(first_number(row["tp"]) or 1), int(first_number(row["pp"]) or 1)
    dp = int(first_number(row["dp"]) or 1)
    ep = row["ep"].strip().lower().startswith("yes")
    hw = Hardware(kind=kind, nodes=nodes, gpus_per_node=n // nodes,
                  total_bytes=kind.total_bytes, free_bytes=kind.total_bytes, source="validation")
    version = version_of(row["engine_version"].replace(">=", ""))
    traits = version_traits(version)
    v0 = traits.engine == "v0"
    kv = "fp8" if row["kv_cache_dtype"].startswith("fp8") else "auto"
    layout = Layout(tp=tp, pp=pp, dp=dp, expert_parallel=ep, nodes=nodes)
    length = min(spec.max_context, w.input_len + w.output_len)
    pins = Pins(max_model_len=length, max_num_seqs=256 if v0 else None, vllm_version=version)
    c = evaluate(spec, hw, layout, kv, traits.default_gpu_memory_utilization, traits, pins,
                 chunked=not v0)
    shape = perf.engine_shape(spec, hw, layout, c.kv_bytes_per_token, c.tokens, c.max_num_seqs,
                              c.max_num_batched_tokens, not v0, constants,
                              traits.block_fp8_gemm_scale if spec.quant.method == "fp8_block"
                              else 1.0)
    if shape is None:
        raise InputError(f"no speed facts for {kind.name} in the catalog")
    return shape


def predict_row(row: dict[str, str], shared: Path,
                constants: perf.Constants = perf.DEFAULT) -> list[PerfResult]:
    out: list[PerfResult] = []
    if " x input_len" in row["itl_ms_mean"]:
        return itl_line(row, shared, constants)
    w, conc = expressible(row)
    s = shape_for(row, shared, w, constants)
    p = perf.point(s, w, conc)
    # request_rate=inf sends every prompt at once: one wave, TPOT mostly queueing; the
    # source README says to use such rows for throughput ceilings only.
    burst = "request_rate=inf" in row["concurrency_or_request_rate"]
    tpot = None if burst else first_number(row["tpot_ms_mean"])
    tput = first_number(row["output_tok_s"])
    if tpot:
        out.append(PerfResult(row["id"], "tpot_ms", p.tpot_ms, tpot))
    if tput:
        out.append(PerfResult(row["id"], "output_tok_s", p.output_tokens_per_s, tput))
    if not out:
        raise InputError("no TPOT or output throughput measured")
    return out


ITL_CONTEXTS = (1024, 8192, 32768)


def itl_line(row: dict[str, str], shared: Path,
             constants: perf.Constants = perf.DEFAULT) -> list[PerfResult]:
    """Rows that publish ITL = a + b x input_len at concurrency 1: predict three contexts."""
    m = re.match(r"\s*([\d.]+)\s*\+\s*([\d.e-]+)\s*x input_len", row["itl_ms_mean"])
    if not m:
        raise InputError("unreadable fitted line")
    a, b = float(m.group(1)), float(m.group(2))
    osl = int(first_number(row["osl"]) or 128)
    out = []
    for ctx in ITL_CONTEXTS:
        w = Workload(ctx, osl)
        s = shape_for(row, shared, w, constants)
        out.append(PerfResult(f"{row['id']}@{ctx // 1024}k", "tpot_ms",
                              perf.point(s, w, 1).tpot_ms, a + b * ctx))
    return out


def run(csv_path: Path, constants: perf.Constants = perf.DEFAULT
        ) -> tuple[list[PerfResult], list[tuple[str, str]]]:
    shared = csv_path.resolve().parents[1]
    results, skipped = [], []
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            try:
                results += predict_row(row, shared, constants)
            except InputError as e:
                skipped.append((row["id"], str(e)))
    return results, skipped


def median_abs(results: list[PerfResult], quantity: str) -> float:
    errs = sorted(abs(r.error) for r in results if r.quantity == quantity)
    if not errs:
        return math.nan
    mid = len(errs) // 2
    return errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2


def table(results: list[PerfResult], skipped: list[tuple[str, str]]) -> str:
    lines = [f"{'row':40} {'quantity':13} {'predicted':>11} {'observed':>11} {'error':>8}"]
    for r in results:
        lines.append(f"{r.row_id[:40]:40} {r.quantity:13} {r.predicted:>11,.2f} "
                     f"{r.observed:>11,.2f} {r.error:>+8.1%}")
    for row_id, why in skipped:
        lines.append(f"{row_id[:40]:40} cannot express: {why}")
    lines.append(f"median |error|: TPOT {median_abs(results, 'tpot_ms'):.1%}, "
                 f"output tokens/s {median_abs(results, 'output_tok_s'):.1%}")
    return "\n".join(lines)
