"""README.md and docs/ quote the tool as it is today: every console block's output is what its
command prints now, every prose figure is in that output, every other `vlaunch` line shown
parses (bench/docs_refresh.py; docs/docs.md says how). Each distinct command runs once per
session (about 25 s in all on 2 cores, most of it `bench/perf_bench.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import docs_refresh  # noqa: E402 - bench/, not the package

DOCS = docs_refresh.doc_files()


@pytest.fixture(scope="module", autouse=True)
def _scratch():
    docs_refresh.prefetch([docs_refresh.parse(p) for p in DOCS])
    yield
    import shutil

    shutil.rmtree(docs_refresh.sandbox(), ignore_errors=True)
    docs_refresh.sandbox.cache_clear()


@pytest.mark.parametrize("path", DOCS, ids=[p.name if p.parent.name != "kubernetes"
                                            else "kubernetes/README.md" for p in DOCS])
def test_doc_is_current(path: Path) -> None:
    from launcher.predict.features.capabilities import installed_vllm

    if installed_vllm() is None:  # `make unit` before `make engine`: plans say what they assumed
        pytest.skip("the docs quote plans made beside the installed vLLM (make engine)")
    bad = list(docs_refresh.problems(docs_refresh.parse(path)))
    assert not bad, ("\n".join(bad) + f"\nrefresh with: {docs_refresh.REFRESH}, then read the "
                     "diff (a figure or a sentence may need a new word)")


def test_every_doc_shows_a_live_command_or_is_prose() -> None:
    """The docs that quote the tool quote it through console blocks: README's plan sample, the
    capacity example and the napkin's memory figures are live, not pasted."""
    docs = {p.name: docs_refresh.parse(p) for p in DOCS if p.parent.name != "kubernetes"}
    assert any(c.text.startswith("vlaunch plan deepseek-v3 --gpus 8xH200")
               for c in docs["README.md"].commands)
    texts = [c.text for c in docs["capacity.md"].commands]
    assert sum("vlaunch capacity" in t for t in texts) == 2
    assert len(docs["capacity.md"].figures) >= 8
    assert len(docs["README.md"].path.read_text()) <= 15_000
    linked = {Path(t).name for _, t in docs["README.md"].links}
    assert {p.name for p in DOCS if p.parent.name == "docs"} <= linked  # every page has a way in


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "doc.md"
    p.write_text(text)
    return p


def test_stale_output_and_figure_are_found_then_refreshed(tmp_path: Path) -> None:
    """A block whose output changed is reported with its doc line and command; the refresh puts
    today's output in and moves the prose figure with it (52.6 -> 53.86, the napkin's case)."""
    doc = _write(tmp_path, "# t\n\nKV per GPU: `52.6` GiB.\n\n```console\n"
                 "$ echo 'K=KV cache 53.86'; echo 'A=activations 0.45'\nK=KV cache 52.6\n"
                 "A=activations 0.8\n```\n")
    bad = list(docs_refresh.problems(docs_refresh.parse(doc)))
    assert any(":6:" in b and "K=KV cache 52.6" in b and "53.86" in b for b in bad), bad
    assert any(":3:" in b and "`52.6`" in b for b in bad), bad
    new = docs_refresh.refresh(docs_refresh.parse(doc))
    assert "KV per GPU: `53.86` GiB." in new and "A=activations 0.45" in new
    doc.write_text(new)
    assert list(docs_refresh.problems(docs_refresh.parse(doc))) == []


def test_failing_command_unknown_option_and_make_target_are_found(tmp_path: Path) -> None:
    doc = _write(tmp_path, "# t\n\n```console\n$ exit 3\n```\n\n```\n"
                 "vlaunch plan MODEL --gpus 8xH200 --no-such-flag   # a synopsis\n"
                 "vlaunch serve MODEL --dry-run -- --any-vllm-flag 1\n"
                 "make no-such-target\nmake docs\n```\n")
    bad = list(docs_refresh.problems(docs_refresh.parse(doc)))
    assert any(":4:" in b and "exits 3" in b for b in bad), bad
    assert any(":8:" in b and "--no-such-flag" in b for b in bad), bad
    assert any(":10:" in b and "no-such-target" in b for b in bad), bad
    assert len(bad) == 3, bad  # --gpus, --dry-run, what follows `--` and `make docs` pass


