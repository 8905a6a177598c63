"""Real `--format json` outputs of doctor, gpus and tune validated against the JSON Schema files
in launcher/schemas, and the one vocabulary they share with the plan: the same names for the
same things (model.params, model.weights_bytes, model.max_context, kv_cache.dtype, gpus.*).
Also: every command has --format json, and text output fits the terminal's width."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pynvml
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nvml_script as ns  # noqa: E402
from schema_check import SCHEMAS, schema_errors  # noqa: E402

from launcher.cli import cli  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"


def _errors(name: str, doc) -> list[str]:
    return schema_errors(name, doc)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    yield from ns.clean_inventory(monkeypatch)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.log")))
def test_doctor_json_of_every_fixture_matches_its_schema(name):
    r = CliRunner().invoke(cli, ["doctor", str(FIXTURES / name), "--format", "json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    assert _errors("doctor", doc) == []
    for d in doc["diagnoses"]:  # numbers are numbers wherever the message printed one
        for key, value in d["numbers"].items():
            if key.endswith(("_gib", "_len", "_bytes", "_s")) or key in ("tp", "head_dim"):
                assert isinstance(value, (int, float)), (key, value)


def test_doctor_json_with_a_planner_context_matches_its_schema():
    log = FIXTURES / "ranks8_kv_short_dp8.log"
    r = CliRunner().invoke(cli, ["doctor", str(log), "deepseek-v3", "--gpus", "8xH200",
                                 "--format", "json"])
    doc = json.loads(r.output)
    assert _errors("doctor", doc) == [] and doc["model"] == {"name": "deepseek-ai/DeepSeek-V3"}


def test_doctor_schema_rejects_what_the_old_output_did():
    """Strings for numbers and a bare model string no longer pass."""
    r = CliRunner().invoke(cli, ["doctor", str(FIXTURES / "kv_short_models_estimate.log"),
                                 "--format", "json"])
    doc = json.loads(r.output)
    old = json.loads(json.dumps(doc))
    old["diagnoses"][0]["numbers"]["max_model_len"] = "163840"
    assert _errors("doctor", old)
    old = json.loads(json.dumps(doc))
    old["model"] = "deepseek-ai/DeepSeek-V3"
    assert _errors("doctor", old)


@pytest.mark.parametrize("script", ["hgx_h200", "a100_mig", "mixed_h100_a100"])
def test_gpus_json_matches_its_schema_and_the_plans_names(monkeypatch, script):
    getattr(ns, script)().install(monkeypatch.setattr)
    r = CliRunner().invoke(cli, ["gpus", "--format", "json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert _errors("gpus", doc) == []
    plan = json.loads(CliRunner().invoke(cli, ["plan", "qwen3-8b", "--gpus", "1xH200",
                                               "--format", "json"]).output)
    shared = {"name", "total_bytes", "free_bytes", "compute_capability"}
    assert shared <= set(plan["gpus"]) and all(shared <= set(d) for d in doc["devices"])


def test_gpus_without_a_gpu_never_suggests_a_flag_gpus_rejects(monkeypatch):
    ns.NVMLScript([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch.setattr)
    r = CliRunner().invoke(cli, ["gpus"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    suggested = r.output.split(";", 1)[1]
    assert "vlaunch plan MODEL --gpus" in suggested
    assert CliRunner().invoke(cli, ["gpus", "--gpus", "8xH200"]).exit_code == 2  # still rejected


def test_gpus_table_fits_the_terminal(monkeypatch):
    s = ns.hgx_h200()
    s.gpus[2].processes = [ns.ScriptProcess(pid=1000 + i, name=f"worker-{i}", used_mib=1024)
                           for i in range(6)]  # a long PROCESSES cell
    s.install(monkeypatch.setattr)
    for cols in (80, 100, 140):
        monkeypatch.setenv("COLUMNS", str(cols))
        out = CliRunner().invoke(cli, ["gpus"]).output
        lines = out.splitlines()
        rows = [x for x in lines if x[:1].isdigit()]
        assert len(rows) == 8
        # columns stay aligned: each row's memory cell starts under the header's
        at = lines[1].index("GiB used/free/total")
        assert all(x[at:].split()[0].count("/") == 2 and x[at - 2:at] == "  " for x in rows)
        assert all(len(x) <= cols for x in lines), cols


def test_profiles_json_uses_the_plans_names():
    doc = json.loads(CliRunner().invoke(cli, ["profiles", "--format", "json"]).output)
    plan = json.loads(CliRunner().invoke(cli, ["plan", "qwen3-8b", "--gpus", "1xH200",
                                               "--format", "json"]).output)
    row = next(r for r in doc if r["name"] == "qwen3-8b")
    for key in ("params", "weights_bytes", "max_context"):
        assert row[key] == plan["model"][key], key
    assert not {"params_b", "weights_gib", "context"} & set(row)


def test_every_command_has_format_json():
    for name, command in cli.commands.items():
        fmt = next((p for p in command.params if p.name == "fmt"), None)
        assert fmt is not None and "json" in fmt.type.choices, name


def test_tune_schema_matches_the_tune_json_names():
    """The schema's statuses are tune's, and its model/gpus are the plan's own objects."""
    from launcher.run import tune

    schema = json.loads((SCHEMAS / "tune.json").read_text())
    assert schema["$defs"]["trial"]["properties"]["status"]["enum"] == list(tune.STATUSES)
    assert "gpus" in schema["required"] and "hardware" not in schema["properties"]


