"""Why a vLLM start failed, from its log: one scan over the lines, into diagnoses.

Why here, below both `run` and `observe`: `serve` and `tune` (run) retry on what a failed start
says, and `vlaunch doctor` (observe) explains it to a person. Both read the same scan, so it
lives in `inputs`, importing neither (before, vllmlog called the doctor, which called serve,
which called vllmlog). The fixes, which need the planner, stay in the doctor.

Parts: `vllm_loglines` (one line: prefix, phase marker, facts), `vllm_rules` (the table of
vLLM's and NCCL's failure messages), this module (the scan, the diagnoses, the `Failure` serve
and tune retry on), `vllm_logfiles` (reading a file, a folder or stdin).

How: one pass over the log, line by line (`Scanner.feed`), in bounded memory:
1. every line's vLLM prefix ("(Worker_TP3 pid=42) ERROR 05-20 10:04:12 [file.py:1] ") is split
   off, giving the process (the rank) and the level;
2. phase marker lines move the start-up phase forward (`PHASES`, `vllm_loglines._MARKERS`);
3. error-looking lines are matched against `RULES`, a table of vLLM's failure messages taken
   from vLLM's source, 0.6.0 to 0.32.0 (file and function cited per rule, with the wording of
   each release line), and NCCL's own WARN lines. Lines that only wrap another error ("See
   root cause above") never count as a cause or a rank;
4. the same failure on several ranks is one `Diagnosis` with `ranks` = how many.
`Report.diagnoses` is ordered by where each failure first appeared: the first is the root
cause. Nothing matched: one `unknown` diagnosis with the lines that look like the error.
"""

from __future__ import annotations

import io
import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import vllm_flags
from .vllm_loglines import (
    ARGPARSE_LINE,
    EXCEPTION_LINE,
    LAUNCH,
    MAX_EVIDENCE,
    MAX_UNKNOWN,
    PHASES,
    SOURCE_LINE,
    Facts,
    Line,
    has_context,
    phase_of,
    quiet_line,
    split_line,
)
from .vllm_rules import (
    NCCL_SPECIFIC,
    RULE_BY_CAUSE,
    RULE_HINT,
    RULE_KEYS,
    RULES,
    Rule,
    consumer_by_budget,
    consumer_by_phase,
)

# --- diagnoses ---------------------------------------------------------------------------------


@dataclass
class Diagnosis:
    """One failure, as the report shows it (JSON: `to_dict`)."""

    cause: str
    phase: str
    consumer: str
    ranks: int
    evidence: list[str]
    fix_args: list[str] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)
    fix_env: dict[str, str] = field(default_factory=dict)
    serve_command: str | None = None  # the fix as `vlaunch serve ...`
    vllm_command: str | None = None  # the same fix as the `vllm serve ...` of the failed launch
    transient: bool = False
    source: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    first_line: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "phase": self.phase, "consumer": self.consumer,
                "ranks": self.ranks, "evidence": list(self.evidence),
                "fix_args": list(self.fix_args), "explain": list(self.explain),
                "fix_env": dict(self.fix_env), "serve_command": self.serve_command,
                "vllm_command": self.vllm_command,
                "transient": self.transient, "source": self.source,
                "numbers": json_numbers(self.numbers), "first_line": self.first_line}


# What each message's numbers are called in JSON: the names the plan uses for the same things
# (max_model_len, gpu_memory_utilization, kv_cache.dtype, tp, ...), with the unit vLLM printed
# them in (vLLM prints GiB; the plan's byte counts are *_bytes).
_JSON_NAMES = {
    "needed": "needed_kv_gib", "available": "available_kv_gib",
    "estimate": "estimated_max_model_len", "kv_tokens": "kv_cache.tokens",
    "free": "free_gib", "total": "total_gib", "util": "gpu_memory_utilization",
    "requested": "requested_gib", "kv_requested": "kv_requested_gib",
    "initial": "initial_free_gib", "current": "current_free_gib",
    "num_reqs": "max_num_seqs", "asked": "max_model_len", "derived": "derived_max_model_len",
    "key": "config_key", "heads": "num_attention_heads", "dtype": "kv_cache.dtype",
    "method": "quantization", "min": "min_compute_capability", "cur": "compute_capability",
    "size": "shm_segment_bytes", "segment": "shm_segment", "waited": "waited_s",
    "unknown": "unknown_arguments", "module": "module", "model": "model", "unit": "unit",
}


