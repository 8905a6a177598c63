"""vLLM's measured KV memory (its startup plan) as ground truth for the next plan."""

from __future__ import annotations

import json

import pytest

from launcher.inputs.hardware import parse_gpus
from launcher.inputs.model import load_model
from launcher.predict.memory import measured_kv as measured
from launcher.predict.search.planner import Pins, make_plan
from launcher.run import vllmlog
from launcher.run.serve import learn_measured_kv

LOG = """\
(EngineCore pid=1) INFO 11-29 10:00:00 [startup_plan.py:190] Saved startup plan to {p0}
(Worker_TP1 pid=2) INFO 11-29 10:00:00 [startup_plan.py:190] Saved startup plan to {p1}
"""


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _plan():
    return make_plan(load_model("deepseek-v3"), parse_gpus("8xH200"),
                     Pins(vllm_version="0.32.0", tp=8))


def test_log_names_the_startup_plan_files():
    a = vllmlog.parse_allocation(LOG.format(p0="/c/startup_plan_aa.json", p1="/c/b.json") +
                                 "Applying persisted startup plan (fingerprint ab12): "
                                 "kv_cache_memory_bytes=123456 (0.00 GiB), recorded")
    assert a.startup_plan_paths == ["/c/b.json", "/c/startup_plan_aa.json"]
    assert a.startup_plan_applied_bytes == 123456


def test_measured_bytes_replace_the_estimate_next_time(cache):
    first = _plan()
    d = first.deployment()
    # two ranks wrote their measurements; every rank is set to the smallest (20 GiB here)
    files = []
    for i, gib in enumerate((21, 20)):
        f = cache / f"startup_plan_{i}.json"
        f.write_text(json.dumps({"schema": 1, "fingerprint": str(i),
                                 "kv_cache_memory_bytes": gib << 30,
                                 "free_memory_baseline": 140 << 30}))
        files.append(str(f))
    alloc = vllmlog.parse_allocation(LOG.format(p0=files[0], p1=files[1]))
    assert learn_measured_kv(d, alloc)
    second = _plan()
    c = second.chosen
    page = c.block_size * c.kv_bytes_per_token  # 64 tokens x 35,136 B (fp8 MLA, 61 layers)
    assert c.kv_memory == (20 << 30) // page * page
    assert c.tokens == c.blocks * c.block_size
    assert any("measured by vLLM" in r.text for r in second.reasons)
    # a different decision (another context) is another key: the estimate is used again
    other = make_plan(load_model("deepseek-v3"), parse_gpus("8xH200"),
                      Pins(vllm_version="0.32.0", tp=8, max_model_len=65536))
    assert not any("measured by vLLM" in r.text for r in other.reasons)


def test_nothing_recorded_without_startup_plan():
    assert learn_measured_kv(_plan().deployment(),
                             vllmlog.parse_allocation("no such lines")) is None
    assert measured.read_startup_plans(["/nonexistent.json"]) is None
