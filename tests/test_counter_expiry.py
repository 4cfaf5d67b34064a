"""The counter's expiry after a charge (docs/arithmetic.md, "TTLs"): set to
``max(need + CLEANUP_GRACE, DEDUP_TTL)`` from now, or kept (``SET … KEEPTTL``) when the
clock is the one expiries follow (Redis ``TIME``; the memory backend's own clock), the
windows are still those of the stored ``t``, and they outlive now by ``DEDUP_TTL``.

A kept expiry is told from a set one by a marker: before a charge the test moves the
counter's expiry to :data:`MARKER_MS` (``PEXPIRE`` on Redis, the entry itself on the
memory backend), which no charge sets; a charge that keeps the expiry leaves it there.
With a client clock a charge never keeps it: that clock may stand still (clamped to the
stored ``t`` while it runs behind) or run slower than the server's, and a kept expiry
would then come too early for the ledger or the window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

import django_quota
from django_quota import limiter, policies
from django_quota.backends.memory import MemoryBackend
from tests import clock

START = 1_800_000_000.0  # a minute boundary (epoch seconds), the settable clock's start
SUBJECT = {"ip": "192.0.2.45"}
#: An expiry (ms from now, about 3.2 years) that no charge sets: the longest lifetime is
#: a 366-day period plus the grace (or DEDUP_TTL).
MARKER_MS = 10**11


def counter_of(policy_id: str) -> str:
    prepared = limiter.get_limiter().prepare(
        [policies.get_policy(policy_id)], SUBJECT, 1, peek=True
    )
    assert prepared.request is not None
    return prepared.request.counters[0]


def mark_expiry(counter: str, redis_client: Any) -> None:
    """Move ``counter``'s expiry to MARKER_MS from now."""
    backend = limiter.get_backend()
    if isinstance(backend, MemoryBackend):
        backend._counters[counter].expires_at = backend._clock_ms() + MARKER_MS
    else:
        assert redis_client.pexpire(counter, MARKER_MS)


def kept(counter: str) -> bool:
    """Whether ``counter`` still has the marked expiry."""
    return limiter.get_backend().ttl_ms(counter) > MARKER_MS - 60_000


@pytest.fixture
def configure(quota: Any, redis_url: str) -> Iterator[Any]:
    clock.set_to(START)

    def apply(backend: str, algorithm: str, windows: str, **values: Any) -> None:
        quota(
            BACKEND=backend,
            REDIS_URL=redis_url,
            POLICIES={"p": {"algorithm": algorithm, "windows": windows}},
            **values,
        )

    yield apply
    clock.set_to(START)


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window"])
def test_a_charge_in_the_same_windows_keeps_the_expiry_on_the_server_clock(
    configure: Any, redis_client: Any, backend: str, algorithm: str
) -> None:
    configure(backend, algorithm, "1000/d")  # CLOCK "redis": the windows end hours away
    assert django_quota.evaluate("p", SUBJECT).remaining == 999
    counter = counter_of("p")
    mark_expiry(counter, redis_client)
    assert django_quota.evaluate("p", SUBJECT).remaining == 998
    assert kept(counter)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_charge_sets_the_expiry_when_dedup_ttl_outlives_the_window(
    configure: Any, redis_client: Any, backend: str
) -> None:
    # A 1 s window and DEDUP_TTL 5 s: the ledger needs more than the window.
    configure(backend, "fixed_window", "1000/s", DEDUP_TTL=5.0)
    django_quota.evaluate("p", SUBJECT)
    counter = counter_of("p")
    mark_expiry(counter, redis_client)
    django_quota.evaluate("p", SUBJECT)
    assert not kept(counter)
    assert 4_000 < limiter.get_backend().ttl_ms(counter) <= 5_000


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket"])
def test_a_charge_on_a_client_clock_always_sets_the_expiry(
    configure: Any, redis_client: Any, backend: str, algorithm: str
) -> None:
    configure(backend, algorithm, "5/m", CLOCK="tests.clock.now")
    django_quota.evaluate("p", SUBJECT)
    counter = counter_of("p")
    mark_expiry(counter, redis_client)
    clock.set_to(START + 20)
    django_quota.evaluate("p", SUBJECT)
    assert not kept(counter)
    # 40 s to the window's end (+ a period for the sliding window counter) + 1 s grace;
    # the token bucket: the token charged at 20 s refills in 12 s (the first one did), + 1 s.
    expected = {"fixed_window": 41_000, "sliding_window": 101_000, "token_bucket": 13_000}
    assert expected[algorithm] - 2_000 < limiter.get_backend().ttl_ms(counter) <= expected[
        algorithm
    ]


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_token_bucket_always_sets_the_expiry(
    configure: Any, redis_client: Any, backend: str
) -> None:
    configure(backend, "token_bucket", "1000/d")
    django_quota.evaluate("p", SUBJECT)
    counter = counter_of("p")
    mark_expiry(counter, redis_client)
    django_quota.evaluate("p", SUBJECT)
    assert not kept(counter)  # its need grows with every charge


