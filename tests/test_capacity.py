"""`vlaunch capacity`: arithmetic, properties, contract, bad input."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.capacity import capacity
from launcher.predict.search.planner import Pins

W = Workload(1024, 256)
PINS = Pins(vllm_version="0.32.0", max_model_len=8192)
SPEC = load_model("llama-3.1-70b")


def run(users=None, rps=None, slo=None, gpus=("8xH100",), prices=None, headroom=0.2,
        spare=0):
    slo = slo or SLO()
    return capacity.plan_capacity(SPEC, capacity.Load(users=users, rps=rps), W, slo,
                                  list(gpus) if gpus else None, prices, headroom, spare, PINS)


def test_replicas_follow_the_stated_arithmetic():
    d = run(users=500, prices={"H100": 2.0}, spare=1)
    o = d["options"][0]
    per = o["per_replica"]["knee_concurrency"]
    assert o["replicas"] == math.ceil(500 * 1.2 / per) + 1
    assert o["gpus_total"] == o["replicas"] * 8
    assert o["monthly_usd"] == pytest.approx(o["gpus_total"] * 2.0 * 730, abs=1)
    assert d["recommended"]["gpus"] == "8xH100"


def test_rps_uses_the_open_loop_rate_under_the_knee():
    # Poisson arrivals: in flight C = rate x E2E must leave sqrt(C) of room under the knee K,
    # C + sqrt(C) = K, so a replica takes less than the closed-loop knee's requests/s.
    d = run(rps=20.0, prices={"H100": 2.0}, headroom=0.0)
    o = d["options"][0]
    pr = o["per_replica"]
    k = pr["knee_concurrency"]
    c = ((math.sqrt(4 * k + 1) - 1) / 2) ** 2
    assert c + math.sqrt(c) == pytest.approx(k)
    # never more than the closed loop's (equal when the knee sits in the queue max-num-seqs
    # makes: the engine already runs flat out there)
    assert pr["open_loop_requests_per_s"] <= pr["requests_per_s"]
    assert o["replicas"] == math.ceil(20.0 / pr["open_loop_requests_per_s"])
    # $ per million output tokens: the hourly bill over the tokens the load asks for.
    hourly = o["gpus_total"] * 2.0
    assert o["usd_per_million_output_tokens"] == pytest.approx(
        hourly / 3600 / (20.0 * 256) * 1e6, rel=1e-3)


def test_more_users_never_need_fewer_gpus():
    last = 0
    for users in (1, 10, 50, 100, 300, 1000, 3000):
        total = run(users=users)["options"][0]["gpus_total"]
        assert total >= last
        last = total


def test_a_tighter_slo_never_needs_fewer_gpus():
    last = 0
    for tpot in (200, 100, 60, 40, 30):
        total = run(users=500, slo=SLO(tpot_ms=tpot))["options"][0]["gpus_total"] or 10**9
        assert total >= last
        last = total


def test_a_price_never_changes_the_replica_count():
    a = run(users=500, prices={"H100": 1.0})["options"][0]
    b = run(users=500, prices={"H100": 9.0})["options"][0]
    assert a["replicas"] == b["replicas"] and b["monthly_usd"] == pytest.approx(
        9 * a["monthly_usd"], rel=1e-6)


def test_options_sorted_by_cost_and_recommendation_meets_the_slo():
    d = run(users=500, gpus=("8xH100", "8xH200", "8xA100-80GB"))
    costs = [o["monthly_usd"] for o in d["options"] if o["monthly_usd"] is not None]
    assert costs == sorted(costs)
    rec = d["recommended"]
    assert rec["monthly_usd"] == costs[0]
    assert rec["per_replica"]["tpot_ms"] <= d["slo"]["tpot_ms"]
    assert "list price" in rec["price_source"]


def test_default_options_are_catalog_gpus_that_hold_the_model():
    shapes = capacity.default_options(load_model("deepseek-r1"))
    names = {s[0].split("x")[-1] for s in shapes}
    assert "H200" in names and "B200" in names
    assert "L4" not in names  # 16 L4s cannot hold 627 GiB


def test_ten_options_under_a_second():
    gpus = ["8xH100", "8xH200", "8xA100-80GB", "8xB200", "8xL40S", "8xH100-PCIe", "2xGH200",
            "4xH100-NVL", "8xB300", "8xA100-40GB"]
    t = time.perf_counter()
    d = run(users=500, gpus=gpus)
    assert len(d["options"]) == 10
    assert time.perf_counter() - t < 3.0  # the goal is 1 s (make bench); 3x for a busy CI


def test_json_contract():
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-70b", "--users", "500", "--gpus",
                                 "8xH100,8xH200", "--price", "H100=2", "--price", "H200=2",
                                 "--max-model-len", "8192", "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    keys = {"gpus", "parallel", "replicas", "gpus_total", "per_replica", "binding",
            "monthly_usd", "usd_per_million_output_tokens", "source"}
    assert all(set(o) >= keys for o in d["options"])
    assert set(d["options"][0]["per_replica"]) >= {"knee_concurrency", "requests_per_s",
                                                   "output_tokens_per_s"}
    assert d["recommended"] in d["options"]


@pytest.mark.parametrize("args,needle", [
    (["--users", "-5"], "--users"),
    (["--rps", "0"], "--rps"),
    ([], "exactly one"),
    (["--users", "5", "--rps", "1"], "exactly one"),
    (["--users", "5", "--slo", "tpot=quick"], "malformed --slo"),
    (["--users", "5", "--gpus", "8xH900"], "unknown GPU"),
    (["--users", "5", "--price", "H200=cheap"], "malformed --price"),
    (["--users", "5", "--price", "H200=-1"], "malformed --price"),
    (["--users", "5", "--headroom", "-1"], "--headroom"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-70b", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_plot_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra")
    out = tmp_path / "cap.png"
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-70b", "--users", "200", "--gpus",
                                 "8xH100", "--max-model-len", "8192", "--plot", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out2 = tmp_path / "plan.png"
    r = CliRunner().invoke(cli, ["plan", "deepseek-r1", "--gpus", "8xH200", "--plot", str(out2)])
    assert r.exit_code == 0 and out2.read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