def test_indented_block_keeps_its_indent(tmp_path: Path) -> None:
    doc = _write(tmp_path, "# t\n\n1. item\n\n   ```console\n   $ echo a; echo b\n   old\n"
                 "   ```\n")
    new = docs_refresh.refresh(docs_refresh.parse(doc))
    assert "   $ echo a; echo b\n   a\n   b\n   ```" in new
    doc.write_text(new)
    assert list(docs_refresh.problems(docs_refresh.parse(doc))) == []


def test_prose_commands_and_links_are_checked(tmp_path: Path) -> None:
    """`vlaunch ...` in running text parses like a block's; a relative link must resolve."""
    (tmp_path / "there.md").write_text("# there\n")
    doc = _write(tmp_path, "# t\n\nRun `vlaunch plan MODEL --gpuz 8xH200` or `make nothing`; "
                 "see [there](there.md#x), [gone](gone.md) and [web](https://example.org/a.md); "
                 "`vlaunch COMMAND --help` is a pattern.\n")
    bad = list(docs_refresh.problems(docs_refresh.parse(doc)))
    assert len(bad) == 3 and all(b.startswith(f"{doc}:3:") for b in bad), bad
    assert any("--gpuz" in b for b in bad) and any("'nothing'" in b for b in bad)
    assert any("gone.md" in b for b in bad)


def test_json_doc_names_every_top_level_key_of_a_plan() -> None:
    """docs/json.md's plan table names each key `--format json` prints (a key added to the plan
    is a row to add), and no key the plan no longer has."""
    import json
    import re

    keys: set[str] = set()
    for cmd in ("vlaunch plan deepseek-v3 --gpus 8xH200 --format json",  # + a pool's folder's
                "vlaunch plan deepseek-r1 --gpus 2x8xH200 --disaggregate on --role decode "
                "--format json"):
        rc, out = docs_refresh.run(cmd)
        assert rc == 0, out
        keys |= set(json.loads("\n".join(out)))
    assert "role" in keys
    text = (docs_refresh.ROOT / "docs" / "json.md").read_text()
    table = text[text.index("## Plan JSON"):text.index("## tune.json")]
    rows = [re.sub(r" \([^)]*\)", "", r.split(" | ")[0])  # "(and `revision` ...)": model's keys
            for r in table.split("\n") if r.startswith("| `")]
    named = {m for r in rows for m in re.findall(r"`([a-z_]+)(?:[{\[`(]|$)", r)}
    assert keys - named == set(), f"docs/json.md lacks a row for {sorted(keys - named)}"
    assert named - keys == set(), f"docs/json.md names keys a plan lacks: {sorted(named - keys)}"


def test_a_figure_whose_line_changed_or_that_sits_twice_is_left_for_a_person(tmp_path: Path):
    """The refresh moves a figure only along a line whose words stay: a row that is gone (the
    4xH100 replica capacity no longer offers) or a number in two places that now disagree (`4`
    in `TP4` and in the replicas column) is kept as written and named, never guessed."""
    doc = _write(tmp_path, "# t\n\nIt serves `85` users on `4` replicas, `53.86` GiB each.\n\n"
                 "```console\n$ echo '8xH100 TP4 users 170 replicas 2'; echo 'KV 60.1'\n"
                 "4xH100 TP4 users 85 replicas 4\nKV 53.86\n```\n")
    unmoved: list[str] = []
    new = docs_refresh.refresh(docs_refresh.parse(doc), unmoved)
    assert "It serves `85` users on `4` replicas, `60.1` GiB each." in new
    assert [u.split(": figure ")[1].split(":")[0] for u in unmoved] == ["`85`", "`4`"]
    assert all(u.startswith(f"{doc}:3:") for u in unmoved)
    doc2 = _write(tmp_path, "# t\n\nOn `4` replicas.\n\n```console\n"
                  "$ echo 'TP4 replicas 2'\nTP4 replicas 4\n```\n")
    unmoved = []
    docs_refresh.refresh(docs_refresh.parse(doc2), unmoved)
    assert len(unmoved) == 1 and "now read 2, 4" in unmoved[0]
