"""Plans (docs/plans.md): a policy's ``plans`` choose its limits per request on its one
counter, so a subject keeps its usage when its plan changes. Every algorithm on the
memory model, fakeredis and a real redis-server (the Cluster case is in
tests/test_cluster.py); the revision rule; ``PLAN_RESOLVER`` at the edges; bad plans
named by ``manage.py check``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from django.core.checks import run_checks
from django.test import Client

import django_quota
from django_quota.core.errors import ConfigurationError
from django_quota.core.policy import parse_policy
from tests import clock
from tests.test_limiter import configure as configure  # the backend-parametrised fixture

ALGORITHMS = ("fixed_window", "sliding_window", "sliding_log", "token_bucket")
START = 1_764_000_000.0
SUBJECT = {"ip": "198.51.100.7"}


def plans_policy(algorithm: str, **extra: Any) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "windows": "100/d",
        "plans": {"basic": "100/d", "pro": "10000/d", "trial": "50/d"},
        "selector": ["ip"],
        **extra,
    }


@pytest.fixture
def frozen() -> Any:
    saved = clock.current
    clock.set_to(START)
    yield clock
    clock.set_to(saved)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_plan_change_keeps_the_usage(configure: Any, frozen: Any, algorithm: str) -> None:
    configure(CLOCK="tests.clock.now", POLICIES={"p": plans_policy(algorithm)})
    for _ in range(90):
        assert django_quota.evaluate("p", SUBJECT, plan="basic").decision == "allowed"
    basic = django_quota.peek("p", SUBJECT, plan="basic")
    assert (basic.limit, basic.remaining) == (100, 10)
    pro = django_quota.peek("p", SUBJECT, plan="pro")
    assert (pro.limit, pro.remaining) == (10000, 9910)
    charged = django_quota.evaluate("p", SUBJECT, plan="pro")
    assert (charged.decision, charged.limit, charged.remaining) == ("allowed", 10000, 9909)
    # Moved down to a smaller plan, the same 91 units are over its limit: refused.
    trial = django_quota.evaluate("p", SUBJECT, plan="trial")
    assert (trial.decision, trial.limit, trial.remaining) == ("denied", 50, 0)
    # No plan, or a name the policy does not have: the policy's own windows.
    for plan in (None, "enterprise"):
        own = django_quota.peek("p", SUBJECT, plan=plan)
        assert (own.limit, own.remaining) == (100, 9)


def test_the_async_api_takes_a_plan(configure: Any, frozen: Any) -> None:
    configure(CLOCK="tests.clock.now", POLICIES={"p": plans_policy("fixed_window")})

    async def scenario() -> tuple[Any, Any]:
        for _ in range(100):
            await django_quota.aevaluate("p", SUBJECT, plan="basic")
        return (
            await django_quota.aevaluate("p", SUBJECT, plan="basic"),
            await django_quota.apeek("p", SUBJECT, plan="pro"),
        )

    refused, upgraded = asyncio.run(scenario())
    assert (refused.decision, refused.remaining) == ("denied", 0)
    assert (upgraded.decision, upgraded.limit, upgraded.remaining) == ("allowed", 10000, 9900)


@pytest.mark.parametrize("plan", [1, b"pro", ["pro"], {"plan": "pro"}])
def test_a_plan_that_is_not_a_string_is_a_type_error_at_the_api(
    configure: Any, frozen: Any, plan: Any
) -> None:
    """A plan id from the database (an int) passed as it is would otherwise quietly mean
    the policy's own windows: say so instead."""
    configure(CLOCK="tests.clock.now", POLICIES={"p": plans_policy("fixed_window")})
    from django_quota.limiter import evaluate_policies
    from django_quota.policies import get_policy

    group = [get_policy("p")]
    calls = [
        lambda: django_quota.evaluate("p", SUBJECT, plan=plan),
        lambda: django_quota.peek("p", SUBJECT, plan=plan),
        lambda: evaluate_policies(group, SUBJECT, plan=plan),
        lambda: asyncio.run(django_quota.aevaluate("p", SUBJECT, plan=plan)),
        lambda: asyncio.run(django_quota.apeek("p", SUBJECT, plan=plan)),
    ]
    for call in calls:
        with pytest.raises(TypeError) as raised:
            call()
        assert str(raised.value).startswith(
            f"plan must be a plan name (str) or None, not {type(plan).__name__}"
        )
    assert django_quota.peek("p", SUBJECT).remaining == 100  # nothing was charged


