"""`vlaunch tune`: measure candidate configurations on the real engine, choose by goodput.

The planner predicts; this module measures. Why each piece is the way it is:

- Candidates come from the planner (`make_plan` over variants of the knobs that need a restart:
  max_num_seqs, max_num_batched_tokens, kv dtype, enforce-eager, the layout where the hardware
  has one to choose), only those it predicts to start, ranked by its predicted goodput. Starting
  an engine costs minutes on a GPU node, so a blind grid or a utilization descent is what this
  avoids.
- vLLM's defaults (the model, its context and the memory sizing it needs to start; every tuned
  knob left to vLLM) are always measured in the same run: a recommendation is only worth its
  gain over what a user gets without vlaunch.
- Outer loop: successive halving over engine starts. Rung 0 measures several candidates
  coarsely; the best of each rung are restarted and measured more finely (more prompts, a finer
  knee) while `--max-starts` and the wall-clock `--budget` allow. A start that fails is
  classified (`vllmlog.classify_failure`) and marked infeasible with its cause; the same flags are
  never started again, in this run or on `--resume`.
- Inner loop on a running engine: an uncounted warm-up, then a concurrency search for the SLO
  knee (the largest concurrency where at least `threshold` of the completed requests meet both
  the TTFT and the TPOT objective), doubling then bisecting; a point whose verdict would flip
  within +-10% of the SLO is measured again and pooled. Load comes from vLLM's own benchmark
  (`launcher.run.loadgen`, in a child process).
- Everything measured is kept: `tune.json` is rewritten atomically after every point, so a
  kill -9 loses at most one point, and `--resume` skips finished trials. Ctrl-C/SIGTERM stop the
  engine, keep what was measured and report the best so far.

Pure orchestration: no click; `out` receives the lines to print. Engine and load generator are
injectable (`runner_factory`, `loadgen_factory`) so the bookkeeping is tested without vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import inspect
import itertools
import json
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import InputError
from ..inputs.hardware import Hardware
from ..inputs.model import ModelSpec
from ..inputs.workload import SLO, Workload
from ..predict.planner import Pins, make_plan
from ..predict.speculative import measured_acceptance, record_acceptance
from ..redact import SECRET_FLAGS, redact_args, redact_text, secret_flags
from .emit import STARTUP_BYTES_PER_SECOND, STARTUP_SECONDS_BASE, atomic_write, emit_plan
from .exposure import exposure_warning, with_host
from .loadgen import LoadGenerator, LoadgenError, LoadSpec
from .runner import VllmRunner
from .serve import merge_args
from .vllmargs import arg_value

TUNE_FILE = "tune.json"
SCHEMA = 1

THRESHOLD = 0.9
"""The SLO is met at a concurrency when at least this share of completed requests met both the
TTFT and the TPOT objective (vLLM's goodput counts them); 90% leaves room for one slow request
in ten, the usual way an SLO is written."""

RESOLUTION = (1.5, 1.25)
"""Bisection stops when the first failing concurrency is within this factor of the last passing
one: coarse in the early rungs (many candidates), fine in the last. 1.25 keeps 1.5x the knee beyond
the first failure, so "1.5x misses the SLO" can be checked."""

PROMPTS_PER_CONCURRENCY = (3, 4)
"""Requests per point (early rungs, last rung) as a multiple of the concurrency: at least three
waves, so the burst at t=0 is not the whole measurement."""

MIN_PROMPTS = 8
FRAGILE_TOLERANCE = 0.1
FRAGILE_SHARE = 0.25
"""A point is measured again only when its verdict is fragile: the share meeting the SLO is
within this of the threshold, and moving every request 10% would flip it (a point where 30%
met is a clear miss, however many requests sit near the limit)."""
MAX_REPEATS = 2
STOP_MARGIN_S = 30.0
"""Kept free at the end of the budget: stopping vLLM's group (SIGTERM, grace, SIGKILL)."""

STATUSES = ("ok", "infeasible", "failed", "skipped")

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s)")


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived: stop, keep what was measured."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class BudgetExhausted(Exception):
    """The wall-clock budget is spent: stop measuring, keep what was measured."""


# ----------------------------------------------------------------------------- input parsing


def parse_budget(text: str | float | int) -> float:
    """`20m`, `90s`, `1h30m`, `1.5h` or a plain number of seconds; more than zero."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        s = text.strip().lower()
        if re.fullmatch(r"\d+(?:\.\d+)?", s):
            seconds = float(s)
        elif s and re.fullmatch(r"(?:\d+(?:\.\d+)?\s*[hms]\s*)+", s):
            unit = {"h": 3600.0, "m": 60.0, "s": 1.0}
            seconds = sum(float(v) * unit[u] for v, u in _DURATION.findall(s))
        else:
            raise InputError(f"malformed --budget {text!r}: use e.g. 20m, 90s, 1h30m or seconds")
    if not seconds > 0 or math.isinf(seconds):
        raise InputError(f"--budget must be more than zero, got {text!r}")
    return seconds


def parse_candidate(text: str) -> list[str]:
    """One `--candidate`: vLLM flags measured on top of the defaults baseline, e.g.
    "--max-num-seqs 16" (a user's own idea, measured like the planner's)."""
    shown = redact_text(text)  # an error message must not echo a key either
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise InputError(f"malformed --candidate {shown!r}: {e}") from None
    if not args or not args[0].startswith("--"):
        raise InputError(f"--candidate {shown!r}: give vLLM flags, e.g. \"--max-num-seqs 16\"")
    if arg_value(args, "--model") or arg_value(args, "--port"):
        raise InputError("--candidate must not set --model or --port (tune sets them)")
    if flags := secret_flags(args):
        # A secret is no tuning knob, and a candidate's flags are printed and saved in
        # tune.json and plan.json: refused before anything can echo or record it.
        env = " / ".join(SECRET_FLAGS[f] for f in flags)
        raise InputError(f"--candidate must not carry {' or '.join(flags)} (it would be saved "
                         f"in tune.json and plan.json); set {env} in the environment instead")
    return args


def check_output_dir(path: str | os.PathLike[str]) -> Path:
    """The output folder exists (made if needed) and is writable; else one clear error."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"--output {out}: not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / ".vlaunch-write-test", "ok\n")
        (out / ".vlaunch-write-test").unlink()
    except OSError as e:
        raise InputError(f"--output {out}: cannot write there ({e.strerror or e})") from None
    return out


# ----------------------------------------------------------------------------- candidates


@dataclass
class TrialSpec:
    """One configuration to measure: vLLM's arguments and the plan that produced them."""

    name: str
    source: str  # baseline | planner | user
    vllm_args: list[str]
    env: dict[str, str]
    plan: dict[str, Any]
    predicted: dict[str, Any] | None = None
    pins: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return flags_key(self.vllm_args)


def flags_key(args: Sequence[str]) -> str:
    """The identity of a configuration: its flags, order-free, without the port."""
    pairs: list[tuple[str, str]] = []
    for a in args:
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            pairs.append((name, value if eq else ""))
        elif pairs:
            name, value = pairs[-1]
            pairs[-1] = (name, f"{value} {a}".strip())
    return " ".join(f"{n}={v}" if v else n for n, v in sorted(p for p in pairs
                                                                if p[0] != "--port"))


