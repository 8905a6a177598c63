"""Docs that stay true: re-run every command README.md and docs/*.md show, and rewrite its output.

A doc quotes the tool in fenced ```console blocks: a `$ COMMAND` line (continued by a trailing
backslash) and the lines it prints, up to the next `$` line or the fence. COMMAND runs in bash,
so an excerpt is an honest pipe (`$ vlaunch plan ... | grep knee`) the reader can run too. A
figure quoted in prose is an inline code span holding only a number and, optionally, its unit
(`53.86` or `53.86 GiB`); it must appear in the output of a console block of the same section
(between `##` headings), and the refresh moves it with that output: the number at the same line
and position in the new output replaces it. Every other command a doc shows (`vlaunch ...` lines
in other code blocks: synopses, GPU-only runs) is checked to parse: each `--option` must be one
the subcommand's `--help` lists, and each `make TARGET` a Makefile target. tests/test_docs.py
runs the same checks; `make docs` (this script) rewrites the docs, atomically, file by file.

Commands run the way the reader's would, minus what varies by machine: this tree's `vlaunch` on
PATH, 100 columns, no colour, a fresh empty cache and home (no calibration, lessons or Hub
records of this machine), the Hub offline, in a scratch folder holding links to the
repository's `tests/`, `profiles/`, `deploy/` and `bench/`. A block's pipeline must exit 0: a
command shown failing ends with `; echo "exit $?"`.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFRESH = "make docs  (or: .venv/bin/python bench/docs_refresh.py)"
TIMEOUT_S = 120
COLUMNS = "100"

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_FIGURE = re.compile(r"`(\d[\d,]*(?:\.\d+)?)((?: ?[A-Za-z%$/]+)?)`")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_STANDALONE = re.compile(r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?!\w)")
_TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?")
_HEADING = re.compile(r"^#{1,2} ")
_PYTHON = re.compile(r"(?<![\w./-])[\w./-]*/bin/python[\d.]*(?![\w/])")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md, every Markdown file under docs/ and the Kubernetes README, in a stable
    order."""
    docs = sorted((root / "docs").glob("**/*.md")) if (root / "docs").is_dir() else []
    return [root / "README.md", *docs, root / "deploy" / "kubernetes" / "README.md"]


@dataclass
class Command:
    """One `$ ...` line of a console block and the output the doc shows under it."""

    text: str  # the shell command, continuation lines joined
    line: int  # 1-based line of its `$` in the doc
    out_start: int  # 0-based index of its first output line in the doc's lines
    out_end: int  # 0-based index one past its last output line
    section: int  # the `##` section the block sits in
    indent: str = ""  # the fence's indent (a block inside a list item), not part of the output

    def shown(self, lines: list[str]) -> list[str]:
        return [x[len(self.indent):] if x.startswith(self.indent) else x.lstrip()
                for x in lines[self.out_start:self.out_end]]


@dataclass
class Doc:
    path: Path
    lines: list[str]
    commands: list[Command] = field(default_factory=list)
    other: list[tuple[int, str]] = field(default_factory=list)  # (line, text) in other blocks
    figures: list[tuple[int, int, str]] = field(default_factory=list)  # (line, section, number)
    links: list[tuple[int, str]] = field(default_factory=list)  # (line, relative target)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else str(
            self.path)


def parse(path: Path) -> Doc:
    """The console commands, other shown commands and prose figures of one Markdown file."""
    lines = path.read_text(encoding="utf-8").split("\n")
    doc = Doc(path, lines)
    section, i = 0, 0
    while i < len(lines):
        line = lines[i]
        if _HEADING.match(line):
            section += 1
        m = _FENCE.match(line)
        if not m:
            for f in _FIGURE.finditer(_strip_code_spans_but_figures(line)):
                doc.figures.append((i + 1, section, f.group(1)))
            doc.other += [(i + 1, c) for c in re.findall(r"`((?:vlaunch|make) [^`]+)`", line)]
            doc.links += [(i + 1, t) for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line)
                          if "://" not in t]
            i += 1
            continue
        lang, j = m.group(2), i + 1
        while j < len(lines) and not _FENCE.match(lines[j]):
            j += 1
        body = list(range(i + 1, j))
        if lang == "console":
            doc.commands += _console(lines, body, section, m.group(1))
        else:
            doc.other += [(k + 1, lines[k]) for k in body]
        i = j + 1
    return doc


