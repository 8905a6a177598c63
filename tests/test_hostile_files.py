"""Hostile files (issue 31, M2 and Low): a FIFO, a link to /dev/zero or a folder where vlaunch
expects a small JSON file, a config.json nested 100,000 deep, negative shapes and counts, and
plans or folders that other users can write.

Anything that could hang is run in a child process with a timeout, so a regression fails the
test instead of holding CI.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import InputError
from launcher.paths import NotSmallFile, read_json_object, read_small, warn_if_foreign

ROOT = Path(__file__).resolve().parent.parent
CONFIG = dict(model_type="llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, intermediate_size=512, vocab_size=1000, num_hidden_layers=2,
              max_position_embeddings=2048, torch_dtype="bfloat16")


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache"


def _vlaunch(args: list[str], tmp_path: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLAUNCH_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", *args],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _one_line(out: subprocess.CompletedProcess | object, needle: str = "") -> str:
    code = getattr(out, "returncode", getattr(out, "exit_code", None))
    err = getattr(out, "stderr", "")
    assert code == 2, (code, getattr(out, "stdout", ""), err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("vlaunch: error:"), err
    assert "Traceback" not in err and needle in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- the reader


def test_the_bounded_reader_refuses_every_non_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_bytes(b"x" * 2049)
    (tmp_path / "ok").write_bytes(b"x" * 2048)
    for name in ("fifo", "zero", "dir", "big"):
        with pytest.raises(NotSmallFile):
            read_small(tmp_path / name, 2048)
    assert read_small(tmp_path / "ok", 2048) == b"x" * 2048


@pytest.mark.parametrize("plant", ["fifo", "zero", "dir", "nested"])
def test_a_planted_cache_entry_is_ignored_not_waited_on(tmp_path: Path, plant: str) -> None:
    """A FIFO, /dev/zero or a folder at every cache file a plan reads: the plan still answers
    (each is reported once and ignored), in a child bounded by a timeout."""
    cache = tmp_path / "cache"
    cache.mkdir()
    names = ["profiles-checked.json", "capabilities.json", "measured.json", "calibration.json",
             "mtp_acceptance.json", "hub/acme--x/refs.json", f"hub/acme--x/{'a' * 40}.json"]
    (cache / "hub" / "acme--x").mkdir(parents=True)
    for name in names:
        p = cache / name
        if plant == "fifo":
            os.mkfifo(p)
        elif plant == "zero":
            p.symlink_to("/dev/zero")
        elif plant == "dir":
            p.mkdir()
        else:
            p.write_text("[" * 200_000)
    out = _vlaunch(["plan", "llama-3.1-8b", "--gpus", "1xH100", "--format", "json"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]
    assert "Traceback" not in out.stderr
    for args in (["acme/x"], ["acme/x", "--revision", "a" * 40]):  # offline: cache only
        out = _vlaunch(["plan", *args, "--gpus", "1xH100"], tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "HF_HUB_OFFLINE" in out.stderr.splitlines()[-1]


def test_a_cache_file_nested_too_deep_is_corrupt_not_a_traceback(tmp_path: Path) -> None:
    p = tmp_path / "deep.json"
    p.write_text("{\"a\":" * 100_000 + "1" + "}" * 100_000)
    assert read_json_object(p) == {}


@pytest.mark.parametrize("command", [
    ["exec", "--plan", "{plan}", "--dry-run"],
    ["exporter", "--vllm-url", "http://127.0.0.1:9", "--plan", "{plan}", "--port", "0"],
    ["doctor", "{log}", "--plan", "{plan}"],
])
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_plan_at_a_fifo_or_dev_zero_is_one_line(tmp_path: Path, command: list[str],
                                                kind: str) -> None:
    plan = tmp_path / "plan.json"
    if kind == "fifo":
        os.mkfifo(plan)
    else:
        plan.symlink_to("/dev/zero")
    log = tmp_path / "vllm.log"
    log.write_text("INFO nothing happened\n")
    args = [a.format(plan=plan, log=log) for a in command]
    _one_line(_vlaunch(args, tmp_path), "not a regular file")


def test_a_config_nested_100000_deep_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "m"), "--gpus", "1xH100"])
    _one_line(r, "nested too deeply")


def test_a_config_json_that_is_a_fifo_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    os.mkfifo(tmp_path / "m" / "config.json")
    _one_line(_vlaunch(["plan", str(tmp_path / "m"), "--gpus", "1xH100"], tmp_path),
              "not a regular file")


# ----------------------------------------------------------------------------- M2


def _safetensors(shapes: dict[str, list[int]]) -> bytes:
    header = {k: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for k, s in shapes.items()}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("shape", [[-1000000, 1000000], [4096, -4096], [2, 1.5], [True, 4],
                                   ["8", 8], [1 << 60, 1 << 60]])
def test_a_negative_or_nonsense_tensor_shape_is_refused(tmp_path: Path, shape: list) -> None:
    """The attack: a header whose shapes are negative made −2 TB of weights, so any model
    "fit" one H100. Every such header is one line, exit 2."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "m" / "model.safetensors").write_bytes(
        _safetensors({"a": [256, 256], "b": shape}))
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "m"), "--gpus", "1xH100"])
    assert r.exit_code == 2, r.output
    assert "safetensors header" in r.stderr or "parameters" in r.stderr, r.stderr


