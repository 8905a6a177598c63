"""Load generation with vLLM's own serving benchmark, run in a child process.

Why a child: `vllm.benchmarks.serve` imports vLLM, torch and transformers (seconds of start-up and
hundreds of MiB), and the vlaunch process must stay light (`vlaunch plan` imports nothing heavy).
So the benchmark runs in `python -m launcher.run.loadgen`, a small child that imports vLLM once and
then answers one request per line on stdin: the benchmark's argv in, its result dict out. One
child serves every measurement of a trial, so the import cost is paid once per trial, not once
per concurrency point.

Why vLLM's benchmark and not a loop of our own: its numbers (TTFT, TPOT, goodput against
`--goodput ttft:X tpot:Y`) are the ones vLLM users compare with, the random dataset with a fixed
seed gives the same prompts on every run, and `--num-warmups` sends requests that are not
counted.

Protocol (child side): the child moves its stdout to stderr at the file-descriptor level, so
whatever vLLM prints cannot corrupt the protocol, and writes one JSON object per answer on the
saved descriptor: `{"ok": true, "result": {...}}` or `{"ok": false, "error": "..."}`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Per-request lists of the raw result that grow with prompts x output tokens; dropped so that
# tune.json stays readable. Per-request TTFTs and latencies are kept (the spread is useful).
_BULKY_KEYS = ("generated_texts", "itls", "errors", "start_times", "input_lens")


class LoadgenError(RuntimeError):
    """The benchmark child failed: it crashed, timed out, or vLLM's benchmark raised."""


@dataclass(frozen=True)
class LoadSpec:
    """One measurement: a fixed-concurrency run of the random dataset against one server, or,
    with `prompts_path`, of vLLM's `custom` dataset (a JSONL file of {"prompt": ...} lines;
    `input_len` is then the prompts' own and not sent)."""

    base_url: str
    model: str
    tokenizer: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    num_warmups: int = 0
    prompts_path: str | None = None

    def validate(self) -> None:
        """Fail in the parent, with a plain message, rather than inside vLLM's argparse."""
        names = ("output_len", "concurrency", "num_prompts") + (
            () if self.prompts_path else ("input_len",))
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_warmups < 0:
            raise ValueError("num_warmups must not be negative")
        if self.prompts_path is not None and not self.prompts_path.endswith(".jsonl"):
            # CustomDataset.load_data raises NotImplementedError for any other name
            raise ValueError(f"vLLM's custom dataset reads only *.jsonl, got {self.prompts_path}")


