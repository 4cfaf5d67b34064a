"""Client clocks (docs/arithmetic.md): time injected through ``QUOTA["CLOCK"]``, counters that
never run backwards, and ``clock_unsafe`` beyond ``MAX_CLOCK_REGRESSION`` failing by the
policy's failure mode, on every backend."""

from __future__ import annotations

from typing import Any

import pytest

import django_quota
from tests import clock
from tests.test_limiter import configure  # noqa: F401 - the parametrised backend fixture

T0 = 1_764_000_000.0  # a whole day boundary


@pytest.fixture(autouse=True)
def _start() -> None:
    clock.set_to(T0 + 0.25)


def test_injected_clock_drives_the_windows(configure: Any) -> None:  # noqa: F811
    configure(CLOCK="tests.clock.now", POLICIES={"p": {"windows": "2/s"}})
    subject = {"ip": "192.0.2.1"}
    assert [django_quota.evaluate("p", subject).decision for _ in range(3)] == [
        "allowed", "allowed", "denied"]
    denied = django_quota.evaluate("p", subject)
    assert denied.retry_after == 0.75
    clock.set_to(T0 + 1.0)
    assert django_quota.evaluate("p", subject).remaining == 1


def test_clock_rounds_seconds_to_the_nearest_millisecond(configure: Any) -> None:  # noqa: F811
    configure(CLOCK="tests.clock.now", POLICIES={"p": {"windows": "1/s"}})
    clock.set_to(T0 + 0.9996)  # rounds to T0 + 1.000
    outcome = django_quota.evaluate("p", {"ip": "192.0.2.1"})
    assert outcome.reset_after == 1.0


def test_small_regressions_are_clamped(configure: Any) -> None:  # noqa: F811
    configure(CLOCK="tests.clock.now", POLICIES={"p": {"windows": "1/s"}})
    clock.set_to(T0 + 1.5)
    django_quota.evaluate("p", {"ip": "192.0.2.1"})
    clock.set_to(T0 + 0.9)  # 600 ms back: clamped to T0 + 1.5, same full window
    outcome = django_quota.evaluate("p", {"ip": "192.0.2.1"})
    assert (outcome.decision, outcome.retry_after) == ("denied", 0.5)


@pytest.mark.parametrize(("mode", "decision"), [("closed", "failed_closed"),
                                                 ("open", "failed_open")])
def test_regression_past_the_bound_is_clock_unsafe(
    configure: Any, mode: str, decision: str  # noqa: F811
) -> None:
    configure(CLOCK="tests.clock.now", MAX_CLOCK_REGRESSION=1.0,
              POLICIES={"p": {"windows": "5/s", "failure_mode": mode}})
    clock.set_to(T0 + 10.0)
    django_quota.evaluate("p", {"ip": "192.0.2.1"})
    clock.set_to(T0 + 8.999)
    outcome = django_quota.evaluate("p", {"ip": "192.0.2.1"})
    assert (outcome.decision, outcome.reason) == (decision, "clock_unsafe")
    clock.set_to(T0 + 9.0)
    assert django_quota.evaluate("p", {"ip": "192.0.2.1"}).decision == "allowed"
