"""docs/policies.md lists every policy key with its default, as core/policy.py parses it."""

from __future__ import annotations

import re
from pathlib import Path

from django_quota.core.policy import Enforcement, Form, Selector, parse_policy

PAGE = Path(__file__).resolve().parent.parent / "docs" / "policies.md"


def key_rows() -> dict[str, str]:
    """The "Policy keys" table: key -> its default cell."""
    section = PAGE.read_text().split("## Policy keys", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([a-z_]+)` \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def test_the_page_lists_exactly_the_policy_keys() -> None:
    assert set(key_rows()) == Form.KEYS


def test_the_documented_defaults_are_the_parsed_ones() -> None:
    rows = key_rows()
    policy = parse_policy("p", {"windows": "5/m"})
    assert rows["algorithm"] == f'`"{policy.algorithm}"`'
    assert rows["selector"] == f'`["{Selector.AUTO}"]`' and policy.selector == (Selector.AUTO,)
    assert rows["enforcement"] == f'`"{Enforcement.ENFORCE}"`'
    assert policy.enforcement == Enforcement.ENFORCE
    assert rows["on_missing"] == f'`"{policy.on_missing}"`'
    assert rows["max_cost"] == "`None`" and policy.max_cost is None
    assert rows["enabled"] == "`True`" and policy.enabled is True
    assert rows["routes"] == "none" and policy.routes == ()
    assert rows["methods"].startswith("`[]`") and policy.methods == ()
    assert policy.failure_mode is None and "FAILURE_MODE" in rows["failure_mode"]
    bucket = parse_policy("b", {"algorithm": "token_bucket", "windows": "7/m"})
    assert rows["capacity"] == "each window's limit" and bucket.windows[0].capacity == 7
