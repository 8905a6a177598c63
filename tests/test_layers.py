"""The package's imports run one way: inputs -> deployment -> predict -> run / observe -> cli,
with no circle, not even through an import inside a function (every import statement in a
module counts). `deployment` holds the typed plan every later stage reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "launcher"
STAGES = ("inputs", "deployment", "predict", "run", "observe")
PURE_MODELS = ("memory.budget", "memory.kvcache", "speed.ops", "speed.step", "speed.request_model",
               "speed.mtp", "speed.speed_decisions")
"""Modules of launcher/predict/ that model one thing and must not reach a composer."""
COMPOSERS = ("search.planner", "search.search", "search.rank", "search.alternatives",
             "search.pd_pools", "memory.candidate_memory", "capacity.capacity",
             "features.serving", "features.speculative")
"""Modules of launcher/predict/ that compose models into decisions."""

MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 400
TOO_LONG: dict[str, int] = {
    # module or class (path relative to launcher/, "path:Class") -> lines allowed until it is split;
    # none today
}
"""Today's offenders: an allow-list that may only shrink. Each entry's figure is the most lines
it may have, so an offender cannot grow; remove the entry once the file or class is split."""


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {t for t in names if t in mods and t != m}
    return graph


GRAPH = _graph()


def _cycle_from(start: str) -> list[str] | None:
    path: list[str] = []
    seen: set[str] = set()

    def visit(v: str) -> list[str] | None:
        if v in path:
            return path[path.index(v):] + [v]
        if v in seen:
            return None
        seen.add(v)
        path.append(v)
        for w in sorted(GRAPH[v]):
            found = visit(w)
            if found:
                return found
        path.pop()
        return None

    return visit(start)


def test_the_graph_is_read():
    assert len(GRAPH) > 40 and "launcher.predict.search.planner" in GRAPH
    assert "launcher.predict.memory.budget" in GRAPH["launcher.predict.search.planner"] | {
        t for m in GRAPH["launcher.predict.search.planner"] for t in GRAPH[m]}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_circle(module: str):
    assert _cycle_from(module) is None, " -> ".join(_cycle_from(module) or [])


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _stage(m)))
def test_stages_import_only_earlier_stages(module: str):
    allowed = {"inputs": {"inputs"}, "deployment": {"inputs", "deployment"},
               "predict": {"inputs", "deployment", "predict"},
               "run": {"inputs", "deployment", "predict", "run", "observe"},
               "observe": {"inputs", "deployment", "predict", "observe"}}[_stage(module)]
    bad = sorted(t for t in GRAPH[module] if _stage(t) and _stage(t) not in allowed)
    assert not bad, f"{module} imports {bad}"
    assert "launcher.cli" not in GRAPH[module]


@pytest.mark.parametrize("name", PURE_MODELS)
def test_pure_models_import_no_planner(name: str):
    module = f"launcher.predict.{name}"
    assert module in GRAPH, f"{module} does not exist: update PURE_MODELS"
    reach, todo = set(), [module]
    while todo:
        for t in GRAPH[todo.pop()]:
            if t not in reach:
                reach.add(t)
                todo.append(t)
    bad = sorted(t for t in reach if t.removeprefix("launcher.predict.") in COMPOSERS)
    assert not bad, f"{module} reaches {bad}"


def test_composers_exist():
    """A renamed composer must not silently drop out of the purity check above."""
    missing = [c for c in COMPOSERS if f"launcher.predict.{c}" not in GRAPH]
    assert not missing, f"update COMPOSERS: {missing}"


def _sizes() -> dict[str, int]:
    """Lines of every module of launcher/ ("path") and of every class ("path:Class")."""
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT).as_posix()
        text = p.read_text()
        out[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                out[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


SIZES = _sizes()


def _limit(key: str) -> int:
    return MAX_CLASS_LINES if ":" in key else MAX_MODULE_LINES


def test_sizes_are_read():
    assert SIZES["predict/search/planner.py"] > 100 and SIZES["run/tune.py:Tuner"] > 100
    assert _limit("run/tune.py:Tuner") == 400 and _limit("run/tune.py") == 700


@pytest.mark.parametrize("key", sorted(SIZES))
def test_no_module_over_700_lines_no_class_over_400(key: str):
    """Small modules with one job: a module over 700 lines or a class over 400 is split, unless
    it is a listed offender, which may not grow past its listed size."""
    allowed = TOO_LONG.get(key, _limit(key))
    assert SIZES[key] <= allowed, (
        f"{key} has {SIZES[key]} lines, over {allowed}: split it"
        + ("" if key not in TOO_LONG else " (a listed offender may only shrink)"))


def test_the_allow_list_only_holds_offenders():
    """An entry whose file was split, or shrank under the limit, leaves the list."""
    for key in TOO_LONG:
        assert key in SIZES, f"{key} no longer exists: remove it from TOO_LONG"
        assert SIZES[key] > _limit(key), f"{key} has {SIZES[key]} lines: remove it from TOO_LONG"
