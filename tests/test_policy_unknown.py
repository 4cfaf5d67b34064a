"""A policy that a view, a throttle or a decorator names but that is not defined (a
database policy deleted in the admin, a typo) is never a 500 (``docs/failures.md``): the
failure mode applies with reason ``policy_unknown``, one ERROR line per policy id and
process, and the outcome is counted in ``django_quota_outcomes_total``.

Every edge is exercised: ``@quota`` on sync and async function and class-based views,
``QuotaThrottle`` (beside a known policy, which still applies), the DRF drop-ins and
``QuotaMiddleware`` (which keeps writing headers for the layers that did decide)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client
from django.urls import path
from django.views import View
from prometheus_client import REGISTRY
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

import django_quota
from django_quota import limiter
from django_quota.core.outcome import is_known_reason
from django_quota.decorators import quota
from django_quota.models import QuotaPolicy
from django_quota.throttling import QuotaThrottle, ScopedRateThrottle
from tests.test_admin import create_policy

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

IP = "198.51.100.23"
CLOCK = "tests.test_middleware.frozen_clock"
KNOWN = {"algorithm": "fixed_window", "windows": "2/m", "selector": ["ip"]}


# -- views ---------------------------------------------------------------------------------
@quota("pu-gone")
def sync_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("sync")


@quota("pu-gone")
async def async_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async")


@quota("pu-gone")
class SyncClassView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("sync class")


@quota("pu-gone")
class AsyncClassView(View):
    async def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("async class")


class ThrottledView(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["pu-gone", "pu-known"]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


class OverridingThrottle(QuotaThrottle):
    """A subclass resolving its ids itself, as the docs allow."""

    def get_quota_policies(self, request: Any, view: Any) -> list[Any]:
        from django_quota import policies

        return [policies.get_policy("pu-gone")]


class OverridingView(APIView):
    throttle_classes = [OverridingThrottle]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


class ScopedView(APIView):
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "pu-unrated"

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


urlpatterns = [
    path("sync/", sync_view),
    path("async/", async_view),
    path("sync-class/", SyncClassView.as_view()),
    path("async-class/", AsyncClassView.as_view()),
    path("drf/", ThrottledView.as_view()),
    path("drf-overriding/", OverridingView.as_view()),
    path("drf-scoped/", ScopedView.as_view()),
    path("api/items/", sync_view),
    path("admin/", admin.site.urls),
]

PATHS = ["/sync/", "/async/", "/sync-class/", "/async-class/"]


@pytest.fixture(autouse=True)
def _fresh_log_memory() -> Iterator[None]:
    limiter.settings_changed()
    yield
    limiter.settings_changed()


@pytest.fixture
def quota_errors(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        yield caplog


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "django_quota" and r.levelno >= logging.ERROR
    ]


def counted(policy: str, decision: str) -> float:
    return REGISTRY.get_sample_value(
        "django_quota_outcomes_total",
        {
            "policy": policy,
            "decision": decision,
            "reason": "policy_unknown",
            "selector_dimensions": "",
            "backend_mode": "memory",
        },
    ) or 0.0


def recorded(response: Any) -> list[tuple[str, str, str | None]]:
    return [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(response.wsgi_request)]


def test_policy_unknown_is_a_known_reason() -> None:
    assert is_known_reason("policy_unknown")


# -- the decorator -----------------------------------------------------------------------------
@pytest.mark.parametrize("url", PATHS)
def test_decorator_naming_an_unknown_policy_fails_closed_with_503(
    quota: Any, quota_errors: pytest.LogCaptureFixture, url: str
) -> None:
    quota(CLOCK=CLOCK)
    before = counted("pu-gone", "failed_closed")
    client = Client(REMOTE_ADDR=IP)
    responses = [client.get(url) for _ in range(3)]
    assert [r.status_code for r in responses] == [503, 503, 503]
    assert responses[0]["Retry-After"] == "1"
    body = json.loads(responses[0].content)
    assert (body["status"], body["reason"], body["policy"]) == (503, "policy_unknown", "pu-gone")
    assert recorded(responses[-1]) == [("pu-gone", "failed_closed", "policy_unknown")]
    assert errors(quota_errors) == [
        "quota policy 'pu-gone' is named but not defined (django_quota.E009); its failure "
        "mode (closed) applies with reason policy_unknown"
    ]
    assert counted("pu-gone", "failed_closed") - before == 3
    assert IP not in " ".join(errors(quota_errors))


@pytest.mark.parametrize("url", PATHS)
def test_decorator_naming_an_unknown_policy_admits_when_open(quota: Any, url: str) -> None:
    quota(CLOCK=CLOCK, FAILURE_MODE="open")
    before = counted("pu-gone", "failed_open")
    client = Client(REMOTE_ADDR=IP)
    responses = [client.get(url) for _ in range(2)]
    assert [r.status_code for r in responses] == [200, 200]
    assert recorded(responses[-1]) == [("pu-gone", "failed_open", "policy_unknown")]
    assert counted("pu-gone", "failed_open") - before == 2


def test_async_views_under_asgi_answer_503_not_500(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = AsyncClient(REMOTE_ADDR=IP)
    for url in ("/async/", "/async-class/"):
        response = async_to_sync(client.get)(url)
        assert response.status_code == 503
        assert json.loads(response.content)["reason"] == "policy_unknown"


def test_a_database_policy_deleted_in_the_admin_fails_closed(
    quota: Any, admin_client: Client, quota_errors: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=["settings", "database"])
    row = create_policy("pu-gone", windows=(("default", 5, 60),), routes=[])
    client = Client(REMOTE_ADDR=IP)
    assert client.get("/sync/").status_code == 200
    confirm = admin_client.post(
        f"/admin/django_quota/quotapolicy/{row.pk}/delete/", {"post": "yes"}
    )
    assert confirm.status_code == 302
    assert not QuotaPolicy.objects.filter(name="pu-gone").exists()
    assert [client.get("/sync/").status_code for _ in range(2)] == [503, 503]
    assert len(errors(quota_errors)) == 1


# -- DRF -----------------------------------------------------------------------------------
def test_quota_throttle_with_an_unknown_id_still_applies_the_known_policy(
    quota: Any, quota_errors: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, FAILURE_MODE="open", POLICIES={"pu-known": KNOWN})
    client = APIClient(REMOTE_ADDR=IP)
    responses = [client.get("/drf/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert recorded(responses[0]) == [
        ("pu-gone", "failed_open", "policy_unknown"),
        ("pu-known", "allowed", None),
    ]
    assert recorded(responses[2]) == [
        ("pu-gone", "failed_open", "policy_unknown"),
        ("pu-known", "denied", "default_quota_exhausted"),
    ]
    assert len(errors(quota_errors)) == 1


def test_quota_throttle_with_an_unknown_id_fails_closed_with_503(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"pu-known": KNOWN})
    before = counted("pu-gone", "failed_closed")
    response = APIClient(REMOTE_ADDR=IP).get("/drf/")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert recorded(response)[0] == ("pu-gone", "failed_closed", "policy_unknown")
    assert counted("pu-gone", "failed_closed") - before == 1
    # The refused group charged nothing: pu-known still has both of its 2 requests.
    assert django_quota.peek("pu-known", {"ip": IP}).remaining == 2


def test_a_throttle_resolving_an_unknown_id_itself_gives_503(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    response = APIClient(REMOTE_ADDR=IP).get("/drf-overriding/")
    assert response.status_code == 503
    assert recorded(response) == [("pu-gone", "failed_closed", "policy_unknown")]


def test_scoped_drop_in_without_a_rate_for_its_scope_gives_503(
    quota: Any, settings: Any, quota_errors: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK)
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "5/m"}}
    client = APIClient(REMOTE_ADDR=IP)
    responses = [client.get("/drf-scoped/") for _ in range(2)]
    assert [r.status_code for r in responses] == [503, 503]
    assert recorded(responses[0]) == [("drf:pu-unrated", "failed_closed", "policy_unknown")]
    (message,) = errors(quota_errors)
    assert "drf:pu-unrated" in message


# -- the middleware --------------------------------------------------------------------------
def test_middleware_policies_go_on_deciding_beside_an_unknown_one(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"pu-mw": {**KNOWN, "routes": ["/api"]}})
    client = Client(REMOTE_ADDR=IP)
    response = client.get("/api/items/")
    assert response.status_code == 503
    assert recorded(response) == [
        ("pu-mw", "allowed", None),
        ("pu-gone", "failed_closed", "policy_unknown"),
    ]
    assert response["RateLimit"] == '"pu-mw";r=1;t=40'


def test_the_error_is_logged_once_per_policy_and_process(
    quota: Any, quota_errors: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, FAILURE_MODE="open", POLICIES={"pu-known": KNOWN})
    client = APIClient(REMOTE_ADDR=IP)
    for url in [*PATHS, "/drf/", "/drf/"]:
        client.get(url)
    assert len(errors(quota_errors)) == 1


def test_policy_unknown_outcome_helper(quota: Any) -> None:
    quota()
    closed = limiter.policy_unknown("pu-helper", "closed")
    opened = limiter.policy_unknown("pu-helper", "open")
    assert (closed.decision, closed.reason, closed.retry_after) == (
        "failed_closed", "policy_unknown", 1.0
    )
    assert (opened.decision, opened.reason, opened.retry_after) == (
        "failed_open", "policy_unknown", None
    )
    assert (closed.window, closed.limit, closed.windows) == (None, None, ())
