"""What a DRF dispatch holds (ledger.Dispatch.held) is released once, and
always, when a view re-dispatches other views with the same ``HttpRequest``
(docs/concurrency.md). Memory and real Redis backends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from django.urls import path
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

import django_quota
from django_quota.throttling import QuotaThrottle
from tests import leases

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

IP = {"ip": "127.0.0.1"}


class Inner(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc2"]

    def get(self, request: Any) -> Response:
        return Response({"inner": True})


class Plain(APIView):
    """An inner view whose throttle holds nothing (a rate policy)."""

    throttle_classes = [QuotaThrottle]
    quota_policies = ["rate"]

    def get(self, request: Any) -> Response:
        return Response({"plain": True})


class OuterTwice(APIView):
    """Dispatches ``Inner`` twice with its own ``HttpRequest``."""

    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc"]

    def get(self, request: Any) -> Response:
        first = Inner.as_view()(request._request)
        second = Inner.as_view()(request._request)
        return Response({"codes": [first.status_code, second.status_code]})


class OuterPlainTwice(APIView):
    """Dispatches ``Plain`` (no holding throttle) twice."""

    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc"]

    def get(self, request: Any) -> Response:
        first = Plain.as_view()(request._request)
        second = Plain.as_view()(request._request)
        return Response({"codes": [first.status_code, second.status_code]})


class Boom(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc2"]

    def get(self, request: Any) -> Response:
        raise RuntimeError("the inner view failed")


class OuterCatches(APIView):
    """Dispatches ``Boom`` twice, catching what it lets through."""

    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc"]

    def get(self, request: Any) -> Response:
        for _ in range(2):
            with contextlib.suppress(RuntimeError):
                Boom.as_view()(request._request)
        return Response({"ok": True})


class Held(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["conc"]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


urlpatterns = [
    path("outer/twice/", OuterTwice.as_view()),
    path("outer/plain/", OuterPlainTwice.as_view()),
    path("outer/catches/", OuterCatches.as_view()),
]

POLICIES = {
    "conc": {"algorithm": "concurrency", "windows": "2/m", "selector": ["ip"]},
    "conc2": {"algorithm": "concurrency", "windows": "3/m", "selector": ["ip"]},
    "rate": {"windows": "100/m", "selector": ["ip"]},
}


@pytest.fixture(params=leases.BACKENDS)
def backend(request: pytest.FixtureRequest, quota: Any) -> Iterator[None]:
    with leases.configured(request, quota, POLICIES, IP):
        yield


def remaining(policy: str) -> int:
    return django_quota.peek(policy, IP).remaining or 0


def test_an_outer_dispatch_calling_an_inner_holding_view_twice_releases_its_lease(
    backend: None,
) -> None:
    response = Client().get("/outer/twice/")
    assert response.json() == {"codes": [200, 200]}
    assert (remaining("conc"), remaining("conc2")) == (2, 3)


def test_an_outer_dispatch_calling_an_inner_plain_view_twice_releases_its_lease(
    backend: None,
) -> None:
    response = Client().get("/outer/plain/")
    assert response.json() == {"codes": [200, 200]}
    assert remaining("conc") == 2


def test_an_outer_dispatch_catching_two_inner_failures_releases_every_lease(
    backend: None,
) -> None:
    assert Client().get("/outer/catches/").status_code == 200
    assert (remaining("conc"), remaining("conc2")) == (2, 3)


def test_one_request_object_sent_to_a_view_several_times_releases_each_time(
    backend: None,
) -> None:
    request = APIRequestFactory().get("/held/", REMOTE_ADDR="127.0.0.1")
    view = Held.as_view()
    codes = [view(request).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 200]
    assert remaining("conc") == 2
