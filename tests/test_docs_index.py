"""docs/index.md: its links read as the pages' titles, not their file names, and it
links every page of the navigation."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
ROOT = DOCS.parent
#: A list entry of the index: ``- [Title](page.md): what it holds``.
ENTRY = re.compile(r"^- \[([^\]]+)\]\(([a-z0-9-]+\.md)\):", re.M)


def title(page: str) -> str:
    first = (DOCS / page).read_text().splitlines()[0]
    assert first.startswith("# "), page
    return first.removeprefix("# ")


def index_links() -> list[tuple[str, str]]:
    """``(text, page)`` of each entry, the tutorial's link in the opening line included."""
    text = (DOCS / "index.md").read_text()
    return [("Tutorial", "tutorial.md"), *ENTRY.findall(text)]


def test_the_index_lists_pages_by_title() -> None:
    entries = ENTRY.findall((DOCS / "index.md").read_text())
    assert len(entries) > 20
    assert [text for text, page in entries if text != title(page)] == []


def test_the_index_links_every_page_of_the_navigation() -> None:
    nav = set(re.findall(r"([a-z0-9-]+\.md)", (ROOT / "mkdocs.yml").read_text()))
    linked = {page for _, page in index_links()}
    assert nav - {"index.md"} <= linked
