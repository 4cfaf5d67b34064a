"""Refunds (docs/refunds.md): ``refund``/``arefund`` undo one evaluation's charge at most
once while its window is current, for every algorithm, on the memory model, fakeredis
and a real redis-server (the Cluster case is in tests/test_refunds_cluster.py)."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import async_to_sync

import django_quota
from tests import clock
from tests.test_limiter import configure as configure  # the backend-parametrised fixture

START = 1_764_000_000.0  # a whole hour, inside one UTC day
SUBJECT = {"ip": "198.51.100.9"}
#: Every algorithm with windows of one minute (limit 5), a calendar day, a concurrency
#: policy: (policy, limit).
POLICIES: dict[str, dict[str, Any]] = {
    "fixed_window": {"algorithm": "fixed_window", "windows": "5/m"},
    "sliding_window": {"algorithm": "sliding_window", "windows": "5/m"},
    "sliding_log": {"algorithm": "sliding_log", "windows": "5/m"},
    "token_bucket": {"algorithm": "token_bucket", "windows": "5/m"},
    "calendar": {"algorithm": "fixed_window", "windows": "5/d"},
    "two_windows": {"algorithm": "fixed_window", "windows": {"burst": "5/m", "daily": "50/h"}},
    "concurrency": {"algorithm": "concurrency", "windows": "5/m"},
}
RATES = [name for name in POLICIES if name != "concurrency"]


@pytest.fixture
def frozen(configure: Any) -> Any:
    saved = clock.current
    clock.set_to(START)
    configure(
        CLOCK="tests.clock.now",
        POLICIES={name: {**policy, "selector": ["ip"]} for name, policy in POLICIES.items()},
    )
    yield configure
    clock.set_to(saved)


def remaining(policy: str) -> int:
    found = django_quota.peek(policy, SUBJECT).remaining
    assert found is not None
    return found


@pytest.mark.parametrize("policy", [*RATES, "concurrency"])
def test_a_refund_undoes_its_evaluation_exactly_once(frozen: Any, policy: str) -> None:
    for evaluation_id in ("a", "b", "c"):
        assert django_quota.evaluate(policy, SUBJECT, evaluation_id=evaluation_id).allowed
    clock.set_to(START + 1)
    assert remaining(policy) == 2
    assert django_quota.refund(policy, SUBJECT, "b") == 1
    assert remaining(policy) == 3
    assert django_quota.refund(policy, SUBJECT, "b") == 0  # at most once
    assert async_to_sync(django_quota.arefund)(policy, SUBJECT, "b") == 0
    assert django_quota.refund(policy, SUBJECT, "never-charged") == 0
    assert remaining(policy) == 3
    assert async_to_sync(django_quota.arefund)(policy, SUBJECT, "c") == 1
    assert remaining(policy) == 4


@pytest.mark.parametrize("policy", RATES)
def test_a_refund_of_a_larger_cost_gives_back_that_cost(frozen: Any, policy: str) -> None:
    assert django_quota.evaluate(policy, SUBJECT, cost=3, evaluation_id="big").allowed
    assert django_quota.evaluate(policy, SUBJECT, evaluation_id="small").allowed
    assert remaining(policy) == 1
    assert django_quota.refund(policy, SUBJECT, "big", cost=3) == 3
    assert remaining(policy) == 4
    assert django_quota.refund(policy, SUBJECT, "big", cost=3) == 0


@pytest.mark.parametrize("policy", RATES)
def test_a_refund_gives_back_what_its_evaluation_charged(frozen: Any, policy: str) -> None:
    # No cost given: the counter's ledger remembers what each evaluation charged.
    for name, cost in (("three", 3), ("one", 1)):
        assert django_quota.evaluate(policy, SUBJECT, cost=cost, evaluation_id=name).allowed
    assert remaining(policy) == 1
    assert django_quota.refund(policy, SUBJECT, "three") == 3
    assert remaining(policy) == 4
    assert django_quota.refund(policy, SUBJECT, "three") == 0
    assert async_to_sync(django_quota.arefund)(policy, SUBJECT, "one") == 1
    assert remaining(policy) == 5


@pytest.mark.parametrize("policy", RATES)
def test_cost_caps_a_refund_at_what_was_charged(frozen: Any, policy: str) -> None:
    assert django_quota.evaluate(policy, SUBJECT, cost=3, evaluation_id="three").allowed
    assert django_quota.evaluate(policy, SUBJECT, cost=1, evaluation_id="one").allowed
    # A part of the charge: the rest stays, and the evaluation is refunded (once).
    assert django_quota.refund(policy, SUBJECT, "three", cost=2) == 2
    assert remaining(policy) == 3
    assert django_quota.refund(policy, SUBJECT, "three") == 0
    # Nothing: the charge stays refundable. More than was charged gives back what was
    # charged, never more.
    assert django_quota.refund(policy, SUBJECT, "one", cost=0) == 0
    assert django_quota.refund(policy, SUBJECT, "one", cost=4) == 1
    assert remaining(policy) == 4


@pytest.mark.parametrize("policy", ["fixed_window", "sliding_log", "token_bucket"])
def test_a_full_ledger_of_mixed_costs_refunds_each_exactly(frozen: Any, policy: str) -> None:
    frozen(
        CLOCK="tests.clock.now",
        DEDUP_TTL=0.001,  # a dropped entry is old at once: no repeat is indeterminate
        POLICIES={policy: {**POLICIES[policy], "windows": "100/h", "selector": ["ip"]}},
    )
    # The ledger keeps the newest entries within 72 bytes, 9 for a cost of 1, 15 for
    # another: of these 11 charges, the last 6 (9 + 15 + 15 + 9 + 15 + 9 = 72 bytes).
    costs = [1, 7, 1, 2, 30, 1, 1, 5, 9, 1, 4]
    for index, cost in enumerate(costs):
        clock.set_to(START + index * 0.002)
        assert django_quota.evaluate(policy, SUBJECT, cost=cost, evaluation_id=f"e{index}").allowed
    assert remaining(policy) == 100 - sum(costs)
    assert [django_quota.refund(policy, SUBJECT, f"e{i}") for i in range(len(costs))] == [
        0, 0, 0, 0, 0, *costs[5:]
    ]
    assert remaining(policy) == 100 - sum(costs[:5])


def test_the_edge_of_a_full_window_admits_again_after_a_refund(frozen: Any) -> None:
    for index in range(5):
        django_quota.evaluate("fixed_window", SUBJECT, evaluation_id=f"e{index}")
    assert django_quota.evaluate("fixed_window", SUBJECT).decision == "denied"
    assert django_quota.refund("fixed_window", SUBJECT, "e2") == 1
    assert django_quota.evaluate("fixed_window", SUBJECT).decision == "allowed"
    assert django_quota.evaluate("fixed_window", SUBJECT).decision == "denied"


@pytest.mark.parametrize(
    ("policy", "later"),
    [
        ("fixed_window", 60),
        ("sliding_window", 60),  # the charged count is the next window's prev now
        ("sliding_log", 60),
        ("token_bucket", 60),  # the bucket is full again
        ("calendar", 86_400),
        ("two_windows", 3600),
    ],
)
def test_a_refund_after_the_window_passed_changes_nothing(
    frozen: Any, policy: str, later: int
) -> None:
    for evaluation_id in ("a", "b", "c"):
        django_quota.evaluate(policy, SUBJECT, evaluation_id=evaluation_id)
    clock.set_to(START + later)
    before = django_quota.peek(policy, SUBJECT)
    assert django_quota.refund(policy, SUBJECT, "b") == 0
    after = django_quota.peek(policy, SUBJECT)
    assert (after.remaining, after.reset_after, after.windows) == (
        before.remaining, before.reset_after, before.windows
    )


def test_a_sliding_window_counter_refund_lowers_only_the_current_count(frozen: Any) -> None:
    for evaluation_id in ("a", "b", "c", "d"):  # 4 in the window [START, START + 60)
        django_quota.evaluate("sliding_window", SUBJECT, evaluation_id=evaluation_id)
    clock.set_to(START + 60 + 30)  # half of the next window: estimate floor(4 / 2) = 2
    assert django_quota.evaluate("sliding_window", SUBJECT, evaluation_id="e").remaining == 2
    assert django_quota.refund("sliding_window", SUBJECT, "a") == 0  # its window passed
    assert remaining("sliding_window") == 2
    assert django_quota.refund("sliding_window", SUBJECT, "e") == 1
    assert remaining("sliding_window") == 3  # floor(4 / 2) + 0


def test_a_refunded_sliding_log_event_leaves_the_log(frozen: Any) -> None:
    for offset, evaluation_id in ((0, "a"), (10, "b"), (20, "c")):
        clock.set_to(START + offset)
        django_quota.evaluate("sliding_log", SUBJECT, evaluation_id=evaluation_id)
    clock.set_to(START + 30)
    assert django_quota.peek("sliding_log", SUBJECT).reset_after == 50.0  # c leaves at 80
    assert django_quota.refund("sliding_log", SUBJECT, "c") == 1
    peeked = django_quota.peek("sliding_log", SUBJECT)
    assert (peeked.remaining, peeked.reset_after) == (3, 40.0)  # b, at 10, is the newest
    assert django_quota.refund("sliding_log", SUBJECT, "a") == 1
    clock.set_to(START + 69)  # b has left at 70 - 60 = 10? not yet: inside (9, 69]
    assert remaining("sliding_log") == 4
    clock.set_to(START + 70)  # b left: the log is empty, a and c are gone already
    assert (django_quota.peek("sliding_log", SUBJECT).remaining, remaining("sliding_log")) == (
        5, 5
    )


def test_a_token_bucket_refund_refills_at_most_to_capacity(frozen: Any) -> None:
    django_quota.evaluate("token_bucket", SUBJECT, cost=2, evaluation_id="two")
    clock.set_to(START + 12)  # one token back (5 per minute)
    assert remaining("token_bucket") == 4
    assert django_quota.refund("token_bucket", SUBJECT, "two", cost=2) == 2
    assert remaining("token_bucket") == 5
    assert django_quota.peek("token_bucket", SUBJECT).reset_after == 0.0


def test_refund_rejects_bad_arguments(frozen: Any) -> None:
    with pytest.raises(ValueError):
        django_quota.refund("fixed_window", {}, "a")
    with pytest.raises(ValueError):
        django_quota.refund("fixed_window", SUBJECT, "")
    with pytest.raises(TypeError):
        django_quota.refund("fixed_window", SUBJECT, "a", cost=1.5)  # type: ignore[arg-type]
    assert django_quota.refund("fixed_window", SUBJECT, "a", cost=0) == 0


@pytest.mark.parametrize("policy", ["fixed_window", "sliding_log", "token_bucket"])
def test_a_charge_the_bounded_ledger_dropped_is_refunded_only_by_an_edges_measure(
    frozen: Any, policy: str
) -> None:
    from django_quota import limiter, policies

    frozen(
        CLOCK="tests.clock.now",
        POLICIES={policy: {**POLICIES[policy], "windows": "20/m", "selector": ["ip"]}},
    )
    django_quota.evaluate(policy, SUBJECT, evaluation_id="first")
    clock.set_to(START + 2)
    for index in range(8):  # the ledger keeps the last 8 charges: "first" is dropped
        django_quota.evaluate(policy, SUBJECT, evaluation_id=f"later{index}")
    assert remaining(policy) == 11
    assert django_quota.refund(policy, SUBJECT, "first") == 0  # unknown to the ledger
    request = limiter.refund_request(  # an edge knows what it charged
        policies.get_policy(policy), SUBJECT, "first", 1, since_ms=2000
    )
    assert limiter.refund_charge(request) == 1  # placed by the edge's measure
    assert remaining(policy) == 12
