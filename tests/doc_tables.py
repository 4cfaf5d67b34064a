"""Reading the reference pages of ``docs/`` back in tests: their Markdown tables, each with
the heading it stands under, and their fenced code blocks.

A table is a run of lines starting with ``|`` whose second line is the delimiter row;
cells are stripped, and one backtick pair around a whole cell is removed (``code``
cells are how the pages spell identifiers)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
_DELIMITER = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_FENCE = re.compile(r"^(`{3,}|~{3,})")


@dataclass(frozen=True)
class Table:
    heading: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def column(self, name: str) -> list[str]:
        """The cells of the column headed ``name``, top to bottom."""
        index = self.header.index(name)
        return [row[index] for row in self.rows]


def page(name: str) -> str:
    """The text of ``docs/<name>``."""
    return (DOCS / name).read_text(encoding="utf-8")


def uncode(cell: str) -> str:
    """A cell without the backticks around it: `` `allowed` `` is ``allowed``."""
    if len(cell) >= 2 and cell.startswith("`") and cell.endswith("`") and cell.count("`") == 2:
        return cell[1:-1]
    return cell


def _cells(line: str) -> tuple[str, ...]:
    inner = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    # A pipe inside a code span is written \| in the tables of these pages.
    parts = re.split(r"(?<!\\)\|", inner)
    return tuple(uncode(part.strip().replace("\\|", "|")) for part in parts)


def tables(text: str) -> list[Table]:
    """Every table of ``text`` (code blocks skipped), with its nearest heading above."""
    found: list[Table] = []
    heading = ""
    lines = text.splitlines()
    fence: str | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        opening = _FENCE.match(line.strip())
        if fence is not None:
            if opening and line.strip().startswith(fence):
                fence = None
            index += 1
            continue
        if opening:
            fence = opening.group(1)
            index += 1
            continue
        match = _HEADING.match(line)
        if match:
            heading = uncode(match.group(2))
        elif (
            line.startswith("|")
            and index + 1 < len(lines)
            and _DELIMITER.match(lines[index + 1].strip())
        ):
            header = _cells(line)
            rows = []
            index += 2
            while index < len(lines) and lines[index].startswith("|"):
                rows.append(_cells(lines[index]))
                index += 1
            found.append(Table(heading, header, tuple(rows)))
            continue
        index += 1
    return found


def table(text: str, heading: str) -> Table:
    """The one table under ``heading`` (fails the test when there is none, or several)."""
    under = [found for found in tables(text) if found.heading == heading]
    assert len(under) == 1, f"expected one table under {heading!r}, found {len(under)}"
    return under[0]


def code_blocks(text: str) -> list[str]:
    """The contents of every fenced code block of ``text``, in order."""
    blocks: list[str] = []
    current: list[str] | None = None
    fence = ""
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            opening = _FENCE.match(stripped)
            if opening:
                fence = opening.group(1)
                current = []
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            blocks.append("\n".join(current))
            current = None
        else:
            current.append(line)
    return blocks
