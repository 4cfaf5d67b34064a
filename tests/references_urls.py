"""A URLconf whose views name the policy ``api`` in every way django-quota knows (the
admin's delete confirmation lists them), on top of the test suite's own URLs."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, URLResolver, path
from django.views import View
from rest_framework.response import Response
from rest_framework.views import APIView

from django_quota.decorators import quota
from django_quota.throttling import QuotaThrottle
from tests import urls


@quota("api")
def decorated(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota("api")
class DecoratedClass(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")


class NamedByThrottle(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["other", "api"]

    def get(self, request: Any) -> Response:
        return Response({})


class ScopedByThrottle(APIView):
    throttle_classes = [QuotaThrottle]
    throttle_scope = "api"

    def get(self, request: Any) -> Response:
        return Response({})


@quota("other")
def unrelated(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns: list[URLPattern | URLResolver] = [
    *urls.urlpatterns,
    path("ref/decorated/", decorated),
    path("ref/class/", DecoratedClass.as_view()),
    path("ref/throttle/", NamedByThrottle.as_view()),
    path("ref/scope/", ScopedByThrottle.as_view()),
    path("ref/unrelated/", unrelated),
]