# -- A client clock that steps back (MAX_CLOCK_REGRESSION): the effective now stays at the
# stored t while the wall clock runs on. Seen failing when such a charge kept the expiry
# (the counter expired 399 ms after "b", the retry of "b" was charged again, a third unit
# was admitted in a 2/m window).
@pytest.fixture
def regressing(quota: Any, redis_url: str) -> Iterator[Any]:
    clock.set_to(START)

    def apply(backend: str, windows: str = "5/m", **values: Any) -> Any:
        quota(
            BACKEND=backend,
            REDIS_URL=redis_url,
            CLOCK="tests.clock.now",
            POLICIES={"p": {"algorithm": "fixed_window", "windows": windows}},
            **values,
        )
        return limiter.get_backend().ttl_ms

    yield apply
    clock.set_to(START)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_charge_during_a_clock_regression_keeps_its_id_for_dedup_ttl(
    regressing: Any, backend: str
) -> None:
    ttl_of = regressing(backend, DEDUP_TTL=1.0, CLEANUP_GRACE=0)
    clock.set_to(START + 59)  # 1 s before the window ends: PX max(1000 + 0, 1000)
    assert django_quota.evaluate("p", SUBJECT, evaluation_id="a").remaining == 4
    time.sleep(0.6)
    clock.set_to(START + 58.5)  # 0.5 s behind t: the effective now is t
    assert django_quota.evaluate("p", SUBJECT, evaluation_id="b").remaining == 3
    left = ttl_of(counter_of("p"))
    assert left > 1_000 - 150, f"the counter expires in {left} ms, before DEDUP_TTL"


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_retry_during_a_clock_regression_is_not_charged_twice(
    regressing: Any, backend: str
) -> None:
    regressing(backend, DEDUP_TTL=1.0, CLEANUP_GRACE=0)
    clock.set_to(START + 59)
    assert django_quota.evaluate("p", SUBJECT, evaluation_id="a").remaining == 4
    time.sleep(0.6)
    clock.set_to(START + 58.5)
    assert django_quota.evaluate("p", SUBJECT, evaluation_id="b").remaining == 3
    time.sleep(0.6)  # within DEDUP_TTL of "b" on the wall clock and on the client's
    clock.set_to(START + 59.1)
    retry = django_quota.evaluate("p", SUBJECT, evaluation_id="b")
    assert retry.remaining == 3, "the retry of 'b' found no ledger and was charged again"


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_clock_step_back_within_max_regression_never_reopens_the_window(
    regressing: Any, backend: str
) -> None:
    regressing(backend, "2/m", DEDUP_TTL=0.5, CLEANUP_GRACE=0.3)
    began = time.monotonic()

    def client_clock(step_back: float) -> None:  # wall time + an offset, stepped back
        clock.set_to(START + 59.5 + (time.monotonic() - began) - step_back)

    client_clock(0)
    assert django_quota.evaluate("p", SUBJECT).decision == "allowed"
    time.sleep(0.6)
    client_clock(0.8)  # 0.2 s behind t: the effective now is t
    assert django_quota.evaluate("p", SUBJECT).decision == "allowed"
    time.sleep(0.4)
    client_clock(0.8)  # the same window on the client's clock, full
    third = django_quota.evaluate("p", SUBJECT)
    assert third.decision == "denied", "a third unit admitted in a 2/m window"


