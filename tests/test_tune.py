"""`vlaunch tune` without vLLM: the bookkeeping, the knee search and the CLI's input checks.

The end-to-end tests run the real Tuner, VllmRunner and process supervision against a stand-in
server (a small script below that logs like vLLM, serves /health, /v1/models, /v1/completions
and its own argv on /args, and dies with vLLM's KV-shortage error when its pinned KV memory
is tiny) and a stand-in load generator whose latencies follow a simple queueing model of the
flags that server was started with. The engine tests (`test_tune_engine.py`) do it for real.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.prompts import builtin_prompts, load_prompts
from launcher.inputs.workload import SLO, Workload
from launcher.predict.features import speculative as SP
from launcher.predict.search.planner import Pins
from launcher.run import tune as T
from launcher.run import tune_search as S
from launcher.run.emit import load_plan
from launcher.run.loadgen import LoadSpec, benchmark_argv, summarize
from launcher.run.runner import VllmRunner
from launcher.run.tinymodel import config_dict
from launcher.run.vllmargs import arg_value

FAKE_VLLM = textwrap.dedent(
    r"""
    import http.server, json, os, subprocess, sys

    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    name = args[args.index("--served-model-name") + 1] if "--served-model-name" in args \
        else args[args.index("--model") + 1]
    with open(os.environ["FAKE_STARTS"], "a") as f:
        f.write(json.dumps(args) + "\n")
    if os.environ.get("FAKE_NO_MODULE"):  # what `python -m vllm...` says without vLLM
        print("/usr/bin/python3: Error while finding module specification for 'vllm.entrypoints"
              ".openai.api_server' (ModuleNotFoundError: No module named 'vllm')", flush=True)
        sys.exit(1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("(APIServer pid=1) INFO [api_utils.py:286] non-default args: {}", flush=True)
    print("(Worker pid=2) INFO [cpu_model_runner.py:68] Starting to load model", flush=True)
    kv = int(args[args.index("--kv-cache-memory-bytes") + 1]) \
        if "--kv-cache-memory-bytes" in args else 10**9
    if kv < 10**6:
        print("(EngineCore pid=1) ERROR [core.py:1510] ValueError: To serve at least one request "
              "with the model's max seq len (4096), (0.01 GiB KV cache is needed, which is larger "
              "than the available KV cache memory (0.00 GiB). Based on the available memory, the "
              "estimated maximum model length is 128. Try increasing ...", flush=True)
        print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
        child.kill()
        sys.exit(1)

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send({"data": [{"id": name}]})
            elif self.path == "/args":
                self._send(args)
            else:
                self._send({})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._send({"choices": [{"text": " hi"}], "usage": {"completion_tokens": 2}})

    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    print("INFO:     Application startup complete.", flush=True)
    srv.serve_forever()
    """
)


RANDOM_RATES = (92.0, 85.0)
NATURAL_RATES = (70.0, 42.0)
"""Per-position acceptance (%) the stand-in reports on random-token and on natural prompts."""

MTP = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']


def synthetic_raw(args: list[str], spec: LoadSpec) -> dict[str, Any]:
    """vLLM's result dict for a server started with `args`, from a queueing model: up to
    max_num_seqs requests decode together (TPOT grows with the batch); the rest wait."""
    seqs = int(arg_value(args, "--max-num-seqs") or 128)
    c, n, out = spec.concurrency, spec.num_prompts, spec.output_len
    batch = min(c, seqs)
    tpot = 0.005 + 0.002 * batch
    service = 0.05 + 0.02 * batch + out * tpot
    wait = max(0.0, c / seqs - 1) * service
    ttft = 0.05 + 0.02 * batch + wait
    latency = ttft + (out - 1) * tpot
    rps = batch / service
    good = ttft * 1000 <= (spec.slo_ttft_ms or math.inf) and tpot * 1000 <= (
        spec.slo_tpot_ms or math.inf)
    spec_decode = {}
    if "--speculative-config" in args:  # vLLM's counters; random tokens inflate acceptance
        rates = RANDOM_RATES if spec.prompts_path is None else NATURAL_RATES
        spec_decode = {"spec_decode_acceptance_length": 1 + sum(rates) / 100,
                       "spec_decode_per_position_acceptance_rates": list(rates)}
    return {**spec_decode, "duration": n / rps, "completed": n, "failed": 0,
            "request_throughput": rps,
            "request_goodput": rps if good else 0.0, "output_throughput": rps * out,
            "mean_ttft_ms": ttft * 1000, "median_ttft_ms": ttft * 1000,
            "p99_ttft_ms": ttft * 1000, "mean_tpot_ms": tpot * 1000,
            "median_tpot_ms": tpot * 1000, "p99_tpot_ms": tpot * 1000,
            "ttfts": [ttft] * n, "latencies": [latency] * n, "output_lens": [out] * n}


class FakeLoadgen:
    """Stands in for launcher.run.loadgen.LoadGenerator: asks the fake server for its flags."""

    calls: list[LoadSpec] = []
    hook = None  # called with the number of calls so far, e.g. to send a signal

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path

    def run(self, spec: LoadSpec, timeout: float = 600, heartbeat=None) -> dict[str, Any]:
        FakeLoadgen.calls.append(spec)
        if FakeLoadgen.hook:
            FakeLoadgen.hook(len(FakeLoadgen.calls))
        if heartbeat:
            heartbeat(0.0)
        with urllib.request.urlopen(spec.base_url + "/args", timeout=5) as r:
            args = json.loads(r.read())
        return summarize(synthetic_raw(args, spec), spec)

    def close(self) -> None:
        pass

    def __enter__(self) -> FakeLoadgen:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture()
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(runner_factory, starts file, spawned runners)."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    starts = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_STARTS", str(starts))
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    made: list[VllmRunner] = []

    def factory(args, env, **kw):
        kw["poll_interval"] = 0.05
        r = VllmRunner(args, env=env, command=[sys.executable, str(script)], **kw)
        made.append(r)
        return r

    FakeLoadgen.calls = []
    FakeLoadgen.hook = None
    return factory, starts, made


@pytest.fixture()
def tiny_spec(tmp_path: Path):
    """The tiny model's config only (the fake server loads nothing)."""
    d = tmp_path / "tiny-deepseek-v3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_dict()))
    return load_model(str(d))


def _opts(tmp_path: Path, **kw) -> T.TuneOptions:
    base = {"workload": Workload(64, 32), "slo": SLO(ttft_ms=1500, tpot_ms=60),
            "budget_s": 300.0, "max_starts": 3, "output": tmp_path / "out"}
    base.update(kw)
    return T.TuneOptions(**base)


def _run(spec, opts, factory, lines=None):
    lines = [] if lines is None else lines
    return T.tune(spec, parse_gpus("cpu"), Pins(), opts, out=lines.append,
                  runner_factory=factory, loadgen_factory=FakeLoadgen)


def _started(starts: Path) -> list[list[str]]:
    if not starts.exists():
        return []
    return [json.loads(line) for line in starts.read_text().splitlines()]


# ----------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("text,seconds", [("20m", 1200), ("90s", 90), ("1h30m", 5400),
                                          ("45", 45), ("1.5h", 5400)])
