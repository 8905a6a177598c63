"""Secrets out of everything vlaunch prints or writes: one function for argv, one for env.

vLLM takes secrets on its command line (`--api-key K [K ...]`, `--hf-token [T]`); vlaunch
echoes commands (`--dry-run`, `tune -v`), records them (tune.json, plan.json) and keeps logs.
Every such place passes the arguments through `redact_args` and the environment through
`redact_env`, so a key never reaches a terminal, a CI log or a file a colleague is sent.

The flag grammar follows vLLM 0.32.0's parser: `--api-key` is `list[str]`
(`vllm/entrypoints/launchers/cli_args.py`, so argparse takes every following value up to the
next option), `--hf-token` is `bool | str` (`vllm/engine/arg_utils.py`: `nargs="?"`, a bare flag
means "the cached login"), `--flag=value` is accepted, and FlexibleArgumentParser treats
`--api_key` as `--api-key` (`vllm/utils/argparse_utils.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from .inputs import vllm_flags as F

REDACTED = "***"
# flag -> the environment variable vLLM reads instead (the safe way to pass it): the flag
# table's secrets (launcher/inputs/vllm_flags.py).
SECRET_FLAGS = {f.name: str(f.secret_env) for f in F.flags() if f.secret}
# Environment names whose values are secrets: HF_TOKEN, VLLM_API_KEY, AWS_SECRET_ACCESS_KEY...
_SECRET_ENV = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|KEY)$", re.I)


def secret_flags(args: Sequence[str]) -> list[str]:
    """The secret-bearing flags present in `args` (canonical names, first-seen order), counting
    the abbreviations argparse accepts (`--api-ke` is `--api-key`)."""
    found: list[str] = []
    for a in args:
        f = F.secret_of(a)
        if f is not None and f.name not in found:
            found.append(f.name)
    return found


def redact_args(args: Sequence[str]) -> list[str]:
    """`args` with the values of --api-key / --hf-token (or any prefix argparse expands to
    one) replaced by ***; the flags stay, so a reader still sees that a key was given. A bare
    `--hf-token` (no value) is left as it is."""
    out: list[str] = []
    following = None  # the secret flag whose values we are in
    for a in args:
        if following is not None and F.takes_value(a):
            out.append(REDACTED)
            if following.kind != F.LIST:  # one value at most
                following = None
            continue
        following = None
        f = F.secret_of(a)
        if f is not None:
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(a)
                following = f
            continue
        out.append(a)
    return out


def redact_text(text: str) -> str:
    """A command line as one string (e.g. a `--candidate` that does not even parse) with the
    secret values hidden; words are split on whitespace, as a reader would."""
    return " ".join(redact_args(text.split()))


def is_secret_env(name: str) -> bool:
    return bool(_SECRET_ENV.search(name))


def redact_env(env: Mapping[str, str | None]) -> dict[str, str | None]:
    """`env` with the values of secret-named variables replaced by *** (None stays None)."""
    return {k: (REDACTED if v and is_secret_env(k) else v) for k, v in env.items()}


def command_line_warning(args: Sequence[str]) -> str | None:
    """A warning for secrets given on vLLM's command line: its argv is readable by every local
    user (`ps`, /proc/PID/cmdline) for as long as it runs. None when there are none."""
    flags = secret_flags(args)
    if not flags:
        return None
    steer = ", ".join(f"{SECRET_FLAGS[f]} instead of {f}" for f in flags)
    return (f"warning: {' and '.join(flags)} on the command line is visible to every local "
            f"user in `ps` while vLLM runs; set {steer} in the environment (vLLM reads it)")
