"""The sliding log (docs/arithmetic.md) on a real redis-server: bounded state, a fixed set of
keys per subject, TTLs, denials that write nothing, reset, ``quota inspect`` and the
cluster refund of a unit that a later charge has already covered. The arithmetic itself
is pinned by tests/test_arithmetic.py and held to the Lua script by
tests/test_differential.py."""

from __future__ import annotations

from typing import Any

import pytest

import django_quota
from django_quota import limiter, operations, policies
from django_quota.backends.cluster import refund_call
from django_quota.backends.scripting import Call
from django_quota.core.calls import PolicyCall
from django_quota.core.policy import Window
from django_quota.core.protocol import GroupRequest, decode_counter, log_key
from django_quota.core.windows import log_units
from tests import clock

pytestmark = pytest.mark.redis

SUBJECT = {"ip": "192.0.2.50"}
START = 1_764_000_000.0


@pytest.fixture
def on_redis(quota: Any, redis_url: str) -> Any:
    """``configure(**POLICIES)`` on the test redis-server with the settable client clock."""
    clock.set_to(START)

    def configure(**definitions: Any) -> None:
        quota(
            REDIS_URL=redis_url,
            CLOCK="tests.clock.now",
            CLEANUP_GRACE=1.0,
            DEDUP_TTL=5.0,
            POLICIES=definitions,
        )

    yield configure
    clock.set_to(START)


def counter_of(policy_id: str, subject: dict[str, str] = SUBJECT) -> str:
    prepared = limiter.get_limiter().prepare(
        [policies.get_policy(policy_id)], subject, 1, peek=True
    )
    assert prepared.request is not None
    return prepared.request.counters[0]


def logged(redis_client: Any, counter: str, window: int = 1) -> tuple[int, ...]:
    return tuple(int(v) for v in redis_client.lrange(log_key(counter, window), 0, -1))


def units(redis_client: Any, counter: str, window: int = 1, window_count: int = 1) -> int:
    state, _ = decode_counter(redis_client.get(counter), "sliding_log", window_count)
    assert state is not None
    count = state[f"c{window}"]
    return log_units(count, logged(redis_client, counter, window))


def writes(redis_client: Any) -> int:
    """Write commands the server has executed so far (INFO commandstats)."""
    stats = redis_client.info("commandstats")
    names = ("set", "hset", "pexpire", "lpush", "ltrim", "del", "lset", "lrem", "lpop")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names)


def test_two_hundred_attempts_at_limit_fifty_leave_at_most_fifty_units(
    on_redis: Any, redis_client: Any
) -> None:
    on_redis(p={"algorithm": "sliding_log", "windows": "50/m"})
    admitted = 0
    for attempt in range(200):
        clock.set_to(START + attempt * 0.013)
        admitted += django_quota.evaluate("p", SUBJECT, cost=1 + attempt % 2).decision == "allowed"
    counter = counter_of("p")
    assert units(redis_client, counter) <= 50
    assert len(logged(redis_client, counter)) <= 2 * 50
    assert admitted > 0
    # minutes later, one charge drops every unit that left the window
    clock.set_to(START + 600)
    assert django_quota.evaluate("p", SUBJECT).remaining == 49
    assert units(redis_client, counter) == 1 and len(logged(redis_client, counter)) == 2


def test_keys_after_a_hundred_decisions_equal_keys_after_one(
    on_redis: Any, redis_client: Any
) -> None:
    on_redis(p={"algorithm": "sliding_log", "windows": {"burst": "5/s", "sustained": "70/h"}})
    django_quota.evaluate("p", SUBJECT)
    after_one = sorted(redis_client.keys("*"))
    counter = counter_of("p")
    assert after_one == sorted(
        k.encode() for k in (counter, log_key(counter, 1), log_key(counter, 2))
    )
    for step in range(99):
        clock.set_to(START + 0.05 * (step + 1))
        django_quota.evaluate("p", SUBJECT)
    assert sorted(redis_client.keys("*")) == after_one


