"""The URLconf of the whole-request rows (``ROOT_URLCONF``): the plain view, and the DRF
views when DRF is installed."""

from __future__ import annotations

import importlib.util

from django.urls import URLPattern, path

from benchmarks import views
from benchmarks.django_settings import (
    DRF_PATH,
    DRF_QUOTA_PATH,
    DRF_THROTTLED_PATH,
    PLAIN_PATH,
    QUOTA_RATELIMIT_PATH,
    RATELIMIT_PATH,
)


def _route(url_path: str) -> str:
    return url_path.removeprefix("/")


urlpatterns: list[URLPattern] = [
    path(_route(PLAIN_PATH), views.plain, name="plain"),
    path(_route(QUOTA_RATELIMIT_PATH), views.quota_ratelimited, name="quota-ratelimit"),
]

if importlib.util.find_spec("django_ratelimit") is not None:
    urlpatterns.append(
        path(_route(RATELIMIT_PATH), views.django_ratelimited(), name="django-ratelimit")
    )

if importlib.util.find_spec("rest_framework") is not None:
    from benchmarks import drf_views

    urlpatterns += [
        path(_route(DRF_PATH), drf_views.Unthrottled.as_view(), name="drf"),
        path(_route(DRF_THROTTLED_PATH), drf_views.DRFAnonThrottled.as_view(), name="drf-anon"),
        path(_route(DRF_QUOTA_PATH), drf_views.QuotaAnonThrottled.as_view(), name="quota-anon"),
    ]
