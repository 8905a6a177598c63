"""The performance model against published vLLM serving measurements, row by row.

Each row of `tests/fixtures/perf/vllm-perf-observations.csv` (a copy of the shared validation
rows, each with its `source_url`) is one operating point of a real deployment: model, GPU,
layout, lengths, concurrency, and what was measured. A row becomes a `Case`: its engine shape,
built once by the same budget and performance code as any plan (at the row's vLLM version: V0
engines prefill a prompt in a step of its own and default to 256 sequences), its workload and
its observations. The shapes hold no constant, so scoring a case under other constants is
replacing `shape.constants` - what the fit (bench/perf_fit.py) does. Rows the model cannot
express are reported with the reason. The MTP rows (`vllm-mtp-observations.csv`) are scored
as the speed-up MTP gives at equal load.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from startup_validation import find_model, version_of

from launcher.errors import InputError
from launcher.inputs.hardware import Hardware, gpu_kind
from launcher.inputs.model import ModelSpec
from launcher.inputs.workload import Workload
from launcher.predict.features.capabilities import version_traits
from launcher.predict.memory.budget import Layout
from launcher.predict.search.planner import Pins, evaluate
from launcher.predict.speed import mtp
from launcher.predict.speed import request_model as perf

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "fixtures" / "perf" / "vllm-perf-observations.csv"
MTP_ROWS = ROOT / "tests" / "fixtures" / "perf" / "vllm-mtp-observations.csv"
SHARED = ROOT.parent / "shared"

MTP_WORKLOAD = Workload(1024, 1024, synchronized=True)
"""PR #13626 does not state its lengths: 1,024 / 1,024 random tokens assumed (the speed-up at
one request barely depends on them)."""


@dataclass
class PerfResult:
    row_id: str
    quantity: str  # tpot_ms | output_tok_s | ttft_ms | mtp_speedup
    predicted: float
    observed: float
    source: str = ""

    @property
    def error(self) -> float:
        return (self.predicted - self.observed) / self.observed


@dataclass
class Case:
    """One expressible observation: predict(constants) -> {quantity: predicted value}."""

    row_id: str
    source: str
    observed: dict[str, float]
    predict: Callable[[perf.Constants], dict[str, float]]

    def results(self, constants: perf.Constants = perf.DEFAULT) -> list[PerfResult]:
        got = self.predict(constants)
        return [PerfResult(self.row_id, q, got[q], v, self.source)
                for q, v in self.observed.items()]


def first_number(text: str) -> float | None:
    m = re.match(r"\s*~?\s*(\d+(?:\.\d+)?(?:e-?\d+)?)", text or "")
    return float(m.group(1)) if m else None


def source_of(url: str) -> str:
    """The publication a row comes from: host and path of its first URL."""
    first = re.split(r"[\s;]+", url.strip())[0]
    u = urlparse(first)
    return (u.netloc + u.path).rstrip("/") or url


def _concurrency(row: dict[str, str]) -> float:
    text = row["concurrency_or_request_rate"]
    m = re.search(r"max_concurrency=(\d+)", text)
    if m:
        return float(m.group(1))
    m = re.search(r"(?:batch of|batch:? all|offline, )\s*(\d+)", text)
    if m:
        return float(m.group(1))
    if "request_rate=inf" in text and first_number(row.get("num_prompts", "")):
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
    if "disaggregated" in row.get("setup", row.get("notes", "")):
        raise InputError("prefill/decode disaggregation (separate pools, DBO, DeepEP): "
                         "the model describes one engine serving both phases")
    isl, osl = first_number(row["isl"]), first_number(row["osl"])
    if not isl or not osl:
        raise InputError("input/output lengths not stated")
    # random datasets have fixed lengths and the clients start together: waves
    synchronized = row["dataset"].strip().lower().startswith("random")
    return Workload(int(isl), int(osl), synchronized=synchronized), _concurrency(row)


def _spec(name: str) -> ModelSpec:
    return find_model(name.split(" ")[0].split("(")[0], SHARED)


def shape_for(row: dict[str, str], w: Workload, spec: ModelSpec | None = None
              ) -> perf.EngineShape:
    """The row's engine through the planner's budget and the one shape constructor."""
    spec = spec or _spec(row["model"])
    kind = gpu_kind(_gpu(row["gpu"]))
    n = int(first_number(row["n_gpus"]) or 1)
    nodes = int(first_number(row.get("nodes", "1")) or 1)
    tp, pp = int(first_number(row["tp"]) or 1), int(first_number(row.get("pp", "1")) or 1)
    dp = int(first_number(row.get("dp", "1")) or 1)
    ep = row.get("ep", "no").strip().lower().startswith("yes")
    hw = Hardware(kind=kind, nodes=nodes, gpus_per_node=n // nodes,
                  total_bytes=kind.total_bytes, free_bytes=kind.total_bytes, source="validation")
    version = version_of(row["engine_version"].replace(">=", ""))
    traits = version_traits(version)
    v0 = traits.engine == "v0"
    kv = "fp8" if row.get("kv_cache_dtype", "").startswith("fp8") else "auto"
    layout = Layout(tp=tp, pp=pp, dp=dp, expert_parallel=ep, nodes=nodes)
    # the context the source served with where it says (the token budget of a prefill-first
    # scheduler follows it), else just the row's request
    length = min(spec.max_context, int(first_number(row.get("max_model_len", "")) or 0)
                 or w.input_len + w.output_len)
    pins = Pins(max_model_len=length, max_num_seqs=256 if v0 else None, vllm_version=version)
    c = evaluate(spec, hw, layout, kv, traits.default_gpu_memory_utilization, traits, pins,
                 chunked=not v0)
    shape = perf.engine_shape(spec, hw, layout, c.kv_bytes_per_token, c.tokens, c.max_num_seqs,
                              c.max_num_batched_tokens, not v0, v0=v0)
    if shape is None:
        raise InputError(f"no speed facts for {kind.name} in the catalog")
    return shape


def planned_shape(model: str, gpus: str, layout: Layout, version: str = "0.32.0",
                  max_len: int = 32768) -> perf.EngineShape:
    """The engine the planner builds for `layout` at `version`'s defaults (chunked prefill):
    what `make bench` reads the MTP equal-load curve from."""
    from launcher.inputs.hardware import parse_gpus

    spec, hw = _spec(model), parse_gpus(gpus)
    traits = version_traits(version)
    pins = Pins(max_model_len=min(max_len, spec.max_context), vllm_version=version)
    c = evaluate(spec, hw, layout, "auto", traits.default_gpu_memory_utilization, traits, pins,
                 chunked=True)
    shape = perf.engine_shape(spec, hw, layout, c.kv_bytes_per_token, c.tokens, c.max_num_seqs,
                              c.max_num_batched_tokens, True) if c.fits else None
    if shape is None:
        raise InputError(f"{model} does not fit {gpus} as {layout}")
    return shape


MTP_CURVE_LAYOUTS = (("TP8", Layout(tp=8)), ("DP8+EP", Layout(dp=8, expert_parallel=True)))
"""The two layouts of DeepSeek-R1 on 8xH200 whose equal-load MTP curve `make bench` prints."""


def mtp_curve_table(ctx: int = 1024) -> str:
    """MTP's equal-load speed-up over load, R1 on 8xH200 (mtp.equal_load_curve), the figure
    issue 28 item 2 is about; the last column is its largest step-to-step rise past 16 in
    flight (mtp.largest_rise: the property allows 3%)."""
    spec = _spec("deepseek-ai/DeepSeek-R1")
    acc = mtp.Acceptance()
    head = "  ".join(f"{c:>5}" for c in mtp.IN_FLIGHT)
    lines = [f"MTP equal-load speed-up, DeepSeek-R1 on 8xH200, {ctx:,}-token context, by "
             f"sequences in flight (mtp.equal_load_curve)", f"{'layout':8} {'k':>2}  {head}  "
             "rise"]
    for name, layout in MTP_CURVE_LAYOUTS:
        s = planned_shape("deepseek-ai/DeepSeek-R1", "8xH200", layout)
        draft = mtp.draft_shape(spec, s, layout, "auto")
        for k in (1, 2, 3):
            curve = mtp.equal_load_curve(s, draft, k, acc, ctx)
            lines.append(f"{name:8} {k:>2}  " + "  ".join(f"{x:5.2f}" for _, x in curve)
                         + f"  {mtp.largest_rise(curve):+.0%}")
    return "\n".join(lines)


def _with(s: perf.EngineShape, k: perf.Constants) -> perf.EngineShape:
    return dataclasses.replace(s, constants=k)


ITL_CONTEXTS = (1024, 8192, 32768)


def row_cases(row: dict[str, str]) -> list[Case]:
    """The cases of one serving row (three for a published ITL line)."""
    src = source_of(row["source_url"])
    if " x input_len" in row["itl_ms_mean"]:
        m = re.match(r"\s*([\d.]+)\s*\+\s*([\d.e-]+)\s*x input_len", row["itl_ms_mean"])
        if not m:
            raise InputError("unreadable fitted line")
        a, b = float(m.group(1)), float(m.group(2))
        osl = int(first_number(row["osl"]) or 128)
        out = []
        for ctx in ITL_CONTEXTS:
            w = Workload(ctx, osl)
            s = shape_for(row, w)
            out.append(Case(f"{row['id']}@{ctx // 1024}k", src, {"tpot_ms": a + b * ctx},
                            lambda k, s=s, w=w: {"tpot_ms": perf.point(_with(s, k), w,
                                                                         1).tpot_ms}))
        return out
    w, conc = expressible(row)
    s = shape_for(row, w)
    # request_rate=inf sends every prompt at once: one wave, TPOT mostly queueing; the
    # source README says to use such rows for throughput ceilings only.
    # an offline batch (LLM.generate on every prompt) is a burst as well
    text = row["concurrency_or_request_rate"].strip().lower()
    burst = "request_rate=inf" in text or text.startswith("offline")
    observed = {}
    tpot = None if burst else first_number(row["tpot_ms_mean"])
    tput = first_number(row["output_tok_s"])
    # TTFT as the row's own client saw it (the burst rows' is queueing: throughput only)
    ttft = None if burst or "MEDIAN" in row["ttft_ms_mean"] else first_number(
        row["ttft_ms_mean"])
    if tpot:
        observed["tpot_ms"] = tpot
    if tput:
        observed["output_tok_s"] = tput
    if ttft:
        observed["ttft_ms"] = ttft
    if not observed:
        raise InputError("no TPOT or output throughput measured")
    prompts = first_number(row.get("num_prompts", "")) or perf.BENCH_PROMPTS

    def predict(k: perf.Constants) -> dict[str, float]:
        # a burst is one wave timed to its last request; a max-concurrency run a loop
        p = (perf.burst_point(_with(s, k), w, conc) if burst else
             perf.point(_with(s, k), w, conc, prompts))
        return {"tpot_ms": p.tpot_ms, "output_tok_s": p.output_tokens_per_s,
                "ttft_ms": p.ttft_ms}

    return [Case(row["id"], src, observed, predict)]


def mtp_cases(row: dict[str, str]) -> list[Case]:
    """An MTP row: the speed-up of k drafts at the row's concurrency (same engine, same load)."""
    m = re.search(r"max_concurrency=(\d+)", row["concurrency_or_request_rate"])
    if not m:
        raise InputError("open-loop rate with lengths not stated: the model replays closed "
                         "loops (kept for its measured acceptance)")
    conc, k = float(m.group(1)), int(row["k"])
    spec = _spec(row["model"])
    w = MTP_WORKLOAD
    base = shape_for(dict(row, engine="vllm", nodes="1", pp="1", dp="1", ep="no",
                          kv_cache_dtype="auto"), w, spec)
    layout = Layout(tp=base.tp)
    draft = mtp.draft_shape(spec, base, layout, "auto")
    acc = mtp.Acceptance()

    def predict(c: perf.Constants) -> dict[str, float]:
        s = _with(base, c)
        off = perf.point(mtp.with_drafts(s, _with(draft, c), 0, acc), w, conc).tpot_ms
        on = perf.point(mtp.with_drafts(s, _with(draft, c), k, acc), w, conc).tpot_ms
        return {"mtp_speedup": off / on}

    return [Case(row["id"], source_of(row["source_url"]),
                 {"mtp_speedup": float(row["speedup"])}, predict)]


