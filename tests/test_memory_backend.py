"""The memory backend does only what it needs (docs/outcomes.md, docs/metrics.md): no
evaluation id or ledger entry unless the caller passed an id or the group acquires
leases, counter keys derived once per subject, and each algorithm still decided as the
model decides it."""

from __future__ import annotations

from typing import Any

import pytest

import django_quota
from django_quota import limiter, policies
from django_quota.core.evaluation_ids import LedgerLayout
from django_quota.core.protocol import counter_key, fingerprint

SUBJECT = {"ip": "198.51.100.23"}


def _counter(policy_id: str, subject: dict[str, object]) -> str:
    current = limiter.get_limiter()
    policy = policies.get_policy(policy_id)
    return counter_key(current.prefix, policy, current.identity(policy, subject))


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket",
                                       "sliding_log"])
def test_an_evaluation_without_a_caller_id_has_none_and_leaves_no_ledger_entry(
    quota: Any, algorithm: str
) -> None:
    quota(POLICIES={"p": {"algorithm": algorithm, "windows": "3/h", "selector": ["ip"]}})
    outcomes = [django_quota.evaluate("p", SUBJECT) for _ in range(4)]
    assert [outcome.decision for outcome in outcomes] == ["allowed"] * 3 + ["denied"]
    assert [outcome.remaining for outcome in outcomes] == [2, 1, 0, 0]
    assert {outcome.evaluation_id for outcome in outcomes} == {""}
    backend = limiter.get_backend()
    assert backend.peek_records(_counter("p", SUBJECT)) == b""


def test_a_caller_s_id_is_kept_in_the_ledger_and_its_repeat_charges_nothing(quota: Any) -> None:
    quota(POLICIES={"p": {"windows": "3/h", "selector": ["ip"]}})
    django_quota.evaluate("p", SUBJECT)  # no id: no entry
    first = django_quota.evaluate("p", SUBJECT, evaluation_id="order-42")
    again = django_quota.evaluate("p", SUBJECT, evaluation_id="order-42")
    assert (first.evaluation_id, first.remaining) == ("order-42", 1)
    assert (again.decision, again.remaining, again.evaluation_id) == ("allowed", 1, "order-42")
    records = limiter.get_backend().peek_records(_counter("p", SUBJECT))
    assert len(records) == LedgerLayout.ENTRY_BYTES
    assert records[: len(fingerprint("order-42"))] == fingerprint("order-42")


def test_a_concurrency_policy_still_gets_an_id_that_releases_its_lease(quota: Any) -> None:
    quota(POLICIES={"c": {"algorithm": "concurrency", "windows": "1/m", "selector": ["ip"]}})
    held = django_quota.evaluate("c", SUBJECT)
    assert held.decision == "allowed" and len(held.evaluation_id) == 22
    assert django_quota.evaluate("c", SUBJECT).decision == "denied"
    assert django_quota.release("c", SUBJECT, held.evaluation_id) == 1
    assert django_quota.evaluate("c", SUBJECT).decision == "allowed"


def test_a_subject_s_counter_key_is_derived_once_and_bounded(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_quota import engine

    quota(POLICIES={
        "p": {"windows": "5/h", "selector": ["ip"]},
        "u": {"windows": "5/h", "selector": ["user"]},
    })
    current = limiter.get_limiter()
    built: list[object] = []
    original = current.identity

    def counted(policy: Any, subject: Any) -> Any:
        built.append(subject)
        return original(policy, subject)

    monkeypatch.setattr(current, "identity", counted)
    for _ in range(3):
        django_quota.evaluate("p", SUBJECT)
        django_quota.evaluate("u", {"user": 42})
        django_quota.evaluate("u", {"user": "42"})  # another raw value: its own entry
    assert built == [SUBJECT, {"user": 42}, {"user": "42"}]
    # the same key as the identity's derivation, and never the raw identity
    policy = policies.get_policy("p")
    found = current.counter(current.compiled(policy), SUBJECT)
    assert found == counter_key(current.prefix, policy, original(policy, SUBJECT))
    assert SUBJECT["ip"] not in found
    # the bound: every policy's remembered keys are forgotten when it is reached
    monkeypatch.setattr(engine.Sizes, "COUNTER_CACHE", 3)
    other = {"ip": "198.51.100.24"}
    django_quota.evaluate("p", other)
    assert current.compiled(policy).counters == {"198.51.100.24": _counter("p", other)}
    assert current.compiled(policies.get_policy("u")).counters == {}
    assert django_quota.evaluate("p", SUBJECT).remaining == 1


def test_its_own_evaluations_never_push_a_caller_s_id_out_of_the_ledger(quota: Any) -> None:
    """On Redis, 8 more charges drop the caller's entry and its repeat is indeterminate
    (tests/test_isolation.py); the memory backend's own evaluations add no entry, so the
    repeat is still recognised: a replay, nothing charged."""
    quota(POLICIES={"p": {"windows": "1000/h", "selector": ["ip"]}})
    django_quota.evaluate("p", SUBJECT, evaluation_id="first")
    for _ in range(20):
        django_quota.evaluate("p", SUBJECT)
    again = django_quota.evaluate("p", SUBJECT, evaluation_id="first")
    assert (again.decision, again.reason, again.remaining) == ("allowed", None, 979)
    assert django_quota.peek("p", SUBJECT).remaining == 979


def test_a_count_when_policy_gets_an_id_that_refunds_its_charge(quota: Any) -> None:
    """The edges refund a ``count_when`` charge by the outcome's id (docs/refunds.md): the
    memory backend gives such a group one."""
    quota(POLICIES={"r": {"windows": "3/h", "selector": ["ip"], "count_when": ["2xx"]}})
    charged = django_quota.evaluate("r", SUBJECT)
    assert charged.remaining == 2 and len(charged.evaluation_id) == 22
    assert django_quota.refund("r", SUBJECT, charged.evaluation_id) == 1
    assert django_quota.peek("r", SUBJECT).remaining == 3