_PLAN_KW: set[str] | None = None


def _plan_kwargs() -> set[str]:
    """make_plan's keyword arguments: the performance model's (workload, slo, objective) when
    the installed planner has them."""
    global _PLAN_KW
    if _PLAN_KW is None:
        _PLAN_KW = set(inspect.signature(make_plan).parameters)
    return _PLAN_KW


def plan_for(spec: ModelSpec, hw: Hardware, pins: Pins, workload: Workload, slo: SLO,
             objective: str):
    """make_plan for the workload, passing the performance model's inputs where supported."""
    kw: dict[str, Any] = {"suggest": False}
    wanted = {"workload": workload, "slo": slo, "objective": objective}
    kw.update({k: v for k, v in wanted.items() if k in _plan_kwargs()})
    return make_plan(spec, hw, pins, **kw)


def predicted_of(d: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """What the planner predicts for a plan: the performance model's knee when it has one, else
    a capacity proxy (requests the engine can hold at the workload's length, capped by
    max_num_seqs), which at least ranks the candidates the same way as their batch room."""
    perf = d.get("performance")
    if isinstance(perf, dict):
        knee = perf.get("knee") or perf.get("at") or {}
        return {"source": perf.get("source", "model"),
                "goodput_rps": knee.get("requests_per_s"),
                "concurrency": knee.get("concurrency"),
                "output_tokens_per_s": knee.get("output_tokens_per_s"),
                "tpot_ms": knee.get("tpot_ms"), "ttft_ms": knee.get("ttft_ms"),
                "score": float(knee.get("requests_per_s") or 0.0)}
    per_request = workload.input_len + workload.output_len
    dp = int(d.get("parallel", {}).get("dp", 1))
    held = d.get("kv_cache", {}).get("tokens", 0) / max(1, per_request) * dp
    seqs = int(d.get("max_num_seqs") or 0) * dp
    return {"source": "capacity", "concurrency": round(min(held, seqs), 1),
            "score": float(min(held, seqs))}


def baseline_args(d: dict[str, Any]) -> list[str]:
    """vLLM's defaults for this model: the plan's arguments less every knob tune varies.

    Kept: the model, its name, the layout (a model that needs 8 GPUs does not start on one) and
    the memory sizing (vLLM's CPU default reserves 92% of RAM and refuses to start on a busy
    machine; a lowered GPU utilization is the free memory's, not a tuning choice).
    """
    args = d["vllm_args"]
    keep_value = ("--model", "--served-model-name", "--tensor-parallel-size",
                  "--pipeline-parallel-size", "--data-parallel-size", "--max-model-len",
                  "--kv-cache-memory-bytes")
    out: list[str] = []
    for name in keep_value:
        value = arg_value(args, name)
        if value is not None:
            out += [name, value]
    if "--enable-expert-parallel" in args:
        out.append("--enable-expert-parallel")
    util = arg_value(args, "--gpu-memory-utilization")
    if util is not None and abs(float(util) - 0.92) > 1e-6:  # lowered for free memory
        out += ["--gpu-memory-utilization", util]
    return out


def knob_variants(spec: ModelSpec, hw: Hardware, pins: Pins, base: dict[str, Any],
                  layouts: list[Any]) -> Iterator[Pins]:
    """Pins for every combination of the restart knobs around the baseline plan's values.

    Knobs the user pinned stay pinned. fp8 KV is tried only where the planner's capability
    table says it works; enforce-eager only on GPUs (the CPU engine has no graphs to skip).
    """
    from ..predict.capabilities import fp8_kv_support

    seqs0, tokens0 = int(base["max_num_seqs"]), int(base["max_num_batched_tokens"])
    seqs = [pins.max_num_seqs] if pins.max_num_seqs else sorted(
        {max(1, seqs0 // 8), max(1, seqs0 // 4), max(1, seqs0 // 2), seqs0, seqs0 * 2})
    tokens = [pins.max_num_batched_tokens] if pins.max_num_batched_tokens else sorted(
        {tokens0 // 2, tokens0, tokens0 * 2} - {0})
    fp8_ok, _ = fp8_kv_support(hw, spec.attention, base["vllm_version"])
    dtypes = [pins.kv_cache_dtype] if pins.kv_cache_dtype else (
        ["auto", "fp8"] if fp8_ok else ["auto"])
    eager = [True] if pins.enforce_eager else ([False] if hw.is_cpu else [False, True])
    for layout, s, t, dt, e, mtp in itertools.product(layouts, seqs, tokens, dtypes, eager,
                                                      mtp_variants(spec, hw, pins, base)):
        yield dataclasses.replace(pins, max_num_seqs=s, max_num_batched_tokens=t,
                                  kv_cache_dtype=dt, enforce_eager=e, **layout, **mtp)


def mtp_variants(spec: ModelSpec, hw: Hardware, pins: Pins,
                 base: dict[str, Any]) -> list[dict[str, Any]]:
    """MTP as a knob: off and each num_speculative_tokens of profiles/serving.yaml where the
    model has an MTP layer and the version and platform load it; a pin stays pinned."""
    from ..predict import speculative

    if pins.speculative is not None or pins.num_speculative_tokens:
        return [{}]
    if not speculative.support(spec, hw, base["vllm_version"])[0]:
        return [{}]
    return [{"speculative": False}] + [{"speculative": True, "num_speculative_tokens": int(k)}
                                       for k in speculative.mtp_table()["candidates"]]


def _layout_pins(spec: ModelSpec, hw: Hardware, pins: Pins) -> list[dict[str, Any]]:
    from ..predict.planner import layouts

    if hw.is_cpu or pins.tp or pins.dp or pins.pp:
        return [{}]
    return [{"tp": L.tp, "pp": L.pp, "dp": L.dp, "expert_parallel": L.expert_parallel}
            for L in layouts(spec, hw, pins)]


def build_candidates(spec: ModelSpec, hw: Hardware, pins: Pins, workload: Workload, slo: SLO,
                     objective: str, user: Sequence[Sequence[str]] = ()
                     ) -> tuple[TrialSpec, list[TrialSpec], list[str]]:
    """(baseline, candidates ranked by predicted goodput, notes). Only plans that fit; the
    baseline's own flags are never a planner candidate twice."""
    context = workload.input_len + workload.output_len
    if pins.max_model_len is None:
        length = max(256, 1 << math.ceil(math.log2(context)))
        pins = dataclasses.replace(pins, max_model_len=min(length, spec.max_context))
    if pins.max_model_len < context:
        raise InputError(f"--max-model-len {pins.max_model_len:,} is shorter than the workload's "
                         f"{context:,} tokens per request")
    base_plan = plan_for(spec, hw, pins, workload, slo, objective)
    base = base_plan.to_dict()
    if not base["fits"]:
        raise InputError(f"{spec.name} does not fit {hw.describe()}: {base['problem']}; see "
                         "`vlaunch plan`")
    notes: list[str] = []
    defaults = defaults_plan(spec, hw, pins, base, workload, slo, objective, notes)
    baseline = TrialSpec("vLLM defaults", "baseline", baseline_args(defaults),
                         dict(defaults["env"]), defaults, predicted_of(defaults, workload),
                         {"max_model_len": pins.max_model_len})
    seen = {baseline.key, flags_key(defaults["vllm_args"])}
    ranked: list[TrialSpec] = []
    for variant in knob_variants(spec, hw, pins, base, _layout_pins(spec, hw, pins)):
        try:
            plan = plan_for(spec, hw, variant, workload, slo, objective)
        except InputError:
            continue
        d = plan.to_dict()
        if not d["fits"] or flags_key(d["vllm_args"]) in seen:
            continue
        seen.add(flags_key(d["vllm_args"]))
        ranked.append(TrialSpec(_describe(d), "planner", d["vllm_args"], dict(d["env"]), d,
                                predicted_of(d, workload), _pins_dict(variant)))
    ranked = rank_candidates(ranked, base)
    users = []
    for i, flags in enumerate(user, 1):
        args, _ = merge_args(baseline.vllm_args, list(flags))
        if flags_key(args) in seen:
            notes.append(f"--candidate {shlex.join(flags)}: same flags as another candidate")
            continue
        seen.add(flags_key(args))
        d = dict(base, vllm_args=args)
        users.append(TrialSpec(f"yours #{i}: {shlex.join(flags)}", "user", args,
                               dict(base["env"]), d, None, {"extra_args": list(flags)}))
    return baseline, users + ranked, notes


def defaults_plan(spec: ModelSpec, hw: Hardware, pins: Pins, base: dict[str, Any],
                  workload: Workload, slo: SLO, objective: str,
                  notes: list[str]) -> dict[str, Any]:
    """The plan of vLLM's defaults on the planner's layout: the scheduler limits `vllm serve`
    would pick (capabilities.batch_defaults), auto KV, no eager mode. Its dict is what the
    baseline's plan.json and calibration describe, so they match what was measured."""
    from ..predict.capabilities import batch_defaults

    p = base["parallel"]
    tokens, seqs = batch_defaults(hw, p["tp"] * p["pp"])
    layout = {} if hw.is_cpu else {"tp": p["tp"], "pp": p["pp"], "dp": p["dp"],
                                   "expert_parallel": p["expert_parallel"]}
    vanilla = dataclasses.replace(
        pins, max_num_seqs=pins.max_num_seqs or seqs,
        max_num_batched_tokens=pins.max_num_batched_tokens or max(tokens, pins.max_model_len
                                                                  or 0),
        kv_cache_dtype=pins.kv_cache_dtype or "auto", **layout)
    try:
        d = plan_for(spec, hw, vanilla, workload, slo, objective).to_dict()
    except InputError as e:
        d = {"fits": False, "problem": str(e)}
    if d["fits"]:
        return d
    notes.append(f"vLLM's defaults do not fit ({d['problem']}); the baseline keeps the "
                 "planner's scheduler limits and KV dtype")
    return base


def _changes(d: dict[str, Any], base: dict[str, Any]) -> int:
    """How many knobs differ from the baseline plan: among equal predictions, fewer changes
    first (the prediction cannot tell them apart, so the smaller step is the safer one)."""
    keys = ("max_num_seqs", "max_num_batched_tokens", "enforce_eager", "parallel")
    return sum(d.get(k) != base.get(k) for k in keys) + (
        d["kv_cache"]["dtype"] != base["kv_cache"]["dtype"]) + (
        _mtp_k(d) != _mtp_k(base))


def _mtp_k(d: dict[str, Any]) -> int:
    s = ((d.get("serving") or {}).get("speculative") or {})
    return int(s.get("num_speculative_tokens") or 0) if s.get("enabled") else 0


def rank_candidates(cands: list[TrialSpec], base: dict[str, Any]) -> list[TrialSpec]:
    """By predicted goodput, but the best of every layout before the second of any: a layout
    question (TP8 vs DP8+EP) is the one a prediction is least sure of, so each gets measured."""
    def key(t: TrialSpec) -> tuple:
        return (-(t.predicted or {}).get("score", 0.0), _changes(t.plan, base), t.key)

    ordered = sorted(cands, key=key)
    firsts: dict[str, TrialSpec] = {}
    for t in ordered:
        firsts.setdefault(json.dumps(t.plan.get("parallel"), sort_keys=True), t)
    leaders = sorted(firsts.values(), key=key)
    return leaders + [t for t in ordered if t not in leaders]


def _pins_dict(p: Pins) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(p).items() if v not in (None, False)}


def _describe(d: dict[str, Any]) -> str:
    p = d["parallel"]
    layout = f"TP{p['tp']}" + (f"xDP{p['dp']}" if p["dp"] > 1 else "") + (
        "+EP" if p["expert_parallel"] and p["dp"] * p["tp"] > 1 else "")
    text = (f"{layout} seqs={d['max_num_seqs']} batched={d['max_num_batched_tokens']} "
            f"kv={d['kv_cache']['dtype']}")
    text += f" mtp={_mtp_k(d)}" if _mtp_k(d) else ""
    return text + (" eager" if d.get("enforce_eager") else "")


# ----------------------------------------------------------------------------- rungs


def rung_sizes(n: int, max_starts: int, eta: int = 2, rungs: int | None = None) -> list[int]:
    """Engine starts per rung of successive halving, at most `max_starts` in all.

    About a third of the starts are kept for promotions (restarting the best of a rung to
    measure it more finely); the rest go to rung 0, which gets at least two starts (the
    baseline and one candidate) whenever there are two. `rungs=1` spends every start on rung 0.
    """
    if n < 1 or max_starts < 1:
        return []
    reserve = 0 if rungs == 1 or max_starts < 3 else max_starts // 3
    first = min(n, max_starts - reserve)
    sizes = [first]
    left = max_starts - first
    while left > 0 and sizes[-1] > 1 and (rungs is None or len(sizes) < rungs):
        size = min(math.ceil(sizes[-1] / eta), left)
        if size >= sizes[-1]:
            size = sizes[-1] - 1
        sizes.append(size)
        left -= size
    return sizes


# ----------------------------------------------------------------------------- knee search


@dataclass
class KneeSearch:
    """Doubling, then bisection, for the largest concurrency that meets the SLO.

    `probe(c) -> bool` measures one concurrency. State lives on the object so that a search
    cut short (budget, Ctrl-C) still says what it found: `lo` (the knee so far, 0 when even
    the smallest concurrency missed), `hi` (the first failing concurrency, None if none).
    """

    probe: Callable[[int], bool]
    max_concurrency: int
    resolution: float = 1.25
    hint: int | None = None
    lo: int = 0
    hi: int | None = None
    verdicts: dict[int, bool] = field(default_factory=dict)

    def _check(self, c: int) -> bool:
        if c not in self.verdicts:
            self.verdicts[c] = self.probe(c)
        ok = self.verdicts[c]
        if ok and c > self.lo:
            self.lo = c
        if not ok and (self.hi is None or c < self.hi):
            self.hi = c
        return ok

    def run(self) -> tuple[int, int | None]:
        top = max(1, self.max_concurrency)
        start = min(top, max(1, self.hint or 1))
        if self._check(start):
            c = start
            while c < top:
                c = min(top, c * 2)
                if not self._check(c):
                    break
        else:
            c = start // 2
            while c >= 1 and not self._check(c):
                c //= 2
            if self.lo == 0:
                return self.lo, self.hi
        while self.hi is not None and self.lo and self.hi - self.lo > 1 \
                and self.hi / self.lo > self.resolution:
            mid = max(self.lo + 1, min(self.hi - 1, round(math.sqrt(self.lo * self.hi))))
            self._check(mid)
        return self.lo, self.hi

    @property
    def bounded(self) -> bool:
        """True when a failing concurrency was seen (the knee is a knee, not the cap)."""
        return self.hi is not None


def fragile(point: dict[str, Any], slo: SLO, threshold: float = THRESHOLD,
            tolerance: float = FRAGILE_TOLERANCE) -> bool:
    """Would the verdict flip if every request were `tolerance` faster or slower? Then the
    spread is too large for one measurement and the point is repeated."""
    raw = point.get("raw") or {}
    ttfts, lats, outs = raw.get("ttfts"), raw.get("latencies"), raw.get("output_lens")
    if not (ttfts and lats and outs) or not (len(ttfts) == len(lats) == len(outs)):
        fraction = point.get("slo_fraction", 0.0)
        return threshold - tolerance < fraction < min(1.0, threshold + tolerance)
    done = [(t, (lat - t) / (n - 1) if n > 1 else 0.0)
            for t, lat, n in zip(ttfts, lats, outs, strict=True) if n and t is not None]
    if not done:
        return False

    def share(scale: float) -> float:
        ttft_s, tpot_s = slo.ttft_ms * scale / 1000, slo.tpot_ms * scale / 1000
        return sum(1 for t, p in done if t <= ttft_s and p <= tpot_s) / len(done)

    near = abs(point.get("slo_fraction", 0.0) - threshold) <= FRAGILE_SHARE
    return near and (share(1 - tolerance) >= threshold) != (share(1 + tolerance) >= threshold)


def flat_point(s: dict[str, Any], slo: SLO, threshold: float, repeat: int) -> dict[str, Any]:
    """A loadgen summary as one row of `results` (and a calibration point)."""
    met = s["completed"] > 0 and s["failed"] == 0 and s["slo_fraction"] >= threshold
    return {"concurrency": s["concurrency"], "input_len": s["input_len"],
            "output_len": s["output_len"], "num_prompts": s["num_prompts"],
            "output_tokens_per_s": s["output_tokens_per_s"],
            "requests_per_s": s["requests_per_s"], "goodput_rps": s["goodput_rps"],
            "tpot_ms": s["tpot_ms"]["mean"], "ttft_ms": s["ttft_ms"]["mean"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "completed": s["completed"], "failed": s["failed"],
            "good_requests": s["good_requests"], "slo_fraction": s["slo_fraction"],
            "slo_met": met, "repeat": repeat, "at": _now(), "raw": s["raw"]}


def pooled(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated measurements of one concurrency as one: request counts add up, rates average."""
    if len(points) == 1:
        return points[0]
    n = len(points)
    out = dict(points[-1])
    for key in ("output_tokens_per_s", "requests_per_s", "goodput_rps", "tpot_ms", "ttft_ms",
                "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
        vals = [p[key] for p in points if p.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
    out["completed"] = sum(p["completed"] for p in points)
    out["failed"] = sum(p["failed"] for p in points)
    out["good_requests"] = sum(p["good_requests"] for p in points)
    out["slo_fraction"] = round(out["good_requests"] / out["completed"], 4) if out[
        "completed"] else 0.0
    out["repeats"] = n
    return out


# ----------------------------------------------------------------------------- the tuner


@dataclass
class TuneOptions:
    workload: Workload
    slo: SLO
    objective: str = "balanced"
    budget_s: float = 1200.0
    max_starts: int = 6
    output: Path = Path("tune")
    resume: bool = False
    seed: int = 0
    threshold: float = THRESHOLD
    max_concurrency: int | None = None
    rungs: int | None = None
    eta: int = 2
    user_candidates: list[list[str]] = field(default_factory=list)
    startup_timeout: float | None = None
    plot: bool = False
    verbose: bool = False
    calibrate: bool = True


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Elapsed time and budget left on every line; heartbeats while waiting (in place on a
    terminal, one line each otherwise) so the user never waits in silence."""

    def __init__(self, budget_s: float, out: Callable[[str], None],
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.t0 = clock()
        self.budget_s = budget_s
        self.out = out
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._pending = False

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed

    def stamp(self) -> str:
        return f"[{_fmt_s(self.elapsed):>6} | {_fmt_s(self.left):>6} left]"

    def line(self, text: str) -> None:
        with self._lock:
            if self._pending:
                sys.stderr.write("\n")
                self._pending = False
            self.out(f"{self.stamp()} {text}")

    def tick(self, text: str) -> None:
        with self._lock:
            if self.tty:
                sys.stderr.write(f"\r{self.stamp()} {text}\x1b[K")
                sys.stderr.flush()
                self._pending = True
            else:
                self.out(f"{self.stamp()} {text}")


RunnerFactory = Callable[..., VllmRunner]
LoadgenFactory = Callable[[Path], Any]


def _default_runner(args: list[str], env: dict[str, str | None], **kw: Any) -> VllmRunner:
    # Trials are measured from this machine: vLLM listens on loopback only (a candidate's own
    # --host wins, and is warned about by the caller when it reaches beyond this machine).
    return VllmRunner(with_host(args), env=env, **kw)


def _default_loadgen(log_path: Path) -> LoadGenerator:
    return LoadGenerator(log_path=log_path)


class Tuner:
    """One `vlaunch tune` run. `run()` returns the exit status (0, or 128 + signal)."""

    def __init__(self, spec: ModelSpec, hw: Hardware, pins: Pins, opts: TuneOptions, *,
                 out: Callable[[str], None] = print, log: Callable[[str], None] | None = None,
                 runner_factory: RunnerFactory = _default_runner,
                 loadgen_factory: LoadgenFactory = _default_loadgen,
                 progress: Progress | None = None, tokenizer: str | None = None) -> None:
        self.spec, self.hw, self.pins, self.opts = spec, hw, pins, opts
        self.out = out
        self.runner_factory = runner_factory
        self.loadgen_factory = loadgen_factory
        self.progress = progress or Progress(opts.budget_s, log or out)
        self.tokenizer = tokenizer
        self.dir = Path(opts.output)
        self.starts = 0
        self.interrupted: int | None = None
        self.doc: dict[str, Any] = {}
        self.previous: dict[tuple[int, str], dict[str, Any]] = {}
        self.startup_times: list[float] = []
        self._specs: dict[str, TrialSpec] = {}
        self._sizes: list[int] = []

    # --- bookkeeping ---------------------------------------------------------------------

    def _load_previous(self) -> None:
        """Finished trials of an earlier run into the same folder (`--resume`)."""
        path = self.dir / TUNE_FILE
        if not self.opts.resume or not path.exists():
            return
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"--resume: cannot read {path} ({e})") from None
        for t in old.get("trials", []):
            if t.get("status") in ("ok", "infeasible"):
                self.previous[(int(t.get("rung", 0)), t.get("key", ""))] = t
            if t.get("status") == "infeasible":
                self.previous[(-1, t.get("key", ""))] = t  # never started again, any rung

    def _new_doc(self, baseline: TrialSpec, notes: list[str]) -> None:
        from ..predict.capabilities import installed_vllm

        o = self.opts
        self.doc = {
            "schema": SCHEMA, "vlaunch_version": __version__,
            "vllm_version": installed_vllm() or baseline.plan.get("vllm_version"),
            "started_at": _now(), "updated_at": _now(), "finished_at": None,
            "status": "running",
            "model": baseline.plan["model"], "hardware": baseline.plan["gpus"],
            "workload": {"input_len": o.workload.input_len, "output_len": o.workload.output_len,
                         "name": o.workload.name},
            "slo": {"ttft_ms": o.slo.ttft_ms, "tpot_ms": o.slo.tpot_ms,
                    "threshold": o.threshold},
            "objective": o.objective,
            "settings": {"budget_s": o.budget_s, "max_starts": o.max_starts, "seed": o.seed,
                         "eta": o.eta, "rungs": o.rungs, "max_concurrency": o.max_concurrency,
                         "resume": o.resume},
            "notes": notes, "starts": 0, "elapsed_s": 0.0,
            "baseline": None, "recommended": None, "trials": [],
        }

    def save(self) -> None:
        self.doc["updated_at"] = _now()
        self.doc["starts"] = self.starts
        self.doc["elapsed_s"] = round(self.progress.elapsed, 1)
        atomic_write(self.dir / TUNE_FILE, json.dumps(self.doc, indent=2, default=str) + "\n")

    def _trial_record(self, t: TrialSpec, rung: int) -> dict[str, Any]:
        rec = {"name": t.name, "source": t.source, "rung": rung, "key": t.key,
               "vllm_args": t.vllm_args, "env": t.env, "pins": t.pins,
               "predicted": t.predicted, "status": "skipped", "cause": "not reached",
               "started_at": None, "finished_at": None, "startup_s": None,
               "knee": None, "warmup": None, "results": []}
        self.doc["trials"].append(rec)
        return rec

    # --- signals -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """Outside a running engine a signal only sets a flag; the loop stops at its next
        check (inside one, the runner forwards it to vLLM's group)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: object) -> None:  # noqa: ARG001
            self.interrupted = signum

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _check(self, runner: VllmRunner | None = None) -> None:
        if runner is not None and runner.interrupted is not None:
            self.interrupted = runner.interrupted
        if self.interrupted is not None:
            raise Interrupted(self.interrupted)
        if self.progress.left <= STOP_MARGIN_S:
            raise BudgetExhausted()

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        o = self.opts
        if o.max_starts < 1:
            raise InputError("--max-starts must be at least 1")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._load_previous()
        self.progress.line(f"planning candidates for {self.spec.name} ...")
        baseline, cands, notes = build_candidates(self.spec, self.hw, self.pins, o.workload,
                                                  o.slo, o.objective, o.user_candidates)
        self._new_doc(baseline, notes)
        self.save()
        pool = [baseline, *cands]
        self._specs = {t.key: t for t in pool}
        sizes = rung_sizes(len(pool), o.max_starts, o.eta, o.rungs)
        self._sizes = sizes
        self.progress.line(f"tune {self.spec.name} on {self.hw.describe()}: "
                           f"{o.workload.describe()}, SLO {o.slo.describe()} for "
                           f"{o.threshold:.0%} of requests; {len(pool)} candidates "
                           f"({len(cands)} from the planner), rungs {sizes}, "
                           f"at most {o.max_starts} starts")
        for n in notes:
            self.progress.line(f"note: {n}")
        status = 0
        with self._signals():
            try:
                self._halving(pool, sizes)
                self.doc["status"] = "done"
            except Interrupted as e:
                self.doc["status"] = f"interrupted by {signal.Signals(e.signum).name}"
                status = 128 + e.signum
            except BudgetExhausted:
                self.doc["status"] = "budget spent"
        self._finish()
        return status

    def _halving(self, pool: list[TrialSpec], sizes: list[int]) -> None:
        entrants = pool[:sizes[0]] if sizes else []
        try:
            self._rungs(pool, entrants, sizes)
        finally:
            recorded = {r["key"] for r in self.doc["trials"]}
            for t in pool:
                if t.key in recorded:
                    continue
                rec = self._trial_record(t, 0)
                rec["cause"] = ("not reached: the run stopped first" if t in entrants else
                                "not measured: the planner ranked it below the rung-0 entrants")

    def _rungs(self, pool: list[TrialSpec], entrants: list[TrialSpec], sizes: list[int]) -> None:
        for rung, size in enumerate(sizes):
            if rung > 0:
                ok = [r for r in self.doc["trials"] if r["rung"] == rung - 1
                      and r["status"] == "ok"]
                if len(ok) < 2:
                    break
                ok.sort(key=lambda r: -self._score(r))
                by_key = {t.key: t for t in pool}
                entrants = [by_key[r["key"]] for r in ok[:size]]
                self.progress.line(f"rung {rung}: restarting the best {len(entrants)} of "
                                   f"{len(ok)} for a finer measurement")
            for t in entrants:
                self._trial(t, rung)
                self._decide()
                self.save()

    def _score(self, rec: dict[str, Any]) -> float:
        knee = rec.get("knee") or {}
        return float(knee.get("goodput_rps") or 0.0)

    # --- one trial -----------------------------------------------------------------------

    def _trial(self, t: TrialSpec, rung: int) -> None:
        rec = self._trial_record(t, rung)
        done = self.previous.get((rung, t.key)) or self.previous.get((-1, t.key))
        if done is not None:
            rec.update({k: v for k, v in done.items() if k not in ("rung",)})
            rec["resumed"] = True
            self.progress.line(f"{t.name}: {done['status']} in the earlier run, not "
                               "started again (--resume)")
            return
        failed = [r for r in self.doc["trials"] if r is not rec and r["key"] == t.key
                  and r["status"] == "infeasible"]
        if failed:
            rec["status"], rec["cause"] = "skipped", (f"same flags as '{failed[0]['name']}', "
                                                      f"which was infeasible")
            return
        if self.starts >= self.opts.max_starts:
            rec["cause"] = "--max-starts reached"
            return
        self._check()
        estimate = self._start_estimate(t)
        if self.progress.left - STOP_MARGIN_S < estimate:
            rec["cause"] = (f"budget: {_fmt_s(self.progress.left)} left, a start takes about "
                            f"{_fmt_s(estimate)}")
            self.progress.line(f"{t.name}: skipped ({rec['cause']})")
            return
        self._run_engine(t, rec, rung)

    def _start_estimate(self, t: TrialSpec) -> float:
        if self.startup_times:
            return max(self.startup_times)
        return 0.0  # nothing known yet: try, with the budget as the start-up deadline

    def _startup_deadline(self, t: TrialSpec) -> float:
        weights = float(t.plan.get("model", {}).get("weights_bytes") or 0)
        deadline = self.opts.startup_timeout or (STARTUP_SECONDS_BASE
                                                 + weights / STARTUP_BYTES_PER_SECOND)
        return max(1.0, min(deadline, self.progress.left - STOP_MARGIN_S))

    def _run_engine(self, t: TrialSpec, rec: dict[str, Any], rung: int) -> None:
        self.starts += 1
        n = self.starts
        log_path = self.dir / f"vllm-trial{n}.log"
        rec.update(started_at=_now(), status="failed", cause="started", log=str(log_path))
        self.save()
        self.progress.line(f"start {n}/{self.opts.max_starts} (rung {rung}): {t.name}")
        if self.opts.verbose:
            self.progress.line("  vllm " + shlex.join(redact_args(t.vllm_args)))
        if arg_value(t.vllm_args, "--host") and (warning := exposure_warning(t.vllm_args,
                                                                              t.env)):
            self.progress.line(f"  {warning}")
        env: dict[str, str | None] = dict(t.env)
        if arg_value(t.vllm_args, "--kv-cache-memory-bytes"):
            env["VLLM_CPU_KVCACHE_SPACE"] = None  # it would replace the pinned bytes
        runner = self.runner_factory(
            list(t.vllm_args), env, log_path=log_path, startup_timeout=self._startup_deadline(t),
            grace_period=10.0,
            on_phase=lambda phase: self.progress.line(f"  {phase}"))
        t0 = time.monotonic()
        with runner, runner.forward_signals():
            runner.start()
            # the log is always a new file: a resumed run's old one keeps its name
            rec["log"] = str(getattr(runner, "log_path", None) or log_path)
            outcome = self._wait_ready(runner, t)
            rec["startup_s"] = round(time.monotonic() - t0, 1)
            if not outcome.ready:
                self._start_failed(rec, outcome, runner)
                return
            self.startup_times.append(rec["startup_s"])
            smoke = runner.smoke_test(timeout=max(5.0, min(120.0, self.progress.left
                                                           - STOP_MARGIN_S)))
            if not smoke.ok:
                rec["status"], rec["cause"] = "infeasible", (
                    f"started, but the first request failed: {(smoke.error or '')[:300]}")
                self.progress.line(f"  infeasible: {rec['cause']}")
                return
            self.progress.line(f"  ready in {rec['startup_s']:.0f}s; measuring")
            try:
                self._measure(runner, t, rec, rung)
            finally:
                rec["finished_at"] = _now()
                self.save()
        self._check(runner)

    def _wait_ready(self, runner: VllmRunner, t: TrialSpec):
        """wait_ready, with a heartbeat line every few seconds while vLLM loads."""
        stop = threading.Event()

        def beat() -> None:
            t0 = time.monotonic()
            while not stop.wait(5.0):
                self.progress.tick(f"  starting {t.name}: {runner.phase or 'starting'} "
                                   f"({time.monotonic() - t0:.0f}s)")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            return runner.wait_ready()
        finally:
            stop.set()
            thread.join(timeout=1)

    def _start_failed(self, rec: dict[str, Any], outcome: Any, runner: VllmRunner) -> None:
        rec["finished_at"] = _now()
        if outcome.reason == "interrupted":
            rec["status"], rec["cause"] = "failed", "interrupted during start-up"
            self._check(runner)
        f = outcome.failure
        if outcome.reason == "timeout" and self.progress.left <= STOP_MARGIN_S + 1:
            rec["status"], rec["cause"] = "skipped", "the budget ran out during start-up"
        elif outcome.reason == "timeout":
            rec["status"], rec["cause"] = "infeasible", (
                f"start-up hung past {runner.startup_timeout:.0f}s (phase {outcome.phase})")
        else:
            rec["status"] = "infeasible"
            rec["cause"] = (f"{f.kind}: {f.message}" if f else
                            f"vLLM exited with status {outcome.returncode} during start-up")
            rec["failure"] = f.to_dict() if f else None
        self.progress.line(f"  {rec['status']}: {rec['cause'][:300]}")

    # --- measuring -----------------------------------------------------------------------

    def _max_concurrency(self, t: TrialSpec) -> int:
        if self.opts.max_concurrency:
            return self.opts.max_concurrency
        d = t.plan
        seqs = int(arg_value(t.vllm_args, "--max-num-seqs") or d.get("max_num_seqs") or 256)
        dp = int(d.get("parallel", {}).get("dp", 1))
        return max(64, 4 * seqs * dp)  # past max-num-seqs requests queue: TTFT finds the knee

    def _load_spec(self, runner: VllmRunner, c: int, prompts: int, warmups: int) -> LoadSpec:
        o = self.opts
        tokenizer = self.tokenizer or arg_value(runner.vllm_args, "--model") or runner.model_name
        return LoadSpec(runner.base_url, runner.model_name, tokenizer, o.workload.input_len,
                        o.workload.output_len, c, prompts, o.seed, o.slo.ttft_ms, o.slo.tpot_ms,
                        warmups)

    def _measure(self, runner: VllmRunner, t: TrialSpec, rec: dict[str, Any], rung: int) -> None:
        o = self.opts
        fine = 1 if rung >= len(self._sizes) - 1 else 0  # the last rung measures finely
        per_c = PROMPTS_PER_CONCURRENCY[fine]
        gen = self.loadgen_factory(self.dir / f"loadgen-trial{self.starts}.log")
        repeats = [0]

        def timeout() -> float:
            left = self.progress.left - STOP_MARGIN_S
            if left <= 0:
                raise BudgetExhausted()
            return left

        def heartbeat(c: int) -> Callable[[float], None]:
            def beat(waited: float) -> None:
                what = f"concurrency {c}" if c else "warm-up"
                self.progress.tick(f"  {what}: measuring ({waited:.0f}s)")
                if runner.interrupted is not None:
                    raise Interrupted(runner.interrupted)
            return beat

        def one(c: int, repeat: int) -> dict[str, Any]:
            spec = self._load_spec(runner, c, max(MIN_PROMPTS, per_c * c), min(c, 4))
            try:
                s = gen.run(spec, timeout=timeout(), heartbeat=heartbeat(c))
            except LoadgenError:
                if self.progress.left <= STOP_MARGIN_S + 1:  # cut off by the budget
                    raise BudgetExhausted() from None
                raise
            point = flat_point(s, o.slo, o.threshold, repeat)
            rec["results"].append(point)
            acc = measured_acceptance(point.get("raw") or {})
            if acc:  # MTP trials: what vLLM's benchmark measured, kept for the next plans
                rec["mtp_acceptance"] = acc
                record_acceptance(self.spec.name, acc)
            self.save()
            return point

        def probe(c: int) -> bool:
            self._check(runner)
            points = [one(c, 0)]
            while (fragile(points[-1], o.slo, o.threshold) and repeats[0] < MAX_REPEATS
                   and len(points) < 2):
                repeats[0] += 1
                self.progress.line(f"  concurrency {c}: verdict within 10% of the SLO, "
                                   "measuring again")
                self._check(runner)
                points.append(one(c, len(points)))
            p = pooled(points)
            met = p["failed"] == 0 and p["slo_fraction"] >= o.threshold
            self.progress.line(
                f"  concurrency {c:>4}: {p['output_tokens_per_s']:8.1f} tok/s, TTFT p50/p99 "
                f"{_ms(p['ttft_p50_ms'])}/{_ms(p['ttft_p99_ms'])}, TPOT p50/p99 "
                f"{_ms(p['tpot_p50_ms'])}/{_ms(p['tpot_p99_ms'])}, SLO met by "
                f"{p['slo_fraction']:.0%} -> {'meets' if met else 'misses'}")
            return met

        hint = None
        if rung > 0:
            prev = [r for r in self.doc["trials"] if r["key"] == t.key and r["rung"] < rung
                    and r.get("knee")]
            hint = prev[-1]["knee"]["concurrency"] if prev else None
        search = KneeSearch(probe, self._max_concurrency(t), RESOLUTION[fine], hint)
        cause = None
        try:
            with gen:
                rec["warmup"] = self._warmup(gen, runner, timeout, heartbeat)
                search.run()
        except LoadgenError as e:
            cause = f"the benchmark failed: {e}"
            if runner.poll() is not None:
                cause = f"vLLM exited during the measurement (status {runner.exit_status})"
        except BudgetExhausted:
            cause = "the budget ran out during the measurement (knee from what was measured)"
        except Interrupted:
            self._knee(rec, search, o)
            rec["status"], rec["cause"] = "failed", "interrupted; kept what was measured"
            raise
        self._knee(rec, search, o)
        if cause and not rec["knee"]:
            rec["status"], rec["cause"] = "failed", cause
        else:
            rec["status"], rec["cause"] = "ok", cause
            if cause:
                rec["partial"] = True
            self._calibrate(t, rec)
        k = rec["knee"] or {}
        bound = "bounded" if k.get("bounded") else "SLO met up to the largest tried"
        self.progress.line(f"  {rec['status']}: knee at concurrency {k.get('concurrency')} "
                           f"({bound}), goodput {k.get('goodput_rps') or 0:.2f} req/s"
                           + (f"; {cause}" if cause else ""))
        if cause and "budget" in cause:
            raise BudgetExhausted()

    def _warmup(self, gen: Any, runner: VllmRunner, timeout: Callable[[], float],
                heartbeat: Callable[[int], Callable[[float], None]]) -> dict[str, Any]:
        """An uncounted run first: the child's imports, the engine's first batches."""
        spec = self._load_spec(runner, 2, 4, 0)
        t0 = time.monotonic()
        s = gen.run(spec, timeout=timeout(), heartbeat=heartbeat(0))
        self.progress.line(f"  warm-up done in {time.monotonic() - t0:.0f}s (not counted)")
        return {"seconds": round(time.monotonic() - t0, 1), "completed": s["completed"]}

    def _knee(self, rec: dict[str, Any], search: KneeSearch, o: TuneOptions) -> None:
        """The trial's knee from its points: the largest concurrency that met the SLO."""
        if not rec["results"]:
            rec["knee"] = None
            return
        by_c: dict[int, list[dict[str, Any]]] = {}
        for p in rec["results"]:
            by_c.setdefault(p["concurrency"], []).append(p)
        c = search.lo
        point = pooled(by_c[c]) if c in by_c else pooled(by_c[min(by_c)])
        rec["knee"] = {
            "concurrency": c, "first_miss": search.hi, "bounded": search.bounded,
            "goodput_rps": point["goodput_rps"] if c else 0.0,
            "output_tokens_per_s": point["output_tokens_per_s"],
            "requests_per_s": point["requests_per_s"],
            "tpot_ms": point["tpot_ms"], "ttft_ms": point["ttft_ms"],
            "tpot_p50_ms": point["tpot_p50_ms"], "tpot_p99_ms": point["tpot_p99_ms"],
            "ttft_p50_ms": point["ttft_p50_ms"], "ttft_p99_ms": point["ttft_p99_ms"],
            "slo_fraction": point["slo_fraction"],
        }

    def _calibrate(self, t: TrialSpec, rec: dict[str, Any]) -> None:
        """Teach the performance model what was measured (launcher.predict.calibration)."""
        if not self.opts.calibrate or not rec["results"]:
            return
        from ..predict import calibration

        points = [{k: p[k] for k in ("concurrency", "input_len", "output_len",
                                     "output_tokens_per_s", "tpot_ms", "ttft_ms")}
                  for p in rec["results"] if p["completed"]]
        try:
            from ..paths import cache_dir

            cache_dir().mkdir(parents=True, exist_ok=True)  # record() writes beside it
            path = calibration.record(t.plan, points, f"vlaunch tune {_now()}")
        except Exception as e:  # noqa: BLE001 - a calibration problem must not lose the trial
            rec["calibration"] = f"not recorded: {type(e).__name__}: {e}"
            return
        rec["calibration"] = str(path)

    # --- choosing ------------------------------------------------------------------------

    def _decide(self) -> None:
        """Best so far: the highest goodput at the knee among ok trials, preferring the latest
        rung a configuration reached (its finest measurement); the baseline for comparison."""
        trials = self.doc["trials"]
        latest: dict[str, dict[str, Any]] = {}
        for r in trials:
            if r["status"] == "ok" and r.get("knee") and (
                    r["key"] not in latest or r["rung"] >= latest[r["key"]]["rung"]):
                latest[r["key"]] = r
        base = next((r for r in latest.values() if r["source"] == "baseline"), None)
        self.doc["baseline"] = self._summary(base) if base else None
        if not latest:
            self.doc["recommended"] = None
            return
        top_rung = max(r["rung"] for r in latest.values())
        finalists = [r for r in latest.values() if r["rung"] == top_rung] or list(latest.values())
        best = max(finalists, key=lambda r: (self._score(r),
                                             r["knee"]["output_tokens_per_s"] or 0.0,
                                             r["source"] == "baseline"))
        rec = {**self._summary(best), "why": self._why(best, base, len(latest))}
        self.doc["recommended"] = rec

    def _summary(self, r: dict[str, Any]) -> dict[str, Any]:
        k = r["knee"]
        return {"trial": r["name"], "rung": r["rung"], "source": r["source"],
                "vllm_args": r["vllm_args"], "concurrency": k["concurrency"],
                "knee_bounded": k["bounded"],
                "measured": {"output_tokens_per_s": k["output_tokens_per_s"],
                             "tpot_ms": k["tpot_ms"], "ttft_ms": k["ttft_ms"],
                             "goodput_rps": k["goodput_rps"],
                             "tpot_p99_ms": k["tpot_p99_ms"], "ttft_p99_ms": k["ttft_p99_ms"]}}

    def _why(self, best: dict[str, Any], base: dict[str, Any] | None, measured: int) -> str:
        k = best["knee"]
        text = (f"highest goodput at the SLO knee of {measured} measured configuration(s): "
                f"{k['goodput_rps']:.2f} req/s meeting {self.opts.slo.describe()} at "
                f"concurrency {k['concurrency']}")
        if base is None:
            return text + "; vLLM's defaults were not measured"
        if base is best:
            return text + "; vLLM's defaults were the best measured"
        b = base["knee"]
        gain = (k["goodput_rps"] / b["goodput_rps"] - 1) if b["goodput_rps"] else float("inf")
        return text + (f"; vLLM's defaults: {b['goodput_rps']:.2f} req/s at concurrency "
                       f"{b['concurrency']} ({gain:+.0%})")

    # --- the end -------------------------------------------------------------------------

    def _finish(self) -> None:
        self._decide()
        self.doc["finished_at"] = _now()
        self.save()
        for line in self.table():
            self.out(line)
        rec = self.doc["recommended"]
        if rec is None:
            self._best_partial()
            return
        plan = self._recommended_plan(rec)
        emit_plan(plan, self.dir)
        self.out(f"recommended: {rec['trial']} at concurrency {rec['concurrency']}: "
                 f"{rec['measured']['goodput_rps']:.2f} req/s goodput, "
                 f"{rec['measured']['output_tokens_per_s']:.1f} output tok/s")
        self.out(f"  why: {rec['why']}")
        self.out(f"  {self.dir / TUNE_FILE}; run it: vlaunch exec --plan "
                 f"{self.dir / 'plan.json'}" + (
                     " -- " + shlex.join(redact_args(plan["tuned"]["extra_args"]))
                     if plan["tuned"].get("extra_args") else ""))
        if self.opts.plot:
            self._plot()

    def _best_partial(self) -> None:
        """No finished trial: say what the cut-short ones measured (kept in tune.json, re-run
        by --resume), so an interruption still answers "how far did it get"."""
        cut = [r for r in self.doc["trials"] if r.get("knee") and r["knee"]["concurrency"]]
        if not cut:
            self.out("vlaunch: no configuration was measured; nothing to recommend "
                     f"(status: {self.doc['status']})")
            return
        best = max(cut, key=self._score)
        self.doc["best_so_far"] = {**self._summary(best), "final": False}
        self.save()
        k = best["knee"]
        self.out(f"best so far ({self.doc['status']}; not final, no plan.json): {best['name']}: "
                 f"SLO met up to concurrency {k['concurrency']} at least, "
                 f"{k['goodput_rps']:.2f} req/s goodput; --resume measures it again")

    def _recommended_plan(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The plan that `vlaunch exec --plan` runs: the planner's own plan of the chosen
        candidate (exec re-plans from its fields), with what was measured beside it."""
        trial = next(r for r in self.doc["trials"] if r["name"] == rec["trial"]
                     and r["rung"] == rec["rung"])
        spec = self._spec_of(trial)
        if spec is None:  # resumed from a run whose candidates differ: the baseline's plan
            spec = next(iter(self._specs.values()))
        plan = json.loads(json.dumps(spec.plan))
        plan["tuned"] = {"tune_json": str(self.dir / TUNE_FILE), "trial": rec["trial"],
                         "concurrency": rec["concurrency"], "measured": rec["measured"],
                         "slo": self.doc["slo"], "workload": self.doc["workload"],
                         "extra_args": trial["pins"].get("extra_args", [])}
        perf = plan.get("performance")
        if isinstance(perf, dict):
            perf["measured"] = {"source": "measured", "concurrency": rec["concurrency"],
                                **rec["measured"]}
        return plan

    def _spec_of(self, trial: dict[str, Any]) -> TrialSpec | None:
        return self._specs.get(trial["key"])

    def table(self) -> list[str]:
        """One row per trial: flags, knee, output tok/s, TTFT/TPOT p50/p99, goodput, status."""
        rows = [f"{'#':>2} {'rung':>4} {'configuration':44} {'knee':>5} {'tok/s':>8} "
                f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'goodput':>8}  status"]
        for i, r in enumerate(self.doc["trials"], 1):
            k = r.get("knee") or {}
            status = r["status"] + (f" ({r['cause'][:80]})" if r.get("cause") else "")
            rows.append(
                f"{i:>2} {r['rung']:>4} {r['name'][:44]:44} {_v(k.get('concurrency')):>5} "
                f"{_v(k.get('output_tokens_per_s'), '.1f'):>8} "
                f"{_ms(k.get('ttft_p50_ms')) + '/' + _ms(k.get('ttft_p99_ms')):>16} "
                f"{_ms(k.get('tpot_p50_ms')) + '/' + _ms(k.get('tpot_p99_ms')):>16} "
                f"{_v(k.get('goodput_rps'), '.2f'):>8}  {status}")
        return rows

    def _plot(self) -> None:
        """Measured curves (tok/s and TPOT against concurrency) next to the model's, as PNG."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.out("vlaunch: --plot needs matplotlib (pip install matplotlib); skipped")
            return
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for r in self.doc["trials"]:
            pts = sorted((p for p in r["results"]), key=lambda p: p["concurrency"])
            if not pts:
                continue
            xs = [p["concurrency"] for p in pts]
            line = ax1.plot(xs, [p["output_tokens_per_s"] for p in pts], "o-",
                            label=r["name"][:40])[0]
            ax2.plot(xs, [p["tpot_ms"] for p in pts], "o-", color=line.get_color())
            spec = self._spec_of(r)
            curve = ((spec.plan.get("performance") or {}).get("curve") if spec else None) or []
            if curve:
                cx = [c["concurrency"] for c in curve]
                ax1.plot(cx, [c["output_tokens_per_s"] for c in curve], "--",
                         color=line.get_color())
                ax2.plot(cx, [c["tpot_ms"] for c in curve], "--", color=line.get_color())
        ax2.axhline(self.opts.slo.tpot_ms, color="grey", linestyle=":")
        for ax, label in ((ax1, "output tokens/s"), (ax2, "TPOT ms (mean)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
        ax1.legend(fontsize=7)
        fig.suptitle("measured (solid) vs model (dashed)")
        path = self.dir / "tune.png"
        fig.savefig(path, dpi=100)
        self.out(f"plot: {path}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _v(v: Any, fmt: str = "") -> str:
    return "-" if v is None else format(v, fmt)


def tune(spec: ModelSpec, hw: Hardware, pins: Pins, opts: TuneOptions, *,
         out: Callable[[str], None] = print, **kw: Any) -> tuple[int, dict[str, Any]]:
    """Run a tune; (exit status, the tune.json document)."""
    tuner = Tuner(spec, hw, pins, opts, out=out, **kw)
    status = tuner.run()
    return status, tuner.doc
