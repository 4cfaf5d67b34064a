"""The denial cache (docs/failures.md#the-denial-cache): a refusal Redis gave is answered
again by this process, without a backend call, with exactly the numbers Redis gives.

The differential test runs hypothesis-generated sequences (time steps that land on a
reply's times, several overlapping groups of every algorithm, costs, peeks, callers' ids)
on two limiters, the denial cache on and off, each on its own fakeredis server or real
Redis database: every outcome must be the same, ``backend_mode`` and the random
evaluation id aside, and so must every key the two backends hold."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import Counter
from collections.abc import Iterator
from io import StringIO
from typing import Any
from unittest import mock

import fakeredis
import pytest
import redis
from django.core.management import call_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import django_quota
from django_quota import conf, limiter, policies
from django_quota.backends.redis import RedisBackend
from django_quota.checks import check_settings
from django_quota.core.calls import REFUSED, PolicyResult
from django_quota.core.denials import advanced, hold_ms
from django_quota.core.errors import BackendError
from django_quota.core.outcome import INDETERMINATE, Outcome
from django_quota.core.policy import (
    ALGORITHMS,
    CONCURRENCY,
    FIXED_WINDOW,
    SLIDING_LOG,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    Enforcement,
    Policy,
    Window,
    settings_revision,
)
from django_quota.core.windows import WindowResult
from django_quota.engine import Limiter
from tests.test_metrics import sample

EXAMPLES = int(os.environ.get("QUOTA_DENIAL_CACHE_EXAMPLES", "60"))
START_MS = 1_764_000_000_000
HMAC_KEY = "tests-hmac-key-0123456789"
#: Checks never connect: any well-formed URL will do.
REDIS_URL = "redis://127.0.0.1:6379/0"
#: Counter keys outlive every sequence: nothing expires by Redis's wall clock mid-run.
HUGE_GRACE = 10 * 365 * 86_400.0
#: Outcomes each engine answered from its cache, over the whole session.
HITS: Counter[str] = Counter()


def policy(
    name: str, algorithm: str, windows: tuple[Window, ...], *, shadow: bool = False
) -> Policy:
    selector = ("user",)
    return Policy(
        id=name,
        algorithm=algorithm,
        windows=windows,
        selector=selector,
        enforcement=Enforcement.SHADOW if shadow else "enforce",
        revision=settings_revision(algorithm, selector, windows),
    )


def build_limiter(client: Any, cache: bool, **values: Any) -> Limiter:
    """A limiter on ``client`` (a Redis database of its own), denial cache on or off."""
    parsed, problems = conf.parse_settings(
        {
            "REDIS_URL": "redis://denial-cache.invalid:6379/0",
            "HMAC_KEY": HMAC_KEY,
            "CLOCK": "client",
            "CLEANUP_GRACE": HUGE_GRACE,
            "DENIAL_CACHE": {"ENABLED": cache},
            # Exactness is under test, not latency: fakeredis loads and runs each script in
            # this process, which a loaded machine once took past the default DEADLINE.
            "TIMEOUT": 5.0,
            "DEADLINE": 10.0,
            **values,
        },
        secret_key="tests",
        with_policies=False,
    )
    assert problems == [] and parsed is not None
    backend = RedisBackend(
        url=None, timeout=5.0, max_inflight=4, client_factory=lambda _asynchronous: client
    )
    return Limiter(parsed, backend)


def normalised(outcomes: list[Outcome]) -> list[Outcome]:
    """Outcomes without what a cache answer differs in: the mode."""
    return [dataclasses.replace(o, backend_mode="") for o in outcomes]


def holdings(client: Any) -> dict[bytes, object]:
    """Every key of ``client``'s database and its value (strings and lists)."""
    found: dict[bytes, object] = {}
    for key in client.keys("*"):
        if client.type(key) == b"list":
            found[key] = client.lrange(key, 0, -1)
        else:
            found[key] = client.get(key)
    return found


