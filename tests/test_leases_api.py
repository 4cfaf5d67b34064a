"""Concurrency policies through the Python API (docs/concurrency.md): outcomes, release
and arelease, groups with rate policies decided all or nothing in both directions,
headers, the check of their windows; on the memory backend and a real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync

import django_quota
from django_quota import limiter, policies
from django_quota.checks import check_settings
from django_quota.core.errors import ConfigurationError
from django_quota.core.policy import parse_policy
from django_quota.http import rate_limit_headers
from tests import leases

USER = {"user": "42"}
POLICIES = {
    "inflight": {"algorithm": "concurrency", "windows": "2/m", "selector": ["user"]},
    "burst": {"algorithm": "fixed_window", "windows": "3/m", "selector": ["user"]},
    "shadowed": {
        "algorithm": "concurrency",
        "windows": "1/m",
        "selector": ["user"],
        "enforcement": "shadow",
    },
}


@pytest.fixture(params=leases.BACKENDS)
def backend(request: pytest.FixtureRequest, quota: Any) -> Iterator[str]:
    with leases.configured(request, quota, POLICIES, USER) as name:
        yield name


def group(*ids: str) -> list[Any]:
    return [policies.get_policy(policy_id) for policy_id in ids]


def decide(*ids: str, evaluation_id: str | None = None, cost: int = 1) -> list[Any]:
    return limiter.evaluate_policies(
        group(*ids), lambda policy: USER, cost, evaluation_id=evaluation_id
    )


def test_outcome_numbers_release_and_release_twice(backend: str) -> None:
    first = django_quota.evaluate("inflight", USER, evaluation_id="a")
    assert (first.decision, first.remaining, first.limit, first.window) == (
        "allowed", 1, 2, "default"
    )
    assert first.reset_after == 60.0  # the only lease: its whole period
    second = django_quota.evaluate("inflight", USER, evaluation_id="b")
    assert second.remaining == 0 and 59 <= second.reset_after <= 60
    third = django_quota.evaluate("inflight", USER, evaluation_id="c")
    assert third.decision == "denied" and third.reason == "default_quota_exhausted"
    assert third.retry_after == third.reset_after and 59 <= third.retry_after <= 60
    peeked = django_quota.peek("inflight", USER)
    assert (peeked.decision, peeked.remaining) == ("denied", 0)
    assert django_quota.release("inflight", USER, "a") == 1
    assert django_quota.release("inflight", USER, "a") == 0  # releasing twice releases once
    assert django_quota.release("inflight", USER, "never") == 0
    assert async_to_sync(django_quota.arelease)("inflight", USER, "b") == 1
    empty = django_quota.peek("inflight", USER)
    assert (empty.decision, empty.remaining, empty.reset_after) == ("allowed", 2, 0.0)


def test_a_repeated_evaluation_id_acquires_once(backend: str) -> None:
    assert django_quota.evaluate("inflight", USER, cost=2, evaluation_id="x").remaining == 0
    again = django_quota.evaluate("inflight", USER, cost=2, evaluation_id="x")
    assert (again.decision, again.remaining) == ("allowed", 0)
    assert django_quota.release("inflight", USER, "x") == 2


def test_cost_is_units_held_and_above_n_is_refused_without_a_call(backend: str) -> None:
    assert django_quota.evaluate("inflight", USER, cost=2, evaluation_id="two").remaining == 0
    refused = django_quota.evaluate("inflight", USER, cost=3)
    assert (refused.decision, refused.reason) == ("denied", "cost_exceeds_limit")
    assert django_quota.release("inflight", USER, "two") == 2


def test_a_denied_rate_policy_acquires_no_lease(backend: str) -> None:
    for _ in range(3):
        assert all(o.decision == "allowed" for o in decide("burst"))
    outcomes = decide("burst", "inflight", evaluation_id="refused")
    assert [o.decision for o in outcomes] == ["denied", "allowed"]
    assert django_quota.peek("inflight", USER).remaining == 2  # no lease acquired
    assert django_quota.release("inflight", USER, "refused") == 0


def test_a_full_concurrency_policy_charges_no_rate(backend: str) -> None:
    django_quota.evaluate("inflight", USER, cost=2, evaluation_id="full")
    outcomes = decide("burst", "inflight")
    assert [o.decision for o in outcomes] == ["allowed", "denied"]
    assert django_quota.peek("burst", USER).remaining == 3  # nothing charged
    django_quota.release("inflight", USER, "full")
    outcomes = decide("burst", "inflight", evaluation_id="both")
    assert [o.decision for o in outcomes] == ["allowed", "allowed"]
    assert django_quota.peek("burst", USER).remaining == 2
    assert django_quota.release("inflight", USER, "both") == 1


def test_a_shadow_concurrency_policy_never_refuses(backend: str) -> None:
    django_quota.evaluate("shadowed", USER, evaluation_id="first")
    over = decide("burst", "shadowed", evaluation_id="second")
    assert [o.decision for o in over] == ["allowed", "shadow_denied"]
    assert django_quota.peek("burst", USER).remaining == 2  # charged: shadow never blocks


def test_headers_report_n_without_a_window(backend: str) -> None:
    outcome = django_quota.evaluate("inflight", USER, evaluation_id="h")
    headers = rate_limit_headers([outcome], "ietf")
    assert headers == {"RateLimit-Policy": '"inflight";q=2', "RateLimit": '"inflight";r=1;t=60'}


@pytest.mark.parametrize(
    ("windows", "problem"),
    [
        ({"a": "2/m", "b": "3/h"}, "one window"),
        ("65536/m", "at most 65,535 units"),
    ],
)
def test_concurrency_windows_are_checked(
    settings: Any, windows: object, problem: str
) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        parse_policy("p", {"algorithm": "concurrency", "windows": windows})
    settings.QUOTA = {
        "HMAC_KEY": "tests-hmac-key-0123456789",
        "POLICIES": {"p": {"algorithm": "concurrency", "windows": windows}},
    }
    (message,) = [m for m in check_settings() if m.id == "django_quota.E004"]
    assert message.msg.startswith("QUOTA['POLICIES']['p']['windows']: ") and problem in message.msg


def test_a_group_with_a_concurrency_policy_is_one_script_call(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    """One EVALSHA per decision: a concurrency policy alone, and grouped with a rate
    policy (INFO commandstats of the test's own server)."""
    quota(REDIS_URL=redis_url, POLICIES=POLICIES)
    django_quota.evaluate("inflight", USER, evaluation_id="warm")  # scripts loaded
    django_quota.release("inflight", USER, "warm")

    def evalsha() -> int:
        stats = redis_client.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

    before = evalsha()
    django_quota.evaluate("inflight", USER, evaluation_id="one")
    assert evalsha() - before == 1
    before = evalsha()
    decide("burst", "inflight", evaluation_id="two")
    assert evalsha() - before == 1
    before = evalsha()
    assert django_quota.release("inflight", USER, "two") == 1
    assert evalsha() - before == 1


def test_reset_forgets_every_lease_and_counts_its_window(backend: str) -> None:
    django_quota.evaluate("inflight", USER, cost=2, evaluation_id="r")
    assert django_quota.reset("inflight", USER) == 1
    assert django_quota.peek("inflight", USER).remaining == 2
    assert django_quota.reset("inflight", USER) == 0
    assert django_quota.release("inflight", USER, "r") == 0
