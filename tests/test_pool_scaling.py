"""Each pool of a disaggregated plan scales on what binds it (predict/capacity/autoscaling.py
prefill_scaling, decode_scaling); its ScaledObject (run/emit.py) and the exporter's advisory
replicas (observe/families.py) come from the same thresholds and the same arithmetic."""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest

from launcher.deployment.plan import Startup
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.capacity import autoscaling as A
from launcher.predict.search import pd_pools
from launcher.predict.search.planner import Pins
from launcher.predict.speed import disagg
from launcher.run import emit

VERSION = "0.32.0"


def _start(seconds: float = 450.0) -> Startup:
    return Startup(seconds, "model", "local", {})


def _prefill(**kw):
    args = dict(replicas=1, dp=8, requests_per_s=20.0, prompt_s=0.25, fixed_s=0.4, derate=0.9,
                ttft_slo_ms=2000.0, time_in_system_s=14.0, kv_tokens_per_engine=400_000,
                block_size=16, input_len=1000, startup=_start())
    return A.prefill_scaling(**{**args, **kw})


def _decode(**kw):
    args = dict(replicas=1, dp=8, requests_per_s=10.0, running_per_engine=64.0, derate=0.92,
                ttft_slo_ms=2000.0, ttft_ms=1500.0, time_in_system_s=14.0,
                kv_tokens_per_engine=400_000, block_size=16, input_len=1024, output_len=256,
                startup=_start())
    return A.decode_scaling(**{**args, **kw})


def test_a_prefill_pool_scales_on_the_queue_its_ttft_allows():
    a = _prefill()
    # backlog B = 2.0 - 0.4 = 1.6 s; a queue drains at 20 prompts/s: floor(1.6 x 20) = 32
    assert a.prefill_backlog_s == pytest.approx(1.6) and a.target_waiting_per_replica == 32
    # M/D/1 within B: rho <= 2 x 1.6 / (0.25 + 3.2) = 0.928, capped at the 0.9 de-rate:
    # 18 prompts/s in service for 0.25 s each: floor(4.5) = 4 running
    assert a.basis["utilization_at_slo"] == pytest.approx(0.9)
    assert a.target_running_per_replica == 4
    # 4 prompts over 8 engines, 1,008 tokens each (63 blocks of 16), of 400,000: 0.0013 -> 0.01
    assert a.kv_usage_threshold == 0.01
    assert a.basis["queued_prompt_tokens"] == 32 * 1000
    tight = _prefill(ttft_slo_ms=600.0)
    # B = 0.2 s: floor(0.2 x 20) = 4 waiting; rho = 0.4 / 0.65 = 0.615: 12.3/s, floor(3.08) = 3
    assert tight.target_waiting_per_replica == 4 and tight.target_running_per_replica == 3
    assert tight.basis["utilization_at_slo"] == pytest.approx(0.4 / 0.65, abs=1e-4)
    assert (a.role, tight.role) == ("prefill", "prefill")
    assert a.scale_up_stabilization_s == 450 and a.scale_down_stabilization_s == 450


def test_a_decode_pool_scales_on_its_batch_and_kv_at_the_tpot_knee():
    a = _decode()
    # 0.92 x 64 per engine x 8 engines = 471.04: 471 running per replica
    assert a.target_running_per_replica == 471
    # 471 / 8 = 58.875 per engine x (1,024 + 128 = 1,152 tokens, 72 blocks) / 400,000 = 0.1696
    assert a.kv_usage_threshold == 0.17
    # advisory queue: (2.0 - 1.5) s left of the TTFT at 0.92 x 10 = 9.2 completions/s: 4
    assert a.target_waiting_per_replica == 4 and a.prefill_backlog_s is None
    assert a.role == "decode" and A.POOL_TRIGGERS["decode"] == ("running", "kv_usage")


