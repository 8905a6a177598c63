"""MTP acceptance for `vlaunch tune`, measured on natural text in a short run of its own.

Why a separate run per MTP trial, and not the trial's knee points on natural prompts:
- The knee must stay comparable. Every trial (vLLM's defaults, the planner's candidates, MTP on
  or off) is measured on the same seeded random prompts at the workload's input and output
  lengths, which is also what the calibration and the public rows use. vLLM's `custom` dataset
  cannot set an input length (a prompt is as long as it is) and does not force the output
  length, so knee points on it would compare an MTP trial's short natural requests against
  the others' long random ones.
- Acceptance does not need load. At temperature 0 a draft is accepted when it equals the
  target's greedy token, which does not depend on the batch, so a few waves at low
  concurrency measure it; one run over tens of prompts costs well under a knee search.
- The knee points of an MTP trial still report vLLM's acceptance counters; they are kept in the
  trial as `mtp_acceptance_random` (labelled, for comparison) and never recorded for planning.

Only this run's acceptance is recorded (`speculative.record_acceptance`, with its source), so
the next plans for the model use what MTP achieves on natural text. The prompts are the user's
(`--dataset`) or the project's own (`inputs/prompts.py`); tune copies the ones it sends into
its output folder (`acceptance-prompts.jsonl`) and names them in tune.json.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..inputs.prompts import PromptSet, to_jsonl
from ..paths import atomic_write
from ..predict.features.speculative import measured_acceptance
from .loadgen import LoadSpec
from .vllmargs import arg_value

PROMPTS_FILE = "acceptance-prompts.jsonl"

MAX_PROMPTS = 64
"""At most this many prompts per acceptance run (a seeded sample of a larger --dataset)."""

CONCURRENCY = 8
"""Requests in flight during the run: enough to finish tens of prompts in a few waves, low
enough that nothing queues (acceptance does not depend on the batch)."""

OUTPUT_LEN = 256
"""Most answer tokens per request (the workload's output length when shorter): a few hundred
tokens give each prompt thousands of draft positions in all, at a bounded cost."""


def runs_mtp(vllm_args: list[str]) -> bool:
    """Whether a trial's flags turn on a draft (vLLM's `--speculative-config`)."""
    return bool(arg_value(vllm_args, "speculative_config"))


def prepare(prompts: PromptSet, out_dir: Path, seed: int) -> tuple[Path, int]:
    """Write the prompts the acceptance runs send (a seeded sample of at most MAX_PROMPTS, in
    their file order) as vLLM's custom dataset reads them; (path, how many)."""
    chosen = list(prompts.prompts)
    if len(chosen) > MAX_PROMPTS:
        keep = sorted(random.Random(seed).sample(range(len(chosen)), MAX_PROMPTS))
        chosen = [chosen[i] for i in keep]
    path = Path(out_dir) / PROMPTS_FILE
    atomic_write(path, to_jsonl(chosen))
    return path, len(chosen)


def load_spec(base: LoadSpec, path: Path, count: int, output_len: int) -> LoadSpec:
    """The acceptance run on a trial's server: the natural prompts, each once, no SLO."""
    return LoadSpec(base.base_url, base.model, base.tokenizer, 0,
                    max(1, min(output_len, OUTPUT_LEN)), min(CONCURRENCY, count), count,
                    base.seed, None, None, 0, prompts_path=str(path))


def measure(run: Callable[[LoadSpec], dict[str, Any]], spec: LoadSpec,
            prompts: PromptSet) -> dict[str, Any]:
    """Run `spec` and read vLLM's acceptance counters; the trial's `mtp_acceptance` record.

    Without counters (the server exposed no spec-decode metrics) the record says so and holds
    no figures; a caller records only a record with `first`."""
    s = run(spec)
    acc = measured_acceptance(s.get("raw") or {}) or {}
    record: dict[str, Any] = {**acc, "source": prompts.describe(), "prompts": prompts.to_dict(),
                              "requests": s.get("completed", 0),
                              "output_len": spec.output_len, "concurrency": spec.concurrency,
                              "mean_prompt_tokens": s.get("input_len")}
    if "first" not in acc:
        record["error"] = ("vLLM's benchmark reported no per-position speculative-decoding "
                           "counters")
    return record
