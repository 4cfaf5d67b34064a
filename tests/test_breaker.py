"""The circuit breaker's state machine, with an injected clock."""

from __future__ import annotations

from django_quota.core.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_consecutive_failures_only() -> None:
    clock = Clock()
    breaker = CircuitBreaker(3, 1.0, clock=clock)
    assert [breaker.failure("backend_unavailable") for _ in range(2)] == [None, None]
    assert breaker.success() is None  # a success in between restarts the count
    assert [breaker.failure("backend_timeout") for _ in range(3)] == [None, None, OPEN]
    assert breaker.state == OPEN and not breaker.allow()
    assert [e.reason for e in breaker.recent_errors][-1] == "backend_timeout"


def test_one_probe_after_the_cool_down_closes_or_reopens() -> None:
    clock = Clock()
    breaker = CircuitBreaker(1, 2.0, clock=clock)
    breaker.failure("backend_unavailable")
    clock.now += 1.999
    assert not breaker.allow()
    clock.now += 0.001
    assert breaker.state == HALF_OPEN
    assert breaker.allow() and not breaker.allow()  # a single probe at a time
    assert breaker.failure("backend_unavailable") == OPEN
    assert not breaker.allow()
    clock.now += 2.0
    assert breaker.allow()
    assert breaker.success() == CLOSED
    assert breaker.allow() and breaker.allow()


def test_reset_closes_and_forgets() -> None:
    breaker = CircuitBreaker(1, 60.0, clock=Clock())
    breaker.failure("indeterminate")
    breaker.reset()
    assert breaker.state == CLOSED and breaker.allow() and not breaker.recent_errors
