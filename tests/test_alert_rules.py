"""deploy/prometheus: the alert rules parse, their promtool unit tests pass, and every alert has
both a firing and a not-firing case (so a rule added without tests fails here)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = PROM_DIR / "alerts.yaml"
RULE_TESTS = PROM_DIR / "alerts_test.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (`make prometheus` installs Debian's)"
)


def _alerts() -> dict[str, dict]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def _promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_alerts_exist_with_severity_and_summary():
    alerts = _alerts()
    assert set(alerts) == {"VlaunchKVCacheNearlyFull", "VlaunchPreemptionsRising",
                           "VlaunchEngineDown", "VlaunchPredictionErrorHigh",
                           "VlaunchGPUMemoryBeyondPlan", "VlaunchLoadAbovePlannedReplicas",
                           "VlaunchTTFTAboveSLO", "VlaunchTPOTAboveSLO"}
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        assert rule["annotations"]["summary"], name
        assert "for" in rule, f"{name} would fire on a single evaluation"


def test_every_alert_has_firing_and_quiet_cases():
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == ["alerts.yaml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert firing >= set(_alerts()), f"no firing case for {set(_alerts()) - firing}"
    assert quiet >= set(_alerts()), f"no quiet case for {set(_alerts()) - quiet}"


@needs_promtool
def test_promtool_check_rules():
    r = _promtool("check", "rules", RULES.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


@needs_promtool
def test_promtool_test_rules():
    r = _promtool("test", "rules", RULE_TESTS.name)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_test_rules_catches_a_broken_threshold(tmp_path):
    # The unit tests must be able to fail: move one threshold and they do.
    (tmp_path / "alerts.yaml").write_text(
        RULES.read_text().replace("(vlaunch_kv_cache_usage_ratio) > 0.9",
                                  "(vlaunch_kv_cache_usage_ratio) > 0.99"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    r = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert r.returncode != 0
    assert "VlaunchKVCacheNearlyFull" in r.stdout + r.stderr


@needs_promtool
def test_sample_scrape_config_is_valid(tmp_path):
    r = _promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_engine_down_rule_tests_cover_a_loading_engine(tmp_path):
    # The rule tests include a 40-minute model load: the old rule (down alone) fires on it and
    # fails them, so "a loading engine does not page" is really tested.
    rules = RULES.read_text()
    new = "(vlaunch_engine_up == 0) unless (vlaunch_engine_starting == 1)"
    assert new in rules
    (tmp_path / "alerts.yaml").write_text(rules.replace(new, "vlaunch_engine_up == 0"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    r = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert r.returncode != 0
    assert "gpu-node-3:9400" in r.stdout + r.stderr  # the loading engine fired


def test_alerts_use_only_metrics_the_exporter_emits():
    from test_dashboard import metric_names, vlaunch_metric_names

    emitted = vlaunch_metric_names()
    for name, rule in _alerts().items():
        for metric in metric_names(rule["expr"]):
            if metric.startswith("vlaunch_"):
                assert metric in emitted, f"{name}: {metric} is not an exporter metric"



@needs_promtool
@pytest.mark.parametrize("old,new,alert", [
    # >= fires on the decode pool whose load is exactly what is up
    ("> count by (role) (vlaunch_replica_capacity_requests)",
     ">= count by (role) (vlaunch_replica_capacity_requests)", "VlaunchLoadAbovePlannedReplicas"),
    # the TPOT SLO (50 ms) in place of the TTFT one: the fast engine's TTFT fires
    ('vlaunch_plan_slo_seconds{quantity="ttft"}', 'vlaunch_plan_slo_seconds{quantity="tpot"}',
     "VlaunchTTFTAboveSLO"),
])
def test_promtool_tests_catch_a_moved_capacity_or_slo_rule(tmp_path, old, new, alert):
    rules = RULES.read_text()
    assert old in rules
    (tmp_path / "alerts.yaml").write_text(rules.replace(old, new))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    r = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert r.returncode != 0
    assert alert in r.stdout + r.stderr
