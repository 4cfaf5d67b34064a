from typing import Any

from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, URLResolver, include, path


def ok(request: HttpRequest, **kwargs: Any) -> HttpResponse:
    return HttpResponse("ok")


async def async_ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async ok")


def denied(request: HttpRequest, outcome: Any) -> HttpResponse:
    """A ``DENIED_VIEW`` for the tests: plain text naming the policy and the reason."""
    return HttpResponse(
        f"slow down: {outcome.policy} {outcome.reason}", status=429, content_type="text/plain"
    )


async def adenied(request: HttpRequest, outcome: Any) -> HttpResponse:
    """An async ``DENIED_VIEW``."""
    return HttpResponse(f"async slow down: {outcome.policy}", status=429, content_type="text/plain")


def denied_from_database(request: HttpRequest, outcome: Any) -> HttpResponse:
    """A ``DENIED_VIEW`` that queries the database (forbidden inside an event loop)."""
    from django.contrib.auth import get_user_model

    return HttpResponse(f"users: {get_user_model().objects.count()}", status=429)


v2 = [
    path("items/", ok, name="items"),
]

api: list[URLPattern | URLResolver] = [
    path("items/", ok, name="items"),
    path("search/", ok, name="search"),
    path("async/", async_ok, name="async"),
    path("v2/", include((v2, "v2"))),
]

urlpatterns = [
    path("api/", include((api, "api"))),
    path("apiary/", ok, name="apiary"),
    path("health/", ok, name="health"),
    path("plain/<int:pk>/", ok),
    path("async/", async_ok, name="async"),
]

# The admin (tests/test_admin.py, tests/test_browser.py) and the Prometheus view
# (tests/test_metrics.py).
from django.contrib import admin  # noqa: E402

import django_quota.views  # noqa: E402

urlpatterns += [
    path("admin/", admin.site.urls),
    path("metrics/quota", django_quota.views.metrics, name="quota-metrics"),
]
