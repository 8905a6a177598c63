"""`make bench`: how fast `vlaunch doctor` diagnoses a 50,000-line vLLM log.

Three logs of 50,000 lines. "serving": what a long-lived deployment leaves, a start-up, then
tens of thousands of request, stats and warning lines from 8 ranks, then the failure of a restart
(8 ranks out of memory, wrapped) at the end. "one launch": the same lines as a single launch
that fails while serving, so no line can be skipped. "crash loop": a pod restarting over and
over, every start-up and failure of the doctor's fixtures appended (every line a start-up
marker, a fact, a traceback or an error; read from its last launch). The goal is under 0.5 s
through the command line (Python's start included); the scan is also timed in-process (the
library, what `serve`/`tune` call).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.observe import doctor

ROOT = Path(__file__).resolve().parents[1]
FAILURE = ROOT / "tests" / "fixtures" / "doctor" / "ranks8_oom_tp8.log"
LINES = 50_000


def build_log(path: Path, lines: int = LINES) -> int:
    """Write a `lines`-line log ending in an 8-rank failure; returns the line count."""
    tail = FAILURE.read_text().splitlines()
    body = lines - len(tail)
    with path.open("w") as f:
        for i in range(body):
            r = i % 8
            kind = i % 5
            if kind == 0:
                f.write(f"(APIServer pid=1) INFO 11-30 10:{i // 3600 % 60:02d}:{i // 60 % 60:02d} "
                        f"[loggers.py:283] Engine 000: Avg prompt throughput: {i % 977}.0 "
                        f"tokens/s, Avg generation throughput: {i % 313}.4 tokens/s, Running: "
                        f"{i % 64} reqs, Waiting: 0 reqs, GPU KV cache usage: 41.2%\n")
            elif kind == 1:
                f.write(f'INFO:     10.0.{r}.{i % 250}:{40000 + i % 9999} - "POST /v1/chat/'
                        'completions HTTP/1.1" 200 OK\n')
            elif kind == 2:
                f.write(f"(Worker_TP{r} pid={300 + r}) WARNING 11-30 10:00:00 [utils.py:99] "
                        f"request {i} preempted: KV cache usage above watermark\n")
            elif kind == 3:
                f.write(f"(EngineCore pid=200) DEBUG 11-30 10:00:00 [core.py:1] step {i} "
                        f"scheduled {i % 128} tokens for {i % 64} requests\n")
            else:
                f.write(f"(APIServer pid=1) INFO 11-30 10:00:00 [logger.py:43] Received request "
                        f"chatcmpl-{i:08x}: prompt: 'hello world number {i}', params: "
                        "SamplingParams(n=1, temperature=0.7, max_tokens=256)\n")
        f.write("\n".join(tail) + "\n")
    return body + len(tail)


def build_crash_loop(path: Path, lines: int = LINES) -> int:
    """Write `lines` lines of appended failed start-ups (the fixtures, in name order)."""
    starts = [p.read_text() for p in sorted(FAILURE.parent.glob("*.log"))]
    out: list[str] = []
    while len(out) < lines:
        for text in starts:
            out += text.splitlines()
    path.write_text("\n".join(out[:lines]) + "\n")
    return lines


def build_one_launch(path: Path, lines: int = LINES) -> int:
    """The serving log as one launch: its start-up first, then the traffic, then the 8-rank
    failure without a launch line of its own (a failure while serving), so every line of the
    50,000 is scanned (nothing precedes the last launch to skip)."""
    tmp = path.with_suffix(".tmp")
    build_log(tmp, lines)
    text = tmp.read_text().splitlines(keepends=True)
    tmp.unlink()
    launch = [x for x in text if "non-default args: " in x]
    rest = [x for x in text if "non-default args: " not in x]
    path.write_text("".join(launch + rest))
    return len(launch) + len(rest)


def build_error_storm(path: Path, lines: int = LINES) -> int:
    """The worst case: one launch, then the fixtures' start-ups, tracebacks and errors over and
    over without another launch line, so every line is scanned and most take the slow path."""
    body = [x for p in sorted(FAILURE.parent.glob("*.log")) for x in p.read_text().splitlines()
            if "non-default args: " not in x]
    out = ["(APIServer pid=1) INFO 11-30 10:00:02 [api_utils.py:286] non-default args: "
           "{'model': 'org/model'}"]
    while len(out) < lines:
        out += body
    path.write_text("\n".join(out[:lines]) + "\n")
    return lines


def _cli_median(log: Path, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "launcher.cli", "doctor", str(log)],
                       capture_output=True, check=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "vllm.log"
        n = build_log(log)
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            report, _ = doctor.diagnose(str(log))
            samples.append(time.perf_counter() - t)
        root = report.root
        assert root is not None and root.cause == "cuda_oom" and root.ranks == 8, root
        print(f"`vlaunch doctor` on a {n:,}-line serving log ({log.stat().st_size / 1e6:.1f} "
              f"MB): library median {statistics.median(samples) * 1000:.0f} ms "
              f"(best {min(samples) * 1000:.0f} ms); command line median "
              f"{_cli_median(log) * 1000:.0f} ms (goal < 500); root cause {root.cause} on "
              f"{root.ranks} ranks")
        one = Path(tmp) / "one-launch.log"
        n = build_one_launch(one)
        t = time.perf_counter()
        report, _ = doctor.diagnose(str(one))
        lib = time.perf_counter() - t
        assert report.root is not None and report.launches == 1
        print(f"`vlaunch doctor` on a {n:,}-line log of one launch (every line scanned): "
              f"library {lib * 1000:.0f} ms; command line median {_cli_median(one) * 1000:.0f} "
              f"ms (goal < 500); root cause {report.root.cause}")
        loop = Path(tmp) / "crash-loop.log"
        n = build_crash_loop(loop)
        t = time.perf_counter()
        report, _ = doctor.diagnose(str(loop))
        lib = time.perf_counter() - t
        print(f"`vlaunch doctor` on a {n:,}-line crash-loop log ({report.launches:,} launches, "
              f"{loop.stat().st_size / 1e6:.1f} MB): library {lib * 1000:.0f} ms; command line "
              f"median {_cli_median(loop) * 1000:.0f} ms (goal < 500)")
        storm = Path(tmp) / "error-storm.log"
        n = build_error_storm(storm)
        t = time.perf_counter()
        doctor.diagnose(str(storm))
        lib = time.perf_counter() - t
        print(f"`vlaunch doctor` on a {n:,}-line error storm (one launch, every line a start-up "
              f"or error line, the worst case): library {lib * 1000:.0f} ms; command line "
              f"median {_cli_median(storm) * 1000:.0f} ms (goal < 500)")


if __name__ == "__main__":
    main()
