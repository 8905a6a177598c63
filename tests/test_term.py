"""Properties of the terminal-fitting helpers: every line within the width, no word lost or
reordered, continuation lines under their first word, table columns aligned, commands that
paste back as the same argv."""

from __future__ import annotations

import io
import os
import pty
import random
import re
import select
import shlex
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import term

ROOT = Path(__file__).resolve().parents[1]


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


# ---------------------------------------------------------------------------------------------
# Writing it out: colour on a terminal only, the same characters everywhere, one hook.

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PLAN = ["plan", "deepseek-v3", "--gpus", "8xH200"]


def _vlaunch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM", "FORCE_COLOR")}
    return {**env, "PYTHONPATH": str(ROOT), "COLUMNS": "100", "TERM": "xterm-256color", **extra}


def _run_in_pty(args: list[str], env: dict[str, str]) -> str:
    """What `vlaunch ARGS` writes to a terminal: stdout and stderr on a pty, read to the end."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-c", "from launcher.cli import main; main()", *args],
                         stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env,
                         cwd=ROOT)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif p.poll() is not None:
                break
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def _run_piped(args: list[str], env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120, check=False).stdout


def test_plan_is_coloured_on_a_terminal_and_plain_otherwise():
    """On a pty the verdict and the budget bar carry colour; the characters between the codes
    are exactly what a pipe gets. NO_COLOR, TERM=dumb and a pipe get no escape code at all."""
    piped = _run_piped(_PLAN, _vlaunch_env())
    tty = _run_in_pty(_PLAN, _vlaunch_env())
    assert "\x1b[" not in piped and piped.startswith("deepseek-v3 on 8xH200")
    assert "\x1b[1;32mFITS\x1b[0m" in tty and "\x1b[34mWWW" in tty
    assert _ANSI.sub("", tty) == piped
    for env in (_vlaunch_env(NO_COLOR="1"), _vlaunch_env(TERM="dumb")):
        assert _run_in_pty(_PLAN, env) == piped


def test_errors_are_one_line_coloured_only_on_a_terminal():
    args = ["plan", "no-such-model", "--gpus", "8xH200"]
    tty = _run_in_pty(args, _vlaunch_env())
    plain = _run_in_pty(args, _vlaunch_env(NO_COLOR="1"))
    assert tty.startswith("vlaunch: \x1b[1;31merror\x1b[0m: unknown model 'no-such-model'")
    assert _ANSI.sub("", tty) == plain and plain.count("\n") == 1 and "\x1b" not in plain


def test_a_piped_plan_never_imports_rich():
    """rich is imported only to colour a terminal: `vlaunch plan | less` does not pay for it
    (python -X importtime: about 67 ms of rich.console)."""
    code = ("import sys; from click.testing import CliRunner; from launcher.cli import cli; "
            f"r = CliRunner().invoke(cli, {_PLAN!r}); "
            "print(r.exit_code, sorted(m for m in sys.modules if m.split('.')[0] == 'rich'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_vlaunch_env(), cwd=ROOT, timeout=120, check=True).stdout
    assert out.strip() == "0 []"


@pytest.mark.parametrize("seed", range(8))
def test_styling_only_adds_escape_codes(seed):
    """Over random texts built from what the commands print (verdicts, headings, bars, the
    gpus usage bar, stray brackets), stripping the codes gives the text back, line for line."""
    rng = random.Random(seed)
    pieces = ["FITS", "DOES NOT FIT", "  why:", "  warnings:", "root cause: cuda_oom", "  fix: ",
              "knee", "misses SLO", "! nvml", "vlaunch: error:", "[WWWAGGNKKK...] 80 GiB",
              "[####......]", "[]", "[W", "K]", "...", "\n", "\n  ", " "]
    for _ in range(40):
        text = "".join(rng.choice(pieces + _words(rng, 3)) for _ in range(rng.randint(0, 60)))
        assert _ANSI.sub("", term.styled_ansi(text)) == text


def test_echo_passes_every_line_through_clean_and_writes_plain_to_a_pipe(monkeypatch):
    """`clean` is the one hook (a sanitiser of printed fields plugs in there): echo and status
    both call it; a StringIO is no terminal, so nothing is coloured."""
    monkeypatch.setattr(term, "clean", lambda s: s.replace("\x07", "?"))
    out = io.StringIO()
    term.echo("deepseek-v3 on 8xH200: FITS \x07", stream=out)
    assert out.getvalue() == "deepseek-v3 on 8xH200: FITS ?\n"
    term.status("loading \x07 weights", stream=out)
    assert out.getvalue().endswith("\rloading ? weights")


def test_status_rewrites_in_place_without_escape_codes(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    out = io.StringIO()
    term.status("a long heartbeat line " * 5, stream=out)
    term.status("short", stream=out)
    first, second = out.getvalue().split("\r")[1:]
    assert len(first) == 39 and second == "short" + " " * 34 and "\x1b" not in out.getvalue()


def test_colour_follows_no_color_term_and_tty(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert term.colour(_Tty()) and not term.colour(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not term.colour(_Tty())
    monkeypatch.setenv("NO_COLOR", "")  # set but empty: colour stays (no-color.org)
    assert term.colour(_Tty())
    monkeypatch.setenv("TERM", "dumb")
    assert not term.colour(_Tty())


@pytest.mark.parametrize("seed", range(4))
def test_bar_is_its_width_and_grows_with_the_share(seed):
    rng = random.Random(seed)
    for _ in range(100):
        cells = rng.randint(1, 60)
        a, b = sorted(rng.uniform(-0.5, 1.5) for _ in range(2))
        ba, bb = term.bar(a, cells), term.bar(b, cells)
        assert len(ba) == len(bb) == cells + 2 and ba[0] == "[" and ba[-1] == "]"
        assert ba.count("#") <= bb.count("#")  # never less done for a larger share
        share = min(1.0, max(0.0, a))
        assert abs(ba.count("#") - share * cells) <= 0.5  # the nearest cell
        assert ba.count("#") + ba.count(".") == cells
    assert term.bar(float("nan"), 4) == term.bar(-1, 4) == term.bar(0.01, 4) == "[....]"
    assert term.bar(2.0, 4) == term.bar(0.99, 4) == "[####]"


def test_tune_heartbeat_on_a_terminal_carries_the_budget_bar(monkeypatch):
    """A heartbeat on a terminal is rewritten in place behind a bar of the budget spent; piped,
    it is one plain line each, no bar and no carriage return."""
    from launcher.run.tune import Progress

    now = [0.0]
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    lines: list[str] = []
    p = Progress(100.0, lines.append, tty=True, clock=lambda: now[0])
    now[0] = 25.0
    p.tick("starting t1: loading")
    assert err.getvalue().startswith("\r[#####...............] [   25s |  1m15s left] starting t1")
    p.line("t1 ready")
    assert lines == ["[   25s |  1m15s left] t1 ready"] and err.getvalue().endswith("\n")
    piped: list[str] = []
    now[0] = 0.0
    q = Progress(100.0, piped.append, tty=False, clock=lambda: now[0])
    now[0] = 25.0
    q.tick("measuring")
    assert piped == ["[   25s |  1m15s left] measuring"]
