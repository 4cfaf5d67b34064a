"""``docs/outcomes.md`` against the code: the page's tables list exactly the decisions,
reasons, backend modes and certainties of ``django_quota.core.outcome``, and exactly the
fields of ``Outcome`` and ``WindowState``, with their types, in declaration order."""

from __future__ import annotations

import dataclasses

import pytest

from django_quota.core import outcome
from django_quota.core.outcome import Outcome, WindowState
from django_quota.core.policy import ALGORITHMS, parse_policy
from tests.doc_tables import page, table

PAGE = "outcomes.md"


def backend_modes() -> set[str]:
    """Every ``BACKEND_MODE_*`` constant of the outcome module."""
    return {
        value for name, value in vars(outcome).items() if name.startswith("BACKEND_MODE_")
    }


def certainties() -> set[str]:
    """The ``certainty`` of a policy of every algorithm."""
    found = set()
    for algorithm in ALGORITHMS:
        policy = parse_policy("p", {"algorithm": algorithm, "windows": "10/m"})
        found.add(policy.certainty)
    return found


def test_the_decision_table_lists_every_decision_once() -> None:
    decisions = table(page(PAGE), "Decisions").column("decision")
    assert sorted(decisions) == sorted(outcome.DECISIONS)
    assert len(decisions) == len(set(decisions))


def test_the_proceeds_column_is_outcome_allowed() -> None:
    found = table(page(PAGE), "Decisions")
    proceeds = dict(zip(found.column("decision"), found.column("request proceeds"), strict=True))
    assert {d for d, cell in proceeds.items() if cell.startswith("yes")} == set(
        outcome.PROCEEDING_DECISIONS
    )
    assert {d for d, cell in proceeds.items() if cell.startswith("no")} == set(
        outcome.DECISIONS
    ) - set(outcome.PROCEEDING_DECISIONS)


def test_the_reason_table_lists_every_reason_once() -> None:
    reasons = table(page(PAGE), "Reasons").column("reason")
    assert len(reasons) == len(set(reasons))
    exhausted = [reason for reason in reasons if reason.endswith(outcome.QUOTA_EXHAUSTED_SUFFIX)]
    assert exhausted == ["<window>" + outcome.QUOTA_EXHAUSTED_SUFFIX]
    assert set(reasons) - set(exhausted) == set(outcome.FIXED_REASONS)


def test_the_failure_reasons_are_marked_as_failures() -> None:
    found = table(page(PAGE), "Reasons")
    kinds = dict(zip(found.column("reason"), found.column("kind"), strict=True))
    assert {reason for reason, kind in kinds.items() if kind == "backend failure"} == set(
        outcome.FAILURE_REASONS
    )


def test_the_backend_mode_table_lists_every_mode_once() -> None:
    modes = table(page(PAGE), "Backend modes").column("backend_mode")
    assert len(modes) == len(set(modes))
    assert set(modes) == backend_modes()
    assert backend_modes() == {"redis", "memory", "fallback", "cache"}


def test_the_certainty_table_lists_every_certainty() -> None:
    values = table(page(PAGE), "Certainty").column("certainty")
    assert sorted(values) == sorted(certainties()) == ["approximate", "exact"]


@pytest.mark.parametrize("kind", [Outcome, WindowState], ids=lambda kind: kind.__name__)
def test_the_field_table_is_the_dataclass(kind: type) -> None:
    found = table(page(PAGE), kind.__name__)
    documented = list(zip(found.column("field"), found.column("type"), strict=True))
    # ``from __future__ import annotations``: each type is its source text.
    assert documented == [(field.name, field.type) for field in dataclasses.fields(kind)]


@pytest.mark.parametrize("kind", [Outcome, WindowState], ids=lambda kind: kind.__name__)
def test_every_time_field_says_its_unit(kind: type) -> None:
    found = table(page(PAGE), kind.__name__)
    for name, type_text, unit in zip(
        found.column("field"), found.column("type"), found.column("unit"), strict=True
    ):
        if "float" in type_text:
            assert unit == "seconds", (name, unit)
        else:
            assert "seconds" not in unit and "milliseconds" not in unit, (name, unit)
