"""The exporter under abuse: idle and half-sent connections, and a stuck NVML (issue 23).

Why: the review held 4,000 half-sent requests open against prometheus_client's server (4,002
threads), made real scrapes time out with ~1,020 idle connections, and measured a median 22 s
per scrape with a stuck NVML. This replays those three on loopback and prints what they cost
now: threads held, and the latency of real scrapes while the abuse goes on.
Targets: threads bounded by the pool (not one per connection); real scrapes under 100 ms at
the median while 4,000 connections are open; with NVML stuck, only the first scrape waits
(up to the exporter's 2 s timeout), the median stays under 100 ms.

Run: `.venv/bin/python bench/exporter_abuse_bench.py [--connections 4000] [--scrapes 20]`
(`make bench` runs it).
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.observe.exporter import Exporter  # noqa: E402


def _scrape_ms(port: int) -> float:
    t0 = time.perf_counter()
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    return (time.perf_counter() - t0) * 1000


def _flood(port: int, n: int, half_sent: bool) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if half_sent:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    return socks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=4000)
    ap.add_argument("--scrapes", type=int, default=20)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * args.connections + 256  # both ends of every connection live in this process
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
        soft = min(want, hard)
    n = min(args.connections, (soft - 256) // 2)

    exp = Exporter(None, gpu_reader=None)
    port = exp.start(0)
    base_threads = threading.active_count()
    try:
        for label, half in (("idle", False), ("half-sent", True)):
            socks = _flood(port, n, half)
            try:
                time.sleep(0.5)
                threads = threading.active_count() - base_threads
                took = [_scrape_ms(port) for _ in range(args.scrapes)]
                print(f"{n:,} {label} connections: {threads} extra threads; real scrapes "
                      f"median {statistics.median(took):.1f} ms, max {max(took):.1f} ms "
                      f"(all {len(took)} answered)")
            finally:
                for s in socks:
                    s.close()
    finally:
        exp.stop()

    release = threading.Event()
    calls = []

    def stuck_nvml() -> list:
        calls.append(1)
        release.wait(600)
        return []

    exp = Exporter(None, gpu_reader=stuck_nvml)  # default timeout (2 s) and cache TTL (1 s)
    try:
        took = []
        for _ in range(args.scrapes):
            t0 = time.perf_counter()
            exp.render()
            took.append((time.perf_counter() - t0) * 1000)
        print(f"stuck NVML, {args.scrapes} scrapes: first {took[0]:.0f} ms, median "
              f"{statistics.median(took):.1f} ms, NVML calls {len(calls)} (review: median "
              "22,000 ms)")
    finally:
        release.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
