"""The benchmark child (`launcher.run.loadgen`): protocol, failures, and the numbers it reports.

The child is tested against a stand-in `vllm.benchmarks.serve` placed first on PYTHONPATH, so
these run without vLLM; `test_vllm_parser_accepts_our_argv` (engine) checks the real parser.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.run import loadgen
from launcher.run.loadgen import LoadGenerator, LoadgenError, LoadSpec, benchmark_argv, summarize

SPEC = LoadSpec("http://127.0.0.1:9/", "tiny", "/models/tiny", 64, 32, 8, 24, seed=3,
                slo_ttft_ms=1500, slo_tpot_ms=60, num_warmups=4)

FAKE_SERVE = textwrap.dedent(
    """
    import sys

    VALUES = ("--backend", "--base-url", "--endpoint", "--model", "--served-model-name",
              "--tokenizer", "--dataset-name", "--random-input-len", "--random-output-len",
              "--request-rate", "--seed", "--temperature", "--num-warmups",
              "--percentile-metrics", "--metric-percentiles")

    def add_cli_args(parser):
        for name in VALUES:
            parser.add_argument(name)
        parser.add_argument("--max-concurrency", type=int)
        parser.add_argument("--num-prompts", type=int)
        parser.add_argument("--goodput", nargs="+")
        parser.add_argument("--disable-tqdm", action="store_true")
        parser.add_argument("--save-detailed", action="store_true")

    def main(args):
        print("vLLM-style chatter on stdout", flush=True)
        if args.max_concurrency == 13:
            raise RuntimeError("All requests failed")
        if args.max_concurrency == 99:
            sys.stdout.flush()
            import os
            os._exit(7)
        n = args.num_prompts
        return {"completed": n, "failed": 0, "duration": 2.0, "request_throughput": n / 2,
                "request_goodput": n / 4, "output_throughput": 16.0 * n,
                "mean_ttft_ms": 100.0, "median_ttft_ms": 90.0, "p99_ttft_ms": 300.0,
                "mean_tpot_ms": 20.0, "median_tpot_ms": 19.0, "p99_tpot_ms": 40.0,
                "generated_texts": ["x"] * n, "ttfts": [0.1] * n, "goodput_args": args.goodput}
    """
)


@pytest.fixture()
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "vllm" / "benchmarks"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "serve.py").write_text(FAKE_SERVE)
    return {"PYTHONPATH": str(tmp_path)}


def test_argv_carries_the_workload_slo_and_seed():
    argv = benchmark_argv(SPEC)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--base-url") == "http://127.0.0.1:9"
    assert value("--served-model-name") == "tiny" and value("--tokenizer") == "/models/tiny"
    assert value("--dataset-name") == "random"
    assert (value("--random-input-len"), value("--random-output-len")) == ("64", "32")
    assert (value("--max-concurrency"), value("--num-prompts")) == ("8", "24")
    assert value("--seed") == "3" and value("--num-warmups") == "4"
    assert argv[argv.index("--goodput") + 1:][:2] == ["ttft:1500", "tpot:60"]


def test_natural_prompts_use_vllms_custom_dataset_with_our_output_cap():
    spec = LoadSpec(**{**SPEC.__dict__, "input_len": 0, "prompts_path": "/tmp/p.jsonl"})
    argv = benchmark_argv(spec)

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--dataset-name") == "custom" and value("--dataset-path") == "/tmp/p.jsonl"
    # vLLM's default --custom-output-len (256) would replace the per-request length otherwise
    assert value("--custom-output-len") == "32"
    assert "random" not in argv and not any(a.startswith("--random") for a in argv)
    assert "--ignore-eos" not in argv  # answers end where the model ends them
    assert (value("--max-concurrency"), value("--num-prompts")) == ("8", "24")
    spec.validate()  # input_len is the prompts' own
    with pytest.raises(ValueError, match="jsonl"):
        LoadSpec(**{**spec.__dict__, "prompts_path": "/tmp/p.txt"}).validate()
    with pytest.raises(ValueError, match="input_len"):
        LoadSpec(**{**SPEC.__dict__, "input_len": 0}).validate()
    s = summarize({"completed": 4, "total_input_tokens": 90, "duration": 1.0}, spec)
    assert s["dataset"] == "custom" and s["input_len"] == 22.5
    assert summarize({"completed": 4}, SPEC)["input_len"] == 64


def test_summary_reports_goodput_share_and_drops_bulky_lists():
    raw = {"completed": 20, "failed": 0, "duration": 4.0, "request_throughput": 5.0,
           "request_goodput": 4.5, "output_throughput": 160.0, "mean_ttft_ms": 100.0,
           "median_ttft_ms": 90.0, "p99_ttft_ms": 300.0, "mean_tpot_ms": 20.0,
           "median_tpot_ms": 19.0, "p99_tpot_ms": 40.0, "generated_texts": ["a"] * 20,
           "itls": [[0.1]] * 20, "ttfts": [0.1] * 20}
    s = summarize(raw, SPEC)
    assert s["slo_fraction"] == 0.9 and s["good_requests"] == 18
    assert s["goodput_rps"] == 4.5 and s["output_tokens_per_s"] == 160.0
    assert s["ttft_ms"] == {"mean": 100.0, "p50": 90.0, "p90": None, "p99": 300.0}
    assert s["tpot_ms"]["p99"] == 40.0
    assert "generated_texts" not in s["raw"] and "itls" not in s["raw"]
    assert s["raw"]["ttfts"] == [0.1] * 20


def test_one_child_answers_many_runs_and_reports_failures(fake_vllm, tmp_path: Path):
    log = tmp_path / "child.log"
    with LoadGenerator(env=fake_vllm, log_path=log) as gen:
        first = gen.run(SPEC, timeout=60)
        second = gen.run(LoadSpec(**{**SPEC.__dict__, "concurrency": 4, "num_prompts": 8}))
        pid = gen._proc.pid
        assert first["completed"] == 24 and second["completed"] == 8
        assert first["raw"]["goodput_args"] == ["ttft:1500", "tpot:60"]
        assert first["slo_fraction"] == 0.5
        with pytest.raises(LoadgenError, match="All requests failed"):
            gen.run(LoadSpec(**{**SPEC.__dict__, "concurrency": 13}))
        # a benchmark error is an answer: the same child goes on
        assert gen.run(SPEC)["completed"] == 24 and gen._proc.pid == pid
        with pytest.raises(LoadgenError, match="exited with status 7"):
            gen.run(LoadSpec(**{**SPEC.__dict__, "concurrency": 99}))
    assert "vLLM-style chatter" in log.read_text()  # vLLM's prints go to the log, not the pipe


def test_a_child_that_cannot_import_vllm_is_a_clear_error(tmp_path: Path):
    empty = tmp_path / "no-vllm"
    (empty / "vllm").mkdir(parents=True)
    (empty / "vllm" / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    with LoadGenerator(env={"PYTHONPATH": str(empty)}) as gen, \
            pytest.raises(LoadgenError, match="no vllm here"):
        gen.run(SPEC, timeout=60)


def test_a_hung_benchmark_times_out(fake_vllm, tmp_path: Path):
    serve = Path(fake_vllm["PYTHONPATH"]) / "vllm" / "benchmarks" / "serve.py"
    serve.write_text(FAKE_SERVE.replace("n = args.num_prompts",
                                        "import time; time.sleep(60); n = 0"))
    beats: list[float] = []
    gen = LoadGenerator(env=fake_vllm, heartbeat_s=0.2)
    with pytest.raises(LoadgenError, match="longer than 1s"):
        gen.run(SPEC, timeout=1.0, heartbeat=beats.append)
    assert beats, "no heartbeat while waiting"
    assert gen._proc is None


def test_importing_loadgen_imports_nothing_heavy():
    code = ("import sys, launcher.run.loadgen, launcher.run.tune\n"
            "print([m for m in ('vllm', 'torch', 'transformers', 'numpy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
    assert loadgen.LoadSpec is LoadSpec


@pytest.mark.engine
def test_vllm_parser_accepts_our_argv():
    """vLLM's own parser takes every flag we pass (a renamed flag would fail here first)."""
    code = ("import argparse, json, sys\n"
            "from vllm.benchmarks import serve\n"
            "p = argparse.ArgumentParser(); serve.add_cli_args(p)\n"
            "a = p.parse_args(json.loads(sys.argv[1]))\n"
            "print(json.dumps([a.max_concurrency, a.random_input_len, a.goodput, a.seed,"
            " a.num_warmups, a.save_detailed, a.dataset_name, a.dataset_path,"
            " a.custom_output_len, a.ignore_eos]))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(benchmark_argv(SPEC))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [8, 64, ["ttft:1500", "tpot:60"],
                                                             3, 4, True, "random", None, 256,
                                                             False]
    custom = LoadSpec(**{**SPEC.__dict__, "prompts_path": "/tmp/p.jsonl"})
    r = subprocess.run([sys.executable, "-c", code, json.dumps(benchmark_argv(custom))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])[6:] == ["custom", "/tmp/p.jsonl", 32,
                                                                 False]
