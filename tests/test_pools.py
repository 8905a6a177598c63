"""Disaggregated deployments in the typed plan (launcher/predict/search/pd_pools.py): the choice
between aggregated and xPyD candidates, the JSON of the two pools, and bad input in one line."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import random

import pytest
from click.testing import CliRunner
from schema_check import schema_errors

from launcher.cli import cli
from launcher.deployment.argv import engine_argv, pool_argv
from launcher.deployment.codec import dump, load
from launcher.inputs import vllm_flags as F
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.search import pd_pools as pools
from launcher.predict.search.planner import Pins
from launcher.predict.speed import disagg

VERSION = "0.32.0"
RELAXED = SLO(ttft_ms=10_000, tpot_ms=50)


# ---- the load the TTFT SLO allows (disagg.split with an SLO) -----------------------------------


def test_a_split_is_run_at_the_load_that_meets_its_ttft():
    p = disagg.PrefillPool(requests_per_s=10.0, prompt_s=0.2, gpus=8)
    d = disagg.DecodePool(requests_per_s=4.0, running=64, tpot_ms=30.0, first_step_s=0.03,
                          gpus=8)
    w, x = Workload(4000, 1000), disagg.Transfer(1e8, "rdma", 0.01, 5.0)
    free = disagg.split(p, d, w, x, 1, 3)
    assert free.ttft_ms == pytest.approx(1140.0)  # 0.9 s queue at rho 0.9 + 0.24 s
    held = disagg.split(p, d, w, x, 1, 3, ttft_slo_ms=640.0)
    # budget 0.64 - 0.24 = 0.4 s of queue: rho <= 2 x 0.4 / (0.2 + 2 x 0.4) = 0.8, 8 req/s;
    # then the wait is 0.8 / (2 x 0.2) x 0.2 = 0.4 s and TTFT is exactly the SLO
    assert held.requests_per_s == pytest.approx(8.0)
    assert held.ttft_ms == pytest.approx(640.0)
    assert held.bound == "ttft" and held.output_tokens_per_s == pytest.approx(8000.0)
    assert disagg.split(p, d, w, x, 1, 3, ttft_slo_ms=5000.0) == free  # no need to lower


def test_a_lowered_split_meets_its_ttft_and_never_gains_rate():
    rng = random.Random(26)
    for _ in range(500):
        p = disagg.PrefillPool(rng.uniform(0.1, 50), rng.uniform(0.01, 3), rng.choice([1, 8]))
        d = disagg.DecodePool(rng.uniform(0.1, 50), 16, rng.uniform(5, 60),
                              rng.uniform(0.005, 0.1), rng.choice([1, 8]))
        w = Workload(rng.randint(64, 32768), rng.randint(16, 2048))
        x = disagg.Transfer(1e8, "nvlink", rng.uniform(0, 0.05), 0.0)
        a, b = rng.randint(1, 8), rng.randint(1, 8)
        slo = rng.uniform(100, 20_000)
        free, held = disagg.split(p, d, w, x, a, b), disagg.split(p, d, w, x, a, b, slo)
        assert held.requests_per_s <= free.requests_per_s + 1e-12
        if p.prompt_s + x.seconds + d.first_step_s < slo / 1e3:  # reachable at some load
            assert held.ttft_ms <= slo + 1e-6


# ---- choosing: the objective's figure, ties to one pool ----------------------------------------


def _option(kind: str, gpus: int, tok_s: float, ttft: float, tpot: float, meets=True):
    return pools.Option(kind, gpus, tok_s / 256, tok_s, ttft, tpot, kind, meets)


def test_auto_takes_the_better_figure_and_ties_stay_aggregated():
    rng = random.Random(7)
    w = Workload(2048, 256)
    for _ in range(400):
        agg = _option("aggregated", 8, rng.uniform(100, 9000), rng.uniform(50, 3000),
                      rng.uniform(5, 60), rng.random() > 0.2)
        splits = [_option("disaggregated", rng.randint(2, 16), rng.uniform(100, 9000),
                          rng.uniform(50, 3000), rng.uniform(5, 60))
                  for _ in range(rng.randint(0, 4))]
        for objective in ("balanced", "throughput", "latency"):
            c = pools.choose(agg, splits, "auto", objective, w)
            best = max([agg, *splits], key=lambda o: o.figure(objective, w))
            assert c.winner.figure(objective, w) == best.figure(objective, w)
            if splits and best.figure(objective, w) == agg.figure(objective, w):
                assert c.winner is agg  # a tie keeps one pool
            (r,) = c.reasons
            assert r.code == "deployment.chosen" and r.data["winner"]["deployment"] == \
                c.winner.kind
            if c.runner_up is not None:
                a, b = c.winner.figure(objective, w), c.runner_up.figure(objective, w)
                ratio = b / a if objective == "latency" else a / b
                assert r.data["ratio"] == pytest.approx(round(ratio, 3))
            assert pools.choose(agg, splits, "off", objective, w).winner is agg
            on = pools.choose(agg, splits, "on", objective, w).winner
            assert on is (max(splits, key=lambda o: o.figure(objective, w)) if splits else agg)


def test_per_gpu_counts_every_gpu_of_both_pools():
    o = _option("disaggregated", 12, 6000.0, 500, 20)
    assert o.per_gpu == 500.0  # 6,000 tok/s over 12 GPUs
    assert o.figure("latency", Workload(1000, 101)) == -(500 + 100 * 20)


def test_replica_sizes_leave_room_for_the_other_pool():
    for gpus in ("2xH100", "4xH100", "8xH100", "2x8xH100", "4x8xH200", "8x8xH200", "3xL40S"):
        hw = parse_gpus(gpus)
        sizes = pools.replica_sizes(hw)
        assert sizes and all(2 * g <= hw.count for g in sizes), gpus
        for g in sizes:
            h = pools.replica_hardware(hw, g)
            assert h.count == g and (g <= hw.gpus_per_node or g % hw.gpus_per_node == 0)
    assert pools.replica_sizes(parse_gpus("1xH100")) == []


# ---- the Deployment of two pools ---------------------------------------------------------------

CASES = [(m, g, i, o) for m, g in [("llama-3.1-8b", "8xH100"), ("llama-3.1-8b", "2x8xH200"),
                                   ("llama-3.1-70b", "8xH200"), ("qwen3-8b", "4xA100-80GB"),
                                   ("deepseek-r1", "2x8xH200"), ("deepseek-v2-lite", "8xH100"),
                                   ("r1-distill-qwen-14b", "8xMI300X")]
         for i, o in [(2048, 256), (16384, 512)]]


@functools.cache
def _planned(model: str, gpus: str, inp: int, out: int, mode: str = "on") -> pools.Planned:
    return pools.plan_deployment(load_model(model), parse_gpus(gpus),
                                 Pins(vllm_version=VERSION), mode=mode,
                                 workload=Workload(inp, out), slo=RELAXED)


@pytest.mark.parametrize("model,gpus,inp,out", CASES)
def test_a_disaggregated_plan_round_trips_and_says_its_pools(model, gpus, inp, out):
    r = _planned(model, gpus, inp, out)
    d = r.deployment
    assert d.kind == "disaggregated" and [p.role for p in d.pools] == ["prefill", "decode"]
    j = json.loads(json.dumps(dump(d)))
    assert load(j) == d
    assert schema_errors("plan", j) == []
    assert j["deployment"] == "disaggregated"
    sp = r.choice.winner.split
    units = d.hardware.count // sp.gpus  # the xPyD unit, as often as the GPUs hold it
    assert [p["replicas"] for p in j["pools"]] == [units * sp.prefill_replicas,
                                                   units * sp.decode_replicas]
    assert d.gpus == units * sp.gpus <= d.hardware.count < (units + 1) * sp.gpus
    for p, raw in zip(d.pools, j["pools"], strict=True):
        t = p.transfer
        assert raw["vllm_args"] == pool_argv(p) == [
            *engine_argv(p.engine), F.flag("kv_transfer_config"), raw["vllm_args"][-1]]
        cfg = json.loads(raw["vllm_args"][-1])
        assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_buffer_device": "cuda"} == dict(t.config)
        assert int(raw["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) >= 5600
        # one node: loopback; across nodes the pod's own IP, which only the pod knows
        assert raw["env"].get("VLLM_NIXL_SIDE_CHANNEL_HOST") == (
            None if t.path == "rdma" else "127.0.0.1")
        assert ("UCX_NET_DEVICES" in raw["env"]) == (t.path == "rdma") == (d.hardware.nodes > 1)
        assert raw["transfer"]["bytes_per_gpu"] == round(sp.transfer.bytes_per_gpu)
    # the top-level keys scripts read are the first (prefill) pool's
    for key in ("kv_cache", "per_gpu", "env", "vllm_args"):
        assert j[key] == j["pools"][0][key], key
    # the deployment's own figures: rate x output length, over every GPU of both pools
    perf = j["performance"]
    assert ("disaggregate.side_channel_host" in [x.code for x in d.warnings]) == \
        (t.path == "rdma")
    assert perf["at"]["requests_per_s"] == pytest.approx(units * sp.requests_per_s, abs=1e-4)
    assert perf["at"]["output_tokens_per_s"] == pytest.approx(
        perf["at"]["requests_per_s"] * out, rel=1e-3)
    assert perf["gpus"] == d.gpus
    assert perf["output_tokens_per_s_per_gpu"] == pytest.approx(
        sp.output_tokens_per_s / sp.gpus, abs=0.01)
    assert perf["at"]["tpot_ms"] == pytest.approx(sp.tpot_ms, abs=1e-3)
    assert perf["at"]["tpot_ms"] == j["pools"][1]["performance"]["at"]["tpot_ms"]
    assert perf["at"]["ttft_ms"] <= RELAXED.ttft_ms
    # TTFT = queue + prefill + hand-off + decode's first step: at least the last three
    pre = d.pools[0].performance.single_request.ttft_ms
    assert perf["at"]["ttft_ms"] >= pre + sp.transfer.seconds * 1e3 - 0.01
    # the decode pool's engines are capped at the batch that holds the TPOT SLO
    dec = pools.disagg.decode_pool(r.choice.winner.decode.performance.shape, Workload(inp, out),
                                   RELAXED)
    assert d.pools[1].engine.max_num_seqs == max(1, math.floor(dec.running))
    (why,) = [x for x in d.reasons if x.code == "deployment.chosen"]
    assert why.data["winner"]["deployment"] == "disaggregated"
    assert why.data["runner_up"] is None or why.data["runner_up"]["deployment"] == "aggregated"


@pytest.mark.parametrize("model,gpus,inp,out", CASES)
def test_a_split_plans_reasons_are_its_pools_not_the_aggregated_runner_up(model, gpus, inp, out):
    """Beyond the choice and the inputs, every reason names the pool(s) it describes; the
    aggregated runner-up's own decisions (its layout, its batch) are not the deployment's."""
    r = _planned(model, gpus, inp, out)
    d = r.deployment
    codes = [x.code for x in d.reasons]
    assert codes[0] == "deployment.chosen" and "workload" in codes
    for x in d.reasons[1:]:
        if x.code in ("workload", "vllm.version"):
            continue
        assert set(x.data["pools"]) <= {"prefill", "decode"} and x.data["pools"], x.code
        assert x.text.startswith(("both pools: ", "prefill pool: ", "decode pool: ")), x.text
    if any(p.engine.parallel.expert_parallel and p.engine.parallel.dp > 1 for p in d.pools):
        assert any(x.code.startswith("all2all.") for x in d.reasons), codes  # the pools' own
    (seqs,) = [x for x in d.reasons if x.code == "max_num_seqs.decode_slo"]  # balanced
    assert seqs.data["max_num_seqs"] == d.pools[1].engine.max_num_seqs
    assert load(json.loads(json.dumps(dump(d)))) == d


@pytest.mark.parametrize("model,gpus,inp,out", CASES[::2])
def test_auto_picks_the_better_of_the_two_plans(model, gpus, inp, out):
    auto = _planned(model, gpus, inp, out, "auto")
    on = _planned(model, gpus, inp, out, "on")
    a, s = pools.aggregated_option(auto.aggregated), on.choice.winner
    w = Workload(inp, out)
    want = "disaggregated" if s.figure("balanced", w) > a.figure("balanced", w) else "aggregated"
    assert auto.deployment.kind == want


def test_short_prompts_stay_aggregated():
    """200 in / 200 out (llm-d: P/D is not for short sequences): the de-rates (0.9, 0.92) cost
    a split more than the prefill interference it removes."""
    for model, gpus in (("llama-3.1-8b", "8xH100"), ("llama-3.1-70b", "8xH200")):
        r = pools.plan_deployment(load_model(model), parse_gpus(gpus),
                                  Pins(vllm_version=VERSION), workload=Workload(200, 200))
        assert r.deployment.kind == "aggregated", model
        (why,) = [x for x in r.deployment.reasons if x.code == "deployment.chosen"]
        assert why.data["runner_up"]["deployment"] == "disaggregated"
        assert why.data["ratio"] > 1


def test_off_is_todays_plan_plus_its_reason():
    from launcher.predict.search.planner import make_plan

    spec, hw = load_model("llama-3.1-8b"), parse_gpus("8xH100")
    r = pools.plan_deployment(spec, hw, Pins(vllm_version=VERSION), mode="off")
    today = make_plan(spec, hw, Pins(vllm_version=VERSION)).deployment()
    assert dataclasses.replace(r.deployment, reasons=today.reasons) == today
    assert [x.code for x in r.deployment.reasons][-1] == "deployment.chosen"


# ---- bad input: one line, exit 2 ---------------------------------------------------------------


@pytest.mark.parametrize("args,says", [
    (["--disaggregate", "on", "--gpus", "1xH100"], "needs at least 2 GPUs"),
    (["--kv-connector", "P2pNcclConnector", "--gpus", "8xH100"], "has no P2pNcclConnector"),
    (["--kv-connector", "NoSuchConnector", "--gpus", "8xH100"], "unknown KV connector"),
    (["--prefill-tp", "4", "--decode-tp", "2", "--gpus", "8xH100"], "decode TP >= 4"),
    (["--prefill-tp", "2", "--decode-tp", "4", "--kv-connector", "MooncakeConnector",
      "--gpus", "8xH100"], "same tensor-parallel size"),
    (["--disaggregate", "on", "--emit", "DIR", "--gpus", "8xH100"], "--role prefill or --role"),
])
def test_bad_disaggregation_input_is_one_line(args, says, tmp_path):
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--vllm-version", VERSION, *args])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and says in lines[0], r.output


def test_exec_refuses_a_disaggregated_plan_in_one_line(tmp_path):
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "8xH100", "--vllm-version",
                                 VERSION, "--disaggregate", "on", "--format", "json", "-o",
                                 str(tmp_path / "plan.json")])
    assert r.exit_code == 0, r.output
    j = json.loads((tmp_path / "plan.json").read_text())
    assert j["deployment"] == "disaggregated"
    r = CliRunner().invoke(cli, ["exec", "--plan", str(tmp_path / "plan.json"), "--dry-run",
                                 "--no-metrics"])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "disaggregated" in lines[0], r.output


def test_the_text_shows_both_pools_and_their_commands():
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "8xH100", "--vllm-version",
                                 VERSION, "--disaggregate", "on", "--input-len", "8192"])
    assert r.exit_code == 0, r.output
    for piece in ("prefill:", "decode:", "KV hand-off: NixlConnector over nvlink",
                  "VLLM_NIXL_SIDE_CHANNEL_PORT=5600", "VLLM_NIXL_SIDE_CHANNEL_PORT=5608",
                  "deployment disaggregated"):
        assert piece in r.output, piece
    assert r.output.count(F.flag("kv_transfer_config")) == 2


def test_every_pairing_the_sweep_emits_passes_the_connector_rules():
    from launcher.predict.features import connectors

    for (model, gpus, inp, out), name in itertools.product(CASES, ["NixlConnector"]):
        d = _planned(model, gpus, inp, out).deployment
        tp = [p.engine.parallel.tp for p in d.pools]
        connectors.check(name, VERSION, tp[0], tp[1], d.model.attention.startswith("mla"))


# ---- capacity: disaggregated options priced beside aggregated ones -----------------------------


def test_capacity_units_gpus_and_bill_are_the_units_arithmetic():
    from launcher.predict.capacity import capacity, capacity_pd
    from launcher.predict.capacity.prices import PriceBook

    spec, w = load_model("llama-3.1-70b"), Workload(8192, 256)
    book = PriceBook(flat={"H200": 3.0})
    for rps, headroom, spare in ((5.0, 0.2, 0), (40.0, 0.0, 1), (0.3, 0.5, 2)):
        load = capacity.Load(rps=rps)
        o = capacity_pd.evaluate(spec, "8xH200", load, w, RELAXED, Pins(vllm_version=VERSION),
                                 book, headroom, spare)
        u = o["per_unit"]
        units = math.ceil(rps * (1 + headroom) / u["requests_per_s"] - 1e-6) + spare
        assert o["units"] == units  # within the per-unit figure's rounding
        assert o["gpus_total"] == units * u["gpus"]
        assert o["monthly_usd"] == round(3.0 * o["gpus_total"] * capacity.HOURS_PER_MONTH)
        assert sum(p["replicas"] * p["gpus_per_replica"] for p in o["pools"]) == o["gpus_total"]
        # users: a unit holds rate x time in the system (Little's law)
    users = capacity.Load(users=500)
    o = capacity_pd.evaluate(spec, "8xH200", users, w, RELAXED, Pins(vllm_version=VERSION), book,
                             0.0, 0)
    u = o["per_unit"]
    held = u["requests_per_s"] * (u["ttft_ms"] + 255 * u["tpot_ms"]) / 1e3
    assert u["concurrency"] == pytest.approx(held, rel=1e-3)
    assert o["units"] == math.ceil(500 / held - 1e-6)


def test_capacity_verdict_names_the_cheaper_deployment():
    from launcher.predict.capacity import capacity_pd

    def opt(usd, gpus):
        return {"gpus": f"{gpus}", "units": 1, "gpus_total": gpus, "monthly_usd": usd}

    rng = random.Random(3)
    for _ in range(300):
        options = [opt(rng.choice([None, rng.randint(1000, 90000)]), rng.randint(2, 64))
                   for _ in range(rng.randint(1, 4))]
        rec = {"monthly_usd": rng.choice([None, rng.randint(1000, 90000)]),
               "gpus_total": rng.randint(1, 64)}
        v = capacity_pd.verdict(options, rec)
        best = min(options, key=lambda o: (o["monthly_usd"] is None, o["monthly_usd"] or 0,
                                           o["gpus_total"]))
        by = "monthly_usd" if best["monthly_usd"] is not None and rec["monthly_usd"] is not None \
            else "gpus_total"
        assert v["by"] == by
        assert v["wins"] == ("disaggregated" if best[by] < rec[by] else "aggregated")
        assert v["ratio"] == pytest.approx(round(max(best[by], rec[by]) / min(best[by], rec[by]),
                                                 3))
    assert capacity_pd.verdict([], None)["wins"] is None


def test_capacity_json_prices_both_and_off_leaves_them_out():
    base = ["capacity", "llama-3.1-70b", "--rps", "10", "--input-len", "8192", "--output-len",
            "256", "--slo", "ttft=10s,tpot=50ms", "--gpus", "8xH200", "--vllm-version", VERSION,
            "--format", "json"]
    r = CliRunner().invoke(cli, base)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert schema_errors("capacity", d) == []
    (o,) = d["disaggregated"]["options"]
    assert [p["role"] for p in o["pools"]] == ["prefill", "decode"] and o["units"] >= 1
    assert d["disaggregated"]["verdict"]["wins"] in ("aggregated", "disaggregated")
    r = CliRunner().invoke(cli, [*base, "--disaggregate", "off"])
    assert r.exit_code == 0 and "disaggregated" not in json.loads(r.output)


# ---- the exporter knows a pool's role ----------------------------------------------------------


def _series(exp) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(exp.render().decode()) for s in f.samples}


def test_the_exporter_labels_a_pools_series_with_its_role_and_its_figures():
    from launcher.errors import InputError
    from launcher.observe import exporter as ex

    d = _planned("llama-3.1-8b", "8xH100", 2048, 256).deployment
    for role, pool in (("prefill", d.pools[0]), ("decode", d.pools[1]), (None, d.pools[0])):
        s = _series(ex.Exporter(None, plan=d, gpu_reader=None, role=role))
        want = role or "prefill"
        mine = [k for k in s if k[0].startswith("vlaunch_")]
        assert mine and all(("role", want) in labels for _, labels in mine)
        kv = s[("vlaunch_plan_memory_bytes",
                frozenset({"component": "kv_cache", "role": want}.items()))]
        assert kv == pool.per_gpu.kv_cache_bytes
    agg = _planned("llama-3.1-8b", "8xH100", 2048, 256, "off").deployment
    s = _series(ex.Exporter(None, plan=agg, gpu_reader=None))
    # an aggregated plan keeps today's label sets; only the autoscaling series are per pool
    # (issue 27: role="aggregated")
    per_pool = ("vlaunch_replica_capacity_requests", "vlaunch_desired_replicas",
                "vlaunch_plan_slo_seconds")
    assert not any("role" in dict(labels) for name, labels in s
                   if name.startswith("vlaunch_") and not name.startswith(per_pool))
    assert all(dict(labels).get("role") == "aggregated" for name, labels in s
               if name.startswith(per_pool))
    with pytest.raises(InputError, match="no decode pool"):
        ex.Exporter(None, plan=agg, gpu_reader=None, role="decode")


# ---- the doctor says which pool failed ---------------------------------------------------------

KV_REPR = ("KVTransferConfig(kv_connector='NixlConnector', engine_id='712be476', "
           "kv_buffer_device='cuda', kv_role='{role}', kv_port=14579, "
           "kv_connector_extra_config={{}}, kv_connector_module_path=None, "
           "enable_permute_local_kv=False, kv_load_failure_policy='fail')")


def _pd_log(path, args: dict, kv_role: str):
    """A failed P/D engine's log as vLLM 0.32 writes it: the config object printed as its repr
    among the non-default args (api_utils.py logs the parsed namespace)."""
    text = repr(args)[:-1] + ", 'kv_transfer_config': " + KV_REPR.format(role=kv_role) + "}"
    path.write_text(
        "(APIServer pid=1) INFO 11-30 10:00:01 [api_utils.py:347] vLLM API server version 0.32.0\n"
        f"(APIServer pid=1) INFO 11-30 10:00:02 [api_utils.py:286] non-default args: {text}\n"
        "(EngineCore pid=2) ERROR 11-30 10:00:09 [core.py:1010] ValueError: No available "
        "memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine.\n")
    return path


@pytest.mark.parametrize("kv_role,name,role", [
    ("kv_producer", "vllm.log", "prefill"), ("kv_consumer", "vllm.log", "decode"),
    ("kv_both", "vllm-decode.log", "decode"), ("kv_both", "vllm-prefill.log", "prefill"),
    ("kv_both", "vllm.log", None)])
def test_the_doctor_reads_the_connector_and_names_the_pool(tmp_path, kv_role, name, role):
    from launcher.observe import doctor

    log = _pd_log(tmp_path / name, {"model": "meta-llama/Llama-3.1-8B-Instruct",
                                    "max_num_seqs": 8, "gpu_memory_utilization": 0.5}, kv_role)
    report, _ = doctor.diagnose(str(log))
    d = report.root
    assert report.facts.arg("max_num_seqs") == 8  # the other args still read
    assert d.numbers["pool"] == {"role": role, "connector": "NixlConnector", "kv_role": kv_role,
                                 "how": d.numbers["pool"]["how"]}
    said = d.explain[0]
    assert "NixlConnector" in said and (f"the {role} pool" in said if role else "--plan" in said)


def test_with_its_plan_the_doctor_finds_the_pool_by_the_engines_shape(tmp_path):
    from launcher.observe import doctor

    dep = _planned("llama-3.1-8b", "8xH100", 16384, 512).deployment
    for pool in dep.pools:
        e = pool.engine
        others = [p for p in dep.pools if p is not pool]
        if any(p.engine.max_num_seqs == e.max_num_seqs and
               p.engine.max_num_batched_tokens == e.max_num_batched_tokens and
               p.engine.parallel == e.parallel for p in others):
            continue  # two pools alike cannot be told apart by their args
        log = _pd_log(tmp_path / "engine.log",
                      {"model": e.model, "max_num_seqs": e.max_num_seqs,
                       "max_num_batched_tokens": e.max_num_batched_tokens,
                       "tensor_parallel_size": e.parallel.tp}, "kv_both")
        d = doctor.diagnose(str(log), plan=dep)[0].root
        assert d.numbers["pool"]["role"] == pool.role
        assert "plan's pool" in d.numbers["pool"]["how"]


def test_a_config_repr_is_read_as_its_fields_and_nothing_runs():
    import ast as _ast

    from launcher.inputs.vllm_loglines import config_reprs_as_dicts
    text = "{'a': 1, 'kv_transfer_config': KVTransferConfig(kv_connector='X', kv_role=" \
           "'kv_both', f=__import__('os').system('x'), g=(1, 2)), 'b': 'KVTransferConfig(('}"
    got = _ast.literal_eval(config_reprs_as_dicts(text))
    assert got == {"a": 1, "kv_transfer_config": {"kv_connector": "X", "kv_role": "kv_both",
                                                   "g": (1, 2)}, "b": "KVTransferConfig(("}
    unbalanced = "{'kv_transfer_config': KVTransferConfig(kv_connector='X'"
    assert config_reprs_as_dicts(unbalanced) == unbalanced


def test_each_pool_gets_deepeps_kernel_for_its_role(monkeypatch):
    """Across nodes, DeepEP's high-throughput kernels prefill and its low-latency ones decode
    (vLLM expert_parallel_deployment.md); the aggregated search picks one by objective and
    workload, so a pool's replica is re-planned with its role's kernel; a pin is kept."""
    from launcher.predict.features.ep_backend import IMAGE_PACKAGES_ENV
    from launcher.predict.search.planner import make_plan

    monkeypatch.setenv(IMAGE_PACKAGES_ENV, "deep_ep,nvshmem")
    spec, hw = load_model("deepseek-r1"), parse_gpus("2x8xH200")
    wide = Pins(tp=8, dp=2, expert_parallel=True, vllm_version=VERSION)
    for objective, w in (("throughput", Workload(8192, 256)), ("balanced", Workload(1024, 1024))):
        p = make_plan(spec, hw, wide, suggest=False, workload=w, objective=objective)
        got = p.serving.ep_backend.backend
        assert got in pools.ROLE_ALL2ALL.values()
        for role, want in pools.ROLE_ALL2ALL.items():
            assert pools.role_all2all(p, role, wide) == (None if got == want else want)
            pinned = dataclasses.replace(wide, all2all_backend=got)
            assert pools.role_all2all(p, role, pinned) is None
            if got != want:
                again = make_plan(spec, hw, dataclasses.replace(wide, all2all_backend=want),
                                  suggest=False, workload=w, objective=objective)
                assert again.serving.ep_backend.backend == want


def test_a_plan_over_nodes_prints_its_pools_and_the_doctor_takes_it(tmp_path):
    plan = tmp_path / "plan.json"
    base = ["plan", "llama-3.1-70b", "--gpus", "2x8xH200", "--vllm-version", VERSION,
            "--disaggregate", "on", "--input-len", "8192", "--output-len", "256", "--slo",
            "ttft=10s,tpot=50ms"]
    r = CliRunner().invoke(cli, [*base, "--format", "json", "-o", str(plan)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, [*base, "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    assert "KV hand-off: NixlConnector over rdma" in r.output and "UCX_NET_DEVICES" in r.output
    assert "nothing drawn" in r.output and not (tmp_path / "p.png").exists()
    log = _pd_log(tmp_path / "vllm-decode.log", {"model": "meta-llama/Llama-3.1-70B-Instruct"},
                  "kv_both")
    r = CliRunner().invoke(cli, ["doctor", str(log), "--plan", str(plan), "--format", "json"])
    assert r.exit_code == 1, r.output
    (root, *_) = json.loads(r.output)["diagnoses"]
    assert root["numbers"]["pool"]["role"] == "decode"
