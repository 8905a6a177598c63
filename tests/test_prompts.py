"""Natural prompts for MTP acceptance (`launcher.inputs.prompts`, `launcher.run.tune_acceptance`):
the format round-trips, the built-in set is natural text, and tune sends a seeded sample."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest

from launcher.errors import InputError
from launcher.inputs.prompts import builtin_prompts, load_prompts, to_jsonl
from launcher.run import tune_acceptance as A
from launcher.run.loadgen import LoadSpec

ALPHABET = (string.ascii_letters + string.digits
            + " \t\n\"\\{}:,.!?\u00e9\u4e2d\u2028\u2029\U0001f600")


def _random_prompts(rng: random.Random) -> list[str]:
    out = []
    for _ in range(rng.randint(1, 30)):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))
        out.append(text if text.strip() else text + "x")
    return out


@pytest.mark.parametrize("seed", range(20))
def test_any_prompts_round_trip_through_the_file_format(tmp_path: Path, seed: int):
    prompts = _random_prompts(random.Random(seed))
    path = tmp_path / "p.jsonl"
    path.write_text(to_jsonl(prompts), encoding="utf-8")
    loaded = load_prompts(path)
    assert list(loaded.prompts) == prompts
    assert loaded.source == "dataset" and str(path) in loaded.describe()
    # what vLLM's custom dataset reads: one JSON object per '\n'-separated line
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    assert [json.loads(line)["prompt"] for line in lines] == prompts


def test_blank_lines_and_other_fields_are_ignored_bad_lines_are_named(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('\n{"prompt": "a", "output_tokens": 5}\r\n\n{"prompt": "b"}\n')
    assert load_prompts(path).prompts == ("a", "b")
    path.write_text('{"prompt": "a"}\n["prompt"]\n')
    with pytest.raises(InputError, match="line 2"):
        load_prompts(path)


def test_the_built_in_prompts_are_varied_natural_text():
    b = builtin_prompts()
    assert b.source == "builtin" and 20 <= len(b.prompts) <= 40
    assert len(set(b.prompts)) == len(b.prompts)
    for p in b.prompts:
        words = p.split()
        assert len(words) >= 8 and p[-1] in ".?:", p
        # prose: mostly lower-case dictionary-shaped words, not token soup
        assert sum(w.strip(".,:;?!'\"()").isalpha() for w in words) >= 0.8 * len(words), p
    openings = {p.split()[0] for p in b.prompts}
    assert len(openings) >= 10, "too many prompts of one kind"


@pytest.mark.parametrize("n,seed", [(3, 0), (64, 1), (65, 2), (500, 3), (500, 4)])
def test_tune_sends_a_seeded_ordered_sample_of_at_most_max_prompts(tmp_path: Path, n: int,
                                                                    seed: int):
    src = tmp_path / "all.jsonl"
    src.write_text(to_jsonl([f"Prompt number {i} asks something." for i in range(n)]))
    prompts = load_prompts(src)
    path, count = A.prepare(prompts, tmp_path, seed)
    sent = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    assert count == len(sent) == min(n, A.MAX_PROMPTS)
    index = [prompts.prompts.index(p) for p in sent]
    assert index == sorted(set(index)), "a sample keeps the file's order, no repeats"
    (tmp_path / "again").mkdir()
    again, _ = A.prepare(prompts, tmp_path / "again", seed)
    assert [json.loads(line)["prompt"] for line in again.read_text().splitlines()] == sent
    spec = A.load_spec(LoadSpec("http://x", "m", "t", 1024, 4096, 64, 8), path, count, 4096)
    spec.validate()
    assert spec.prompts_path == str(path) and spec.num_prompts == count
    assert spec.output_len == A.OUTPUT_LEN and spec.concurrency == min(A.CONCURRENCY, count)
    assert spec.slo_ttft_ms is None and spec.num_warmups == 0


def test_acceptance_without_counters_is_an_error_not_a_figure():
    prompts = builtin_prompts()
    spec = LoadSpec("http://x", "m", "t", 0, 16, 2, 4, prompts_path="/p.jsonl")
    rec = A.measure(lambda s: {"completed": 4, "raw": {}}, spec, prompts)
    assert "first" not in rec and "error" in rec and "built-in" in rec["source"]
    rec = A.measure(lambda s: {"completed": 4, "raw": {
        "spec_decode_acceptance_length": 1.5,
        "spec_decode_per_position_acceptance_rates": [50.0]}}, spec, prompts)
    assert rec["first"] == 0.5 and "error" not in rec


def test_runs_mtp_reads_the_speculative_config_flag():
    assert A.runs_mtp(["--speculative-config", '{"method": "mtp"}'])
    assert not A.runs_mtp(["--max-num-seqs", "8"])
