"""Concurrency policies (docs/concurrency.md): the Python model against evaluate.lua and
release.lua on fakeredis and on a real redis-server, on generated sequences of acquires,
releases (of held, released, expired and unknown leases), peeks, repeats and time
passing exactly to a lease's expiry, alone and in groups with rate policies. Each step
compares the replies, the released units, the stored leases and the keys left (none
once every lease is released or expired)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_quota.core.calls import PolicyCall
from django_quota.core.errors import BackendError
from django_quota.core.policy import CONCURRENCY, Window
from django_quota.core.protocol import GroupReply, GroupRequest, ReleaseRequest, fingerprint
from tests import differential
from tests.differential import SEQUENCES

pytestmark = pytest.mark.redis

EXAMPLES = int(os.environ.get("QUOTA_DIFFERENTIAL_EXAMPLES", "150"))
START_MS = 1_764_000_000_000
HUGE_GRACE_MS = 10 * 365 * 86_400_000  # nothing expires by wall clock during a sequence
RATES = ("fixed_window", "sliding_window", "token_bucket", "sliding_log")


def release(engine: Any, request: ReleaseRequest) -> int | str:
    try:
        return int(engine.backend.release(request))
    except BackendError as exc:
        return exc.reason


@pytest.fixture(scope="module")
def engines(redis_server: Any) -> list[Any]:
    return differential.engines_on(redis_server, db=2)


@st.composite
def groups(draw: Any) -> list[tuple[str, tuple[Window, ...], bool]]:
    """A concurrency policy, alone or with up to two rate policies (any order)."""
    limit = draw(st.integers(1, 6))
    period = draw(st.sampled_from([1_000, 2_000, 60_000]))
    group = [(CONCURRENCY, (Window("default", limit, period, limit),), draw(st.booleans()))]
    for _ in range(draw(st.integers(0, 2))):
        algorithm = draw(st.sampled_from(RATES))
        rate_limit = draw(st.integers(1, 8))
        window = Window("w", rate_limit, draw(st.sampled_from([1_000, 3_000])), rate_limit)
        group.insert(draw(st.integers(0, len(group))), (algorithm, (window,), draw(st.booleans())))
    return group


#: One step: ("acquire", cost, subject, repeat an earlier id), ("release", which earlier
#: id (an index, or -1: never used), subject), ("peek", subject) or ("wait", ms or a
#: ("lease", delta): until the previous reply's oldest lease expires, plus delta).
STEP = st.one_of(
    st.tuples(st.just("acquire"), st.integers(0, 4), st.integers(0, 1), st.booleans()),
    st.tuples(st.just("acquire"), st.integers(1, 2), st.integers(0, 1), st.just(False)),
    st.tuples(st.just("release"), st.integers(-1, 30), st.integers(0, 1)),
    st.tuples(st.just("peek"), st.integers(0, 1)),
    st.tuples(st.just("wait"), st.one_of(st.integers(0, 1_500), st.sampled_from([999, 1_000]))),
    st.tuples(st.just("wait"), st.tuples(st.just("lease"), st.integers(-1, 1))),
)


def run(engines: list[Any], group: list[tuple[str, tuple[Window, ...], bool]], steps: list) -> None:
    for engine in engines:
        engine.reset()
    now = START_MS
    ids: list[str] = []
    last: GroupReply | str | None = None
    calls_of = {
        cost: tuple(PolicyCall(algorithm, ws, cost, enforce) for algorithm, ws, enforce in group)
        for cost in range(5)
    }
    at = group.index(next(p for p in group if p[0] == CONCURRENCY))
    every = tuple(f"q:{{s{s}}}:p{i}:r" for s in range(2) for i in range(len(group)))
    for number, step in enumerate(steps):
        kind = step[0]
        if kind == "wait":
            wait = step[1]
            if not isinstance(wait, int):
                wait = 0
                if isinstance(last, GroupReply) and last.results:
                    reset_after = last.results[at].windows[0].reset_after_ms
                    wait = max(0, reset_after + step[1][1]) if reset_after > 0 else 0
            now += wait
            continue
        subject = step[-1] if kind in ("release", "peek") else step[2]
        counters = tuple(f"q:{{s{subject}}}:p{i}:r" for i in range(len(group)))
        if kind == "release":
            chosen = step[1]
            evaluation_id = ids[chosen % len(ids)] if ids and chosen >= 0 else "never"
            request = ReleaseRequest(counters[at], fingerprint(evaluation_id), now, HUGE_GRACE_MS)
            released = [release(engine, request) for engine in engines]
            assert released[1:] == released[:1] * 2, f"step {number}: released {released}"
        else:
            peek = kind == "peek"
            cost = 1 if peek else step[1]
            repeat = not peek and step[3] and bool(ids)
            evaluation_id = ids[-1] if repeat else f"e{number}"
            if not peek and not repeat:
                ids.append(evaluation_id)
            request = GroupRequest(
                counters=counters,
                calls=calls_of[cost],
                now_ms=now,
                peek=peek,
                max_regression_ms=-1,
                dedup_ttl_ms=2_000,
                cleanup_grace_ms=HUGE_GRACE_MS,
                fingerprint=fingerprint(evaluation_id),
                may_repeat=repeat or number % 2 == 0,
            )
            replies = []
            for engine in engines:
                try:
                    replies.append(engine.backend.evaluate(request))
                except BackendError as exc:
                    replies.append(exc.reason)
            for engine, reply in zip(engines[1:], replies[1:], strict=True):
                assert reply == replies[0], (
                    f"{engine.name} differs from the model at step {number} ({step}, now={now})"
                    f": {reply} != {replies[0]}"
                )
            last = replies[0]
        for counter, (algorithm, windows, enforce) in zip(counters, group, strict=True):
            call = PolicyCall(algorithm, windows, 1, enforce)
            want = engines[0].state(counter, call), engines[0].logs(counter, call)
            for engine in engines[1:]:
                got = engine.state(counter, call), engine.logs(counter, call)
                assert got == want, f"{engine.name} stored {got}, the model {want} ({step})"
        want_keys = engines[0].keys(every)
        for engine in engines[1:]:
            assert engine.keys(every) == want_keys, f"{engine.name} holds other keys ({step})"
    for engine in engines:
        SEQUENCES[("concurrency:seq", engine.name)] += 1


def test_lua_matches_model_for_acquires_releases_and_expiry(engines: list[Any]) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(group=groups(), steps=st.lists(STEP, min_size=1, max_size=40))
    def check(group: Any, steps: Any) -> None:
        run(engines, group, steps)

    check()


def test_every_lease_released_or_expired_leaves_no_key(engines: list[Any]) -> None:
    """Two leases of 3 held, one released twice (once counts), the other expiring: the
    set's key is gone in every engine; a release then frees 0."""
    window = Window("default", 3, 1_000, 3)
    group = [(CONCURRENCY, (window,), True)]
    steps = [
        ("acquire", 1, 0, False),
        ("wait", 10),
        ("acquire", 2, 0, False),
        ("release", 0, 0),
        ("release", 0, 0),
        ("wait", 1_000),  # to the second lease's expiry: no longer held
        ("peek", 0),
        ("release", 1, 0),
    ]
    run(engines, group, steps)
    for engine in engines:
        assert engine.keys(("q:{s0}:p0:r",)) == set()
    model = engines[0].backend
    request = ReleaseRequest("q:{s0}:p0:r", fingerprint("e0"), START_MS, 0)
    assert model.release(request) == 0


def test_a_release_frees_every_lease_its_evaluation_holds(engines: list[Any]) -> None:
    """No acquire makes two leases of one evaluation in a set, but release.lua frees all it
    finds: three of its own (one expired), beside another evaluation's, on fakeredis and
    on Redis alike."""
    key, mine, other = "q:{s0}:p0:r", fingerprint("e1"), fingerprint("e2")
    leases = {
        mine + bytes([0, 4]): START_MS,  # expired at now
        mine + bytes([0, 2]): START_MS + 10,
        other + bytes([0, 1]): START_MS + 20,
        mine + bytes([1, 3]): START_MS + 30,
    }
    for engine in engines[1:]:
        engine.reset()
        engine.client.zadd(key, leases)
        request = ReleaseRequest(key, mine, START_MS, 1_000)
        assert release(engine, request) == 2 + 259, engine.name
        assert engine.client.zrange(key, 0, -1, withscores=True) == [
            (other + bytes([0, 1]), START_MS + 20)
        ], engine.name
        assert 0 < engine.client.pttl(key) <= 20 + 1_000
        assert release(engine, request) == 0
