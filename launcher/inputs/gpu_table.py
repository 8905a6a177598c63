"""`vlaunch gpus`: the table of one inventory reading (NVIDIA or AMD devices alike)."""

from __future__ import annotations

import itertools

from ..term import fit
from .devices import Device, Inventory, _gib
from .hardware import GiB

_BAR_WIDTH = 20


def _ranges(ids: list[int]) -> str:
    """`0-2,4-7`: peers of a GPU on an 8-GPU board fit in a column."""
    out: list[str] = []
    for _, run in itertools.groupby(enumerate(sorted(ids)), key=lambda p: p[1] - p[0]):
        nums = [n for _, n in run]
        out.append(str(nums[0]) if len(nums) == 1 else f"{nums[0]}-{nums[-1]}")
    return ",".join(out) or "-"


def _bar(d: Device, color: bool) -> str:
    taken = (d.total_bytes - d.free_bytes) / d.total_bytes if d.total_bytes else 0.0
    n = min(_BAR_WIDTH, round(taken * _BAR_WIDTH))
    if taken > 0 and n == 0:
        n = 1
    fill = "#" * n
    if color:
        import click  # only the CLI asks for colour

        fill = click.style(fill, fg="green" if taken < 0.5 else "yellow" if taken < 0.8 else "red")
    return f"[{fill}{'.' * (_BAR_WIDTH - n)}]"


def render_table(inv: Inventory, color: bool = False, width: int | None = None) -> str:
    """The `vlaunch gpus` text: one row per device, problems listed under the table.

    With `width` (the terminal's, launcher.term) a row that would run past it lists its
    processes as a count and their total memory instead of one by one, so the columns stay
    aligned; the problems under the table wrap with a hanging indent."""
    def g(n: int) -> str:
        return f"{n / GiB:.1f}"

    head = ["GPU", "NAME", "GiB used/free/total", "CC", "MIG", "PROCESSES", "NVLINK"]
    rows = []
    bars = []
    listed: list[str] = []
    for d in inv.devices:
        name = d.name.replace("NVIDIA ", "")
        if d.error:
            rows.append([d.label, name, f"error: {d.error}", d.compute_capability or "-", "-",
                         "-", "-"])
            bars.append(" " * (_BAR_WIDTH + 2))
            listed.append("-")
            continue
        procs = ", ".join(f"{p.pid} {p.name} {_gib(p.used_bytes)}" for p in d.processes) or "-"
        listed.append(f"{len(d.processes)} processes, "
                      f"{_gib(sum(p.used_bytes for p in d.processes))}"
                      if len(d.processes) > 1 else procs)
        mem = f"{g(d.total_bytes - d.free_bytes)}/{g(d.free_bytes)}/{g(d.total_bytes)}"
        rows.append([d.label, name, mem, d.compute_capability or "-",
                     "on" if d.mig_enabled else "off", procs,
                     "-" if d.mig_index is not None else _ranges(d.nvlink_peers)])
        bars.append(_bar(d, color))

    def widths_of(rs: list[list[str]]) -> list[int]:
        return [max(len(r[i]) for r in [head, *rs]) for i in range(len(head))]

    def too_wide(ws: list[int], bar: bool) -> bool:
        return width is not None and sum(ws) + 2 * (len(ws) - 1) + (_BAR_WIDTH + 4) * bar > width

    widths = widths_of(rows)
    if too_wide(widths, True):  # first the process lists, then the bar, give way
        for r, short in zip(rows, listed, strict=True):
            if len(r[5]) > len(short):
                r[5] = short
        widths = widths_of(rows)
    show_bar = not too_wide(widths, True)

    def line(cells: list[str], bar: str) -> str:
        parts = [c.ljust(w) for c, w in zip(cells, widths, strict=True)]
        if show_bar:
            parts.insert(2, bar)  # the bar is always _BAR_WIDTH + 2 visible characters
        return "  ".join(parts).rstrip()

    seen = f"{len(inv.devices)} device{'s' if len(inv.devices) != 1 else ''}"
    if inv.hidden:
        seen += f" ({inv.hidden} hidden by {inv.visibility})"
    elif inv.visibility:
        seen += f" ({inv.visibility})"
    stack = (f"CUDA {inv.cuda_driver_version or '?'}" if inv.platform == "cuda" else "ROCm")
    out = [f"driver {inv.driver_version or '?'}  {stack}  {seen}",
           line(head, "USE".ljust(_BAR_WIDTH + 2))]
    out += [line(r, b) for r, b in zip(rows, bars, strict=True)]
    notes = [f"! {e}" for e in inv.errors]
    out += fit(notes, width) if width is not None else notes
    return "\n".join(out)
