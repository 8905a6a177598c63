"""`make bench`: the validation table and how fast `vlaunch plan` answers."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from launcher.predict import validation

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT.parent / "shared" / "validation" / "vllm-startup-observations.csv"


def _time(cmd: list[str], runs: int = 7) -> float:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    if CSV.is_file():
        rows, skipped = validation.run(CSV)
        print("Budget model vs real vLLM start-ups (shared/validation):")
        print(validation.table(rows, skipped))
    else:
        print(f"validation data not found at {CSV}; skipped")
    bare = _time([sys.executable, "-c", "pass"])
    plan = _time([sys.executable, "-m", "launcher.cli", "plan", "deepseek-v3", "--gpus",
                  "8xH200", "--format", "json"])
    print(f"\n`vlaunch plan deepseek-v3 --gpus 8xH200`: median {plan * 1000:.0f} ms; "
          f"bare `python -c pass`: {bare * 1000:.0f} ms; ratio {plan / bare:.1f}x")


if __name__ == "__main__":
    main()