# -- the differential test --------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs(redis_server: Any) -> dict[str, tuple[Any, Any]]:
    """Two databases per backend kind: the cache-on limiter's and the cache-off one's."""
    real = [redis.Redis(host=redis_server.host, port=redis_server.port, db=db) for db in (4, 5)]
    fake = [fakeredis.FakeRedis(server=fakeredis.FakeServer()) for _ in range(2)]
    return {"fakeredis": (fake[0], fake[1]), "redis": (real[0], real[1])}


@st.composite
def window_strategy(draw: Any, algorithm: str) -> tuple[Window, ...]:
    """One to three windows of small limits (refusals come soon), a token bucket's
    capacity sometimes apart from its rate."""
    out = []
    for index in range(draw(st.integers(1, 3))):
        limit = draw(st.sampled_from([1, 2, 3, 3, 4, 6]))
        capacity = limit
        if algorithm == TOKEN_BUCKET and draw(st.booleans()):
            capacity = draw(st.integers(1, 8))
        period = draw(st.sampled_from([1_000, 2_000, 3_000, 60_000]))
        out.append(Window(f"w{index}", limit, period, capacity))
    return tuple(out)


#: A step that follows the previous outcome: wait exactly one of its times, +-1 ms.
FOLLOW = st.tuples(
    st.sampled_from(["reset_after", "retry_after", "replenish_after"]),
    st.integers(0, 2),
    st.sampled_from([-1, 0, 0, 1]),
)
#: How a step evaluates: mostly a fresh evaluation, sometimes a peek, a caller's new
#: id, or the previous step's id again.
MODES = ["fresh"] * 6 + ["peek", "caller", "repeat"]


@st.composite
def steps(draw: Any, groups: int, max_cost: int) -> list[tuple[Any, int, int, int, str]]:
    """(time step ms or a FOLLOW triple, group, subject, cost, mode); half of the steps
    repeat the group, subject and cost of one of the last three (a client hammering,
    between other charges of the same counters)."""
    out: list[tuple[Any, int, int, int, str]] = []
    for _ in range(draw(st.integers(1, 40))):
        if out and draw(st.booleans()):  # one of the last three again: A, A or A, B, A
            _, group, subject, cost, _ = out[-draw(st.integers(1, min(3, len(out))))]
            step = draw(st.one_of(FOLLOW, st.integers(0, 20), st.integers(0, 20)))
            out.append((step, group, subject, cost, draw(st.sampled_from(MODES))))
            continue
        step = draw(
            st.one_of(
                FOLLOW,
                FOLLOW,
                FOLLOW,
                st.integers(0, 5),
                st.integers(0, 1_500),
                st.sampled_from([999, 1_000, 1_001, 60_000]),
                st.integers(-1_500, -1),  # a client clock running backwards
            )
        )
        # Mostly 1; above 1 (a token bucket's refusal then holds less than its
        # retry_after), 0 (a peek) and above every limit (refused before Redis) too.
        cost = draw(st.sampled_from([1] * 6 + [2, 3, 0, max_cost + 1]))
        out.append(
            (
                step,
                draw(st.integers(0, groups - 1)),
                draw(st.integers(0, 1)),
                cost,
                draw(st.sampled_from(MODES)),
            )
        )
    return out


def _follow(step: Any, last: list[Outcome]) -> int:
    if isinstance(step, int):
        return step
    field, index, delta = step
    windows = [window for outcome in last for window in outcome.windows]
    if not windows:
        return 0
    value = getattr(windows[index % len(windows)], field)
    return max(0, round(value * 1000) + delta) if value is not None else 0


