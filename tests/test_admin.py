"""The Django admin for quota policies (docs/operations.md), through the test client: the
changelist, the add form with its inline windows (management form included), validation,
revision bumps and fresh counters after an edit, the enable/disable and reset-counters
actions, and the staff-only status page."""

from __future__ import annotations

import html
import re
import socket
from datetime import UTC, datetime
from typing import Any

import pytest
from django.test import Client

import django_quota
from django_quota import engine, limiter, policies
from django_quota.models import QuotaPlanLimit, QuotaPolicy, QuotaWindow, revision_batch

pytestmark = pytest.mark.django_db

CLOCK = "tests.test_middleware.frozen_clock"
SOURCES = ["settings", "database"]
CHANGELIST = "/admin/django_quota/quotapolicy/"
ADD = CHANGELIST + "add/"
STATUS = CHANGELIST + "status/"
IP = "203.0.113.9"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def database_policies(quota: Any) -> Any:
    """Settings for database policies on the memory backend with a frozen clock."""
    return quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES)


def policy_form(**fields: Any) -> dict[str, str]:
    """The add/change form of a policy as the browser posts it."""
    data = {
        "name": "api",
        "position": "0",
        "algorithm": "fixed_window",
        "selector": '["ip"]',
        "routes": '["/api"]',
        "methods": "[]",
        "exempt": "[]",
        "count_when": "",
        "enforcement": "enforce",
        "failure_mode": "",
        "on_missing": "deny",
        "max_cost": "",
        "enabled": "on",
        "_save": "Save",
    }
    data.update({key: str(value) for key, value in fields.items()})
    return data


def windows_formset(
    windows: list[dict[str, Any]], *, initial: int = 0
) -> dict[str, str]:
    """The inline formset of windows: the management form, then each row."""
    data = {
        "windows-TOTAL_FORMS": str(len(windows)),
        "windows-INITIAL_FORMS": str(initial),
        "windows-MIN_NUM_FORMS": "0",
        "windows-MAX_NUM_FORMS": "1000",
    }
    for index, window in enumerate(windows):
        for key in ("id", "policy", "name", "limit", "period", "capacity", "DELETE"):
            if key in window:
                data[f"windows-{index}-{key}"] = str(window[key])
        data.setdefault(f"windows-{index}-capacity", "")
    return data


def plans_formset(rows: list[dict[str, Any]], *, initial: int = 0) -> dict[str, str]:
    """The inline formset of plan limits (one row per plan and window)."""
    data = {
        "plan_limits-TOTAL_FORMS": str(len(rows)),
        "plan_limits-INITIAL_FORMS": str(initial),
        "plan_limits-MIN_NUM_FORMS": "0",
        "plan_limits-MAX_NUM_FORMS": "1000",
    }
    for index, row in enumerate(rows):
        for key in ("id", "policy", "plan", "window", "limit", "DELETE"):
            if key in row:
                data[f"plan_limits-{index}-{key}"] = str(row[key])
    return data


def add_policy(
    client: Client,
    windows: list[dict[str, Any]],
    plans: list[dict[str, Any]] = (),  # type: ignore[assignment]
    **fields: Any,
) -> Any:
    return client.post(
        ADD, {**policy_form(**fields), **windows_formset(windows), **plans_formset(list(plans))}
    )


def create_policy(name: str = "api", windows: tuple[tuple[str, int, int], ...] = (
    ("default", 2, 3600),
), **fields: Any) -> QuotaPolicy:
    fields.setdefault("selector", ["ip"])
    fields.setdefault("routes", ["/api"])
    with revision_batch():
        policy = QuotaPolicy.objects.create(name=name, **fields)
        for window_name, limit, period in windows:
            QuotaWindow.objects.create(policy=policy, name=window_name, limit=limit, period=period)
    policy.refresh_from_db()
    return policy


def statuses(path: str, count: int, address: str = IP) -> list[int]:
    client = Client(REMOTE_ADDR=address)
    return [client.get(path).status_code for _ in range(count)]


def errors_of(response: Any) -> str:
    """The text of every error list on an admin page."""
    found = re.findall(r'<ul class="errorlist[^"]*"[^>]*>(.*?)</ul>', response.content.decode(),
                       re.S)
    return html.unescape(" ".join(re.sub(r"<[^>]+>", "", item) for item in found))


