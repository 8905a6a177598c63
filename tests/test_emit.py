"""emit_plan / load_plan / write_termination_message: the init container's hand-off files."""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.deployment import plan as P
from launcher.deployment.argv import engine_argv
from launcher.errors import InputError
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.search.planner import Pins, make_plan
from launcher.run import emit
from launcher.run.emit import emit_plan, load_plan, write_termination_message

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _base() -> P.Deployment:
    return make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100"),
                     Pins(vllm_version="0.32.0")).deployment()


def _plan(served: str = 'it\'s a "model"', env: dict | None = None,
          **engine: object) -> P.Deployment:
    """A real plan with a served name and an environment that need quoting."""
    d = _base()
    pool = dataclasses.replace(
        d.pool, engine=dataclasses.replace(d.engine, served_model_name=served, **engine),
        env=env if env is not None else {"VLLM_USE_V1": "1", "WEIRD": "a b;$(rm -rf /)'\"",
                                         "EMPTY": ""})
    return dataclasses.replace(d, pools=(pool,))


def _args(d: P.Deployment) -> list[str]:
    return engine_argv(d.engine)


def test_emit_writes_its_files_that_round_trip(tmp_path):
    paths = emit_plan(_plan(), tmp_path / "plan")
    # the ScaledObject because the plan has autoscaling (a knee); plan.json last
    assert _plan().pool.autoscaling is not None
    assert [p.name for p in paths] == ["vllm-args", "vllm.env", "scaledobject.yaml", "plan.json"]
    assert load_plan(tmp_path / "plan") == _plan()
    assert load_plan(tmp_path / "plan" / "plan.json") == _plan()
    args = (tmp_path / "plan" / "vllm-args").read_text().splitlines()
    assert args == _args(_plan()) and 'it\'s a "model"' in args
    # Nothing but those files: the temp files were renamed, not left behind.
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == sorted(p.name for p in paths)


def test_env_file_is_shell_safe(tmp_path):
    """A shell that sources vllm.env gets back exactly the plan's values, nothing executed."""
    emit_plan(_plan(), tmp_path)
    script = f"set -a; . {shlex.quote(str(tmp_path / 'vllm.env'))}; env -0"
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, check=True, env={"PATH": os.defpath}
    ).stdout.decode()
    seen = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    for key, value in _plan().pool.env.items():
        assert seen[key] == value


@pytest.mark.parametrize(
    "bad",
    [
        {"served": "a\nb"},
        {"served": "a\rb"},
        {"env": {"BAD-NAME": "1"}},
        {"env": {"A=1": "x"}},
    ],
)
def test_unexpressible_plan_is_an_input_error_and_writes_nothing(tmp_path, bad):
    with pytest.raises(InputError):
        emit_plan(_plan(**bad), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_emit_into_a_file_path_is_an_input_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="not a folder"):
        emit_plan(_plan(), tmp_path / "f")


def test_failed_write_keeps_old_file_and_cleans_temp(tmp_path, monkeypatch):
    emit_plan(_plan(), tmp_path)
    before = (tmp_path / "plan.json").read_text()

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(emit.os, "fsync", boom)
    with pytest.raises(OSError):
        emit_plan(_plan(max_model_len=4096), tmp_path)
    assert (tmp_path / "plan.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_crash_mid_write_leaves_previous_plan_readable(tmp_path):
    """A process killed between writing and renaming (no cleanup runs) must not damage plan.json."""
    emit_plan(_plan(), tmp_path)
    child = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from launcher.run import emit
        real_write = emit.os.fdopen
        class Half:
            def __init__(self, f): self.f = f
            def __enter__(self): return self
            def __exit__(self, *a): return False
            def write(self, text):
                self.f.write(text[: len(text) // 2]); self.f.flush()
                os._exit(9)  # the kernel's SIGKILL, as far as this file is concerned
        emit.os.fdopen = lambda fd, *a, **k: Half(real_write(fd, *a, **k))
        import dataclasses
        from launcher.inputs.hardware import parse_gpus
        from launcher.inputs.model import load_model
        from launcher.predict.search.planner import Pins, make_plan
        plan = make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100"),
                         Pins(vllm_version="0.32.0")).deployment()
        pool = dataclasses.replace(plan.pool, env={{"BIG": "x" * 100000}})
        emit.emit_plan(dataclasses.replace(plan, pools=(pool,)), {str(tmp_path)!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()
    # The half-written temp file is there (nobody cleaned up), and the real files are intact.
    leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers and leftovers[0].stat().st_size > 0
    assert load_plan(tmp_path) == _plan()
    assert (tmp_path / "vllm-args").read_text().splitlines() == _args(_plan())


@pytest.mark.parametrize(
    "content, match",
    [(None, "no plan at"), ("{not json", "not valid JSON"), ('{"fits": true}', "no `pools`"),
     ("[1]", "JSON object")],
)
def test_load_plan_errors(tmp_path, content, match):
    if content is not None:
        (tmp_path / "plan.json").write_text(content)
    with pytest.raises(InputError, match=match):
        load_plan(tmp_path)


def test_emitted_files_are_world_readable(tmp_path):
    """The vLLM container may run as another user than the planner; mkstemp makes 0600."""
    for p in emit_plan(_plan(), tmp_path):
        assert p.stat().st_mode & 0o444 == 0o444


def test_termination_message_written_only_where_kubelet_made_the_file(tmp_path):
    log = tmp_path / "termination-log"
    assert write_termination_message("does not fit", log) is False
    assert not log.exists()
    log.touch()
    assert write_termination_message("does not fit: needs 700 GiB, has 640 GiB", log) is True
    assert log.read_text() == "does not fit: needs 700 GiB, has 640 GiB"


def test_termination_message_is_bounded_and_stays_valid_utf8(tmp_path):
    log = tmp_path / "termination-log"
    log.touch()
    text = "reason: " + "\u00e9" * 5000  # two bytes each: the cut falls mid-character
    write_termination_message(text, log)
    data = log.read_bytes()
    assert len(data) <= emit.TERMINATION_MAX_BYTES
    decoded = data.decode("utf-8")  # raises if a character was split
    assert decoded.startswith("reason: ") and decoded.endswith("[...truncated]")
