"""Nothing outside the codec reads a plan by string key (issue 32): every command takes the
typed Deployment (launcher/deployment/plan.py) and only launcher/deployment/codec.py turns
JSON into it. The check is by AST over launcher/: a subscript `x["k"]` or `x.get("k")` whose
key only a plan has (a key of launcher/schemas/plan.json that no other command's JSON uses).

Reads of the same key names that are not a plan's (a metric's `engine` label, the capability
table's rows, calibration points) are listed with why; modules not yet moved to the typed plan
are listed too, and the test fails when one of them no longer needs its entry, so the lists
only shrink."""

from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "launcher" / "schemas"
CODEC = {"launcher/deployment/codec.py", "launcher/deployment/schema.py"}

NOT_A_PLAN = {  # module -> keys it reads from something that is not a plan, and what
    "launcher/observe/vllmpage.py": {"engine"},  # the `engine` label of vLLM's metrics
    "launcher/predict/features/capabilities.py": {"engine", "max_num_batched_tokens"},  # table rows
    "launcher/predict/speed/request_model.py": {"max_num_batched_tokens"},  # a calibration's limits
    "launcher/predict/speed/calibration.py": {"max_num_batched_tokens"},  # the same points
    "launcher/predict/features/serving.py": {"candidates"},  # the MTP table's draft counts
    "launcher/run/tune_candidates.py": {"candidates"},  # the same table
}
NOT_YET_TYPED: dict[str, set[str]] = {}  # module -> plan keys it still reads (none left)


def _schema_keys(node, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "properties" and isinstance(v, dict):
                out |= set(v)
            _schema_keys(v, out)
    elif isinstance(node, list):
        for x in node:
            _schema_keys(x, out)
    return out


def plan_only_keys() -> set[str]:
    plan = json.loads((SCHEMAS / "plan.json").read_text())
    top = set(plan["properties"]) | set(plan["$defs"]["pool_block"]["properties"])
    others: set[str] = set()
    for name in ("capacity", "tune", "doctor", "gpus"):
        _schema_keys(json.loads((SCHEMAS / f"{name}.json").read_text()), others)
    return top - others


def string_key_reads(path: Path, keys: set[str]) -> set[str]:
    """The keys of `keys` that module `path` reads as `x["k"]` or `x.get("k")`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args
              and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if isinstance(key, str) and key in keys:
            found.add(key)
    return found


def test_the_keys_are_the_plans_own():
    keys = plan_only_keys()
    assert {"per_gpu", "reasons", "alternatives", "engine"} <= keys
    # capacity.json has a model, a `fits` per option and a mix's `pools` too: not a plan's alone
    assert not {"model", "fits", "pools"} & keys


def test_the_check_finds_a_plan_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(d):\n    return d['per_gpu']['weights_bytes'] + d.get('reasons')\n")
    assert string_key_reads(bad, plan_only_keys()) == {"per_gpu", "reasons"}


def test_no_module_outside_the_codec_reads_a_plan_by_key():
    keys = plan_only_keys()
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name in CODEC:
            continue
        reads = string_key_reads(path, keys)
        allowed = NOT_A_PLAN.get(name, set()) | NOT_YET_TYPED.get(name, set())
        assert reads <= allowed, f"{name} reads a plan by key: {sorted(reads - allowed)}"
        if name in NOT_YET_TYPED:
            assert NOT_YET_TYPED[name] <= reads, \
                f"{name} no longer reads {sorted(NOT_YET_TYPED[name] - reads)}: shrink the list"
