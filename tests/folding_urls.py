"""Views whose generated policy ids fold together (``report`` and ``Report`` are both
``view:tests.folding_urls.report``), for check E012."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.views import View

from django_quota.decorators import quota


@quota(rate="5/m")
def report(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota(rate="5/m")
class Report(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")


@quota(rate="5/m")
def summary(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


class Undecorated(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")


urlpatterns = [
    path("report/", report),
    path("Report/", Report.as_view()),
    path("summary/", summary),
    path("summary-again/", summary),  # one view at two routes shares its counter on purpose
]
