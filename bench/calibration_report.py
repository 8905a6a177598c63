"""Print how well each recorded calibration fits the points it was fitted to.

`make tune-demo` runs this after its tune: the fitted and the uncalibrated median |error| of
output tokens/s per engine. The figure moves with whatever else shares the machine, which is why
it is printed here and not asserted by a test (tests/test_tune_engine.py asserts only that the
fit is no worse than no fit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> int:
    store = Path(path)
    if not store.is_file():
        print(f"no calibration recorded at {store}")
        return 1
    for key, entry in json.loads(store.read_text()).items():
        if not isinstance(entry, dict) or "median_error" not in entry:
            continue
        print(f"== calibration {key}: median |error| of output tok/s "
              f"{entry['median_error']:.1%} fitted, "
              f"{entry.get('median_error_uncalibrated', float('nan')):.1%} uncalibrated, "
              f"on {len(entry.get('points', []))} points; the fit's RMS log error "
              f"{entry.get('fit_loss', float('nan')):.3f} against "
              f"{entry.get('fit_loss_uncalibrated', float('nan')):.3f} unfitted")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
