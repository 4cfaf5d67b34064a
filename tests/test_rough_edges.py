"""Rough edges a newcomer hit (docs/testing.md): taking one outcome apart from DRF's two
default throttles, and no ERROR line from the policy registry in a test that runs
without database access."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.urls import path
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

import django_quota
from django_quota import policies
from django_quota.testing import outcome
from django_quota.throttling import AnonRateThrottle, UserRateThrottle

pytestmark = pytest.mark.urls(__name__)


class Items(APIView):
    # What DEFAULT_THROTTLE_CLASSES gives a view: the class attribute is read at import.
    throttle_classes = [AnonRateThrottle, UserRateThrottle]

    def get(self, request: Any) -> Response:
        return Response({"items": []})


urlpatterns = [path("api/items/", Items.as_view())]

TWO_THROTTLES = {
    "DEFAULT_THROTTLE_CLASSES": [
        "django_quota.throttling.AnonRateThrottle",
        "django_quota.throttling.UserRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {"anon": "3/min", "user": "10/min"},
}


@pytest.mark.django_db
def test_outcome_takes_one_policy_apart_from_drfs_two_throttles(settings: Any) -> None:
    settings.REST_FRAMEWORK = TWO_THROTTLES
    client = APIClient()
    for _ in range(3):
        client.get("/api/items/")
    throttled = client.get("/api/items/")
    assert throttled.status_code == 429
    recorded = django_quota.outcomes(throttled.wsgi_request)
    assert sorted(o.policy for o in recorded) == ["drf:anon", "drf:user"]  # [x] = ... fails
    found = outcome(throttled.wsgi_request, "drf:anon")
    assert (found.policy, found.decision) == ("drf:anon", "denied")
    assert outcome(throttled.wsgi_request, "drf:user").decision == "allowed"
    with pytest.raises(AssertionError, match=r"'signup'.*recorded: 'drf:anon', 'drf:user'"):
        outcome(throttled.wsgi_request, "signup")


def test_a_test_without_database_access_logs_no_error(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # No django_db mark: pytest-django refuses every query of this test.
    quota(
        POLICY_SOURCES=["settings", "database"],
        POLICIES={"api": {"windows": "5/m", "selector": ["ip"]}},
    )
    with caplog.at_level(logging.DEBUG, logger="django_quota"):
        registry = policies.get_registry()
        assert django_quota.evaluate("api", {"ip": "203.0.113.1"}).decision == "allowed"
    assert list(registry.policies) == ["api"]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "which this test blocks" in caplog.text


def test_a_real_database_failure_is_still_an_error() -> None:
    assert policies.blocked_by_tests(RuntimeError("Database access not allowed, use ..."))
    assert not policies.blocked_by_tests(RuntimeError("connection refused"))
    assert not policies.blocked_by_tests(ValueError("Database access not allowed"))
