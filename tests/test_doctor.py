# ruff: noqa: E501  (log lines are kept verbatim)
"""`vlaunch doctor` on fixture logs written from vLLM's message formats (tests/fixtures/doctor).

Every fixture is in one table below with the diagnosis it must get: cause, phase, consumer and
the exact fix. The `unknown_*` logs hold errors the doctor has no rule for: they must come out
`unknown` with their error lines and no fix, never as a false cause. Fast: no engine.

The 0.32.0 lines follow the format strings in the installed vLLM source (cited in
launcher/doctor.py RULES). Older wordings ("models's", "GB", no estimate; "Free memory on device
(...)" without a device; raw-byte profiling errors) and older prefixes ("(VllmWorker rank=0
pid=...)", no prefix) are written from those releases' format strings; the version numbers in
those fixtures' banners are illustrative, not a verified release mapping.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.errors import InputError
from launcher.inputs import vllm_failures as vf
from launcher.inputs import vllm_logfiles as vlf
from launcher.inputs import vllm_loglines as vll
from launcher.inputs import vllm_rules as vr
from launcher.inputs.hardware import parse_gpus
from launcher.observe import doctor
from launcher.observe import doctor_logfix as dlf
from launcher.observe import doctor_plancheck as dpc
from launcher.predict.search.planner import Pins, make_plan
from launcher.run import vllmlog

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"

# name: (cause, phase, consumer, fix_args, fix_env). fix_args None: checked separately.
EXPECTED: dict[str, tuple[str, str, str, list[str] | None, dict[str, str]]] = {
    "kv_short_v032_cpu.log": ("kv_cache_too_small", "kv_cache", "kv_cache", ["--max-model-len", "2864"], {}),
    "kv_short_models_estimate.log": ("kv_cache_too_small", "kv_cache", "kv_cache", ["--max-model-len", "90880"], {}),
    # no estimate in the earliest wording: 32768 x 2.00/4.00, less 2%
    "kv_short_oldest_gb.log": ("kv_cache_too_small", "kv_cache", "kv_cache", ["--max-model-len", "16056"], {}),
    "kv_short_kubectl_timestamps.log": ("kv_cache_too_small", "kv_cache", "kv_cache", ["--max-model-len", "90880"], {}),
    "ranks8_kv_short_dp8.log": ("kv_cache_too_small", "starting", "kv_cache", ["--max-model-len", "90880"], {}),
    "restart_appended.log": ("kv_cache_too_small", "kv_cache", "kv_cache", ["--max-model-len", "7424"], {}),
    "no_kv_weights.log": ("no_kv_cache_memory", "kv_cache", "weights", ["--gpu-memory-utilization", "0.95"], {}),
    "no_kv_cudagraph_estimate.log": ("no_kv_cache_memory", "profiling", "cuda_graphs", [], {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"}),
    "no_kv_activations.log": ("no_kv_cache_memory", "profiling", "activations", ["--max-num-batched-tokens", "32768"], {}),
    "no_kv_cpu_zero.log": ("no_kv_cache_memory", "kv_cache", "kv_cache", [], {}),
    # utilization at most free/total less 1%, rounded down: 30.12/79.19 = 0.380 -> 0.37
    "free_mem_v032.log": ("free_memory_below_utilization", "starting", "co_tenant", ["--gpu-memory-utilization", "0.37"], {}),
    "free_mem_old_no_device.log": ("free_memory_below_utilization", "starting", "co_tenant", ["--gpu-memory-utilization", "0.56"], {}),
    "free_mem_cpu_node.log": ("free_memory_below_utilization", "starting", "co_tenant", ["--gpu-memory-utilization", "0.32"], {}),
    # 90% of the 1.5 GiB free
    "free_mem_cpu_kv.log": ("free_memory_below_utilization", "profiling", "co_tenant", ["--kv-cache-memory-bytes", str(int(1.5 * 0.9 * (1 << 30)))], {}),
    "free_mem_external_weights.log": ("free_memory_below_utilization", "starting", "co_tenant", ["--gpu-memory-utilization", "0.24"], {}),
    "mem_profiling_v032.log": ("memory_changed_during_profiling", "profiling", "co_tenant", [], {}),
    "mem_profiling_old_bytes.log": ("memory_changed_during_profiling", "profiling", "co_tenant", [], {}),
    "oom_loading_weights.log": ("cuda_oom", "loading_weights", "weights", ["--tensor-parallel-size", "8"], {}),
    "oom_profiling.log": ("cuda_oom", "profiling", "activations", ["--max-num-batched-tokens", "16384"], {}),
    "oom_graph_profiling.log": ("cuda_oom", "profiling", "cuda_graphs", ["--gpu-memory-utilization", "0.90"], {}),
    "oom_graph_capture.log": ("cuda_oom", "capturing_graphs", "cuda_graphs", ["--gpu-memory-utilization", "0.87"], {}),
    "oom_kv_allocation.log": ("cuda_oom", "kv_cache", "kv_cache", ["--gpu-memory-utilization", "0.85"], {}),
    "ranks8_oom_tp8.log": ("cuda_oom", "profiling", "activations", ["--max-num-batched-tokens", "8192"], {}),
    "oom_sampler_warmup.log": ("sampler_warmup_oom", "profiling", "activations", ["--max-num-seqs", "512"], {}),
    "host_oom_loading.log": ("host_oom_killed", "loading_weights", "weights", [], {}),
    "host_oom_shell_killed.log": ("host_oom_killed", "loading_weights", "weights", [], {}),
    "nccl_error.log": ("nccl_error", "starting", "none", [], {}),
    "nccl_timeout.log": ("nccl_timeout", "profiling", "none", [], {}),
    "kv_dtype_no_backend.log": ("kv_cache_dtype_unsupported", "starting", "kv_cache", ["--kv-cache-dtype", "auto"], {}),
    "kv_dtype_triton_mla_old.log": ("kv_cache_dtype_unsupported", "starting", "kv_cache", ["--kv-cache-dtype", "auto"], {}),
    "kv_dtype_cpu_first_request.log": ("kv_cache_dtype_unsupported", "ready", "kv_cache", ["--kv-cache-dtype", "auto"], {}),
    "kv_dtype_invalid_choice.log": ("invalid_kv_cache_dtype", "starting", "kv_cache", ["--kv-cache-dtype", "auto"], {}),
    "quant_capability.log": ("quantization_unsupported", "starting", "weights", [], {}),
    "missing_module.log": ("missing_module", "starting", "none", [], {}),
    "gpu_no_driver.log": ("gpu_unavailable", "starting", "none", [], {}),
    "port_in_use_uvicorn.log": ("port_in_use", "starting", "none", None, {}),
    "model_not_on_hub.log": ("model_not_found", "starting", "none", [], {}),
    "hub_unreachable.log": ("hub_unreachable", "starting", "none", [], {}),
    "hub_gated.log": ("hub_access_denied", "starting", "none", [], {}),
    "engine_ready_timeout.log": ("engine_ready_timeout", "loading_weights", "none", [], {"VLLM_ENGINE_READY_TIMEOUT_S": "1800"}),
    "max_len_exceeds_model.log": ("max_model_len_exceeds_model", "starting", "none", ["--max-model-len", "163840"], {}),
    "tp_not_divisible.log": ("tp_not_divisible", "starting", "none", ["--tensor-parallel-size", "8"], {}),
    # V0 (0.6.0 to 0.10.x, worker/worker.py raise_if_cache_size_invalid): tokens, not GiB
    "kv_short_v06_tokens.log": ("kv_cache_too_small", "kv_cache", "kv_cache", ["--max-model-len", "40624"], {}),
    # 0.8.5 prints "Based on the available memory," and loses the estimate: 40960 x 4.32/5.62, less 2%
    "kv_short_v085_lost_estimate.log": ("kv_cache_too_small", "kv_cache", "kv_cache", ["--max-model-len", "30855"], {}),
    "oom_pooler_warmup.log": ("sampler_warmup_oom", "profiling", "activations", ["--max-num-seqs", "128"], {}),
    # NCCL's own WARN lines (src/misc/shmutils.cc, transport/net_ib.cc, misc/socket.cc, CUDACHECK)
    "nccl_shm_container.log": ("nccl_shared_memory", "starting", "none", [], {}),
    "nccl_peer_access.log": ("nccl_peer_access", "starting", "none", ["--disable-custom-all-reduce"], {"NCCL_P2P_DISABLE": "1"}),
    "nccl_ib_completion.log": ("nccl_infiniband", "loading_weights", "none", [], {}),
    "nccl_socket_closed.log": ("nccl_socket", "starting", "none", [], {}),
    "cpu_head_dim16.log": ("cpu_attention_head_size", "serving", "none", [], {}),
    # 0.11 and 0.14 word the engine start-up timeout as a handshake that never came
    "engine_handshake_timeout_v011.log": ("engine_ready_timeout", "loading_weights", "none", [], {"VLLM_ENGINE_READY_TIMEOUT_S": "1800"}),
    "quant_moe_wna16_awq.log": ("quantization_unsupported", "starting", "weights", [], {}),
}

# name: a piece of the error line that must be in the evidence.
UNKNOWN = {
    "unknown_keyerror_weights.log": "KeyError: 'model.layers.0.mlp.gate.e_score_correction_bias'",
    "unknown_empty_env_int.log": "invalid literal for int() with base 10",
    "unknown_config_json.log": "JSONDecodeError",
    "unknown_tokenizer_enum.log": "untagged enum ModelWrapper",
    "unknown_safetensors_header.log": "HeaderTooLarge",
    "unknown_shape_mismatch.log": "is invalid for input of size 2048",
    "unknown_unexpected_kwarg.log": "unexpected keyword argument 'rope_scaling_type'",
    "unknown_permission_cache.log": "Permission denied",
    "unknown_illegal_memory_access.log": "an illegal memory access was encountered",
    "unknown_no_space.log": "No space left on device",
    "unknown_architecture.log": "are not supported for now",
    "unknown_request_too_long.log": "longer than the maximum model length of 4096",
}


def _diagnose(name: str, ctx=None) -> vf.Report:
    """The fixture's diagnosis: the log-only fixes without a context (what the table below
    pins), or the planner-checked ones with it."""
    if ctx is None:
        report = vlf.scan_source(str(FIXTURES / name))[0]
        dlf.apply_log_fixes(report)
        return report
    return doctor.diagnose(str(FIXTURES / name), ctx)[0]


def test_every_fixture_is_checked_and_the_corpus_is_big_enough():
    on_disk = {p.name for p in FIXTURES.glob("*.log")}
    assert on_disk == set(EXPECTED) | set(UNKNOWN)
    assert len(EXPECTED) >= 25 and len(UNKNOWN) >= 10
    assert len({v[0] for v in EXPECTED.values()}) >= 18  # kinds of failure, not one kind 25 times


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_diagnosis(name: str):
    cause, phase, consumer, fix_args, fix_env = EXPECTED[name]
    report = _diagnose(name)
    assert len(report.diagnoses) == 1, [d.cause for d in report.diagnoses]
    d = report.root
    assert (d.cause, d.phase, d.consumer) == (cause, phase, consumer)
    assert d.consumer in vr.CONSUMERS and d.phase in vll.PHASES
    if fix_args is not None:
        assert d.fix_args == fix_args
    assert d.fix_env == fix_env
    assert d.evidence and d.explain
    # a fix with flags comes with the `vlaunch serve` command that applies it
    if d.fix_args and report.facts.arg("model"):
        assert d.serve_command and "vlaunch serve " in d.serve_command
        env = " ".join(f"{k}={v}" for k, v in d.fix_env.items())
        assert d.serve_command.startswith((env + " vlaunch serve ") if env else "vlaunch serve ")
        for flag in d.fix_args[::2]:
            assert dlf._VLAUNCH_PINS.get(flag, flag) in d.serve_command


@pytest.mark.parametrize("name", sorted(UNKNOWN))
def test_unrelated_errors_are_unknown_with_their_lines_and_no_fix(name: str):
    report = _diagnose(name)
    assert [d.cause for d in report.diagnoses] == ["unknown"]
    d = report.root
    assert any(UNKNOWN[name] in e for e in d.evidence), d.evidence
    assert d.fix_args == [] and d.fix_env == {} and d.serve_command is None
    # wrapper and traceback-frame lines are not the error
    assert not any("See root cause above" in e or e.endswith("load_weights()") for e in d.evidence)


def test_port_fix_is_a_port_free_here():
    d = _diagnose("port_in_use_uvicorn.log").root
    assert d.fix_args[0] == "--port" and int(d.fix_args[1]) >= 8001
    with socket.socket() as s:
        s.bind(("0.0.0.0", int(d.fix_args[1])))


def test_port_in_use_skips_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert dlf.next_free_port(port) != port


def test_eight_ranks_failing_the_same_way_are_one_diagnosis():
    for name in ("ranks8_oom_tp8.log", "ranks8_kv_short_dp8.log"):
        report = _diagnose(name)
        assert len(report.diagnoses) == 1
        assert report.root.ranks == 8
    # the engine core's "Worker failed with error '...CUDA out of memory...'" echo is no rank
    d = _diagnose("ranks8_oom_tp8.log").root
    assert all("Worker failed with error" not in e for e in d.evidence[:4])


def test_one_rank_is_one():
    assert _diagnose("oom_profiling.log").root.ranks == 1


def test_restart_appended_diagnoses_the_last_launch():
    report = _diagnose("restart_appended.log")
    assert report.launches == 2
    assert [d.cause for d in report.diagnoses] == ["kv_cache_too_small"]


def test_root_cause_is_the_first_direct_error_not_the_exit_code():
    text = (FIXTURES / "oom_profiling.log").read_text().replace(
        "Failed core proc(s): {'EngineCore': 1}", "Failed core proc(s): {'EngineCore': -9}")
    report = vf.scan_text(text)
    assert [d.cause for d in report.diagnoses] == ["cuda_oom", "host_oom_killed"]


def test_transient_failures_are_marked():
    assert _diagnose("mem_profiling_v032.log").root.transient
    assert _diagnose("nccl_timeout.log").root.transient
    assert not _diagnose("kv_short_v032_cpu.log").root.transient
    assert not _diagnose("nccl_error.log").root.transient


def test_numbers_from_vllms_message():
    d = _diagnose("kv_short_models_estimate.log").root
    # numbers are numbers (JSON shows them unquoted), words stay words
    assert d.numbers == {"max_model_len": 163840, "needed": 10.72, "unit": "GiB",
                         "available": 5.95, "estimate": 90880}
    d = _diagnose("free_mem_v032.log").root
    assert (d.numbers["device"], d.numbers["free"], d.numbers["total"]) == ("cuda:0", 30.12, 79.19)


def test_phases_follow_vllms_markers():
    lines = [
        ("(APIServer pid=1) INFO 11-30 10:00:00 [api_utils.py:286] non-default args: {'model': 'm'}", "starting"),
        ("(Worker_TP0 pid=3) INFO 11-30 10:00:01 [gpu_model_runner.py:5040] Starting to load model m...", "loading_weights"),
        ("(Worker_TP0 pid=3) INFO 11-30 10:00:02 [gpu_model_runner.py:5150] Model loading took 78.45 GiB memory and 1.0 seconds", "profiling"),
        ("(Worker_TP0 pid=3) INFO 11-30 10:00:03 [gpu_worker.py:760] Available KV cache memory: 40.5 GiB", "kv_cache"),
        ("(Worker_TP0 pid=3) INFO 11-30 10:00:04 [gpu_model_runner.py:6582] Graph capturing finished in 28 secs, took 0.98 GiB", "capturing_graphs"),
        ("(EngineCore pid=2) INFO 11-30 10:00:05 [core.py:403] init engine (profile, create kv cache, warmup model) took 60.00 s", "ready"),
        ("(APIServer pid=1) INFO 11-30 10:00:06 [loggers.py:283] Engine 000: Avg prompt throughput: 1.0 tokens/s", "serving"),
    ]
    for line, phase in lines:
        assert vll.phase_of(split := vll.split_line(1, line).content)[0] == phase, split
    assert [p for _, p in lines] == list(vll.PHASES)
    report = vf.scan_text("\n".join(x for x, _ in lines))
    assert report.phase == "serving" and report.diagnoses == []
    assert report.facts.number("weights_gib") == 78.45


def test_warnings_that_mention_failures_are_not_failures():
    text = (
        "(APIServer pid=1) WARNING 11-30 10:00:00 [x.py:1] lowering max_num_seqs avoids CUDA out of memory\n"
        "(APIServer pid=1) INFO 11-30 10:00:01 [x.py:1] Port 8000 is already in use, trying port 8001\n"
        "INFO:     Application startup complete.\n"
    )
    report = vf.scan_text(text)
    assert report.diagnoses == []


def test_overlong_lines_are_cut_and_the_error_after_them_still_found():
    big = "(APIServer pid=1) INFO 11-30 10:00:00 [x.py:1] config: " + "x" * 1_000_000 + "\n"
    text = big + "ValueError: No available memory for the cache blocks. Try increasing ...\n"
    report, _ = vlf.scan_source("-", stdin=io.StringIO(text))
    assert report.root.cause == "no_kv_cache_memory"
    assert report.lines == 2


def test_vllmlog_classify_failure_delegates_with_its_kinds():
    kv = vllmlog.classify_failure((FIXTURES / "kv_short_models_estimate.log").read_text())
    assert kv.kind == vllmlog.KV_SHORTAGE and kv.estimated_max_model_len == 90880
    assert (kv.max_model_len, kv.needed_kv_gib, kv.available_kv_gib) == (163840, 10.72, 5.95)
    assert kv.cause == "kv_cache_too_small" and not kv.transient
    free = vllmlog.classify_failure((FIXTURES / "free_mem_external_weights.log").read_text())
    assert free.kind == vllmlog.INSUFFICIENT_FREE_MEMORY
    assert (free.free_gib, free.total_gib, free.requested_utilization, free.requested_gib) == (20.0, 79.19, 0.9, 40.5)
    oom = vllmlog.classify_failure((FIXTURES / "oom_sampler_warmup.log").read_text())
    assert oom.kind == vllmlog.DEVICE_OOM
    prof = vllmlog.classify_failure((FIXTURES / "mem_profiling_v032.log").read_text())
    assert prof.kind == vllmlog.OTHER and prof.transient
    unk = vllmlog.classify_failure((FIXTURES / "unknown_keyerror_weights.log").read_text())
    assert unk.kind == vllmlog.OTHER and unk.details["exception"] == "KeyError"


# --- fixes computed by the planner --------------------------------------------------------------


@pytest.fixture(scope="module")
def h200_ctx() -> dpc.PlanContext:
    return dpc.context_from_model("deepseek-v3", "8xH200", Pins(), {}, parse_gpus("8xH200"))


def test_planner_fix_for_kv_shortage_uses_the_measured_estimate(h200_ctx):
    d = _diagnose("ranks8_kv_short_dp8.log", h200_ctx).root
    assert d.fix_args == ["--max-model-len", "90880"]
    # the run line is the failed launch (its --dp 8 from the log) with the fix applied
    assert d.serve_command.startswith("vlaunch serve deepseek-ai/DeepSeek-V3 --gpus 8xH200 ")
    assert "--tp 1 --pp 1 --dp 8 --expert-parallel --max-model-len 90880" in d.serve_command
    assert d.explain[0].startswith("checked by vlaunch's planner")


def _pins_of_command(command: str) -> Pins:
    """The pins a `vlaunch serve` command line sets (what the doctor's run: line re-plans)."""
    import shlex

    words = shlex.split(command)
    names = {"--tp": "tp", "--pp": "pp", "--dp": "dp", "--max-model-len": "max_model_len",
             "--kv-cache-dtype": "kv_cache_dtype", "--max-num-seqs": "max_num_seqs",
             "--gpu-memory-utilization": "gpu_memory_utilization",
             "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
             "--max-num-batched-tokens": "max_num_batched_tokens"}
    kw: dict = {}
    for i, w in enumerate(words):
        if w in names:
            v = words[i + 1]
            kw[names[w]] = v if w == "--kv-cache-dtype" else (float(v) if "." in v else int(v))
        elif w == "--enforce-eager":
            kw["enforce_eager"] = True
    return Pins(**kw)


PLANNED = sorted(n for n, v in EXPECTED.items() if v[0] in dpc.PLANNED_CAUSES)


@pytest.mark.parametrize("name", PLANNED)
def test_every_shown_fix_fits_by_the_planner_and_agrees_with_its_run_line(name, h200_ctx):
    """Property over every planned-cause fixture: a fix that is shown is one the planner says
    fits, and the `fix:` flags appear with the same values in the `run:` command, which
    itself re-plans to a plan that fits."""
    from launcher.predict.search.planner import make_plan

    report = _diagnose(name, h200_ctx)
    for d in report.diagnoses:
        if not d.fix_args:
            assert d.serve_command is None or d.fix_env
            continue
        words = d.serve_command.split()
        for i in range(0, len(d.fix_args)):
            flag = d.fix_args[i]
            if not flag.startswith("--"):
                continue
            mine = dlf._VLAUNCH_PINS.get(flag, flag)
            assert mine in words, (flag, d.serve_command)
            if i + 1 < len(d.fix_args) and not d.fix_args[i + 1].startswith("--"):
                assert words[words.index(mine) + 1] == d.fix_args[i + 1]
        plan = make_plan(h200_ctx.spec, h200_ctx.hardware, _pins_of_command(d.serve_command))
        assert plan.fits, (name, d.serve_command, plan.chosen.problem)


def _write_log(tmp_path: Path, args: dict, *errors: str) -> Path:
    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer pid=1) INFO 11-30 10:00:01 [api_utils.py:347] vLLM API server version 0.32.0\n"
        f"(APIServer pid=1) INFO 11-30 10:00:02 [api_utils.py:286] non-default args: {args!r}\n"
        + "".join(f"(EngineCore pid=2) ERROR 11-30 10:00:09 [core.py:1010] {e}\n" for e in errors))
    return log