def json_numbers(numbers: dict[str, Any]) -> dict[str, Any]:
    """A diagnosis' numbers under the JSON vocabulary's names ("a.b" nests as {"a": {"b"}});
    the profiling error's raw byte counts (V0) become GiB like the other releases print."""
    out: dict[str, Any] = {}
    for key, value in numbers.items():
        if key in ("initial", "current") and isinstance(value, (int, float)) and value > 1 << 20:
            value = round(value / (1 << 30), 2)
        name = _JSON_NAMES.get(key, key)
        head, _, tail = name.partition(".")
        if tail:
            out.setdefault(head, {})[tail] = value
        else:
            out[name] = value
    return out


@dataclass
class _Hit:
    """A failure while the scan is running: where it began and who reported it."""

    rule: Rule
    phase: str
    marker: str
    first_line: int
    numbers: dict[str, Any]
    ranks: set[str] = field(default_factory=set)
    wrapped_only: bool = True
    evidence: list[str] = field(default_factory=list)

    def add(self, line: Line) -> None:
        if not line.wrapper:
            self.wrapped_only = False
            self.ranks.add(line.rank or "")
        if len(self.evidence) < MAX_EVIDENCE:
            text = shown(line.text)
            if text not in self.evidence:
                self.evidence.append(text)


# Terminal control characters (an escape sequence in a log must not repaint the reader's
# terminal) and Unicode's bidirectional overrides (they reorder what is shown).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# The flag table's secrets, as "non-default args" prints them ('api_key': '...') and as a
# command line gives them, abbreviations argparse accepts included (`--api-ke K`).
_SECRETS = [f for f in vllm_flags.flags() if f.secret]
_SECRET_TEXT = re.compile(
    "('(?:" + "|".join(f.dest for f in _SECRETS) + r")':\s*)(?:\[[^\]]*\]|'[^']*')|(--(?:"
    + "|".join(re.escape(f.name[2:i]) for f in _SECRETS for i in range(len(f.name), 2, -1))
    + r")[= ])\S+")


