"""vLLM's /metrics page as the exporter reads it: only the families it uses, within bounds.

Why: vLLM's page is mostly histogram buckets the exporter never uses, and a broken or hostile
page (a 30 MB label, a million series) must not make a scrape slow or the exporter's own output
unbounded. `VllmPage` keeps, while the page streams in, only the lines of the needed families,
and counts what it leaves out; `parse_vllm_metrics` turns them into one `VllmSnapshot` (usage
ratio and KV capacity per engine). Pure: no I/O.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Bounds on what is taken from vLLM's page (issue 13 item 18): a line of a family we use is a
# few hundred bytes (cache_config_info, two dozen short labels), an engine label a DP index.
# Beyond these the series is dropped and counted, so a broken or hostile page cannot make a
# scrape slow (the text parser needs ~0.1 s per MB) or the exporter's own output unbounded.
MAX_LINE_BYTES = 8192
MAX_SERIES_PER_FAMILY = 1024
MAX_LABEL_CHARS = 128
DROP_REASONS = ("label_too_long", "too_many_series")
READ_CHUNK = 65536

USAGE_FAMILIES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
CACHE_INFO_FAMILY = "vllm:cache_config_info"
START_TIME_FAMILY = "process_start_time_seconds"
# Requests per engine: what the advisory replica count (families.scaling_families) adds up.
LOAD_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
NEEDED_FAMILIES = (*USAGE_FAMILIES, CACHE_INFO_FAMILY, START_TIME_FAMILY, *LOAD_FAMILIES)

# Only the lines of the families above (samples and their HELP/TYPE) are handed to the parser:
# vLLM's page is mostly histogram buckets we do not use, and parsing all of it took ~60 ms for 8
# engines. A pattern that starts with a literal newline lets `re` skip between lines quickly.
_NEEDED_LINES = re.compile(
    rb"\n((?:# (?:HELP|TYPE) )?("
    + b"|".join(re.escape(n.encode()) for n in NEEDED_FAMILIES)
    + rb")[ {][^\n]*)"
)
_NEEDED_START = re.compile(rb"(?:# (?:HELP|TYPE) )?(?:"
                           + b"|".join(re.escape(n.encode()) for n in NEEDED_FAMILIES) + rb")[ {]")



@dataclass
class EngineSample:
    """What one vLLM engine (DP rank) reported in one scrape; None where it said nothing."""

    usage_ratio: float | None = None
    capacity_tokens: int | None = None
    capacity_bytes: int | None = None
    max_concurrency: float | None = None
    running: float | None = None  # vllm:num_requests_running
    waiting: float | None = None  # vllm:num_requests_waiting


@dataclass
class VllmSnapshot:
    """The result of one fetch of vLLM's /metrics: engines by their `engine` label, or an error."""

    ok: bool
    engines: dict[str, EngineSample] = field(default_factory=dict)
    start_time: float | None = None
    error: str | None = None
    duration_s: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)  # series left out, by reason
    relayed: bytes | None = None  # vLLM's whole page, when the exporter relays it



class ScrapeError(Exception):
    """A failed fetch of vLLM's /metrics; `reason` is one of VLLM_ERROR_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason



class VllmPage:
    """The lines of vLLM's page the exporter uses, kept within bounds while the page streams in.

    Fed chunk by chunk, it never holds more than one chunk, one partial line of at most
    MAX_LINE_BYTES and the kept lines: a 30 MB label is skipped as it arrives, not buffered.
    `dropped` counts, by reason, the series of the needed families that were left out.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES,
                 max_series: int = MAX_SERIES_PER_FAMILY, keep_raw: bool = False) -> None:
        # The whole page as sent, for the exporter to relay (bounded by the client's
        # MAX_BODY_BYTES); None when not relaying.
        self.raw: bytearray | None = bytearray() if keep_raw else None
        self.max_line = max_line
        self.max_series = max_series
        self.lines: list[str] = []
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self._series: dict[bytes, int] = {}
        self._partial = bytearray()
        self._skipping = False

    @classmethod
    def from_text(cls, text: str) -> VllmPage:
        page, data = cls(), text.encode("utf-8")
        for i in range(0, len(data), READ_CHUNK):
            page.feed(data[i:i + READ_CHUNK])
        page.close()
        return page

    def feed(self, chunk: bytes) -> None:
        if self.raw is not None:
            self.raw += chunk
        if self._skipping:  # inside an over-long line: discard up to its end
            nl = chunk.find(b"\n")
            if nl < 0:
                return
            self._skipping = False
            chunk = chunk[nl + 1:]
        nl = chunk.rfind(b"\n")
        if nl < 0:
            self._partial += chunk
        else:
            region = bytes(self._partial) + chunk[:nl]
            self._partial = bytearray(chunk[nl + 1:])
            self._scan(region)
        if len(self._partial) > self.max_line:
            if _NEEDED_START.match(self._partial) and not self._partial.startswith(b"#"):
                self.dropped["label_too_long"] += 1
            self._partial.clear()
            self._skipping = True

    def close(self) -> None:
        if self._partial and not self._skipping:
            self._scan(bytes(self._partial))
        self._partial.clear()

    def _scan(self, region: bytes) -> None:
        for m in _NEEDED_LINES.finditer(b"\n" + region):
            line, name = m.group(1), m.group(2)
            sample = not line.startswith(b"#")
            if len(line) > self.max_line:
                if sample:
                    self.dropped["label_too_long"] += 1
                continue
            if sample:
                seen = self._series.get(name, 0)
                if seen >= self.max_series:
                    self.dropped["too_many_series"] += 1
                    continue
                self._series[name] = seen + 1
            try:
                self.lines.append(line.decode("utf-8"))
            except UnicodeDecodeError:
                raise ScrapeError("malformed", "vLLM /metrics is not UTF-8 text") from None



