"""The JSON contracts: real `plan` and `capacity` outputs validate against launcher/schemas."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from schema_check import schema_errors as _errors

from launcher.cli import cli


@pytest.mark.parametrize("args", [
    ["deepseek-r1", "--gpus", "8xH200"],
    ["deepseek-r1", "--gpus", "2x8xH100", "--no-mtp", "--objective", "throughput"],
    ["llama-3.1-70b", "--gpus", "2xH100", "--workload", "rag", "--concurrency", "8"],
    ["llama-3.1-70b", "--gpus", "1xH100"],  # does not fit (exit 3), still a plan
    ["llama-3.1-8b", "--gpus", "4x24GiB"],  # no speed facts: performance null
])
def test_plan_outputs_validate(args):
    r = CliRunner().invoke(cli, ["plan", *args, "--format", "json"])
    assert r.exit_code in (0, 3), r.output
    d = json.loads(r.output)
    assert _errors("plan", d) == []


def test_a_renamed_field_breaks_the_plan_schema():
    r = CliRunner().invoke(cli, ["plan", "deepseek-r1", "--gpus", "8xH200", "--format", "json"])
    d = json.loads(r.output)
    d["model"]["params_b"] = d["model"].pop("params") / 1e9
    assert _errors("plan", d)


@pytest.mark.parametrize("args,code", [
    (["llama-3.1-70b", "--users", "300", "--gpus", "8xH100,8xH200", "--max-model-len", "8192"],
     0),
    (["deepseek-r1", "--rps", "2", "--gpus", "8xH200", "--no-mtp"], 0),
    (["llama-3.1-70b", "--users", "10", "--gpus", "8xH100", "--slo", "tpot=5ms"], 3),
])
def test_capacity_outputs_validate(args, code):
    r = CliRunner().invoke(cli, ["capacity", *args, "--format", "json"])
    assert r.exit_code == code, r.output
    d = json.loads(r.output[:r.output.rindex("}") + 1])
    assert _errors("capacity", d) == []
    assert (d["recommended"] is None) == (code == 3)
    if code == 3:
        assert d["closest_miss"] is not None
