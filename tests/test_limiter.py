"""The Python API (docs/failures.md) on every backend: the memory model, the Lua script on
fakeredis and on a real redis-server. Exact outcomes, cost rules, peek, reset,
evaluation-id replay, NOSCRIPT recovery and TTL bounds read back from Redis."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest

import django_quota
from django_quota import limiter
from django_quota.backends.redis import RedisBackend
from django_quota.core.outcome import Outcome, WindowState
from tests import clock

BACKENDS = ["memory", "fakeredis", "redis"]


@pytest.fixture(params=BACKENDS)
def configure(
    request: pytest.FixtureRequest, quota: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Any]]:
    """``configure(POLICIES=...)`` sets QUOTA for the parametrised backend; returns a raw
    client for Redis backends (None for memory)."""
    kind = request.param
    client: Any = None
    url = None
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        import redis

        client = redis.Redis.from_url(url)
    elif kind == "fakeredis":
        server = fakeredis.FakeServer()
        client = fakeredis.FakeRedis(server=server)
        url = "redis://fakeredis.invalid:6379/0"
        original = limiter.backend_from_settings

        def build(settings: Any) -> Any:
            if settings.backend == "redis":
                return RedisBackend(
                    url=None,
                    timeout=1.0,
                    max_inflight=8,
                    client_factory=lambda asynchronous: (
                        fakeredis.FakeAsyncRedis(server=server) if asynchronous else client
                    ),
                )
            return original(settings)

        monkeypatch.setattr(limiter, "backend_from_settings", build)

    def apply(**values: Any) -> Any:
        if url is not None:
            values.setdefault("REDIS_URL", url)
        if kind != "memory":
            # Behaviour, not latency, is under test here (docs/failures.md's latencies are
            # the fault matrix's): timeouts a loaded CI machine's scheduling never reaches
            # (fakeredis runs the Lua in this process, loading each script on first use).
            values.setdefault("TIMEOUT", 1.0)
            values.setdefault("DEADLINE", 2.0)
        quota(**values)
        return client

    apply.kind = kind  # type: ignore[attr-defined]
    yield apply


def test_outcome_fields_for_an_allowed_then_denied_fixed_window(configure: Any) -> None:
    configure(POLICIES={"p": {"algorithm": "fixed_window", "windows": "2/h", "selector": ["ip"]}})
    subject = {"ip": "203.0.113.7"}
    first = django_quota.evaluate("p", subject)
    assert (first.decision, first.reason, first.window, first.limit, first.remaining) == (
        "allowed",
        None,
        "default",
        2,
        1,
    )
    assert first.retry_after is None and first.certainty == "exact"
    assert 0 < first.reset_after <= 3600
    django_quota.evaluate("p", subject)
    denied = django_quota.evaluate("p", subject)
    assert denied.decision == "denied" and denied.reason == "default_quota_exhausted"
    assert denied.remaining == 0 and not denied.allowed
    assert denied.retry_after == denied.reset_after
    assert denied.windows == (
        WindowState(
            "default", 2, 3600.0, 0, denied.reset_after, denied.retry_after, denied.reset_after
        ),
    )
    assert denied.backend_mode == ("memory" if configure.kind == "memory" else "redis")
    # the memory backend's counters live in this process, which never retries: no id
    assert len(denied.evaluation_id) == (0 if configure.kind == "memory" else 22)


def test_reported_window_and_reason_follow_the_documented_rules(
    configure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16:00 UTC: the hour ends before the day (in the day's last hour both end at
    # midnight, their reset_after ties and declaration order reports the burst window).
    monkeypatch.setattr(clock, "current", 1_764_000_000.0)
    configure(
        CLOCK="tests.clock.now",
        POLICIES={
            "tie": {"selector": ["user"], "windows": {"burst": "3/h", "sustained": "3/d"}},
            "burst": {"selector": ["user"], "windows": {"burst": "2/h", "sustained": "5/d"}},
        }
    )
    tie = [django_quota.evaluate("tie", {"user": "1"}) for _ in range(4)]
    # equal remaining: the larger reset_after (the day) is reported
    assert [(o.window, o.remaining) for o in tie[:3]] == [
        ("sustained", 2),
        ("sustained", 1),
        ("sustained", 0),
    ]
    # both deny: the larger retry_after names the reason
    assert (tie[3].window, tie[3].reason) == ("sustained", "sustained_quota_exhausted")
    assert tie[3].retry_after == max(w.retry_after or 0 for w in tie[3].windows)
    burst = [django_quota.evaluate("burst", {"user": "1"}) for _ in range(3)]
    assert [(o.window, o.remaining) for o in burst[:2]] == [("burst", 1), ("burst", 0)]
    assert (burst[2].window, burst[2].reason) == ("burst", "burst_quota_exhausted")
    assert [w.retry_after is None for w in burst[2].windows] == [False, True]


def test_sliding_window_outcomes_are_approximate(configure: Any) -> None:
    configure(POLICIES={"s": {"algorithm": "sliding_window", "windows": "5/h"}})
    outcome = django_quota.evaluate("s", {"ip": "198.51.100.1"})
    assert outcome.certainty == "approximate" and outcome.remaining == 4


@pytest.mark.parametrize("bad", [True, 1.0, "1"])
def test_cost_must_be_an_int(configure: Any, bad: Any) -> None:
    configure(POLICIES={"p": {"windows": "2/h"}})
    with pytest.raises(TypeError):
        django_quota.evaluate("p", {"ip": "192.0.2.1"}, cost=bad)


def test_negative_cost_is_a_value_error(configure: Any) -> None:
    configure(POLICIES={"p": {"windows": "2/h"}})
    with pytest.raises(ValueError):
        django_quota.evaluate("p", {"ip": "192.0.2.1"}, cost=-1)


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket"])
def test_cost_above_the_limit_is_refused_without_touching_the_backend(
    configure: Any, algorithm: str
) -> None:
    client = configure(POLICIES={"p": {"algorithm": algorithm, "windows": "5/h", "max_cost": 10}})
    outcome = django_quota.evaluate("p", {"ip": "192.0.2.1"}, cost=6)
    assert (outcome.decision, outcome.reason, outcome.retry_after) == (
        "denied",
        "cost_exceeds_limit",
        None,
    )
    assert outcome.windows == () and outcome.remaining is None
    if client is not None:
        assert client.keys("*") == []
    assert django_quota.peek("p", {"ip": "192.0.2.1"}).remaining == 5


def test_max_cost_refuses_below_the_limit(configure: Any) -> None:
    configure(POLICIES={"p": {"windows": "50/h", "max_cost": 3, "enforcement": "shadow"}})
    outcome = django_quota.evaluate("p", {"ip": "192.0.2.1"}, cost=4)
    assert (outcome.decision, outcome.reason) == ("shadow_denied", "cost_exceeds_limit")
    assert outcome.allowed


def test_cost_zero_returns_what_peek_returns(configure: Any) -> None:
    client = configure(POLICIES={"p": {"algorithm": "token_bucket", "windows": "3/h"}})
    subject = {"api_key": "k-1"}
    django_quota.evaluate("p", subject)
    zero = django_quota.evaluate("p", subject, cost=0)
    peeked = django_quota.peek("p", subject)
    assert (zero.decision, zero.remaining, zero.window) == (
        peeked.decision,
        peeked.remaining,
        peeked.window,
    )
    assert zero.remaining == 2
    if client is not None:
        assert [k for k in client.keys("*") if b":e:" not in k].__len__() == 1


def test_peek_writes_nothing_for_an_unseen_subject(configure: Any) -> None:
    client = configure(POLICIES={"p": {"algorithm": "token_bucket", "windows": "3/h"}})
    outcome = django_quota.peek("p", {"user": "99"})
    assert (outcome.decision, outcome.remaining, outcome.reset_after) == ("allowed", 3, 0.0)
    if client is not None:
        assert client.keys("*") == []


def test_reset_forgets_every_window_and_returns_how_many_had_state(configure: Any) -> None:
    configure(
        POLICIES={
            "p": {"algorithm": "sliding_window", "windows": {"burst": "2/m", "sustained": "3/h"}}
        }
    )
    subject = {"user": "7"}
    for _ in range(3):
        django_quota.evaluate("p", subject)
    assert django_quota.evaluate("p", subject).decision == "denied"
    assert django_quota.reset("p", subject) == 2
    assert django_quota.reset("p", subject) == 0
    assert django_quota.evaluate("p", subject).remaining == 1


def test_reset_with_a_missing_identity_raises_value_error(configure: Any) -> None:
    configure(POLICIES={"p": {"windows": "2/h", "selector": ["user"]}})
    with pytest.raises(ValueError):
        django_quota.reset("p", {"ip": "192.0.2.1"})


def test_repeated_evaluation_id_is_allowed_with_current_numbers_and_consumes_nothing(
    configure: Any,
) -> None:
    configure(POLICIES={"p": {"windows": "3/h"}})
    subject = {"ip": "192.0.2.44"}
    first = django_quota.evaluate("p", subject, evaluation_id="same-id")
    again = django_quota.evaluate("p", subject, evaluation_id="same-id")
    assert (first.decision, first.remaining) == ("allowed", 2)
    assert (again.decision, again.remaining, again.evaluation_id) == ("allowed", 2, "same-id")
    assert django_quota.peek("p", subject).remaining == 2


def test_missing_identity_denies_and_skip_skips(configure: Any) -> None:
    configure(
        POLICIES={
            "deny": {"windows": "3/h", "selector": ["user"]},
            "skip": {"windows": "3/h", "selector": ["user"], "on_missing": "skip"},
        }
    )
    denied = django_quota.evaluate("deny", {"ip": "192.0.2.1"})
    assert (denied.decision, denied.reason, denied.retry_after) == (
        "denied",
        "selector_identity_missing",
        None,
    )
    skipped = django_quota.evaluate("skip", {})
    assert (skipped.decision, skipped.reason, skipped.allowed) == (
        "skipped",
        "selector_identity_missing",
        True,
    )


def test_async_twins_match_the_sync_api(configure: Any) -> None:
    import asyncio

    configure(POLICIES={"p": {"windows": "2/h"}})
    subject = {"ip": "192.0.2.5"}

    async def scenario() -> tuple[Outcome, Outcome, Outcome, int]:
        first = await django_quota.aevaluate("p", subject)
        second = await django_quota.aevaluate("p", subject, cost=1)
        peeked = await django_quota.apeek("p", subject)
        cleared = await django_quota.areset("p", subject)
        return first, second, peeked, cleared

    first, second, peeked, cleared = asyncio.run(scenario())
    assert (first.remaining, second.remaining, peeked.decision, cleared) == (1, 0, "denied", 1)


# -- real Redis only -------------------------------------------------------------------------
def _settle(quota: Any, redis_url: str, **policies: Any) -> None:
    quota(REDIS_URL=redis_url, CLEANUP_GRACE=1.0, DEDUP_TTL=5.0, POLICIES=policies)


@pytest.mark.parametrize(
    ("algorithm", "rate", "bound_ms"),
    [
        ("fixed_window", "10/m", lambda o: o.reset_after * 1000),
        ("sliding_window", "10/m", lambda o: o.reset_after * 1000 + 60_000),
        # the time until the bucket is full: charges spread over a slow machine refill meanwhile
        ("token_bucket", "10/m", lambda o: o.reset_after * 1000),
        # a short window: the counter outlives it to remember its evaluation ids (DEDUP_TTL)
        ("fixed_window", "10/s", lambda o: 5_000 - 1_000),
    ],
)
def test_ttl_is_no_longer_than_needed_plus_grace(
    quota: Any, redis_url: str, redis_client: Any, algorithm: str, rate: str, bound_ms: Any
) -> None:
    _settle(quota, redis_url, p={"algorithm": algorithm, "windows": rate})
    for _ in range(3):
        time.sleep(0.4)
        charged_at = time.monotonic()
        outcome = django_quota.evaluate("p", {"ip": "192.0.2.9"})
    time.sleep(0.3)
    counters = redis_client.keys("*")
    assert len(counters) == 1  # the evaluation-id ledger lives in the counter: no key per call
    ttl = redis_client.pttl(counters[0])
    # The TTL runs down from the last charge: allow what has passed since, however slow.
    since_ms = (time.monotonic() - charged_at) * 1000
    needed = max(bound_ms(outcome) + 1_000, 5_000)  # CLEANUP_GRACE 1 s, DEDUP_TTL 5 s
    assert needed - since_ms - 2 <= ttl <= needed


def test_keys_hold_no_raw_identity(quota: Any, redis_url: str, redis_client: Any) -> None:
    _settle(quota, redis_url, p={"windows": "5/h", "selector": ["user", "ip", "route"]})
    django_quota.evaluate("p", {"user": "alice-42", "ip": "203.0.113.99", "route": "orders"})
    dump = b" ".join(redis_client.keys("*"))
    for raw in (b"alice-42", b"203.0.113.99"):
        assert raw not in dump
    assert b"orders" in dump  # route values stay readable
    for key in redis_client.keys("*"):
        if redis_client.type(key) == b"hash":
            values = b" ".join(redis_client.hvals(key))
            assert b"alice" not in values


def test_noscript_after_script_flush_is_recovered_silently(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    _settle(quota, redis_url, p={"windows": "3/h"})
    subject = {"ip": "192.0.2.10"}
    assert django_quota.evaluate("p", subject).remaining == 2
    redis_client.script_flush()
    assert django_quota.evaluate("p", subject).remaining == 1
    redis_client.script_flush()
    assert django_quota.peek("p", subject).remaining == 1


def test_refused_connection_fails_by_failure_mode(quota: Any) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    quota(
        REDIS_URL=f"redis://127.0.0.1:{port}/0",
        FAILURE_RETRY_AFTER=3,
        POLICIES={
            "closed": {"windows": "3/h"},
            "open": {"windows": "3/h", "failure_mode": "open"},
        },
    )
    closed = django_quota.evaluate("closed", {"ip": "192.0.2.1"})
    assert (closed.decision, closed.reason, closed.retry_after, closed.allowed) == (
        "failed_closed",
        "backend_unavailable",
        3.0,
        False,
    )
    opened = django_quota.evaluate("open", {"ip": "192.0.2.1"})
    assert (opened.decision, opened.reason, opened.allowed) == (
        "failed_open",
        "backend_unavailable",
        True,
    )
    assert opened.windows == () and not math.isnan(0.0)


def test_url_query_options_cannot_undo_the_pinned_client_settings(quota: Any) -> None:
    quota(
        REDIS_URL="redis://127.0.0.1:1/0?socket_timeout=30&max_connections=999",
        TIMEOUT=0.2,
        DEADLINE=0.5,
        MAX_INFLIGHT=7,
        POLICIES={"p": {"windows": "1/h"}},
    )
    backend: Any = limiter.get_backend()
    pool = backend.client.connection_pool
    assert pool.max_connections == 7
    assert pool.connection_kwargs["socket_timeout"] == 0.2
    assert pool.connection_kwargs["socket_connect_timeout"] == 0.2
    assert pool.connection_kwargs["retry"].get_retries() == 0