def cells(response: Any, table_id: str) -> list[list[str]]:
    """The text of each row of the table ``table_id`` (its body rows only)."""
    page = response.content.decode()
    table = re.search(rf'<table id="{table_id}">(.*?)</table>', page, re.S)
    assert table is not None, table_id
    body = table.group(1).split("</thead>")[-1]
    rows = re.findall(r"<tr>(.*?)</tr>", body, re.S)
    return [
        [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
         for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in rows
    ]


# -- changelist --------------------------------------------------------------------------------
def test_changelist_shows_what_a_policy_means(admin_client: Client, database_policies: Any) -> None:
    create_policy("orders", windows=(("burst", 2, 60), ("sustained", 100, 3600)),
                  selector=["user"], enforcement="shadow", failure_mode="open")
    response = admin_client.get(CHANGELIST)
    assert response.status_code == 200
    page = response.content.decode()
    for header in ("algorithm", "windows", "selector", "enforcement", "failure mode", "revision"):
        assert f">{header.capitalize()}<" in page or f">{header}<" in page, header
    row = re.search(r'<tr>.*?orders.*?</tr>', page, re.S)
    assert row is not None
    text = html.unescape(re.sub(r"<[^>]+>", "|", row.group(0)))
    for value in ("fixed window", "burst: 2/m, sustained: 100/h", '["user"]', "shadow",
                  "open"):
        assert value in text, value
    assert re.search(r'class="field-revision">1<', row.group(0))


# -- add --------------------------------------------------------------------------------------
def test_a_policy_added_with_two_windows_is_applied_by_the_middleware(
    admin_client: Client, database_policies: Any
) -> None:
    response = add_policy(
        admin_client,
        [{"name": "burst", "limit": 2, "period": 60},
         {"name": "sustained", "limit": 3, "period": 3600}],
    )
    assert response.status_code == 302, errors_of(response)
    policy = QuotaPolicy.objects.get(name="api")
    assert [(w.name, w.limit, w.period) for w in policy.windows.all()] == [
        ("burst", 2, 60), ("sustained", 3, 3600)
    ]
    assert policy.revision == 1  # one edit: no bump for the windows that came with it
    assert (policy.selector, policy.routes, policy.failure_mode) == (["ip"], ["/api"], None)
    assert statuses("/api/items/", 3) == [200, 200, 429]
    assert statuses("/health/", 3) == [200, 200, 200]
    outcome = django_quota.peek("api", {"ip": IP})
    assert (outcome.window, outcome.remaining) == ("burst", 0)


@pytest.mark.parametrize(
    ("windows", "message"),
    [
        ([{"name": "burst", "limit": 10, "period": 3600},
          {"name": "sustained", "limit": 100, "period": 60}],
         "the 'burst' window's period must be shorter than the 'sustained' one's"),
        ([{"name": "burst", "limit": 10, "period": 60},
          {"name": "sustained", "limit": 100, "period": 60}],
         "the 'burst' window's period must be shorter than the 'sustained' one's"),
        ([], "A policy needs at least one window."),
        ([{"name": "default", "limit": 10, "period": 60, "capacity": 20}],
         "capacity applies to token_bucket only"),
        ([{"name": "default", "limit": 0, "period": 60}], "positive integer"),
        ([{"name": "default", "limit": 10, "period": 0}], "period"),
        ([{"name": "Default", "limit": 10, "period": 60}], "Enter a valid value."),
        ([{"name": "default", "limit": 10, "period": 60},
          {"name": "default", "limit": 20, "period": 3600}],
         "Please correct the duplicate data for name"),
    ],
)
def test_invalid_windows_are_refused_with_a_message(
    admin_client: Client, database_policies: Any, windows: list[dict[str, Any]], message: str
) -> None:
    response = add_policy(admin_client, windows)
    assert response.status_code == 200
    assert message in errors_of(response)
    assert not QuotaPolicy.objects.exists()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "Not An Id", "a policy id must match"),
        ("selector", '["nobody"]', "unknown dimension 'nobody'"),
        ("methods", '["get"]', "'get' must be upper-case, e.g. GET"),
        ("routes", '"/api"', "expected a list of strings"),
        ("exempt", '["the office"]', "'the office' is not an IP network"),
        ("exempt", '"192.0.2.0/24"', "expected a list of strings"),
        ("count_when", '["2xy"]', "'2xy' is not an HTTP status (100 to 599) or a class"),
        ("count_when", "[600]", "600 is not an HTTP status (100 to 599) or a class"),
        ("count_when", "[true]", "True is not an HTTP status (100 to 599) or a class"),
        ("count_when", "[]", "expected None or a non-empty list of statuses and classes"),
        ("count_when", '"2xx"', "expected None or a non-empty list of statuses and classes"),
        ("count_when", '{"2xx": 1}', "expected None or a non-empty list of statuses"),
        ("count_when", "[2", "Enter a valid JSON."),
    ],
)
def test_invalid_policy_fields_are_refused_next_to_the_field(
    admin_client: Client, database_policies: Any, field: str, value: str, message: str
) -> None:
    response = add_policy(admin_client, [{"name": "default", "limit": 1, "period": 60}],
                          **{field: value})
    assert response.status_code == 200
    assert message in errors_of(response)
    assert re.search(rf'class="form-row[^"]*field-{field}', response.content.decode())
    assert not QuotaPolicy.objects.exists()