def _run_sequence(
    engine: str,
    clients: tuple[Any, Any],
    group_list: list[list[Policy]],
    sequence: list[tuple[Any, int, int, int, str]],
    regression: float,
) -> None:
    for client in clients:
        client.flushdb()
    on = build_limiter(clients[0], True, MAX_CLOCK_REGRESSION=regression)
    off = build_limiter(clients[1], False, MAX_CLOCK_REGRESSION=regression)
    now = [START_MS]

    def clock() -> float:
        return now[0] / 1000

    last: list[Outcome] = []
    evaluation_id = "id-0"
    for number, (step, group_index, subject, cost, mode) in enumerate(sequence):
        now[0] += _follow(step, last)
        if mode == "caller":
            evaluation_id = f"id-{number + 1}"
        caller_id = evaluation_id if mode in ("caller", "repeat") else None
        group = group_list[group_index]
        answers = []
        for engine_limiter in (on, off):
            # The same fresh id on both sides: the ledgers they store must be equal too.
            fresh_id = f"fresh-{number}"
            with mock.patch("django_quota.engine.decisions.new_evaluation_id", lambda: fresh_id):  # noqa: B023
                prepared = engine_limiter.prepare(
                    group,
                    {"user": f"u{subject}"},
                    cost,
                    peek=mode == "peek",
                    evaluation_id=caller_id,
                    clock=clock,
                )
            answers.append(engine_limiter.run(prepared))
        cached, asked = answers
        context = f"{engine} step {number} (now={now[0]}, cost={cost}, mode={mode})"
        assert normalised(cached) == normalised(asked), context
        assert all(outcome.backend_mode != "cache" for outcome in asked)
        hits = [outcome for outcome in cached if outcome.backend_mode == "cache"]
        if hits:
            HITS[engine] += 1
            assert mode == "fresh", f"{context}: a {mode} evaluation was answered by the cache"
            assert any(outcome.decision == "denied" for outcome in hits)
            assert not any(p.shadow for p in group)
        assert holdings(clients[0]) == holdings(clients[1]), f"{context}: stored state differs"
        last = asked


@pytest.mark.parametrize("engine", ["fakeredis", "redis"])
def test_answers_from_the_cache_are_the_answers_of_redis(
    pairs: dict[str, tuple[Any, Any]], engine: str
) -> None:
    before = HITS[engine]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data())
    def check(data: Any) -> None:
        policies = []
        for index in range(3):
            algorithm = data.draw(st.sampled_from(CACHED))
            shadow = data.draw(st.integers(0, 7)) == 0
            policies.append(
                policy(f"p{index}", algorithm, data.draw(window_strategy(algorithm)), shadow=shadow)
            )
        # Overlapping groups: a charge through one must forget the other's refusals.
        members = data.draw(
            st.lists(
                st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
                min_size=1,
                max_size=3,
            )
        )
        group_list = [[policies[index] for index in chosen] for chosen in members]
        max_cost = min(20, max(w.capacity for p in policies for w in p.windows))
        sequence = data.draw(steps(len(group_list), max_cost))
        regression = data.draw(st.sampled_from([0.0, 1.0, 1e6]))
        _run_sequence(engine, pairs[engine], group_list, sequence, regression)

    check()
    assert HITS[engine] > before, "no step was answered by the cache"


#: The algorithms whose refusals the cache answers: not a concurrency policy's, which a
#: release in any process frees (docs/concurrency.md).
CACHED = tuple(algorithm for algorithm in ALGORITHMS if algorithm != CONCURRENCY)


@pytest.mark.parametrize("algorithm", CACHED)
def test_every_algorithm_is_answered_from_the_cache_until_its_numbers_move(
    pairs: dict[str, tuple[Any, Any]], algorithm: str
) -> None:
    """One policy of two windows, hammered at 1 ms steps well past its limit: the cache
    answers, the numbers stay Redis's, and a refusal is asked of Redis again only when
    its hold ends."""
    windows = (Window("short", 3, 1_000, 3), Window("long", 5, 60_000, 5))
    group = [policy("hammered", algorithm, windows)]
    sequence = [(1, 0, 0, 1, "fresh")] * 300 + [(7, 0, 0, 2, "fresh")] * 100
    before = HITS["fakeredis"]
    _run_sequence("fakeredis", pairs["fakeredis"], [group], sequence, 1.0)
    assert HITS["fakeredis"] - before > 150


