"""Natural-text prompts for measuring MTP acceptance: the user's (`vlaunch tune --dataset`) or
vlaunch's own.

Why natural text: a draft head is accepted when it guesses the target model's next token, and
random-token prompts make the target's continuation degenerate (repeats, lists of fragments)
that the draft guesses far more often than on real requests, so acceptance measured on them
overstates what MTP buys. The speed-up the planner predicts follows the acceptance it is given.

Format (one, documented in `--dataset`'s help): JSON Lines, one object per line with a
non-empty string field "prompt"; blank lines are skipped and other fields are ignored. It is
the format of vLLM's own `custom` benchmark dataset (vllm/benchmarks/datasets/datasets.py,
CustomDataset.load_data), so a file made for `vllm bench serve --dataset-name custom` works
as is. Checked here, before any engine starts, so a bad file is one line and exit 2 rather than
a failure inside vLLM's benchmark after minutes of start-up.

The built-in set (`natural_prompts.jsonl` beside this module) is original prose written for
this project (Apache-2.0 like the rest): short questions, instructions and story openings over
varied topics, so no single style (code, lists, dialogue) dominates the acceptance.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..paths import read_small

MAX_DATASET_BYTES = 32 * 1024 * 1024
"""Larger files are refused: acceptance needs tens of prompts, and tune reads the whole file
before the first start (a multi-GB dump by mistake would stall it)."""

BUILTIN = Path(__file__).resolve().parent / "natural_prompts.jsonl"

FORMAT = 'JSON Lines with a "prompt" field on each line, e.g. {"prompt": "Explain ..."}'


@dataclass(frozen=True)
class PromptSet:
    """Prompts and where they came from (written into tune.json beside the acceptance)."""

    prompts: tuple[str, ...]
    source: str  # "builtin" or "dataset"
    path: str
    sha256: str

    def describe(self) -> str:
        what = ("vlaunch's built-in natural prompts" if self.source == "builtin"
                else f"your --dataset {self.path}")
        return f"{what} ({len(self.prompts)} prompts)"

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source, "path": self.path, "prompts": len(self.prompts),
                "sha256": self.sha256}


def _parse(text: str, where: str) -> list[str]:
    prompts: list[str] = []
    for n, line in enumerate(text.split("\n"), 1):  # JSON allows U+2028 in strings
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise InputError(f"{where}: line {n} is not JSON; use {FORMAT}") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f"{where}: line {n} has no non-empty string \"prompt\"; use "
                             f"{FORMAT}")
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"{where}: no prompts in it; use {FORMAT}")
    return prompts


def load_prompts(path: str | Path) -> PromptSet:
    """The user's `--dataset` file, checked; InputError (one line, exit 2) when it is missing,
    unreadable, empty, oversized or not in the format."""
    p = Path(path)
    where = f"--dataset {p}"
    if not p.exists():
        raise InputError(f"{where}: no such file")
    if not p.is_file():
        raise InputError(f"{where}: not a file; give a {FORMAT.split(' with')[0]} file")
    try:
        size = p.stat().st_size
        if size > MAX_DATASET_BYTES:
            raise InputError(f"{where}: {size / 2**20:.0f} MiB is more than the "
                             f"{MAX_DATASET_BYTES // 2**20} MiB accepted; tens of prompts "
                             "are enough, give a sample")
        data = read_small(p, MAX_DATASET_BYTES)
        text = data.decode("utf-8")
    except OSError as e:
        raise InputError(f"{where}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise InputError(f"{where}: not UTF-8 text; use {FORMAT}") from None
    return PromptSet(tuple(_parse(text, where)), "dataset", str(p),
                     hashlib.sha256(data).hexdigest())


def builtin_prompts() -> PromptSet:
    """The project's own natural prompts (shipped as package data)."""
    data = BUILTIN.read_bytes()
    return PromptSet(tuple(_parse(data.decode("utf-8"), str(BUILTIN))), "builtin",
                     BUILTIN.name, hashlib.sha256(data).hexdigest())


def to_jsonl(prompts: tuple[str, ...] | list[str]) -> str:
    """The prompts as vLLM's `custom` dataset reads them (one {"prompt": ...} per line)."""
    return "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
