"""URLs of the example project: the admin, a health check and the shop API."""

from __future__ import annotations

import os

from django.contrib import admin
from django.http import HttpRequest, JsonResponse
from django.urls import include, path


def healthz(request: HttpRequest) -> JsonResponse:
    """Report that this worker process is serving (exempt from every quota policy)."""
    return JsonResponse({"status": "ok", "pid": os.getpid()})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("api/", include("example_project.shop.urls")),
]