def test_parse_budget(text: str, seconds: float):
    assert T.parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["0", "20x", "", "m", "-5m", "0s"])
def test_parse_budget_rejects(text: str):
    with pytest.raises(InputError):
        T.parse_budget(text)


def test_rung_sizes_spend_at_most_max_starts():
    for n in range(1, 12):
        for starts in range(1, 12):
            sizes = T.rung_sizes(n, starts)
            assert sum(sizes) <= starts
            assert sizes[0] <= n
            assert all(a > b for a, b in zip(sizes, sizes[1:], strict=False)), sizes
    assert T.rung_sizes(10, 6) == [4, 2]
    assert T.rung_sizes(10, 9) == [6, 3]
    assert T.rung_sizes(3, 3, rungs=1) == [3]
    assert T.rung_sizes(1, 6) == [1]


def test_knee_search_finds_the_knee_within_resolution():
    knee = 23
    seen: list[int] = []

    def probe(c: int) -> bool:
        seen.append(c)
        return c <= knee

    s = S.KneeSearch(probe, max_concurrency=256, resolution=1.25)
    lo, hi = s.run()
    assert lo <= knee < hi and hi / lo <= 1.25 and s.bounded
    assert len(seen) == len(set(seen)) <= 10
    assert seen[:6] == [1, 2, 4, 8, 16, 32]


