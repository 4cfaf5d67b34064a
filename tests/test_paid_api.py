"""docs/paid-api.md, run: the page's combined configuration (a monthly plan in a
timezone, a per-second burst and a concurrency limit, decided together) does what its
text says, on the memory backend and a real Redis, with a frozen clock."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import django_quota
from django_quota import limiter, policies
from tests import clock

PAGE = Path(__file__).resolve().parent.parent / "docs" / "paid-api.md"
SECTION = "## At most N requests in flight"
KEY = {"api_key": "customer-7"}


def page_quota() -> dict[str, Any]:
    """The ``QUOTA`` dict of the page's combined example, executed as written."""
    section = PAGE.read_text().split(SECTION, 1)[1]
    (code,) = re.findall(r"^```python\n(.*?)^```$", section, flags=re.M | re.S)[:1]
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    quota: dict[str, Any] = namespace["QUOTA"]
    return quota


@pytest.fixture(params=["memory", "redis"])
def configured(request: pytest.FixtureRequest, quota: Any) -> Any:
    values = {**page_quota(), "CLOCK": "tests.clock.now"}
    values.pop("PLAN_RESOLVER")  # the page's billing module is the project's; plans by name here
    if request.param == "redis":
        values["REDIS_URL"] = request.getfixturevalue("redis_url")
        # Behaviour, not latency, is under test: timeouts a loaded machine never reaches.
        values.setdefault("TIMEOUT", 1.0)
        values.setdefault("DEADLINE", 2.0)
    saved = clock.current
    clock.set_to(1_767_225_600.0)  # 2026-01-01 00:00 UTC, 01:00 in Berlin
    quota(**values)
    yield [policies.get_policy(name) for name in ("api-monthly", "api-burst", "api-inflight")]
    clock.set_to(saved)


def decide(group: Any, plan: str = "pro") -> list[Any]:
    return limiter.evaluate_policies(group, KEY, plan=plan)


def test_five_in_flight_then_refused_without_charging_the_rates(configured: Any) -> None:
    held = [decide(configured) for _ in range(5)]
    assert all(outcome.decision == "allowed" for outcomes in held for outcome in outcomes)
    sixth = decide(configured)
    refusing = [outcome for outcome in sixth if outcome.decision == "denied"]
    assert [(o.policy, o.reason) for o in refusing] == [("api-inflight", "default_quota_exhausted")]
    monthly = django_quota.peek("api-monthly", KEY, plan="pro")
    assert (monthly.limit, monthly.remaining) == (100_000, 100_000 - 5)  # the sixth: nothing
    assert django_quota.peek("api-burst", KEY).remaining == 20 - 5
    # A release frees a slot for the next request.
    inflight = next(o for o in held[0] if o.policy == "api-inflight")
    assert django_quota.release("api-inflight", KEY, inflight.evaluation_id) == 1
    assert all(outcome.decision == "allowed" for outcome in decide(configured))


def test_a_refused_burst_acquires_no_lease(configured: Any) -> None:
    for _ in range(4):
        outcomes = decide(configured)
        for outcome in outcomes:
            if outcome.policy == "api-inflight":
                django_quota.release("api-inflight", KEY, outcome.evaluation_id)
    # 20 per second: 16 more fit, then the burst refuses and no lease is taken.
    for _ in range(16):
        for outcome in decide(configured):
            if outcome.policy == "api-inflight":
                django_quota.release("api-inflight", KEY, outcome.evaluation_id)
    refused = decide(configured)
    assert {o.policy: o.decision for o in refused}["api-burst"] == "denied"
    assert django_quota.peek("api-inflight", KEY).remaining == 5
    assert django_quota.peek("api-monthly", KEY, plan="free").remaining == 1000 - 20
