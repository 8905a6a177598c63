"""Python-side cost of one `read_inventory()` over a scripted 8x H200 NVML.

Why: the exporter polls the inventory on every Prometheus scrape and `vlaunch plan` reads it on
start-up, so one reading must cost milliseconds. The scripted NVML (tests/nvml_script.py) answers
instantly, so this measures our side only: the thread hand-off with its deadline, the visibility
rules, building the records. The first call (init, static facts, NVLink links) is timed apart
from the polls that reuse the cached handles. A real driver adds its own per-call latency.

Run: `.venv/bin/python bench/inventory_bench.py [--reads 2000]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import nvml_script  # noqa: E402

from launcher.inputs import inventory  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=2000)
    args = parser.parse_args()
    script = nvml_script.hgx_h200()
    with script.installed():
        inventory.shutdown()
        t0 = time.perf_counter()
        inv = inventory.read_inventory()
        first_ms = (time.perf_counter() - t0) * 1e3
        assert len(inv.devices) == 8 and not inv.errors, inv.errors
        times = []
        for _ in range(args.reads):
            t0 = time.perf_counter()
            inventory.read_inventory()
            times.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        for _ in range(args.reads // 10):
            inventory.detect_hardware()
        detect_ms = (time.perf_counter() - t0) * 1e3 / max(1, args.reads // 10)
        calls = sum(script.calls.values())
        inventory.shutdown()
    print(f"read_inventory over scripted 8x H200 ({args.reads} reads)")
    print(f"  first read (init + static facts): {first_ms:.2f} ms")
    print(f"  poll p50 {statistics.median(times):.3f} ms  p99 {percentile(times, 0.99):.3f} ms  "
          f"max {max(times):.3f} ms")
    print(f"  read + detect_hardware: {detect_ms:.3f} ms")
    print(f"  NVML binding calls in total: {calls}")


if __name__ == "__main__":
    main()
