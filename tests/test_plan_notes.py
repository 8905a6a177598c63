"""The plan's notes are data (launcher/deployment/notes.py): every `Performance.notes`,
`Autoscaling.notes` and `Alternative.why_not` is a Reason whose code is one of its field's closed
set, whose data carries every figure its text quotes, and whose text is that code's renderer's
output of the data; and the figures in the data are the plan's own (the runner-up's knee, the
chosen plan's, the pools' hand-off, the replica bounds), so a script that reads the data and a
person who reads the text are told the same numbers.

Swept over models x GPUs x objectives x replica asks, and the split plans of a few models."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from launcher.deployment import notes as N
from launcher.deployment import plan as P
from launcher.deployment.codec import dump, load
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.capacity import startup_time
from launcher.predict.capacity.autoscaling import HPA_MAX_WINDOW_S, Knee, ScalingAsk, derive
from launcher.predict.search import pd_pools
from launcher.predict.search.planner import Pins, make_plan

VERSION = "0.32.0"
MODELS = ("llama-3.1-8b", "deepseek-r1", "qwen3-8b", "llama-3.1-70b", "deepseek-v2-lite",
          "r1-distill-qwen-14b")
GPUS = ("1xH100", "8xH200", "4xA100-80GB", "8xMI300X", "2xL40S", "cpu", "4x80GiB")
"""4x80GiB: a card known by its size alone has no speed facts (runner-ups ranked by memory)."""
OBJECTIVES = ("balanced", "throughput", "latency")
ASKS = (ScalingAsk(), ScalingAsk(users=300), ScalingAsk(max_replicas=4),
        ScalingAsk(rps=2.5, spare=1), ScalingAsk(min_replicas=2, max_replicas=3))
NO_LOAD = (0, 2, 4)
"""The asks without --users/--rps: a GPU with no speed facts has no knee to size a load by."""
CASES = [(m, g, o, NO_LOAD[i % 3] if g == "4x80GiB" else i % len(ASKS)) for i, (m, g, o) in
         enumerate(itertools.product(MODELS, GPUS, OBJECTIVES))]
SPLITS = [("llama-3.1-8b", "8xH100", 0), ("deepseek-r1", "2x8xH200", 1),
          ("llama-3.1-70b", "8xH200", 2)]


@functools.cache
def _plan(model: str, gpus: str, objective: str, ask: int) -> P.Deployment:
    return make_plan(load_model(model), parse_gpus(gpus), Pins(vllm_version=VERSION),
                     suggest=False, objective=objective, scaling=ASKS[ask]).deployment()


@functools.cache
def _split(model: str, gpus: str, ask: int) -> P.Deployment:
    return pd_pools.plan_deployment(load_model(model), parse_gpus(gpus),
                                    Pins(vllm_version=VERSION), mode="on",
                                    workload=Workload(2048, 256), slo=SLO(5000, 100),
                                    scaling=ASKS[ask]).deployment


def _notes(d: P.Deployment) -> Iterator[tuple[frozenset[str], P.Reason]]:
    """(the codes its field allows, the note) of every note and verdict in the plan."""
    perfs = [d.performance, *(p.performance for p in d.pools),
             *(a.performance for a in d.runners_up)]
    for perf in perfs:
        for n in perf.notes if perf is not None else ():
            yield N.PERFORMANCE_CODES, n
    for pool in d.pools:
        for n in pool.autoscaling.notes if pool.autoscaling is not None else ():
            yield N.AUTOSCALING_CODES, n
    for a in d.runners_up:
        yield N.RUNNER_UP_CODES, a.why_not


def _values(data: Any) -> Iterator[Any]:
    if isinstance(data, Mapping):
        for v in data.values():
            yield from _values(v)
    elif isinstance(data, (list, tuple)):
        for v in data:
            yield from _values(v)
    else:
        yield data


NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?%?")
SCALES = (1.0, 1e-6)
"""A figure is quoted as it is, or bytes as MB (the hand-off)."""


def _quoted(token: str, data: Mapping[str, Any]) -> bool:
    """Whether a number the text shows is one of the data's figures at the text's precision,
    or is part of a word the data holds (a date, a label)."""
    values = list(_values(data))
    if any(isinstance(v, str) and token in v for v in values):
        return True
    pct = token.endswith("%")
    digits = token.rstrip("%")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        for scale in SCALES:
            x = v * scale
            shown = ({f"{x:.{decimals}%}"} if pct else
                     {f"{x:,.{decimals}f}", f"{x:.{decimals}f}", f"{x:g}"})
            if token in shown:
                return True
    return False


def _check(d: P.Deployment) -> int:
    seen = 0
    for codes, n in _notes(d):
        assert isinstance(n, P.Reason), n
        assert n.code in codes, (n.code, sorted(codes))
        assert n.text == N.render(n.code, n.data), n  # the text is the renderer's, of the data
        json.dumps(dict(n.data))  # numbers and names: JSON values
        missing = [t for t in NUMBER.findall(n.text) if not _quoted(t, n.data)]
        assert not missing, (n.code, n.text, dict(n.data), missing)
        seen += 1
    j = json.loads(json.dumps(dump(d)))
    assert load(j) == d  # the notes round-trip as {code, text, data}
    for a in j["alternatives"]:
        assert set(a["why_not"]) == {"code", "text", "data"}
    return seen


def test_the_codes_are_one_closed_set_split_by_field():
    sets = (N.PERFORMANCE_CODES, N.AUTOSCALING_CODES, N.RUNNER_UP_CODES)
    assert set().union(*sets) == set(N.RENDERERS)
    assert sum(map(len, sets)) == len(N.RENDERERS)  # no code belongs to two fields
    for code in N.RENDERERS:
        assert all(part.replace("_", "").isalnum() for part in code.split(".")), code
    with pytest.raises(ValueError, match="no renderer"):
        N.note("runner_up.faster")


@pytest.mark.parametrize("model,gpus,objective,ask", CASES)
def test_every_note_of_a_plan_is_its_codes_rendering_of_its_figures(model, gpus, objective, ask):
    d = _plan(model, gpus, objective, ask)
    _check(d)
    for a in d.runners_up:  # the verdict's figures are the two plans' own
        w = a.why_not
        if w.code == "runner_up.does_not_fit":
            assert not a.fits and w.data["problem"] and a.performance is None
            continue
        assert a.fits
        if w.code == "runner_up.shorter_context":
            assert w.data["max_model_len"] < w.data["chosen_max_model_len"]
            assert w.data["chosen_max_model_len"] == d.engine.max_model_len
        elif w.code == "runner_up.no_prediction":
            assert a.performance is None and d.performance is None
            assert w.data["concurrent_sequences"] == a.max_concurrency
        else:
            assert w.code == "runner_up.slower" and w.data["objective"] == d.objective
            for got, perf in ((w.data, a.performance), (w.data["chosen"], d.performance)):
                assert got["single_tpot_ms"] == perf.single_request.tpot_ms
                if objective != "latency" and perf.knee is not None:
                    assert got["output_tokens_per_s"] == perf.knee.output_tokens_per_s
                    assert got["concurrency"] == perf.knee.concurrency
                else:
                    assert got["output_tokens_per_s"] is None


@pytest.mark.parametrize("model,gpus,objective,ask", CASES)
def test_an_autoscaling_note_says_the_bounds_the_pool_has(model, gpus, objective, ask):
    d = _plan(model, gpus, objective, ask)
    a, want = d.pool.autoscaling, ASKS[ask]
    if a is None:  # nothing to scale on: no fit, or no knee (no speed facts, SLO out of reach)
        assert not d.fits or d.performance is None or d.performance.knee is None
        return
    first = a.notes[0]
    if want.users is not None or want.rps is not None:
        assert first.code == "replicas.for_load"
        assert first.data["replicas"] == a.max_replicas  # no --max-replicas: the load's count
        assert first.data["load"] == (want.users if want.users is not None else want.rps)
        assert first.data["spare"] == want.spare and first.data["headroom"] == want.headroom
    elif want.max_replicas is not None:
        assert first.code == "replicas.max_replicas"
        assert (first.data["min_replicas"], first.data["max_replicas"]) == \
            (a.min_replicas, a.max_replicas)
    else:
        assert first.code == "replicas.at_minimum"
        assert first.data["min_replicas"] == a.min_replicas == a.max_replicas
    capped = [n for n in a.notes if n.code == "windows.capped"]
    assert bool(capped) == (a.startup_s > HPA_MAX_WINDOW_S)


@pytest.mark.parametrize("model,gpus,ask", SPLITS)
def test_a_splits_notes_carry_its_pools_figures(model, gpus, ask):
    d = _split(model, gpus, ask)
    assert _check(d) >= 3
    pre, dec = d.pools
    rate = d.performance.notes[0]
    assert rate.code == "disaggregated.rate_matched"
    units = rate.data["units"]
    assert units * rate.data["prefill_replicas"] == pre.replicas
    assert units * rate.data["decode_replicas"] == dec.replicas
    assert rate.data["bytes_per_gpu"] == pre.transfer.bytes_per_gpu
    assert rate.data["path"] == pre.transfer.path
    assert rate.data["transfer_ms"] == round(pre.transfer.seconds * 1e3, 2)
    hand = [n for n in d.performance.notes if n.code == "disaggregated.handshake"]
    assert bool(hand) == bool(pre.transfer.handshake_s)
    assert all(n.data["connector"] == pre.transfer.connector for n in hand)
    assert [n.code for n in pre.performance.notes] == ["pool.prefill_rate"]
    assert [n.code for n in dec.performance.notes] == ["pool.decode_rate"]
    for pool in d.pools:
        if ASKS[ask] == ScalingAsk():  # no bounds asked: each pool stays rate-matched
            why = pool.autoscaling.notes[0]
            assert why.code == "replicas.rate_matched"
            assert why.data["replicas"] == pool.replicas == pool.autoscaling.max_replicas


def test_a_start_up_past_the_hpas_window_says_the_windows_are_capped():
    knee = Knee(34, 2.652, 678.9, 305.0, 2.641)
    for seconds in (55.0, 3599.0, 3600.4, 3601.0, 7200.0, 12_345.6):
        st = startup_time.Startup(seconds, {"all": seconds}, "local", "model")
        a = derive(knee, ttft_slo_ms=2000.0, single_ttft_ms=120.0, dp=1,
                   kv_tokens_per_engine=524_304, block_size=16, input_len=1024,
                   output_len=256, startup=st, ask=ScalingAsk())
        capped = [n for n in a.notes if n.code == "windows.capped"]
        # the scale-down window is max(ceil(start-up), 300 s): capped once past 3,600 s
        assert bool(capped) == (seconds > HPA_MAX_WINDOW_S), seconds
        for n in capped:
            assert n.data == {"startup_s": a.startup_s, "max_window_s": HPA_MAX_WINDOW_S}
            assert n.text == N.render(n.code, n.data)
            assert a.scale_down_stabilization_s == HPA_MAX_WINDOW_S


def test_a_loaded_plans_notes_render_from_their_data_alone():
    """A plan read back from JSON words its notes from the data it carries (a hand edit of a
    figure shows in the re-rendered text, not in the stale one)."""
    d = _plan("llama-3.1-8b", "8xH200", "balanced", 1)
    j = json.loads(json.dumps(dump(d)))
    a = j["alternatives"][0]["why_not"]
    assert a["code"] == "runner_up.slower"
    a["data"]["chosen"]["output_tokens_per_s"] = 1.0
    back = load(j).runners_up[0].why_not
    assert N.render(back.code, back.data).endswith("chosen: 1 output tok/s")
    assert not back.text.endswith("chosen: 1 output tok/s")
    assert dataclasses.replace(back, text=N.render(back.code, back.data)) != \
        d.runners_up[0].why_not


def test_a_calibrated_plan_says_so_in_data_and_in_its_reasons(tmp_path, monkeypatch):
    """`vlaunch tune`'s points for one engine: a plan for that engine, and one for another
    layout that borrows its scales, each carry one `performance.calibrated` note with the
    points, the scope and the fit error; the same Reason is among the plan's reasons."""
    from launcher.predict.search.engine_from_plan import shape_from_plan
    from launcher.predict.speed import calibration
    from launcher.predict.speed import request_model as perf
    from launcher.render import plan_text

    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path))
    spec, hw = load_model("llama-3.1-8b"), parse_gpus("8xH100")
    pins = Pins(vllm_version=VERSION, tp=1, pp=1, kv_cache_dtype="auto")
    d = make_plan(spec, hw, pins).deployment()
    w = Workload(d.workload.input_len, d.workload.output_len, synchronized=True)
    a = make_plan(spec, hw, pins).performance
    slow = dataclasses.replace(a.shape, constants=perf.scaled(
        perf.DEFAULT, perf.Calibration(2.0, 1.3, 0, 0)))
    pts = [{"concurrency": c, "input_len": w.input_len, "output_len": w.output_len,
            "output_tokens_per_s": perf.point(slow, w, c).output_tokens_per_s,
            "tpot_ms": perf.point(slow, w, c).tpot_ms} for c in (4, 32, 256)]
    calibration.record(d, pts, "test", shape_from_plan(d))
    for plan_pins, scope in ((pins, "engine"), (dataclasses.replace(pins, tp=2), "layout")):
        got = make_plan(spec, hw, plan_pins).deployment()
        assert _check(got)
        cal = [n for n in got.performance.notes if n.code == "performance.calibrated"]
        assert len(cal) == 1 and cal[0] in got.reasons
        assert cal[0].data["points"] == 3 and cal[0].data["scope"] == scope
        assert 0 <= cal[0].data["median_error"] < 1
        assert plan_text(got).count(cal[0].text) == 1  # under `why`, not again under performance


def test_the_text_says_the_notes_the_figures_do_not():
    """`vlaunch plan` prints a pool's bounds' why when a load or --max-replicas set them (and a
    capped window), not the default's `stays at its minimum`; a split's rate match once, under
    its performance; a runner-up's verdict as its Reason's text."""
    from launcher.render import plan_text

    plain = _plan("llama-3.1-8b", "8xH200", "balanced", 0)
    loaded = _plan("llama-3.1-8b", "8xH200", "balanced", 1)
    assert plain.pool.autoscaling.notes[0].text not in plan_text(plain)
    why = loaded.pool.autoscaling.notes[0]
    assert why.code == "replicas.for_load" and f"\n    {why.text}\n" in plan_text(loaded)
    for d in (plain, loaded):
        text = plan_text(d)
        assert all(f": {a.why_not.text}\n" in text for a in d.runners_up if a.fits)
    split = _split("llama-3.1-8b", "8xH100", 0)
    text = plan_text(split)
    for n in split.performance.notes:
        assert text.count(n.text) == 1, n.code
    for pool in split.pools:  # rate-matched bounds: said by `min-max replicas` alone
        assert pool.autoscaling.notes[0].text not in text
