"""Calendar windows through the limiter (docs/policies.md#calendar-windows): a monthly
plan in a customer's timezone on the memory backend, a real Redis (client clock and
Redis ``TIME``) and a real Redis Cluster (a group across slots, refunds included), each
counted exactly to the local midnight that ends the month."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from django_quota import limiter, policies
from django_quota.core.calendar import window_end, window_start
from django_quota.core.outcome import Outcome
from tests import clock
from tests.cluster import Cluster, redis_cluster

#: 1 April 2026 00:00 in Berlin (CEST): 31 March 22:00 UTC.
APRIL = datetime(2026, 3, 31, 22, tzinfo=UTC).timestamp()
PLANS = {
    "monthly": {"windows": "3/month", "timezone": "Europe/Berlin", "selector": ["user"]},
    "daily": {
        "windows": {"burst": "2/s", "day": "2/d"},
        "timezone": "America/New_York",
        "selector": ["ip"],
    },
}
#: (seconds from APRIL, cost): up to the end of March, then into April.
STEPS = [(-10.0, 1), (-9.0, 1), (-1.0, 1), (-0.002, 1), (-0.001, 0), (0.0, 1), (0.0, 1),
         (0.5, 1), (3.0, 1), (3.5, 2)]  # fmt: skip


def _run(group_ids: list[str], subject: dict[str, str]) -> list[list[Outcome]]:
    group = [policies.get_policy(policy_id) for policy_id in group_ids]
    runs = []
    for offset, cost in STEPS:
        clock.set_to(APRIL + offset)
        runs.append(limiter.evaluate_policies(group, subject, cost))
    return runs


def comparable(outcome: Outcome) -> Outcome:
    return dataclasses.replace(outcome, backend_mode="", evaluation_id="")


def _monthly(runs: list[list[Outcome]]) -> list[tuple[str, int | None, float | None]]:
    return [(o.decision, o.remaining, o.reset_after) for step in runs for o in step]


EXPECTED_MONTHLY = [
    ("allowed", 2, 10.0),
    ("allowed", 1, 9.0),
    ("allowed", 0, 1.0),
    ("denied", 0, 0.002),
    ("denied", 0, 0.001),  # a peek
    ("allowed", 2, 30 * 86_400.0),  # April in Berlin: 30 days
    ("allowed", 1, 30 * 86_400.0),
    ("allowed", 0, 30 * 86_400.0 - 0.5),
    ("denied", 0, 30 * 86_400.0 - 3.0),
    ("denied", 0, 30 * 86_400.0 - 3.5),
]


def test_a_monthly_plan_on_the_memory_backend(quota: Any) -> None:
    quota(CLOCK="tests.clock.now", POLICIES=PLANS)
    assert limiter.get_backend().mode == "memory"
    assert _monthly(_run(["monthly"], {"user": "7"})) == EXPECTED_MONTHLY


@pytest.mark.redis
def test_a_monthly_plan_on_redis_decides_as_memory(quota: Any, redis_server: Any) -> None:
    url = f"redis://{redis_server.host}:{redis_server.port}/3"
    quota(CLOCK="tests.clock.now", POLICIES=PLANS, REDIS_URL=url)
    limiter.get_backend().client.flushdb()
    assert _monthly(_run(["monthly"], {"user": "7"})) == EXPECTED_MONTHLY
    on_redis = _run(["monthly", "daily"], {"user": "8", "ip": "10.0.0.1"})
    quota(CLOCK="tests.clock.now", POLICIES=PLANS)
    in_memory = _run(["monthly", "daily"], {"user": "8", "ip": "10.0.0.1"})
    assert [[comparable(o) for o in s] for s in on_redis] == [
        [comparable(o) for o in s] for s in in_memory
    ]


@pytest.mark.redis
def test_on_the_redis_clock_the_window_ends_at_the_local_midnight(
    quota: Any, redis_server: Any
) -> None:
    """CLOCK = "redis": the script places Redis TIME; reset_after is the time to the
    end of the local month on that clock (the client and the server share this machine's
    clock here, so it is the month's end seen now, within the test's run)."""
    url = f"redis://{redis_server.host}:{redis_server.port}/3"
    quota(CLOCK="redis", POLICIES=PLANS, REDIS_URL=url)
    client = limiter.get_backend().client
    client.flushdb()
    before = client.time()
    (outcome,) = limiter.evaluate_policies([policies.get_policy("monthly")], {"user": "9"}, 1)
    after = client.time()
    assert (outcome.decision, outcome.remaining) == ("allowed", 2)
    start = window_start("month", "Europe/Berlin", int(before[0]) * 1000)
    end = window_end("month", "Europe/Berlin", start)
    earliest = end / 1000 - (int(after[0]) + int(after[1]) / 1e6)
    latest = end / 1000 - (int(before[0]) + int(before[1]) / 1e6)
    assert outcome.reset_after is not None
    assert earliest - 0.001 <= outcome.reset_after <= latest + 0.001
    (key,) = client.keys("*")
    assert end - 1000 * int(after[0]) - 2_000 <= client.pttl(key)  # lives to the month's end


# -- the cluster lane ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with redis_cluster() as started:
        yield started


@pytest.mark.redis
@pytest.mark.parametrize("order", [["monthly", "daily"], ["daily", "monthly"]])
def test_a_calendar_group_across_cluster_slots_decides_as_memory(
    quota: Any, cluster: Cluster, order: list[str]
) -> None:
    """Two policies of one subject on two slots: the later slot's refusals refund the
    earlier calendar charge (refund.lua with the window's start and end) or dry-run it,
    exactly as one script deciding the group in memory would."""
    cluster.wait_ok()
    cluster.flushall()
    subject = None
    for number in range(200):
        candidate = {"user": f"u{number}", "ip": f"10.2.0.{number + 1}"}
        quota(CLOCK="tests.clock.now", POLICIES=PLANS, REDIS_URL=cluster.url, CLUSTER=True,
              TIMEOUT=2.0, DEADLINE=5.0)  # fmt: skip
        counters = (
            limiter.get_limiter()
            .prepare(
                [policies.get_policy(name) for name in ("monthly", "daily")],
                candidate,
                1,
                peek=True,
            )
            .request
        )
        assert counters is not None
        if cluster.node_of(counters.counters[0]) != cluster.node_of(counters.counters[1]):
            subject = candidate
            break
    assert subject is not None
    on_cluster = _run(order, subject)
    quota(CLOCK="tests.clock.now", POLICIES=PLANS)
    in_memory = _run(order, subject)
    assert [[comparable(o) for o in s] for s in on_cluster] == [
        [comparable(o) for o in s] for s in in_memory
    ]
    monthly = [o for step in on_cluster for o in step if o.policy == "monthly"]
    assert [o.remaining for o in monthly][-5:] == [o.remaining for o in [
        o for step in in_memory for o in step if o.policy == "monthly"]][-5:]  # fmt: skip
    assert any(o.decision == "denied" and o.policy == "daily" for step in on_cluster for o in step)


def test_the_memory_backend_places_its_own_clock(quota: Any) -> None:
    """CLOCK = "redis" on the memory backend: the counters follow this process's clock,
    the boundaries are sent around the same clock, and the month is the local one."""
    quota(CLOCK="redis", POLICIES=PLANS)
    assert limiter.get_backend().mode == "memory"
    before = time.time()
    (outcome,) = limiter.evaluate_policies([policies.get_policy("monthly")], {"user": "5"}, 1)
    after = time.time()
    assert (outcome.decision, outcome.remaining) == ("allowed", 2)
    start = window_start("month", "Europe/Berlin", int(before * 1000))
    end = window_end("month", "Europe/Berlin", start) / 1000
    assert outcome.reset_after is not None
    assert end - after - 0.002 <= outcome.reset_after <= end - before + 0.002
