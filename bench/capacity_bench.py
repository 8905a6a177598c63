"""How fast `vlaunch capacity` answers: ten explicit GPU options, and the default catalog sweep.

Goal (issue): ten options under 1 s. Times are medians of in-process runs, so they measure the
planner and the performance model, not Python's start-up.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.inputs.model import load_model  # noqa: E402
from launcher.inputs.workload import SLO, Workload  # noqa: E402
from launcher.predict.capacity import capacity  # noqa: E402
from launcher.predict.search.planner import Pins  # noqa: E402

TEN = ["8xH100", "8xH200", "8xA100-80GB", "8xB200", "8xL40S", "8xH100-PCIe", "2xGH200",
       "4xH100-NVL", "8xB300", "8xA100-40GB"]


def _median(fn, runs: int = 5) -> float:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> int:
    load, w, slo = capacity.Load(users=500), Workload(1024, 256), SLO()
    for model, pins in (("llama-3.1-70b", Pins(max_model_len=8192)), ("deepseek-r1", Pins())):
        spec = load_model(model)
        ten = _median(lambda s=spec, p=pins: capacity.plan_capacity(s, load, w, slo, TEN,
                                                                    pins=p))
        sweep = _median(lambda s=spec, p=pins: capacity.plan_capacity(s, load, w, slo, None,
                                                                      pins=p))
        print(f"capacity {model}: ten explicit options {ten * 1000:.0f} ms (goal < 1,000 ms); "
              f"default catalog sweep {sweep * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
