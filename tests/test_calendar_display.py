"""Calendar windows in words (docs/policies.md#calendar-windows): ``quota policies``
and the admin's status page show ``10000/month (Europe/Berlin)``, a fixed window of one
day in UTC ``3/day (UTC)`` as its settings spell it, and every other period in its
largest whole unit (a 30-day window is ``30d``, a rolling day ``d``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from django_quota import policies
from tests.test_admin import STATUS, cells
from tests.test_commands import quota_command

PLANS = {
    "paid": {
        "windows": {"monthly": "10000/month", "burst": "50/s"},
        "timezone": "Europe/Berlin",
        "selector": ["user"],
    },
    "trial": {"windows": "100/30d", "selector": ["user"]},
    "daily": {"windows": {"utc": "5/day", "week": "20/w"}, "selector": ["user"]},
    # A day of 24 hours, epoch-aligned, is the UTC day whatever the policy's timezone; a
    # rolling day is no calendar window.
    "berlin": {
        "windows": {"local": "3/d", "aligned": "9/24h"},
        "timezone": "Europe/Berlin",
        "selector": ["user"],
        "plans": {"pro": {"local": "30/d", "aligned": "90/24h"}},
    },
    "rolling": {"windows": "5/d", "algorithm": "sliding_window", "selector": ["user"]},
}


@pytest.fixture(autouse=True)
def _no_declared_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies._state, "declared", {})


def test_quota_policies_writes_calendar_windows_in_words(quota: Any) -> None:
    quota(POLICIES=PLANS)
    lines = quota_command("policies").splitlines()
    windows = {line.split()[0]: line for line in lines[1:]}
    assert "monthly=10000/month (Europe/Berlin),burst=50/s" in windows["paid"]
    assert "default=100/30d " in windows["trial"]
    # A UTC day (the epoch-aligned day) is written as its settings spell it, with its
    # timezone, as a UTC week is.
    assert "utc=5/day (UTC),week=20/week (UTC)" in windows["daily"]
    assert (
        "local=3/day (Europe/Berlin),aligned=9/day (UTC)  "
        "pro:local=30/day (Europe/Berlin),aligned=90/day (UTC)"
    ) in windows["berlin"]
    assert "default=5/d " in windows["rolling"]
    listed = {row["policy"]: row for row in json.loads(quota_command("policies", "--json"))}
    assert listed["paid"]["windows"][0] == {
        "window": "monthly",
        "limit": 10000,
        "period": 31 * 86_400.0,
        "capacity": None,
        "calendar": "month",
        "timezone": "Europe/Berlin",
    }
    assert "calendar" not in listed["trial"]["windows"][0]
    assert "calendar" not in listed["rolling"]["windows"][0]
    utc_day = {"calendar": "day", "timezone": "UTC"}
    assert listed["daily"]["windows"][0].items() >= utc_day.items()
    assert listed["berlin"]["plans"][0]["windows"][1].items() >= utc_day.items()


@pytest.mark.django_db
def test_the_status_page_writes_calendar_windows_in_words(admin_client: Client, quota: Any) -> None:
    quota(POLICIES=PLANS, CLOCK="tests.test_middleware.frozen_clock")
    rows = {row[0]: row for row in cells(admin_client.get(STATUS), "quota-policies")}
    assert rows["paid"][4] == "monthly: 10000/month (Europe/Berlin), burst: 50/s"
    assert rows["trial"][4] == "default: 100/30d"
    assert rows["daily"][4] == "utc: 5/day (UTC), week: 20/week (UTC)"
    assert rows["berlin"][4] == "local: 3/day (Europe/Berlin), aligned: 9/day (UTC)"
    assert rows["berlin"][5] == "pro (local 30/day (Europe/Berlin), aligned 90/day (UTC))"
    assert rows["rolling"][4] == "default: 5/d"
