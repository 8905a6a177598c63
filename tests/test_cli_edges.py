"""Small CLI rough edges (issue 13, item 15): exporter --plan, -o named like a format, one
--format vocabulary, profile order, headings with nothing under them, "pinned by you"."""

from __future__ import annotations

import json
import re

import click
import pytest
from click.testing import CliRunner

from launcher.cli import cli


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))


def _emit(tmp_path, *pins: str):
    out = tmp_path / "emitted"
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "--vllm-version",
                                 "0.32.0", "--emit", str(out), *pins])
    assert r.exit_code == 0, r.output
    return out


def test_exporter_plan_accepts_the_folder_exec_accepts(tmp_path, monkeypatch):
    from launcher.observe import exporter

    seen = {}

    class FakeExporter:
        def __init__(self, url, plan=None, **kw):
            seen["plan"] = plan

    monkeypatch.setattr(exporter, "Exporter", FakeExporter)
    monkeypatch.setattr(exporter, "run_forever", lambda *a, **k: None)
    folder = _emit(tmp_path)
    for given in (folder, folder / "plan.json"):
        seen.clear()
        r = CliRunner().invoke(cli, ["exporter", "--vllm-url", "http://127.0.0.1:1", "--plan",
                                     str(given)])
        assert r.exit_code == 0, r.output
        assert seen["plan"].model.name == "llama-3.1-8b"  # the typed plan
    r = CliRunner().invoke(cli, ["exporter", "--vllm-url", "http://x", "--plan",
                                 str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "no plan at" in r.output


def test_exporter_help_names_only_flags_that_exist():
    text = CliRunner().invoke(cli, ["exporter", "--help"]).output
    plan_help = CliRunner().invoke(cli, ["plan", "--help"]).output
    for flag in re.findall(r"vlaunch plan[^)]*?(--[a-z-]+)", text):
        assert flag in plan_help, flag
    assert "--json" not in text


@pytest.mark.parametrize("name, fmt", [("json", "json"), ("YAML", "yaml"), ("text", "text"),
                                       ("args", "args"), ("yml", "yaml")])
def test_output_named_like_a_format_warns(tmp_path, monkeypatch, name, fmt):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "-o", name])
    assert r.exit_code == 0, r.output
    warnings = [x for x in r.stderr.splitlines() if "warning" in x]
    assert len(warnings) == 1 and f"--format {fmt}" in warnings[0], r.stderr
    assert (tmp_path / name).read_text().startswith("llama-3.1-8b on 1xH100")  # still text


def test_output_with_a_real_file_name_does_not_warn(tmp_path):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "--format",
                                 "json", "-o", str(out)])
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    assert json.loads(out.read_text())["fits"] is True


def _format_options():
    for name, cmd in cli.commands.items():
        for p in cmd.params:
            if "--format" in getattr(p, "opts", ()):
                yield name, p


def test_every_format_option_speaks_text_and_json():
    found = dict(_format_options())
    assert {"plan", "capacity", "profiles", "gpus", "tune", "doctor"} <= set(found)
    for name, p in found.items():
        assert isinstance(p.type, click.Choice), name
        assert list(p.type.choices)[:2] == ["text", "json"], (name, p.type.choices)
        assert p.default == "text" and p.show_default, name


def test_gpus_text_format_is_the_table(monkeypatch):
    from launcher.inputs import inventory

    monkeypatch.setattr(inventory, "read_inventory", lambda: "INV")
    monkeypatch.setattr(inventory, "render_table", lambda inv, color, width=None: f"table of {inv}")
    r = CliRunner().invoke(cli, ["gpus", "--format", "text"])
    assert r.exit_code == 0 and r.output.strip() == "table of INV"


def _natural(name: str) -> list:
    return [(s, 0) if i % 2 == 0 else ("", int(s))
            for i, s in enumerate(re.split(r"(\d+)", name))]


def test_profiles_are_listed_by_name():
    r = CliRunner().invoke(cli, ["profiles", "--format", "json"])
    names = [row["name"] for row in json.loads(r.output)]
    assert names == sorted(names, key=_natural)
    # file order put deepseek-r1-0528.yaml before deepseek-r1.yaml, and 405b before 8b
    assert names.index("deepseek-r1") < names.index("deepseek-r1-0528")
    assert names.index("llama-3.1-8b") < names.index("llama-3.1-70b")
    text = CliRunner().invoke(cli, ["profiles"]).output.splitlines()[1:]
    assert [line.split()[0] for line in text] == names


@pytest.mark.parametrize("suggestions, heading", [([], False), ([""], False), (["  "], False),
                                                  (["8xH200 fits"], True)])
def test_what_would_fit_heading_only_above_suggestions(tmp_path, suggestions, heading):
    from launcher.deployment.codec import load
    from launcher.render import plan_text

    r = CliRunner().invoke(cli, ["plan", "deepseek-v3", "--gpus", "1xH100", "--format", "json"])
    d = json.loads(r.output)
    assert not d["fits"]
    d["suggestions"] = [{"code": "suggest", "text": s, "data": {}} for s in suggestions]
    text = plan_text(load(d))
    assert ("what would fit:" in text) is heading
    assert not re.search(r"^  [a-z ]+:\n(?!    )", text + "\n", re.M), text  # no empty heading


def test_exec_says_pinned_by_you_only_for_the_users_pins(tmp_path):
    folder = _emit(tmp_path, "--max-model-len", "8192")
    reasons = json.loads((folder / "plan.json").read_text())["reasons"]
    assert [r["code"] for r in reasons if r["data"].get("pinned")] == [
        "vllm.version", "max_model_len.pinned"]  # the user's pins, by code (_emit pins vLLM)
    # exec runs the plan as it is: its reasons are the emitted plan's
    r = CliRunner().invoke(cli, ["exec", "--plan", str(folder), "--dry-run", "--no-metrics"])
    assert r.exit_code == 0, r.output
    pinned = [x.strip() for x in r.output.splitlines() if "pinned" in x]
    assert pinned == ["- max-model-len 8,192: pinned by you"], pinned
    # --replan re-plans with every decision pinned: only the user's keep the label
    r = CliRunner().invoke(cli, ["exec", "--plan", str(folder), "--replan", "--dry-run",
                                 "--no-metrics"])
    assert r.exit_code == 0, r.output
    pinned = [x.strip() for x in r.output.splitlines() if "pinned" in x]
    assert pinned == ["- max-model-len 8,192: pinned by you"], pinned
    assert "gpu-memory-utilization 0.92: from the emitted plan" in r.output
    assert re.search(r"layout TP1: .*\(from the emitted plan\)", " ".join(r.output.split()))


def test_a_closed_pipe_ends_quietly_as_sigpipe_would():
    """`vlaunch ... | head`: the reader went away; no error line, exit 128 + SIGPIPE."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "deepseek-v3", "--gpus",
                          "8xH200", "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    p.stdout.read(10)
    p.stdout.close()  # as `head -c 10` does
    _, err = p.communicate(timeout=120)
    assert p.returncode in (0, 141), err
    assert b"error" not in err and b"Traceback" not in err, err
