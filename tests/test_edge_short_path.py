"""The edges (middleware, ``@quota``, DRF throttles share ``ledger.decide``) take the
common call's short path (``Limiter.shortcut``, docs/architecture.md, "One decision") for
one pending policy that holds nothing, on the memory backend and on Redis, sync and async;
a ``count_when`` policy, which holds its charge until the response, still goes through
``prepare`` and is refunded as before."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client
from django.urls import path

from django_quota import testing
from django_quota.decorators import quota
from django_quota.engine import Limiter

pytestmark = [pytest.mark.urls(__name__)]

POLICIES = {
    "api": {"windows": "3/h", "selector": ["ip"], "routes": ["/api"]},
    "billable": {"windows": "3/h", "selector": ["ip"], "count_when": ["2xx"]},
}


def api(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota("billable")
def billable(request: HttpRequest) -> HttpResponse:
    return HttpResponse("no", status=int(request.GET.get("status", "200")))


urlpatterns = [path("api", api), path("billable", billable)]


@pytest.fixture(params=["memory", "redis"])
def configured(
    request: pytest.FixtureRequest, quota: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str]]:
    """QUOTA with the middleware on the parametrised backend; the policies each
    ``Limiter.prepare`` call was given (the general path)."""
    values: dict[str, Any] = {"POLICIES": POLICIES}
    if request.param == "redis":
        values.update(REDIS_URL=request.getfixturevalue("redis_url"), TIMEOUT=1.0, DEADLINE=2.0)
    quota(**values)  # tests/settings.py has the middleware
    testing.reset()
    prepared: list[str] = []
    general = Limiter.prepare

    def counted(self: Limiter, group: Any, *args: Any, **kwargs: Any) -> Any:
        prepared.extend(policy.id for policy in group)
        return general(self, group, *args, **kwargs)

    monkeypatch.setattr(Limiter, "prepare", counted)
    yield prepared


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_middleware_decides_the_common_call_without_prepare(
    configured: list[str], asynchronous: bool
) -> None:
    if asynchronous:
        client = AsyncClient()
        statuses = [async_to_sync(client.get)("/api").status_code for _ in range(4)]
    else:
        statuses = [Client().get("/api").status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    # Decided in memory, or one script call whose refusal resumed the general plan
    # without a prepare: the denial cache remembers it only now.
    assert configured == []


def test_a_count_when_policy_is_prepared_and_refunded_as_before(configured: list[str]) -> None:
    client = Client()
    assert [client.get("/billable?status=500").status_code for _ in range(5)] == [500] * 5
    assert configured == ["billable"] * 5  # each charge held until the response
    assert [client.get("/billable").status_code for _ in range(4)] == [200, 200, 200, 429]
