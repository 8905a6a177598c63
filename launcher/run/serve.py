"""`vlaunch serve`: plan, start vLLM, check what it allocated, recover, keep serving.

The loop: plan -> start vLLM on the plan's arguments (a user's own flags after `--` win, and
are reported) -> wait for /health and /v1/models -> compare what vLLM logged with the plan ->
one short completion. A start-up that dies of vLLM's KV shortage, CUDA OOM or its free-memory
check is re-planned from what the failed attempt measured (a shorter context, a lower
utilization) and retried, up to `max_attempts`. A smoke request that fails on fp8 KV is a lesson
recorded in the capability cache, and the engine restarts with auto KV. The exporter serves
planned and actual numbers side by side for as long as vLLM runs.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..inputs.hardware import Hardware
from ..inputs.model import ModelSpec
from ..predict.budget import GiB
from ..predict.capabilities import lesson_key, record_lesson
from ..predict.planner import Pins, Plan, make_plan
from ..render import plan_text
from . import vllmlog
from .runner import VllmRunner, arg_value, free_port, prefixed_echo

STARTUP_SECONDS_BASE = 300
STARTUP_BYTES_PER_SECOND = 200 * (1 << 20)
"""Start-up deadline: 5 minutes plus the weights at 200 MiB/s (a slow network volume); a
DeepSeek-V3 FP8 load is given about an hour. A hang past it is a failure, not a wait."""


def merge_args(planned: list[str], extra: list[str]) -> tuple[list[str], list[str]]:
    """The plan's vLLM args with the user's extra args on top: a user's flag replaces the plan's
    flag of the same name. Returns (args, one note per overridden flag)."""
    def flags(args: list[str]) -> list[tuple[str, list[str]]]:
        out: list[tuple[str, list[str]]] = []
        for a in args:
            if a.startswith("--"):
                name, eq, value = a.partition("=")
                out.append((name, [value] if eq else []))
            elif out:
                out[-1][1].append(a)
        return out

    mine = flags(extra)
    names = {n for n, _ in mine}
    notes, merged = [], []
    for name, values in flags(planned):
        if name in names:
            user = next(v for n, v in mine if n == name)
            notes.append(f"{name} {' '.join(user)} (yours) replaces the plan's "
                         f"{' '.join(values) or 'on'}")
            continue
        merged += [name, *values]
    for name, values in mine:
        merged += [name, *values]
    return merged, notes


@dataclass
class Attempt:
    number: int
    args: list[str]
    outcome: str
    detail: str = ""


@dataclass
class ServeResult:
    exit_code: int
    attempts: list[Attempt] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    actual: dict[str, Any] | None = None


def replan_pins(pins: Pins, plan: Plan, failure: vllmlog.Failure) -> tuple[Pins, str] | None:
    """New pins from what a failed start-up measured; None when retrying cannot help."""
    c = plan.chosen
    if failure.kind == "KV_SHORTAGE":
        if failure.estimated_max_model_len:
            length = failure.estimated_max_model_len
        elif failure.available_kv_gib:
            length = int(failure.available_kv_gib * GiB // c.kv_bytes_per_token)
        else:
            length = c.max_model_len // 2
        length = max(c.block_size, length // c.block_size * c.block_size)
        return (dataclasses.replace(pins, max_model_len=length),
                f"vLLM had KV cache for fewer tokens than max-model-len; retrying with "
                f"--max-model-len {length:,} (what its measured KV memory holds)")
    if failure.kind == "INSUFFICIENT_FREE_MEMORY" and failure.free_gib and failure.total_gib:
        u = int((failure.free_gib / failure.total_gib - 0.01) * 100) / 100
        return (dataclasses.replace(pins, gpu_memory_utilization=max(0.05, u)),
                f"only {failure.free_gib:.2f} GiB was free; retrying with "
                f"--gpu-memory-utilization {u:.2f}")
    if failure.kind in ("DEVICE_OOM", "NO_KV_MEMORY"):
        u = round(c.utilization - 0.05, 2)
        if u <= 0.1 and not plan.hardware.is_cpu:
            return None
        tokens = max(512, c.max_num_batched_tokens // 2)
        return (dataclasses.replace(pins, gpu_memory_utilization=u if not plan.hardware.is_cpu
                                    else pins.gpu_memory_utilization,
                                    max_num_batched_tokens=tokens),
                f"out of memory at start-up; retrying with utilization {u:.2f} and "
                f"--max-num-batched-tokens {tokens}")
    return None


def next_attempt(pins: Pins, plan: Plan, failure: vllmlog.Failure | None, extra: list[str],
                 transient_retried: bool) -> tuple[Pins, list[str], str, bool] | None:
    """(pins, extra vLLM flags, why, same flags?) for the start after `failure`; None to stop.

    A deterministic failure is retried only with changed flags, re-planned from what the failed
    start measured; a transient one (`failure.transient`: memory changed during profiling, an
    NCCL timeout) may be retried once with the same flags. Both per issue 12, item 5.
    """
    if failure is None:
        return None
    fix = replan_pins(pins, plan, failure)
    if fix is not None:
        new_pins, why = fix
        new_extra = _drop_flag(extra, "--max-model-len") if new_pins.max_model_len else extra
        if (new_pins, new_extra) != (pins, extra):
            return new_pins, new_extra, why, False
    if failure.transient and not transient_retried:
        return pins, extra, (f"{failure.cause or failure.kind} is transient; retrying once "
                             "with the same flags"), True
    return None


def verification_table(plan: dict[str, Any], actual: Any) -> tuple[list[str], dict[str, Any]]:
    """Predicted vs actual per component, with the error; and the numbers as a dict."""
    kv, per_gpu = plan["kv_cache"], plan["per_gpu"]
    alloc = actual.allocation
    rows = [("KV cache tokens", kv["tokens"], actual.kv_cache_tokens, "{:,.0f}"),
            ("KV blocks", kv.get("blocks"), actual.num_blocks, "{:,.0f}"),
            ("block size", kv["block_size"], actual.block_size, "{:,.0f}"),
            ("KV cache memory GiB", kv["memory_bytes"] / GiB,
             (actual.kv_cache_memory_bytes / GiB) if actual.kv_cache_memory_bytes
             else alloc.available_kv_gib, "{:,.2f}"),
            ("weights GiB (per GPU)", per_gpu["weights_bytes"] / GiB, alloc.weights_gib,
             "{:,.2f}"),
            ("max concurrency", plan["max_concurrency"], actual.max_concurrency, "{:,.2f}")]
    lines = [f"  {'':24} {'planned':>14} {'actual':>14} {'error':>8}"]
    numbers: dict[str, Any] = {}
    for name, want, got, fmt in rows:
        err = ""
        if want is not None and got is not None and want:
            err = f"{(got - want) / want:+.1%}"
        show = (lambda v, f=fmt: f.format(v) if v is not None else "-")  # noqa: E731
        lines.append(f"  {name:24} {show(want):>14} {show(got):>14} {err:>8}")
        numbers[name] = {"planned": want, "actual": got}
    return lines, numbers


def serve(spec: ModelSpec, hw: Hardware, pins: Pins, extra: list[str], *,
          max_attempts: int = 3, quiet: bool = False, verbose: bool = False,
          dry_run: bool = False, metrics_port: int | None = 9400,
          metrics_bind: str = "127.0.0.1", log_dir: Path | None = None,
          goals: dict[str, Any] | None = None,
          startup_timeout: float | None = None, port: int | None = None,
          out: Callable[[str], None] = print,
          plan_hook: Callable[[Plan], Plan] | None = None) -> ServeResult:
    """Run the whole loop; returns when vLLM exits (or start-up finally failed)."""
    result = ServeResult(exit_code=1)
    extra = list(extra)
    original = pins
    exporter = None
    say = (lambda s: None) if quiet else out  # noqa: E731
    # One API port for every attempt, so the exporter (up from the start, showing
    # vlaunch_engine_up 0 while a long load runs) always scrapes the right place.
    user_port = arg_value(extra, "--port")
    api_port = int(user_port) if user_port else (port or free_port())
    transient_retried = False
    for number in range(1, max_attempts + 1):
        plan = make_plan(spec, hw, pins, **(goals or {}))
        if plan_hook:
            plan = plan_hook(plan)
        d = plan.to_dict()
        result.plan = d
        if number == 1:
            say(plan_text(d))
        if not plan.fits:
            out("vlaunch: the plan does not fit; not starting vLLM (see 'what would fit')")
            result.exit_code = 3
            return result
        args, notes = merge_args(d["vllm_args"], extra)
        if "--port" not in args:
            args += ["--port", str(api_port)]
        for n in notes:
            out(f"vlaunch: {n}")
        env = dict(d["env"])
        if d["kv_cache"].get("pinned"):
            # A legacy VLLM_CPU_KVCACHE_SPACE in our environment would replace the pinned bytes.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if dry_run:
            runner = VllmRunner(args, env=env)
            out(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " "
                + " ".join(shlex.quote(a) for a in runner.argv))
            result.exit_code = 0
            return result
        deadline = startup_timeout or (STARTUP_SECONDS_BASE
                                       + d["model"]["weights_bytes"] / STARTUP_BYTES_PER_SECOND)
        log_path = (log_dir or Path.cwd()) / f"vllm-attempt{number}.log"
        started = time.monotonic()
        phases: list[str] = []

        def on_phase(phase: str, started: float = started, phases: list[str] = phases) -> None:
            phases.append(phase)
            if not quiet:
                out(f"  [{time.monotonic() - started:6.1f}s] {phase}")

        runner = VllmRunner(args, env=env, log_path=log_path, on_phase=on_phase,
                            echo=prefixed_echo() if verbose else None,
                            startup_timeout=deadline)
        if metrics_port is not None and exporter is None:
            exporter = _start_exporter(runner.base_url, d, metrics_port, metrics_bind, out)
        elif exporter is not None:
            exporter.plan = d
            exporter.record_restart()
        say(f"vlaunch: attempt {number}/{max_attempts}: starting vLLM (log: {log_path})")
        with runner, runner.forward_signals():
            runner.start()
            outcome = runner.wait_ready()
            if not outcome.ready:
                failure = outcome.failure
                detail = (failure.message if failure
                          else f"{outcome.reason} (rc {outcome.returncode})")
                result.attempts.append(Attempt(number, args, "failed", detail))
                out(f"vlaunch: attempt {number} failed: {detail}")
                if outcome.reason == "interrupted":
                    result.exit_code = outcome.returncode or 130
                    return result
                step = next_attempt(pins, plan, failure, extra, transient_retried)
                if step is None or number == max_attempts:
                    break
                pins, extra, why, same_flags = step
                transient_retried = transient_retried or same_flags
                out(f"vlaunch: re-planning: {why}")
                continue
            actual = runner.read_actual()
            lines, numbers = verification_table(d, actual)
            say("vlaunch: vLLM is ready; planned vs actual:")
            for line in lines:
                say(line)
            result.actual = {"numbers": numbers, **actual.to_dict()}
            learnt = learn_measured_kv(d, actual.allocation)
            if learnt:
                say(f"vlaunch: recorded vLLM's measured KV memory for the next plan ({learnt})")
            smoke = runner.smoke_test()
            if not smoke.ok:
                kv = d["kv_cache"]["dtype"]
                result.attempts.append(Attempt(number, args, "smoke failed", smoke.error or ""))
                out(f"vlaunch: the smoke request failed: {smoke.error}")
                if kv.startswith("fp8") and number < max_attempts:
                    key = lesson_key(hw, spec.attention, plan.vllm_version)
                    path = record_lesson(key, False, f"fp8 KV allocated, then the first "
                                         f"request failed ({(smoke.error or '')[:160]})")
                    out(f"vlaunch: fp8 KV does not work here; recorded in {path}; "
                        "restarting with --kv-cache-dtype auto")
                    # A context shortened for fp8's capacity is re-planned for the new dtype.
                    pins = dataclasses.replace(pins, kv_cache_dtype="auto",
                                               max_model_len=original.max_model_len)
                    extra = _drop_flag(extra, "--kv-cache-dtype")
                    continue
                break
            result.attempts.append(Attempt(number, args, "serving"))
            say(f"vlaunch: smoke request answered in {smoke.seconds:.2f}s; serving on "
                f"{runner.base_url}")
            if exporter is not None:
                _set_actual(exporter, actual)
            status = runner.wait()
            if runner.unexpected_exit:
                out(f"vlaunch: vLLM exited unexpectedly with status {status}")
            result.exit_code = status if status is not None else 1
            if exporter:
                exporter.stop()
            return result
    out("vlaunch: could not start vLLM: " + "; ".join(
        f"attempt {a.number}: {a.outcome} ({a.detail[:200]})" for a in result.attempts))
    result.exit_code = result.exit_code if result.exit_code not in (0,) else 1
    if exporter:
        exporter.stop()
    return result


def run_node(launch: Any, d: dict[str, Any], *, port: int | None, metrics_port: int | None,
             metrics_bind: str, log_dir: Path, dry_run: bool, verbose: bool,
             startup_timeout: float | None, out: Callable[[str], None] = print) -> int:
    """One node of a multi-node plan (`launcher.run.multinode.NodeLaunch`), supervised.

    The leader is watched like `serve` (ready, planned vs actual, exporter); a headless worker
    only runs until vLLM exits. Re-planning is not attempted: the group must agree on one plan.
    """
    program = ["vllm", "serve"]
    args = launch.argv[len(program):] if launch.argv[:2] == program else launch.argv
    args = ["--model", args[0], *args[1:]] if args and not args[0].startswith("-") else args
    if port and "--port" not in args:
        args += ["--port", str(port)]
    if dry_run:
        for pre in launch.pre_commands:
            out(shlex.join(pre))
        out(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(launch.env.items())) + " "
            + shlex.join(launch.argv))
        return 0
    for pre in launch.pre_commands:  # e.g. `ray start --head`; a failure is the node's failure
        subprocess.run(pre, check=True)
    deadline = startup_timeout or (STARTUP_SECONDS_BASE
                                   + d["model"]["weights_bytes"] / STARTUP_BYTES_PER_SECOND)
    runner = VllmRunner(args, env=launch.env, command=program,
                        log_path=log_dir / f"vllm-{launch.role}{launch.node_rank}.log",
                        echo=prefixed_echo() if verbose else None, startup_timeout=deadline,
                        on_phase=lambda phase: out(f"  {launch.role}: {phase}"))
    exporter = None
    with runner, runner.forward_signals():
        runner.start()
        if launch.serves_api:
            outcome = runner.wait_ready()
            if not outcome.ready:
                why = outcome.failure.message if outcome.failure else outcome.reason
                out(f"vlaunch: {launch.role} failed to start: {why}")
                return outcome.returncode or 1
            actual = runner.read_actual()
            for line in verification_table(d, actual)[0]:
                out(line)
            if metrics_port is not None:
                exporter = _start_exporter(runner.base_url, d, metrics_port, metrics_bind, out)
                if exporter is not None:
                    _set_actual(exporter, actual)
        status = runner.wait()
    if exporter:
        exporter.stop()
    return status if status is not None else 1


def learn_measured_kv(d: dict[str, Any], alloc: vllmlog.Allocation) -> str | None:
    """Record what vLLM measured (its startup-plan files) as ground truth for the next plan."""
    from ..predict import measured

    if d["kv_cache"].get("pinned"):
        return None
    kv = measured.read_startup_plans(alloc.startup_plan_paths) or alloc.startup_plan_applied_bytes
    if not kv:
        return None
    path = measured.record(d, kv, f"vLLM {d['vllm_version']} startup plan")
    return f"{kv / GiB:.2f} GiB in {path}"


def _drop_flag(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip and not a.startswith("--"):
            skip = False
            continue
        skip = False
        if a == name:
            skip = True
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out


def _start_exporter(base_url: str, plan: dict[str, Any], port: int, bind: str,
                    out: Callable[[str], None]):
    from ..observe.exporter import Exporter

    exp = Exporter(vllm_url=base_url, plan=plan)
    try:
        bound = exp.start(port=port, bind=bind)
    except Exception as e:  # a busy port must not take the engine down
        out(f"vlaunch: metrics exporter not started: {e}")
        return None
    out(f"vlaunch: metrics on http://{bind}:{bound}/metrics (vLLM's own at {base_url}/metrics)")
    sys.stdout.flush()
    return exp


def _set_actual(exp: Any, actual: Any) -> None:
    """Hand the exporter what vLLM reported at start-up."""
    alloc = actual.allocation
    exp.set_actual(kv_tokens=actual.kv_cache_tokens, kv_memory_bytes=actual.kv_cache_memory_bytes,
                   weights_bytes=int(alloc.weights_gib * GiB) if alloc.weights_gib else None,
                   num_blocks=actual.num_blocks, block_size=actual.block_size)