def test_a_plan_changes_limits_not_the_counter() -> None:
    base = parse_policy("p", plans_policy("fixed_window"))
    other_limits = parse_policy(
        "p", {**plans_policy("fixed_window"), "windows": "7/d", "plans": {"pro": "99/d"}}
    )
    assert base.revision == other_limits.revision
    other_period = parse_policy(
        "p", {**plans_policy("fixed_window"), "windows": "100/h", "plans": {"pro": "99/h"}}
    )
    assert other_period.revision != base.revision
    other_algorithm = parse_policy("p", plans_policy("sliding_log"))
    assert other_algorithm.revision != base.revision
    # A policy without plans keeps the revision it had before plans existed (values
    # computed by the code of 8f26be6), and never shares one with a policy with plans.
    assert parse_policy("p", {"windows": "100/d"}).revision == "f45d3615"
    bucket = {
        "algorithm": "token_bucket",
        "windows": {"burst": "10/s", "daily": "100/d"},
        "selector": ["user"],
    }
    assert parse_policy("p", bucket).revision == "2763d46e"
    with_plans = parse_policy("p", {**bucket, "plans": {"pro": {"burst": "20/s", "daily": "9/d"}}})
    assert with_plans.revision != "2763d46e"


def test_plan_windows_follow_the_policys_order() -> None:
    policy = parse_policy(
        "p",
        {
            "windows": {"burst": "10/s", "daily": "100/d"},
            "plans": {"pro": {"daily": "1000/d", "burst": "50/s"}},
        },
    )
    (windows,) = [windows for name, windows in policy.plans if name == "pro"]
    assert [(w.name, w.limit, w.period_ms) for w in windows] == [
        ("burst", 50, 1000),
        ("daily", 1000, 86_400_000),
    ]