def test_pool_targets_hold_their_physics_over_a_sweep():
    rng = random.Random(2626)
    for _ in range(500):
        mu, s = rng.uniform(0.2, 80), rng.uniform(0.005, 3.0)
        fixed = s + rng.uniform(0, 0.2)
        slo = rng.uniform(50, 20_000)
        dp = rng.choice([1, 2, 4, 8, 16])
        start = _start(rng.uniform(10, 5000))
        p = _prefill(requests_per_s=mu, prompt_s=s, fixed_s=fixed, ttft_slo_ms=slo, dp=dp,
                     startup=start, input_len=rng.randint(16, 32768))
        b = max(0.0, slo / 1e3 - fixed)
        rho = min(0.9, 2 * b / (s + 2 * b))
        assert p.basis["utilization_at_slo"] == pytest.approx(rho, abs=1e-4)
        # the M/D/1 wait at the rate it is held to stays within the backlog
        assert rho / (2 * (1 - rho)) * s <= b + 1e-9
        # the queue it may hold drains within the backlog (or is the one request that must)
        assert p.target_waiting_per_replica == 1 or p.target_waiting_per_replica / mu <= b + 1e-9
        assert p.target_running_per_replica >= 1 and 0 < p.kv_usage_threshold <= 1
        d = _decode(running_per_engine=rng.uniform(1, 512), dp=dp, startup=start,
                    requests_per_s=rng.uniform(0.1, 100), output_len=rng.randint(1, 8192))
        assert 1 <= d.target_running_per_replica <= max(1, d.basis["running_per_engine_at_knee"]
                                                        * dp)
        assert 0 < d.kv_usage_threshold <= 1
        for a in (p, d):
            assert a.scale_up_stabilization_s >= min(start.seconds, A.HPA_MAX_WINDOW_S) - 1e-9
            assert A.HPA_SCALE_DOWN_DEFAULT_S <= a.scale_down_stabilization_s <= 3600
            assert a.min_replicas == a.max_replicas == 1


def test_a_pool_is_sized_for_a_load_at_its_own_rate():
    a = _prefill(ask=A.ScalingAsk(rps=100.0))
    # 100 req/s x 1.2 headroom / 18 per replica = 6.67: 7, and the floor is the planned 1
    assert (a.min_replicas, a.max_replicas) == (1, 7)
    d = _decode(ask=A.ScalingAsk(rps=100.0), replicas=3)
    assert (d.min_replicas, d.max_replicas) == (3, math.ceil(120 / 9.2))
    low = _decode(ask=A.ScalingAsk(max_replicas=2), replicas=3)
    assert (low.min_replicas, low.max_replicas) == (2, 2)


def test_desired_replicas_is_kedas_arithmetic_over_the_roles_triggers():
    rng = random.Random(27)
    for _ in range(300):
        a = rng.choice([_prefill(requests_per_s=rng.uniform(1, 50)),
                        _decode(running_per_engine=rng.uniform(1, 100))])
        load = {"running": rng.uniform(0, 2000), "waiting": rng.uniform(0, 300),
                "kv_usage": rng.uniform(0, 4)}
        so = emit.scaled_object(a)
        got = {t["name"].removeprefix("vllm-").replace("-", "_"): float(
            t["metadata"]["threshold"]) for t in so["spec"]["triggers"]}
        assert set(got) == set(A.POOL_TRIGGERS[a.role])
        want = max(math.ceil(load[k] / t - 1e-9) for k, t in got.items())
        assert A.desired_replicas(a, load) == want


@functools.cache
def _split(model: str, gpus: str, rps: float | None = None):
    return pd_pools.plan_deployment(load_model(model), parse_gpus(gpus),
                                    Pins(vllm_version=VERSION), mode="on",
                                    workload=Workload(8192, 512), slo=SLO(4000, 50),
                                    scaling=A.ScalingAsk(rps=rps) if rps else None)


@pytest.mark.parametrize("model,gpus", [("deepseek-r1", "2x8xH200"), ("llama-3.1-8b", "8xH100"),
                                        ("llama-3.1-70b", "8xH200")])
def test_the_plans_pools_carry_the_targets_of_their_own_figures(model, gpus):
    r = _split(model, gpus)
    d, sp = r.deployment, r.choice.winner.split
    pre, dec = d.pools
    p1 = disagg.prefill_pool(r.choice.winner.prefill.performance.shape, d.workload)
    d1 = disagg.decode_pool(r.choice.winner.decode.performance.shape, d.workload, d.slo)
    a, b = pre.autoscaling, dec.autoscaling
    assert (a.role, b.role) == ("prefill", "decode")
    backlog = d.slo.ttft_ms / 1e3 - (p1.prompt_s + sp.transfer.seconds + d1.first_step_s)
    assert a.prefill_backlog_s == pytest.approx(backlog, abs=1e-3)
    assert a.target_waiting_per_replica == max(1, math.floor(backlog * p1.requests_per_s + 1e-9))
    assert b.target_running_per_replica == max(1, math.floor(
        disagg.DECODE_DERATE * d1.running * dec.engine.parallel.dp + 1e-9))
    assert a.startup_s == pre.startup.seconds and b.startup_s == dec.startup.seconds
    assert (a.min_replicas, b.min_replicas) == (pre.replicas, dec.replicas)


