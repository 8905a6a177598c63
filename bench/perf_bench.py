"""The performance model against published vLLM serving measurements, row by row.

Prints each expressible row of shared/validation/vllm-perf-observations.csv (TPOT and output
tokens/s, predicted vs observed), the rows the model cannot express and why, and the median
|error| of each quantity (goal: <= 25% on both).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.predict import perf_validation  # noqa: E402

CSV = Path(__file__).resolve().parents[2] / "shared" / "validation" / "vllm-perf-observations.csv"


def main() -> int:
    if not CSV.is_file():
        print(f"skipped: {CSV} not found (shared validation data absent)")
        return 0
    results, skipped = perf_validation.run(CSV)
    print(perf_validation.table(results, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