# -- the rule, pure ---------------------------------------------------------------------------
def test_a_token_bucket_refusal_of_a_cost_above_one_holds_until_the_next_token_only() -> None:
    # capacity 5 at 5/s, empty: a token every 200 ms, cost 3 fits in 600 ms.
    numbers = WindowResult(
        remaining=0, reset_after_ms=1_000, retry_after_ms=600, replenish_after_ms=200
    )
    assert hold_ms(TOKEN_BUCKET, [numbers]) == 200
    later = advanced(PolicyResult(REFUSED, START_MS, (numbers,)), 199)
    assert later == PolicyResult(REFUSED, START_MS + 199, (WindowResult(0, 801, 401, 1),))


def test_a_window_with_nothing_counted_never_ends_a_hold() -> None:
    empty = WindowResult(remaining=10, reset_after_ms=0, retry_after_ms=-1, replenish_after_ms=0)
    refusing = WindowResult(
        remaining=0, reset_after_ms=900, retry_after_ms=900, replenish_after_ms=300
    )
    assert hold_ms(SLIDING_LOG, [empty, refusing]) == 300
    assert hold_ms(SLIDING_WINDOW, [refusing]) == 300
    assert hold_ms(FIXED_WINDOW, [refusing._replace(replenish_after_ms=900)]) == 900
    assert advanced(PolicyResult(REFUSED, 0, (empty,)), 250).windows == (empty,)


# -- through the public API, on the Redis clock ----------------------------------------------
def evalsha_calls(client: Any) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.fixture
def hammered(quota: Any, redis_url: str, redis_client: Any) -> Iterator[Any]:
    quota(
        REDIS_URL=redis_url,
        POLICIES={
            "dc-orders": {"windows": "2/m", "selector": ["user"]},
            "dc-shadow": {"windows": "2/m", "selector": ["user"], "enforcement": "shadow"},
            "dc-api": {"windows": "2/m", "selector": ["api_key"]},
        },
    )
    yield redis_client
    limiter.settings_changed()


def test_a_repeated_denial_makes_no_backend_call(hammered: Any) -> None:
    subject = {"user": "42"}
    for _ in range(2):
        assert django_quota.evaluate("dc-orders", subject).decision == "allowed"
    first = django_quota.evaluate("dc-orders", subject)
    assert (first.decision, first.backend_mode) == ("denied", "redis")
    calls = evalsha_calls(hammered)
    repeated = [django_quota.evaluate("dc-orders", subject) for _ in range(20)]
    assert evalsha_calls(hammered) == calls
    for outcome in repeated:
        assert (outcome.decision, outcome.reason, outcome.backend_mode) == (
            "denied",
            "default_quota_exhausted",
            "cache",
        )
        assert (outcome.window, outcome.limit, outcome.remaining) == ("default", 2, 0)
        assert outcome.retry_after is not None and first.retry_after is not None
        assert 0 < outcome.retry_after <= first.retry_after
        assert outcome.reset_after == outcome.retry_after
    # Another subject, and the same subject at another cost, are asked of Redis.
    assert django_quota.evaluate("dc-orders", {"user": "43"}).backend_mode == "redis"
    assert django_quota.evaluate("dc-orders", subject, cost=2).backend_mode == "redis"
    assert evalsha_calls(hammered) == calls + 2


def test_a_repeated_async_denial_makes_no_backend_call(hammered: Any) -> None:
    async def scenario() -> list[Outcome]:
        for _ in range(3):
            await django_quota.aevaluate("dc-orders", {"user": "7"})
        calls = evalsha_calls(hammered)
        repeated = [await django_quota.aevaluate("dc-orders", {"user": "7"}) for _ in range(5)]
        assert evalsha_calls(hammered) == calls
        return repeated

    assert {o.backend_mode for o in asyncio.run(scenario())} == {"cache"}


