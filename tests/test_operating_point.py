"""The model's operating point and the plan's: one field list, one conversion.

`request_model.OperatingPoint` inherits `deployment.plan.Point`'s figures (declared once) and
adds what the search reads of the busiest engine; `plan_point()` is the only way a model point
becomes the plan's, at the decimals the plan prints."""

from __future__ import annotations

import dataclasses
import random

from test_perf import toy

from launcher.deployment import plan as D
from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.inputs.workload import SLO, Workload
from launcher.predict.search.planner import Pins, make_plan
from launcher.predict.speed import request_model as perf


def test_the_plans_point_fields_are_declared_once_and_each_has_its_decimals():
    model = {f.name for f in dataclasses.fields(perf.OperatingPoint)}
    plan = [f.name for f in dataclasses.fields(D.Point)]
    assert issubclass(perf.OperatingPoint, D.Point)
    assert model == {*plan, "running", "limit", "bound"}
    assert set(perf._PLAN_DIGITS) == set(plan)  # a new plan figure needs its decimals


def test_plan_point_rounds_every_figure_and_keeps_nothing_else():
    rng = random.Random(5)
    for _ in range(300):
        s = toy(max_num_seqs=rng.choice([8, 64, 256]), kv_tokens=rng.choice([50_000, 10**6]),
                hbm=rng.uniform(0.5e12, 5e12))
        w = Workload(rng.randint(16, 8192), rng.randint(16, 2048))
        p = perf.point(s, w, rng.uniform(1, 600))
        q = p.plan_point()
        assert type(q) is D.Point  # not the model's point: the plan carries no running/limit
        for f, digits in perf._PLAN_DIGITS.items():
            assert getattr(q, f) == round(getattr(p, f), digits)
        assert p.to_dict() == dataclasses.asdict(q)


def test_a_plans_points_are_the_plans_type_and_the_assessments_rounded():
    spec = load_model("llama-3.1-8b")
    plan = make_plan(spec, parse_gpus("1xH100"), Pins(vllm_version="0.32.0"),
                     workload=Workload(1024, 256), slo=SLO())
    a, perf_ = plan.performance, plan.deployment().performance
    assert perf_.knee == a.knee.plan_point() and perf_.single_request == a.single.plan_point()
    assert perf_.curve == tuple(p.plan_point() for p in a.curve)
    points = (perf_.at, perf_.knee, perf_.single_request, *perf_.curve)
    assert all(type(p) is D.Point for p in points)
