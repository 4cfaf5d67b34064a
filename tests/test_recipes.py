"""docs/recipes.md, run: each recipe's blocks are executed as written (a ``# settings.py``
block's upper-case names become the test's settings, a ``# myproject/<name>.py`` block
becomes the module ``myproject.<name>``), then requests check what the recipe's text
promises, on the memory backend with a frozen clock."""

from __future__ import annotations

import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.signals import user_logged_in
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import clear_url_caches, path

import django_quota
from django_quota import metrics
from django_quota.testing import outcome
from tests.test_middleware import CLOCK

pytestmark = pytest.mark.django_db

PAGE = Path(__file__).resolve().parent.parent / "docs" / "recipes.md"
PROXY = "10.0.0.5"


def recipes() -> dict[str, list[tuple[str, str]]]:
    """Recipe title -> its ``(file, code)`` blocks, in page order."""
    found: dict[str, list[tuple[str, str]]] = {}
    for section in PAGE.read_text().split("\n## ")[1:]:
        title = section.splitlines()[0].strip()
        blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.M | re.S)
        found[title] = [
            (block.splitlines()[0].removeprefix("# ").strip(), block) for block in blocks
        ]
    return found


RECIPES = recipes()


@pytest.fixture
def recipe(settings: Any) -> Iterator[Any]:
    """``recipe(title)`` executes that recipe's blocks; its modules are removed after."""
    made: list[str] = []
    receivers: list[Any] = []

    def run(title: str) -> dict[str, types.ModuleType]:
        modules: dict[str, types.ModuleType] = {}
        for filename, code in RECIPES[title]:
            if filename == "settings.py":
                namespace: dict[str, Any] = {}
                exec(code, namespace)
                for name, value in namespace.items():
                    if name == "QUOTA":
                        value = {"HMAC_KEY": "tests-hmac-key-0123456789", "CLOCK": CLOCK, **value}
                        value.setdefault("POLICY_SOURCES", ["settings"])
                    if name.isupper():
                        setattr(settings, name, value)
                continue
            assert filename.startswith("myproject/") and filename.endswith(".py"), filename
            name = "myproject." + filename.removeprefix("myproject/").removesuffix(".py")
            if "myproject" not in sys.modules:
                package = types.ModuleType("myproject")
                package.__path__ = []
                sys.modules["myproject"] = package
                made.append("myproject")
            module = types.ModuleType(name)
            sys.modules[name] = module
            made.append(name)
            before = list(user_logged_in.receivers)
            exec(compile(code, filename, "exec"), module.__dict__)
            receivers.extend(r for r in user_logged_in.receivers if r not in before)
            modules[name] = module
        return modules

    yield run
    for receiver_key in receivers:
        user_logged_in.receivers.remove(receiver_key)
    user_logged_in.sender_receivers_cache.clear()
    for name in made:
        sys.modules.pop(name, None)
    clear_url_caches()


@pytest.fixture
def mount(settings: Any) -> Iterator[Any]:
    """``mount(patterns)``: make ``patterns`` the root URLconf for the test."""
    name = "tests.test_recipes_urlconf"

    def apply(patterns: list[Any]) -> None:
        module = types.ModuleType(name)
        module.urlpatterns = patterns  # type: ignore[attr-defined]
        sys.modules[name] = module
        settings.ROOT_URLCONF = name
        clear_url_caches()

    yield apply
    sys.modules.pop(name, None)
    clear_url_caches()


def test_the_page_has_the_recipes_this_module_runs() -> None:
    assert list(RECIPES) == [
        "Exempting health checks and internal networks",
        "Tiers: a plan per API key",
        "A usage endpoint",
        "Billable-only charging",
        "POST-only limits with DRF",
        "Daily plus monthly quotas",
        "Login protection",
    ]


def test_recipes_compose_no_two_write_the_same_module() -> None:
    """A reader who follows two recipes keeps both: each recipe's code has a module of its
    own (the settings blocks are merged into one ``QUOTA``, as the page says)."""
    writers: dict[str, list[str]] = {}
    for title, blocks in RECIPES.items():
        for filename, _code in blocks:
            if filename != "settings.py":
                writers.setdefault(filename, []).append(title)
    assert {name: titles for name, titles in writers.items() if len(titles) > 1} == {}


# -- exempting health checks and internal networks ------------------------------------------
def ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


exempting_urls = [path("healthz", ok), path("api/items", ok)]