def test_a_caller_s_evaluation_id_always_asks_redis(hammered: Any) -> None:
    subject = {"user": "5"}
    for _ in range(3):
        django_quota.evaluate("dc-orders", subject)
    assert django_quota.evaluate("dc-orders", subject).backend_mode == "cache"
    calls = evalsha_calls(hammered)
    for number in range(3):
        outcome = django_quota.evaluate("dc-orders", subject, evaluation_id=f"order-{number}")
        assert (outcome.decision, outcome.backend_mode) == ("denied", "redis")
    assert evalsha_calls(hammered) == calls + 3


def test_peeks_neither_read_nor_fill_the_cache(hammered: Any) -> None:
    subject = {"user": "8"}
    for _ in range(2):
        django_quota.evaluate("dc-orders", subject)
    for _ in range(2):
        assert django_quota.peek("dc-orders", subject).backend_mode == "redis"
    assert len(cache_of(limiter.get_limiter())) == 0
    django_quota.evaluate("dc-orders", subject)
    assert len(cache_of(limiter.get_limiter())) == 1
    assert django_quota.peek("dc-orders", subject).backend_mode == "redis"


def test_shadow_policies_are_never_cached(hammered: Any) -> None:
    subject = {"user": "9"}
    group = [policies.get_policy(name) for name in ("dc-orders", "dc-shadow")]
    for _ in range(2):
        limiter.evaluate_policies(group, subject)
    calls = evalsha_calls(hammered)
    for _ in range(3):
        outcomes = limiter.evaluate_policies(group, subject)
        assert [(o.decision, o.backend_mode) for o in outcomes] == [
            ("denied", "redis"),
            ("shadow_denied", "redis"),
        ]
    assert evalsha_calls(hammered) == calls + 3
    assert len(cache_of(limiter.get_limiter())) == 0
    # The enforced policy alone is cached.
    django_quota.evaluate("dc-orders", subject)
    assert django_quota.evaluate("dc-orders", subject).backend_mode == "cache"


def cache_of(current: Limiter) -> Any:
    assert current.denials is not None
    return current.denials


def test_reset_in_the_process_forgets_the_refusal(hammered: Any) -> None:
    subject = {"user": "11"}
    for _ in range(3):
        django_quota.evaluate("dc-orders", subject)
    assert django_quota.evaluate("dc-orders", subject).backend_mode == "cache"
    assert django_quota.reset("dc-orders", subject) == 1
    assert len(cache_of(limiter.get_limiter())) == 0
    outcome = django_quota.evaluate("dc-orders", subject)
    assert (outcome.decision, outcome.remaining, outcome.backend_mode) == ("allowed", 1, "redis")


def test_testing_reset_forgets_the_refusals_with_the_counters(hammered: Any) -> None:
    """``django_quota.testing.reset()`` between tests: a refusal remembered by an earlier
    test never answers the next one (django-ratelimit's own tests caught it)."""
    from django_quota import testing

    subject = {"user": "15"}
    for _ in range(3):
        django_quota.evaluate("dc-orders", subject)
    assert len(cache_of(limiter.get_limiter())) == 1
    testing.reset()
    assert len(cache_of(limiter.get_limiter())) == 0
    outcome = django_quota.evaluate("dc-orders", subject)
    assert (outcome.decision, outcome.remaining, outcome.backend_mode) == ("allowed", 1, "redis")


def test_areset_forgets_the_refusal(hammered: Any) -> None:
    subject = {"user": "12"}
    for _ in range(4):
        django_quota.evaluate("dc-orders", subject)
    assert len(cache_of(limiter.get_limiter())) == 1
    assert asyncio.run(django_quota.areset("dc-orders", subject)) == 1
    assert len(cache_of(limiter.get_limiter())) == 0
    assert django_quota.evaluate("dc-orders", subject).decision == "allowed"


