"""The performance model against published vLLM serving measurements (vendored with their sources
in tests/fixtures/perf): the rows are read, the inexpressible ones say why, and single-request
decode - bytes over bandwidth plus fixed costs - stays close."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import perf_validation  # noqa: E402


@pytest.fixture(scope="module")
def fit():
    return perf_validation.run()


def test_rows_are_read_and_scored(fit):
    results, _ = fit
    assert sum(r.quantity == "tpot_ms" for r in results) >= 8
    assert sum(r.quantity == "output_tok_s" for r in results) >= 8
    assert sum(r.quantity == "mtp_speedup" for r in results) >= 4
    assert all(r.source and "/" in r.source for r in results)


def test_rows_it_cannot_express_say_why(fit):
    _, skipped = fit
    why = dict(skipped)
    assert all(why.values())
    assert any("comparison row" in w for w in why.values())
    assert any("disaggregation" in w for w in why.values())
    assert {"mtp-r1-pr12755-qps1", "mtp-r1-pr12755-qps2"} <= set(why)


def test_single_request_rows_of_dense_models_are_close(fit):
    # Batch-1 decode of a dense model is bytes over bandwidth plus fixed costs: the physics
    # the model rests on, on the V1 engine (Llama-3.1-8B's ITL lines, Qwen3-8B alone).
    results, _ = fit
    c1 = [r for r in results if r.quantity == "tpot_ms"
          and (r.row_id.startswith("dn-") and (r.row_id.endswith("-c1") or "@" in r.row_id))]
    assert len(c1) >= 4 and all(abs(r.error) < 0.2 for r in c1), [(r.row_id, r.error) for r in c1]


def test_mtp_rows_are_speedups_below_tokens_per_step(fit):
    from launcher.predict.speed.mtp import Acceptance

    results, _ = fit
    for r in (r for r in results if r.quantity == "mtp_speedup"):
        k = int(r.row_id.split("-k")[1].split("-")[0])
        assert 0 < r.predicted <= Acceptance().tokens_per_step(k) + 1e-9, r