def test_knee_search_edges():
    s = S.KneeSearch(lambda c: False, max_concurrency=64)
    assert s.run() == (0, 1)
    s = S.KneeSearch(lambda c: True, max_concurrency=48)
    assert s.run() == (48, None) and not s.bounded
    # from a hint above the knee it walks down, then bisects
    s = S.KneeSearch(lambda c: c <= 10, max_concurrency=256, resolution=1.25, hint=40)
    lo, hi = s.run()
    assert lo <= 10 < hi <= 12


def test_fragile_when_the_verdict_flips_within_ten_percent():
    slo = SLO(ttft_ms=1000, tpot_ms=50)
    spec = LoadSpec("http://x", "m", "m", 64, 32, 4, 10, slo_ttft_ms=1000, slo_tpot_ms=50)
    raw = {"completed": 10, "failed": 0, "duration": 1.0, "request_throughput": 10,
           "request_goodput": 10, "output_throughput": 320, "output_lens": [32] * 10,
           "ttfts": [0.2] * 10, "latencies": [0.2 + 31 * 0.030] * 10}
    assert not S.fragile(summarize(raw, spec), slo)
    raw["latencies"] = [0.2 + 31 * 0.049] * 10  # 49 ms per token: within 10% of 50
    assert S.fragile(summarize(raw, spec), slo)


def test_candidates_from_the_planner_rank_layouts_and_keep_baseline_minimal():
    spec = load_model("deepseek-v2-lite")
    hw = parse_gpus("2xH100")
    base, cands, _ = T.build_candidates(spec, hw, Pins(), Workload(1024, 1024), SLO(),
                                        "balanced")
    assert base.source == "baseline"
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-dtype",
                 "--enforce-eager", "--enable-chunked-prefill"):
        assert flag not in base.vllm_args
    assert arg_value(base.vllm_args, "--max-model-len") == "2048"  # the workload, rounded up
    assert cands and all(c.plan.fits for c in cands)
    assert len({c.key for c in cands} | {base.key}) == len(cands) + 1
    layouts = [c.plan.engine.parallel for c in cands]
    n_layouts = len(set(layouts))
    assert n_layouts > 1
    # the best of every layout comes first, each group by predicted goodput
    assert len(set(layouts[:n_layouts])) == n_layouts
    rest = [c.predicted["score"] for c in cands[n_layouts:]]
    assert rest == sorted(rest, reverse=True)
    lead = [c.predicted["score"] for c in cands[:n_layouts]]
    assert lead == sorted(lead, reverse=True)


def test_candidates_refuse_a_context_shorter_than_the_workload(tiny_spec):
    with pytest.raises(InputError, match="shorter than the workload"):
        T.build_candidates(tiny_spec, parse_gpus("cpu"), Pins(max_model_len=64),
                           Workload(64, 32), SLO(), "balanced")


# ----------------------------------------------------------------------------- fake engine


INFEASIBLE = ["--max-model-len", "4096", "--kv-cache-memory-bytes", "1000"]


def test_tune_end_to_end_on_a_fake_engine(tmp_path: Path, fake_engine, tiny_spec):
    factory, starts, made = fake_engine
    opts = _opts(tmp_path, max_starts=4, user_candidates=[INFEASIBLE, ["--max-num-seqs", "8"]])
    lines: list[str] = []
    status, doc = _run(tiny_spec, opts, factory, lines)
    assert status == 0, lines
    started = _started(starts)
    assert len(started) == doc["starts"] <= 4
    assert all(not r.group_pids() for r in made), "a fake vLLM process survived"

    saved = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert saved["recommended"] == doc["recommended"]
    for key in ("vllm_version", "gpus", "started_at", "finished_at", "workload", "slo",
                "baseline", "recommended", "trials"):
        assert key in saved, key
    statuses = {t["status"] for t in saved["trials"]}
    assert statuses <= set(T.STATUSES)
    import jsonschema  # the real tune.json against launcher/schemas/tune.json

    schema = json.loads((Path(T.__file__).parents[1] / "schemas" / "tune.json").read_text())
    jsonschema.validate(saved, schema)

    bad = [t for t in saved["trials"] if t["source"] == "user" and "1000" in t["vllm_args"]]
    assert len(bad) == 1 and bad[0]["status"] == "infeasible"
    assert bad[0]["cause"].startswith("KV_SHORTAGE")
    assert sum("1000" in a for a in started) == 1, "the infeasible flags started twice"

    ok = [t for t in saved["trials"] if t["status"] == "ok"]
    assert len(ok) >= 2 and all(t["results"] and t["knee"] for t in ok)
    for t in ok:
        knee = t["knee"]
        met = {p["concurrency"] for p in t["results"] if p["slo_met"]}
        missed = {p["concurrency"] for p in t["results"] if not p["slo_met"]}
        assert knee["concurrency"] == max(met)
        if knee["bounded"]:
            assert knee["first_miss"] == min(missed) > knee["concurrency"]
        else:
            assert not missed

    rec, base = saved["recommended"], saved["baseline"]
    assert rec["measured"]["goodput_rps"] >= base["measured"]["goodput_rps"]
    assert rec["measured"]["goodput_rps"] == max(t["knee"]["goodput_rps"] for t in ok
                                                 if t["rung"] == rec["rung"])
    # every finished trial taught the performance model (predict.speed.calibration) its points
    assert all(t["calibration"].endswith("calibration.json") for t in ok), [
        t["calibration"] for t in ok]
    stored = json.loads((tmp_path / "cache" / "calibration.json").read_text())
    assert sum(len(e["points"]) for e in stored.values()) >= len(ok[0]["results"])
    plan = load_plan(tmp_path / "out" / "plan.json")
    assert plan.tuned["concurrency"] == rec["concurrency"]  # the typed plan carries it
    assert plan.performance.measured["concurrency"] == rec["concurrency"]
    assert "recommended:" in "\n".join(lines)