def test_the_reset_command_forgets_the_refusal(hammered: Any) -> None:
    subject = {"api_key": "key-13"}
    for _ in range(4):
        django_quota.evaluate("dc-api", subject)
    assert django_quota.evaluate("dc-api", subject).backend_mode == "cache"
    call_command("quota", "reset", "dc-api", "--api-key", "key-13", "--yes", stdout=StringIO())
    assert len(cache_of(limiter.get_limiter())) == 0
    outcome = django_quota.evaluate("dc-api", subject)
    assert (outcome.decision, outcome.backend_mode) == ("allowed", "redis")


def test_a_charge_of_a_shared_counter_forgets_the_refusal(hammered: Any) -> None:
    subject = {"user": "14"}
    django_quota.evaluate("dc-orders", subject)  # 1 left
    denied = django_quota.evaluate("dc-orders", subject, cost=2)
    assert (denied.decision, denied.remaining, denied.backend_mode) == ("denied", 1, "redis")
    assert django_quota.evaluate("dc-orders", subject, cost=2).backend_mode == "cache"
    django_quota.evaluate("dc-orders", subject)  # the last unit, charged by cost 1
    again = django_quota.evaluate("dc-orders", subject, cost=2)
    assert (again.decision, again.remaining, again.backend_mode) == ("denied", 0, "redis")


def test_a_new_revision_misses_the_cache(hammered: Any) -> None:
    subject = {"user": "15"}
    narrow = policy("dc-revised", FIXED_WINDOW, (Window("default", 1, 60_000, 1),))
    wide = policy("dc-revised", FIXED_WINDOW, (Window("default", 3, 60_000, 3),))
    assert narrow.revision != wide.revision
    for _ in range(2):
        limiter.evaluate_policies([narrow], subject)
    assert limiter.evaluate_policies([narrow], subject)[0].backend_mode == "cache"
    outcome = limiter.evaluate_policies([wide], subject)[0]
    assert (outcome.decision, outcome.remaining, outcome.backend_mode) == ("allowed", 2, "redis")