def _int_label(value: str | None) -> int | None:
    try:
        v = int(float(value)) if value not in (None, "", "None") else None
    except (TypeError, ValueError):
        return None
    return v if v is not None and v > 0 else None


def _float_label(value: str | None) -> float | None:
    try:
        v = float(value) if value not in (None, "", "None") else None
    except (TypeError, ValueError):
        return None
    return v if v is not None and math.isfinite(v) and v > 0 else None


@functools.lru_cache(maxsize=2)
def _parse_cache_info(info_text: str) -> dict[str, dict[str, str]]:
    """Labels of `vllm:cache_config_info` by engine. Memoised: the block is set once at engine
    start and never changes, while its two dozen labels per engine were most of the parse time.
    (At most MAX_SERIES_PER_FAMILY lines of MAX_LINE_BYTES each, so each entry is bounded.)"""
    infos: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(info_text):
        for s in family.samples:
            if s.name == CACHE_INFO_FAMILY:
                infos[s.labels.get("engine") or "0"] = s.labels
    return infos


def parse_vllm_metrics(page: VllmPage | str) -> VllmSnapshot:
    """Pick the usage ratio and the actual KV capacity per engine out of vLLM's exposition.

    Raises ScrapeError("malformed") if the needed families do not parse, and
    ScrapeError("missing_metrics") if no usage gauge is there (stats logging off, or not vLLM).
    Series beyond the bounds (MAX_*) are left out and counted in the snapshot's `dropped`.
    """
    if isinstance(page, str):
        page = VllmPage.from_text(page)
    dropped = dict(page.dropped)
    info_text = "\n".join(x for x in page.lines if CACHE_INFO_FAMILY in x) + "\n"
    other_text = "\n".join(x for x in page.lines if CACHE_INFO_FAMILY not in x) + "\n"
    usage: dict[str, dict[str, float]] = {n: {} for n in USAGE_FAMILIES}
    load: dict[str, dict[str, float]] = {n: {} for n in LOAD_FAMILIES}
    start_time: float | None = None
    try:
        infos = _parse_cache_info(info_text)
        for family in text_string_to_metric_families(other_text):
            for s in family.samples:
                if s.name in usage:
                    if not math.isfinite(s.value):
                        raise ValueError(f"{s.name} is {s.value}")
                    usage[s.name][s.labels.get("engine") or "0"] = s.value
                elif s.name in load and math.isfinite(s.value) and s.value >= 0:
                    per = load[s.name]
                    engine = s.labels.get("engine") or "0"
                    per[engine] = per.get(engine, 0.0) + s.value  # summed over model names
                elif s.name == START_TIME_FAMILY:
                    start_time = s.value
    except ValueError as e:
        raise ScrapeError("malformed", f"vLLM /metrics does not parse: {e}") from None
    # The engine label becomes a label of ours: a long one is dropped, never re-exported.
    for series in (*usage.values(), *load.values(), infos):
        for engine in [e for e in series if len(e) > MAX_LABEL_CHARS]:
            del series[engine]
            dropped["label_too_long"] += 1
    ratios = next((usage[n] for n in USAGE_FAMILIES if usage[n]), None)
    if ratios is None:
        raise ScrapeError(
            "missing_metrics",
            "vLLM /metrics has no vllm:kv_cache_usage_perc (is --disable-log-stats set?)",
        )
    engines = {e: EngineSample(usage_ratio=min(max(v, 0.0), 1.0)) for e, v in ratios.items()}
    for per, attr in zip(load.values(), ("running", "waiting"), strict=True):
        for engine, v in per.items():
            if engine in engines:  # an engine is one that reports its KV usage
                setattr(engines[engine], attr, v)
    # num_gpu_blocks in cache_config_info is the front-end's sum over DP engines, while
    # kv_cache_size_tokens is per engine; split the sum when it is the only number there is.
    n_info = max(len(infos), 1)
    for engine, labels in infos.items():
        if engine not in engines and len(engines) >= MAX_SERIES_PER_FAMILY:
            dropped["too_many_series"] += 1
            continue
        sample = engines.setdefault(engine, EngineSample())
        tokens = _int_label(labels.get("kv_cache_size_tokens"))
        if tokens is None:
            blocks = _int_label(labels.get("num_gpu_blocks"))
            block_size = _int_label(labels.get("block_size"))
            if blocks and block_size:
                tokens = blocks * block_size // n_info
        sample.capacity_tokens = tokens
        sample.capacity_bytes = _int_label(labels.get("kv_cache_memory_bytes"))
        sample.max_concurrency = _float_label(labels.get("kv_cache_max_concurrency"))
    return VllmSnapshot(ok=True, engines=engines, start_time=start_time, dropped=dropped,
                        relayed=relayable(bytes(page.raw)) if page.raw is not None else None)


_OURS = re.compile(rb"^(?:# (?:HELP|TYPE) )?vlaunch_[^\n]*\n?", re.MULTILINE)


def relayable(raw: bytes) -> bytes:
    """vLLM's page as the exporter relays it after its own families: any `vlaunch_*` line
    dropped (a family must appear once in a page, and ours are the exporter's to say), and
    ending in a newline so the two pages join line by line."""
    text = _OURS.sub(b"", raw)
    return text if not text or text.endswith(b"\n") else text + b"\n"