def test_exempting_health_checks_and_internal_networks(
    recipe: Any, mount: Any, django_user_model: Any
) -> None:
    recipe("Exempting health checks and internal networks")
    mount(exempting_urls)
    client = Client()

    def statuses(url: str, count: int, address: str) -> list[int]:
        forwarded = {"REMOTE_ADDR": PROXY, "HTTP_X_FORWARDED_FOR": address}
        return [client.get(url, **forwarded).status_code for _ in range(count)]

    # The health check is never looked at; the office and the VPN skip the policy.
    assert set(statuses("/healthz", 70, "198.51.100.1")) == {200}
    assert set(statuses("/api/items", 70, "192.0.2.10")) == {200}
    assert set(statuses("/api/items", 70, "2001:db8:42:7::3")) == {200}
    exempt_before = metrics.outcome_counts().get(("api", "skipped", "exempt"), 0)
    assert statuses("/api/items", 1, "192.0.2.10") == [200]
    assert metrics.outcome_counts()[("api", "skipped", "exempt")] == exempt_before + 1
    # Anyone else meets the limit...
    assert statuses("/api/items", 61, "198.51.100.2")[-2:] == [200, 429]
    # ...except signed-in staff, from the same address.
    staff = django_user_model.objects.create_user("sam", is_staff=True)
    client.force_login(staff)
    assert set(statuses("/api/items", 3, "198.51.100.2")) == {200}


# -- tiers: a plan per API key ----------------------------------------------------------------
def test_tiers_a_plan_per_api_key(recipe: Any, mount: Any) -> None:
    modules = recipe("Tiers: a plan per API key")
    customers = modules["myproject.plans"].CUSTOMERS
    mount([path("api/items", ok)])
    client = Client()

    def get(key: str | None) -> Any:
        headers = {"HTTP_X_API_KEY": key} if key else {}
        return client.get("/api/items", **headers)

    assert [get("key-acme").status_code for _ in range(101)][-2:] == [200, 429]
    premium = outcome(get("key-globex").wsgi_request, "api")
    assert (premium.limit, premium.remaining) == (10000, 9999)
    # Acme upgrades: the day's 100 calls stay counted, against the premium limit.
    customers["key-acme"] = "premium"
    upgraded = get("key-acme")
    assert upgraded.status_code == 200
    found = outcome(upgraded.wsgi_request, "api")
    assert (found.limit, found.remaining) == (10000, 9899)
    # No key, or one nobody issued: api does not apply; per-address counts the call.
    for key in (None, "key-made-up"):
        anonymous = get(key)
        assert anonymous.status_code == 200
        skipped = outcome(anonymous.wsgi_request, "api")
        assert (skipped.decision, skipped.reason) == ("skipped", "selector_identity_missing")
    # Every call came from the test client's one address; the 101st, refused by api, was
    # charged to neither policy (a layer is decided all or nothing).
    assert django_quota.peek("per-address", {"ip": "127.0.0.1"}).remaining == 1000 - 104


# -- billable-only charging -------------------------------------------------------------------
def answer(request: HttpRequest) -> HttpResponse:
    if request.GET.get("raise"):
        raise RuntimeError("the view failed")
    return HttpResponse("answer", status=int(request.GET.get("status", "200")))


def test_billable_only_charging(recipe: Any, mount: Any) -> None:
    recipe("Billable-only charging")
    mount([path("api/items", answer)])
    client = Client(raise_request_exception=False, HTTP_X_API_KEY="key-acme")
    statuses = [
        client.get("/api/items", {"status": status}).status_code
        for status in ("200", "201", "400", "404", "500")
    ]
    assert statuses == [200, 201, 400, 404, 500]
    assert client.get("/api/items", {"raise": "1"}).status_code == 500
    (outcome,) = django_quota.outcomes(client.get("/api/items").wsgi_request)
    # Three successes charged (this one included); the failures cost nothing.
    assert (outcome.limit, outcome.remaining) == (1000, 997)
    assert django_quota.peek("billable", {"api_key": "acme"}).remaining == 997


# -- POST-only limits with DRF ----------------------------------------------------------------
def test_post_only_limits_with_drf(
    recipe: Any, mount: Any, settings: Any, django_user_model: Any
) -> None:
    from rest_framework.response import Response
    from rest_framework.test import APIClient
    from rest_framework.views import APIView

    modules = recipe("POST-only limits with DRF")
    throttle = modules["myproject.throttles"].WriteThrottle
    assert settings.REST_FRAMEWORK["DEFAULT_THROTTLE_CLASSES"] == [
        f"{throttle.__module__}.{throttle.__name__}"
    ]

    class Orders(APIView):
        # APIView read DEFAULT_THROTTLE_CLASSES when DRF was imported, before this test
        # set it; a project's settings are read before its views exist.
        throttle_classes = [throttle]

        def get(self, request: Any) -> Response:
            return Response({"orders": []})

        def post(self, request: Any) -> Response:
            return Response({"created": True}, status=201)

    mount([path("api/orders", Orders.as_view())])
    client = APIClient()
    client.force_authenticate(django_user_model.objects.create_user("olga"))
    assert {client.get("/api/orders").status_code for _ in range(15)} == {200}
    posts = [client.post("/api/orders").status_code for _ in range(11)]
    assert posts == [201] * 10 + [429]
    refused = client.post("/api/orders")
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    # Reads still pass with the writes spent.
    assert client.get("/api/orders").status_code == 200


