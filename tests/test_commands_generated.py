"""``manage.py quota`` names the policies that live outside settings and the database:
the DRF drop-ins' ``drf:<scope>`` and ``@quota(rate=...)`` views, with the counters the
HTTP layers wrote."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.core.management import call_command
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

from django_quota.decorators import quota as quota_decorator
from django_quota.throttling import AnonRateThrottle


class Anonymous(APIView):
    throttle_classes = [AnonRateThrottle]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


@quota_decorator(rate="5/m", selector=("ip",), algorithm="fixed_window")
def exported(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [path("anon/", Anonymous.as_view()), path("exported/", exported)]
EXPORT_ID = "view:tests.test_commands_generated.exported"


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("quota", *args, stdout=out)
    return out.getvalue()


@pytest.mark.urls(__name__)
def test_policies_lists_drf_scopes_and_decorated_views(quota: Any, settings: Any) -> None:
    quota(DRF_ALGORITHM="fixed_window")
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "3/m", "user": "9/h"}}
    rows = {row["policy"]: row for row in json.loads(run("policies", "--json"))}
    assert rows["drf:anon"]["selector"] == ["ip"]
    assert rows["drf:anon"]["source"] == "drf"
    assert rows["drf:user"]["selector"] == ["auto"]
    assert rows[EXPORT_ID]["source"] == "decorator"
    assert rows[EXPORT_ID]["windows"] == [
        {"window": "default", "limit": 5, "period": 60.0, "capacity": None}
    ]


@pytest.mark.urls(__name__)
def test_inspect_and_reset_reach_the_counters_the_throttle_and_decorator_wrote(
    quota: Any, settings: Any
) -> None:
    quota(DRF_ALGORITHM="fixed_window")
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "3/m"}}
    client = Client(REMOTE_ADDR="198.51.100.23")
    assert [client.get("/anon/").status_code for _ in range(4)] == [200, 200, 200, 429]
    assert client.get("/exported/").status_code == 200

    anon = json.loads(run("inspect", "drf:anon", "--ip", "198.51.100.23", "--json"))
    assert [(w["count"], w["remaining"]) for w in anon["windows"]] == [(3, 0)]
    export = json.loads(run("inspect", EXPORT_ID, "--ip", "198.51.100.23", "--json"))
    assert [(w["count"], w["remaining"]) for w in export["windows"]] == [(1, 4)]

    assert run("reset", "drf:anon", "--ip", "198.51.100.23", "--yes").strip() == (
        "reset drf:anon: 1 window(s) had state"
    )
    assert client.get("/anon/").status_code == 200
