"""E009: a view that names a policy no source defines is a check error, not a 500 on
every request."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.checks import run_checks
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.views import View
from rest_framework.response import Response
from rest_framework.views import APIView

from django_quota.decorators import quota
from django_quota.throttling import QuotaThrottle, UserRateThrottle


@quota("known")
def known_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota("typo-in-decorator")
def mistyped_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota("typo-in-class")
class MistypedClassView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")


class ScopedByQuotaThrottle(APIView):
    throttle_classes = [QuotaThrottle, UserRateThrottle]
    throttle_scope = "typo-in-scope"

    def get(self, request: Any) -> Response:
        return Response({})


class NamedPolicies(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["known", "typo-in-list"]

    def get(self, request: Any) -> Response:
        return Response({})


urlpatterns = [
    path("known/", known_view),
    path("mistyped/", mistyped_view),
    path("class/", MistypedClassView.as_view()),
    path("scoped/", ScopedByQuotaThrottle.as_view()),
    path("named/", NamedPolicies.as_view()),
]


@pytest.mark.urls(__name__)
def test_views_naming_unknown_policies_fail_the_check(quota: Any) -> None:
    quota(POLICIES={"known": {"windows": "5/m"}})
    errors = [m for m in run_checks() if m.id == "django_quota.E009"]
    named = sorted(m.msg.split("names policy ")[1].split(",")[0] for m in errors)
    assert named == [
        "'typo-in-class'",
        "'typo-in-decorator'",
        "'typo-in-list'",
        "'typo-in-scope'",
    ]


@pytest.mark.urls(__name__)
def test_defined_policies_pass_the_check(quota: Any) -> None:
    defined = {"windows": "5/m"}
    quota(
        POLICIES={
            name: defined
            for name in (
                "known",
                "typo-in-decorator",
                "typo-in-class",
                "typo-in-scope",
                "typo-in-list",
            )
        }
    )
    assert [m for m in run_checks() if m.id == "django_quota.E009"] == []