def test_a_negative_count_from_any_source_fails_the_gate() -> None:
    """spec_from_config is the gate every source passes: a negative parameter count or
    checkpoint size is refused whichever path (Hub, cache, headers) supplied it."""
    from launcher.inputs.model import spec_from_config

    for meta in ({"params_by_dtype": (("BF16", -2 * 10**12),)},
                 {"params_by_dtype": (("BF16", 10**20),)},
                 {"checkpoint_bytes": -2 * 10**12}, {"checkpoint_bytes": 1.5}):
        with pytest.raises(InputError):
            spec_from_config(dict(CONFIG), "hostile", **meta)
    assert spec_from_config(dict(CONFIG), "sound", params_by_dtype=(("BF16", 10**9),))


def test_a_model_too_big_for_the_gpus_still_does_not_fit(tmp_path: Path) -> None:
    """The init container's gate: a 70B-shaped config with a header claiming negative weights
    is refused (exit 2), never planned as fitting (exit 0)."""
    big = dict(CONFIG, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
               head_dim=128, intermediate_size=28672, num_hidden_layers=80, vocab_size=128256)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(big))
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "m"), "--gpus", "1xL4"])
    assert r.exit_code == 3, r.output  # without a header: does not fit
    (tmp_path / "m" / "model.safetensors").write_bytes(
        _safetensors({"w": [-(10**6), 10**6]}))
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "m"), "--gpus", "1xL4"])
    assert r.exit_code == 2, r.output


# ----------------------------------------------------------------------------- ownership


def test_a_plan_someone_else_can_write_is_warned_about(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "plan.json"
    p.write_text("{}")
    os.chmod(p, 0o644)
    assert not warn_if_foreign(p)
    os.chmod(p, 0o666)
    assert warn_if_foreign(p)
    assert "writable by every user" in capsys.readouterr().err
    os.chmod(p, 0o644)
    if os.geteuid() == 0:
        os.chown(p, 4242, -1)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    assert warn_if_foreign(p)
    assert "owned by user" in capsys.readouterr().err


def test_emitting_into_a_world_writable_folder_is_warned_about(tmp_path: Path) -> None:
    out = tmp_path / "open"
    out.mkdir()
    os.chmod(out, 0o777)
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "--emit", str(out)])
    assert r.exit_code == 0, r.output
    assert "writable by every user" in r.stderr
    os.chmod(out, stat.S_IRWXU)
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "--emit", str(out)])
    assert "writable by every user" not in r.stderr
    # the plan it wrote, read back by exec, warns when it becomes world-writable
    os.chmod(out / "plan.json", 0o666)
    r = CliRunner().invoke(cli, ["exec", "--plan", str(out), "--dry-run"])
    assert "writable by every user" in r.stderr


@pytest.mark.parametrize("command", [["exec", "--plan", "{plan}", "--dry-run"],
                                     ["doctor", "{log}", "--plan", "{plan}"]])
def test_a_plan_nested_100000_deep_is_one_line(tmp_path: Path, command: list[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("[" * 100_000 + "]" * 100_000)
    log = tmp_path / "vllm.log"
    log.write_text("INFO nothing happened\n")
    r = CliRunner().invoke(cli, [a.format(plan=plan, log=log) for a in command])
    _one_line(r, "not valid JSON")
