"""`vlaunch plan` and `vlaunch capacity` at the edges: files, plots, options that must matter."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_output_into_a_missing_folder_names_the_users_path(tmp_path: Path):
    target = tmp_path / "nope" / "x.json"
    r = _run("plan", "llama-3.1-8b", "--gpus", "1xH100", "-o", str(target))
    assert r.exit_code == 2
    assert str(target) in r.output and ".tmp" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_emit_into_an_unwritable_folder_prints_no_plan(tmp_path: Path):
    r = _run("plan", "llama-3.1-8b", "--gpus", "1xH100", "--emit", "/proc/vlaunch-x")
    assert r.exit_code == 2
    assert "FITS" not in r.output and "vllm serve" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_plot_has_the_mode_of_emitted_files(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra")
    old = os.umask(0o027)
    try:
        out = tmp_path / "p.png"
        r = _run("plan", "llama-3.1-8b", "--gpus", "1xH100", "--plot", str(out))
        assert r.exit_code == 0, r.output
        assert stat.S_IMODE(out.stat().st_mode) == 0o644 & ~0o027
    finally:
        os.umask(old)


def test_plot_of_a_plan_that_does_not_fit_says_so(tmp_path: Path):
    out = tmp_path / "p.png"
    r = _run("plan", "llama-3.1-70b", "--gpus", "1xH100", "--plot", str(out))
    assert r.exit_code == 3
    assert "does not fit" in r.output and "--plot" in r.output and not out.exists()


def _capacity(*extra: str) -> dict:
    r = _run("capacity", "deepseek-r1", "--users", "2000", "--gpus", "8xH200",
             "--format", "json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_every_capacity_option_changes_the_answer():
    base = _capacity()
    rec = base["recommended"]
    lat = _capacity("--objective", "latency")["recommended"]
    # (which layout each objective picks for R1 is the performance model's call: TP8+EP and
    # DP8+EP are within ~15% at the default SLO; test_search_properties checks the choice)
    assert lat["parallel"]["expert_parallel"] and rec["parallel"]["expert_parallel"]
    off = _capacity("--no-mtp")["recommended"]
    on = _capacity("--mtp")["recommended"]
    assert off["serving"]["mtp"] == 0 and on["serving"]["mtp"] > 0
    assert off["per_replica"] != on["per_replica"]
    r = _run("capacity", "deepseek-r1", "--users", "10", "--gpus", "8xH200", "--concurrency",
             "64")
    assert r.exit_code == 2 and "--concurrency" in r.output  # sized by its load: no such flag


def test_capacity_with_no_option_meeting_the_slo_exits_3_naming_the_closest_miss():
    r = _run("capacity", "llama-3.1-70b", "--users", "10", "--gpus", "2xH100,8xH100",
             "--slo", "tpot=5ms")
    assert r.exit_code == 3
    last = r.output.strip().splitlines()[-1]
    assert "misses the SLO" in last and "closest:" in last
    assert "TPOT" in last and "recommended: none" in r.output


@pytest.mark.parametrize("model,gpus", [("deepseek-v3", "8xH200"), ("llama-3.1-8b", "1xH100"),
                                        ("qwen3-8b", "1xL4"), ("deepseek-v3", "2x8xH100"),
                                        ("deepseek-v3", "1xH100")])
def test_plan_text_says_what_will_happen_first_and_one_knee(model, gpus):
    """The verdict, why not, the warnings and the command (or what would fit) come before the
    figures, and the reasons last. One knee: the performance line's "N in flight" (the load
    the SLO holds); max-num-seqs is the batch that runs at once, never called a knee."""
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import Pins, make_plan
    from launcher.render import plan_text

    dep = make_plan(load_model(model), parse_gpus(gpus), Pins()).deployment()
    lines = plan_text(dep).splitlines()
    heads = [x.strip() for x in lines if x.startswith("  ") and not x.startswith("   ")]

    def at(prefix: str) -> int:
        return next((i for i, x in enumerate(heads) if x.startswith(prefix)), -1)

    acts = [i for i in (at("why it does not fit"), at("warnings:"), at("command"),
                        at("what would fit:")) if i >= 0]
    assert acts and max(acts) < at("model:") and (at("why:") < 0 or at("why:") > at("model:"))
    text = " ".join(lines)
    knee = dep.performance.knee if dep.performance is not None else None
    if dep.fits and knee:
        assert f"knee: {knee.concurrency:,.0f} in flight" in text
        assert "this engine's SLO knee" not in text
        seqs, dp = dep.engine.max_num_seqs, dep.engine.parallel.dp
        if seqs * dp < knee.concurrency:
            assert f"{seqs * dp:,} running at max-num-seqs {seqs:,}" in text
