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


UNUSABLE = [1e12, -5.0, float("nan"), float("inf"), "soon", None, RuntimeError("clock broke")]


@pytest.mark.parametrize("value", UNUSABLE, ids=repr)
@pytest.mark.parametrize(("mode", "decision"), [("closed", "failed_closed"),
                                                 ("open", "failed_open")])
def test_an_unusable_clock_is_clock_unsafe_never_an_exception(
    configure: Any, value: object, mode: str, decision: str  # noqa: F811
) -> None:
    client = configure(CLOCK="tests.clock.unusable",
                       POLICIES={"p": {"windows": "5/s", "failure_mode": mode}})
    clock.unusable_value = value
    try:
        for outcome in (django_quota.evaluate("p", {"ip": "192.0.2.1"}),
                        django_quota.peek("p", {"ip": "192.0.2.1"})):
            assert (outcome.decision, outcome.reason) == (decision, "clock_unsafe")
        recent = django_quota.limiter.recent_errors()
        assert recent and recent[-1].reason == "clock_unsafe"
        assert "the clock" in recent[-1].detail
    finally:
        clock.unusable_value = None
    if client is not None:
        assert client.keys("*") == []  # nothing was sent


def test_an_unusable_clock_answers_503_through_the_middleware_and_fails_quota_check(
    quota: Any, client: Any
) -> None:
    from django.core.management import call_command
    from django.core.management.base import CommandError

    quota(CLOCK="tests.clock.unusable",
          POLICIES={"p": {"windows": "5/s", "selector": ["ip"], "routes": ["/items"]}})
    clock.unusable_value = RuntimeError("clock broke")
    try:
        response = client.get("/items/")
        assert response.status_code == 503
        assert response.json()["reason"] == "clock_unsafe"
        with pytest.raises(CommandError, match=r"QUOTA\['CLOCK'\] gives no usable time"):
            call_command("quota", "check")
    finally:
        clock.unusable_value = None


@pytest.mark.parametrize("subject", [None, [], "192.0.2.1", 42])
def test_a_subject_that_is_not_a_mapping_is_a_type_error(
    configure: Any, subject: object  # noqa: F811
) -> None:
    configure(POLICIES={"p": {"windows": "5/s"}})
    for call in (django_quota.evaluate, django_quota.peek, django_quota.reset):
        with pytest.raises(TypeError, match="a subject maps dimensions"):
            call("p", subject)  # type: ignore[operator]