# -- The expiry each charge sets, Lua against the model, over the differential tests'
# groups and steps (those run with a 10-year CLEANUP_GRACE and never read a TTL). Their
# now is explicit, a client clock: every charge sets its expiry, and Lua's PX is the
# model's lifetime.
def _expiry_run(client: Any, group: list[Any], sequence: list[Any], dedup: int, grace: int) -> None:
    from django_quota.backends.redis import RedisBackend
    from django_quota.core.calls import PolicyCall
    from django_quota.core.protocol import GroupRequest, fingerprint
    from tests.test_differential import START_MS, _follow

    client.flushall()
    # Above every lifetime this group can set (a token bucket's is up to C * P / L ms,
    # years for a long period), so that only a kept expiry reads as the marker.
    longest = max(
        -(-window.capacity * window.period_ms // window.limit) + 2 * window.period_ms
        for _, windows, _ in group
        for window in windows
    )
    marker = max(MARKER_MS, 2 * (longest + grace + dedup))
    model = MemoryBackend(10**6, clock_ms=lambda: 0)
    lua = RedisBackend(url=None, timeout=5.0, max_inflight=4, client_factory=lambda _a: client)
    now, evaluation_id, last = START_MS, "e0", None
    for number, (step, cost, subject, peek, repeat) in enumerate(sequence):
        now += _follow(step, last)
        if not repeat:
            evaluation_id = f"e{number + 1}"
        counters = tuple(f"q:{{s{subject}}}:p{index}:r" for index in range(len(group)))
        for key in counters:
            if client.pexpire(key, marker):
                if key in model._counters:
                    model._counters[key].expires_at = marker
            else:
                # Gone from Redis: a lifetime of a few ms ran out on the wall clock since
                # the last step, where the model's clock stands still. Both lose it.
                model._counters.pop(key, None)
        request = GroupRequest(
            counters=counters,
            fingerprint=fingerprint(evaluation_id),
            may_repeat=repeat or number % 3 == 0,
            calls=tuple(PolicyCall(a, ws, cost, enforce) for a, ws, enforce in group),
            now_ms=now,
            peek=peek,
            max_regression_ms=-1,
            dedup_ttl_ms=dedup,
            cleanup_grace_ms=grace,
        )
        last = model.evaluate(request)
        assert lua.evaluate(request) == last, f"reply differs at step {number}"
        for key in counters:
            entry = model._counters.get(key)
            pttl = client.pttl(key)
            if entry is None:
                assert pttl == -2, f"step {number}: {key} only in Redis"
                continue
            if pttl == -2 and entry.expires_at < 1_000:
                continue  # a lifetime under a second already ran out on the wall clock
            model_kept = entry.expires_at == marker
            lua_kept = pttl > marker - 60_000
            assert lua_kept == model_kept, (
                f"step {number} (now={now}): Redis {'kept' if lua_kept else 'set'} "
                f"the expiry (PTTL {pttl}), the model {entry.expires_at}"
            )
            if not model_kept:
                assert entry.expires_at - 1_000 < pttl <= entry.expires_at, f"step {number}"


def test_lua_sets_the_same_expiry_as_the_model(redis_server: Any) -> None:
    import redis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.test_differential import EXAMPLES, policy_calls, steps

    client = redis.Redis(host=redis_server.host, port=redis_server.port, db=2)
    slow = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=slow)
    @given(
        group=st.lists(policy_calls(), min_size=1, max_size=3),
        dedup=st.sampled_from([0, 1_000, 2_000, 5_000, 60_000, 3_600_000]),
        grace=st.sampled_from([0, 1, 1_000]),
        data=st.data(),
    )
    def check(group: Any, dedup: int, grace: int, data: Any) -> None:
        longest = max(window.capacity for _, windows, _ in group for window in windows)
        _expiry_run(client, group, data.draw(steps(min(longest, 20))), dedup, grace)

    try:
        check()
    finally:
        client.flushall()
        client.close()