def test_log_keys_live_until_their_newest_unit_leaves_plus_grace(
    on_redis: Any, redis_client: Any
) -> None:
    on_redis(p={"algorithm": "sliding_log", "windows": {"burst": "5/2s", "sustained": "70/m"}})
    django_quota.evaluate("p", SUBJECT)
    counter = counter_of("p")
    assert 2_900 <= redis_client.pttl(log_key(counter, 1)) <= 3_000  # 2 s + grace
    assert 60_900 <= redis_client.pttl(log_key(counter, 2)) <= 61_000  # 60 s + grace
    assert 60_900 <= redis_client.pttl(counter) <= 61_000  # the longest window + grace
    on_redis(q={"algorithm": "sliding_log", "windows": "5/s"})
    django_quota.evaluate("q", SUBJECT)
    short = counter_of("q")
    assert 1_900 <= redis_client.pttl(log_key(short, 1)) <= 2_000
    assert 4_900 <= redis_client.pttl(short) <= 5_000  # DEDUP_TTL: the ledger lives on


def test_a_denial_writes_nothing(on_redis: Any, redis_client: Any) -> None:
    on_redis(p={"algorithm": "sliding_log", "windows": "2/m"})
    django_quota.evaluate("p", SUBJECT)
    django_quota.evaluate("p", SUBJECT)
    counter = counter_of("p")
    before = (redis_client.get(counter), logged(redis_client, counter), writes(redis_client))
    clock.set_to(START + 1)
    outcome = django_quota.evaluate("p", SUBJECT)
    assert outcome.decision == "denied" and outcome.retry_after == 59.0
    assert django_quota.peek("p", SUBJECT).decision == "denied"
    after = (redis_client.get(counter), logged(redis_client, counter), writes(redis_client))
    assert after == before


def test_retry_after_a_denial_is_exact_on_redis(on_redis: Any) -> None:
    on_redis(p={"algorithm": "sliding_log", "windows": "3/10s"})
    for offset in (0.0, 1.234, 2.5):
        clock.set_to(START + offset)
        assert django_quota.evaluate("p", SUBJECT).decision == "allowed"
    clock.set_to(START + 4)
    denied = django_quota.evaluate("p", SUBJECT)
    assert denied.retry_after == 6.0 and denied.reset_after == 8.5
    clock.set_to(START + 9.999)
    assert django_quota.evaluate("p", SUBJECT).decision == "denied"
    clock.set_to(START + 10)
    assert django_quota.evaluate("p", SUBJECT).decision == "allowed"


def test_reset_and_inspect_cover_the_logs(on_redis: Any, redis_client: Any) -> None:
    on_redis(p={"algorithm": "sliding_log", "windows": {"burst": "5/s", "sustained": "9/h"}})
    for _ in range(3):
        django_quota.evaluate("p", SUBJECT)
    inspection = operations.inspect("p", SUBJECT)
    assert [(w["window"], w["count"], w["remaining"]) for w in inspection.windows] == [
        ("burst", 3, 2),
        ("sustained", 3, 6),
    ]
    counter = counter_of("p")
    assert django_quota.reset("p", SUBJECT) == 2
    assert redis_client.exists(log_key(counter, 1), log_key(counter, 2)) == 0
    assert django_quota.peek("p", SUBJECT).remaining == 5


def test_refund_removes_exactly_the_refunded_units_behind_a_newer_charge(
    on_redis: Any, redis_client: Any
) -> None:
    """A refund arriving after another request charged the same counter (the cluster
    path, best effort) takes its units out of its own event, not the newest one."""
    on_redis()
    backend = limiter.get_backend()
    windows = (Window("default", 10, 60_000, 10),)
    counter = "quota:{s}:1:p:r"

    def charge(now_ms: int, cost: int, evaluation: bytes) -> GroupRequest:
        return GroupRequest(
            counters=(counter,),
            calls=(PolicyCall("sliding_log", windows, cost),),
            now_ms=now_ms,
            peek=False,
            max_regression_ms=-1,
            dedup_ttl_ms=5_000,
            cleanup_grace_ms=1_000,
            fingerprint=evaluation,
        )

    t0 = int(START * 1000)
    backend.evaluate(charge(t0, 1, b"aaaaa"))
    refunded = charge(t0 + 100, 3, b"bbbbb")
    results = backend.evaluate(refunded).results
    backend.evaluate(charge(t0 + 200, 2, b"ccccc"))
    call = refund_call(refunded, results)
    assert call is not None and isinstance(call, Call)
    assert backend.run(call) == 1
    # events (time, units before it): t0 holds 1, t0 + 200 holds 2; t0 + 100 is gone
    assert units(redis_client, counter) == 3
    assert logged(redis_client, counter) == (t0 + 200, 1, t0, 0)
    assert b"bbbbb" not in decode_counter(redis_client.get(counter), "sliding_log", 1)[1]
    again = backend.evaluate(charge(t0 + 300, 7, b"ddddd"))
    assert again.results[0].windows[0].remaining == 0
