"""Parameter counts from config.json against published checkpoint counts.

The corpus (`shared/validation/corpus/<org>--<name>/`) holds 24 unedited config.json files and a
truth.json per model; its README says what each number includes. The truth used here:

- `total_size_bytes / 2` when an index total is given (gemma-2-9b-it, medgemma-27b-it,
  Devstral-Small-2507: all-BF16 checkpoints, so bytes / 2 = stored elements; medgemma's
  `total_parameters` line would count its tied lm_head twice);
- otherwise `num_params`: stored elements of a tensor dump (FP8 scale tensors and MTP layers
  included, as `budget.param_count` counts them) or a KerasHub logical count (gpt-oss: one per
  FP4 value, no MXFP4 scales; also what param_count gives for mxfp4).

Tolerance 0.5%: what is left is stored buffers that are not weights (Llama-2 and Kimi-K2
rotary inv_freq tables).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.inputs.model import ModelSpec, load_model
from launcher.predict.memory.budget import param_count

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "validation" / "corpus"
TOLERANCE = 0.005


def _dirs() -> list[Path]:
    if not CORPUS.is_dir():
        return []
    return sorted(p for p in CORPUS.iterdir() if (p / "truth.json").is_file())


def _truth(folder: Path, spec: ModelSpec) -> int:
    t = json.loads((folder / "truth.json").read_text())
    if t.get("total_size_bytes"):
        assert spec.dtype_bytes == 2, "total_size/2 is an element count only for 2-byte dtypes"
        return int(t["total_size_bytes"]) // 2
    return int(t["num_params"])


def _candidates(spec: ModelSpec) -> list[int]:
    """Predicted counts to accept.

    A tied model (no lm_head tensor) may or may not store the tied matrix a second time, and
    the config cannot say which: Qwen3-0.6B stores lm_head.weight, Qwen2.5-3B and Gemma do not.
    The library counts it once; the test also accepts one more vocab x hidden matrix.
    """
    predicted = param_count(spec)
    if any(t.name == "lm_head" for t in spec.tensors):
        return [predicted]
    return [predicted, predicted + spec.vocab_size * spec.hidden_size]


def _row(folder: Path) -> tuple[str, int, int, float, str]:
    spec = load_model(str(folder))
    truth = _truth(folder, spec)
    candidates = _candidates(spec)
    best = min(candidates, key=lambda p: abs(p - truth))
    note = "+ tied lm_head copy" if best != candidates[0] else ""
    return spec.architecture, best, truth, (best - truth) / truth, note


@pytest.mark.parametrize("folder", _dirs() or [None], ids=lambda p: p.name if p else "absent")
def test_param_count_matches_checkpoint(folder: Path | None) -> None:
    if folder is None:
        pytest.skip(f"validation corpus not found at {CORPUS}")
    arch, predicted, truth, err, _ = _row(folder)
    assert abs(err) <= TOLERANCE, (
        f"{folder.name} ({arch}): predicted {predicted:,} vs truth {truth:,} ({err:+.3%})")


def test_corpus_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Every corpus model is countable; the table is printed straight to the terminal."""
    folders = _dirs()
    if not folders:
        pytest.skip(f"validation corpus not found at {CORPUS}")
    rows = [(f.name, *_row(f)) for f in folders]
    head = ("model", "architecture", "predicted", "truth", "error", "note")
    lines = ["{:<38} {:<13} {:>19} {:>19} {:>8}  {}".format(*head)]
    lines += [f"{name:<38} {arch:<13} {pred:>19,} {truth:>19,} {err:>+8.3%}  {note}"
              for name, arch, pred, truth, err, note in rows]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert len(rows) == len(folders)
    assert max(abs(r[4]) for r in rows) <= TOLERANCE