# -- change ------------------------------------------------------------------------------------
def change(admin_client: Client, policy: QuotaPolicy, windows: list[dict[str, Any]],
           plans: list[dict[str, Any]] = (),  # type: ignore[assignment]
           **fields: Any) -> Any:
    """Post the change form: the stored windows and plan rows, edited by ``windows`` and
    ``plans`` row by row (extra items are new rows)."""
    plan_rows = [
        {"id": row.pk, "policy": policy.pk, "plan": row.plan, "window": row.window,
         "limit": row.limit}
        for row in policy.plan_limits.all()
    ]
    for row, edit in zip(plan_rows, plans, strict=False):
        row.update(edit)
    plan_rows += list(plans)[len(plan_rows):]
    rows = [
        {"id": w.pk, "policy": policy.pk, "name": w.name, "limit": w.limit, "period": w.period,
         "capacity": w.capacity or ""}
        for w in policy.windows.all()
    ]
    for row, edit in zip(rows, windows, strict=False):
        row.update(edit)
    rows += windows[len(rows):]
    form = policy_form(**{"name": policy.name, "algorithm": policy.algorithm, **fields})
    return admin_client.post(
        f"{CHANGELIST}{policy.pk}/change/",
        {**form, **windows_formset(rows, initial=policy.windows.count()),
         **plans_formset(plan_rows, initial=policy.plan_limits.count())},
    )