def _labelled_line(text: str, label: str) -> str:
    """The `fix:`/`run:` command of a text report, its backslash continuations joined."""
    lines = text.splitlines()
    i = next(n for n, x in enumerate(lines) if x.strip().startswith(f"{label}:"))
    out = lines[i].split(f"{label}:", 1)[1].strip()
    while out.endswith("\\"):
        i += 1
        out = out[:-1].rstrip() + " " + lines[i].strip()
    return out


def test_no_kv_memory_fix_the_planner_refuses_is_never_shown(tmp_path):
    """Qwen3-8B at utilization 0.50 on a 24 GB card: the log's "+0.05" fix still leaves the
    40,960-token request without room; the doctor shows a fix the planner fits instead, and
    the one it refused only as the reason it was not taken."""
    log = _write_log(tmp_path, {"model": "Qwen/Qwen3-8B", "max_model_len": 40960,
                                "gpu_memory_utilization": 0.5},
                     "ValueError: No available memory for the cache blocks. Try increasing "
                     "`gpu_memory_utilization` when initializing the engine.")
    ctx = dpc.context_from_model("qwen3-8b", "1xL4", Pins(), {}, parse_gpus("1xL4"))
    d = doctor.diagnose(str(log), ctx)[0].root
    assert d.fix_args != ["--gpu-memory-utilization", "0.55"]
    assert any("0.55" in x and "does not fit" in x for x in d.explain)
    r = CliRunner().invoke(cli, ["doctor", str(log), "qwen3-8b", "--gpus", "1xL4"])
    fix, run = _labelled_line(r.output, "fix"), _labelled_line(r.output, "or")
    flags = fix.split()
    for i, flag in enumerate(flags):  # every fix flag, with its value, in the vllm command
        if flag.startswith("--"):
            value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") \
                else None
            assert (f"{flag} {value}" if value else flag) in run, (fix, run)