def _strip_code_spans_but_figures(line: str) -> str:
    """The line with code spans that are not figures blanked, so `--tp 8` is not a figure."""
    return re.sub(r"`[^`]*`", lambda m: m.group(0) if _FIGURE.fullmatch(m.group(0)) else "",
                  line)


def _console(lines: list[str], body: list[int], section: int, indent: str) -> list[Command]:
    def prompt(k: int) -> bool:
        return lines[body[k]].startswith(indent + "$ ")

    cmds: list[Command] = []
    k = 0
    while k < len(body):
        idx = body[k]
        if not prompt(k):
            k += 1  # output before any command: kept as written, checked by nothing
            continue
        parts = [lines[idx][len(indent) + 2:]]
        while parts[-1].endswith("\\") and k + 1 < len(body):
            k += 1
            parts[-1] = parts[-1][:-1].rstrip()
            parts.append(lines[body[k]].strip())
        start = body[k] + 1
        k += 1
        while k < len(body) and not prompt(k):
            k += 1
        end = body[k] if k < len(body) else (body[-1] + 1 if body else start)
        cmds.append(Command(" ".join(parts), idx + 1, start, max(start, end), section, indent))
    return cmds


@functools.cache
def sandbox() -> Path:
    """A scratch folder commands run in: links to the repository's data, a `vlaunch` on PATH."""
    top = Path(tempfile.mkdtemp(prefix="vlaunch-docs-"))
    (top / "bin").mkdir()
    (top / "home").mkdir()
    work = top / "work"
    work.mkdir()
    for name in ("tests", "profiles", "deploy", "bench"):
        (work / name).symlink_to(ROOT / name)
    for name, tail in (("vlaunch", " -c 'from launcher.cli import main; main()'"),
                       ("python", "")):  # this tree's, whatever the venv was installed from
        exe = top / "bin" / name
        exe.write_text(f"#!/bin/sh\nexec {_quote(sys.executable)}{tail} \"$@\"\n")
        exe.chmod(0o755)
    return top


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def env() -> dict[str, str]:
    top = sandbox()
    keep = {k: v for k, v in os.environ.items()
            if k in ("PATH", "LANG", "LC_ALL", "TMPDIR", "USER", "LOGNAME")}
    return {**keep, "PATH": f"{top / 'bin'}:{keep.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": str(ROOT), "HOME": str(top / "home"), "COLUMNS": COLUMNS,
            "NO_COLOR": "1", "TERM": "dumb", "HF_HUB_OFFLINE": "1",  # the HF cache: HOME's
            "VLAUNCH_CACHE_DIR": str(top / "home" / "cache"), "PYTHONDONTWRITEBYTECODE": "1",
            # the engine command a dry run prints, as `python3`: the interpreter's own path
            # (this checkout's venv) would wrap the quoted lines differently in every clone
            "VLAUNCH_VLLM_COMMAND": "python3 -m vllm.entrypoints.openai.api_server"}


