"""The performance model against published vLLM serving measurements, row by row.

Prints each expressible row of tests/fixtures/perf/ (TPOT, output tokens/s, TTFT and MTP
speed-ups, predicted vs observed with the shipped constants, each row under the client it ran),
the rows the model cannot express and why, and the headline: the leave-one-source-out median
|error| of each (every publication's rows predicted by constants fitted to the others only;
goal TPOT and tok/s <= 10%, TTFT <= 25%) with the in-sample figure beside it; then MTP's
equal-load speed-up over load for DeepSeek-R1 on 8xH200 (issue 28's open property).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import perf_fit  # noqa: E402
import perf_validation  # noqa: E402


def main() -> int:
    t0 = time.perf_counter()
    results, skipped = perf_validation.run()
    print(perf_validation.table(results, skipped))
    held = perf_fit.leave_one_source_out()
    print(perf_fit.headline(results, held))
    print()
    print(perf_validation.mtp_curve_table())
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
