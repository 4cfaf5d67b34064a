"""One rate grammar everywhere (docs/policies.md, docs/drf.md): settings
policies, ``@quota(rate=...)`` and the drop-in DRF throttles read the same ``"N/P"``
forms; the drop-ins also read whatever DRF's own ``parse_rate`` reads, and ``None``. A
``DEFAULT_THROTTLE_RATES`` entry the drop-ins cannot use is check E013 and, on a
request, the failure mode with reason ``policy_unknown``, never a 500."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import rest_framework.throttling as drf_throttling
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory
from rest_framework.test import APIClient

import django_quota
from django_quota.checks import check_drf_rates
from django_quota.conf import parse_settings
from django_quota.decorators import quota as quota_decorator
from django_quota.throttling import AnonRateThrottle, parse_drf_rate

pytestmark = [pytest.mark.urls("tests.test_throttling"), pytest.mark.django_db]

CLOCK = "tests.test_throttling.frozen_clock"

#: (rate, limit, period in seconds): every spelling of the grammar, in several cases.
FORMS = [
    ("10/s", 10, 1),
    ("10/sec", 10, 1),
    ("10/second", 10, 1),
    ("10/seconds", 10, 1),
    ("10/m", 10, 60),
    ("10/min", 10, 60),
    ("10/minute", 10, 60),
    ("10/minutes", 10, 60),
    ("10/h", 10, 3_600),
    ("10/hour", 10, 3_600),
    ("10/hours", 10, 3_600),
    ("10/d", 10, 86_400),
    ("10/day", 10, 86_400),
    ("10/days", 10, 86_400),
    ("10/S", 10, 1),
    ("10/Minute", 10, 60),
    ("10/HOURS", 10, 3_600),
    ("100/5m", 100, 300),
    ("100/5minutes", 100, 300),
    ("3/2Hours", 3, 7_200),
    ("7/30sec", 7, 30),
    ("1/366d", 1, 31_622_400),
    ("10/w", 10, 604_800),
    ("10/Week", 10, 604_800),
    ("10/weeks", 10, 604_800),
    ("10/52w", 10, 52 * 604_800),
]
#: Calendar-only periods (fixed_window, the settings' default algorithm; no multiplier):
#: their period is their longest length, the window follows the calendar.
CALENDAR_FORMS = [
    ("10/mo", 10, 31 * 86_400),
    ("10/MONTH", 10, 31 * 86_400),
    ("10/months", 10, 31 * 86_400),
    ("10/y", 10, 366 * 86_400),
    ("10/year", 10, 366 * 86_400),
    ("10/Years", 10, 366 * 86_400),
]
#: Strings DRF 3.18's ``parse_rate`` reads (only the first letter of the period counts).
DRF_SPELLINGS = ["5/minute", "5/mon", "5/ms", "5/sxyz", "5/dog", "+5/m", " 5/h", "5 /d", "1_0/s"]
#: Neither grammar: ``ImproperlyConfigured`` from the drop-ins, E004 in settings.
INVALID = ["5", "5/", "5/x", "x/m", "5/m/m", "", "5/M0N", "1/0s", "1/0-sec"]
#: Parsed, but outside the bounds (count 1..10**9, period 1 s..366 d).
OUT_OF_BOUNDS = ["0/m", "-1/m", "1/367d", "1000000001/s", "1/400-d", "1/53w"]


def window_of(text: str) -> tuple[int, int]:
    parsed, problems = parse_settings({"POLICIES": {"p": {"windows": text}}})
    assert problems == []
    assert parsed is not None
    (window,) = parsed.policies["p"].windows
    return window.limit, window.period_ms // 1000


@pytest.mark.parametrize(("rate", "limit", "period"), FORMS + CALENDAR_FORMS)
def test_settings_policies_read_every_form(rate: str, limit: int, period: int) -> None:
    assert window_of(rate) == (limit, period)


@pytest.mark.parametrize(("rate", "limit", "period"), FORMS)
def test_decorator_reads_every_form(quota: Any, rate: str, limit: int, period: int) -> None:
    quota(CLOCK=CLOCK)

    @quota_decorator(rate=rate)
    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    request = RequestFactory().get("/")
    assert view(request).status_code == 200
    (outcome,) = django_quota.outcomes(request)
    assert (outcome.limit, outcome.remaining, outcome.windows[0].period) == (
        limit,
        limit - 1,
        period,
    )


@pytest.mark.parametrize(("rate", "limit", "period"), FORMS)
def test_drop_ins_read_every_form(
    quota: Any, settings: Any, rate: str, limit: int, period: int
) -> None:
    quota(CLOCK=CLOCK)
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": rate}}
    assert parse_drf_rate(rate) == (limit, period)
    assert (AnonRateThrottle().num_requests, AnonRateThrottle().duration) == (limit, period)
    response = APIClient().get("/drf/anon/")
    assert response.status_code == 200
    (outcome,) = django_quota.outcomes(response.wsgi_request)
    assert (outcome.limit, outcome.windows[0].period) == (limit, period)


@pytest.mark.parametrize("rate", DRF_SPELLINGS)
def test_drop_ins_read_drfs_spellings_as_drf_does(rate: str) -> None:
    drf = drf_throttling.SimpleRateThrottle.parse_rate(None, rate)  # type: ignore[arg-type]
    assert parse_drf_rate(rate) == drf


@pytest.mark.parametrize(
    ("rate", "parsed"), [("1/2-sec", (1, 2)), ("60/30-min", (60, 1_800)), ("5/3-h", (5, 10_800))]
)
def test_drop_ins_read_the_hyphenated_multiplier(rate: str, parsed: tuple[int, int]) -> None:
    assert parse_drf_rate(rate) == parsed


@pytest.mark.parametrize("rate", ["5/mon", "5/ms", "5/sxyz", "5/dog", "+5/m", "1_0/s"])
def test_settings_do_not_take_drfs_first_letter_spellings(rate: str) -> None:
    _, problems = parse_settings({"POLICIES": {"p": {"windows": rate}}})
    assert [problem.id for problem in problems] == ["django_quota.E004"]


def test_drop_in_rate_none_is_no_limit(quota: Any, settings: Any) -> None:
    quota(CLOCK=CLOCK)
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": None}}
    assert (AnonRateThrottle().num_requests, AnonRateThrottle().duration) == (None, None)
    client = APIClient()
    assert [client.get("/drf/anon/").status_code for _ in range(3)] == [200, 200, 200]
    assert django_quota.outcomes(client.get("/drf/anon/").wsgi_request) == []


@pytest.mark.parametrize("rate", INVALID + OUT_OF_BOUNDS)
def test_drop_ins_refuse_rates_outside_both_grammars(rate: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="Invalid throttle rate"):
        parse_drf_rate(rate)


# -- E013 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", ["10/xyz", "0/m", 10, "1/367d", "5/m/m"])
def test_e010_names_the_scope_of_an_unusable_rate(settings: Any, rate: object) -> None:
    settings.REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_RATES": {"anon": "10/minute", "uploads": rate, "user": None}
    }
    (message,) = check_drf_rates()
    assert message.id == "django_quota.E013"
    assert message.msg.startswith("REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['uploads']: ")
    assert repr(rate) in message.msg
    assert message.hint == (
        "write 'N/P' with P one of s, m, h, d, w, mo, y (or sec, second(s), min, minute(s), "
        "hour(s), day(s), week(s), month(s), year(s)) and an optional multiplier ('100/5m'; "
        "none for a month or a year), or None for no limit"
    )


def test_e010_quiet_for_every_usable_rate(settings: Any) -> None:
    usable = [rate for rate, _, _ in FORMS] + DRF_SPELLINGS + ["1/2-sec", None]
    settings.REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_RATES": {f"scope{i}": rate for i, rate in enumerate(usable)}
    }
    assert check_drf_rates() == []


def test_e010_reports_rates_that_are_not_a_dict(settings: Any) -> None:
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": ["10/m"]}
    (message,) = check_drf_rates()
    assert message.id == "django_quota.E013"
    assert message.msg == (
        "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] must be a dict of scope -> rate, not list"
    )


def test_e010_runs_with_manage_py_check(settings: Any) -> None:
    from django.core.checks import run_checks

    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "10/xyz"}}
    assert "django_quota.E013" in [message.id for message in run_checks()]


# -- an unusable rate on a request -----------------------------------------------------------
def test_unusable_rate_fails_closed_with_503_not_500(
    quota: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK)
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "10/xyz"}}
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        response = APIClient().get("/drf/anon/", REMOTE_ADDR="198.51.100.7")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(
        response.wsgi_request
    )] == [("drf:anon", "failed_closed", "policy_unknown")]
    (record,) = [r for r in caplog.records if r.name == "django_quota"]
    assert record.levelno == logging.ERROR
    assert "'anon'" in record.getMessage()
    assert "'10/xyz'" in record.getMessage()
    assert "django_quota.E013" in record.getMessage()
    assert "198.51.100.7" not in record.getMessage()


def test_unusable_rate_fails_open_when_the_failure_mode_is_open(
    quota: Any, settings: Any
) -> None:
    quota(CLOCK=CLOCK, FAILURE_MODE="open")
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"x": "0/m"}}
    client = APIClient()
    responses = [client.get("/drf/x/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(
        responses[-1].wsgi_request
    )] == [("drf:x", "failed_open", "policy_unknown")]


def test_unusable_rate_is_logged_once_per_scope_and_rate(
    quota: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, FAILURE_MODE="open")
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "10/xyz"}}
    client = APIClient()
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        for _ in range(3):
            client.get("/drf/anon/")
    assert len([r for r in caplog.records if r.name == "django_quota"]) == 1


def test_configured_policy_under_the_drop_ins_id_still_applies(
    quota: Any, settings: Any
) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={"drf:anon": {"algorithm": "fixed_window", "windows": "1/m", "selector": ["ip"]}},
    )
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "10/xyz"}}
    client = APIClient()
    assert [client.get("/drf/anon/").status_code for _ in range(2)] == [200, 429]
