"""The chart of a run (``--plot FILE``): a PNG drawn with matplotlib's Agg backend.

The first panel puts the p50 µs per decision of each django-quota row beside its peers'
(the rows whose ratio is taken to it in the report), as horizontal bars, each peer's bar
annotated with django-quota's p50 divided by that peer's, the ratio the goals block
prints. The second panel, when the run measured whole requests, puts each row beside its
base (the view without a throttle or middleware) with the µs it adds, and that added
cost divided by DRF ``AnonRateThrottle``'s.

matplotlib is imported only when a chart is drawn: a run without ``--plot`` needs none.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import whole_request
from benchmarks.contenders import DQ
from benchmarks.report import Row

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: Bar colours: django-quota's rows, the peers', the whole-request bases.
OURS = "#2f6db5"
PEERS = "#d9822b"
BASES = "#9a9a9a"
#: Characters of a row name on one line of the axis labels.
LABEL_WIDTH = 52
REQUEST_PREFIX = f"{whole_request.IMPLEMENTATION} "


@dataclass(frozen=True, slots=True)
class Bar:
    """One bar: its label, its p50 and the text printed after it."""

    label: str
    median_us: float
    note: str
    colour: str


def _is_request(row: Row) -> bool:
    return row.key.startswith("request/")


def _is_ours(row: Row) -> bool:
    return row.implementation.startswith(DQ)


def decision_groups(rows: Sequence[Row]) -> list[list[Row]]:
    """The decision rows (not whole requests), each django-quota row first in its group,
    followed by the peers whose ratio the report takes to it; a peer whose django-quota
    row was not measured (``--only``) stands alone."""
    decisions = [row for row in rows if not _is_request(row)]
    ours = {row.key for row in decisions if _is_ours(row)}
    groups = [
        [row, *(p for p in decisions if not _is_ours(p) and p.reference == row.key)]
        for row in decisions
        if _is_ours(row)
    ]
    groups += [[p] for p in decisions if not _is_ours(p) and p.reference not in ours]
    return groups


def request_groups(rows: Sequence[Row]) -> list[list[Row]]:
    """The whole-request rows, each base followed by the rows measured over it; a row
    whose base was not measured stands alone."""
    requests = [row for row in rows if _is_request(row)]
    bases = {row.key for row in requests if row.base is None}
    groups = [
        [base, *(row for row in requests if row.base == base.key)]
        for base in requests
        if base.base is None
    ]
    groups += [[row] for row in requests if row.base is not None and row.base not in bases]
    return groups


def _label(row: Row) -> str:
    return textwrap.fill(row.name.removeprefix(REQUEST_PREFIX), LABEL_WIDTH)


def decision_bars(group: Sequence[Row]) -> list[Bar]:
    """A group's bars: django-quota's with its p50, each peer's with the ratio of
    django-quota's p50 to its own."""
    first = group[0]
    ours = first if _is_ours(first) else None
    bars = []
    for row in group:
        note = f"{row.median_us:,.0f} µs"
        if ours is not None and row is not ours and row.median_us > 0:
            note += f"   django-quota / this: {ours.median_us / row.median_us:.2f}x"
        bars.append(Bar(_label(row), row.median_us, note, OURS if _is_ours(row) else PEERS))
    return bars


def request_bars(group: Sequence[Row], rows: Sequence[Row]) -> list[Bar]:
    """A group's bars: the base with its p50, each row over it with the µs it adds and
    that added cost divided by DRF AnonRateThrottle's."""
    by_key = {row.key: row for row in rows}
    drf = by_key.get(whole_request.DRF_THROTTLED)
    drf_added = whole_request.added_us(drf, by_key) if drf is not None else None
    bars = []
    for row in group:
        note = f"{row.median_us:,.0f} µs"
        added = whole_request.added_us(row, by_key)
        if added is not None:
            note += f"   +{added:,.0f} µs"
            if drf_added is not None and drf_added > 0:
                note += f", {added / drf_added:.2f}x DRF's added"
        colour = BASES if row.base is None else OURS if DQ in row.implementation else PEERS
        bars.append(Bar(_label(row), row.median_us, note, colour))
    return bars


def _panel(axes: Axes, groups: Sequence[Sequence[Bar]], title: str, xlabel: str) -> None:
    """Horizontal bars, top to bottom in the order given, a gap between groups."""
    positions: list[float] = []
    bars: list[Bar] = []
    y = 0.0
    for group in groups:
        for bar in group:
            positions.append(y)
            bars.append(bar)
            y += 1.0
        y += 0.6
    widths = [bar.median_us for bar in bars]
    axes.barh(positions, widths, height=0.8, color=[bar.colour for bar in bars])
    largest = max(widths, default=0.0) or 1.0
    for position, bar in zip(positions, bars, strict=True):
        axes.text(bar.median_us + largest * 0.01, position, bar.note, va="center", fontsize=8)
    axes.set_yticks(positions)
    axes.set_yticklabels([bar.label for bar in bars], fontsize=8)
    axes.invert_yaxis()
    # Room on the right for the longest note.
    axes.set_xlim(0, largest * 1.75)
    axes.set_xlabel(xlabel, fontsize=9)
    axes.set_title(title, fontsize=10, loc="left")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)


def plot(rows: Sequence[Row], path: Path, *, subtitle: str = "") -> None:
    """Draw the chart of ``rows`` into the PNG file ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    decisions = [decision_bars(group) for group in decision_groups(rows)]
    requests = [request_bars(group, rows) for group in request_groups(rows)]
    panels = [
        (
            decisions,
            "p50 per decision: each django-quota row (blue) beside its peers",
            "µs per decision, median (lower is faster)",
        ),
        (
            requests,
            "whole requests through Django's WSGIHandler: each row beside its base (grey)",
            "µs per request, median; +µs: added over the base",
        ),
    ]
    panels = [panel for panel in panels if panel[0]]
    if not panels:
        raise ValueError("no rows to plot")
    heights = [sum(len(group) for group in groups) + 0.6 * len(groups) for groups, _, _ in panels]
    figure = Figure(figsize=(11, 1.2 + 0.34 * sum(heights)), layout="constrained")
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    for axes, (groups, title, xlabel) in zip(axes_list, panels, strict=True):
        _panel(axes, groups, title, xlabel)
    heading = "django-quota and its peers on one redis-server"
    figure.suptitle(f"{heading}\n{subtitle}" if subtitle else heading, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