@functools.cache
def run(command: str) -> tuple[int, list[str]]:
    """(exit status, output lines) of one shell command, stdout and stderr together; cached so
    a command quoted twice runs once."""
    top = sandbox()
    try:
        p = subprocess.run(["bash", "-c", command], cwd=top / "work", env=env(),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return 124, [f"(timed out after {TIMEOUT_S} s)"]
    text = _PYTHON.sub("python3", p.stdout.decode("utf-8", "replace"))
    text = text.replace(str(top / "work") + "/", "").replace(str(top / "home"), "~")
    text = text.replace(str(ROOT) + "/", "")
    out = [x.rstrip() for x in text.rstrip("\n").split("\n")] if text.strip() else []
    return p.returncode, out


def prefetch(docs: list[Doc]) -> None:
    """Run every distinct command the docs quote, and each subcommand's --help, a few at a time
    (one per core), so the checks that follow read the cache."""
    from concurrent.futures import ThreadPoolExecutor

    cmds = {c.text for d in docs for c in d.commands}
    subs = {w[1] for d in docs for _, text in d.other for w in _invocations(text)
            if w[0] == "vlaunch" and len(w) > 1 and not w[1].startswith("-")}
    cmds |= {f"vlaunch {s} --help" for s in subs if not _placeholder(s)} | {"vlaunch --help"}
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(run, sorted(cmds)))


def normal(lines: list[str]) -> list[str]:
    """Lines as compared: trailing spaces and timestamps do not count."""
    return [_TIME.sub("<time>", x.rstrip()) for x in lines]


def problems(doc: Doc) -> Iterator[str]:
    """Every way `doc` differs from what the tool prints today, one line each."""
    outputs: dict[int, list[tuple[list[str], list[str]]]] = {}  # section: [(shown, now)]
    for c in doc.commands:
        rc, now = run(c.text)
        shown = c.shown(doc.lines)
        outputs.setdefault(c.section, []).append((shown, now))
        where = f"{doc.name}:{c.line}: `$ {c.text}`"
        if rc != 0:
            yield f"{where} exits {rc} (a command shown failing ends with '; echo \"exit $?\"')"
        elif any("Traceback (most recent call last)" in x for x in now):
            yield f"{where} prints a traceback"
        elif normal(shown) != normal(now):
            diff = next((n for n, (a, b) in enumerate(zip(normal(shown), normal(now), strict=False))
                         if a != b), min(len(shown), len(now)))
            was = shown[diff] if diff < len(shown) else "(nothing)"
            new = now[diff] if diff < len(now) else "(nothing)"
            yield (f"{where} output differs from today's at line {c.out_start + diff + 1}: "
                   f"doc {was.strip()!r}, now {new.strip()!r}")
    for line, section, number in doc.figures:
        if not any(number in _NUMBER.findall(x) for _, now in outputs.get(section, ())
                   for x in now):
            yield (f"{doc.name}:{line}: figure `{number}` is in no console output of its "
                   "section")
    yield from _shown_commands(doc)
    for line, target in doc.links:
        if not (doc.path.parent / target).exists():
            yield f"{doc.name}:{line}: link to {target}, which does not exist"


