"""A project's callable that raises never answers 500 and never lifts a limit
(docs/settings.md#when-a-projects-callable-fails): ``API_KEY_RESOLVER`` and
``TENANT_RESOLVER`` give an invalid identity, at every edge (the middleware, sync and
async, ``@quota`` sync and async, ``QuotaThrottle``, a DRF drop-in throttle whose policy
is configured, the django-ratelimit drop-in, the usage view, the login backend); the
drop-in's key and rate callables, a ``cost`` callable and ``DENIED_VIEW`` fall back as
that page says; each failure is logged with its traceback, naming the setting and the
policy."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import AnonymousUser
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

import django_quota
from django_quota.auth import BACKEND_PATH
from django_quota.decorators import quota
from django_quota.ratelimit.core import ais_ratelimited, get_usage, is_ratelimited
from django_quota.ratelimit.decorators import ratelimit
from django_quota.ratelimit.exceptions import Ratelimited
from django_quota.throttling import QuotaThrottle
from django_quota.views import usage
from tests.test_exemptions import urlpatterns as edges  # /mw/, /dec/, /adec/, /drf/, /anon/

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

IP = "198.51.100.31"
HERE = "tests.test_resolver_failures"


class KeyServiceDown(Exception):
    """What a project's resolver raises when the service it asks is down."""


def broken(request: Any) -> Any:
    """A resolver (and ``EXEMPT_WHEN``-style callable) with a failure in it."""
    raise KeyServiceDown("the key service is down")


def tenant_of(request: Any) -> str | None:
    return request.META.get("HTTP_X_TENANT")


BROKEN = f"{HERE}.broken"


def costly(request: Any) -> int:
    raise ValueError("the batch does not parse")


def bad_cost(request: Any) -> Any:
    return "three"


