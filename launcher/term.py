"""The presentation layer: text that fits the terminal, and the one way it is written out.

Every text-printing command (plan, capacity, doctor, gpus, tune, serve) asks this module for its
width instead of assuming 80 or nothing: a 616-character reason or a 200-column table row is
unreadable in a terminal and in a CI log alike. The rule is the one `ls` and `git` follow:
`COLUMNS` when set (a user's override, and how tests pin it), else the tty's width, else 100 —
piped output has no terminal to measure, and 100 is this repository's own line length.

Text a person reads leaves through `echo` (and a progress line through `status`): every field
passes `clean` there, the one hook for sanitising what is printed, and on a terminal, unless
`NO_COLOR` is set or `TERM` is `dumb`, the verdicts, headings and bars are coloured with rich.
Colour only adds escape codes around the characters already there: the layout is this
module's, the same on a terminal and in a pipe (which scripts, docs and tests read), so rich is
imported only when it will colour something and `vlaunch plan | less` never pays for it.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

PIPED_WIDTH = 100
MIN_WIDTH = 40  # narrower than this a hanging indent leaves no room for words; wrap at 40 anyway

_BULLET = re.compile(r"^(\s*)((?:[-*]|\d+[.)])\s+)?")


def width(stream: TextIO | None = None) -> int:
    """Columns to fit: `COLUMNS` if it is a positive integer, else the tty's, else 100.

    `stream` is the file the text goes to (stdout by default); only when it is a terminal is its
    size asked for, so `vlaunch plan ... | less` and a redirected file get the fixed 100."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return max(MIN_WIDTH, int(env))
    out = sys.stdout if stream is None else stream
    try:
        if out.isatty():
            return max(MIN_WIDTH, os.get_terminal_size(out.fileno()).columns)
    except (AttributeError, OSError, ValueError):  # a closed or fd-less stream: treat as piped
        pass
    return PIPED_WIDTH


def wrap(text: str, cols: int, indent: str = "", hang: str | None = None) -> list[str]:
    """`text` as lines of at most `cols` characters: the first starts with `indent`, the rest
    with `hang` (default: as many spaces as `indent`), breaking only at spaces.

    Unlike textwrap this never re-flows the given indent and cuts an over-long word rather than
    letting it run past the edge, so every returned line is within `cols`."""
    hang = " " * len(indent) if hang is None else hang
    words = text.split()
    lines: list[str] = []
    line, prefix = indent, indent
    for word in words:
        sep = "" if line == prefix else " "
        if len(line) + len(sep) + len(word) <= cols:
            line += sep + word
            continue
        if line != prefix:
            lines.append(line)
            line = prefix = hang
        while len(line) + len(word) > cols:  # too long for any line: cut it to fit
            room = max(1, cols - len(line))
            lines.append(line + word[:room])
            word, line, prefix = word[room:], hang, hang
        line += word
    if line != prefix or not lines:
        lines.append(line)
    return lines


def fit_line(line: str, cols: int) -> list[str]:
    """One line of prose wrapped with a hanging indent under its own text.

    The hang is the line's leading spaces plus its bullet ("- ", "* ", "3. ") or, for a
    "label: text" line, the label's width, so continuation lines start under the first word
    they continue."""
    if len(line) <= cols:
        return [line]
    m = _BULLET.match(line)  # always matches, possibly empty
    lead, bullet = m.group(0), m.group(2)
    body = line[len(lead):]
    label = re.match(r"^[\w .()/-]{1,24}: ", body)
    hang = " " * (len(lead) + (len(label.group(0)) if label and not bullet else 0))
    if len(hang) > cols // 2:  # a deep indent would leave a ribbon of one word per line
        hang = " " * min(len(lead), cols // 4)
    return wrap(body, cols, indent=lead, hang=hang)


def fit(lines: Iterable[str], cols: int) -> list[str]:
    """Every line of a text block fitted to `cols` (see fit_line); short lines are untouched."""
    out: list[str] = []
    for line in lines:
        for part in line.split("\n"):
            out += fit_line(part, cols)
    return out


def table(rows: Sequence[Sequence[str]], cols: int, *, indent: str = "",
          right: Iterable[int] = (), gap: str = "  ") -> list[str]:
    """Rows (the first is the header) as aligned columns within `cols` characters.

    Every column but the last is as wide as its widest cell; the last takes what is left and
    wraps inside its own column, so continuation lines start exactly under it and the columns
    to its left stay aligned however long a note is. Columns listed in `right` are
    right-aligned (numbers)."""
    if not rows:
        return []
    right = set(right)
    n = max(len(r) for r in rows)
    cells = [[str(c) for c in r] + [""] * (n - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(n)]
    out: list[str] = []
    for r in cells:
        head = indent + gap.join(
            (r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]))
            for i in range(n - 1))
        if n == 1:
            out.append((indent + r[0]).rstrip())
            continue
        start = head + gap
        last = r[-1].rjust(widths[-1]) if (n - 1) in right else r[-1]
        if len(start) + len(last) <= cols or len(start) > cols - 12:
            out.append((start + last).rstrip())
        else:
            out += [x.rstrip() for x in wrap(last, cols, indent=start, hang=" " * len(start))]
    return out


