"""Autoscaling from the plan: start-up prediction, the targets' arithmetic, the CLI's bad input,
the ScaledObject, and the exporter's advisory replica count."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import yaml

from launcher.deployment.plan import Startup
from launcher.errors import InputError
from launcher.observe.families import scaling_families
from launcher.observe.vllmpage import parse_vllm_metrics
from launcher.predict.capacity import startup_measured
from launcher.predict.capacity import startup_time as startup
from launcher.predict.capacity.autoscaling import (
    HPA_MAX_WINDOW_S,
    Knee,
    ScalingAsk,
    derive,
    replicas_needed,
)
from launcher.run.emit import emit_plan, scaled_object

GiB = 1 << 30


def _knee(**kw) -> Knee:
    base = dict(concurrency=34, requests_per_s=2.652, output_tokens_per_s=678.9, ttft_ms=305.0,
                open_loop_requests_per_s=2.641)
    return Knee(**{**base, **kw})


def _derive(knee: Knee, ask: ScalingAsk | None = None, role: str = "aggregated",
            seconds: float = 55.0, **kw):
    args = dict(ttft_slo_ms=2000.0, single_ttft_ms=120.0, dp=1, kv_tokens_per_engine=524_304,
                block_size=16, input_len=1024, output_len=256)
    st = Startup(seconds, "model", "local", {"all": seconds})
    return derive(knee, startup=st, ask=ask or ScalingAsk(), role=role, **{**args, **kw})


# ---- the targets, from first principles --------------------------------------------------------


def test_targets_of_the_tiny_models_knee():
    a = _derive(_knee())
    # 34 requests in flight at the knee
    assert a.target_running_per_replica == 34
    # (2,000 - 305) ms of spare TTFT x 2.652 prompts/s (1,024 tokens each) = 4.49 -> 4
    assert a.target_waiting_per_replica == 4
    # 34 running x ceil((1,024 + 128) / 16) x 16 = 1,152 tokens each over 524,304 -> 0.0747
    assert a.kv_usage_threshold == 0.08
    assert a.prefill_backlog_s is None  # only a prefill pool has one
    assert (a.min_replicas, a.max_replicas) == (1, 1)
    assert (a.scale_up_stabilization_s, a.scale_down_stabilization_s) == (55, 300)


def test_prefill_pool_backlog_is_the_slo_less_one_prompts_prefill():
    assert _derive(_knee(), role="prefill").prefill_backlog_s == pytest.approx(1.88)


def test_targets_hold_over_random_knees():
    """Properties over 500 random knees, SLOs, shapes and start-ups."""
    rng = random.Random(27)
    for _ in range(500):
        knee = _knee(concurrency=rng.uniform(1, 600), requests_per_s=rng.uniform(0.01, 80),
                     ttft_ms=rng.uniform(10, 5000), open_loop_requests_per_s=rng.uniform(0, 60))
        slo = rng.uniform(50, 10_000)
        seconds = rng.uniform(1, 6000)
        dp = rng.choice([1, 2, 4, 8, 16])
        a = _derive(knee, ttft_slo_ms=slo, dp=dp, seconds=seconds,
                    kv_tokens_per_engine=rng.randint(1_000, 5_000_000),
                    input_len=rng.randint(1, 32_000), output_len=rng.randint(1, 8_000),
                    role=rng.choice(["aggregated", "prefill", "decode"]))
        assert 1 <= a.target_running_per_replica <= max(1, knee.concurrency + 1e-9)
        assert a.target_waiting_per_replica >= 1
        queue_s = a.target_waiting_per_replica / knee.requests_per_s
        if a.target_waiting_per_replica > 1:  # the queue it allows drains within the spare TTFT
            assert queue_s <= (slo - knee.ttft_ms) / 1e3 + 1e-9
        assert 0 < a.kv_usage_threshold <= 1
        for window in (a.scale_up_stabilization_s, a.scale_down_stabilization_s):
            assert window >= min(seconds, HPA_MAX_WINDOW_S) - 1e-9
            assert window <= HPA_MAX_WINDOW_S
        assert a.scale_down_stabilization_s >= a.scale_up_stabilization_s
        assert a.min_replicas <= a.max_replicas


def test_replicas_for_a_load_use_capacitys_rule():
    # 100 users x 1.2 / 34 per replica = 3.53 -> 4
    assert replicas_needed(100, 34, 0.2, 0) == 4
    a = _derive(_knee(), ScalingAsk(users=100))
    assert (a.min_replicas, a.max_replicas) == (1, 4)
    # 10 req/s x 1.2 / 2.641 = 4.54 -> 5, + 1 spare
    a = _derive(_knee(), ScalingAsk(rps=10, spare=1))
    assert a.max_replicas == 6


@pytest.mark.parametrize("ask,needle", [
    (ScalingAsk(min_replicas=3, max_replicas=2), "above --max-replicas"),
    (ScalingAsk(min_replicas=0), "at least 1"),
    (ScalingAsk(users=500, max_replicas=2), "need 18 replicas"),
    (ScalingAsk(users=5, rps=1.0), "at most one"),
])
def test_bad_asks_are_input_errors(ask, needle):
    with pytest.raises(InputError, match=needle):
        _derive(_knee(), ask)


# ---- start-up ----------------------------------------------------------------------------------


def test_capture_sizes_are_vllms_defaults():
    # max_num_seqs 256: min(2 x 256, 512) = 512 -> 1, 2, 4, 8..248 step 8, 256..512 step 16
    sizes = startup.capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and len(sizes) == 3 + 31 + 17
    assert startup.capture_sizes(4) == [1, 2, 4, 8]


def test_startup_terms_add_up_and_grow_with_bytes_and_path():
    s = startup.predict(8 * GiB, 8, 80, 256, "local")
    assert isinstance(s, Startup)  # the plan's own type, no second shape
    # weights: 15.3 s + max(8 GiB / 0.93 GiB/s, 64 GiB / 3 GiB/s) = 15.3 + 21.3, at the 0.1 s
    # the plan prints
    assert s.terms["weights"] == round(15.3 + 64 / 3.0, 1) == 36.6
    # the sum is rounded once, each term once: at most half a tenth apart per term
    assert s.seconds == pytest.approx(sum(s.terms.values()), abs=0.05 * (len(s.terms) + 1))
    slow = startup.predict(8 * GiB, 8, 80, 256, "volume")
    assert slow.terms["weights"] > s.terms["weights"]
    eager = startup.predict(8 * GiB, 8, 80, 256, "local", enforce_eager=True)
    assert "cuda_graphs" not in eager.terms and eager.seconds < s.seconds
    rng = random.Random(3)
    for _ in range(300):  # never faster than the bytes over the path's bandwidth
        per, ranks = rng.uniform(0.1, 100) * GiB, rng.choice([1, 2, 4, 8, 16])
        path = rng.choice(list(startup.LOAD_PATHS))
        p = startup.predict(per, ranks, rng.randint(1, 128), rng.randint(1, 1024), path,
                            cpu=rng.random() < 0.2)
        # rounding is monotone: the 0.1 s figure is never under the floor at 0.1 s
        assert p.seconds >= round(per * ranks / startup.LOAD_PATHS[path].bytes_per_s, 1)
        assert p.seconds == round(p.seconds, 1) and all(v == round(v, 1) for v in p.terms.values())


def test_the_windows_read_the_startup_the_plan_prints():
    """One figure: the scale-up window is the start-up the plan prints (0.1 s) rounded up to a
    whole second, never the estimator's unrounded sum (which a 141.03 s start-up turned into a
    142 s window beside a printed 141.0 s)."""
    rng = random.Random(11)
    for _ in range(300):
        per, ranks = rng.uniform(0.1, 400) * GiB, rng.choice([1, 2, 4, 8, 16])
        st = startup.predict(per, ranks, rng.randint(1, 128), rng.randint(1, 1024),
                             rng.choice(list(startup.LOAD_PATHS)), cpu=rng.random() < 0.2,
                             enforce_eager=rng.random() < 0.2)
        a = derive(_knee(), ttft_slo_ms=2000.0, single_ttft_ms=120.0, dp=1,
                   kv_tokens_per_engine=524_304, block_size=16, input_len=1024, output_len=256,
                   startup=st, ask=ScalingAsk())
        assert a.startup_s == st.seconds
        assert a.scale_up_stabilization_s == min(math.ceil(st.seconds - 1e-9), HPA_MAX_WINDOW_S)


def test_the_plans_startup_is_the_deployments(tiny_model):
    """The planner's start-up flows into the typed plan as the same object, not rebuilt from
    a dict."""
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import make_plan

    plan = make_plan(load_model(str(tiny_model)), parse_gpus("cpu"))
    assert isinstance(plan.startup, Startup) and plan.deployment().pool.startup is plan.startup


def test_measured_startup_is_used_by_the_next_plan(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path))
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import make_plan
    from launcher.run.startup_timing import learn_startup

    spec, hw = load_model(str(tiny_model)), parse_gpus("cpu")
    dep = make_plan(spec, hw).deployment()
    assert dep.pool.startup.source == "model"

    class Runner:  # phases as VllmRunner marks them
        phase_marks = [("starting", 100.0), ("loading_weights", 104.0), ("profiling", 110.0),
                       ("allocating_kv_cache", 130.0), ("ready", 141.5)]

    line = learn_startup(Runner(), dep, None)
    assert line and "41.5 s" in line
    d2 = make_plan(spec, hw).to_dict()
    assert d2["startup"]["source"] == "measured" and d2["startup"]["seconds"] == 41.5
    assert d2["startup"]["terms"] == {"starting": 4.0, "loading_weights": 6.0,
                                      "profiling": 20.0, "allocating_kv_cache": 11.5}
    assert list(d2["startup"]["terms"])[0] == "starting"  # in the order vLLM went through them
    assert d2["autoscaling"]["startup_s"] == 41.5
    assert d2["autoscaling"]["scale_up_stabilization_s"] == 42
    assert startup_measured.key(dep, "local") != startup_measured.key(dep, "hub")


def test_the_startup_serve_prints_is_the_one_the_next_plan_carries(tmp_path, monkeypatch,
                                                                   tiny_model):
    """Rounded once, as stored: a 1.049 s start-up is stored as 1.05 s, which the plan
    prints as 1.1 s, so the line says 1.1 s too (it said 1.0 s)."""
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path))
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import make_plan
    from launcher.run.startup_timing import learn_startup

    spec, hw = load_model(str(tiny_model)), parse_gpus("cpu")
    dep = make_plan(spec, hw).deployment()

    class Runner:
        phase_marks = [("starting", 10.0), ("loading_weights", 10.449), ("ready", 11.049)]

    line = learn_startup(Runner(), dep, None)
    st = make_plan(spec, hw).deployment().pool.startup
    assert st.source == "measured" and st.seconds == 1.1
    assert line and "took 1.1 s (starting 0.5 s, loading_weights 0.6 s)" in line
    assert dict(st.terms) == {"starting": 0.5, "loading_weights": 0.6}


def test_plan_cli_bad_replicas_is_one_line_exit_2(tiny_model):
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", str(tiny_model), "--gpus",
                        "cpu", "--min-replicas", "3", "--max-replicas", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--min-replicas 3" in r.stderr


# ---- the ScaledObject and the exporter ---------------------------------------------------------


def _plan(tiny_model, **ask):
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import make_plan

    return make_plan(load_model(str(tiny_model)), parse_gpus("cpu"),
                     scaling=ScalingAsk(**ask)).deployment()


def test_emit_writes_the_scaled_object_of_the_plan(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    dep = _plan(tiny_model, users=100)
    paths = emit_plan(dep, tmp_path / "out")
    assert [p.name for p in paths][-1] == "plan.json"
    (so,) = list(yaml.safe_load_all((tmp_path / "out" / "scaledobject.yaml").read_text()))
    a = dep.pool.autoscaling
    assert so == scaled_object(a)
    # capacity's rule at the plan's own knee: ceil(100 x 1.2 / knee), one more if 100% busy
    want = replicas_needed(100, a.basis["knee_concurrency"], 0.2, 0, closed=True)
    assert so["spec"]["maxReplicaCount"] == a.max_replicas == want
    thresholds = [float(t["metadata"]["threshold"]) for t in so["spec"]["triggers"]]
    assert thresholds == [a.target_running_per_replica, a.target_waiting_per_replica,
                          a.kv_usage_threshold]
    with pytest.raises(InputError, match="no `autoscaling`"):
        scaled_object(None)


def _page(running: dict[str, int], waiting: dict[str, int]) -> str:
    lines = ["# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} 0.1' for e in running]
    lines += ["# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {v}'
              for e, v in running.items()]
    lines += ["# TYPE vllm:num_requests_waiting gauge"]
    lines += [f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} {v}'
              for e, v in waiting.items()]
    return "\n".join(lines) + "\n"


def test_desired_replicas_is_ceil_of_live_load_over_the_plans_capacity(tmp_path, monkeypatch,
                                                                      tiny_model):
    import dataclasses

    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path))
    dep = _plan(tiny_model)
    pool = dataclasses.replace(dep.pool, autoscaling=dataclasses.replace(
        dep.pool.autoscaling, target_running_per_replica=34, role="decode"))
    plan = dataclasses.replace(dep, pools=(pool,))
    rng = random.Random(5)
    for _ in range(200):
        engines = [str(i) for i in range(rng.randint(1, 8))]
        running = {e: rng.randint(0, 64) for e in engines}
        waiting = {e: rng.randint(0, 40) for e in engines}
        fams = {f.name: f for f in scaling_families(plan, parse_vllm_metrics(_page(running,
                                                                                   waiting)))}
        (d,) = fams["vlaunch_desired_replicas"].samples
        assert d.labels == {"role": "decode"}
        assert d.value == math.ceil((sum(running.values()) + sum(waiting.values())) / 34)
        (cap,) = fams["vlaunch_replica_capacity_requests"].samples
        assert cap.value == 34
    slo = {s.labels["quantity"]: s.value for s in fams["vlaunch_plan_slo_seconds"].samples}
    assert slo == {"ttft": dep.slo.ttft_ms / 1e3, "tpot": dep.slo.tpot_ms / 1e3}
    # nothing scraped: the count is left out, never frozen; no autoscaling: no families
    (none,) = [f for f in scaling_families(plan, None) if f.name == "vlaunch_desired_replicas"]
    assert none.samples == []
    assert list(scaling_families(None, None)) == []


def test_phase_durations_split_launch_to_ready():
    marks = [("starting", 10.0), ("loading_weights", 12.5), ("profiling", 20.0)]
    assert startup_measured.phase_durations(marks, 31.0, 10.0) == {
        "starting": 2.5, "loading_weights": 7.5, "profiling": 11.0}


def test_a_corrupt_measured_startup_is_reported_and_not_used(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path))
    (tmp_path / "startup.json").write_text('{"k": {"seconds": "fast", "phases": {}}}')
    assert startup_measured.lookup("k", "local") is None
    assert "startup.json" in capsys.readouterr().err


def test_exec_replans_with_the_emitted_bounds_and_weights_path():
    from types import SimpleNamespace as NS

    from launcher.predict.capacity.autoscaling import ask_from_plan

    pool = NS(autoscaling=NS(min_replicas=2, max_replicas=5), startup=NS(load_path="volume"))
    assert ask_from_plan(NS(pool=pool)) == {
        "scaling": ScalingAsk(min_replicas=2, max_replicas=5), "load_path": "volume"}
    assert ask_from_plan(NS(pool=NS(autoscaling=None, startup=None))) == {}