def test_editing_a_window_limit_bumps_the_revision_and_starts_fresh_counters(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_policy(windows=(("default", 2, 3600),))
    assert statuses("/api/items/", 3) == [200, 200, 429]
    response = change(admin_client, policy, [{"limit": 3}])
    assert response.status_code == 302, errors_of(response)
    policy.refresh_from_db()
    assert policy.revision == 2
    assert statuses("/api/items/", 4) == [200, 200, 200, 429]
    assert admin_client.get(CHANGELIST).status_code == 200


def test_editing_two_windows_in_one_save_bumps_once(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_policy(windows=(("burst", 2, 60), ("sustained", 10, 3600)))
    response = change(admin_client, policy, [{"limit": 3}, {"limit": 11}])
    assert response.status_code == 302, errors_of(response)
    assert QuotaPolicy.objects.get(pk=policy.pk).revision == 2


def test_editing_enforcement_keeps_the_revision_and_the_counters(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_policy(windows=(("default", 2, 3600),))
    assert statuses("/api/items/", 2) == [200, 200]
    response = change(admin_client, policy, [], enforcement="shadow")
    assert response.status_code == 302, errors_of(response)
    assert QuotaPolicy.objects.get(pk=policy.pk).revision == 1
    assert django_quota.peek("api", {"ip": IP}).remaining == 0  # same counters
    assert statuses("/api/items/", 1) == [200]  # shadow: never refuses


def test_switching_away_from_token_bucket_while_clearing_capacity_is_accepted(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_policy(algorithm="token_bucket")
    QuotaWindow.objects.filter(policy=policy).update(capacity=5)
    policy.refresh_from_db()
    response = change(
        admin_client,
        QuotaPolicy.objects.get(pk=policy.pk),
        [{"capacity": ""}],
        algorithm="fixed_window",
    )
    assert response.status_code == 302, errors_of(response)
    assert QuotaPolicy.objects.get(pk=policy.pk).algorithm == "fixed_window"


def test_deleting_a_window_in_the_admin_bumps_the_revision(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_policy(windows=(("burst", 2, 60), ("sustained", 10, 3600)))
    response = change(admin_client, policy, [{}, {"DELETE": "on"}])
    assert response.status_code == 302, errors_of(response)
    policy.refresh_from_db()
    assert [w.name for w in policy.windows.all()] == ["burst"]
    assert policy.revision == 2


# -- actions ----------------------------------------------------------------------------------
def act(admin_client: Client, action: str, *policies_: QuotaPolicy, **extra: str) -> Any:
    return admin_client.post(
        CHANGELIST,
        {"action": action, "_selected_action": [p.pk for p in policies_], **extra},
        follow=True,
    )


def test_disable_and_enable_actions(admin_client: Client, database_policies: Any) -> None:
    api = create_policy(windows=(("default", 1, 3600),))
    other = create_policy("other", routes=["/health"])
    response = act(admin_client, "disable_policies", api, other)
    assert "Disabled 2 policies." in response.content.decode()
    assert not QuotaPolicy.objects.filter(enabled=True).exists()
    assert statuses("/api/items/", 2) == [200, 200]
    response = act(admin_client, "enable_policies", api)
    assert "Enabled 1 policies." in response.content.decode()
    assert statuses("/api/items/", 2) == [200, 429]
    assert QuotaPolicy.objects.get(pk=api.pk).revision == 1


def test_reset_counters_action_asks_for_the_subject_then_resets(
    admin_client: Client, database_policies: Any
) -> None:
    api = create_policy(windows=(("burst", 2, 60), ("sustained", 10, 3600)))
    assert statuses("/api/items/", 3) == [200, 200, 429]
    assert statuses("/api/items/", 1, address="198.51.100.7") == [200]
    assert django_quota.peek("api", {"ip": IP}).remaining == 0

    intermediate = act(admin_client, "reset_counters", api)
    page = intermediate.content.decode()
    assert intermediate.templates[0].name == "django_quota/admin/reset_counters.html"
    assert 'name="ip"' in page and 'name="apply"' in page
    assert django_quota.peek("api", {"ip": IP}).remaining == 0  # nothing reset yet

    # "::ffff:…" is normalised as the middleware does: the same subject.
    response = act(admin_client, "reset_counters", api, ip=f"::ffff:{IP}", apply="Reset")
    assert "Reset api: 2 window(s) had state." in response.content.decode()
    assert django_quota.peek("api", {"ip": IP}).remaining == 2
    assert django_quota.peek("api", {"ip": "198.51.100.7"}).remaining == 1  # untouched
    assert statuses("/api/items/", 3) == [200, 200, 429]


def test_reset_counters_without_the_needed_dimension_says_why(
    admin_client: Client, database_policies: Any
) -> None:
    api = create_policy()
    response = act(admin_client, "reset_counters", api, user="42", apply="Reset")
    assert (
        "Could not reset api: cannot reset &#x27;api&#x27;: selector_identity_missing (ip)"
        in response.content.decode()
    )


# -- status page ------------------------------------------------------------------------------
def test_status_page_is_staff_only(client: Client, django_user_model: Any,
                                   database_policies: Any) -> None:
    anonymous = client.get(STATUS)
    assert anonymous.status_code == 302
    assert anonymous["Location"] == f"/admin/login/?next={STATUS}"
    member = django_user_model.objects.create_user("member", password="pw")
    client.force_login(member)
    refused = client.get(STATUS)
    assert refused.status_code == 302
    assert refused["Location"].startswith("/admin/login/")
    assert b"quota-status" not in refused.content


def test_status_page_shows_policies_backend_and_outcomes(
    admin_client: Client, quota: Any
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES,
          POLICIES={"from-settings": {"windows": "5/m", "selector": ["ip"]}})
    create_policy("status-api", windows=(("default", 1, 3600),))
    django_quota.evaluate("status-api", {"ip": IP})
    django_quota.evaluate("status-api", {"ip": IP})
    response = admin_client.get(STATUS)
    assert response.status_code == 200
    policies_table = cells(response, "quota-policies")
    assert [row[:4] for row in policies_table] == [
        ["from-settings", "settings", policies.get_policy("from-settings").revision,
         "fixed_window"],
        ["status-api", "database", "1", "fixed_window"],
    ]
    assert policies_table[0][4:] == ["default: 5/m", "-", "ip", "-", "enforce",
                                     "closed (default)", "yes"]
    assert policies_table[1][4:] == ["default: 1/h", "-", "ip", "/api", "enforce",
                                     "closed (default)", "yes"]
    page = response.content.decode()
    assert '<td id="quota-backend">memory</td>' in page
    assert '<td id="quota-breaker">closed</td>' in page
    assert '<td id="quota-degraded">no</td>' in page
    counts = cells(response, "quota-counts")
    assert ["status-api", "allowed", "-", "1"] in counts
    assert ["status-api", "denied", "default_quota_exhausted", "1"] in counts
    assert cells(response, "quota-errors") == [["None since this process started."]]


def test_status_page_lists_each_nodes_breaker_and_shows_the_worst(
    admin_client: Client, quota: Any
) -> None:
    quota(POLICIES={"p": {"windows": "5/m"}})
    current = limiter.get_limiter()
    for _ in range(engine.Sizes.BREAKER_THRESHOLD):  # one cluster primary failing, one healthy
        current.guard("127.0.0.1:7001").breaker.failure("backend_unavailable", "refused")
    current.guard("127.0.0.1:7002").breaker.success()
    page = admin_client.get(STATUS).content.decode()
    assert '<td id="quota-breaker">open</td>' in page
    assert '<td id="quota-nodes">127.0.0.1:7001: open, 127.0.0.1:7002: closed</td>' in page
    assert '<td id="quota-degraded">yes</td>' in page


def test_status_page_shows_recent_backend_errors_and_the_open_breaker(
    admin_client: Client, quota: Any
) -> None:
    port = free_port()
    quota(
        REDIS_URL=f"redis://:s3cret@127.0.0.1:{port}/0",
        POLICIES={"dead-redis": {"windows": "5/m", "selector": ["ip"]}},
    )
    for _ in range(engine.Sizes.BREAKER_THRESHOLD):
        outcome = django_quota.evaluate("dead-redis", {"ip": IP})
        assert (outcome.decision, outcome.reason) == ("failed_closed", "backend_unavailable")
    response = admin_client.get(STATUS)
    page = response.content.decode()
    assert '<td id="quota-backend">redis</td>' in page
    assert f"redis://***@127.0.0.1:{port}/0" in page
    assert "s3cret" not in page
    assert '<td id="quota-breaker">open</td>' in page
    assert '<td id="quota-nodes">default: open</td>' in page
    assert '<td id="quota-degraded">yes</td>' in page
    errors = cells(response, "quota-errors")
    assert len(errors) == engine.Sizes.BREAKER_THRESHOLD
    # When, as a reader reads it (UTC with milliseconds), not as epoch seconds.
    newest = limiter.get_limiter().recent_errors[-1].at
    assert errors[0][0] == f"{datetime.fromtimestamp(newest, UTC):%Y-%m-%d %H:%M:%S.%f}"[
        :-3
    ] + " UTC"
    assert {row[1] for row in errors} == {"backend_unavailable"}
    assert str(port) in errors[0][2]
    assert IP not in page
    counts = cells(response, "quota-counts")
    assert ["dead-redis", "failed_closed", "backend_unavailable",
            str(engine.Sizes.BREAKER_THRESHOLD)] in counts


def redis_row(response: Any) -> str | None:
    """The text of the status page's Redis row, or None when it has none."""
    found = re.search(r"<tr><th>Redis</th><td[^>]*>(.*?)</td></tr>", response.content.decode())
    return None if found is None else html.unescape(found.group(1))


@pytest.mark.parametrize("redis_url", [None, "redis://127.0.0.1:6399/0"])
def test_status_page_shows_the_redis_of_cache_alias(
    admin_client: Client, quota: Any, settings: Any, redis_url: str | None
) -> None:
    """With CACHE_ALIAS the counters live in the cache's Redis: that is the row shown,
    without its password, whether a REDIS_URL (ignored) is set beside it or not."""
    port = free_port()
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "quota": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://:s3cret@127.0.0.1:{port}/3",
        },
    }
    quota(CACHE_ALIAS="quota", REDIS_URL=redis_url, POLICIES={"p": {"windows": "5/m"}})
    response = admin_client.get(STATUS)
    assert response.status_code == 200
    assert '<td id="quota-backend">redis</td>' in response.content.decode()
    assert redis_row(response) == f"redis://***@127.0.0.1:{port}/3 (CACHE_ALIAS quota)"
    assert b"s3cret" not in response.content
    assert b"6399" not in response.content


def test_status_page_shows_no_redis_row_for_the_memory_backend(
    admin_client: Client, quota: Any
) -> None:
    quota(POLICIES={"p": {"windows": "5/m"}})
    response = admin_client.get(STATUS)
    assert '<td id="quota-backend">memory</td>' in response.content.decode()
    assert redis_row(response) is None


def test_status_page_says_when_database_policies_conflict(
    admin_client: Client, quota: Any
) -> None:
    quota(POLICY_SOURCES=SOURCES, POLICIES={"api": {"windows": "5/m"}})
    create_policy("api")
    page = admin_client.get(STATUS).content.decode()
    assert "Defined in settings and in the database (settings win): api" in page


# -- permissions ------------------------------------------------------------------------------
def staff_with(django_user_model: Any, *codenames: str) -> Client:
    """A logged-in staff client holding only these django_quota permissions."""
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("operator", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_quota", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def test_view_only_staff_sees_no_actions_and_cannot_run_them(
    django_user_model: Any, database_policies: Any
) -> None:
    api = create_policy(windows=(("default", 1, 3600),))
    viewer = staff_with(django_user_model, "view_quotapolicy")
    page = viewer.get(CHANGELIST).content.decode()
    assert viewer.get(CHANGELIST).status_code == 200
    for action in ("enable_policies", "disable_policies", "reset_counters"):
        assert f'value="{action}"' not in page, action
    act(viewer, "disable_policies", api)
    assert QuotaPolicy.objects.get(pk=api.pk).enabled is True
    assert statuses("/api/items/", 2) == [200, 429]
    response = act(viewer, "reset_counters", api, ip=IP, apply="Reset")
    assert "window(s) had state" not in response.content.decode()
    assert django_quota.peek("api", {"ip": IP}).remaining == 0  # nothing was reset


def test_the_actions_check_the_change_permission_themselves(
    rf: Any, django_user_model: Any, database_policies: Any
) -> None:
    from django.contrib import admin as django_admin
    from django.core.exceptions import PermissionDenied

    api = create_policy(windows=(("default", 1, 3600),))
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    model_admin = django_admin.site._registry[QuotaPolicy]
    for action in ("enable_policies", "disable_policies", "reset_counters"):
        assert getattr(model_admin, action).allowed_permissions == ("change",), action
        request = rf.post(CHANGELIST, {"apply": "Reset", "ip": IP})
        request.user = viewer
        with pytest.raises(PermissionDenied):
            getattr(model_admin, action)(request, QuotaPolicy.objects.filter(pk=api.pk))
    assert QuotaPolicy.objects.get(pk=api.pk).enabled is True


def test_staff_with_the_change_permission_runs_the_actions(
    django_user_model: Any, database_policies: Any
) -> None:
    api = create_policy(windows=(("default", 1, 3600),))
    editor = staff_with(django_user_model, "view_quotapolicy", "change_quotapolicy")
    assert statuses("/api/items/", 2) == [200, 429]
    response = act(editor, "reset_counters", api, ip=IP, apply="Reset")
    assert "Reset api: 1 window(s) had state." in response.content.decode()
    response = act(editor, "disable_policies", api)
    assert "Disabled 1 policies." in response.content.decode()
    assert QuotaPolicy.objects.get(pk=api.pk).enabled is False


def test_status_page_needs_the_view_permission(
    django_user_model: Any, database_policies: Any
) -> None:
    nobody = staff_with(django_user_model)
    refused = nobody.get(STATUS)
    assert refused.status_code == 403
    assert b"quota-status" not in refused.content


def test_status_page_opens_with_the_view_permission(
    django_user_model: Any, database_policies: Any
) -> None:
    viewer = staff_with(django_user_model, "view_quotapolicy")
    response = viewer.get(STATUS)
    assert response.status_code == 200
    assert b'<div id="quota-status">' in response.content


def test_changelist_links_to_the_status_page(admin_client: Client, database_policies: Any) -> None:
    page = admin_client.get(CHANGELIST).content.decode()
    assert re.search(rf'<a href="{STATUS}"[^>]*>Quota status</a>', page)


def test_a_database_policy_cannot_take_a_settings_policy_id(
    admin_client: Client, quota: Any
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES, POLICIES={"api": {"windows": "5/m"}})
    response = add_policy(admin_client, [{"name": "default", "limit": 1, "period": 60}])
    assert response.status_code == 200
    assert (
        "QUOTA['POLICIES'] already defines a policy 'api', which would win over this row; "
        "choose another name" in errors_of(response)
    )
    assert re.search(r'class="form-row[^"]*field-name', response.content.decode())
    assert not QuotaPolicy.objects.exists()
    response = add_policy(admin_client, [{"name": "default", "limit": 1, "period": 60}],
                          name="api-db")
    assert response.status_code == 302, errors_of(response)


def test_a_settings_id_is_free_when_settings_are_not_a_source(
    admin_client: Client, quota: Any
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=["database"], POLICIES={"api": {"windows": "5/m"}})
    response = add_policy(admin_client, [{"name": "default", "limit": 1, "period": 60}])
    assert response.status_code == 302, errors_of(response)


def deleted_references(response: Any) -> list[str]:
    page = response.content.decode()
    block = re.search(r'<ul id="quota-references">(.*?)</ul>', page, re.S)
    assert block is not None, "no reference list on the page"
    return [html.unescape(re.sub(r"<[^>]+>", "", item)).strip()
            for item in re.findall(r"<li>(.*?)</li>", block.group(1), re.S)]


@pytest.mark.urls("tests.references_urls")
def test_delete_confirmation_lists_the_views_that_name_the_policy(
    admin_client: Client, database_policies: Any
) -> None:
    api = create_policy()
    response = admin_client.get(f"{CHANGELIST}{api.pk}/delete/")
    assert response.status_code == 200
    assert deleted_references(response) == [
        "ref/decorated/ (tests.references_urls.decorated): @quota('api')",
        "ref/class/ (tests.references_urls.DecoratedClass): @quota('api')",
        "ref/throttle/ (tests.references_urls.NamedByThrottle): QuotaThrottle, quota_policies",
        "ref/scope/ (tests.references_urls.ScopedByThrottle): QuotaThrottle, throttle_scope",
    ]
    assert "django_quota.E009" in response.content.decode()
    bulk = admin_client.post(
        CHANGELIST, {"action": "delete_selected", "_selected_action": [api.pk]}
    )
    assert bulk.status_code == 200
    assert len(deleted_references(bulk)) == 4
    assert QuotaPolicy.objects.filter(pk=api.pk).exists()


@pytest.mark.urls("tests.references_urls")
def test_delete_confirmation_of_an_unnamed_policy_lists_nothing(
    admin_client: Client, database_policies: Any
) -> None:
    lonely = create_policy("lonely")
    page = admin_client.get(f"{CHANGELIST}{lonely.pk}/delete/").content.decode()
    assert 'id="quota-references"' not in page
    assert "Are you sure you want to delete" in page


# -- plans (docs/plans.md) ---------------------------------------------------------------------
def plan_rows(*rows: tuple[str, str, int]) -> list[dict[str, Any]]:
    return [{"plan": plan, "window": window, "limit": limit} for plan, window, limit in rows]


def test_a_policy_added_with_plans_decides_with_the_plans_limits(
    admin_client: Client, database_policies: Any
) -> None:
    response = add_policy(
        admin_client,
        [{"name": "burst", "limit": 2, "period": 60},
         {"name": "daily", "limit": 3, "period": 86400}],
        plan_rows(("free", "burst", 2), ("free", "daily", 3),
                  ("pro", "burst", 20), ("pro", "daily", 300)),
    )
    assert response.status_code == 302, errors_of(response)
    policy = policies.get_policy("api")
    assert [(name, [w.rate for w in windows]) for name, windows in policy.plans] == [
        ("free", ["2/m", "3/d"]), ("pro", ["20/m", "300/d"])
    ]
    assert django_quota.peek("api", {"ip": IP}, plan="pro").limit == 20
    page = admin_client.get(CHANGELIST).content.decode()
    # A fixed window of a database day is the day in UTC, written as quota policies
    # and the status page write it.
    unescaped = html.unescape(page)
    assert "burst: 2/m, daily: 3/day (UTC)" in unescaped
    assert "free (burst 2/m, daily 3/day (UTC)), pro (burst 20/m, daily 300/day (UTC))" in unescaped
    (row,) = cells(admin_client.get(STATUS), "quota-policies")
    # The status page writes the effective policy: a day of a database policy is the
    # epoch-aligned day, the day in UTC (docs/policies.md#calendar-windows).
    assert row[4:6] == [
        "burst: 2/m, daily: 3/day (UTC)",
        "free (burst 2/m, daily 3/day (UTC)), pro (burst 20/m, daily 300/day (UTC))",
    ]


def create_planned_policy() -> QuotaPolicy:
    policy = create_policy(windows=(("daily", 3, 86400),))
    with revision_batch():
        for plan, limit in (("free", 3), ("pro", 10)):
            QuotaPlanLimit.objects.create(policy=policy, plan=plan, window="daily", limit=limit)
    policy.refresh_from_db()
    return policy


def test_editing_a_plans_limit_in_the_admin_keeps_the_revision_and_the_usage(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_planned_policy()
    revision = policy.revision
    for _ in range(3):
        assert django_quota.evaluate("api", {"ip": IP}, plan="free").allowed
    assert django_quota.peek("api", {"ip": IP}, plan="pro").remaining == 7
    # pro from 10 to 100, free from 3 to 5, and the policy's own window from 3 to 4
    response = change(admin_client, policy, [{"limit": 4}], [{"limit": 5}, {"limit": 100}])
    assert response.status_code == 302, errors_of(response)
    policy.refresh_from_db()
    assert policy.revision == revision
    assert django_quota.peek("api", {"ip": IP}, plan="pro").remaining == 97
    assert django_quota.peek("api", {"ip": IP}, plan="free").remaining == 2
    assert django_quota.peek("api", {"ip": IP}).remaining == 1
    # A new plan keeps the counter too.
    response = change(admin_client, policy, [], [{}, {}, {"plan": "team", "window": "daily",
                                                          "limit": 1000}])
    assert response.status_code == 302, errors_of(response)
    assert QuotaPolicy.objects.get(pk=policy.pk).revision == revision
    assert django_quota.peek("api", {"ip": IP}, plan="team").remaining == 997


def test_a_period_change_of_a_policy_with_plans_starts_fresh_counters(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_planned_policy()
    django_quota.evaluate("api", {"ip": IP}, plan="pro")
    response = change(admin_client, policy, [{"period": 3600}])
    assert response.status_code == 302, errors_of(response)
    assert QuotaPolicy.objects.get(pk=policy.pk).revision > policy.revision
    assert django_quota.peek("api", {"ip": IP}, plan="pro").remaining == 10


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (plan_rows(("pro", "hourly", 10)),
         "plan 'pro' gives a limit to window 'hourly', which the policy does not have "
         "(its windows: burst, daily)"),
        (plan_rows(("pro", "burst", 10)),
         "plan 'pro': a plan has the policy's windows (burst, daily), not burst"),
        (plan_rows(("pro plan", "burst", 10), ("pro plan", "daily", 10)),
         "Enter a valid value."),
        (plan_rows(("pro", "burst", 0), ("pro", "daily", 10)),
         "Ensure this value is greater than or equal to 1."),
        (plan_rows(("pro", "burst", -1), ("pro", "daily", 10)),
         "Ensure this value is greater than or equal to"),
        (plan_rows(("pro", "burst", "many"), ("pro", "daily", 10)), "Enter a whole number."),
        (plan_rows(("pro", "burst", 2**40), ("pro", "daily", 10)),
         "plan 'pro': the limit must be between 1 and 1000000000, not 1099511627776"),
        (plan_rows(("pro", "burst", 1), ("pro", "burst", 2), ("pro", "daily", 10)),
         "Please correct the duplicate data"),
    ],
)
def test_invalid_plans_are_refused_with_a_message(
    admin_client: Client, database_policies: Any, rows: list[dict[str, Any]], message: str
) -> None:
    response = add_policy(
        admin_client,
        [{"name": "burst", "limit": 2, "period": 60},
         {"name": "daily", "limit": 3, "period": 86400}],
        rows,
    )
    assert response.status_code == 200
    assert message in errors_of(response)
    assert not QuotaPolicy.objects.exists()


def test_deleting_a_window_a_plan_still_names_is_refused(
    admin_client: Client, database_policies: Any
) -> None:
    policy = create_policy(windows=(("burst", 2, 60), ("daily", 3, 86400)))
    QuotaPlanLimit.objects.bulk_create(
        [QuotaPlanLimit(policy=policy, plan="pro", window=name, limit=10)
         for name in ("burst", "daily")]
    )
    response = change(admin_client, policy, [{}, {"DELETE": "on"}])
    assert response.status_code == 200
    assert "plan 'pro' gives a limit to window 'daily', which the policy does not have" in (
        errors_of(response)
    )
    assert QuotaWindow.objects.filter(policy=policy).count() == 2


def test_a_plan_added_row_by_row_through_the_orm_keeps_the_counters(
    database_policies: Any
) -> None:
    """Between its first and its last row, the new plan lacks a window and the policy is
    invalid for a moment; that passing state is no change of meaning."""
    policy = create_policy(windows=(("burst", 2, 60), ("daily", 3, 86400)))
    for name in ("burst", "daily"):
        QuotaPlanLimit.objects.create(policy=policy, plan="pro", window=name, limit=10)
    revision = QuotaPolicy.objects.get(pk=policy.pk).revision
    assert revision > policy.revision  # the first plan: counters of another meaning
    django_quota.evaluate("api", {"ip": IP}, plan="pro")
    for name in ("burst", "daily"):
        QuotaPlanLimit.objects.create(policy=policy, plan="team", window=name, limit=100)
    assert QuotaPolicy.objects.get(pk=policy.pk).revision == revision
    assert django_quota.peek("api", {"ip": IP}, plan="team").remaining == 99


def test_staff_with_the_change_permission_edits_windows_and_plans(
    django_user_model: Any, database_policies: Any
) -> None:
    """docs/admin.md: ``change_quotapolicy`` grants editing a policy *and its windows*
    (and plans); the inline rows need no permissions of their own."""
    api = create_policy(windows=(("default", 1, 3600),))
    editor = staff_with(django_user_model, "view_quotapolicy", "change_quotapolicy")
    page = editor.get(f"{CHANGELIST}{api.pk}/change/").content.decode()
    assert 'name="windows-0-limit"' in page and 'name="plan_limits-0-limit"' in page
    response = change(editor, api, [{"limit": 7}],
                      [{"plan": "pro", "window": "default", "limit": 70}])
    assert response.status_code == 302, errors_of(response)
    assert [w.limit for w in api.windows.all()] == [7]
    assert [(p.plan, p.limit) for p in api.plan_limits.all()] == [("pro", 70)]


def test_a_policy_added_with_exempt_networks_skips_their_clients(
    admin_client: Client, database_policies: Any
) -> None:
    response = add_policy(admin_client, [{"name": "default", "limit": 1, "period": 3600}],
                          exempt='["192.0.2.0/24"]')
    assert response.status_code == 302, errors_of(response)
    assert QuotaPolicy.objects.get(name="api").revision == 1
    assert statuses("/api/items/", 3, address="192.0.2.7") == [200, 200, 200]
    assert statuses("/api/items/", 2) == [200, 429]


def test_a_policy_added_with_count_when_refunds_the_responses_it_does_not_list(
    admin_client: Client, database_policies: Any
) -> None:
    response = add_policy(admin_client, [{"name": "default", "limit": 2, "period": 3600}],
                          count_when='["2XX", 304]')
    assert response.status_code == 302, errors_of(response)
    stored = QuotaPolicy.objects.get(name="api")
    assert stored.count_when == ["2XX", 304]
    assert policies.get_policy("api").count_when == ("2xx", 304)
    # Each 404 is charged before the view, then refunded: none of them uses the budget.
    assert statuses("/api/nothing/", 5) == [404] * 5
    assert django_quota.peek("api", {"ip": IP}).remaining == 2
    assert statuses("/api/items/", 3) == [200, 200, 429]


def test_count_when_left_empty_counts_every_response(
    admin_client: Client, database_policies: Any
) -> None:
    response = add_policy(admin_client, [{"name": "default", "limit": 2, "period": 3600}])
    assert response.status_code == 302, errors_of(response)
    assert QuotaPolicy.objects.get(name="api").count_when is None
    assert policies.get_policy("api").count_when is None
    assert statuses("/api/nothing/", 3) == [404, 404, 429]


def test_count_when_is_no_part_of_the_revision(
    admin_client: Client, database_policies: Any
) -> None:
    api = create_policy()
    before = api.revision
    assert statuses("/api/items/", 1) == [200]
    response = change(admin_client, api, [], count_when='["2xx"]')
    assert response.status_code == 302, errors_of(response)
    api.refresh_from_db()
    assert api.revision == before and api.count_when == ["2xx"]
    assert django_quota.peek("api", {"ip": IP}).remaining == 1  # the counter is kept