def benchmark_argv(spec: LoadSpec) -> list[str]:
    """The arguments of `vllm bench serve` for `spec` (parsed by vLLM's own parser).

    Temperature 0 and the random dataset's `ignore_eos` make every request generate exactly
    `output_len` tokens, so runs with the same seed do the same work.

    With `prompts_path`, vLLM's `custom` dataset (datasets.py CustomDataset): each prompt goes
    through the tokenizer's chat template (as a chat user's request would), is shuffled with
    the seed, and asks for at most `--custom-output-len` tokens (its default, 256, would
    silently replace ours). `ignore_eos` is deliberately not set (serve.py sets it only for
    the random datasets): tokens forced past the end of an answer are not natural text and
    would inflate the draft's acceptance the way random prompts do; the answer length is
    bounded by `output_len`, and acceptance is a ratio, so shorter answers do not bias it.
    """
    if spec.prompts_path:
        dataset = ["--dataset-name", "custom", "--dataset-path", spec.prompts_path,
                   "--custom-output-len", str(spec.output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(spec.input_len),
                   "--random-output-len", str(spec.output_len)]
    argv = [
        "--backend", "vllm",
        "--base-url", spec.base_url.rstrip("/"),
        "--endpoint", "/v1/completions",
        "--model", spec.tokenizer,
        "--served-model-name", spec.model,
        "--tokenizer", spec.tokenizer,
        *dataset,
        "--num-prompts", str(spec.num_prompts),
        "--max-concurrency", str(spec.concurrency),
        "--request-rate", "inf",
        "--seed", str(spec.seed),
        "--temperature", "0",
        "--num-warmups", str(spec.num_warmups),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--disable-tqdm",
        "--save-detailed",  # keeps per-request TTFTs and lengths in the result (nothing saved)
    ]
    slo = []
    if spec.slo_ttft_ms is not None:
        slo.append(f"ttft:{spec.slo_ttft_ms:g}")
    if spec.slo_tpot_ms is not None:
        slo.append(f"tpot:{spec.slo_tpot_ms:g}")
    if slo:
        argv += ["--goodput", *slo]
    return argv


def _num(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    return float(value) if isinstance(value, int | float) else None


def summarize(raw: dict[str, Any], spec: LoadSpec) -> dict[str, Any]:
    """vLLM's result dict in vlaunch's terms (the raw dict, less bulky lists, under `raw`).

    `slo_fraction`: the share of completed requests that met both SLOs (vLLM counts a request
    as good when TTFT <= ttft and TPOT <= tpot); 1.0 when no SLO was given.
    """
    completed = int(raw.get("completed") or 0)
    duration = _num(raw, "duration") or 0.0
    goodput = _num(raw, "request_goodput")
    rps = _num(raw, "request_throughput") or 0.0
    good = round(goodput * duration) if goodput is not None else completed
    fraction = (good / completed) if completed else 0.0
    input_len: float | int = spec.input_len
    if spec.prompts_path:  # the prompts' own mean length, as vLLM's tokenizer counted it
        total_in = _num(raw, "total_input_tokens")
        input_len = round(total_in / completed, 1) if total_in and completed else 0
    return {
        "concurrency": spec.concurrency,
        "num_prompts": spec.num_prompts,
        "dataset": "custom" if spec.prompts_path else "random",
        "input_len": input_len,
        "output_len": spec.output_len,
        "completed": completed,
        "failed": int(raw.get("failed") or 0),
        "duration_s": duration,
        "output_tokens_per_s": _num(raw, "output_throughput") or 0.0,
        "requests_per_s": rps,
        "goodput_rps": goodput if goodput is not None else rps,
        "good_requests": good,
        "slo_fraction": round(fraction, 4),
        "ttft_ms": {"mean": _num(raw, "mean_ttft_ms"), "p50": _num(raw, "median_ttft_ms"),
                    "p90": _num(raw, "p90_ttft_ms"), "p99": _num(raw, "p99_ttft_ms")},
        "tpot_ms": {"mean": _num(raw, "mean_tpot_ms"), "p50": _num(raw, "median_tpot_ms"),
                    "p90": _num(raw, "p90_tpot_ms"), "p99": _num(raw, "p99_tpot_ms")},
        "raw": {k: v for k, v in raw.items() if k not in _BULKY_KEYS},
    }


class LoadGenerator:
    """A benchmark child that answers measurements until closed (one import of vLLM).

    `run(spec)` blocks until the child answers or `timeout` passes; while waiting it calls
    `heartbeat(seconds_waited)` about every `heartbeat_s`, so a caller can show progress.
    The child runs in its own session: a Ctrl-C at the terminal reaches vlaunch, which stops it.
    """

    def __init__(self, python: str | None = None, *, log_path: str | os.PathLike[str] | None = None,
                 env: dict[str, str] | None = None, heartbeat_s: float = 5.0) -> None:
        self.python = python or sys.executable
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.heartbeat_s = heartbeat_s
        self._proc: subprocess.Popen[str] | None = None
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._tail: deque[str] = deque(maxlen=60)

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
        self._answers = queue.Queue()
        self._proc = subprocess.Popen(
            [self.python, "-m", "launcher.run.loadgen"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True)
        threading.Thread(target=self._read_answers, args=(self._proc,), daemon=True).start()
        threading.Thread(target=self._read_log, args=(self._proc,), daemon=True).start()
        return self._proc

    def _read_answers(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._answers.put(line)
        self._answers.put(None)  # end of file: the child is gone

    def _read_log(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        log = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115
        try:
            for line in proc.stderr:
                self._tail.append(line.rstrip("\n"))
                if log:
                    log.write(line)
                    log.flush()
        finally:
            if log:
                log.close()

    def tail(self, lines: int = 15) -> str:
        return "\n".join(list(self._tail)[-lines:])

    def run(self, spec: LoadSpec, timeout: float = 600.0,
            heartbeat: Callable[[float], None] | None = None) -> dict[str, Any]:
        """Measure `spec`; the summary of `summarize`. Raises LoadgenError on any failure."""
        spec.validate()
        proc = self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps({"argv": benchmark_argv(spec)}) + "\n")
            proc.stdin.flush()
        except OSError as e:
            raise LoadgenError(f"the benchmark child is gone ({e}); its last words:\n"
                               f"{self.tail()}") from None
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            if waited >= timeout:
                self.close()
                raise LoadgenError(f"the benchmark at concurrency {spec.concurrency} took longer "
                                   f"than {timeout:.0f}s; stopped it")
            try:
                line = self._answers.get(timeout=min(self.heartbeat_s, timeout - waited))
            except queue.Empty:
                if heartbeat is not None:
                    heartbeat(time.monotonic() - started)
                continue
            if line is None:
                code = proc.wait()
                self._proc = None
                raise LoadgenError(f"the benchmark child exited with status {code}; its last "
                                   f"words:\n{self.tail()}")
            return self._answer(line, spec)

    def _answer(self, line: str, spec: LoadSpec) -> dict[str, Any]:
        try:
            answer = json.loads(line)
        except ValueError:
            raise LoadgenError(f"the benchmark child wrote something else than JSON: "
                               f"{line[:200]!r}") from None
        if not answer.get("ok"):
            raise LoadgenError(f"vLLM's benchmark failed at concurrency {spec.concurrency}: "
                               f"{answer.get('error')}")
        return summarize(answer["result"], spec)

    def close(self) -> None:
        """Stop the child: end of input, then SIGTERM, then SIGKILL (its whole session)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            for sig in (15, 9):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- child side


def _jsonable(value: Any) -> Any:
    """vLLM's result holds numpy scalars and tuples; JSON wants plain numbers and lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


def _measure(argv: Sequence[str]) -> dict[str, Any]:
    import argparse

    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(list(argv))
    return _jsonable(serve.main(args))


def child_main() -> int:
    """Answer one benchmark per stdin line until end of input (see the module docstring)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints go to stderr, never into the protocol
    sys.stdout = os.fdopen(1, "w", buffering=1)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            argv = json.loads(line)["argv"]
            answer = {"ok": True, "result": _measure(argv)}
        except SystemExit as e:  # argparse refusing the argv
            answer = {"ok": False, "error": f"bad benchmark arguments (exit {e.code})"}
        except BaseException as e:  # noqa: BLE001 - every failure is an answer, not a crash
            traceback.print_exc()
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