def _shown_commands(doc: Doc) -> Iterator[str]:
    """Commands in non-console blocks: each option known to its subcommand, each make target
    in the Makefile."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for line, text in doc.other:
        for words in _invocations(text):
            if words[0] == "make":
                for t in (w for w in words[1:] if not w.startswith("-") and "=" not in w
                          and not _placeholder(w)):
                    if t not in targets:
                        yield f"{doc.name}:{line}: make target {t!r} is not in the Makefile"
                continue
            sub = words[1] if len(words) > 1 and not words[1].startswith("-") else None
            if sub is not None and _placeholder(sub):
                continue  # `vlaunch COMMAND --help`: a pattern, not a command
            known = _options(sub)
            if known is None:
                yield f"{doc.name}:{line}: `vlaunch {sub}` is not a vlaunch command"
                continue
            for w in words[2 if sub else 1:]:
                if w == "--":
                    break  # what follows goes to vLLM
                opt = re.match(r"(--?[A-Za-z][\w-]*)", w)
                if w.startswith("-") and opt and opt.group(1) not in known:
                    yield (f"{doc.name}:{line}: `vlaunch {sub}` has no option {opt.group(1)} "
                           "(see its --help)")


def _invocations(text: str) -> Iterator[list[str]]:
    """The `vlaunch ...` and `make ...` commands on one shown line, as words; a trailing
    comment, `[`/`]`/`|` of a synopsis and the rest of a pipe are cut off."""
    code = re.sub(r"\s#\s.*$", "", " " + text).strip()
    code = re.sub(r"^\$\s+", "", code)
    for part in re.split(r"\s*(?:\||&&|;)\s*", code):
        words = [w.strip("[]") for w in part.replace("|", " ").split()]
        words = [w for w in words if w and "=" not in w.split("-")[0]]  # VAR=value prefixes
        if words and words[0] in ("vlaunch", "make"):
            yield words


def _placeholder(word: str) -> bool:
    """COMMAND, TARGET, MODEL, ...: a word the reader replaces."""
    return word.strip(".") == "" or (word.isupper() and word.isalpha())


@functools.cache
def _options(sub: str | None) -> frozenset[str] | None:
    """The options `vlaunch [SUB] --help` lists; None when SUB is not a command."""
    rc, out = run(f"vlaunch {sub} --help" if sub else "vlaunch --help")
    if rc != 0:
        return None
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", "\n".join(out)))


def _skeleton(line: str) -> str:
    """A line with its standalone numbers blanked: what must stay for a number in it to be the
    same fact. Numbers inside words (`8xH100`, `TP4`, `4.16x`) stay: they name the row."""
    return _STANDALONE.sub("#", line.strip())


def _moved(number: str, shown: list[str], now: list[str]) -> set[str]:
    """What `number` reads as in the new output, at each place it sits in the old one: the same
    place on the nearest line with the same words around the numbers. Empty when no such line is
    left (the fact is gone, or reworded); more than one value when its places disagree (`4` in
    `TP4` and in the replicas column): either way a person must read the sentence."""
    values: set[str] = set()
    for i, old in enumerate(shown):
        same = [j for j, new in enumerate(now) if _skeleton(new) == _skeleton(old)]
        if not same:
            continue
        new = _NUMBER.findall(now[min(same, key=lambda j: abs(j - i))])
        values |= {new[k] for k, n in enumerate(_NUMBER.findall(old)) if n == number}
    return values


def refresh(doc: Doc, unmoved: list[str] | None = None) -> str:
    """The doc's text with every console block's output and every prose figure as today's; a
    figure whose line is gone from the output is kept as written and named in `unmoved`."""
    lines = list(doc.lines)
    blocks: dict[int, list[tuple[list[str], list[str]]]] = {}
    for c in doc.commands:
        blocks.setdefault(c.section, []).append((c.shown(doc.lines), run(c.text)[1]))

    def new_figure(m: re.Match[str], line: int, section: int) -> str:
        number = m.group(1)
        values = set().union(*(_moved(number, shown, now)
                               for shown, now in blocks.get(section, ())))
        if len(values) == 1:
            return f"`{values.pop()}{m.group(2)}`"
        if unmoved is not None:
            why = ("its output line changed" if not values else
                   f"it sits in several places that now read {', '.join(sorted(values))}")
            unmoved.append(f"{doc.name}:{line}: figure `{number}`: {why}; reword the sentence "
                           "by hand (or quote a figure that appears once)")
        return m.group(0)

    for line, section in dict.fromkeys((n, s) for n, s, _ in doc.figures):  # once a line;
        # prose lines hold no console output, so the indices stay valid
        lines[line - 1] = _FIGURE.sub(lambda m, n=line, s=section: new_figure(m, n, s),
                                      lines[line - 1])
    for c in reversed(doc.commands):  # from the bottom, so earlier indices stay valid
        lines[c.out_start:c.out_end] = [(c.indent + x) if x else x for x in run(c.text)[1]]
    return "\n".join(lines)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main() -> int:
    try:
        prefetch([parse(p) for p in doc_files()])
        unmoved: list[str] = []
        for path in doc_files():
            doc = parse(path)
            new = refresh(doc, unmoved)
            if new != "\n".join(doc.lines):
                atomic_write(path, new)
                print(f"rewrote {doc.name}")
        bad = unmoved + [p for path in doc_files() for p in problems(parse(path))]
        for p in bad:
            print(p)
        return 1 if bad else 0
    finally:
        shutil.rmtree(sandbox(), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