def test_resume_skips_finished_trials_and_never_restarts_infeasible(tmp_path: Path, fake_engine,
                                                                     tiny_spec):
    factory, starts, _ = fake_engine
    opts = _opts(tmp_path, max_starts=3, rungs=1, user_candidates=[INFEASIBLE])
    status, first = _run(tiny_spec, opts, factory)
    assert status == 0 and len(_started(starts)) == 3
    finished = {(t["name"], t["status"]) for t in first["trials"]
                if t["status"] in ("ok", "infeasible")}
    assert ("vLLM defaults", "ok") in finished
    assert any(s == "infeasible" for _, s in finished)

    status, second = _run(tiny_spec, _opts(tmp_path, max_starts=3, rungs=1, resume=True,
                                           user_candidates=[INFEASIBLE]), factory)
    assert status == 0
    assert len(_started(starts)) == 3, "resume started an engine for a finished trial"
    assert second["starts"] == 0
    again = {(t["name"], t["status"]) for t in second["trials"] if t.get("resumed")}
    assert again == finished
    assert second["recommended"]["measured"] == first["recommended"]["measured"]


def test_same_seed_same_workload_same_trials_and_choice(tmp_path: Path, fake_engine, tiny_spec,
                                                         monkeypatch: pytest.MonkeyPatch):
    """Two tunes with one seed and workload, each with its own calibration cache (so the first
    one's lessons do not steer the second), start the same flags in the same order, send the same
    load (the seed reaches every benchmark) and recommend the same configuration. On the real
    engine the measurements differ run to run; on the deterministic fake they must not."""
    factory, starts, _ = fake_engine
    runs = []
    for i in range(2):
        monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / f"cache{i}"))
        FakeLoadgen.calls = []
        status, doc = _run(tiny_spec, _opts(tmp_path, max_starts=2, rungs=1, seed=7,
                                            output=tmp_path / f"out{i}"), factory)
        assert status == 0
        runs.append((doc, [(c.concurrency, c.num_prompts, c.seed) for c in FakeLoadgen.calls]))
    def flags(args: list[str]) -> list[str]:  # the port is free-port luck, not a choice
        i = args.index("--port")
        return args[:i] + args[i + 2:]

    started = [flags(a) for a in _started(starts)]
    assert len(started) == 4 and started[:2] == started[2:]
    (first, load1), (second, load2) = runs
    assert load1 == load2 and {seed for _, _, seed in load1} == {7}
    assert first["recommended"]["vllm_args"] == second["recommended"]["vllm_args"]
    assert first["recommended"]["measured"] == second["recommended"]["measured"]