def cases(rows: Path = ROWS, mtp_rows: Path | None = MTP_ROWS
          ) -> tuple[list[Case], list[tuple[str, str]]]:
    """Every expressible case, and (row, why not) for the others."""
    out: list[Case] = []
    skipped: list[tuple[str, str]] = []
    for path, make in ((rows, row_cases), (mtp_rows, mtp_cases)):
        if path is None or not path.is_file():
            continue
        with path.open() as f:
            for row in csv.DictReader(f):
                try:
                    out += make(row)
                except InputError as e:
                    skipped.append((row["id"], str(e)))
    return out, skipped


def run(rows: Path = ROWS, constants: perf.Constants = perf.DEFAULT
        ) -> tuple[list[PerfResult], list[tuple[str, str]]]:
    cs, skipped = cases(rows)
    return [r for c in cs for r in c.results(constants)], skipped


def median_abs(results: list[PerfResult], quantity: str) -> float:
    errs = [abs(r.error) for r in results if r.quantity == quantity]
    return statistics.median(errs) if errs else math.nan


def table(results: list[PerfResult], skipped: list[tuple[str, str]]) -> str:
    lines = [f"{'row':40} {'quantity':13} {'predicted':>11} {'observed':>11} {'error':>8}"]
    for r in results:
        lines.append(f"{r.row_id[:40]:40} {r.quantity:13} {r.predicted:>11,.2f} "
                     f"{r.observed:>11,.2f} {r.error:>+8.1%}")
    for row_id, why in skipped:
        lines.append(f"{row_id[:40]:40} cannot express: {why}")
    lines.append(f"median |error| in sample: TPOT {median_abs(results, 'tpot_ms'):.1%}, "
                 f"output tokens/s {median_abs(results, 'output_tok_s'):.1%}, "
                 f"TTFT {median_abs(results, 'ttft_ms'):.1%}, "
                 f"MTP speed-up {median_abs(results, 'mtp_speedup'):.1%}")
    return "\n".join(lines)