def command(argv: Sequence[str], cols: int, indent: str = "    ",
            env: dict[str, str] | None = None) -> list[str]:
    """A shell command as lines that paste back as one command: each line within `cols` where
    a single argument allows, continued with a trailing backslash, an option kept on the line
    of its value."""
    env_words = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return _pack(env_words + [shlex.quote(a) for a in argv], cols, indent)


def shell_lines(text: str, cols: int, indent: str = "    ") -> list[str]:
    """An already-quoted shell command line (`"$VAR"` kept as written) as `command` lines."""
    try:
        words = shlex.split(text, posix=False)
    except ValueError:  # unbalanced quotes: show it as it is
        return [indent + text]
    return _pack(words, cols, indent)


def _pack(quoted: list[str], cols: int, indent: str) -> list[str]:
    words: list[str] = []
    i = 0
    while i < len(quoted):  # "--flag value" stays together on one line
        a = quoted[i]
        if a.startswith("-") and i + 1 < len(quoted) and not quoted[i + 1].startswith("-"):
            a += " " + quoted[i + 1]
            i += 1
        words.append(a)
        i += 1
    lines: list[str] = []
    line = indent
    for w in words:
        sep = "" if line.strip() == "" else " "
        if line.strip() and len(line) + len(sep) + len(w) + 2 > cols:
            lines.append(line + " \\")
            line = indent + "  " + w
        else:
            line += sep + w
    lines.append(line)
    return lines


# ---------------------------------------------------------------------------------------------
# Writing it out: the one place printed text passes, plain unless a terminal asks for colour.

def clean(text: str) -> str:
    """Printed text as it may reach the terminal: the hook where every line `echo` and `status`
    write passes, so the sanitiser of control characters in printed fields (a model name from
    a config.json, a line from a vLLM log) applies to every command at once: escape sequences
    and control characters go, a carriage return becomes a new line (launcher/printable.py)."""
    from .printable import printable

    return printable(text)