def test_sigterm_stops_the_engine_keeps_points_and_exits_143(tmp_path: Path, fake_engine,
                                                            tiny_spec):
    factory, starts, made = fake_engine

    def hook(n: int) -> None:
        if n == 4:  # during the first trial's knee search (call 1 is the warm-up)
            os.kill(os.getpid(), signal.SIGTERM)

    FakeLoadgen.hook = hook
    lines: list[str] = []
    status, doc = _run(tiny_spec, _opts(tmp_path), factory, lines)
    assert status == 128 + signal.SIGTERM
    assert any(s.startswith("best so far") for s in lines), lines[-3:]
    assert doc["best_so_far"]["concurrency"] >= 2 and doc["recommended"] is None
    assert doc["status"] == "interrupted by SIGTERM"
    assert len(_started(starts)) == 1
    assert all(not r.group_pids() for r in made)
    saved = json.loads((tmp_path / "out" / "tune.json").read_text())
    first = saved["trials"][0]
    assert first["status"] == "failed" and "interrupted" in first["cause"]
    assert len(first["results"]) >= 2


def test_budget_too_small_for_another_start_skips_it(tmp_path: Path, fake_engine, tiny_spec):
    factory, starts, _ = fake_engine
    tuner = T.Tuner(tiny_spec, parse_gpus("cpu"), Pins(), _opts(tmp_path, rungs=1),
                    out=lambda s: None, runner_factory=factory, loadgen_factory=FakeLoadgen)
    tuner.startup_times = [10_000.0]  # as if a start had taken hours
    assert tuner.run() == 0
    assert _started(starts) == []
    assert all(t["status"] == "skipped" for t in tuner.doc["trials"])
    assert "budget" in tuner.doc["trials"][0]["cause"]


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("args,message", [
    (["--budget", "0"], "--budget must be more than zero"),
    (["--budget", "20x"], "malformed --budget"),
    (["--max-starts", "0"], "--max-starts must be at least 1"),
    (["--candidate", "max-num-seqs 4"], "--candidate"),
    (["--slo", "ttft=fast"], "--slo"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tiny_spec):
    r = CliRunner().invoke(cli, ["tune", tiny_spec.path, "--gpus", "cpu", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_cli_unknown_model_and_unwritable_output(tmp_path: Path, tiny_spec):
    r = CliRunner().invoke(cli, ["tune", "no-such-model", "--gpus", "cpu"])
    assert r.exit_code == 2 and "unknown model" in r.output
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = CliRunner().invoke(cli, ["tune", tiny_spec.path, "--gpus", "cpu", "--output",
                                 str(blocker / "sub")])
    assert r.exit_code == 2 and "--output" in r.output and "Traceback" not in r.output


def test_plot_draws_measured_curves_or_says_why_not(tmp_path: Path, fake_engine, tiny_spec):
    factory, _, _ = fake_engine
    lines: list[str] = []
    status, _ = _run(tiny_spec, _opts(tmp_path, max_starts=1, plot=True), factory, lines)
    assert status == 0
    png = tmp_path / "out" / "tune.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists() and any("--plot needs matplotlib" in s for s in lines)
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- MTP acceptance


def _acceptance_calls() -> list[LoadSpec]:
    return [c for c in FakeLoadgen.calls if c.prompts_path is not None]


@pytest.mark.parametrize("dataset", [False, True])
def test_mtp_acceptance_is_measured_on_natural_prompts_and_names_its_source(
        tmp_path: Path, fake_engine, tiny_spec, dataset: bool):
    factory, starts, _ = fake_engine
    mine = [f"Question {i}: what is a \u201cgood\u201d answer?\u2028Explain." for i in range(5)]
    prompts = None
    if dataset:
        path = tmp_path / "mine.jsonl"
        path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n"
                                for i, p in enumerate(mine)))
        prompts = load_prompts(path)
    status, doc = _run(tiny_spec, _opts(tmp_path, max_starts=2, rungs=1, user_candidates=[MTP],
                                        prompts=prompts), factory)
    assert status == 0
    mtp = [t for t in doc["trials"] if t["source"] == "user"]
    assert len(mtp) == 1 and mtp[0]["status"] == "ok", doc["trials"]
    others = [t for t in doc["trials"] if t["source"] != "user" and t["status"] == "ok"]

    # one acceptance run per MTP trial, on the natural prompts file, never on random tokens
    calls = _acceptance_calls()
    assert len(calls) == 1
    argv = benchmark_argv(calls[0])
    assert argv[argv.index("--dataset-name") + 1] == "custom" and "random" not in argv
    assert not any(a.startswith("--random") for a in argv)
    sent = Path(argv[argv.index("--dataset-path") + 1])
    assert sent.parent == tmp_path / "out" and sent.suffix == ".jsonl"
    expected = mine if dataset else list(builtin_prompts().prompts)
    assert [json.loads(line)["prompt"] for line in sent.read_text().splitlines()] == expected
    assert calls[0].num_prompts == len(expected)
    assert calls[0].output_len <= _opts(tmp_path).workload.output_len
    # the knee stays on the random dataset for every trial
    assert all(c.prompts_path is None for c in FakeLoadgen.calls if c not in calls)

    # what is recorded came from the natural run and says so; the random points' figure is
    # kept beside it, labelled, and never recorded
    acc = mtp[0]["mtp_acceptance"]
    assert acc["first"] == pytest.approx(NATURAL_RATES[0] / 100)
    assert acc["first"] < mtp[0]["mtp_acceptance_random"]["first"]
    assert "random" in mtp[0]["mtp_acceptance_random"]["source"]
    assert acc["prompts"]["source"] == ("dataset" if dataset else "builtin")
    assert (str(path) in acc["source"]) if dataset else ("built-in" in acc["source"])
    assert doc["acceptance_prompts"]["source"] == acc["prompts"]["source"]
    assert doc["acceptance_prompts"]["sent"] == len(expected)
    assert all("mtp_acceptance" not in t for t in others)
    stored = json.loads((tmp_path / "cache" / "mtp_acceptance.json").read_text())
    entry = stored[tiny_spec.name]
    assert entry["first"] == acc["first"] and entry["source"] == acc["source"]
    assert SP.acceptance(model=tiny_spec.name).first == acc["first"]
    assert acc["source"] in SP.acceptance(model=tiny_spec.name).source


def test_no_mtp_trial_means_no_acceptance_run_and_an_unused_dataset_is_noted(
        tmp_path: Path, fake_engine, tiny_spec):
    factory, _, _ = fake_engine
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Tell me a story."}\n')
    status, doc = _run(tiny_spec, _opts(tmp_path, max_starts=1, prompts=load_prompts(path)),
                       factory)
    assert status == 0 and doc["starts"] == 1
    assert _acceptance_calls() == [] and "acceptance_prompts" not in doc
    assert any("--dataset" in n and "not used" in n for n in doc["notes"])
    assert not (tmp_path / "out" / "acceptance-prompts.jsonl").exists()


def _too_big(path: Path) -> Path:
    path.write_text('{"prompt": "hello there, how are you?"}\n' * 100)
    return path


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing.jsonl", "no such file"),
    (lambda d: d, "not a file"),
    (lambda d: (d / "e.jsonl").write_text("\n\n") and d / "e.jsonl", "no prompts"),
    (lambda d: (d / "t.txt").write_text("plain text prompt\n") and d / "t.txt", "not JSON"),
    (lambda d: (d / "n.jsonl").write_text('{"text": "hi"}\n') and d / "n.jsonl",
     'no non-empty string "prompt"'),
    (lambda d: (d / "s.jsonl").write_text('{"prompt": "  "}\n') and d / "s.jsonl",
     'no non-empty string "prompt"'),
    (lambda d: (d / "b.jsonl").write_bytes(b'{"prompt": "\xff"}\n') and d / "b.jsonl",
     "not UTF-8"),
    (lambda d: _too_big(d / "big.jsonl"), "MiB accepted"),
])
def test_cli_dataset_is_checked_one_line_exit_2(tmp_path: Path, tiny_spec, monkeypatch, make,
                                                message: str):
    monkeypatch.setattr("launcher.inputs.prompts.MAX_DATASET_BYTES", 1024)
    d = tmp_path / "data"
    d.mkdir()
    r = CliRunner().invoke(cli, ["tune", tiny_spec.path, "--gpus", "cpu", "--output",
                                 str(tmp_path / "out"), "--dataset", str(make(d))])
    assert r.exit_code == 2, r.output
    assert message in r.output and "--dataset" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "tune.json").exists(), "checked after work had started"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_cli_unreadable_dataset_is_one_line(tmp_path: Path, tiny_spec):
    path = tmp_path / "secret.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    path.chmod(0)
    r = CliRunner().invoke(cli, ["tune", tiny_spec.path, "--gpus", "cpu", "--dataset", str(path)])
    assert r.exit_code == 2 and "cannot read" in r.output and "Traceback" not in r.output


