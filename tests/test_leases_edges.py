"""Concurrency policies at the edges (docs/concurrency.md): the middleware, ``@quota``,
``QuotaThrottle`` and the DRF drop-ins release what the request acquired when the
response is done: after the view returns or raises, and for a streaming response when
it is closed. Each view reads the lease it holds (``peek``) while it runs; the test
reads it again once the response is done. Against a real Redis started for the session,
and the memory backend."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.test import AsyncClient, Client
from django.urls import path
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

import django_quota
from django_quota.core.policy import Policy
from django_quota.decorators import quota
from django_quota.policies import get_policy
from django_quota.throttling import QuotaThrottle, ScopedRateThrottle
from tests import leases

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

IP = {"ip": "127.0.0.1"}
#: What each view saw of its own policy while it ran: remaining, from peek.
SEEN: list[int] = []


def seen(policy: str) -> None:
    SEEN.append(django_quota.peek(policy, IP).remaining or 0)


# -- views ---------------------------------------------------------------------------------
def plain(request: HttpRequest) -> HttpResponse:
    seen("mw")
    return HttpResponse("ok")


def boom(request: HttpRequest) -> HttpResponse:
    seen("mw")
    raise RuntimeError("the view failed")


def stream(request: HttpRequest) -> StreamingHttpResponse:
    seen("mw")
    return StreamingHttpResponse(iter([b"a", b"b"]))


@quota("conc")
def decorated(request: HttpRequest) -> HttpResponse:
    seen("conc")
    return HttpResponse("ok")


@quota("conc")
def decorated_boom(request: HttpRequest) -> HttpResponse:
    seen("conc")
    raise RuntimeError("the view failed")


@quota("conc")
def decorated_stream(request: HttpRequest) -> StreamingHttpResponse:
    seen("conc")
    return StreamingHttpResponse(iter([b"a", b"b"]))


@quota("conc")
async def decorated_async(request: HttpRequest) -> HttpResponse:
    SEEN.append((await django_quota.apeek("conc", IP)).remaining or 0)
    return HttpResponse("ok")


class Throttled(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc"]

    def get(self, request: Any) -> Response:
        seen("conc")
        if request.GET.get("fail") == "handled":
            raise ValidationError("bad input")  # DRF turns it into a 400
        if request.GET.get("fail") == "uncaught":
            raise RuntimeError("the view failed")
        return Response({"ok": True})


class Scoped(APIView):
    """The drop-in ScopedRateThrottle, its scope's policy configured as a concurrency
    policy (a configured ``drf:<scope>`` wins over the generated one)."""

    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "reports"

    def get(self, request: Any) -> Response:
        SEEN.append(django_quota.peek("drf:reports", IP).remaining or 0)
        return Response({"ok": True})


class TwoHolding(APIView):
    """Two throttles of one dispatch, each holding a lease of its own policy."""

    class Second(QuotaThrottle):
        def get_quota_policies(self, request: Any, view: Any) -> list[Policy]:
            return [get_policy("conc2")]

    throttle_classes = [QuotaThrottle, Second]
    quota_policies = ["conc"]

    def get(self, request: Any) -> Response:
        seen("conc")
        seen("conc2")
        return Response({"ok": True})


class Inner(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc2"]

    def get(self, request: Any) -> Response:
        seen("conc2")
        return Response({"inner": True})


class Outer(APIView):
    """A view that dispatches another DRF view with the same ``HttpRequest`` inside its
    own dispatch: each dispatch releases what its own throttles hold."""

    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc"]

    def get(self, request: Any) -> Response:
        inner = Inner.as_view()(request._request)
        seen("conc")
        seen("conc2")  # the inner dispatch is done: its lease is released
        return Response({"inner": inner.status_code})


urlpatterns = [
    path("drf/two/", TwoHolding.as_view()),
    path("drf/outer/", Outer.as_view()),
    path("drf/scoped/", Scoped.as_view()),
    path("mw/plain/", plain),
    path("mw/boom/", boom),
    path("mw/stream/", stream),
    path("dec/plain/", decorated),
    path("dec/boom/", decorated_boom),
    path("dec/stream/", decorated_stream),
    path("dec/async/", decorated_async),
    path("drf/", Throttled.as_view()),
]

POLICIES = {
    "mw": {"algorithm": "concurrency", "windows": "2/m", "selector": ["ip"], "routes": ["/mw"]},
    "conc": {"algorithm": "concurrency", "windows": "2/m", "selector": ["ip"]},
    "conc2": {"algorithm": "concurrency", "windows": "2/m", "selector": ["ip"]},
    "drf:reports": {"algorithm": "concurrency", "windows": "2/m", "selector": ["ip"]},
}


@pytest.fixture(params=leases.BACKENDS)
def backend(request: pytest.FixtureRequest, quota: Any) -> Iterator[None]:
    with leases.configured(request, quota, POLICIES, IP):
        SEEN.clear()
        yield


def remaining(policy: str) -> int:
    return django_quota.peek(policy, IP).remaining or 0


@pytest.mark.parametrize(
    ("url", "policy"), [("/mw/plain/", "mw"), ("/dec/plain/", "conc"), ("/drf/", "conc")]
)
def test_a_lease_is_held_while_the_view_runs_and_released_after(
    backend: None, url: str, policy: str
) -> None:
    response = Client().get(url)
    assert response.status_code == 200
    assert SEEN == [1]  # one of 2 held while the view ran
    assert remaining(policy) == 2


@pytest.mark.parametrize(
    ("url", "policy"),
    [("/mw/boom/", "mw"), ("/dec/boom/", "conc"), ("/drf/?fail=uncaught", "conc")],
)
def test_a_view_that_raises_releases_its_lease(backend: None, url: str, policy: str) -> None:
    response = Client(raise_request_exception=False).get(url)
    assert response.status_code == 500
    assert SEEN == [1]
    assert remaining(policy) == 2


def test_a_drf_exception_turned_into_a_response_releases_its_lease(backend: None) -> None:
    response = Client().get("/drf/?fail=handled")
    assert response.status_code == 400
    assert SEEN == [1]
    assert remaining("conc") == 2


@pytest.mark.parametrize(("url", "policy"), [("/mw/stream/", "mw"), ("/dec/stream/", "conc")])
def test_a_streaming_response_holds_its_lease_until_closed(
    backend: None, url: str, policy: str
) -> None:
    response = Client().get(url)
    assert response.status_code == 200
    assert remaining(policy) == 1  # still streaming: still held
    assert b"".join(response.streaming_content) == b"ab"  # the test client closes it at the end
    assert remaining(policy) == 2


def test_an_async_view_releases_its_lease(backend: None) -> None:
    from asgiref.sync import async_to_sync

    response = async_to_sync(AsyncClient().get)("/dec/async/")
    assert response.status_code == 200
    assert SEEN == [1]
    assert remaining("conc") == 2


def test_a_full_policy_refuses_with_the_oldest_lease_as_retry_after(backend: None) -> None:
    first = django_quota.evaluate("conc", IP, cost=2, evaluation_id="held-by-another")
    assert first.decision == "allowed" and first.remaining == 0
    response = Client().get("/dec/plain/")
    assert response.status_code == 429
    assert SEEN == []  # the view never ran
    assert 59 <= int(response["Retry-After"]) <= 60
    assert django_quota.release("conc", IP, "held-by-another") == 2
    assert django_quota.release("conc", IP, "held-by-another") == 0  # twice releases once
    assert Client().get("/dec/plain/").status_code == 200


def test_a_drf_drop_in_naming_a_concurrency_policy_releases_its_lease(
    backend: None, settings: Any
) -> None:
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"reports": "2/min"}}
    response = Client().get("/drf/scoped/")
    assert response.status_code == 200
    assert SEEN == [1]
    assert remaining("drf:reports") == 2


def test_two_throttles_of_one_dispatch_release_each_lease_once(backend: None) -> None:
    response = Client().get("/drf/two/")
    assert response.status_code == 200
    assert SEEN == [1, 1]  # each policy held once while the view ran
    assert (remaining("conc"), remaining("conc2")) == (2, 2)


def test_a_dispatch_inside_a_dispatch_of_the_same_request_releases_both(
    backend: None,
) -> None:
    response = Client().get("/drf/outer/")
    assert response.status_code == 200
    assert response.json() == {"inner": 200}
    assert SEEN == [1, 1, 2]  # inner view ran; then outer still holds conc, conc2 released
    assert (remaining("conc"), remaining("conc2")) == (2, 2)
