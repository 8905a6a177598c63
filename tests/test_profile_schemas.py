"""profiles/*.yaml against their JSON Schemas (launcher/schemas/profiles): the shipped files
pass, and a misspelt or mistyped key is refused, at load, in one line."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher import profile_check
from launcher.paths import profiles_dir

REPO = Path(__file__).resolve().parents[1]


def _profiles() -> list[tuple[Path, str]]:
    root = profiles_dir()
    files = [p for p in sorted(root.rglob("*.yaml"))]
    out = [(p, profile_check.schema_for(p.relative_to(root))) for p in files]
    assert all(schema for _, schema in out), "a profile file no schema covers"
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("path,schema", _profiles(), ids=lambda v: getattr(v, "name", v))
def test_every_shipped_profile_meets_its_schema(path: Path, schema: str):
    assert profile_check.problems(yaml.safe_load(path.read_text()), schema) == []


def _misspellings(key: str) -> list[str]:
    """Typos a hand makes: a letter dropped, two swapped, a letter doubled."""
    out = {key[:i] + key[i + 1:] for i in range(len(key))}
    out |= {key[:i] + key[i + 1] + key[i] + key[i + 2:] for i in range(len(key) - 1)}
    out |= {key[:i] + key[i] + key[i:] for i in range(len(key))}
    return sorted(out - {key})


def test_a_misspelt_gpu_key_is_refused():
    """Every key of every GPU row, misspelt any way, is an error, never 'not given'."""
    data = yaml.safe_load((profiles_dir() / "gpus.yaml").read_text())
    for name, row in data["gpus"].items():
        for key in row:
            for typo in _misspellings(key):
                if typo in row:
                    continue
                bad = copy.deepcopy(data)
                bad["gpus"][name][typo] = bad["gpus"][name].pop(key)
                found = profile_check.problems(bad, "gpus")
                assert any(typo in p for p in found), (name, key, typo, found)


def test_a_mistyped_number_is_refused():
    data = yaml.safe_load((profiles_dir() / "gpus.yaml").read_text())
    numbers = ("total_mib", "hbm_gbps", "bf16_tflops", "fp8_tflops", "nvlink_gbps")
    for name, row in data["gpus"].items():
        for key in (k for k in numbers if k in row):
            for wrong in ("fast", -1, 0, None):
                bad = copy.deepcopy(data)
                bad["gpus"][name][key] = wrong
                assert profile_check.problems(bad, "gpus"), (name, key, wrong)


def test_a_model_profile_takes_any_config_key_but_only_its_own_top_keys():
    path = profiles_dir() / "models" / "llama-3.1-8b.yaml"
    data = yaml.safe_load(path.read_text())
    ok = copy.deepcopy(data)
    ok["config"]["some_new_hf_field"] = 1  # config.json grows with transformers
    assert profile_check.problems(ok, "model") == []
    for typo in _misspellings("checkpoint_bytes")[:5]:
        bad = copy.deepcopy(data)
        bad[typo] = 1
        assert profile_check.problems(bad, "model")
    bad = copy.deepcopy(data)
    bad["config"]["num_hidden_layers"] = "32"
    assert profile_check.problems(bad, "model")


def test_a_broken_profile_is_one_line_at_load(tmp_path: Path):
    """`vlaunch plan` with a catalog that says `hbm_gbs`: exit 2, one line naming the key."""
    folder = tmp_path / "profiles"
    shutil.copytree(profiles_dir(), folder)
    env = {"VLAUNCH_PROFILES_DIR": str(folder), "VLAUNCH_CACHE_DIR": str(tmp_path / "cache"),
           "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-m", "launcher.cli", "plan", "llama-3.1-8b", "--gpus", "1xH200"]
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr  # checked, and remembered as checked
    gpus = folder / "gpus.yaml"
    text = gpus.read_text()
    assert "    hbm_gbps: 4800\n" in text
    gpus.write_text(text.replace("    hbm_gbps: 4800\n", "    hbm_gbs: 4800\n", 1))
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr  # the edit is checked again
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hbm_gbs" in lines[0] and "gpus.yaml" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
