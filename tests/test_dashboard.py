"""deploy/grafana/vlaunch-dashboard.json: valid, portable (datasource variable), every panel
queries something, every expression parses (promtool) and names only metrics that exist: vLLM
0.32's (read from the installed vLLM source) or the vlaunch exporter's (read from its collector).

The helpers here (`dashboard_exprs`, `substitute`, `metric_names`) are reused by the live test.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher.observe import exporter as ex

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "vlaunch-dashboard.json"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def query_panels(dash: dict) -> list[dict]:
    """Panels that query data (rows are layout only), including panels nested in rows."""
    out = []
    for p in dash["panels"]:
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def dashboard_exprs(dash: dict | None = None) -> list[tuple[str, str]]:
    """(panel title / refId, PromQL) for every target of every panel."""
    dash = dash or load_dashboard()
    return [(f"{p['title']} / {t['refId']}", t["expr"])
            for p in query_panels(dash) for t in p["targets"]]


def substitute(expr: str, rate_interval: str = "5m") -> str:
    """Grafana's template variables replaced the way 'All' would: regexes match everything."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (a small lexer; PromQL has no Python
    parser): drop strings, label matchers, ranges and grouping clauses, then every identifier
    not followed by '(' and not a keyword is a metric name."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", e):
        if m.group(2) is None and m.group(1).lower() not in _KEYWORDS:
            names.add(m.group(1))
    return names


def vllm_metric_names() -> set[str] | None:
    """Exposed names of vLLM's metrics, from the installed vLLM's source (None if absent)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    metrics_dir = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics"
    suffixes = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    for src in metrics_dir.glob("*.py"):
        text = src.read_text()
        for kind, name in re.findall(r"_(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[^\"]+)\"",
                                     text):
            names.update(name + s for s in suffixes[kind])
        names.update(re.findall(r"name = \"(vllm:[a-z_]+_info)\"", text))
    return names


def vlaunch_metric_names() -> set[str]:
    """Sample names the exporter can emit, from its collector with every source present
    (vLLM pointed at a closed port so the engine families appear without a server)."""
    from launcher.inputs.hardware import parse_gpus
    from launcher.inputs.model import load_model
    from launcher.predict.search.planner import make_plan

    plan = make_plan(load_model("llama-3.1-8b"), parse_gpus("1xH100")).deployment()
    exp = ex.Exporter("http://127.0.0.1:1", plan=plan,
                      gpu_reader=lambda: [], timeout_s=0.2)
    return {f.name + ("_total" if f.type == "counter" else "") for f in exp.collect()}


def test_json_and_variables():
    dash = load_dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "model"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"


def test_no_hard_coded_datasource_uid():
    def walk(node, path="$"):
        if isinstance(node, dict):
            if isinstance(node.get("datasource"), dict):
                assert node["datasource"].get("uid") == "${datasource}", path
            elif "datasource" in node and not isinstance(node["datasource"], dict):
                assert node.get("type") == "datasource", f"{path}: datasource by name"
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(load_dashboard())


def test_every_panel_has_targets_with_expressions():
    panels = query_panels(load_dashboard())
    assert len(panels) >= 10
    ids = [p["id"] for p in load_dashboard()["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_panels_do_not_overlap():
    cells = {}
    for p in load_dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[x, y] = p["title"]


def test_expressions_use_the_template_variables():
    for where, expr in dashboard_exprs():
        assert "${instance}" in expr, where
        if "vllm:" in expr:
            assert '$model' in expr, where


def test_metric_names_exist():
    vllm_names = vllm_metric_names()
    vlaunch_names = vlaunch_metric_names()
    for where, expr in dashboard_exprs():
        for name in metric_names(expr):
            if name.startswith("vlaunch_"):
                assert name in vlaunch_names, f"{where}: {name} is not an exporter metric"
            elif name.startswith("vllm:"):
                if vllm_names is None:
                    pytest.skip("vLLM not installed: cannot check vllm: names against its source")
                assert name in vllm_names, f"{where}: {name} is not a vLLM 0.32 metric"
            else:
                pytest.fail(f"{where}: unexpected metric {name}")


def test_metric_name_lexer():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(vllm:x_bucket{model_name=~"a(b)"}[5m])))'
            ' / on (instance) group_left () vlaunch_y offset 5m > bool 3')
    assert metric_names(expr) == {"vllm:x_bucket", "vlaunch_y"}


def test_required_views_are_there():
    exprs = " ".join(e for _, e in dashboard_exprs())
    for needle in (
        "vlaunch_kv_cache_usage_ratio", "vlaunch_kv_cache_used_tokens",
        'vlaunch_kv_cache_capacity_tokens{instance=~"${instance}:.*", source="planned"}',
        'vlaunch_kv_cache_capacity_tokens{instance=~"${instance}:.*", source="actual"}',
        "vlaunch_prediction_error_ratio", "vlaunch_kv_cache_max_concurrency",
        "vllm:num_requests_running", "vllm:num_requests_waiting",
        "rate(vllm:num_preemptions_total", "vlaunch_gpu_memory_bytes", 'kind="total"',
        "vlaunch_plan_memory_bytes",
    ):
        assert needle in exprs, needle
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert any(e.startswith(f"histogram_quantile({q}, ") and f"vllm:{hist}_bucket" in e
                       for _, e in dashboard_exprs()), (hist, q)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (`make prometheus` installs Debian's)")
def test_expressions_parse_with_promtool(tmp_path):
    # promtool has no bare expression checker in Debian's 2.42, but it parses every rule's expr:
    # each dashboard expression becomes a recording rule.
    rules = [{"record": f"dashboard:expr_{i}", "expr": substitute(expr)}
             for i, (_, expr) in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # and it does reject a broken one, so the check above means something
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "d:x", "expr": "sum by (le (rate(x[5m]))"}]}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
