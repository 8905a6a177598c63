"""Bad inputs and corrupt caches: one line and exit 2 (or a warning and the cache ignored),
never a traceback, never a plan for a nonsense model; concurrent cache writers keep every
update (issue 13, items 12-14)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher import paths
from launcher.cli import cli
from launcher.deployment.codec import dump
from launcher.errors import InputError
from launcher.inputs.hardware import GiB, parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.search.planner import Pins, make_plan

LLAMA = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2048,
         "vocab_size": 4096, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """A private cache folder, and the once-per-file warnings forgotten between tests."""
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(paths, "_REPORTED", set())
    return tmp_path / "cache"


def _model(tmp_path: Path, cfg: dict, **files: bytes) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    for name, data in files.items():
        (d / name.replace("__", ".")).write_bytes(data)
    return d


def _plan(*args: str):
    return CliRunner().invoke(cli, ["plan", *args])


def _one_line_exit_2(r, needle: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("vlaunch: error:"), r.output
    assert needle in lines[0], lines[0]


# ----------------------------------------------------------------------------- item 13: configs


@pytest.mark.parametrize("change, needle", [
    ({"num_key_value_heads": 0}, "num_key_value_heads is 0"),  # not "as many as the heads"
    ({"num_hidden_layers": -4}, "num_hidden_layers is -4"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    ({"hidden_size": -1024}, "hidden_size is -1024"),
    ({"vocab_size": 0}, "vocab_size is 0"),
    ({"intermediate_size": -1}, "intermediate_size is -1"),
    ({"num_key_value_heads": "eight"}, "num_key_value_heads is 'eight'"),
    ({"max_position_embeddings": "lots"}, "max_position_embeddings is 'lots'"),
    ({"hidden_size": 1024.5}, "hidden_size is 1024.5"),
    ({"num_hidden_layers": True}, "num_hidden_layers is True"),
    ({"num_hidden_layers": 10**9}, "at most 4,096"),  # would build a billion tensor groups
    ({"hidden_size": 10**400}, "at most"),  # JSON integers are unbounded
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"head_dim": None, "hidden_size": 4}, "smaller than num_attention_heads"),
    ({"rope_scaling": {"factor": "x", "original_max_position_embeddings": 4096}},
     "rope_scaling.factor"),
    ({"text_config": [1]}, "text_config"),
    ({"text_config": {"num_hidden_layers": 0}}, "text_config.num_hidden_layers is 0"),
    ({"quantization_config": "fp8"}, "quantization_config is 'fp8'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     "weight_block_size is [128]"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": ["a", 128]}},
     "weight_block_size"),
    ({"quantization_config": {"quant_method": "gptq", "bits": "four"}}, "bits is 'four'"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "float", "block_structure": [128]}}}}},
     "block_structure"),
])
def test_nonsense_config_is_one_line_exit_2(tmp_path, change, needle):
    _one_line_exit_2(_plan(str(_model(tmp_path, LLAMA | change)), "--gpus", "1xH100"), needle)


def test_mixture_config_with_more_experts_per_token_than_experts(tmp_path):
    cfg = LLAMA | {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 8}
    _one_line_exit_2(_plan(str(_model(tmp_path, cfg)), "--gpus", "1xH100"),
                     "8 experts per token but only 4")


def test_sound_configs_still_load(tmp_path):
    # What the checks must not refuse: null optional keys, 0 where 0 means "none", GPTQ's -1.
    cfg = LLAMA | {"num_key_value_heads": None, "sliding_window": None, "rope_scaling": None,
                   "quantization_config": {"quant_method": "gptq", "bits": 4,
                                           "group_size": -1}}
    spec = load_model(str(_model(tmp_path, cfg)))
    assert spec.num_kv_heads == 8 and spec.quant.method == "int4_group"
    v2 = load_model("deepseek-v2-lite")  # q_lora_rank null, num_nextn_predict_layers 0
    assert v2.num_layers == 27


def test_plan_of_a_file_that_is_not_a_config(tmp_path):
    binary = tmp_path / "true"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff\xfe" + bytes(range(256)))
    _one_line_exit_2(_plan(str(binary), "--gpus", "1xH100"), "not UTF-8")
    if Path("/bin/true").is_file():
        _one_line_exit_2(_plan("/bin/true", "--gpus", "1xH100"), "/bin/true")
    if Path("/dev/zero").exists():  # would otherwise be read without end
        _one_line_exit_2(_plan("/dev/zero", "--gpus", "1xH100"), "not a regular file")


@pytest.mark.parametrize("index, needle", [
    (b"[1, 2]", "JSON list"),
    (b'{"metadata": {"total_size": -5}, "weight_map": {}}', "total_size is -5"),
    (b'{"metadata": {"total_size": "12"}, "weight_map": {}}', "total_size is '12'"),
    (b"\xff\xfe{}", "cannot read"),
    (b"{not json", "cannot read"),
])
def test_broken_safetensors_index_is_one_line(tmp_path, index, needle):
    d = _model(tmp_path, LLAMA, model__safetensors__index__json=index)
    _one_line_exit_2(_plan(str(d), "--gpus", "1xH100"), needle)


def test_safetensors_index_without_total_is_estimated_from_the_config(tmp_path):
    d = _model(tmp_path, LLAMA, model__safetensors__index__json=b'{"weight_map": {}}')
    assert load_model(str(d)).checkpoint_bytes is None


def test_corrupt_single_file_header_is_refused_not_negative_weights(tmp_path):
    # A header length larger than the file would make "file size - header" negative: weights
    # of minus a megabyte, which fit on anything.
    bad = struct.pack("<Q", 10**6) + b"{}" + b"x" * 100
    d = _model(tmp_path, LLAMA, model__safetensors=bad)
    _one_line_exit_2(_plan(str(d), "--gpus", "1xH100"), "corrupt header")
    (d / "model.safetensors").write_bytes(b"\x01\x02")  # shorter than the length field
    _one_line_exit_2(_plan(str(d), "--gpus", "1xH100"), "corrupt header")
    header = b'{"__metadata__": {}}'
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"w" * 64)
    assert load_model(str(d)).checkpoint_bytes == 64


def test_huge_hidden_size_does_not_fit_and_the_bar_stays_bounded(tmp_path):
    # Weights 10^5 times the card: the plan says so; the per-GPU bar stays 60 characters.
    cfg = LLAMA | {"hidden_size": 1 << 30, "num_attention_heads": 8, "num_key_value_heads": 8}
    r = _plan(str(_model(tmp_path, cfg)), "--gpus", "1xH100")
    assert r.exit_code == 3, r.output
    bar = next(x for x in r.output.splitlines() if x.strip().startswith("["))
    assert bar.strip().startswith("[" + "W" * 60 + "]")
    assert max(len(x) for x in r.output.splitlines()) < 2000


def test_budget_bar_is_proportional_and_bounded():
    from launcher.deployment.plan import PerGpuBudget
    from launcher.render import budget_bar

    def per_gpu(weights: int, kv: int = 0) -> PerGpuBudget:
        return PerGpuBudget(weights + kv, weights, 0, 0, 0, kv)

    bar = budget_bar(per_gpu(10**30, 5 * GiB), 80 * GiB)[0]
    assert bar.startswith("[" + "W" * 60 + "]")
    half = budget_bar(per_gpu(20 * GiB, 20 * GiB), 80 * GiB)[0]
    assert half.startswith("[" + "W" * 15 + "K" * 15 + "." * 30 + "]")
    empty = budget_bar(per_gpu(-5), 0)[0]
    assert empty.startswith("[" + "." * 60 + "]")


def test_more_gpus_than_a_node_holds_needs_a_node_count():
    with pytest.raises(InputError, match="2x8xH100"):
        parse_gpus("16xH100")
    with pytest.raises(InputError, match="2x8x24GiB"):  # a size-only card: an 8-GPU board
        parse_gpus("16x24GiB")
    assert parse_gpus("1x16x24GiB").gpus_per_node == 16  # a larger server, said explicitly
    assert parse_gpus("2x8xH100").count == 16


# ----------------------------------------------------------------------------- item 12: caches


def _stderr_warnings(r) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.startswith("vlaunch: warning:")]


@pytest.mark.parametrize("name", ["capabilities.json", "measured.json", "calibration.json"])
@pytest.mark.parametrize("content", [b"\xff\xfe{\x80", b"{truncated", b"[1, 2]", b'"text"'])
def test_corrupt_cache_is_reported_once_and_ignored(_cache, name, content):
    _cache.mkdir(parents=True)
    (_cache / name).write_bytes(content)
    clean = _plan("llama-3.1-8b", "--gpus", "8xH100", "--format", "json", "--vllm-version",
                  "0.32.0")
    assert clean.exit_code == 0, clean.output
    warnings = _stderr_warnings(clean)
    assert len(warnings) == 1 and name in warnings[0], clean.stderr
    assert "Traceback" not in clean.output


def test_lesson_of_the_wrong_type_is_not_trusted(_cache):
    from launcher.predict.features.capabilities import fp8_kv_support, lesson_key, record_lesson

    # The table says yes on H100 and no on A100: a wrong-typed lesson read as truthy or falsy
    # would flip one of them.
    for gpus in ("1xH100", "1xA100"):
        hw = parse_gpus(gpus)
        key = lesson_key(hw, "gqa", "0.32.0")
        (_cache / "capabilities.json").unlink(missing_ok=True)
        table_answer = fp8_kv_support(hw, "gqa", "0.32.0")
        record_lesson(key, not table_answer[0], "what a run taught")
        learnt = fp8_kv_support(hw, "gqa", "0.32.0")
        assert learnt[0] is not table_answer[0] and learnt[1].startswith("learnt at run time")
        for bad in ({"supported": "false", "reason": "hand-edited"},
                    {"supported": "true", "reason": "hand-edited"},
                    {"supported": 0, "reason": "x"}, {"supported": 1, "reason": "x"},
                    {"supported": False, "reason": 7}, {"supported": True},
                    ["supported", False], "no", None):
            (_cache / "capabilities.json").write_text(json.dumps({key: bad}))
            assert fp8_kv_support(hw, "gqa", "0.32.0") == table_answer, (gpus, bad)


@pytest.mark.parametrize("row", [
    {"kv_cache_memory_bytes": "123"}, {"kv_cache_memory_bytes": True},
    {"kv_cache_memory_bytes": -5 * GiB}, {"kv_cache_memory_bytes": 0},
    {"kv_cache_memory_bytes": 5.0e9}, {"kv_cache_memory_bytes": 10**10, "source": ["x"]},
    [1, 2], "row",
])
def test_measured_row_of_the_wrong_type_is_not_used(_cache, capsys, row):
    from launcher.predict.memory import measured_kv as measured

    spec, hw = load_model("llama-3.1-8b"), parse_gpus("1xH100")
    pins = Pins(vllm_version="0.32.0")
    dep = make_plan(spec, hw, pins).deployment()
    d = dump(dep)
    _cache.mkdir(parents=True)
    (_cache / "measured.json").write_text(json.dumps({measured.plan_key(dep): row}))
    again = make_plan(spec, hw, pins).to_dict()
    assert again["kv_cache"]["memory_bytes"] == d["kv_cache"]["memory_bytes"]
    assert not any("measured by vLLM" in r["text"] for r in again["reasons"])
    assert "measured.json" in capsys.readouterr().err


def test_calibration_record_of_the_wrong_type_is_not_used(_cache, capsys):
    from launcher.predict.speed import calibration

    k = calibration.key("m", "H100", 8, 1, 1, 8, False, "auto", "0.32.0")
    good = {"fixed_scale": 1.5, "roofline_scale": 1.2, "points": [], "family": "f"}
    _cache.mkdir(parents=True)
    (_cache / "calibration.json").write_text(json.dumps({k: good}))
    assert calibration.lookup(k) == good
    for bad in ({"fixed_scale": "1.5", "roofline_scale": 1.2}, {"fixed_scale": 1.5},
                {"fixed_scale": True, "roofline_scale": 1.2},
                {"fixed_scale": 1.5, "roofline_scale": 1.2, "points": "many"}):
        (_cache / "calibration.json").write_text(json.dumps({k: bad | {"family": "f"}}))
        assert calibration.lookup(k) is None, bad
        assert calibration.lookup_family("f") is None, bad
    assert "calibration.json" in capsys.readouterr().err


def test_exec_plan_without_parallel_is_one_line(tmp_path):
    emitted = tmp_path / "emitted"
    r = _plan("llama-3.1-8b", "--gpus", "1xH100", "--emit", str(emitted), "--vllm-version",
              "0.32.0")
    assert r.exit_code == 0, r.output
    good = json.loads((emitted / "plan.json").read_text())
    engine = ("pools", 0, "engine")
    for section, field, value, needle in (
            ((*engine, "parallel"), None, None, "no `pools[0].engine.parallel`"),
            ((*engine, "parallel"), "tp", "2", "`pools[0].engine.parallel.tp` is '2'"),
            ((*engine, "parallel"), "nodes", 0, "`pools[0].engine.parallel.nodes` is 0"),
            (("gpus",), "count", None, None),  # not needed by exec: no complaint about it
            (engine, "max_model_len", None, "no `pools[0].engine.max_model_len`"),
            (("pools", 0, "kv_cache"), "dtype", 8, "`pools[0].kv_cache.dtype` is 8")):
        d = json.loads(json.dumps(good))
        part = d
        for key in section[:-1] if field is None else section:
            part = part[key]
        if field is None:
            del part[section[-1]]
        elif value is None:
            del part[field]
        else:
            part[field] = value
        (tmp_path / "plan.json").write_text(json.dumps(d))
        r = CliRunner().invoke(cli, ["exec", "--plan", str(tmp_path / "plan.json"),
                                     "--dry-run", "--no-metrics", "-q"])
        if needle is None:
            assert r.exit_code == 0, r.output
        else:
            _one_line_exit_2(r, needle)


# ----------------------------------------------------------------------------- item 14: locking


def _write_keys(prefix: str, n: int) -> None:
    for i in range(n):
        paths.update_json_object(paths.cache_dir() / "shared.json",
                                 lambda data, i=i: data.__setitem__(f"{prefix}-{i}", i))


def _write_lessons(prefix: str, n: int) -> None:
    from launcher.predict.features.capabilities import record_lesson

    for i in range(n):
        record_lesson(f"{prefix}-{i}", i % 2 == 0, f"lesson {i}")


def _with_context(d, n: int):
    """Plan `d` with another max_model_len (another measured key)."""
    engine = dataclasses.replace(d.engine, max_model_len=n)
    return dataclasses.replace(d, pools=(dataclasses.replace(d.pool, engine=engine),))


def _write_measured(d, n: int) -> None:
    from launcher.predict.memory import measured_kv as measured

    for i in range(n):
        measured.record(_with_context(d, d.engine.max_model_len - i), 10**9 + i, "test")


def _write_calibration(d) -> None:
    from launcher.predict.search.engine_from_plan import shape_from_plan
    from launcher.predict.speed import calibration

    calibration.record(d, [{"concurrency": 4, "input_len": 1024, "output_len": 256,
                            "output_tokens_per_s": 500.0, "tpot_ms": 20.0}], "test",
                       shape_from_plan(d))


def _run_all(target, args_list) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=a) for a in args_list]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0


def test_concurrent_writers_keep_every_update(_cache):
    _run_all(_write_keys, [(f"w{j}", 25) for j in range(6)])
    data = json.loads((_cache / "shared.json").read_text())
    assert len(data) == 6 * 25
    _run_all(_write_lessons, [(f"gpu{j}", 15) for j in range(6)])
    lessons = json.loads((_cache / "capabilities.json").read_text())
    assert len(lessons) == 6 * 15
    assert all(isinstance(v["supported"], bool) for v in lessons.values())


def test_concurrent_measured_and_calibration_records_keep_every_update(_cache):
    from launcher.predict.memory import measured_kv as measured
    from launcher.predict.speed import calibration

    spec, hw = load_model("llama-3.1-8b"), parse_gpus("8xH100")
    plans = [make_plan(spec, hw, Pins(vllm_version="0.32.0", tp=tp, kv_cache_dtype="auto"))
             .deployment() for tp in (1, 2, 4, 8)]
    _run_all(_write_measured, [(_with_context(d, 8192 * (j + 1)), 10)
                               for j, d in enumerate(plans)])
    assert len(json.loads((_cache / "measured.json").read_text())) == 4 * 10
    _run_all(_write_calibration, [(d,) for d in plans])
    stored = json.loads((_cache / "calibration.json").read_text())
    assert set(stored) == {calibration.plan_key(d) for d in plans}
    assert measured.lookup(measured.plan_key(_with_context(plans[0], 8192))) is not None