def test_each_pools_scaled_object_and_exporter_agree(tmp_path):
    from launcher.observe.families import scaling_families
    from launcher.observe.vllmpage import parse_vllm_metrics

    whole = _split("deepseek-r1", "2x8xH200", rps=60.0).deployment
    rng = random.Random(5)
    for role in ("prefill", "decode"):
        d = emit.pool_plan(whole, role)
        a = d.pool.autoscaling
        assert a.max_replicas == A.replicas_needed(60.0, a.basis["rate_at_slo"], 0.2, 0)
        (so,) = list(__import__("yaml").safe_load_all(emit.scaled_objects_text(d)))
        assert so["metadata"]["name"] == f"vlaunch-{role}"
        for _ in range(100):
            running = [rng.randint(0, 80) for _ in range(8)]
            waiting = [rng.randint(0, 60) for _ in range(8)]
            usage = [round(rng.uniform(0, 1), 3) for _ in range(8)]
            page = "".join(
                f'vllm:num_requests_running{{engine="{i}"}} {r}\n'
                f'vllm:num_requests_waiting{{engine="{i}"}} {w}\n'
                f'vllm:kv_cache_usage_perc{{engine="{i}"}} {u}\n'
                for i, (r, w, u) in enumerate(zip(running, waiting, usage, strict=True)))
            fams = {f.name: f for f in scaling_families(d, parse_vllm_metrics(page))}
            (s,) = fams["vlaunch_desired_replicas"].samples
            assert s.labels == {"role": role}
            load = {"running": sum(running), "waiting": sum(waiting),
                    "kv_usage": sum(usage) / len(usage)}
            thresholds = {t["name"]: float(t["metadata"]["threshold"])
                          for t in so["spec"]["triggers"]}
            keda = max(math.ceil(load[k.removeprefix("vllm-").replace("-", "_")] / t - 1e-9)
                       for k, t in thresholds.items())
            assert s.value == keda == A.desired_replicas(a, load)


def test_an_emitted_pools_exporter_carries_its_role(tmp_path):
    from launcher.observe import exporter as ex

    whole = _split("llama-3.1-8b", "8xH100").deployment
    for role in ("prefill", "decode"):
        emit.emit_plan(emit.pool_plan(whole, role), tmp_path / role)
        plan = emit.load_plan(tmp_path / role)
        e = ex.Exporter(None, plan=plan, gpu_reader=None)
        assert e.role == role and e.plan.pool.role == role
        text = e.render().decode()
        assert f'vlaunch_replica_capacity_requests{{role="{role}"}}' in text
        other = "decode" if role == "prefill" else "prefill"
        e2 = ex.Exporter(None, plan=plan, gpu_reader=None, role=other)
        assert e2.role == other and e2.plan.pool.role == other
    assert dataclasses.replace(whole, role=None).pool.role == "prefill"


def test_the_plan_text_shows_each_pools_own_triggers():
    from click.testing import CliRunner

    from launcher.cli import cli

    r = CliRunner().invoke(cli, ["plan", "deepseek-r1", "--gpus", "2x8xH200", "--vllm-version",
                                 VERSION, "--disaggregate", "on", "--max-replicas", "3"])
    assert r.exit_code == 0, r.output
    d = _split_for_text()
    pre, dec = (p.autoscaling for p in d.pools)
    assert (f"autoscaling: 1-3 replicas on waiting {pre.target_waiting_per_replica:,}, "
            f"running {pre.target_running_per_replica:,} per replica") in r.output
    assert (f"autoscaling: 1-3 replicas on running {dec.target_running_per_replica:,}, "
            f"KV {dec.kv_usage_threshold:.0%} per replica") in r.output


def _split_for_text():
    return pd_pools.plan_deployment(load_model("deepseek-r1"), parse_gpus("2x8xH200"),
                                    Pins(vllm_version=VERSION), mode="on",
                                    scaling=A.ScalingAsk(max_replicas=3)).deployment
