"""``django_quota.views.usage`` (docs/usage.md): the caller's state under every enabled,
enforced policy whose selector resolves, peeked: nothing charged (peek before and after),
never limited by the middleware or DRF's throttles, the same as a DRF view."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import include, path
from rest_framework.decorators import api_view

import django_quota
from django_quota import metrics
from django_quota.views import usage
from tests.test_middleware import CLOCK

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

IP = "203.0.113.40"


def ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


api = [
    path("items/", ok),
    path("rate_limit/", usage, name="usage"),
    path("drf/rate_limit/", api_view(["GET"])(usage)),
]
urlpatterns = [path("api/", include(api))]

API = {"windows": "3/m", "selector": ["ip"], "routes": ["/api"]}
TWO = {"windows": {"burst": "2/m", "sustained": "10/h"}, "selector": ["ip"], "routes": ["/api"]}


def read(client: Any, url: str = "/api/rate_limit/") -> dict[str, Any]:
    response = client.get(url, REMOTE_ADDR=IP)
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "application/json"
    assert response["Cache-Control"] == "no-store"
    assert "RateLimit" not in response
    body: dict[str, Any] = json.loads(response.content)
    return body


def remaining(body: dict[str, Any]) -> dict[str, int]:
    return {entry["policy"]: entry["remaining"] for entry in body["policies"]}


def test_the_usage_view_charges_nothing(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": API})
    client = Client()
    before = django_quota.peek("api", {"ip": IP}).remaining
    counted = dict(metrics.outcome_counts())
    bodies = [read(client) for _ in range(5)]  # more than the limit: never limited
    assert before == django_quota.peek("api", {"ip": IP}).remaining == 3
    assert [remaining(body) for body in bodies] == [{"api": 3}] * 5
    assert dict(metrics.outcome_counts()) == counted
    # A charged request shows in the next reading, and the reading still charges nothing.
    assert client.get("/api/items/", REMOTE_ADDR=IP).status_code == 200
    assert remaining(read(client)) == {"api": 2}
    assert django_quota.peek("api", {"ip": IP}).remaining == 2


def test_the_body_has_every_window_in_seconds(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"two": TWO})
    client = Client()
    client.get("/api/items/", REMOTE_ADDR=IP)
    assert read(client) == {
        "policies": [
            {
                "policy": "two",
                "window": "burst",
                "limit": 2,
                "remaining": 1,
                "reset_after": pytest.approx(39.6),
                "windows": [
                    {
                        "name": "burst",
                        "limit": 2,
                        "period": 60.0,
                        "remaining": 1,
                        "reset_after": pytest.approx(39.6),
                        "retry_after": None,
                    },
                    {
                        "name": "sustained",
                        "limit": 10,
                        "period": 3600.0,
                        "remaining": 9,
                        "reset_after": pytest.approx(2739.6),
                        "retry_after": None,
                    },
                ],
            }
        ]
    }


def test_an_exhausted_window_reports_when_to_retry(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"two": TWO})
    client = Client()
    assert [client.get("/api/items/", REMOTE_ADDR=IP).status_code for _ in range(3)] == [
        200, 200, 429
    ]
    (entry,) = read(client)["policies"]
    assert (entry["window"], entry["remaining"]) == ("burst", 0)
    assert entry["windows"][0]["retry_after"] == pytest.approx(39.6)


def test_several_policies_and_the_unresolvable_ones_left_out(
    quota: Any, django_user_model: Any
) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={
            "api": API,
            "two": TWO,
            "members": {"windows": "5/m", "selector": ["user"]},
            "tenants": {"windows": "5/m", "selector": ["tenant"]},  # no TENANT_RESOLVER
            "keys": {"windows": "5/m", "selector": ["api_key"]},
            "off": {"windows": "5/m", "selector": ["ip"], "enabled": False},
            "trial": {"windows": "5/m", "selector": ["ip"], "enforcement": "shadow"},
        },
    )
    client = Client()
    assert remaining(read(client)) == {"api": 3, "two": 2}
    user = django_user_model.objects.create_user("dana")
    client.force_login(user)
    assert remaining(read(client)) == {"api": 3, "two": 2, "members": 5}
    response = client.get("/api/rate_limit/", REMOTE_ADDR=IP, HTTP_X_API_KEY="k-1")
    assert remaining(json.loads(response.content)) == {
        "api": 3, "two": 2, "members": 5, "keys": 5
    }


def test_an_exempt_client_sees_no_entry_for_that_policy(quota: Any) -> None:
    quota(POLICIES={"api": {**API, "exempt": ["203.0.113.0/24"]}, "two": TWO})
    assert remaining(read(Client())) == {"two": 2}


def test_as_a_drf_view_it_is_neither_throttled_nor_charged(quota: Any, settings: Any) -> None:
    settings.REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_CLASSES": ["django_quota.throttling.AnonRateThrottle"],
        "DEFAULT_THROTTLE_RATES": {"anon": "1/min"},
    }
    quota(CLOCK=CLOCK, POLICIES={"api": API})
    client = Client()
    bodies = [read(client, "/api/drf/rate_limit/") for _ in range(4)]
    assert [remaining(body) for body in bodies] == [{"api": 3}] * 4
    assert django_quota.peek("api", {"ip": IP}).remaining == 3


def test_only_safe_methods(quota: Any) -> None:
    quota(POLICIES={"api": API})
    response = Client().post("/api/rate_limit/", REMOTE_ADDR=IP)
    assert response.status_code == 405
    # The refused POST was not charged either (the middleware skipped the view's URL).
    assert django_quota.peek("api", {"ip": IP}).remaining == 3


def test_a_backend_failure_is_a_503(quota: Any) -> None:
    from tests.test_middleware import dead_redis_url

    quota(REDIS_URL=dead_redis_url(), POLICIES={"api": API})
    response = Client().get("/api/rate_limit/", REMOTE_ADDR=IP)
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert json.loads(response.content)["reason"] == "backend_unavailable"


def plan_of(request: Any) -> str | None:
    """The tests' PLAN_RESOLVER: the plan a header names."""
    return request.META.get("HTTP_X_PLAN")


