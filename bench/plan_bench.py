"""`make bench`: the validation table and how fast `vlaunch plan` answers."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import startup_validation as validation  # noqa: E402 - bench/, not the package

SHARED = ROOT.parent / "shared"
SHARED_CSV = SHARED / "validation" / "vllm-startup-observations.csv"


def _time(cmd: list[str], runs: int = 7) -> float:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    if SHARED_CSV.is_file():  # the shared data, when present, may have rows added since
        rows, skipped = validation.run(SHARED_CSV, (validation.CONFIGS,
                                                    SHARED / "reference" / "model-configs",
                                                    SHARED / "validation" / "corpus"))
        where = SHARED_CSV
    else:
        rows, skipped = validation.run()
        where = validation.CSV
    print(f"Budget model vs real vLLM start-ups ({where}):")
    print(validation.table(rows, skipped))
    bare = _time([sys.executable, "-c", "pass"])
    plan = _time([sys.executable, "-m", "launcher.cli", "plan", "deepseek-v3", "--gpus",
                  "8xH200", "--format", "json"])
    print(f"\n`vlaunch plan deepseek-v3 --gpus 8xH200`: median {plan * 1000:.0f} ms (goal < 300 "
          f"ms); bare `python -c pass`: {bare * 1000:.0f} ms; ratio {plan / bare:.1f}x")
    _search()


def _search() -> None:
    """The search alone, in process: how many candidates each plan judged, and how long."""
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import make_plan

    print("\nthe search (make_plan in process, median of 5):")
    for model, gpus, objective in (("deepseek-r1", "8xH200", "balanced"),
                                   ("deepseek-r1", "8xH200", "latency"),
                                   ("deepseek-r1", "2x8xH100", "throughput"),
                                   ("llama-3.1-70b", "2xH100", "balanced")):
        spec, hw = load_model(model), parse_gpus(gpus)
        samples, plan = [], None
        for _ in range(5):
            t = time.perf_counter()
            plan = make_plan(spec, hw, objective=objective)
            samples.append(time.perf_counter() - t)
        print(f"  {model} on {gpus}, {objective}: {statistics.median(samples) * 1000:.0f} ms, "
              f"{plan.judged} candidates judged, {plan.timed} timed -> {plan.chosen.label()}")


if __name__ == "__main__":
    main()
