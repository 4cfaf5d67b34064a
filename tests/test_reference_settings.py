"""The reference pages hold to the code: docs/settings.md lists every ``QUOTA`` key with
its default exactly as ``conf.DEFAULTS`` has it, and names only check ids that exist."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from django_quota import conf

DOCS = Path(__file__).resolve().parent.parent / "docs"
SOURCE = Path(conf.__file__).resolve().parent
#: How a check id is written in the source: ``"django_quota.E001"``.
CHECK_ID = re.compile(r"django_quota\.([EW]\d{3})")
HEADER = ["key", "default", "type", "unit", "what it does", "checks"]
UNITS = {"seconds", "-"}


def split_row(line: str) -> list[str]:
    """The cells of one Markdown table row (a ``|`` inside backticks does not split)."""
    cells, current, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    cells.append(current.strip())
    return cells


def settings_table() -> dict[str, dict[str, str]]:
    """The rows of the settings table of docs/settings.md, by key (the first table whose
    header starts with ``| key | default |``)."""
    lines = (DOCS / "settings.md").read_text().splitlines()
    start = next(
        at for at, line in enumerate(lines) if split_row(line)[:2] == ["key", "default"]
    )
    header = split_row(lines[start])
    rows: dict[str, dict[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, split_row(line), strict=True))
        key = row["key"]
        assert key not in rows, f"{key} is listed twice"
        rows[key] = row
    return rows


def literal(cell: str) -> object:
    """The Python value a ``default`` cell shows in backticks."""
    match = re.fullmatch(r"`([^`]*)`", cell)
    assert match is not None, f"a default is one literal in backticks, not {cell!r}"
    return ast.literal_eval(match.group(1))


def code_check_ids() -> set[str]:
    """Every check id the package's source defines or reports (``E001``, ``W001``…)."""
    return {
        found
        for path in SOURCE.rglob("*.py")
        for found in CHECK_ID.findall(path.read_text())
    }


def test_settings_table_has_the_reference_columns() -> None:
    lines = (DOCS / "settings.md").read_text().splitlines()
    headers = [split_row(line) for line in lines if split_row(line)[:2] == ["key", "default"]]
    assert headers == [HEADER]


def test_settings_table_lists_exactly_the_keys_of_the_code() -> None:
    assert sorted(settings_table()) == sorted(f"`{key}`" for key in conf.DEFAULTS)


def test_each_documented_default_is_the_code_default() -> None:
    rows = settings_table()
    for key, default in conf.DEFAULTS.items():
        documented = literal(rows[f"`{key}`"]["default"])
        # Exactly: 1 and 1.0, or [] and (), would compare equal.
        assert (documented, type(documented)) == (default, type(default)), key


def test_durations_say_seconds_and_other_keys_say_no_unit() -> None:
    """Float fields of QuotaSettings are durations in seconds (its docstring), and
    FAILURE_RETRY_AFTER is a whole number of seconds; nothing else has a unit."""
    hints = typing.get_type_hints(conf.QuotaSettings)
    durations = {
        field.name.upper()
        for field in dataclasses.fields(conf.QuotaSettings)
        if hints[field.name] is float
    } | {"FAILURE_RETRY_AFTER"}
    assert durations == {
        "MAX_CLOCK_REGRESSION", "TIMEOUT", "DEADLINE", "DEDUP_TTL", "CLEANUP_GRACE",
        "POLICY_CACHE_TTL", "FAILURE_RETRY_AFTER",
    }
    units = {key.strip("`"): row["unit"] for key, row in settings_table().items()}
    assert set(units.values()) <= UNITS
    assert {key for key, unit in units.items() if unit == "seconds"} == durations


def test_the_checks_named_for_each_key_exist_and_link_to_the_checks_page() -> None:
    known = code_check_ids()
    link = re.compile(r"\[([EW]\d{3})\]\(checks\.md#([ew]\d{3})\)")
    for key, row in settings_table().items():
        named = link.findall(row["checks"])
        assert named, f"{key} names no check"
        assert all(check.lower() == anchor for check, anchor in named), key
        assert {check for check, _ in named} <= known, key
        # Every id in the cell is such a link: no bare or misspelt id.
        assert not re.search(r"[EW]\d{3}", link.sub("", row["checks"])), key


# -- docs/checks.md ------------------------------------------------------------------------
#: Where check ids are defined: a constant ``X = "django_quota.E001"`` each.
DEFINED_ID = re.compile(r'^    [EW]_\w+ = "django_quota\.([EW]\d{3})"$', re.M)  # messages.Codes


def defined_check_ids() -> set[str]:
    return {
        found
        for module in ("messages.py",)
        for found in DEFINED_ID.findall((SOURCE / module).read_text())
    }


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: str) -> set[str]:
    text = (DOCS / page).read_text()
    return {slug(found) for found in re.findall(r"^#+ (.+)$", text, re.M)}


def check_sections() -> dict[str, str]:
    """The text of each ``### E001`` section of docs/checks.md, by id."""
    text = (DOCS / "checks.md").read_text()
    parts = re.split(r"^### ([EW]\d{3})$", text, flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert len(sections) == len(parts[1::2]), "an id has two sections"
    return sections


def test_every_check_id_is_defined_once_and_reported_somewhere() -> None:
    defined = defined_check_ids()
    assert len(defined) >= 21
    assert defined == code_check_ids()  # no id used in the source that is not defined


def test_checks_page_documents_exactly_the_ids_of_the_code() -> None:
    sections = check_sections()
    assert set(sections) == defined_check_ids()
    summary = set(re.findall(r"^\| \[`django_quota\.([EW]\d{3})`\]\(#([ew]\d{3})\)",
                             (DOCS / "checks.md").read_text(), re.M))
    assert summary == {(check, check.lower()) for check in defined_check_ids()}


def test_each_check_section_names_its_id_shows_its_messages_and_a_fix() -> None:
    for check, section in check_sections().items():
        section = section.split("\n## ")[0]  # the "## Warnings" heading ends E013
        assert f"`django_quota.{check}`" in section, check
        shown = re.findall(r"^\?: \(django_quota\.([EW]\d{3})\) ", section, re.M)
        assert shown and set(shown) == {check}, check
        assert "Fix:" in section and "```python\n" in section.split("Fix:", 1)[1], check


def test_settings_and_checks_pages_link_each_other_to_anchors_that_exist() -> None:
    settings_page = (DOCS / "settings.md").read_text()
    checks_page = (DOCS / "checks.md").read_text()
    to_checks = set(re.findall(r"\]\(checks\.md#([\w-]+)\)", settings_page))
    to_settings = set(re.findall(r"\]\(settings\.md#([\w-]+)\)", checks_page))
    assert to_checks and to_checks <= anchors("checks.md")
    assert to_settings and to_settings <= anchors("settings.md")
    assert "](settings.md)" in checks_page and "](checks.md)" in settings_page
