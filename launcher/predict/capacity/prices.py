"""Where a capacity option's price per GPU-hour comes from: `--price`, `--prices FILE`, or the
catalog's list price for that replica shape.

Why a file beside `--price`: a team's negotiated prices differ by shape (a reserved 8xH100 node
costs less per GPU than a single card) and carry their own source and date; one `--price GPU=USD`
per run cannot say that. Each option names the row it was priced by, so a bill is never read
as more certain than its price.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InputError
from ...inputs.hardware import GPUKind, ShapePrice, gpu_kind
from ...paths import read_small_text

_PRICE = re.compile(r"^\s*([A-Za-z0-9._-]+)\s*=\s*\$?(\d+(?:\.\d+)?)\s*$")


@dataclass(frozen=True)
class Price:
    """One option's price per GPU-hour (None: none known) and the words saying whose it is."""

    usd_per_hour: float | None
    source: str


@dataclass
class PriceBook:
    """The user's prices over the catalog's: `--price` (any shape) first, then the prices
    file (its row for this shape, else its row for any shape of the GPU), then the catalog."""

    flat: dict[str, float] = field(default_factory=dict)  # --price GPU=USD, by catalog name
    rows: dict[tuple[str, int | None], ShapePrice] = field(default_factory=dict)
    file: str = ""

    def price(self, kind: GPUKind, gpus: int) -> Price:
        if kind.name in self.flat:
            return Price(self.flat[kind.name], "your --price")
        row = self.rows.get((kind.name, gpus)) or self.rows.get((kind.name, None))
        if row is not None:
            return Price(row.usd_per_hour, f"{self.file}: {row.source} ({row.date})")
        listed = kind.price_for(gpus)
        if listed is not None:
            return Price(listed.usd_per_hour, listed.describe())
        sold = ", ".join(f"{p.gpus}x" for p in kind.prices)
        return Price(None, f"no list price for {gpus}x{kind.name}"
                     + (f" (the catalog prices {sold})" if sold else "")
                     + ": pass --price or --prices")


def parse_prices(items: tuple[str, ...] | list[str]) -> dict[str, float]:
    """`H200=3.50` (one per --price); keyed by the catalog's canonical name."""
    out: dict[str, float] = {}
    for item in items:
        m = _PRICE.match(item)
        if not m:
            raise InputError(f"malformed --price {item!r}: use GPU=USD_PER_GPU_HOUR, e.g. "
                             "H200=3.50")
        value = float(m.group(2))
        if value <= 0:
            raise InputError(f"--price {item!r}: the price must be more than 0")
        out[gpu_kind(m.group(1)).name] = value
    return out


def read_prices_file(path: str) -> PriceBook:
    """A `--prices FILE` (YAML, launcher/schemas/profiles/prices.json): a list of
    {gpu, gpus (optional: any shape), usd_per_hour, source, date}. One line, exit 2, when the
    file is missing, is not YAML, breaks the schema or names an unknown GPU."""
    import yaml

    from ...profile_check import SCHEMAS, problems

    p = Path(path)
    try:
        data: Any = yaml.safe_load(read_small_text(p))  # a FIFO or /dev/zero: refused
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or "not UTF-8 text"
        raise InputError(f"--prices {path}: cannot read it ({why})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise InputError(f"--prices {path}: not YAML{where}; see "
                         f"{SCHEMAS / 'prices.json'} for its shape") from None
    rows = data.get("prices") if isinstance(data, dict) else None
    for row in rows if isinstance(rows, list) else ():
        if isinstance(row, dict) and isinstance(row.get("date"), datetime.date):
            row["date"] = row["date"].isoformat()  # YAML reads 2026-11-02 unquoted as a date
    found = problems(data, "prices")
    if found:
        raise InputError(f"--prices {path}: {found[0]}; see {SCHEMAS / 'prices.json'} for "
                         "what it may hold")
    book = PriceBook(file=p.name)
    for row in data["prices"]:
        kind = gpu_kind(row["gpu"])
        gpus = row.get("gpus")
        book.rows[(kind.name, gpus)] = ShapePrice(gpus or 0, float(row["usd_per_hour"]),
                                                  row["source"], str(row["date"]))
    return book