def colour(stream: TextIO | None = None) -> bool:
    """Whether to colour what goes to `stream` (stdout by default): only a terminal, never with
    `NO_COLOR` set to anything (no-color.org) or a `TERM=dumb` terminal."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    out = sys.stdout if stream is None else stream
    try:
        return bool(out.isatty())
    except (AttributeError, OSError, ValueError):
        return False


# What is coloured: patterns over the text every command already prints, so the plain text is
# exactly what a pipe gets. A group named `s` styles only that part of a match.
_STYLES: tuple[tuple[str, str], ...] = (
    (r"\bFITS\b", "bold green"),
    (r"\bDOES NOT FIT\b", "bold red"),
    (r"^vlaunch: (?P<s>error):", "bold red"),
    (r"^vlaunch: (?P<s>warning):", "yellow"),
    (r"(?m)^ {0,4}(?P<s>why|warnings|what would fit|command|runner-ups|per GPU \(limiting rank\)"
     r"|performance|recommended|root cause|fix|run)(?= ?[(:])", "bold"),
    (r"(?m)^ {0,4}(?P<s>warnings):", "yellow"),
    (r"(?m)^root cause: (?P<s>\S+)", "red"),
    (r"(?m)^ {2}(?P<s>fix): ", "cyan"),
    (r"\bknee\b", "bold"),
    (r"\bmisses SLO\b", "red"),
    (r"(?m)^! .*$", "yellow"),
    # the plan's budget bar: one colour per consumer, headroom dim
    (r"(?<=\[)W+(?=[AGNK.]*\])", "blue"), (r"(?<=[\[W])A+(?=[GNK.]*\])", "magenta"),
    (r"(?<=[\[WA])G+(?=[NK.]*\])", "cyan"), (r"(?<=[\[WAG])N+(?=[K.]*\])", "yellow"),
    (r"(?<=[\[WAGN])K+(?=\.*\])", "green"), (r"(?<=[WAGNK])\.+(?=\] )", "dim"),
)


def styled_ansi(text: str) -> str:
    """`text` with rich's escape codes around what `_STYLES` names; the characters between the
    codes are `text`'s own, line for line (tests strip the codes and compare)."""
    import re as _re

    from rich.console import Console
    from rich.text import Text

    t = Text(text)
    for pattern, style in _STYLES:
        for m in _re.finditer(pattern, text, _re.M):
            a, b = m.span("s") if "s" in m.re.groupindex else m.span()
            if b > a:
                t.stylize(style, a, b)
    for m in _re.finditer(r"\[(#+)(\.*)\]", text):  # `vlaunch gpus`: memory taken per GPU
        share = len(m.group(1)) / (len(m.group(1)) + len(m.group(2)))
        t.stylize("green" if share < 0.5 else "yellow" if share < 0.8 else "red",
                  m.start(1), m.end(1))
    console = Console(force_terminal=True, color_system="standard", highlight=False,
                      markup=False, emoji=False, soft_wrap=True, width=1 << 16)
    with console.capture() as cap:
        console.print(t, end="")
    return cap.get()


def echo(text: str = "", *, err: bool = False, stream: TextIO | None = None) -> None:
    """Write `text` and a newline for a person to read: through `clean`, coloured on a terminal
    (see `colour`), plain otherwise. stderr with `err` (progress beside a JSON document)."""
    from .printable import raw

    out = stream if stream is not None else (sys.stderr if err else sys.stdout)
    text = clean(text)
    if text and colour(out):
        text = styled_ansi(text)
    out = raw(out)  # cleaned already: the colour codes added here are the only escapes
    out.write(text + "\n")
    out.flush()


def bar(fraction: float, cells: int) -> str:
    """A progress bar of `cells` characters between brackets, `#` for the share done (clamped to
    0-1, to the nearest cell), `.` for the rest: plain characters, so it reads the same in a
    pipe (a line `echo` prints colours it like `vlaunch gpus`'s bars)."""
    share = min(1.0, max(0.0, fraction)) if fraction == fraction else 0.0  # NaN: nothing done
    n = min(cells, round(share * cells))
    return "[" + "#" * n + "." * (cells - n) + "]"


def status(text: str, *, stream: TextIO | None = None) -> None:
    """A progress line rewritten in place on a terminal (a heartbeat while vLLM loads): a
    carriage return, the text cut to the width (a wrapped line could not be rewritten), and
    spaces over what the previous one left; no escape code, so it is plain under NO_COLOR too.
    The caller ends it with a newline. Piped progress is printed one `echo` line at a time."""
    from .printable import raw

    out = stream if stream is not None else sys.stderr
    text = clean(text).replace("\n", " ")[:width(out) - 1]  # one line, rewritten in place
    out = raw(out)  # the carriage return is the status line's own
    pad = max(0, _STATUS_LEN.get(id(out), 0) - len(text))
    _STATUS_LEN[id(out)] = len(text)
    out.write("\r" + text + " " * pad)
    out.flush()


_STATUS_LEN: dict[int, int] = {}  # per stream: the last status line's length, to blank it