def shown(text: str) -> str:
    """A log line as evidence may show it: control characters escaped (\\x1b), and the values
    of --api-key and --hf-token (as vLLM's "non-default args" prints them) hidden."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                        else f"\\u{ord(m.group()):04x}", text)
    return _SECRET_TEXT.sub(lambda m: (m.group(1) + "'***'") if m.group(1)
                            else m.group(2) + "***", text)


_ALIAS = re.compile(r"(?:_v0|\d)$")  # "model2", "max_model_len_v0": another wording's group
_INT = re.compile(r"-?\d+")
_DEC = re.compile(r"-?\d+\.\d*")


def _value(text: str) -> Any:
    """A number the message printed, as a number (JSON shows numbers as numbers); else text."""
    if _INT.fullmatch(text):
        return int(text)
    if _DEC.fullmatch(text):
        return float(text)
    return text


def _numbers(m: re.Match[str]) -> dict[str, Any]:
    """The named groups a message matched, under one name per fact whichever wording printed
    it, numbers converted."""
    out: dict[str, Any] = {}
    for k, v in m.groupdict().items():
        if v is not None:
            out.setdefault(_ALIAS.sub("", k), _value(v))
    return out


def _rank_count(ranks: set[str]) -> int:
    """Distinct processes that failed this way; the API server and unprefixed lines (which echo
    an engine's error) count only when no engine or worker reported it."""
    named = {r for r in ranks if r and not r.startswith("APIServer")}
    # one process, two names: vLLM's "Worker_TP0:300" and NCCL's "host:300" (by process id)
    return max(1, len({r.rsplit(":", 1)[-1] if r.rsplit(":", 1)[-1].isdigit() else r
                       for r in named}))


@dataclass
class Report:
    """What a log says: the diagnoses (root cause first), the furthest phase, the facts."""

    diagnoses: list[Diagnosis]
    phase: str | None
    facts: Facts
    lines: int
    launches: int = 1

    @property
    def root(self) -> Diagnosis | None:
        return self.diagnoses[0] if self.diagnoses else None

    def to_dict(self) -> dict[str, Any]:
        return {"diagnoses": [d.to_dict() for d in self.diagnoses], "phase": self.phase,
                "lines": self.lines, "launches": self.launches,
                "vllm_version": self.facts.numbers.get("vllm_version"),
                "model": _model_of(self.facts)}


def _model_of(facts: Facts) -> dict[str, str] | None:
    """The log's model as the plan's JSON names it (`model.name`), or None."""
    return {"name": facts.model} if facts.model else None


class Scanner:
    """One pass over a log in bounded memory: feed lines, then `report()`."""

    def __init__(self) -> None:
        self.count = 0
        self.launches = 0
        self.vllm_seen = False  # a line naming vLLM (what makes a stream a vLLM log)
        self._version_line = -10  # the line that last named the version
        self._reset()

    def _reset(self) -> None:
        self.phase: str | None = None
        self.marker = "starting"
        self.facts = Facts()
        self.hits: dict[tuple[str, str], _Hit] = {}
        self.unknown: list[Line] = []
        self.unknown_tail: deque[Line] = deque(maxlen=MAX_UNKNOWN // 2)

    def feed(self, raw: str) -> None:
        self.count += 1
        if not self.vllm_seen:
            self.vllm_seen = ("vllm" in raw.lower() or "EngineCore" in raw
                              or "(APIServer" in raw or "api_server.py" in raw)
        if quiet_line(raw):
            # An INFO/DEBUG/WARNING line can only move the phase or add a fact: most of a long
            # log is these, so they skip the prefix split and the failure table. Once serving,
            # only a new launch matters (the start-up facts are behind us).
            if self.phase == "serving":
                if "non-default args: " in raw:
                    self._context(raw)
            elif has_context(raw):
                self._context(raw)
            return
        if raw[:1].isspace() or "]  " in raw or "] \t" in raw:
            # A traceback's frame or source line ("    raise ValueError(...)"): neither an
            # error message nor a marker; the message itself follows as "ValueError: ...".
            # An indented message (pydantic's "  Value error, ...") still counts.
            if SOURCE_LINE.match(raw.split("] ", 1)[-1].strip()) or not RULE_HINT.search(raw):
                return
            hint = True
        else:
            hint = RULE_HINT.search(raw) is not None
        line = split_line(self.count, raw)
        content = line.content
        if not content:
            return
        if line.level not in ("ERROR", "CRITICAL") and not line.indented \
                and has_context(content):
            self._context(content)
        if not line.errorish:
            return
        if hint and self._match(line):
            return
        if not line.wrapper:
            self._remember_error(line)

    def _context(self, text: str) -> None:
        """Launches, phase markers and facts (what the fixes need) in one line."""
        if LAUNCH in text:
            if self.count > 1 and (self.hits or self.phase not in (None, "starting")):
                # a restart appended to the same file: diagnose the last one, with the version
                # its API server printed just before its "non-default args"
                version = self.facts.version if self.count - self._version_line <= 3 else None
                self._reset()
                if version:
                    self.facts.numbers["vllm_version"] = version
            self.launches += 1
        if self.phase != "serving":
            self._advance(text)
        before = self.facts.version
        self.facts.feed(text)
        if self.facts.version != before:
            self._version_line = self.count

    def _advance(self, content: str) -> None:
        found = phase_of(content)
        if found is None:
            return
        phase, marker = found
        if self.phase is None or PHASES.index(phase) >= PHASES.index(self.phase):
            self.phase, self.marker = phase, marker

    def _match(self, line: Line) -> bool:
        content = line.content
        for rule in RULES:
            if line.wrapper and not rule.on_wrappers and "Worker failed with error" not in \
                    content:
                continue
            for key in RULE_KEYS[rule.cause]:
                if key in content:
                    break
            else:
                continue
            m = rule.pattern.search(content)
            if m is None:
                continue
            phase = rule.phase or self.phase or "starting"
            key = (rule.cause, phase)
            hit = self.hits.get(key)
            if hit is None:
                hit = self.hits[key] = _Hit(rule, phase, self.marker, line.number, _numbers(m))
            hit.add(line)
            return True
        return False

    def _remember_error(self, line: Line) -> None:
        """Keep the first and the latest few lines that look like an error, for `unknown`."""
        if not (EXCEPTION_LINE.match(line.content) or ARGPARSE_LINE.match(line.content)
                or (line.level in ("ERROR", "CRITICAL") and not line.indented
                    and not line.content.startswith(("File ", "^", "~")))):
            return
        if len(self.unknown) < MAX_UNKNOWN // 2:
            self.unknown.append(line)
        else:
            self.unknown_tail.append(line)

    def report(self) -> Report:
        hits = dict(self.hits)
        specific = [h for h in hits.values() if h.rule.cause in NCCL_SPECIFIC]
        if specific:  # NCCL's own WARN line says why; torch's "NCCL error" only that it failed
            for key in [k for k, h in hits.items() if h.rule.cause == "nccl_error"]:
                generic = hits.pop(key)
                first = min(specific, key=lambda h: h.first_line)
                first.first_line = min(first.first_line, generic.first_line)
                first.ranks |= generic.ranks
                first.wrapped_only = first.wrapped_only and generic.wrapped_only
        diagnoses = [self._diagnosis(h) for h in sorted(hits.values(), key=_order)]
        if not diagnoses and (self.unknown or self.unknown_tail):
            diagnoses = [self._unknown()]
        return Report(diagnoses, self.phase, self.facts, self.count, max(1, self.launches))

    def _diagnosis(self, hit: _Hit) -> Diagnosis:
        rule = hit.rule
        consumer = rule.consumer
        if consumer == "by_phase":
            consumer = consumer_by_phase(hit.phase, hit.marker, self.facts.cpu)
        elif consumer == "by_budget":
            consumer = consumer_by_budget(self.facts)
        return Diagnosis(cause=rule.cause, phase=hit.phase, consumer=consumer,
                         ranks=_rank_count(hit.ranks), evidence=hit.evidence,
                         transient=rule.transient, source=rule.source,
                         numbers=dict(hit.numbers), first_line=hit.first_line)

    def _unknown(self) -> Diagnosis:
        seen: list[str] = []
        lines = self.unknown + [x for x in self.unknown_tail if x not in self.unknown]
        for x in lines:
            if shown(x.text) not in seen:
                seen.append(shown(x.text))
        root = next((x for x in lines if EXCEPTION_LINE.match(x.content)), lines[0])
        numbers: dict[str, Any] = {}
        if m := EXCEPTION_LINE.match(root.content):
            numbers["exception"] = m.group(1).rsplit(".", 1)[-1]
        return Diagnosis(cause="unknown", phase=self.phase or "starting", consumer="none",
                         ranks=1, evidence=seen, numbers=numbers, first_line=root.number,
                         explain=["no known vLLM failure message matched; these lines look "
                                  "like the error (no fix is guessed)"])


def _order(hit: _Hit) -> tuple[int, int]:
    """Root cause first: the earliest failure reported directly by a process; a failure only
    seen inside wrapper lines (an exit code, an echo) comes after the direct ones."""
    return (1 if hit.wrapped_only else 0, hit.first_line)



def scan_lines(lines: Iterable[str]) -> Report:
    scanner = Scanner()
    for raw in lines:
        scanner.feed(raw)
    return scanner.report()


def scan_text(text: str) -> Report:
    return scan_lines(io.StringIO(text))


# --- what serve and tune retry on --------------------------------------------------------------

# Failure kinds: stable strings that the serve loop and tune compare against.
KV_SHORTAGE = "KV_SHORTAGE"
NO_KV_MEMORY = "NO_KV_MEMORY"
DEVICE_OOM = "DEVICE_OOM"
INSUFFICIENT_FREE_MEMORY = "INSUFFICIENT_FREE_MEMORY"
OTHER = "OTHER"


@dataclass
class Failure:
    """Why the engine did not come up, as far as its log tells (a root `Diagnosis` reduced to
    the kind and numbers re-planning reads)."""

    kind: str  # one of KV_SHORTAGE, NO_KV_MEMORY, DEVICE_OOM, INSUFFICIENT_FREE_MEMORY, OTHER
    message: str  # the line that told us (trimmed), for humans
    max_model_len: int | None = None
    needed_kv_gib: float | None = None
    available_kv_gib: float | None = None
    estimated_max_model_len: int | None = None
    free_gib: float | None = None
    total_gib: float | None = None
    requested_utilization: float | None = None
    requested_gib: float | None = None
    details: dict[str, str] = field(default_factory=dict)
    # The cause (RULES) and whether the same flags may be retried once (memory changed during
    # profiling, an NCCL timeout); a deterministic failure never is.
    cause: str | None = None
    transient: bool = False
    # The machine failed (vLLM or a module missing, no driver, no GPU), not these flags: no
    # verdict on them (tune retries such a trial on --resume and stops the run).
    environment: bool = False

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def to_failure(d: Diagnosis) -> Failure:
    """A diagnosis as the `Failure` serve's and tune's re-planning read."""
    n = d.numbers
    rule = RULE_BY_CAUSE.get(d.cause)

    def num(key: str, conv: Callable[[Any], Any] = float) -> Any:
        return conv(n[key]) if n.get(key) is not None else None

    details = {"cause": d.cause, "consumer": d.consumer, "phase": d.phase}
    if d.cause == "unknown" and n.get("exception"):
        details["exception"] = n["exception"]
    if n.get("device"):
        details["device"] = n["device"]
    return Failure(
        kind=rule.kind if rule else "OTHER",
        message=_strip(d.evidence[0]) if d.evidence else d.cause,
        max_model_len=num("max_model_len", int), needed_kv_gib=num("needed"),
        available_kv_gib=num("available"),
        estimated_max_model_len=num("estimate", int) or num("kv_tokens", int),
        free_gib=num("free"), total_gib=num("total"),
        requested_utilization=num("util"), requested_gib=num("requested"),
        details=details, cause=d.cause, transient=d.transient,
        environment=bool(rule and rule.environment))


def _strip(text: str) -> str:
    return split_line(0, text).content[:2000] or text[:2000]


def classify(text: str) -> Diagnosis | None:
    """The root cause of a failed start in `text`, or None when the log shows no error."""
    report = scan_text(text)
    return report.root
