"""Text made safe for a terminal: no escape sequence or control character from outside gets
through.

Fields vlaunch prints come from places an attacker may write: a Hub config's model_type, a
vLLM log's model name, a plan, a GPU name. A terminal obeys what such text carries: ESC ] 0 ;
retitles it, ESC [ 2 J clears it, a carriage return writes over the line, so a model_type once
printed a fake "FITS" over the real verdict (issue 31, M4). Stripping at each field would miss
the next field added, so the command line strips once, at the edge: while a command runs,
stdout and stderr are `Printable` streams (`guarded()`), and every character written passes
`printable()`. JSON output is unchanged by it: json.dumps already escapes every control
character. term.echo and term.status clean their text with `printable` (term.clean), then add
their own colour codes or carriage return and write to `raw(stream)`: those are the only
escapes that reach the terminal.

Kept separate from term.py (layout) so whichever module draws the text can call it.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["Printable", "guarded", "one_line", "printable", "raw"]

# A CSI sequence (colour, cursor move, clear) goes whole: it is short and well formed, and its
# remnant ("[2J") would only be noise. Any other escape loses its introducer (ESC, the C1
# controls, BEL) below, so its payload ("]0;title") shows as the harmless text it is, and
# nothing the attacker wrote is hidden from the reader.
_SEQUENCE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]")
# What is left: C0 but tab and newline, DEL, C1, and the Unicode controls that reorder or hide
# text (bidi overrides and isolates, as in the "Trojan Source" attack).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` without escape sequences or control characters; tabs and newlines kept, a
    carriage return made a newline."""
    if text.isprintable():  # the common case: nothing to do (newlines are not printable)
        return text
    # A carriage return writes over what came before on its line: as a new line instead,
    # nothing is hidden (a progress bar's updates show one per line).
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("", _SEQUENCE.sub("", text))


def one_line(text: str, limit: int = 200) -> str:
    """A field shown inside a line: printable, newlines and tabs as spaces, at most `limit`."""
    flat = " ".join(printable(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


class Printable:
    """A text stream that writes only `printable` text to the stream it wraps."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner

    def write(self, text: str) -> int:
        self.inner.write(printable(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        if name == "buffer":  # bytes written there would pass unfiltered: no binary side
            raise AttributeError(name)
        return getattr(self.inner, name)


def raw(stream: TextIO) -> TextIO:
    """The stream a `Printable` wraps (the stream itself otherwise), for text that means its
    escapes and was built from `printable` parts."""
    return stream.inner if isinstance(stream, Printable) else stream


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """sys.stdout and sys.stderr as `Printable` streams for the duration of a command."""
    out, err = sys.stdout, sys.stderr
    sys.stdout = Printable(out) if not isinstance(out, Printable) else out  # type: ignore[assignment]
    sys.stderr = Printable(err) if not isinstance(err, Printable) else err  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
