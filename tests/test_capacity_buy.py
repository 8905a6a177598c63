"""Capacity that can be bought: node shapes, prices per shape, the queue each replica keeps,
does-not-fit answers, and the mixed-fleet ILP (issue 29)."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from schema_check import schema_errors

from launcher.cli import cli
from launcher.inputs import hardware
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.capacity import capacity, mix, queueing
from launcher.predict.capacity.prices import PriceBook, read_prices_file
from launcher.predict.search.planner import Pins

W = Workload(1024, 256)
PINS = Pins(vllm_version="0.32.0", max_model_len=8192)
SPEC = load_model("llama-3.1-70b")


# ----------------------------------------------------------------------------- the queue

def test_one_server_is_m_m_1():
    # M/M/1: P(wait) = rho, Wq = rho / (mu - lambda); Cs^2 = 1 leaves Allen-Cunneen exact.
    for rho in (0.1, 0.5, 0.9, 0.99):
        mu = 4.0
        q = queueing.mgc(rho * mu, 1, mu)
        assert queueing.erlang_c(1, rho) == pytest.approx(rho)
        assert q.wait_s == pytest.approx(rho / (mu - rho * mu))
        assert q.utilization == pytest.approx(rho)


def test_two_servers_and_fixed_lengths():
    # M/M/2: P(wait) = a^2 / (2 + a) for offered load a; M/D/c waits half as long (Cs^2 = 0).
    for a in (0.2, 1.0, 1.7):
        assert queueing.erlang_c(2, a) == pytest.approx(a * a / (2 + a))
        m, d = queueing.mgc(a, 2, 2.0), queueing.mgc(a, 2, 2.0, cs2=0.0)
        assert d.wait_s == pytest.approx(m.wait_s / 2)


def test_wait_grows_with_rate_and_is_infinite_at_capacity():
    for servers in (1, 4, 64, 512):
        last = -1.0
        for i in range(1, 100):
            q = queueing.mgc(i / 100 * 10.0, servers, 10.0)
            assert q.wait_s >= last and q.utilization < 1
            last = q.wait_s
        assert queueing.mgc(10.0, servers, 10.0).wait_s == math.inf


def _simulated_wait(servers: int, rho: float, n: int = 100_000, seed: int = 1) -> float:
    """Mean wait of n Poisson arrivals at c exponential servers (FCFS), by simulation."""
    import heapq

    rnd, mu = random.Random(seed), 1.0
    lam, t, free, total = rho * servers * mu, 0.0, [0.0] * servers, 0.0
    for _ in range(n):
        t += rnd.expovariate(lam)
        start = max(t, free[0])
        total += start - t
        heapq.heapreplace(free, start + rnd.expovariate(mu))
    return total / n


def test_the_closed_form_matches_a_simulated_queue():
    # Why a closed form: Erlang C is exact for M/M/c; a seeded simulation agrees within noise.
    for servers, rho in ((1, 0.6), (4, 0.75), (16, 0.8)):
        formula = queueing.mgc(rho * servers, servers, float(servers)).wait_s
        assert _simulated_wait(servers, rho) == pytest.approx(formula, rel=0.15)


def test_max_rate_is_the_largest_rate_within_the_budget():
    for servers, budget in itertools.product((1, 8, 100), (0.001, 0.05, 1.0)):
        r = queueing.max_rate(servers, 20.0, lambda q, b=budget: b)
        assert 0 < r < 20.0
        assert queueing.mgc(r, servers, 20.0).wait_s <= budget
        assert queueing.mgc(r * 1.001 + 1e-9, servers, 20.0).wait_s > budget * 0.999


def run(rps=None, users=None, gpus=("8xH100",), headroom=0.2, slo=None, prices=None):
    return capacity.plan_capacity(SPEC, capacity.Load(users=users, rps=rps), W, slo or SLO(),
                                  list(gpus), prices or {"H100": 2.0}, headroom, 0, PINS)


def test_sweep_of_rates_never_plans_a_full_replica_and_meets_the_ttft_slo():
    # Open loop over 40 rates, with and without headroom: every sized option states its queue,
    # stays below 100% busy, and its TTFT with queueing meets the SLO; more rate, more GPUs.
    slo = SLO()
    for headroom in (0.0, 0.2):
        last = 0
        for i in range(40):
            rate = 0.5 * 1.18 ** i  # 0.5 .. ~320 requests/s
            o = run(rps=rate, headroom=headroom)["options"][0]
            q = o["at_load"]
            assert q is not None and set(q) == {"requests_per_s", "utilization",
                                                "queue_wait_ms", "ttft_ms"}
            assert q["utilization"] < 1.0, (rate, q)
            assert q["ttft_ms"] <= slo.ttft_ms + 0.1, (rate, q)
            assert q["requests_per_s"] == pytest.approx(rate / o["replicas"], rel=1e-3)
            assert o["gpus_total"] >= last
            last = o["gpus_total"]


def test_at_load_is_the_queue_model_arithmetic():
    o = run(rps=29.0, headroom=0.0)["options"][0]
    pr, q = o["per_replica"], o["at_load"]
    lam = 29.0 / o["replicas"]
    expect = queueing.mgc(lam, int(pr["knee_concurrency"]), pr["requests_per_s"])
    assert q["utilization"] == pytest.approx(lam / pr["requests_per_s"], abs=1e-4)
    assert q["queue_wait_ms"] == pytest.approx(expect.wait_s * 1e3, abs=0.1)
    assert q["ttft_ms"] >= q["queue_wait_ms"]


def test_users_are_a_closed_loop_without_a_queue():
    o = run(users=500)["options"][0]
    assert o["at_load"]["queue_wait_ms"] == 0
    assert 0 < o["at_load"]["utilization"] < 1
    knee = int(o["per_replica"]["knee_concurrency"])
    for users in (knee - 1, knee, knee + 1, 2 * knee, 3 * knee):  # exactly at the knee: 2
        o = run(users=users, headroom=0.0)["options"][0]
        assert o["at_load"]["utilization"] < 1
        assert o["replicas"] == users // knee + 1


# ----------------------------------------------------------------------------- shapes


def test_catalog_shapes_are_the_ones_sold():
    k = hardware.gpu_kind
    assert k("GH200").node_sizes == (1, 2) and k("GH200").nvlink_domain == 2
    for name in ("H100", "H200", "B200", "B300", "MI300X", "MI325X", "MI355X"):
        assert k(name).node_sizes == (8,), name
    for name in ("H100-PCIe", "L40S", "L4"):
        assert max(k(name).node_sizes) <= 8 and k(name).nvlink_domain == 1 and not k(name).nvlink
    for name in ("GB200", "GB300"):
        assert k(name).node_sizes == (4,) and k(name).nvlink_domain == 72
        assert k(name).replica_shapes() == [f"4x{name}", f"2x4x{name}", f"4x4x{name}",
                                             f"8x4x{name}", f"16x4x{name}"]
    for kind in hardware.kinds():
        if kind.datacenter:
            for p in kind.prices:
                assert f"{p.gpus}x{kind.name}" in kind.replica_shapes(), kind.name


def test_a_datacenter_gpu_must_say_how_it_is_sold():
    from launcher.profile_check import problems

    row = {"total_mib": 1000, "datacenter": True}
    assert any("node" in p for p in problems({"gpus": {"X": row}}, "gpus"))
    row["node"] = {"sizes": [8], "nvlink_domain": 8}
    row["prices"] = [{"gpus": 8, "usd_per_hour": 1.0, "source": "s", "date": "2026-01"}]
    assert problems({"gpus": {"X": row}}, "gpus") == []
    row["prices"][0]["usd_per_hour"] = 0
    assert problems({"gpus": {"X": row}}, "gpus")


def test_plans_refuse_a_node_that_does_not_exist():
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-70b", "--gpus", "4xGH200"])
    assert r.exit_code == 2 and "2x2xGH200" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_nvl72_trays_talk_over_nvlink_within_the_domain():
    from launcher.predict.memory import budget as B
    from launcher.predict.speed.step import engine_shape

    spec = load_model("llama-3.1-70b")
    tray = engine_shape(spec, hardware.parse_gpus("2x4xGB200"), B.Layout(tp=8, nodes=2),
                        1024, 10**6, 256, 8192, True)
    hgx = engine_shape(spec, hardware.parse_gpus("2x8xH100"), B.Layout(tp=16, nodes=2),
                       1024, 10**6, 256, 8192, True)
    assert not tray.cross_node_tp and hgx.cross_node_tp


def test_capacity_offers_only_rentable_shapes():
    d = run(users=500, gpus=("4xH200", "8xH200"), prices={"H200": 3.0})
    bad, good = d["options"][1], d["options"][0]
    assert good["gpus"] == "8xH200" and good["replicas"]
    assert bad["replicas"] is None and "not a shape one can rent" in bad["problem"]
    for shapes in capacity.default_options(SPEC):
        for g in shapes:
            hw = hardware.parse_gpus(g)
            assert f"{hw.gpus_per_node}x{hw.kind.name}" in hw.kind.replica_shapes()
    names = {s[0].split("x")[-1] for s in capacity.default_options(SPEC)}
    assert {"MI300X", "MI325X", "MI355X", "GB200"} <= names


# ----------------------------------------------------------------------------- prices


def test_price_per_shape_and_its_source(tmp_path: Path):
    gh = hardware.gpu_kind("GH200")
    book = PriceBook()
    assert book.price(gh, 1).usd_per_hour == 2.29 and "Lambda" in book.price(gh, 1).source
    assert book.price(gh, 2).usd_per_hour is None  # nobody lists NVL2 at the 1-GPU rate
    assert book.price(hardware.gpu_kind("B300"), 16).usd_per_hour == 7.85  # two whole nodes
    f = tmp_path / "p.yaml"
    f.write_text("prices:\n  - {gpu: GH200, gpus: 2, usd_per_hour: 3.1, source: deal, "
                 "date: '2026-11'}\n  - {gpu: h100, usd_per_hour: 2.2, source: ours, "
                 "date: 2026-11-02}\n")
    book = read_prices_file(str(f))
    assert book.price(gh, 2).usd_per_hour == 3.1 and "deal" in book.price(gh, 2).source
    assert book.price(hardware.gpu_kind("H100"), 8).usd_per_hour == 2.2
    book.flat["H100"] = 1.0
    assert book.price(hardware.gpu_kind("H100"), 8).source == "your --price"


def test_every_option_shows_its_price_source(tmp_path: Path):
    f = tmp_path / "p.yaml"
    f.write_text("prices:\n  - {gpu: H200, gpus: 8, usd_per_hour: 3.0, source: reserved, "
                 "date: '2026-11'}\n")
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-70b", "--users", "300", "--gpus",
                                 "8xH200,8xH100", "--prices", str(f), "--max-model-len", "8192",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert schema_errors("capacity", d) == []
    src = {o["gpus"]: o["price_source"] for o in d["options"]}
    assert "reserved" in src["8xH200"] and "Lambda" in src["8xH100"]


# ----------------------------------------------------------------------------- does not fit


def test_does_not_fit_is_not_a_missed_slo():
    d = capacity.plan_capacity(load_model("deepseek-v3"), capacity.Load(users=100), W, SLO(),
                               ["8xH100"], {}, 0.2, 0, Pins(vllm_version="0.32.0"))
    assert d["verdict"] == "does_not_fit" and d["closest_miss"] is None
    assert "does not fit" in capacity.miss_message(d)
    assert "does not fit" in capacity.render(d)
    d = run(users=100, slo=SLO(tpot_ms=2))
    assert d["verdict"] == "misses_slo" and "misses the SLO" in capacity.miss_message(d)


def test_plan_alternatives_name_another_gpu_that_fits_with_its_price():
    r = CliRunner().invoke(cli, ["plan", "deepseek-v3", "--gpus", "8xH100", "--format", "json"])
    d = json.loads(r.output)
    other = [s for s in d["suggestions"] if s["code"] == "suggest.other_gpu"]
    assert any(s["data"]["gpus"] == "8xH200" and "$4.29/GPU-hour" in s["text"]
               for s in other), d["suggestions"]


# ----------------------------------------------------------------------------- the mix


def _brute(rates, loads, hourly):
    """The cheapest whole replica counts whose capacity covers an assignment of every bucket:
    every count up to what one type alone needs, cheapest first, the first feasible one (each
    feasibility an LP)."""
    from scipy.optimize import linprog

    G, J = len(rates), len(loads)
    most = max(math.ceil(sum(lam / r for lam, r in zip(loads, rates[g], strict=True)))
               for g in range(G))
    a_eq = [[1.0 if j == jj else 0.0 for _ in range(G) for jj in range(J)] for j in range(J)]
    a_ub = [[loads[j] / rates[g][j] if gg == g else 0.0 for gg in range(G) for j in range(J)]
            for g in range(G)]
    for n in sorted(itertools.product(range(most + 1), repeat=G),
                    key=lambda n: sum(a * b for a, b in zip(n, hourly, strict=True))):
        res = linprog([0] * (G * J), A_ub=a_ub, b_ub=list(n), A_eq=a_eq, b_eq=[1] * J,
                      bounds=[(0, 1)] * (G * J))
        if res.status == 0:
            return sum(a * b for a, b in zip(n, hourly, strict=True))
    raise AssertionError("no fleet")


def test_the_ilp_finds_the_cheapest_fleet():
    rnd = random.Random(29)
    for _ in range(25):
        G, J = 2, rnd.choice((1, 2, 3))
        gpus = [f"g{i}" for i in range(G)]
        rates = {g: [rnd.uniform(0.5, 6) for _ in range(J)] for g in gpus}
        loads = [rnd.uniform(0.5, 8) for _ in range(J)]
        hourly = {g: rnd.uniform(1, 10) for g in gpus}
        buckets = [mix.Bucket(100, 100, 1 / J)] * J
        n, x = mix.solve(gpus, buckets, rates, loads, hourly)
        for j in range(J):
            assert sum(x[g][j] for g in gpus) == pytest.approx(1, abs=1e-6)
        for g in gpus:
            assert sum(x[g][j] * loads[j] / rates[g][j] for j in range(J)) <= n[g] + 1e-6
        cost = sum(n[g] * hourly[g] for g in gpus)
        assert cost == pytest.approx(_brute([rates[g] for g in gpus], loads,
                                            [hourly[g] for g in gpus]), rel=1e-6)
        single = min(math.ceil(sum(lam / r for lam, r in zip(loads, rates[g], strict=True))
                               - 1e-9) * hourly[g] for g in gpus)
        assert cost <= single + 1e-6


def test_mix_cli_json_and_saving(tmp_path: Path):
    f = tmp_path / "lengths.yaml"
    f.write_text("lengths:\n  - {input_len: 256, output_len: 128, share: 0.6}\n"
                 "  - {input_len: 8192, output_len: 256, share: 0.3}\n"
                 "  - {workload: reasoning, share: 0.1}\n")
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-8b", "--rps", "50", "--gpus",
                                 "L4,H100,A100-80GB", "--mix", "--lengths", str(f),
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert schema_errors("capacity", d) == []
    m = d["mix"]
    assert sum(p["share"] for p in m["pools"]) == pytest.approx(1, abs=1e-3)
    assert m["saving_vs_best_single_usd"] == m["best_single"]["monthly_usd"] - m["monthly_usd"]
    assert m["saving_vs_best_single_usd"] >= 0
    assert m["monthly_usd"] == sum(p["monthly_usd"] for p in m["pools"])


@pytest.mark.parametrize("args,needle", [
    (["--rps", "5", "--gpus", "H100,H900", "--mix"], "unknown GPU"),
    (["--users", "5", "--gpus", "H100,H200", "--mix"], "--rps"),
    (["--rps", "5", "--gpus", "H100", "--mix"], "two GPU types"),
    (["--rps", "5", "--lengths", "x.yaml"], "--mix"),
    (["--users", "5", "--prices", "PRICES"], "--prices"),
    (["--users", "5", "--prices", "NOTYAML"], "not YAML"),
    (["--rps", "5", "--gpus", "H100,H200", "--mix", "--lengths", "PRICES"], "--lengths"),
])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, args, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prices:\n  - {gpu: H100, usd_per_hour: -3, source: x, date: '2026-01'}\n")
    notyaml = tmp_path / "n.yaml"
    notyaml.write_text("prices: [\n")
    args = [str(bad) if a == "PRICES" else str(notyaml) if a == "NOTYAML" else a for a in args]
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-8b", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_nothing_in_the_catalog_holds_it_is_does_not_fit(monkeypatch):
    monkeypatch.setattr(capacity, "holds", lambda kind, gpus, spec: False)
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-70b", "--users", "5"])
    assert r.exit_code == 2 and "does not fit" in r.output
    assert len(r.output.strip().splitlines()) == 1
