"""Nonsense numbers (issue 31, Low): a vLLM log whose figures no engine prints makes the doctor
suggest nothing out of range (never --gpu-memory-utilization 1.02 or --max-model-len 1e26),
and `capacity` never writes Infinity or NaN into its JSON.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import InputError
from launcher.observe.fix_ranges import RANGES, out_of_range
from launcher.predict.capacity import capacity

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "tests" / "fixtures" / "doctor"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _strict_json(text: str) -> object:
    def refuse(name: str) -> float:
        raise AssertionError(f"{name} in JSON output")
    return json.loads(text, parse_constant=refuse)


def _doctor(tmp_path: Path, log: str, old: str, new: str) -> dict:
    text = (LOGS / log).read_text()
    hostile = text.replace(old, new)
    assert (hostile != text) == (old != new)
    # a model no profile names: the fix is the log's own, not the planner's
    hostile = hostile.replace("'deepseek-ai/DeepSeek-V3'", "'/models/unknown'")
    (tmp_path / "vllm.log").write_text(hostile)
    r = CliRunner().invoke(cli, ["doctor", str(tmp_path / "vllm.log"), "--format", "json"])
    assert r.exit_code == 1, r.output
    return _strict_json(r.stdout)  # type: ignore[return-value]


def _suggested(d: dict) -> list[list[str]]:
    out = []
    for diag in d["diagnoses"]:
        out.append(diag["fix_args"])
        cmd = diag.get("serve_command") or []
        out.append(cmd.split() if isinstance(cmd, str) else list(cmd))
    return out


@pytest.mark.parametrize("log,old,new,flag", [
    # free memory above the total: free/total - 1% would be utilization 1.18
    ("free_mem_v032.log", "(30.12/79.19 GiB)", "(95.00/79.19 GiB)", "--gpu-memory-utilization"),
    # vLLM's "estimated maximum model length" of 1e26 tokens
    ("kv_short_v032_cpu.log", "model length is 2864", "model length is " + "1" + "0" * 26,
     "--max-model-len"),
])
def test_the_doctor_suggests_nothing_out_of_range_from_nonsense(tmp_path: Path, log: str,
                                                                old: str, new: str,
                                                                flag: str) -> None:
    d = _doctor(tmp_path, log, old, new)
    for args in _suggested(d):
        assert out_of_range(args) is None, args
    explain = " ".join(" ".join(x["explain"]) for x in d["diagnoses"])
    assert "outside what vLLM accepts" in explain and flag in explain


def test_sound_logs_still_get_their_fix(tmp_path: Path) -> None:
    d = _doctor(tmp_path, "free_mem_v032.log", "(30.12/79.19 GiB)", "(30.12/79.19 GiB)")
    assert d["diagnoses"][0]["fix_args"] == ["--gpu-memory-utilization", "0.37"]


def test_the_range_check_over_hundreds_of_values() -> None:
    """Property: a value is accepted exactly when it is a finite number inside the flag's
    range (and whole where the flag takes a count)."""
    rng = random.Random(31)
    from launcher.inputs.vllm_flags import flag as flag_of

    for dest, (low, high, whole) in RANGES.items():
        flag = flag_of(dest)
        for _ in range(100):
            x = rng.choice([rng.uniform(-2, 2) * high, rng.uniform(low, high), low, high,
                            float("inf"), float("nan"), 10.0 ** rng.randint(-30, 30)])
            text = str(int(x)) if whole and math.isfinite(x) and rng.random() < 0.7 else repr(x)
            value = float(text)
            ok = math.isfinite(value) and low <= value <= high and \
                (not whole or value.is_integer())
            assert (out_of_range([flag, text]) is None) == ok, (flag, text)
    assert out_of_range(["--gpu-memory-utilization", "1.02"]) is not None
    assert out_of_range(["--max-model-len", "1" + "0" * 26]) is not None
    assert out_of_range(["--enforce-eager"]) is None


@pytest.mark.parametrize("rps", [1e308, float("inf"), float("nan"), -1.0, 0.0, 1e7 * 1.0001])
def test_capacity_refuses_a_load_it_cannot_count(rps: float) -> None:
    with pytest.raises(InputError, match="--rps"):
        capacity.Load(rps=rps).validate()


def test_capacity_json_is_finite_at_the_largest_load_it_takes() -> None:
    for args in (["--rps", "1e308"], ["--users", str(10**17)]):
        r = CliRunner().invoke(cli, ["capacity", "llama-3.1-8b", *args, "--gpus", "1xH100",
                                     "--format", "json"])
        assert r.exit_code == 2 and "Infinity" not in r.output, r.output
        assert r.stderr.startswith("vlaunch: error: ") and r.stderr.count("\n") == 1
    r = CliRunner().invoke(cli, ["capacity", "llama-3.1-8b", "--rps", str(capacity.MAX_RPS),
                                 "--gpus", "1xH100", "--format", "json"])
    assert r.exit_code in (0, 3), r.output
    d = _strict_json(r.stdout)
    assert d["load"]["rps"] == capacity.MAX_RPS  # type: ignore[index]
