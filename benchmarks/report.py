"""The printed report: one main table (a Markdown pipe table, aligned for the terminal),
then the whole-request table, the per-command and per-key breakdowns, the notes, and the
goals block last."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks import engine, goals, whole_request
from benchmarks.measure import Exactness, Footprint

Classifier = Callable[[str], str]


@dataclass
class Row:
    key: str
    reference: str
    implementation: str
    algorithm: str
    median_us: float
    p99_us: float
    throughput_1: float
    throughput_n: float
    commands: float | None
    server_cpu_us: float | None
    command_breakdown: dict[str, float]
    sent: float | None
    footprints: dict[int, Footprint] = field(default_factory=dict)
    exactness: Exactness | None = None
    base: str | None = None

    @property
    def name(self) -> str:
        return f"{self.implementation} {self.algorithm}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if index in right else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _ratio(value: float, reference: float | None) -> str:
    if not reference:
        return "-"
    return f"{value / reference:.2f}x"


def _bytes(footprint: Footprint | None) -> str:
    if footprint is None:
        return "-"
    return f"{footprint.bytes:,}"


def _keys(count: int) -> str:
    return f"{count} key" if count == 1 else f"{count} keys"


def _key_counts(row: Row) -> str:
    counts = [row.footprints[n].keys for n in sorted(row.footprints)]
    return ", ".join(str(count) for count in counts) if counts else "-"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _whole_requests(rows: Sequence[Row], by_key: dict[str, Row]) -> list[str]:
    requests = [row for row in rows if row.key.startswith("request/")]
    if not requests:
        return []
    drf = by_key.get(whole_request.DRF_THROTTLED)
    drf_added = whole_request.added_us(drf, by_key) if drf else None
    table_rows = []
    for row in requests:
        added = whole_request.added_us(row, by_key)
        base = by_key.get(row.base) if row.base else None
        share = "-"
        if added is not None and drf_added is not None and drf_added > 0:
            share = f"{added / drf_added:.2f}x"
        table_rows.append(
            [
                row.name,
                _us(row.median_us),
                _us(row.p99_us),
                base.name if base else "-",
                _us(added),
                share,
            ]
        )
    headers = ["row", "µs median", "µs p99", "base", "µs added", "added / DRF's added"]
    return [
        "",
        "Whole requests through WSGIHandler, in process (µs per request; added: this "
        "row's median minus its base's; DRF's added: DRF AnonRateThrottle's):",
        "",
        _table(headers, table_rows, right={1, 2, 4, 5}),
    ]


def _goals(rows: Sequence[Row], figures: engine.EngineFigures | None) -> list[str]:
    found = goals.evaluate(rows, figures)
    table_rows = [[goal.goal, goal.measured, goal.target, goal.verdict] for goal in found]
    return [
        "",
        "goals (this run's figures; printed, never asserted):",
        "",
        _table(["goal", "measured", "target", "verdict"], table_rows, right={1}),
    ]


def _exact(exactness: Exactness | None) -> str:
    if exactness is None:
        return "-"
    return f"{exactness.admitted}/{exactness.limit}"


def render(
    rows: Sequence[Row],
    *,
    header: Sequence[str],
    notes: Sequence[str],
    args: argparse.Namespace,
    cores: int,
    seconds: float,
    figures: engine.EngineFigures | None = None,
) -> str:
    by_key = {row.key: row for row in rows}
    threads = args.threads
    headers = [
        "implementation",
        "algorithm",
        "µs median",
        "µs p99",
        "dec/s 1 thread",
        f"dec/s {threads} threads",
        "ratio 1t",
        f"ratio {threads}t",
        "Redis cmds/dec",
        "sent/dec",
        "Redis CPU µs/dec",
        "bytes/subject @1",
        "bytes/subject @100",
        "keys/subject @1, @100",
        "admitted/limit",
    ]
    table_rows = []
    for row in rows:
        reference = by_key.get(row.reference)
        table_rows.append(
            [
                row.implementation,
                row.algorithm,
                f"{row.median_us:,.0f}",
                f"{row.p99_us:,.0f}",
                f"{row.throughput_1:,.0f}",
                f"{row.throughput_n:,.0f}",
                _ratio(row.throughput_1, reference.throughput_1 if reference else None),
                _ratio(row.throughput_n, reference.throughput_n if reference else None),
                "-" if row.commands is None else f"{row.commands:.2f}",
                "-" if row.sent is None else f"{row.sent:.2f}",
                "-" if row.server_cpu_us is None else f"{row.server_cpu_us:.0f}",
                _bytes(row.footprints.get(1)),
                _bytes(row.footprints.get(100)),
                _key_counts(row),
                _exact(row.exactness),
            ]
        )
    out = [
        "",
        f"django-quota benchmark: {args.decisions} decisions per row and loop, "
        f"{args.rounds} interleaved round{'' if args.rounds == 1 else 's'}, "
        f"{args.subjects} subjects, {cores} cores, "
        f"{seconds:.0f} s",
        "; ".join(header),
        "",
        _table(headers, table_rows, right=set(range(2, len(headers)))),
        "",
        "ratio: this row's decisions/s divided by the django-quota row it is compared to "
        "(same algorithm, else fixed_window; async rows: django-quota's async row; "
        "whole requests: django-quota's row of the same kind); above 1.00x is faster "
        f"than django-quota. Async rows: {threads} tasks in one event loop instead of "
        f"{threads} threads. Compared to a row of another algorithm or kind:",
    ]
    names = {row.key: row.name for row in rows}
    out += [
        f"- {names[row.key]} -> {names.get(row.reference, row.reference)}"
        for row in rows
        if row.reference and row.key != row.reference
    ]
    out += _whole_requests(rows, by_key)
    out += ["", "Redis commands per decision, by command (Lua's redis.call included):", ""]
    command_rows = []
    for row in rows:
        if not row.command_breakdown:
            continue
        parts = ", ".join(f"{name} {count:.2f}" for name, count in row.command_breakdown.items())
        command_rows.append([row.name, parts])
    out.append(_table(["row", "commands/decision"], command_rows, right=set()))
    out += ["", "Redis keys per subject (after 1 and after 100 decisions):", ""]
    key_rows = []
    for row in rows:
        if not row.footprints:
            continue
        cells = []
        for decisions in sorted(row.footprints):
            footprint = row.footprints[decisions]
            kinds = ", ".join(
                f"{kind}: {_keys(keys)} {size:,} B"
                for kind, (keys, size) in sorted(footprint.by_kind.items())
            )
            text = f"@{decisions}: {_keys(footprint.keys)} {footprint.bytes:,} B"
            cells.append(f"{text} ({kinds})" if kinds else text)
        key_rows.append([row.name, "; ".join(cells)])
    out.append(_table(["row", "keys and bytes"], key_rows, right=set()))
    exact_notes = [
        f"{row.implementation} {row.algorithm}: {row.exactness.admitted} admitted of "
        f"{row.exactness.attempts} attempts, limit {row.exactness.limit}"
        for row in rows
        if row.exactness is not None and row.exactness.admitted != row.exactness.limit
    ]
    if exact_notes:
        out += ["", "admitted != limit:", *(f"- {note}" for note in exact_notes)]
    if notes:
        out += ["", "notes:", *(f"- {note}" for note in notes)]
    if figures is not None:
        out += engine.table(figures)
    out += _goals(rows, figures)
    return "\n".join(out)
