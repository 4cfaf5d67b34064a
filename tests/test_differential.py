"""Differential tests (docs/arithmetic.md): hypothesis-generated sequences of (time step, cost,
subject, peek, repeated evaluation id) for every algorithm, multi-window policies and
multi-policy groups. The Lua script on fakeredis and on a real redis-server must return
exactly what the Python model returns, every field, and store exactly the same state
(counters, sliding-log lists, and no other key)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_quota.core.calls import PolicyCall
from django_quota.core.policy import ALGORITHMS, CONCURRENCY, MAX_CONCURRENCY, Window
from django_quota.core.protocol import GroupReply, GroupRequest, fingerprint
from django_quota.core.rates import Bounds
from tests import differential
from tests.differential import SEQUENCES, expected_script

EXAMPLES = int(os.environ.get("QUOTA_DIFFERENTIAL_EXAMPLES", "150"))
START_MS = 1_764_000_000_000
PERIODS_MS = [1_000, 2_000, 3_000, 60_000, 3_600_000, 86_400_000, Bounds.MAX_PERIOD_MS]
HUGE_GRACE_MS = 10 * 365 * 86_400_000  # nothing expires by wall clock during a sequence
#: Evaluation-id ledger drops younger than these make a possible repeat indeterminate.
DEDUP_TTLS_MS = [HUGE_GRACE_MS, 2_000, 0]


@st.composite
def windows(draw: Any, algorithm: str, counts: tuple[int, int] = (1, 3)) -> tuple[Window, ...]:
    count = draw(st.integers(*counts))
    if algorithm == CONCURRENCY:  # one window of at most MAX_CONCURRENCY units
        count = 1
    out = []
    for index in range(count):
        period = draw(st.sampled_from(PERIODS_MS))
        kind = draw(st.sampled_from(["small", "small", "small", "bound"]))
        if kind == "bound" and algorithm == CONCURRENCY:
            limit = MAX_CONCURRENCY
        elif kind == "bound":
            limit = min(10**9, Bounds.MAX_PRODUCT // period)
        else:
            limit = draw(st.integers(1, 12))
        capacity = limit
        if algorithm == "token_bucket" and draw(st.booleans()):
            capacity = draw(st.integers(1, 15))
            if capacity * period > Bounds.MAX_PRODUCT:
                capacity = limit
        out.append(Window(f"w{index}", limit, period, capacity))
    return tuple(out)


@st.composite
def policy_calls(
    draw: Any, algorithm: str | None = None, counts: tuple[int, int] = (1, 3)
) -> tuple[str, tuple[Window, ...], bool]:
    chosen = algorithm or draw(st.sampled_from(ALGORITHMS))
    return chosen, draw(windows(chosen, counts)), draw(st.booleans())


#: A step that follows the previous reply: wait exactly one of its times, +-1 ms.
FOLLOW = st.tuples(
    st.sampled_from(["reset_after_ms", "retry_after_ms", "replenish_after_ms"]),
    st.integers(0, 2),
    st.sampled_from([-1, 0, 0, 1]),
)


@st.composite
def steps(draw: Any, max_limit: int) -> list[tuple[Any, int, int, bool, bool]]:
    """(time step ms or a FOLLOW triple, cost, subject, peek, repeat the previous id)."""
    count = draw(st.integers(1, 40))
    out = []
    for _ in range(count):
        step = draw(
            st.one_of(
                FOLLOW,
                FOLLOW,
                st.integers(0, 1_500),
                st.integers(0, 10),
                st.sampled_from([999, 1_000, 1_001, 59_999, 60_000, 3_600_000]),
                st.integers(0, 2 * Bounds.MAX_PERIOD_MS),  # long idle gaps
                st.integers(-1_500, -1),  # client clock running backwards
            )
        )
        cost = draw(st.one_of(st.integers(0, 3), st.integers(0, max_limit + 1)))
        out.append(
            (
                step,
                cost,
                draw(st.integers(0, 2)),
                draw(st.booleans()) and draw(st.booleans()),
                draw(st.integers(0, 9)) == 0,
            )
        )
    return out


def _follow(step: Any, last: GroupReply | str | None) -> int:
    """A fixed step, or the chosen time of the previous reply (plus delta) when it has one."""
    if isinstance(step, int):
        return step
    field, window, delta = step
    if not isinstance(last, GroupReply) or not last.results:
        return 0
    windows = last.results[0].windows
    value = int(getattr(windows[window % len(windows)], field))
    return max(0, value + delta) if value >= 0 else 0


@pytest.fixture(scope="module")
def engines(redis_server: Any) -> list[Any]:
    return differential.engines_on(redis_server, db=1)


def _run(
    engines: list[Any],
    label: str,
    group: list[tuple[str, tuple[Window, ...], bool]],
    sequence: list[tuple[Any, int, int, bool, bool]],
    max_regression_ms: int,
    dedup_ttl_ms: int = HUGE_GRACE_MS,
) -> None:
    for engine in engines:
        engine.reset()
    now = START_MS
    evaluation_id = "e0"
    last: GroupReply | str | None = None
    for number, (step, cost, subject, peek, repeat) in enumerate(sequence):
        now += _follow(step, last)
        if not repeat:
            evaluation_id = f"e{number + 1}"
        counters = tuple(f"q:{{s{subject}}}:p{index}:r" for index in range(len(group)))
        request = GroupRequest(
            counters=counters,
            fingerprint=fingerprint(evaluation_id),
            # a repeat, and every third fresh id too (a caller's own ids are searched for)
            may_repeat=repeat or number % 3 == 0,
            calls=tuple(
                PolicyCall(algorithm, policy_windows, cost, enforce)
                for algorithm, policy_windows, enforce in group
            ),
            now_ms=now,
            peek=peek,
            max_regression_ms=max_regression_ms,
            dedup_ttl_ms=dedup_ttl_ms,
            cleanup_grace_ms=HUGE_GRACE_MS,
        )
        replies: list[GroupReply | str] = [engine.evaluate(request) for engine in engines]
        script = expected_script(request)
        for engine in engines[1:]:  # each ran the script of the group's shape, once
            assert engine.scripts[-1:] == [script], f"{engine.name} ran {engine.scripts[-1:]}"
            engine.scripts.clear()
            SEQUENCES[(f"step:{script}", engine.name)] += 1
        expected = last = replies[0]
        for engine, reply in zip(engines[1:], replies[1:], strict=True):
            assert reply == expected, (
                f"{engine.name} differs from the model at step {number} "
                f"(now={now}, cost={cost}, peek={peek}): {reply} != {expected}"
            )
        for counter, call in zip(counters, request.calls, strict=True):
            want = engines[0].state(counter, call)  # numbers and evaluation-id ledger
            want_logs = engines[0].logs(counter, call)  # sliding_log lists, concurrency leases
            for engine in engines[1:]:
                assert engine.state(counter, call) == want, f"{engine.name} stored another state"
                assert engine.logs(counter, call) == want_logs, f"{engine.name} stored another log"
        every_counter = tuple(
            f"q:{{s{other}}}:p{index}:r" for other in range(3) for index in range(len(group))
        )
        want_keys = engines[0].keys(every_counter)
        for engine in engines[1:]:
            assert engine.keys(every_counter) == want_keys, f"{engine.name} holds other keys"
    for engine in engines:
        SEQUENCES[(label, engine.name)] += 1


#: Window counts of one policy: one (the algorithm's own script) or several (the general).
SHAPES = {"one window": (1, 1), "several windows": (2, 3)}


#: Every (algorithm, shape) pair that exists: a concurrency policy has one window.
ONE_POLICY_CASES = [
    (algorithm, shape)
    for algorithm in ALGORITHMS
    for shape in SHAPES
    if algorithm != CONCURRENCY or shape == "one window"
]


@pytest.mark.parametrize(("algorithm", "shape"), ONE_POLICY_CASES)
def test_lua_matches_model_for_one_policy(engines: list[Any], algorithm: str, shape: str) -> None:
    """Each step asserts the script that ran (_run): with one window, the variant of
    evaluate.lua generated for the algorithm; with several, the general script. A
    concurrency policy has one window, decided by the general script."""

    @settings(
        max_examples=max(1, EXAMPLES // 2),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data())
    def check(data: Any) -> None:
        policy = data.draw(policy_calls(algorithm, SHAPES[shape]))
        max_limit = max(window.capacity for window in policy[1])
        sequence = data.draw(steps(min(max_limit, 20)))
        regression = data.draw(st.sampled_from([-1, -1, 0, 1_000]))
        dedup_ttl = data.draw(st.sampled_from(DEDUP_TTLS_MS))
        _run(engines, algorithm, [(policy[0], policy[1], True)], sequence, regression, dedup_ttl)

    check()


def test_lua_matches_model_for_policy_groups(engines: list[Any]) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data())
    def check(data: Any) -> None:
        group = data.draw(st.lists(policy_calls(), min_size=2, max_size=3))
        max_limit = max(window.capacity for _, ws, _ in group for window in ws)
        sequence = data.draw(steps(min(max_limit, 20)))
        dedup_ttl = data.draw(st.sampled_from(DEDUP_TTLS_MS))
        _run(engines, "group", group, sequence, -1, dedup_ttl)

    check()


@st.composite
def long_log_steps(draw: Any) -> list[tuple[Any, int, int, bool, bool]]:
    """Many admissions inside one period, some steps landing on a reply's times: long
    sliding logs whose oldest events expire one by one (binary searches, trims)."""
    count = draw(st.integers(20, 120))
    out = []
    for _ in range(count):
        step = draw(st.one_of(FOLLOW, st.integers(0, 3), st.integers(0, 400)))
        out.append((step, draw(st.integers(0, 4)), 0, draw(st.integers(0, 9)) == 0, False))
    return out


def test_lua_matches_model_for_long_sliding_logs(engines: list[Any]) -> None:
    @settings(
        max_examples=max(1, EXAMPLES // 5),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data())
    def check(data: Any) -> None:
        limit = data.draw(st.integers(4, 80))
        period = data.draw(st.sampled_from([1_000, 2_000, 3_000]))
        windows = (
            Window("w0", limit, period, limit),
            Window("w1", limit * 2, period * 3, limit * 2),
        )
        sequence = data.draw(long_log_steps())
        _run(engines, "sliding_log:long", [("sliding_log", windows, True)], sequence, -1)

    check()


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a != CONCURRENCY])
@pytest.mark.parametrize("windows", [1, 2])
def test_a_charge_after_a_reset_keeps_the_ledger_and_its_young_drop(
    engines: list[Any], algorithm: str, windows: int
) -> None:
    """Nine charges 1 ms apart fill the ledger and drop an entry younger than DEDUP_TTL
    (d); a reset keeps the ledger and d and forgets the numbers; charges a second later
    append to the ledger, drop only old entries and keep d, alike on every engine (a
    variant reads d with the numbers, which a reset counter lacks)."""
    call = PolicyCall(algorithm, tuple(Window(f"w{w}", 50, 60_000, 50) for w in range(windows)), 1)
    counter = "q:{s0}:p0:r"
    for engine in engines:
        engine.reset()
    for step, now in enumerate([*range(9), 1_000, 1_001]):
        if step == 9:
            assert [engine.backend.reset(counter, windows) for engine in engines] == [windows] * 3
        request = GroupRequest(
            (counter,), (call,), START_MS + now, False, -1, 100, HUGE_GRACE_MS,
            fingerprint(f"e{step}"),
        )
        replies = [engine.evaluate(request) for engine in engines]
        assert replies[1:] == replies[:1] * 2, step
        states = [engine.state(counter, call) for engine in engines]
        assert states[1:] == states[:1] * 2, step
    state, records = states[0]
    assert state is not None and "t" in state and records  # numbers again, and the ledger
    assert state["d"] == START_MS  # the young drop's charge time, kept through the reset