def test_max_len_fix_never_offers_more_kv_bytes_than_the_log_had(tmp_path):
    log = _write_log(tmp_path, {"model": "Qwen/Qwen3-8B", "max_model_len": 40960},
                     "ValueError: To serve at least one request with the model's max seq len "
                     "(40960), (5.62 GiB KV cache is needed, which is larger than the available "
                     "KV cache memory (4.32 GiB). Based on the available memory, the estimated "
                     "maximum model length is 31488. Try increasing `gpu_memory_utilization`")
    report = vlf.scan_source(str(log))[0]
    dlf.apply_log_fixes(report)
    d = report.root
    assert d.fix_args == ["--max-model-len", "31488"]
    assert not any("--kv-cache-memory-bytes" in x for x in d.explain)


# --- the command ----------------------------------------------------------------------------------


def test_cli_json_shape_and_exit_codes(tmp_path: Path):
    runner = CliRunner()
    r = runner.invoke(cli, ["doctor", str(FIXTURES / "ranks8_oom_tp8.log"), "--format", "json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    (d,) = doc["diagnoses"]
    assert set(d) >= {"cause", "phase", "consumer", "ranks", "evidence", "fix_args", "explain"}
    assert (d["cause"], d["ranks"], d["fix_args"]) == ("cuda_oom", 8, ["--max-num-batched-tokens", "8192"])
    clean = tmp_path / "ok.log"
    clean.write_text("(APIServer pid=1) INFO 11-30 10:00:00 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000\n")
    r = runner.invoke(cli, ["doctor", str(clean)])
    assert r.exit_code == 0 and "no failure found" in r.output


def test_cli_reads_stdin_and_a_folder(tmp_path: Path):
    runner = CliRunner()
    text = (FIXTURES / "kv_short_v032_cpu.log").read_text()
    r = runner.invoke(cli, ["doctor", "-"], input=text)
    assert r.exit_code == 1 and "kv_cache_too_small" in r.output and "fix: --max-model-len 2864" in r.output
    (tmp_path / "notes.txt").write_text("nothing to see\n")
    (tmp_path / "vllm-attempt1.log").write_text(text)
    r = runner.invoke(cli, ["doctor", str(tmp_path), "--format", "json"])
    doc = json.loads(r.output)
    assert doc["sources"] == [str(tmp_path / "vllm-attempt1.log")]
    assert doc["diagnoses"][0]["cause"] == "kv_cache_too_small"


def test_cli_with_a_plan_file(tmp_path: Path, h200_ctx):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(h200_ctx.plan.to_dict()))
    r = CliRunner().invoke(cli, ["doctor", str(FIXTURES / "ranks8_kv_short_dp8.log"), "--plan", str(plan), "--format", "json"])
    d = json.loads(r.output)["diagnoses"][0]
    assert d["fix_args"] == ["--max-model-len", "90880"]
    assert d["serve_command"].startswith("vlaunch serve deepseek-ai/DeepSeek-V3 --gpus 1x8xH200")


@pytest.mark.parametrize("args,message", [
    (["/no/such/log"], "no such log"),
    (["EMPTY"], "is empty"),
    (["DIR"], "no vLLM logs in"),
    (["LOG", "deepseek-v3", "--plan", "p.json"], "either --plan or MODEL"),
    (["LOG", "--gpus", "8xH200"], "describe a MODEL"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str):
    empty = tmp_path / "empty.log"
    empty.write_text("")
    folder = tmp_path / "d"
    folder.mkdir()
    subs = {"EMPTY": str(empty), "DIR": str(folder), "LOG": str(FIXTURES / "nccl_error.log")}
    r = CliRunner().invoke(cli, ["doctor", *[subs.get(a, a) for a in args]])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("vlaunch: error:")


def test_unreadable_log_is_an_input_error(tmp_path: Path, monkeypatch):
    log = tmp_path / "vllm.log"
    log.write_text("ValueError: No available memory for the cache blocks.\n")

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(InputError, match="cannot read"):
        vlf.scan_source(str(log))


# --- serve's retries use the same classifier (issue 12, item 5) ----------------------------------


def test_serve_never_retries_a_deterministic_failure_with_the_same_flags(h200_ctx):
    from launcher.run.serve import next_attempt

    failure = vllmlog.classify_failure((FIXTURES / "ranks8_kv_short_dp8.log").read_text())
    pins, plan = h200_ctx.pins, h200_ctx.plan
    new_pins, extra, why, same = next_attempt(pins, plan, failure, [], False)
    assert (new_pins.max_model_len, extra, same) == (90880, [], False)
    # the re-planned pins are what already failed: stop, whatever the transient budget
    assert next_attempt(new_pins, plan, failure, [], False) is None
    # a user's own --max-model-len was what failed: dropping it changes the flags
    step = next_attempt(new_pins, plan, failure, ["--max-model-len", "163840"], False)
    assert step is not None and step[1] == [] and step[3] is False
    other = vllmlog.classify_failure((FIXTURES / "missing_module.log").read_text())
    assert other.kind == "OTHER" and next_attempt(pins, plan, other, [], False) is None


def test_serve_retries_a_transient_failure_once_with_the_same_flags(h200_ctx):
    from launcher.run.serve import next_attempt

    pins, plan = h200_ctx.pins, h200_ctx.plan
    for name in ("mem_profiling_v032.log", "nccl_timeout.log"):
        failure = vllmlog.classify_failure((FIXTURES / name).read_text())
        step = next_attempt(pins, plan, failure, ["--seed", "1"], False)
        assert step == (pins, ["--seed", "1"], step[2], True) and "transient" in step[2]
        assert next_attempt(pins, plan, failure, ["--seed", "1"], True) is None


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, inside a function?) for every import of a launcher source file."""
    import ast

    tree = ast.parse(path.read_text())
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level:
                pkg = path.parent.relative_to(Path(doctor.__file__).parents[2]).parts
                base = ".".join(pkg[:len(pkg) - child.level + 1])
                out.append((f"{base}.{child.module}" if child.module else base, inner))
            visit(child, inner)

    visit(tree, False)
    return out


def test_failure_classification_sits_below_run_and_observe():
    """No circle serve -> doctor -> serve or vllmlog -> doctor -> vllmlog, not even through an
    import inside a function: the table imports neither stage, the doctor never imports run,
    and vllmlog reaches the table directly."""
    root = Path(doctor.__file__).parents[1]
    for part in ("vllm_failures", "vllm_rules", "vllm_loglines", "vllm_logfiles"):
        table = _imports(root / "inputs" / f"{part}.py")
        assert all(not m.startswith(("launcher.run", "launcher.observe",
                                    "launcher.predict")) for m, _ in table), part
    for name in ("observe/doctor.py", "observe/doctor_logfix.py", "observe/doctor_plancheck.py",
                 "run/vllmlog.py", "inputs/vllm_failures.py", "inputs/vllm_rules.py",
                 "inputs/vllm_loglines.py", "inputs/vllm_logfiles.py", "predict/search/after_failure.py"):
        found = _imports(root / name)
        assert not [m for m, nested in found if nested], name
    for path in (root / "observe").glob("doctor*.py"):
        assert not [m for m, _ in _imports(path) if m.startswith("launcher.run")], path
    for path in (root / "observe").glob("*.py"):
        assert "launcher.run.serve" not in [m for m, _ in _imports(path)], path
    assert "launcher.observe.doctor" not in [m for m, _ in _imports(root / "run" / "vllmlog.py")]


@pytest.mark.parametrize("name", sorted(n for n, v in EXPECTED.items()
                                         if v[0] in vr.NCCL_SPECIFIC))
def test_nccl_evidence_starts_with_the_line_that_says_why(name):
    """The first evidence line is the WARN/ERROR line that names the failure, never a quoted
    `raise` source line; NCCL's own WARN line beats torch's "NCCL error" summary."""
    d = _diagnose(name).root
    first = d.evidence[0]
    assert "NCCL WARN" in first, d.evidence
    assert not any(e.split("] ", 1)[-1].lstrip().startswith("raise ") for e in d.evidence)
    assert d.explain and all("no vLLM flag fixes it" not in x for x in d.explain)


def test_shared_memory_advice_matches_vlaunchs_own_manifests():
    """The doctor tells a pod to mount a memory emptyDir at /dev/shm "as vlaunch's manifests
    do": each manifest it names must really mount one."""
    import yaml

    root = Path(__file__).parents[1]
    for rel in dlf.SHM_MANIFESTS:
        docs = [d for d in yaml.safe_load_all((root / rel).read_text()) if d]
        text = json.dumps(docs)
        assert '"mountPath": "/dev/shm"' in text, rel
        assert '"medium": "Memory"' in text, rel
    d = _diagnose("nccl_shm_container.log").root
    assert d.ranks == 2 and any("--shm-size" in x for x in d.explain)
    assert any("medium: Memory" in x and "/dev/shm" in x for x in d.explain)
    assert d.numbers["size"] == 9637892 and d.numbers["segment"].startswith("/dev/shm/nccl-")


def test_the_planner_refuses_a_head_size_the_cpu_backend_lacks(tmp_path):
    """A tiny Llama with head size 16 plans on a GPU and is refused on CPU, naming the sizes
    vLLM's CPU attention backend supports; the supported list is the one in vLLM's source."""
    from launcher.inputs.model import load_model
    from launcher.predict.features import capabilities
    from launcher.predict.search.planner import make_plan

    for head_dim in (16, 32, 48, 64, 128):
        cfg = {"model_type": "llama", "hidden_size": 4 * head_dim, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
               "vocab_size": 512, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        spec = load_model(str(tmp_path))
        cpu = make_plan(spec, parse_gpus("cpu"), Pins())
        supported = head_dim in capabilities.CPU_ATTENTION_HEAD_SIZES["gqa"][1]
        assert cpu.fits == supported, (head_dim, cpu.chosen.problem)
        if not supported:
            assert f"head size {head_dim}" in cpu.chosen.problem and "32, 64, 80" in cpu.chosen.problem
        assert make_plan(spec, parse_gpus("1xL4"), Pins()).fits
    src = Path(capabilities.__file__).parents[2]  # the vLLM source, when installed here
    import importlib.util

    spec_v = importlib.util.find_spec("vllm")
    if spec_v and spec_v.origin:
        text = (Path(spec_v.origin).parent / "v1/attention/backends/cpu_attn.py").read_text()
        listed = text.split("def get_supported_head_sizes", 1)[1].split("return", 1)[1]
        assert listed.split("]")[0].strip(" [") == ", ".join(
            map(str, capabilities.CPU_ATTENTION_HEAD_SIZES["gqa"][1]))
    assert src.exists()


def test_only_regular_vllm_logs_are_read(tmp_path: Path):
    """/dev/zero never ends and a FIFO blocks: both are refused before a byte is read; a file
    that is not a vLLM log (random bytes, an os-release) gets the folder scan's rule: exit 2,
    one line, never "no failure found"."""
    import os
    import random

    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    noise = tmp_path / "noise.log"
    noise.write_bytes(random.Random(7).randbytes(200_000).replace(b"vllm", b"xxxx"))
    release = tmp_path / "os-release"
    release.write_text('NAME="Debian GNU/Linux"\nVERSION_ID="12"\nID=debian\n')
    for path, message in ((Path("/dev/zero"), "not a regular file"), (fifo, "not a regular file"),
                          (noise, "not a vLLM log"), (release, "not a vLLM log")):
        r = CliRunner().invoke(cli, ["doctor", str(path)])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and message in lines[0], r.output
    r = CliRunner().invoke(cli, ["doctor", "-"], input=release.read_text())
    assert r.exit_code == 2 and "not a vLLM log" in r.output


def test_a_log_bigger_than_the_cap_is_read_from_its_tail(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(vlf, "MAX_BYTES", 4096)
    log = tmp_path / "vllm.log"
    head = (FIXTURES / "kv_short_v032_cpu.log").read_text()
    filler = "(APIServer pid=1) INFO 11-30 10:00:00 [x.py:1] vllm says hello\n" * 500
    log.write_text(head + filler + (FIXTURES / "nccl_socket_closed.log").read_text())
    report = vlf.scan_source(str(log))[0]
    assert report.lines < 200 and report.root.cause == "nccl_socket"


def test_evidence_escapes_control_characters_and_hides_secrets(tmp_path: Path):
    evil = "\x1b]0;owned\x07\x1b[2J"
    log = _write_log(tmp_path, {"model": "qwen3-8b", "api_key": "sk-live-123",
                                "hf_token": "hf_abc", "max_model_len": 40960},
                     f"ValueError: No available memory for the cache blocks.{evil} "
                     "args: {'api_key': 'sk-live-123'}")
    for fmt in ("text", "json"):
        r = CliRunner().invoke(cli, ["doctor", str(log), "--format", fmt])
        assert r.exit_code == 1, r.output
        assert "\x1b" not in r.output and "\x07" not in r.output
        assert "sk-live-123" not in r.output and "hf_abc" not in r.output
    r = CliRunner().invoke(cli, ["doctor", str(log)])
    assert "\\x1b]0;owned\\x07" in r.output
    run = _labelled_line(r.output, "run")
    assert '--api-key "$VLLM_API_KEY"' in run and '--hf-token "$HF_TOKEN"' in run


@pytest.mark.parametrize("seed", range(6))
def test_skipping_to_the_last_launch_changes_nothing(tmp_path: Path, seed: int):
    """A file is read from its last launch (what a restart resets to); the report must equal
    the one a line-by-line scan of the whole text gives, lines and launches included, for any
    order of appended start-ups in one file; split over a folder, each file is its own report."""
    import random

    logs = sorted(FIXTURES.glob("*.log"))
    rng = random.Random(seed)
    picked = [rng.choice(logs).read_text() for _ in range(rng.randint(1, 12))]
    text = "".join(picked)
    whole = vf.scan_text(text)
    one = tmp_path / "one" / "vllm.log"
    one.parent.mkdir()
    one.write_text(text)
    folder = tmp_path / "many"
    folder.mkdir()
    for i, part in enumerate(picked):
        p = folder / f"vllm-{i:02d}.log"
        p.write_text(part)
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    got = vlf.scan_source(str(one))[0]
    assert (got.lines, got.launches, got.phase) == (whole.lines, whole.launches, whole.phase)
    assert [d.to_dict() for d in got.diagnoses] == [d.to_dict() for d in whole.diagnoses]
    # a folder: every log diagnosed on its own, newest first
    logs = vlf.read_logs(str(folder))
    assert [name for name, _ in logs] == [str(folder / f"vllm-{i:02d}.log")
                                          for i in reversed(range(len(picked)))]
    for (_, got), part in zip(logs, reversed(picked), strict=True):
        alone = vf.scan_text(part)
        assert (got.lines, got.launches, got.phase) == (alone.lines, alone.launches, alone.phase)
        assert [d.to_dict() for d in got.diagnoses] == [d.to_dict() for d in alone.diagnoses]


def test_every_rule_match_holds_one_of_its_keys():
    """The keys that let a line skip a rule's pattern must never hide a match: every fixture
    line any rule's pattern matches holds one of that rule's keys."""
    assert set(vr.RULE_KEYS) == {r.cause for r in vr.RULES}
    for path in FIXTURES.glob("*.log"):
        for line in path.read_text().splitlines():
            content = vll.split_line(0, line).content
            for rule in vr.RULES:
                if rule.pattern.search(content):
                    assert any(k in content for k in vr.RULE_KEYS[rule.cause]), (rule.cause, line)


def test_a_kv_size_alternative_is_offered_only_when_the_planner_fits_it(tmp_path):
    """A pinned-KV launch that ran out of context: the log-only explanation offers the KV
    bytes the asked context needs; with the model and GPUs known that offer survives only if
    the planner fits it (40 GiB of KV next to Qwen3-8B's weights on a 24 GB L4 does not)."""
    log = _write_log(tmp_path, {"model": "Qwen/Qwen3-8B", "max_model_len": 40960,
                                "kv_cache_memory_bytes": 2 << 30},
                     "ValueError: To serve at least one request with the model's max seq len "
                     "(40960), (40.00 GiB KV cache is needed, which is larger than the available "
                     "KV cache memory (2.00 GiB). Based on the available memory, the estimated "
                     "maximum model length is 2048. Try increasing `gpu_memory_utilization`")
    report = vlf.scan_source(str(log))[0]
    dlf.apply_log_fixes(report)
    assert any("--kv-cache-memory-bytes" in x and "if the device" in x for x in report.root.explain)
    for gpus, fits in (("1xL4", False), ("1xH200", True)):
        ctx = dpc.context_from_model("qwen3-8b", gpus, Pins(), {}, parse_gpus(gpus))
        d = doctor.diagnose(str(log), ctx)[0].root
        offers = [x for x in d.explain if "--kv-cache-memory-bytes" in x]
        assert offers and all(("does not fit" in x) != fits for x in offers), (gpus, offers)


def test_reading_a_log_never_reaches_the_hub(tmp_path, monkeypatch):
    """The model a log names is looked up on this machine only (folder, profile, HF cache):
    a Hub id it has nowhere is no planner check, and no network call is tried."""
    from launcher.inputs import hub

    real = hub.fetch

    def no_network(*a, **k):  # the real fetch refuses offline; online it would download
        assert hub.offline(), "the doctor let a Hub look-up go online"
        return real(*a, **k)

    monkeypatch.setattr(hub, "fetch", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    log = _write_log(tmp_path, {"model": "nobody/nothing-here", "max_model_len": 4096},
                     "ValueError: Free memory on device cuda:0 (30.00/79.19 GiB) on startup is "
                     "less than desired GPU memory utilization (0.9, 71.27 GiB). Decrease GPU "
                     "memory utilization or reduce GPU memory used by other processes.")
    d = doctor.diagnose(str(log))[0].root
    assert d.cause == "free_memory_below_utilization"
    assert any("not checked by vlaunch's planner" in x for x in d.explain)
    assert "HF_HUB_OFFLINE" not in os.environ  # restored


_NCCL_HOST = re.compile(r"^([\w.-]+):(\d+):\d+ \[(\d+)\] (NCCL WARN .*)$")
# How NCCL's own "host:pid:tid [dev] NCCL WARN ..." reaches a log: bare (NCCL's stderr), through
# vLLM's logger at WARNING or INFO with its worker prefix (vllm/logger.py; the "[nccl]" source
# and NCCL's own "file:line" in front), through an older worker prefix, or under kubectl's time.
_NCCL_WRAPPINGS = (
    lambda host, pid, dev, msg: f"{host}:{pid}:900 [{dev}] {msg}",
    lambda host, pid, dev, msg: (f"(VllmWorker rank={dev} pid={pid}) WARNING 05-01 14:00:16 "
                                 f"[nccl] include/shm.h:28 {msg}"),
    lambda host, pid, dev, msg: (f"(Worker_TP{dev} pid={pid}) INFO 05-01 14:00:16 [nccl] "
                                 f"{host}:{pid}:900 [{dev}] {msg}"),
    lambda host, pid, dev, msg: (f"2026-05-01T14:00:16.123456789Z (Worker_TP{dev} pid={pid}) "
                                 f"WARNING 05-01 14:00:16 [pynccl.py:98] {msg}"),
    lambda host, pid, dev, msg: f"(RayWorkerWrapper pid={pid}, ip=10.0.0.{dev}) {msg}",
)


@pytest.mark.parametrize("name", sorted(n for n, v in EXPECTED.items()
                                         if v[0] in vr.NCCL_SPECIFIC))
@pytest.mark.parametrize("wrap", range(len(_NCCL_WRAPPINGS)))
def test_nccl_warn_lines_are_read_through_every_prefix(name, wrap):
    """NCCL's WARN line names the cause whatever carries it into the log: a line relayed by
    vLLM's logger at WARNING is no less the root cause than NCCL's bare stderr (the doctor once
    skipped it as a quiet level and said NCCL "printed no line naming why")."""
    lines = []
    for raw in (FIXTURES / name).read_text().splitlines():
        m = _NCCL_HOST.match(raw)
        lines.append(_NCCL_WRAPPINGS[wrap](*m.groups()) if m else raw)
    report = vf.scan_text("\n".join(lines) + "\n")
    assert report.root.cause == EXPECTED[name][0], lines
    assert "NCCL WARN" in report.root.evidence[0]


def test_nccl_shm_warn_without_a_size_still_names_dev_shm():
    """The issue's own wording, cut after the segment: still /dev/shm, not a generic NCCL error."""
    text = ("(APIServer pid=1) INFO 05-01 14:00:01 [api_utils.py:347] vLLM API server version "
            "0.32.0\n(VllmWorker rank=5 pid=733) WARNING 05-01 14:00:16 [nccl] include/shm.h:28 "
            "NCCL WARN Error: failed to extend /dev/shm/nccl-x1\n(VllmWorker rank=5 pid=733) "
            "ERROR 05-01 14:00:17 [multiproc_executor.py:953] RuntimeError: NCCL error: "
            "unhandled system error\n")
    d = vf.scan_text(text).root
    assert d.cause == "nccl_shared_memory" and d.numbers["segment"] == "/dev/shm/nccl-x1"


_P = "(APIServer pid=1) INFO 05-01 14:00:01 [launcher.py:380] "
_E = "(EngineCore pid=9) INFO 05-01 14:00:04 [core.py:134] "
_W = "(Worker_TP0 pid=30) INFO 05-01 14:00:09 [gpu_model_runner.py:5040] "


@pytest.mark.parametrize("line,version,model", [
    (_P + "vLLM server version 0.32.0, serving model Qwen/Qwen3-8B", "0.32.0", "Qwen/Qwen3-8B"),
    (_P + "vLLM API server version 0.11.0", "0.11.0", None),
    (_P + " ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.20.1", "0.20.1", None),
    (_E + "Initializing a V1 LLM engine (v0.32.0) with config: model='/models/tiny', "
     "speculative_config=None", "0.32.0", "/models/tiny"),
    ("INFO 07-11 06:23:05 llm_engine.py:237] Initializing an LLM engine (v0.6.3.post1) with "
     "config: model='meta-llama/Llama-3.1-8B', speculative_config=None", "0.6.3.post1",
     "meta-llama/Llama-3.1-8B"),
    (_W + "Starting to load model deepseek-ai/DeepSeek-V3...", None, "deepseek-ai/DeepSeek-V3"),
])
def test_version_and_model_come_from_every_line_that_names_them(line, version, model):
    """The report's vllm_version and model from whichever line names them, with or without
    a "non-default args" line after (the version line comes just before it)."""
    fail = "(EngineCore pid=9) ERROR 05-01 14:00:20 [core.py:1] ValueError: No available " \
           "memory for the cache blocks."
    args = _P + "non-default args: {'max_model_len': 4096}\n"
    orders = [line + "\n", args + line + "\n"]
    if "Starting to load" not in line:  # the API server's and engine's lines come before
        orders.append(line + "\n" + args)
    for text in orders:
        report = vf.scan_text(text + fail + "\n")
        d = report.to_dict()
        assert d["vllm_version"] == version, text
        assert d["model"] == ({"name": model} if model else None), text


def test_the_version_line_before_the_last_launch_is_kept(tmp_path):
    """A file that holds two launches is read from the last; the version its API server printed
    on the line before "non-default args" belongs to it (it once came out null)."""
    one = (_P + "vLLM server version 0.31.0, serving model m\n" + _P
           + "non-default args: {'model': 'm'}\n(EngineCore pid=9) ERROR 05-01 14:00:20 "
           "[core.py:1] ValueError: No available memory for the cache blocks.\n")
    log = tmp_path / "two.log"
    log.write_text(one + one.replace("0.31.0", "0.32.0"))
    report = vlf.scan_source(str(log))[0]
    assert report.launches == 2 and report.facts.version == "0.32.0"
    assert vf.scan_text(log.read_text()).facts.version == "0.32.0"


def test_a_file_that_is_not_a_log_exits_2_whatever_its_name(tmp_path: Path):
    """README.md names vLLM and quotes its log lines, and is no log: exit 2 with one line, as
    a file named .log with the same text, the project's own README and a Python source
    (never "no failure found"). Every fixture still reads as a log, under any name."""
    root = Path(__file__).resolve().parent.parent
    prose = ("# Serving with vLLM\n\nStart vLLM and read its log. A failed start prints, for "
             "example:\n\n    (EngineCore pid=1) ERROR 05-20 10:04:12 [core.py:1] ValueError: "
             "No available memory for the cache blocks.\n\nwhich means the KV cache got nothing."
             "\nRaise the utilization or use more GPUs.\nSee the vLLM docs for details.\n")
    cases = [root / "README.md", root / "launcher" / "run" / "serve.py"]
    for name in ("README.md", "notes.log", "vllm.txt"):
        (tmp_path / name).write_text(prose)
        cases.append(tmp_path / name)
    for path in cases:
        if not path.exists():
            continue
        r = CliRunner().invoke(cli, ["doctor", str(path)])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and "not a vLLM log" in lines[0], path
    r = CliRunner().invoke(cli, ["doctor", "-"], input=prose)
    assert r.exit_code == 2 and "not a vLLM log" in r.output
    for fixture in FIXTURES.glob("*.log"):
        renamed = tmp_path / (fixture.stem + ".md")
        renamed.write_text(fixture.read_text())
        assert vlf.scan_source(str(renamed))[0].lines > 0, fixture.name


def test_a_folder_gives_every_logs_diagnosis_newest_first(tmp_path: Path):
    """Each log of a folder is diagnosed on its own, the newest first; a file there that is no
    vLLM log (notes, a README) is left out."""
    names = ["kv_short_v032_cpu.log", "nccl_shm_container.log", "port_in_use_uvicorn.log"]
    for i, name in enumerate(names):
        p = tmp_path / f"attempt{i}.log"
        p.write_text((FIXTURES / name).read_text())
        os.utime(p, (2_000 - i, 2_000 - i))  # attempt0 is the newest
    (tmp_path / "README.txt").write_text("vLLM logs of last night's runs.\nAsk Sam.\n")
    r = CliRunner().invoke(cli, ["doctor", str(tmp_path)])
    assert r.exit_code == 1
    heads = [x for x in r.output.splitlines() if x.startswith("vlaunch doctor: ")]
    assert [h.split()[2] for h in heads] == [str(tmp_path / f"attempt{i}.log") for i in range(3)]
    causes = [x.split()[2] for x in r.output.splitlines() if x.startswith("root cause: ")]
    assert causes == ["kv_cache_too_small", "nccl_shared_memory", "port_in_use"]


def test_stdin_past_its_cap_says_so_and_exits_2(monkeypatch):
    """A pipe cannot be read from its tail: more than the cap is one line that says how to pass
    it, exit 2, never a diagnosis of its first part ("no failure found")."""
    monkeypatch.setattr(vlf, "MAX_BYTES", 4096)
    text = (FIXTURES / "kv_short_v032_cpu.log").read_text()
    filler = "(APIServer pid=1) INFO 11-30 10:00:00 [x.py:1] vllm says hello\n" * 200
    r = CliRunner().invoke(cli, ["doctor", "-"], input=filler + text)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "more than" in lines[0], r.output
    one_line = "x" * 10_000  # one endless line counts too
    r = CliRunner().invoke(cli, ["doctor", "-"], input=one_line)
    assert r.exit_code == 2 and "more than" in r.output
    r = CliRunner().invoke(cli, ["doctor", "-"], input=text[:4000])
    assert r.exit_code in (0, 1), r.output


# --- the printed fix pastes as it is (issue 30, item 1) ------------------------------------------

_LOG_HEAD = ("(APIServer pid=1) INFO 11-30 10:00:01 [api_utils.py:327] vLLM server version "
             "0.32.0, serving model {model}\n(APIServer pid=1) INFO 11-30 10:00:02 "
             "[api_utils.py:286] non-default args: {args!r}\n")
_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.21 GiB is free.")
_PASTE_CASES = [  # (log args, error, MODEL, --gpus): the issue's own cases and a few more
    ({"model": "meta-llama/Llama-3.1-8B-Instruct"}, "ValueError: Free memory on device cuda:0 "
     "(30.12/79.19 GiB) on startup is less than desired GPU memory utilization (0.92, 72.85 "
     "GiB).", "llama-3.1-8b", "1xH100"),
    ({"model": "Qwen/Qwen3-8B", "gpu_memory_utilization": 0.5}, "ValueError: No available "
     "memory for the cache blocks.", "qwen3-8b", "1x32GiB"),
    ({"model": "Qwen/Qwen3-8B", "max_model_len": 40960, "kv_cache_dtype": "fp8"},
     "ValueError: No valid attention backend found for cuda with kv_cache_dtype=fp8: "
     "kv_cache_dtype not supported", "qwen3-8b", "1xL4"),
    ({"model": "meta-llama/Llama-3.1-70B-Instruct", "tensor_parallel_size": 2}, _OOM,
     "llama-3.1-70b", "8xH100"),
    ({"model": "deepseek-ai/DeepSeek-V3", "tensor_parallel_size": 8}, _OOM, "deepseek-v3",
     "8xH100"),
]


def _vllm_launch_log(tmp_path: Path, words: list[str]) -> Path:
    """A `vllm serve MODEL FLAGS` command read back as the launch it would be: its flags as the
    "non-default args" vLLM would log for it (what the doctor plans a launch from)."""
    assert words[:2] == ["vllm", "serve"] and not words[2].startswith("--"), words
    args: dict = {"model": words[2]}
    i = 3
    while i < len(words):
        key = words[i][2:].replace("-", "_")
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            raw = words[i + 1]
            args[key] = int(raw) if raw.isdigit() else (
                float(raw) if raw.replace(".", "", 1).isdigit() else raw)
            i += 2
        else:
            args[key] = True
            i += 1
    log = tmp_path / "relaunch.log"
    log.write_text(_LOG_HEAD.format(model=words[2], args=args))
    return log


def _flags(words: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else None
            out[w] = nxt if nxt is not None and not nxt.startswith("--") else None
    return out


@pytest.mark.parametrize("case", range(len(_PASTE_CASES)))
def test_the_printed_fix_pastes_and_replans_to_a_plan_that_fits(case, tmp_path: Path):
    """Parse the printed `fix:`, `run:` and `or:` lines as a user would paste them: the
    vlaunch command plans (exit 0, FITS) to exactly the decisions it pins; the vllm serve
    command, read back as a launch (its flags as vLLM's non-default args), plans to a fit at
    the same settings; every fix flag is in both, with its value. Where nothing fits these
    GPUs, no command is shown and the plan's alternatives are (never a layout beyond them)."""
    import shlex

    args, error, model, gpus = _PASTE_CASES[case]
    log = tmp_path / "vllm.log"
    log.write_text(_LOG_HEAD.format(model=args["model"], args=args)
                   + "(Worker_TP0 pid=3) INFO 11-30 10:00:05 [gpu_model_runner.py:5040] "
                   f"Starting to load model {args['model']}...\n"
                   f"(Worker_TP0 pid=3) ERROR 11-30 10:00:09 [core.py:1010] {error}\n")
    out = CliRunner().invoke(cli, ["doctor", str(log), model, "--gpus", gpus]).output
    if "  fix: " not in out:
        assert "  run: " not in out and "what would fit" in out, out
        assert "--tensor-parallel-size 16" not in out
        return
    fix = _flags(shlex.split(_labelled_line(out, "fix")))
    run = shlex.split(_labelled_line(out, "run"))
    vllm = [w for w in shlex.split(_labelled_line(out, "or")) if "=" not in w or w.startswith("-")]
    # the vlaunch command, pasted with `plan` for `serve`, plans to what it pins
    assert run[:2] == ["vlaunch", "serve"]
    r = CliRunner().invoke(cli, ["plan", *run[2:], "--format", "json"])
    assert r.exit_code == 0, (run, r.output)
    d = json.loads(r.output)
    pinned = _flags(run)
    assert d["fits"], run
    got = {"--tp": d["parallel"]["tp"], "--pp": d["parallel"]["pp"], "--dp": d["parallel"]["dp"],
           "--max-model-len": d["max_model_len"], "--kv-cache-dtype": d["kv_cache"]["dtype"],
           "--max-num-seqs": d["max_num_seqs"],
           "--max-num-batched-tokens": d["max_num_batched_tokens"],
           "--gpu-memory-utilization": f"{d['gpu_memory_utilization']:.2f}"}
    for flag, value in got.items():
        if flag in pinned:
            assert str(value) == pinned[flag], (flag, value, run)
    # the vllm serve command, read back as a launch, plans to a fit
    again = doctor.diagnose(str(_vllm_launch_log(tmp_path, vllm)),
                            dpc.context_from_model(model, gpus, Pins(), {}, parse_gpus(gpus)))
    assert again[0].diagnoses == []  # no failure in it: it is a launch, not a log of one
    relaunch = vlf.scan_source(str(_vllm_launch_log(tmp_path, vllm)))[0]
    ctx = dpc.context_from_model(model, gpus, Pins(), {}, parse_gpus(gpus))
    plan = make_plan(ctx.spec, ctx.hardware, dpc.launch_pins(ctx, relaunch.facts))
    assert plan.fits, (vllm, plan.chosen.problem)
    # fix: and both run: commands agree
    for flag, value in fix.items():
        assert flag in _flags(vllm) and _flags(vllm)[flag] == value, (flag, vllm)
        mine = dlf._VLAUNCH_PINS.get(flag, flag)
        if flag == "--enable-expert-parallel":
            mine = "--expert-parallel"
        assert mine in pinned and pinned[mine] == value, (flag, run)