def test_the_retry_after_an_indeterminate_call_asks_redis(
    hammered: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    subject = {"user": "16"}
    for _ in range(3):
        django_quota.evaluate("dc-orders", subject)
    current = limiter.get_limiter()
    cache_of(current).clear()
    backend = current.scripts
    original = backend.run
    calls: list[Any] = []

    def lost_reply(call: Any, deadline: float | None = None) -> Any:
        calls.append(call)
        reply = original(call, deadline)
        if len(calls) == 1:  # ran, but its reply is lost
            raise BackendError(INDETERMINATE, "reply lost")
        return reply

    monkeypatch.setattr(backend, "run", lost_reply)
    outcome = django_quota.evaluate("dc-orders", subject)
    assert (outcome.decision, outcome.backend_mode) == ("denied", "redis")
    assert len(calls) == 2  # the retry went to Redis, not to the cache
    # The refusal the retry got is remembered like any other.
    assert django_quota.evaluate("dc-orders", subject).backend_mode == "cache"
    assert len(calls) == 2


def test_cache_answers_are_counted_apart_without_backend_samples(hammered: Any) -> None:
    subject = {"user": "17"}
    labels = {
        "policy": "dc-orders",
        "decision": "denied",
        "reason": "default_quota_exhausted",
        "selector_dimensions": "user",
    }
    cached_before = sample("django_quota_outcomes_total", backend_mode="cache", **labels)
    redis_before = sample("django_quota_outcomes_total", backend_mode="redis", **labels)
    for _ in range(3):
        django_quota.evaluate("dc-orders", subject)
    health = sample("django_quota_backend_health_total", backend_mode="redis", reason="ok")
    latency = sample("django_quota_backend_latency_seconds_count", backend_mode="redis")
    for _ in range(4):
        django_quota.evaluate("dc-orders", subject)
    assert sample("django_quota_outcomes_total", backend_mode="cache", **labels) == (
        cached_before + 4
    )
    assert sample("django_quota_outcomes_total", backend_mode="redis", **labels) == (
        redis_before + 1
    )
    assert sample("django_quota_backend_health_total", backend_mode="redis", reason="ok") == health
    assert sample("django_quota_backend_latency_seconds_count", backend_mode="redis") == latency


def test_disabled_the_cache_answers_nothing(quota: Any, redis_url: str) -> None:
    quota(
        REDIS_URL=redis_url,
        DENIAL_CACHE={"ENABLED": False},
        POLICIES={"dc-off": {"windows": "1/m", "selector": ["user"]}},
    )
    try:
        modes = [django_quota.evaluate("dc-off", {"user": "1"}).backend_mode for _ in range(4)]
        assert modes == ["redis"] * 4
        assert limiter.get_limiter().denials is None
    finally:
        limiter.settings_changed()


def test_the_memory_backend_has_no_cache(quota: Any) -> None:
    quota(POLICIES={"dc-memory": {"windows": "1/m", "selector": ["user"]}})
    modes = [django_quota.evaluate("dc-memory", {"user": "1"}).backend_mode for _ in range(3)]
    assert modes == ["memory"] * 3
    assert limiter.get_limiter().denials is None


def test_the_cache_keeps_at_most_max_entries_least_recently_used_first(
    pairs: dict[str, tuple[Any, Any]],
) -> None:
    client = pairs["fakeredis"][0]
    client.flushdb()
    current = build_limiter(client, True, DENIAL_CACHE={"MAX_ENTRIES": 2})
    one = policy("dc-lru", FIXED_WINDOW, (Window("default", 1, 60_000, 1),))
    now = START_MS / 1000

    def evaluate(user: str) -> Outcome:
        return current.run(current.prepare([one], {"user": user}, 1, clock=lambda: now))[0]

    for user in ("a", "b", "c"):
        evaluate(user)
        assert evaluate(user).backend_mode == "redis"
    assert evaluate("c").backend_mode == "cache"  # c and b remembered, a dropped
    assert evaluate("b").backend_mode == "cache"
    assert evaluate("a").backend_mode == "redis"  # remembered again, c dropped (b was used)
    assert evaluate("b").backend_mode == "cache"
    assert evaluate("c").backend_mode == "redis"
    assert len(cache_of(current)) == 2


def test_a_refusal_sent_before_a_refund_or_reset_is_not_remembered(
    pairs: dict[str, tuple[Any, Any]],
) -> None:
    # Another thread's refund (or reset) of the counter lands while a refusal is on its
    # way back: the refusal predates it, and remembered it would deny a budget given back.
    client = pairs["fakeredis"][0]
    client.flushdb()
    current = build_limiter(client, True)
    one = policy("dc-race", FIXED_WINDOW, (Window("default", 1, 3_600_000, 1),))

    def prepared() -> Any:
        return current.prepare([one], {"user": "r"}, 1, clock=lambda: 1.7e9)

    assert [current.run(prepared())[0].decision for _ in range(2)] == ["allowed", "denied"]
    cache = cache_of(current)
    [denial] = cache.entries.values()
    request = prepared().request
    cache.clear()
    sent_at = time.monotonic()
    current.forget_denials(request.counters)  # the refund, after the refusal was sent
    assert cache.remember(request, denial.results, sent_at) is False
    assert cache.answer(request, time.monotonic()) is None
    # A refusal sent after the refund is remembered as before.
    assert cache.remember(request, denial.results, time.monotonic() + 1.0) is True
    assert cache.answer(request, time.monotonic() + 1.0) is not None


def test_max_ttl_bounds_an_answer(
    pairs: dict[str, tuple[Any, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = pairs["fakeredis"][0]
    client.flushdb()
    current = build_limiter(client, True, DENIAL_CACHE={"MAX_TTL": 2.0})
    one = policy("dc-ttl", FIXED_WINDOW, (Window("default", 1, 3_600_000, 1),))
    monotonic = [1000.0]
    monkeypatch.setattr("django_quota.engine.decisions.time.monotonic", lambda: monotonic[0])

    def evaluate() -> str:
        outcome = current.run(current.prepare([one], {"user": "t"}, 1, clock=lambda: 1.7e9))
        return outcome[0].backend_mode

    assert [evaluate(), evaluate(), evaluate()] == ["redis", "redis", "cache"]
    monotonic[0] += 1.999
    assert evaluate() == "cache"
    monotonic[0] += 0.001
    assert evaluate() == "redis"


# -- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "key"),
    [
        ({"ENABLED": "yes"}, "QUOTA['DENIAL_CACHE']['ENABLED']"),
        ({"MAX_ENTRIES": 0}, "QUOTA['DENIAL_CACHE']['MAX_ENTRIES']"),
        ({"MAX_ENTRIES": True}, "QUOTA['DENIAL_CACHE']['MAX_ENTRIES']"),
        ({"MAX_TTL": 0}, "QUOTA['DENIAL_CACHE']['MAX_TTL']"),
        ({"MAX_TTL": float("nan")}, "QUOTA['DENIAL_CACHE']['MAX_TTL']"),
        ({"MAX_TTL": "5"}, "QUOTA['DENIAL_CACHE']['MAX_TTL']"),
        ({"TTL": 5}, "QUOTA['DENIAL_CACHE']"),
        (True, "QUOTA['DENIAL_CACHE']"),
    ],
)
def test_a_bad_denial_cache_fails_the_check_naming_the_key(
    settings: Any, value: object, key: str
) -> None:
    settings.QUOTA = {"REDIS_URL": REDIS_URL, "HMAC_KEY": HMAC_KEY, "DENIAL_CACHE": value}
    (message,) = check_settings()
    assert message.id == "django_quota.E003"
    assert message.msg.startswith(f"{key}: ")


def test_a_valid_denial_cache_passes_the_check(settings: Any) -> None:
    settings.QUOTA = {
        "REDIS_URL": REDIS_URL,
        "HMAC_KEY": HMAC_KEY,
        "DENIAL_CACHE": {"ENABLED": False, "MAX_ENTRIES": 1, "MAX_TTL": 0.5},
    }
    assert check_settings() == []
    assert conf.get_settings().denial_cache == conf.DenialCacheSettings(False, 1, 0.5)
    settings.QUOTA = {"REDIS_URL": REDIS_URL, "HMAC_KEY": HMAC_KEY}
    assert conf.get_settings().denial_cache == conf.DenialCacheSettings(True, 4096, 5.0)


def test_the_admin_reset_forgets_the_refusal(admin_client: Any, quota: Any, redis_url: str) -> None:
    from tests import test_admin

    quota(REDIS_URL=redis_url, POLICY_SOURCES=test_admin.SOURCES)
    try:
        row = test_admin.create_policy("dc-admin", windows=(("default", 1, 3600),))
        subject = {"ip": test_admin.IP}
        modes = [django_quota.evaluate("dc-admin", subject).backend_mode for _ in range(3)]
        assert modes == ["redis", "redis", "cache"]
        response = test_admin.act(
            admin_client, "reset_counters", row, ip=test_admin.IP, apply="Reset"
        )
        assert "Reset dc-admin: 1 window(s) had state." in response.content.decode()
        assert len(cache_of(limiter.get_limiter())) == 0
        outcome = django_quota.evaluate("dc-admin", subject)
        assert (outcome.decision, outcome.backend_mode) == ("allowed", "redis")
    finally:
        limiter.settings_changed()