@pytest.mark.parametrize(
    ("plans", "key", "message"),
    [
        ({"pro": "5/h"}, "['plans']['pro']", "must keep the policy's period (/d)"),
        ({"pro": {"other": "5/d"}}, "['plans']['pro']", "a plan has the policy's windows"),
        ([], "['plans']", "plans must be a non-empty dict"),
        ({}, "['plans']", "plans must be a non-empty dict"),
        ({"no spaces": "5/d"}, "['plans']", "plan name 'no spaces' must match"),
        ({"pro": "five/d"}, "['plans']['pro']", "five/d"),
    ],
)
def test_a_bad_plan_is_a_check_error_naming_it(
    quota: Any, plans: object, key: str, message: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_policy("p", {"windows": "100/d", "plans": plans})
    assert key in str(raised.value) and message in str(raised.value)
    quota(POLICIES={"p": {"windows": "100/d", "plans": plans}})
    errors = [str(message) for message in run_checks() if message.id.startswith("django_quota")]
    assert any(f"QUOTA['POLICIES']['p']{key}" in error for error in errors), errors


def test_a_plan_with_named_windows_must_name_them() -> None:
    with pytest.raises(ConfigurationError, match="name the windows as the policy does: a, b"):
        parse_policy("p", {"windows": {"a": "1/s", "b": "9/d"}, "plans": {"pro": "5/s"}})


def test_a_concurrency_plan_keeps_the_65535_units_bound(quota: Any) -> None:
    """A lease's units take two bytes (docs/concurrency.md): a plan may not allow more in
    flight than the policy's windows may; Redis refused such a cost (backend_error)
    while the memory backend admitted it."""
    policy = {"algorithm": "concurrency", "windows": "5/m", "plans": {"big": "70000/m"}}
    with pytest.raises(ConfigurationError) as raised:
        parse_policy("p", policy)
    assert "['plans']['big']" in str(raised.value)
    assert "at most 65,535 units in flight" in str(raised.value)
    quota(POLICIES={"p": policy})
    errors = [str(message) for message in run_checks() if message.id.startswith("django_quota")]
    assert any("QUOTA['POLICIES']['p']['plans']['big']" in error for error in errors), errors
    parse_policy("p", {**policy, "plans": {"big": "65535/m"}})


# -- PLAN_RESOLVER at the edges -----------------------------------------------------------
def plan_from_header(request: Any) -> str | None:
    """The plan a test request names in its X-Plan header."""
    return request.headers.get("X-Plan")


def plan_resolver_raising(request: Any) -> str | None:
    raise RuntimeError("the plan service is down")


def plan_resolver_wrong_type(request: Any) -> object:
    return 42


def edge_settings(quota: Any, resolver: str) -> None:
    quota(
        CLOCK="tests.clock.now",
        PLAN_RESOLVER=resolver,
        POLICIES={"p": {**plans_policy("fixed_window"), "routes": ["/api"], "windows": "2/d"}},
    )


@pytest.mark.django_db
def test_the_middleware_decides_with_the_requests_plan(
    quota: Any, frozen: Any, django_assert_num_queries: Any
) -> None:
    edge_settings(quota, "tests.test_plans.plan_from_header")
    client = Client()
    assert [client.get("/api/items/").status_code for _ in range(3)] == [200, 200, 429]
    with django_assert_num_queries(0):  # the plan comes from the request: no query
        upgraded = client.get("/api/items/", headers={"X-Plan": "pro"})
    assert upgraded.status_code == 200
    (outcome,) = django_quota.outcomes(upgraded.wsgi_request)
    assert (outcome.limit, outcome.remaining) == (10000, 9997)
    assert upgraded.headers["RateLimit-Policy"].startswith('"p";q=10000')


def test_the_async_middleware_reads_the_plan_off_the_event_loop(quota: Any, frozen: Any) -> None:
    from django.test import AsyncClient

    edge_settings(quota, "tests.test_plans.plan_from_header")

    async def scenario() -> list[int]:
        client = AsyncClient()
        statuses = [(await client.get("/api/items/")).status_code for _ in range(3)]
        statuses.append((await client.get("/api/items/", headers={"X-Plan": "pro"})).status_code)
        return statuses

    assert asyncio.run(scenario()) == [200, 200, 429, 200]


@pytest.mark.parametrize(
    ("resolver", "logged"),
    [
        ("tests.test_plans.plan_resolver_raising", "raised"),
        ("tests.test_plans.plan_resolver_wrong_type", "returned a int"),
    ],
)
def test_a_failing_plan_resolver_gives_the_policys_own_windows(
    quota: Any, frozen: Any, caplog: pytest.LogCaptureFixture, resolver: str, logged: str
) -> None:
    edge_settings(quota, resolver)
    client = Client()
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        assert [client.get("/api/items/").status_code for _ in range(3)] == [200, 200, 429]
    assert logged in caplog.text and "the policies' own windows apply" in caplog.text


def test_the_plan_resolver_is_not_called_without_a_policy_with_plans(
    quota: Any, frozen: Any
) -> None:
    quota(
        PLAN_RESOLVER="tests.test_plans.plan_resolver_raising",
        POLICIES={"p": {"windows": "2/d", "routes": ["/api"], "selector": ["ip"]}},
    )
    assert Client().get("/api/items/").status_code == 200


def test_an_unimportable_plan_resolver_fails_the_check(quota: Any) -> None:
    quota(PLAN_RESOLVER="tests.nowhere.resolver")
    errors = [str(message) for message in run_checks() if message.id.startswith("django_quota")]
    assert any("QUOTA['PLAN_RESOLVER']" in error for error in errors), errors


def test_calendar_plans_share_the_monthly_counter(configure: Any, frozen: Any) -> None:
    monthly = {
        "algorithm": "fixed_window",
        "windows": "100/month",
        "timezone": "Europe/Berlin",
        "plans": {"pro": "10000/month"},
        "selector": ["ip"],
    }
    configure(CLOCK="tests.clock.now", POLICIES={"p": monthly})
    for _ in range(90):
        django_quota.evaluate("p", SUBJECT)
    pro = django_quota.peek("p", SUBJECT, plan="pro")
    assert (pro.limit, pro.remaining) == (10000, 9910)
    assert [w.calendar for w in parse_policy("p", monthly).plans[0][1]] == ["month"]
    with pytest.raises(ConfigurationError, match=r"must keep the policy's period \(/month\)"):
        parse_policy("p", {**monthly, "plans": {"pro": "10000/31d"}})