def test_serve_dry_run_prints_one_labelled_command_on_a_fixed_port(monkeypatch):
    """Two dry runs print the same thing: the plan (without its own command section), then one
    labelled command on vLLM's default port, every line within the width; --format json gives
    the same command and environment as data."""
    monkeypatch.setenv("COLUMNS", "90")
    args = ["serve", "qwen3-8b", "--gpus", "1xH200", "--dry-run", "--no-metrics"]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    assert first.output == CliRunner().invoke(cli, args).output
    lines = first.output.splitlines()
    labels = [x for x in lines if "would run" in x]
    assert len(labels) == 1 and "port 8000" in labels[0]
    assert not any(x.strip() == "command:" for x in lines)
    after = lines[lines.index(labels[0]) + 1:]
    cmd = after[:next(i for i, x in enumerate(after) if not x.endswith(" \\")) + 1]
    assert all(x.endswith(" \\") for x in cmd[:-1]) and "--port 8000" in " ".join(cmd)
    assert all(len(x) <= 90 for x in lines)
    # what will run comes before the figures and the reasons
    assert lines.index(labels[0]) < next(i for i, x in enumerate(lines) if x.startswith("  model:"))
    r = CliRunner().invoke(cli, [*args, "--format", "json"])
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 0 and doc["command"][-4:-2] == ["--port", "8000"] or \
        "--port" in doc["command"]
    assert doc["env"] and doc["plan"]["model"]["name"] == "qwen3-8b"


def test_text_output_fits_the_terminal_for_doctor(monkeypatch):
    for cols in (60, 80, 120):
        monkeypatch.setenv("COLUMNS", str(cols))
        for name in ("nccl_shm_container.log", "ranks8_oom_tp8.log", "unknown_no_space.log"):
            out = CliRunner().invoke(cli, ["doctor", str(FIXTURES / name)]).output
            too_long = [x for x in out.splitlines() if len(x) > cols]
            assert not too_long, (cols, name, too_long)


@pytest.mark.parametrize("cols", [90, 100, 140])
def test_tune_table_keeps_its_numbers_aligned_within_the_width(monkeypatch, cols):
    import random
    from types import SimpleNamespace

    from launcher.run import tune

    rng = random.Random(cols)
    trials = []
    for i in range(9):
        ok = i % 3 != 1
        knee = {"concurrency": rng.randint(1, 400), "output_tokens_per_s": rng.random() * 9e3,
                "ttft_p50_ms": rng.random() * 3e3, "ttft_p99_ms": rng.random() * 9e3,
                "tpot_p50_ms": rng.random() * 90, "tpot_p99_ms": rng.random() * 200,
                "goodput_rps": rng.random() * 40} if ok else None
        trials.append({"rung": i // 3, "status": "ok" if ok else "infeasible",
                       "name": " ".join(["--max-num-seqs", str(i), "--kv-cache-dtype", "fp8"]
                                        * rng.randint(1, 4)),
                       "cause": None if ok else "KV_SHORTAGE: " + "x " * rng.randint(5, 60),
                       "knee": knee})
    monkeypatch.setenv("COLUMNS", str(cols))
    lines = tune.Tuner.table(SimpleNamespace(doc={"trials": trials}))
    assert all(len(x) <= cols for x in lines)
    at = lines[0].index("goodput") + len("goodput")
    starts = [x for x in lines if x[:2].strip()]  # a trial's first line (or the header)
    assert len(starts) == len(trials) + 1
    assert all(x[at] == " " and x[at - 1] != " " for x in starts[1:])  # right-aligned column


def test_doctor_json_of_a_folder_holds_every_log_newest_first(tmp_path):
    """A folder of logs: the newest at the top level, every other log in `older`, newest
    first, each its own report; the whole document within the schema."""
    import os

    names = ["kv_short_v032_cpu.log", "nccl_shm_container.log", "oom_loading_weights.log"]
    for i, name in enumerate(names):
        p = tmp_path / f"vllm-attempt{i}.log"
        p.write_text((FIXTURES / name).read_text())
        os.utime(p, (1_000 + i, 1_000 + i))
    r = CliRunner().invoke(cli, ["doctor", str(tmp_path), "--format", "json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    assert _errors("doctor", doc) == []
    assert doc["sources"] == [str(tmp_path / f"vllm-attempt{i}.log") for i in (2, 1, 0)]
    assert doc["diagnoses"][0]["cause"] == "cuda_oom"
    assert [o["diagnoses"][0]["cause"] for o in doc["older"]] == ["nccl_shared_memory",
                                                                 "kv_cache_too_small"]
