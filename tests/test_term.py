"""Properties of the terminal-fitting helpers: every line within the width, no word lost or
reordered, continuation lines under their first word, table columns aligned, commands that
paste back as the same argv."""

from __future__ import annotations

import io
import random
import shlex
import string

import pytest

from launcher import term


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(string.ascii_letters + "0123456789,.=/")
                    for _ in range(rng.choice((1, 2, 5, 9, 14, 30, 130))))
            for _ in range(n)]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        raise OSError("no descriptor")


def test_width_follows_columns_then_tty_then_100(monkeypatch):
    monkeypatch.setenv("COLUMNS", "132")
    assert term.width(io.StringIO()) == 132
    monkeypatch.setenv("COLUMNS", "12")
    assert term.width(io.StringIO()) == term.MIN_WIDTH
    for bad in ("", "wide", "-3", "0"):
        monkeypatch.setenv("COLUMNS", bad)
        assert term.width(io.StringIO()) == term.PIPED_WIDTH  # a pipe has no size to ask
        assert term.width(_Tty()) == term.PIPED_WIDTH  # a tty whose size cannot be read


@pytest.mark.parametrize("seed", range(40))
def test_wrap_keeps_every_word_in_order_within_width(seed):
    rng = random.Random(seed)
    cols = rng.randint(term.MIN_WIDTH, 130)
    words = _words(rng, rng.randint(0, 60))
    indent = " " * rng.randint(0, 8)
    hang = indent + " " * rng.randint(0, 6)
    lines = term.wrap(" ".join(words), cols, indent=indent, hang=hang)
    assert all(len(x) <= cols for x in lines)
    assert lines[0].startswith(indent)
    assert all(x.startswith(hang) for x in lines[1:])
    body = [lines[0][len(indent):]] + [x[len(hang):] for x in lines[1:]]
    # cut pieces of an over-long word join back; nothing else is lost, added or reordered
    assert "".join("".join(b.split()) for b in body) == "".join(words)
    if all(len(w) + len(hang) <= cols for w in words):  # no word needed cutting
        assert " ".join(b for b in body if b).split() == words


@pytest.mark.parametrize("seed", range(30))
def test_fit_hangs_continuations_under_the_first_word(seed):
    rng = random.Random(seed)
    cols = rng.randint(term.MIN_WIDTH, 120)
    lead = " " * rng.randint(0, 6) + rng.choice(("", "- ", "* ", "12. "))
    text = " ".join(w[:cols // 3] for w in _words(rng, rng.randint(1, 50)))
    lines = term.fit([lead + text], cols)
    assert all(len(x) <= cols for x in lines)
    assert lines[0].startswith(lead)
    for x in lines[1:]:
        assert x.startswith(" " * len(lead)) and x[len(lead)] != " "
    short = "  - short line"
    assert term.fit([short], cols) == [short]


@pytest.mark.parametrize("seed", range(30))
def test_table_keeps_columns_aligned_and_wraps_only_the_last(seed):
    rng = random.Random(seed)
    cols = rng.randint(60, 120)
    ncol = rng.randint(2, 5)
    rows = [[str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(ncol - 1)]
            + [" ".join(w[:20] for w in _words(rng, rng.randint(0, 25)))] for _ in range(8)]
    rows.insert(0, [f"col{i}" for i in range(ncol)])
    lines = term.table(rows, cols, indent="  ", right=range(ncol - 1))
    assert all(len(x) <= cols for x in lines)
    header = lines[0]
    last = header.index(f"col{ncol - 1}")
    starts = [x for x in lines if x[:last].strip()]  # a row's first line; the rest continue
    assert len(starts) == len(rows)
    # right-aligned numeric columns end at the same offset in every row
    for i in range(ncol - 1):
        end = header.index(f"col{i}") + len(f"col{i}")
        for row, line in zip(rows, starts, strict=True):
            assert line[:end].endswith(row[i])
    for x in lines:
        if not x[:last].strip():  # continuation of the last column: starts under it
            assert len(x) - len(x.lstrip()) == last


@pytest.mark.parametrize("seed", range(20))
def test_command_lines_paste_back_as_the_same_argv(seed):
    rng = random.Random(seed)
    cols = rng.randint(term.MIN_WIDTH, 120)
    argv = ["vllm", "serve", "org/model"]
    for w in _words(rng, rng.randint(0, 20)):
        argv += [f"--{w[:12].lower()}", w] if rng.random() < 0.6 else [w]
    env = {"VLLM_X": "1 2"}
    lines = term.command(argv, cols, env=env)
    joined = " ".join(x[:-2] if x.endswith(" \\") else x for x in lines)
    assert shlex.split(joined) == ["VLLM_X=1 2"] + argv
    assert all(x.endswith(" \\") for x in lines[:-1])
    for x in lines:  # over the width only where one argument alone is longer
        if len(x) > cols:
            assert len(x.strip().rstrip("\\").split(" ")) <= 3