def test_an_environment_failure_is_no_verdict_on_the_flags(tmp_path: Path, fake_engine, tiny_spec,
                                                           monkeypatch):
    """Without vLLM every start fails the same way: the run stops at the first with one error
    line and exit 2, that trial is "failed" for the environment (never "infeasible"), and
    --resume, with vLLM back, starts it again."""
    factory, starts, _ = fake_engine
    monkeypatch.setenv("FAKE_NO_MODULE", "1")
    lines: list[str] = []
    status, doc = _run(tiny_spec, _opts(tmp_path, max_starts=3, rungs=1), factory, lines)
    assert status == 2 and len(_started(starts)) == 1
    errors = [x for x in lines if x.startswith("vlaunch: error:")]
    assert errors == lines[-1:] and "No module named 'vllm'" in errors[0]
    assert not [x for x in lines if "infeasible" in x], lines  # no table of "infeasible" rows
    assert not [t for t in doc["trials"] if t["status"] == "infeasible"]
    (failed,) = [t for t in doc["trials"] if t["status"] == "failed"]
    assert failed["environment"] is True and failed["cause"].startswith("environment: ")
    monkeypatch.delenv("FAKE_NO_MODULE")
    status, again = _run(tiny_spec, _opts(tmp_path, max_starts=3, rungs=1, resume=True), factory)
    assert status == 0 and len(_started(starts)) > 1
    assert not any(t.get("resumed") and t["key"] == failed["key"] for t in again["trials"])
    assert any(t["key"] == failed["key"] and t["status"] == "ok" for t in again["trials"])