def test_the_callers_plan_gives_the_limits(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        PLAN_RESOLVER="tests.test_usage.plan_of",
        POLICIES={
            "api": {
                **API,
                "windows": "3/m",
                "plans": {"free": "3/m", "pro": "100/m"},
            }
        },
    )
    client = Client()
    client.get("/api/items/", REMOTE_ADDR=IP, HTTP_X_PLAN="pro")
    pro = client.get("/api/rate_limit/", REMOTE_ADDR=IP, HTTP_X_PLAN="pro")
    (entry,) = json.loads(pro.content)["policies"]
    assert (entry["limit"], entry["remaining"]) == (100, 99)
    free = client.get("/api/rate_limit/", REMOTE_ADDR=IP, HTTP_X_PLAN="free")
    (entry,) = json.loads(free.content)["policies"]
    assert (entry["limit"], entry["remaining"]) == (3, 2)


def test_a_login_policy_is_read_for_the_callers_username(
    quota: Any, settings: Any, django_user_model: Any
) -> None:
    """A login policy's ``user`` is the submitted username (docs/login.md), not the
    signed-in user's primary key: the view reads it for the caller's username."""
    settings.AUTHENTICATION_BACKENDS = [
        "django_quota.auth.QuotaLoginBackend",
        "django.contrib.auth.backends.ModelBackend",
    ]
    quota(
        CLOCK=CLOCK,
        LOGIN_POLICIES=["login-user"],
        POLICIES={"login-user": {"windows": "5/15m", "selector": ["user"]}},
    )
    user = django_user_model.objects.create_user("fiona")
    for _ in range(2):
        django_quota.evaluate("login-user", {"user": "fiona"})
    client = Client()
    client.force_login(user, backend="django.contrib.auth.backends.ModelBackend")
    assert remaining(read(client)) == {"login-user": 3}
