"""The typed deployment plan: one codec, `load(dump(d)) == d` over many plans, the generated
schema, bad plan JSON in one line, reasons as data."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from schema_check import schema_errors

from launcher.deployment import plan as P
from launcher.deployment import schema
from launcher.deployment.argv import engine_argv
from launcher.deployment.codec import dump, load
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import list_profiles
from launcher.predict.search.planner import Pins, make_plan

GPUS = ("1xH100", "8xH200", "2x8xH100", "4xA100-80GB", "2xL40S", "8xMI300X", "cpu")
OBJECTIVES = ("balanced", "throughput", "latency")
PINS = (Pins(), Pins(kv_cache_dtype="auto"), Pins(max_model_len=8192), Pins(max_num_seqs=32),
        Pins(enforce_eager=True), Pins(gpu_memory_utilization=0.85), Pins(speculative=False))


def _sweep() -> list[tuple[str, str, int, str]]:
    """Every model profile on every GPU kind, pins and objectives rotated (one plan each)."""
    cases = []
    for i, spec in enumerate(list_profiles()):
        for j, gpus in enumerate(GPUS):
            cases.append((spec.name, gpus, (i + j) % len(PINS), OBJECTIVES[(i * 2 + j) % 3]))
    return cases


CASES = _sweep()
_SPECS = {s.name: s for s in list_profiles()}


def _deployment(name: str, gpus: str, pin: int, objective: str) -> P.Deployment:
    pins = dataclasses.replace(PINS[pin], max_model_len=None) \
        if PINS[pin].max_model_len and _SPECS[name].max_context < 8192 else PINS[pin]
    try:
        return make_plan(_SPECS[name], parse_gpus(gpus), pins, suggest=False,
                         objective=objective).deployment()
    except InputError as e:  # a pin this model refuses is bad input, not a plan
        pytest.skip(str(e))


def test_the_sweep_is_hundreds_of_plans():
    assert len(CASES) >= 100, len(CASES)


@pytest.mark.parametrize("name,gpus,pin,objective", CASES)
def test_load_dump_round_trip(name, gpus, pin, objective):
    d = _deployment(name, gpus, pin, objective)
    j = json.loads(json.dumps(dump(d)))
    assert load(j) == d
    assert schema_errors("plan", j) == []
    assert j["vllm_args"] == (engine_argv(d.engine) if d.fits else [])
    assert j["deployment"] == "aggregated" and [p["role"] for p in j["pools"]] == ["aggregated"]
    pool = j["pools"][0]
    # today's top-level keys are the aggregated pool's, the same numbers
    for key in ("kv_cache", "per_gpu", "env", "vllm_args", "serving"):
        assert pool[key] == j[key], key
    if j["performance"] is not None:  # the deployment's own block adds the per-GPU figure
        top = dict(j["performance"])
        gpus, per_gpu = top.pop("gpus"), top.pop("output_tokens_per_s_per_gpu")
        assert top == pool["performance"]
        assert gpus == d.hardware.count
        assert per_gpu == round(top["at"]["output_tokens_per_s"] / gpus, 2)
    assert pool["gpus_per_replica"] == j["gpus"]["count"] == d.hardware.count
    assert {k: v for k, v in j["parallel"].items() if k != "distributed_executor_backend"} \
        == pool["parallel"]


def _variants(d: P.Deployment, rng: random.Random) -> P.Deployment:
    """`d` with a few fields changed at random: replicas, KV tokens, reasons and their data."""
    pool = d.pool
    kv = dataclasses.replace(pool.kv_cache, tokens=rng.randrange(0, 10**7),
                             layer_kinds={"full": rng.randrange(1, 200)})
    pool = dataclasses.replace(pool, replicas=rng.randrange(1, 64), kv_cache=kv,
                               env={f"V{i}": str(rng.random()) for i in range(rng.randrange(4))})
    reasons = tuple(P.Reason(f"code.{i}", f"text {rng.random()}",
                             {"n": rng.randrange(10**9), "x": rng.random(), "on": bool(i % 2),
                              "list": [1, 2.5, "a"], "none": None})
                    for i in range(rng.randrange(6)))
    return dataclasses.replace(d, pools=(pool,), reasons=reasons,
                               warnings=reasons[::-1], objective=rng.choice(OBJECTIVES))


def test_round_trip_holds_for_hundreds_of_perturbed_plans():
    rng = random.Random(32)
    bases = [_deployment(*CASES[i]) for i in range(0, len(CASES), max(1, len(CASES) // 6))]
    for n in range(300):
        d = _variants(rng.choice(bases), rng)
        assert load(json.loads(json.dumps(dump(d)))) == d, n


def test_the_committed_schema_is_the_generated_one():
    assert schema.PATH.read_text() == schema.text(), \
        "launcher/schemas/plan.json is stale: run python -m launcher.deployment.schema"


@pytest.fixture(scope="module")
def good() -> dict:
    return dump(make_plan(_SPECS["llama-3.1-8b"], parse_gpus("1xH100")).deployment())


@pytest.mark.parametrize("edit,says", [
    (lambda j: j.pop("pools"), "no `pools`"),
    (lambda j: j["pools"][0]["engine"].update(max_model_len="8k"),
     "`pools[0].engine.max_model_len` is '8k'; it must be a whole number"),
    (lambda j: j["pools"][0]["engine"]["parallel"].update(tp=0),
     "`pools[0].engine.parallel.tp` is 0"),
    (lambda j: j["pools"][0]["engine"].pop("kv_cache_dtype"),
     "no `pools[0].engine.kv_cache_dtype`"),
    (lambda j: j["gpus"].update(nodes=None), "`gpus.nodes` is None"),
    (lambda j: j.update(deployment="sharded"), "`deployment` is 'sharded'"),
    (lambda j: j["pools"][0]["vllm_args"].append("--trust-remote-code"),
     "`pools[0].vllm_args` differ from the arguments its `pools[0].engine` gives"),
    (lambda j: j["pools"][0]["engine"].update(gpu_memory_utilization=1.5), "in (0, 1]"),
    (lambda j: j["pools"][0]["engine"].update(kv_cache_memory_bytes=-1),
     "`pools[0].engine.kv_cache_memory_bytes` is -1"),
    (lambda j: j["reasons"].append("a string"), "`reasons[")
])
def test_bad_plan_json_is_one_line(good, edit, says):
    j = json.loads(json.dumps(good))
    edit(j)
    with pytest.raises(InputError) as e:
        load(j)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_not_an_object_is_refused():
    for bad in ([], "plan", None, 3):
        with pytest.raises(InputError, match="JSON object"):
            load(bad)


def test_reasons_are_data_with_stable_codes():
    d = make_plan(_SPECS["llama-3.1-70b"], parse_gpus("2xH100"),
                  Pins(max_model_len=8192, gpu_memory_utilization=0.85)).deployment()
    codes = [r.code for r in d.reasons]
    assert "max_model_len.pinned" in codes and "gpu_memory_utilization.pinned" in codes
    pinned = {r.code for r in d.reasons if r.data.get("pinned")}
    assert pinned == {"max_model_len.pinned", "gpu_memory_utilization.pinned"}
    r = next(r for r in d.reasons if r.code == "max_model_len.pinned")
    assert r.data["value"] == d.engine.max_model_len == 8192  # the number, not only its text
    for r in dump(d)["reasons"]:
        assert set(r) == {"code", "text", "data"} and r["code"] and r["text"]


def _emitted(tmp_path) -> str:
    from click.testing import CliRunner

    from launcher.cli import cli

    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "--emit",
                                 str(tmp_path), "--vllm-version", "0.32.0"])
    assert r.exit_code == 0, r.output
    return str(tmp_path)


def test_exec_runs_the_plan_and_never_plans_again(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from launcher.cli import cli
    from launcher.predict.search import planner
    from launcher.run import serve

    folder = _emitted(tmp_path)
    args = json.loads((tmp_path / "plan.json").read_text())["vllm_args"]

    def no_planning(*a, **k):
        raise AssertionError("exec planned again")

    for module in (planner, serve):  # serve binds make_plan at import
        monkeypatch.setattr(module, "make_plan", no_planning)
    r = CliRunner().invoke(cli, ["exec", "--plan", folder, "--dry-run", "--no-metrics",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    command = json.loads(r.stdout)["command"]
    assert all(a in command for a in args)  # the plan's own arguments, not a new plan's


def test_exec_exits_3_when_the_free_memory_no_longer_holds_the_plan(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from launcher.cli import cli
    from launcher.inputs import inventory

    folder = _emitted(tmp_path)
    need = json.loads((tmp_path / "plan.json").read_text())["per_gpu"]["requested_bytes"]
    busy = dataclasses.replace(parse_gpus("1xH100"), free_bytes=need - 1, source="nvml")
    monkeypatch.setattr(inventory, "detect_hardware", lambda *a, **k: busy)
    r = CliRunner().invoke(cli, ["exec", "--plan", folder, "--dry-run", "--no-metrics"])
    assert r.exit_code == 3, r.output
    line = r.output.strip()
    assert "\n" not in line and "--replan" in line and "free now" in line
    roomy = dataclasses.replace(busy, free_bytes=need)
    monkeypatch.setattr(inventory, "detect_hardware", lambda *a, **k: roomy)
    r = CliRunner().invoke(cli, ["exec", "--plan", folder, "--dry-run", "--no-metrics"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("command", [
    ["exec", "--plan", "{plan}", "--dry-run", "--no-metrics"],
    ["exec", "--plan", "{plan}", "--replan", "--dry-run", "--no-metrics"],
    ["exporter", "--vllm-url", "http://127.0.0.1:1", "--plan", "{plan}"],
    ["doctor", "{log}", "--plan", "{plan}"],
])
def test_bad_plan_json_is_one_line_and_exit_2_for_every_command(tmp_path, command):
    from click.testing import CliRunner

    from launcher.cli import cli

    folder = _emitted(tmp_path / "good")
    j = json.loads((tmp_path / "good" / "plan.json").read_text())
    j["pools"][0]["engine"]["parallel"]["tp"] = "2"
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(j))
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n")
    args = [a.format(plan=bad, log=log) for a in command]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, (folder, r.output)
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "`pools[0].engine.parallel.tp` is '2'" in lines[0], r.output
    assert "Traceback" not in r.output


def test_replan_plans_for_the_memory_free_now(tmp_path, monkeypatch):
    from launcher.inputs import inventory
    from launcher.predict.search.plan_inputs import inputs_from_plan
    from launcher.run.emit import load_plan
    from launcher.run.exec_plan import live_hardware

    dep = load_plan(_emitted(tmp_path))
    _, planned, _ = inputs_from_plan(dep)
    busy = dataclasses.replace(planned, free_bytes=planned.free_bytes // 2, source="nvml")
    monkeypatch.setattr(inventory, "detect_hardware", lambda *a, **k: busy)
    assert live_hardware(dep, planned) == busy  # the same GPUs, as they are now
    other = dataclasses.replace(parse_gpus("1xA100-80GB"), source="nvml")
    monkeypatch.setattr(inventory, "detect_hardware", lambda *a, **k: other)
    assert live_hardware(dep, planned) == planned  # other GPUs: the plan's own figures

    def no_gpu(*a, **k):
        raise InputError("no GPU")

    monkeypatch.setattr(inventory, "detect_hardware", no_gpu)
    assert live_hardware(dep, planned) == planned


@pytest.mark.parametrize("name,gpus,pin,objective", CASES[::3])
def test_a_reasons_numbers_are_the_plans(name, gpus, pin, objective):
    """`data` carries the figures the text shows, and they are the engine's own values."""
    d = _deployment(name, gpus, pin, objective)
    e = d.engine
    engine_value = {"max_model_len": e.max_model_len, "max_num_seqs": e.max_num_seqs,
                    "max_num_batched_tokens": e.max_num_batched_tokens,
                    "gpu_memory_utilization": e.gpu_memory_utilization,
                    "kv_cache_dtype": e.kv_cache_dtype}
    codes = [r.code for r in d.reasons]
    assert codes.count("layout") <= 1 and "search.counts" in codes
    for r in (*d.reasons, *d.warnings, *d.suggestions):
        assert r.code and r.text.strip(), r
        json.dumps(r.data)  # JSON values only
        flag = r.code.split(".")[0]
        value = r.data.get("value")
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            assert f"{value:,}" in r.text, r
        elif isinstance(value, float):
            assert f"{value:.2f}" in r.text, r
        if flag in engine_value and d.fits and r.code.endswith(("pinned", "default", "full",
                                                                "largest", "lowered")):
            assert value == pytest.approx(engine_value[flag], abs=5e-5), r
    search = next(r for r in d.reasons if r.code == "search.counts")
    assert search.data == {"judged": d.candidates.judged, "timed": d.candidates.timed}


@pytest.mark.parametrize("env", [{"LD_PRELOAD": "/tmp/x.so"}, {"VLLM_PLUGINS": "evil"},
                                 {"PATH": "/tmp"}])
def test_exec_refuses_an_environment_vlaunch_plan_never_writes(tmp_path, env):
    from click.testing import CliRunner

    from launcher.cli import cli

    _emitted(tmp_path / "good")
    j = json.loads((tmp_path / "good" / "plan.json").read_text())
    j["pools"][0]["env"].update(env)
    j["env"].update(env)  # the summary key says the same (else the codec refuses the edit)
    (tmp_path / "plan.json").write_text(json.dumps(j))
    r = CliRunner().invoke(cli, ["exec", "--plan", str(tmp_path / "plan.json"), "--dry-run",
                                 "--no-metrics"])
    assert r.exit_code == 2, r.output
    assert "never writes" in r.output and len(r.output.strip().splitlines()) == 1