# -- daily plus monthly quotas ----------------------------------------------------------------
def test_daily_plus_monthly_quotas(recipe: Any, mount: Any) -> None:
    from datetime import datetime, timedelta
    from zoneinfo import ZoneInfo

    from tests.test_middleware import FROZEN_NOW

    recipe("Daily plus monthly quotas")
    mount([path("api/items", ok)])
    response = Client().get("/api/items", REMOTE_ADDR="203.0.113.20")
    assert response.status_code == 200
    found = outcome(response.wsgi_request, "api")
    daily, monthly = found.windows
    assert (daily.name, daily.limit, daily.remaining) == ("daily", 1000, 999)
    assert (monthly.name, monthly.limit, monthly.remaining) == ("monthly", 20000, 19999)
    berlin = ZoneInfo("Europe/Berlin")
    now = datetime.fromtimestamp(FROZEN_NOW, berlin)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), berlin)
    first = (now.replace(day=28) + timedelta(days=4)).replace(day=1)
    month_end = datetime.combine(first.date(), datetime.min.time(), berlin)
    assert daily.reset_after == pytest.approx(midnight.timestamp() - FROZEN_NOW, abs=0.001)
    assert monthly.reset_after == pytest.approx(month_end.timestamp() - FROZEN_NOW, abs=0.001)


# -- a usage endpoint -------------------------------------------------------------------------
def test_a_usage_endpoint(recipe: Any, mount: Any, quota: Any, settings: Any) -> None:
    modules = recipe("A usage endpoint")
    mount([*modules["myproject.urls"].urlpatterns, path("api/items", ok)])
    settings.REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_CLASSES": ["django_quota.throttling.AnonRateThrottle"],
        "DEFAULT_THROTTLE_RATES": {"anon": "1/min"},
    }
    quota(CLOCK=CLOCK, POLICIES={"api": {"windows": "3/m", "selector": ["ip"], "routes": ["/api"]}})
    client = Client()
    address = {"REMOTE_ADDR": "203.0.113.9"}
    assert client.get("/api/items", **address).status_code == 200
    for url in ("/rate_limit", "/api/rate_limit") * 3:
        response = client.get(url, **address)
        assert response.status_code == 200
        (entry,) = json.loads(response.content)["policies"]
        assert (entry["policy"], entry["limit"], entry["remaining"]) == ("api", 3, 2)
    assert django_quota.peek("api", {"ip": "203.0.113.9"}).remaining == 2


# -- login protection -------------------------------------------------------------------------
login_urls = [
    path("login/", LoginView.as_view(template_name="admin/login.html")),
    path("admin/", admin.site.urls),
    path("home/", ok),
]


def test_login_protection(
    recipe: Any, mount: Any, settings: Any, django_user_model: Any
) -> None:
    recipe("Login protection")
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.LOGIN_REDIRECT_URL = "/home/"
    mount(login_urls)
    # A username with capitals: login policies count it case-folded ("fiona").
    django_user_model.objects.create_user("Fiona", password="s3cret-pass")
    client = Client()

    def login(password: str) -> Any:
        return client.post(
            "/login/", {"username": "Fiona", "password": password}, REMOTE_ADDR="203.0.113.7"
        )

    # Two failures, then a success: the reset-on-success receiver forgets them.
    assert [login("wrong").status_code for _ in range(2)] == [200, 200]
    assert login("s3cret-pass").status_code == 302
    assert django_quota.peek("login-user", {"user": "fiona"}).remaining == 5
    client.logout()
    # Five failures, then the sixth attempt (the right password) is refused.
    assert [login("wrong").status_code for _ in range(5)] == [200] * 5
    refused = login("s3cret-pass")
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) >= 1
    assert "_auth_user_id" not in client.session



@pytest.mark.parametrize("title", [title for title in RECIPES if title != "A usage endpoint"])
def test_each_recipes_settings_pass_the_checks(recipe: Any, title: str) -> None:
    """The page calls each recipe a complete configuration to copy: ``manage.py check``
    finds nothing in it (the tiers and billable recipes once drew W004)."""
    from django.core import checks

    recipe(title)
    found = [
        message
        for message in checks.run_checks(include_deployment_checks=False)
        # Not the recipe's: W005 names the frozen CLOCK this module adds for its requests,
        # W001 the memory backend (the recipes leave REDIS_URL to the project's settings).
        if message.id
        and message.id.startswith("django_quota.")
        and message.id not in ("django_quota.W001", "django_quota.W005")
    ]
    assert found == []