@quota("dec", cost=costly)
def decorated_costly(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota("dec", cost=bad_cost)
def decorated_bad_cost(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


async def acostly(request: Any) -> int:
    raise ValueError("the batch does not parse")


@quota("dec", cost=acostly)
async def adecorated_costly(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


class CostlyThrottle(QuotaThrottle):
    def get_quota_cost(self, request: Any, view: Any) -> int:
        raise ValueError("the batch does not parse")


class CostlyView(APIView):
    throttle_classes = [CostlyThrottle]
    quota_policies = ["drf-api"]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


urlpatterns = [
    *edges,
    path("usage/", usage),
    path("login/", LoginView.as_view(template_name="admin/login.html")),
    path("costly/", decorated_costly),
    path("bad-cost/", decorated_bad_cost),
    path("acostly/", adecorated_costly),
    path("drf-costly/", CostlyView.as_view()),
]

#: Each edge's policy, by the route it limits.
POLICY_OF = {
    "/mw/": "mw", "/dec/": "dec", "/adec/": "dec", "/drf/": "drf-api", "/anon/": "drf:anon"
}


def policies(selector: list[str], **extra: Any) -> dict[str, Any]:
    # on_missing "skip": a resolver that fails must not skip the policy (nor lift it).
    one = {"windows": "2/m", "selector": selector, "on_missing": "skip", **extra}
    return {
        "mw": {**one, "routes": ["/mw"]},
        "dec": one,
        "drf-api": one,
        "drf:anon": one,  # configured under the drop-in's id: it replaces the rate
        "ratelimit:g": one,  # the same for the django-ratelimit drop-in's group "g"
    }


SELECTORS = [
    ("API_KEY_RESOLVER", ["api_key"]),
    ("API_KEY_RESOLVER", ["auto"]),
    ("TENANT_RESOLVER", ["tenant"]),
    ("TENANT_RESOLVER", ["tenant", "ip"]),
]


@pytest.fixture(autouse=True)
def drf_rates(settings: Any) -> None:
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "100/min"}}


def failures(caplog: pytest.LogCaptureFixture, setting: str) -> list[logging.LogRecord]:
    return [
        record
        for record in caplog.records
        if record.name == "django_quota" and record.getMessage().startswith(f"{setting} ")
    ]


def assert_logged(caplog: pytest.LogCaptureFixture, setting: str, policy_id: str) -> None:
    found = failures(caplog, setting)
    assert found, f"the failure of {setting} was not logged"
    message = found[0].getMessage()
    assert message == (
        f"{setting} {BROKEN} raised (policy {policy_id}): the request's identity is "
        "invalid (selector_identity_invalid)"
    ), message
    assert found[0].exc_info is not None and isinstance(found[0].exc_info[1], KeyServiceDown)
    assert found[0].levelno == logging.ERROR


def invalid(outcomes: list[Any]) -> list[tuple[str, str | None]]:
    return [(o.decision, o.reason) for o in outcomes]


@pytest.mark.parametrize(("setting", "selector"), SELECTORS)
@pytest.mark.parametrize("route", ["/mw/", "/dec/", "/drf/", "/anon/"])
def test_a_resolver_that_raises_is_an_invalid_identity_never_a_500(
    quota: Any, caplog: pytest.LogCaptureFixture, setting: str, selector: list[str], route: str
) -> None:
    quota(**{setting: BROKEN}, POLICIES=policies(selector))
    response = Client().get(route, REMOTE_ADDR=IP)
    assert response.status_code == 429
    assert invalid(django_quota.outcomes(response.wsgi_request)) == [
        ("denied", "selector_identity_invalid")
    ]
    assert "Retry-After" not in response
    assert_logged(caplog, setting, POLICY_OF[route])


@pytest.mark.parametrize(("setting", "selector"), SELECTORS)
@pytest.mark.parametrize("route", ["/mw/", "/adec/"])
def test_a_resolver_that_raises_on_the_async_path(
    quota: Any, caplog: pytest.LogCaptureFixture, setting: str, selector: list[str], route: str
) -> None:
    quota(**{setting: BROKEN}, POLICIES=policies(selector))

    async def run() -> Any:
        return await AsyncClient().get(route)

    response = async_to_sync(run)()
    assert response.status_code == 429
    assert invalid(django_quota.outcomes(response.asgi_request)) == [
        ("denied", "selector_identity_invalid")
    ]
    assert_logged(caplog, setting, POLICY_OF[route])


def test_in_shadow_mode_a_resolver_that_raises_is_only_counted(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(TENANT_RESOLVER=BROKEN, POLICIES=policies(["tenant"], enforcement="shadow"))
    response = Client().get("/mw/")
    assert response.status_code == 200
    assert invalid(django_quota.outcomes(response.wsgi_request)) == [
        ("shadow_denied", "selector_identity_invalid")
    ]
    assert_logged(caplog, "TENANT_RESOLVER", "mw")


def test_other_policies_of_the_request_still_count(quota: Any) -> None:
    quota(
        TENANT_RESOLVER=BROKEN,
        POLICIES={
            "per-ip": {"windows": "5/m", "selector": ["ip"], "routes": ["/mw"]},
            "per-tenant": {
                "windows": "5/m",
                "selector": ["tenant"],
                "routes": ["/mw"],
                "enforcement": "shadow",
            },
        },
    )
    response = Client().get("/mw/", REMOTE_ADDR=IP)
    assert response.status_code == 200
    assert invalid(django_quota.outcomes(response.wsgi_request)) == [
        ("allowed", None),
        ("shadow_denied", "selector_identity_invalid"),
    ]
    assert django_quota.peek("per-ip", {"ip": IP}).remaining == 4


def test_the_resolver_is_called_once_per_request_and_logged_once(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(
        TENANT_RESOLVER=BROKEN,
        POLICIES={
            "a": {"windows": "5/m", "selector": ["tenant"], "routes": ["/mw"]},
            "b": {"windows": "5/m", "selector": ["tenant", "ip"], "routes": ["/mw"]},
        },
    )
    assert Client().get("/mw/").status_code == 429
    assert len(failures(caplog, "TENANT_RESOLVER")) == 1


@pytest.mark.parametrize(("setting", "selector"), SELECTORS)
def test_the_ratelimit_drop_in_with_a_configured_policy(
    quota: Any, caplog: pytest.LogCaptureFixture, setting: str, selector: list[str]
) -> None:
    quota(**{setting: BROKEN}, POLICIES=policies(selector))

    def request() -> Any:
        made = RequestFactory().get("/", REMOTE_ADDR=IP)
        made.user = AnonymousUser()
        return made

    assert is_ratelimited(request(), group="g", key="ip", rate="5/m", increment=True)
    assert async_to_sync(ais_ratelimited)(
        request(), group="g", key="ip", rate="5/m", increment=True
    )
    peeked = get_usage(request(), group="g", key="ip", rate="5/m")
    assert peeked is not None and peeked["should_limit"]
    assert_logged(caplog, setting, "ratelimit:g")


def test_the_usage_view_leaves_out_the_policies_it_cannot_identify(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(
        API_KEY_RESOLVER=BROKEN,
        POLICIES={
            "per-ip": {"windows": "5/m", "selector": ["ip"]},
            "per-key": {"windows": "5/m", "selector": ["api_key"]},
        },
    )
    response = Client().get("/usage/", REMOTE_ADDR=IP)
    assert response.status_code == 200
    assert [entry["policy"] for entry in json.loads(response.content)["policies"]] == ["per-ip"]
    assert_logged(caplog, "API_KEY_RESOLVER", "per-key")


def test_the_login_backend_never_calls_the_resolvers(
    quota: Any, settings: Any, django_user_model: Any
) -> None:
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "django.contrib.auth.backends.ModelBackend"]
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    quota(
        API_KEY_RESOLVER=BROKEN,
        TENANT_RESOLVER=BROKEN,
        EXEMPT_WHEN=BROKEN,
        PLAN_RESOLVER=BROKEN,
        LOGIN_POLICIES=["login-user"],
        POLICIES={"login-user": {"windows": "5/15m", "selector": ["user"]}},
    )
    django_user_model.objects.create_user("fiona", password="pw-0123456789")
    client = Client()
    response = client.post("/login/", {"username": "fiona", "password": "pw-0123456789"})
    assert response.status_code == 302
    assert "_auth_user_id" in client.session


# -- the django-ratelimit drop-in's own callables ------------------------------------------
def key_raising(group: str, request: Any) -> str:
    raise KeyServiceDown("the key service is down")


def rate_raising(group: str, request: Any) -> str:
    raise KeyServiceDown("the plan service is down")


def meta_key_raising(request: Any) -> str:
    raise KeyServiceDown("the edge header is gone")


def anonymous(**extra: Any) -> Any:
    made = RequestFactory().get("/", REMOTE_ADDR=IP, **extra)
    made.user = AnonymousUser()
    return made


def ratelimit_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "django_quota" and r.exc_info]


@pytest.mark.parametrize("key", [key_raising, f"{HERE}.key_raising"])
def test_a_ratelimit_key_that_raises_limits_the_request(
    quota: Any, caplog: pytest.LogCaptureFixture, key: Any
) -> None:
    quota()
    assert is_ratelimited(anonymous(), group="k", key=key, rate="5/m", increment=True)
    assert async_to_sync(ais_ratelimited)(anonymous(), group="k", key=key, rate="5/m")
    logged = ratelimit_failures(caplog)
    assert logged and isinstance(logged[0].exc_info[1], KeyServiceDown)  # type: ignore[index]
    assert logged[0].getMessage() == (
        f"ratelimit key {HERE}.key_raising of group 'k' raised: the request's identity "
        "is invalid (selector_identity_invalid)"
    )


def test_a_ratelimit_ip_meta_key_that_raises_limits_the_request(
    quota: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota()
    settings.RATELIMIT_IP_META_KEY = f"{HERE}.meta_key_raising"
    assert is_ratelimited(anonymous(), group="m", key="ip", rate="5/m", increment=True)
    logged = ratelimit_failures(caplog)
    assert logged and logged[0].getMessage().startswith(
        f"RATELIMIT_IP_META_KEY {HERE}.meta_key_raising raised"
    )


@pytest.mark.parametrize("fail_open", [False, True])
@pytest.mark.parametrize("rate", [rate_raising, f"{HERE}.rate_raising"])
def test_a_ratelimit_rate_that_raises_applies_the_failure_mode(
    quota: Any, settings: Any, caplog: pytest.LogCaptureFixture, fail_open: bool, rate: Any
) -> None:
    quota()
    settings.RATELIMIT_FAIL_OPEN = fail_open
    request = anonymous()
    limited = is_ratelimited(request, group="r", key="ip", rate=rate, increment=True)
    assert limited is not fail_open
    assert invalid(django_quota.outcomes(request)) == [
        ("failed_open" if fail_open else "failed_closed", "policy_unknown")
    ]
    peeked = get_usage(anonymous(), group="r", key="ip", rate=rate)
    if fail_open:
        assert peeked is None
    else:
        assert peeked == {"count": 0, "limit": 0, "should_limit": True, "time_left": -1}
    assert async_to_sync(ais_ratelimited)(
        anonymous(), group="r", key="ip", rate=rate, increment=True
    ) is not fail_open
    logged = ratelimit_failures(caplog)
    assert logged and isinstance(logged[0].exc_info[1], KeyServiceDown)  # type: ignore[index]
    assert logged[0].getMessage() == (
        f"ratelimit rate {HERE}.rate_raising of group 'r' raised: the group's failure mode "
        f"({'open' if fail_open else 'closed'}) applies with reason policy_unknown"
    )


def test_the_ratelimit_decorator_with_a_key_that_raises_blocks(quota: Any) -> None:
    quota()

    @ratelimit(key=key_raising, rate="5/m", block=True)
    def view(request: Any) -> HttpResponse:
        return HttpResponse("ok")

    with pytest.raises(Ratelimited):
        view(anonymous())


# -- a cost callable ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("route", "logged"),
    [
        ("/costly/", f"the cost callable {HERE}.costly of policy dec raised: the request costs 1"),
        (
            "/bad-cost/",
            f"the cost callable {HERE}.bad_cost of policy dec returned a str, not an int >= 0: "
            "the request costs 1",
        ),
        (
            "/drf-costly/",
            f"the cost callable {HERE}.CostlyThrottle.get_quota_cost of policy drf-api "
            "raised: the request costs 1",
        ),
    ],
)
def test_a_cost_callable_that_fails_charges_one(
    quota: Any, caplog: pytest.LogCaptureFixture, route: str, logged: str
) -> None:
    quota(POLICIES=policies(["ip"]))
    client = Client()
    assert [client.get(route, REMOTE_ADDR=IP).status_code for _ in range(3)] == [200, 200, 429]
    messages = [r.getMessage() for r in caplog.records if r.name == "django_quota"]
    assert logged in messages, messages


def test_an_async_cost_callable_that_raises_charges_one(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(POLICIES=policies(["ip"]))

    async def run() -> list[int]:
        client = AsyncClient()
        return [(await client.get("/acostly/")).status_code for _ in range(3)]

    assert async_to_sync(run)() == [200, 200, 429]
    assert any(
        r.getMessage().startswith(f"the cost callable {HERE}.acostly of policy dec raised")
        for r in caplog.records
    )


# -- DENIED_VIEW -----------------------------------------------------------------------------
def denied_view_raising(request: Any, outcome: Any) -> HttpResponse:
    raise KeyServiceDown("the template is gone")


@pytest.mark.parametrize("route", ["/mw/", "/dec/"])
def test_a_denied_view_that_raises_gives_the_default_refusal(
    quota: Any, caplog: pytest.LogCaptureFixture, route: str
) -> None:
    quota(DENIED_VIEW=f"{HERE}.denied_view_raising", POLICIES=policies(["ip"]))
    client = Client()
    responses = [client.get(route, REMOTE_ADDR=IP) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 429]
    refused = responses[-1]
    assert refused["Content-Type"] == "application/problem+json"
    assert json.loads(refused.content)["reason"] == "default_quota_exhausted"
    assert "Retry-After" in refused
    logged = [r for r in caplog.records if r.name == "django_quota" and r.exc_info]
    assert logged[0].getMessage() == (
        f"DENIED_VIEW {HERE}.denied_view_raising raised: the default refusal is sent"
    )