def test_preflight_vllm_must_import_one_line(monkeypatch):
    """tune's first check: vLLM imports in the interpreter it starts it with; else one line
    naming the error (the child's last stderr line) and what to do."""
    from launcher.run import preflight

    class Done:
        returncode = 1
        stderr = ("Traceback (most recent call last):\n  ...\n"
                  "ModuleNotFoundError: No module named 'vllm'\n")

    monkeypatch.delenv("VLAUNCH_VLLM_COMMAND", raising=False)
    with pytest.raises(InputError) as e:
        preflight.check_vllm_imports("/usr/bin/python3", run=lambda *a, **k: Done())
    assert "\n" not in str(e.value) and "No module named 'vllm'" in str(e.value)
    Done.returncode = 0
    preflight.check_vllm_imports("/usr/bin/python3", run=lambda *a, **k: Done())
    monkeypatch.setenv("VLAUNCH_VLLM_COMMAND", "/no/such/program serve")
    with pytest.raises(InputError, match="not a program"):
        preflight.check_vllm_imports()


@pytest.mark.parametrize("gpus,seen,ok", [
    ("cpu", [], True),
    ("2xH100", [], False),
    ("2xH100", [("NVIDIA H100 80GB HBM3", 80 << 30)] * 2, True),
    ("2xH100", [("NVIDIA H100 80GB HBM3", 80 << 30)], False),
    ("2xH100", [("NVIDIA L4", 23 << 30)] * 4, False),
    ("2x8xH100", [("NVIDIA H100 80GB HBM3", 80 << 30)] * 16, False),
])
def test_preflight_the_planned_gpus_must_be_here(gpus, seen, ok):
    """The GPUs tune plans for are on this machine (as many as one node, as big), else one
    line that says what it sees; the CPU engine needs none; two nodes are not one machine."""
    from types import SimpleNamespace

    from launcher.run import preflight

    devices = [SimpleNamespace(name=n, total_bytes=b, error=None) for n, b in seen]
    hw = parse_gpus(gpus)
    if ok:
        preflight.check_gpus(hw, read=lambda: devices)
        return
    with pytest.raises(InputError) as e:
        preflight.check_gpus(hw, read=lambda: devices)
    assert "\n" not in str(e.value)


def test_cli_tune_without_the_engine_is_one_line_and_exit_2(tiny_spec, monkeypatch, tmp_path):
    monkeypatch.setenv("VLAUNCH_VLLM_COMMAND", "/no/such/vllm serve")
    r = CliRunner().invoke(cli, ["tune", tiny_spec.path, "--gpus", "cpu", "--output",
                                 str(tmp_path / "o")])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("vlaunch: error:")
    assert not (tmp_path / "o" / "tune.json").exists()
