"""What to change after a failed start: new pins from the failure's numbers, and how a user's
flags go over the plan's.

Why in predict: both the serve loop (run) and the doctor (observe) re-plan a failed start, and
neither may import the other; the rule is the planner's (what the measured memory holds), so it
lives beside the planner and each caller asks it directly.
"""

from __future__ import annotations

import dataclasses

from ...inputs import vllm_flags
from ...inputs.vllm_failures import Failure
from ..memory.budget import GiB
from .planner import Pins, Plan


def merge_args(planned: list[str], extra: list[str]) -> tuple[list[str], list[str]]:
    """The plan's vLLM args with the user's extra args on top: a user's flag replaces the plan's
    flag of the same name, whichever spelling vLLM accepts each side uses (the flag table's
    aliases, `--max_model_len`). Returns (args, one note per overridden flag)."""
    def key(name: str) -> str:
        spec = vllm_flags.spec_of(name)
        return spec.dest if spec is not None else vllm_flags.canonical(name)

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
    names = {key(n) for n, _ in mine}
    notes, merged = [], []
    for name, values in flags(planned):
        if key(name) in names:
            user = next(v for n, v in mine if key(n) == key(name))
            notes.append(f"{name} {' '.join(user)} (yours) replaces the plan's "
                         f"{' '.join(values) or 'on'}")
            continue
        merged += [name, *values]
    for name, values in mine:
        merged += [name, *values]
    return merged, notes


def replan_pins(pins: Pins, plan: Plan, failure: Failure) -> tuple[Pins, str] | None:
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
