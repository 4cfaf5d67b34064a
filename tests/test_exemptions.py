"""Exemptions (docs/policies.md#exemptions): a policy's ``exempt`` networks and
``QUOTA["EXEMPT_WHEN"]`` at every edge (the middleware, sync and async, ``@quota``, the
DRF throttles, the django-ratelimit drop-in): decision ``skipped``, reason ``exempt``,
nothing charged, counted in the metrics; bad entries are check errors."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import AnonymousUser
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

import django_quota
from django_quota import metrics
from django_quota.checks import check_settings
from django_quota.decorators import quota
from django_quota.ratelimit.core import get_usage, is_ratelimited
from django_quota.throttling import AnonRateThrottle, QuotaThrottle

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

PROXY = "10.9.0.1"
TRUSTED = ["10.9.0.0/16", "fd00:9::/32"]
OFFICE = "192.0.2.0/24"
#: One address of a /64 that holds other, not exempt, addresses.
PROBE6 = "2001:db8:2:3::1/128"
EXEMPT_NETWORKS = [OFFICE, "2001:db8:1::/48", PROBE6]


def ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota("dec")
def decorated(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota("dec")
async def adecorated(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


class ThrottledView(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["drf-api"]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


class AnonView(APIView):
    throttle_classes = [AnonRateThrottle]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


urlpatterns = [
    path("mw/", ok),
    path("dec/", decorated),
    path("adec/", adecorated),
    path("drf/", ThrottledView.as_view()),
    path("anon/", AnonView.as_view()),
    path("health/", ok),
]


def internal(request: Any) -> bool:
    """The tests' ``EXEMPT_WHEN``: the health check and requests saying they are internal."""
    return request.path.startswith("/health") or request.META.get("HTTP_X_INTERNAL") == "yes"


def policy(**extra: Any) -> dict[str, Any]:
    return {"algorithm": "fixed_window", "windows": "1/m", "selector": ["ip"], **extra}


def configure(quota_fixture: Any, **values: Any) -> None:
    quota_fixture(
        TRUSTED_PROXIES=TRUSTED,
        POLICIES={
            "api": policy(routes=["/mw", "/health"], exempt=EXEMPT_NETWORKS),
            "dec": policy(exempt=EXEMPT_NETWORKS),
            "drf-api": policy(exempt=EXEMPT_NETWORKS),
        },
        **values,
    )


def via_proxy(client_address: str) -> dict[str, str]:
    return {"REMOTE_ADDR": PROXY, "HTTP_X_FORWARDED_FOR": f"203.0.113.250, {client_address}"}


def decisions(response: Any) -> list[tuple[str, str, str | None]]:
    return [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(response.wsgi_request)]


def statuses(path_: str, count: int, **extra: Any) -> list[int]:
    client = Client()
    return [client.get(path_, **extra).status_code for _ in range(count)]


# -- policy networks, behind trusted proxies ------------------------------------------------
@pytest.mark.parametrize(
    "address", ["192.0.2.7", "2001:db8:1:5::9", "2001:db8:2:3::1", "::ffff:192.0.2.8"]
)
@pytest.mark.parametrize("route", ["/mw/", "/dec/", "/drf/"])
def test_clients_in_exempt_networks_skip_the_policy(
    quota: Any, address: str, route: str
) -> None:
    configure(quota)
    client = Client()
    responses = [client.get(route, **via_proxy(address)) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    policy_id = {"/mw/": "api", "/dec/": "dec", "/drf/": "drf-api"}[route]
    assert decisions(responses[-1]) == [(policy_id, "skipped", "exempt")]
    assert "RateLimit" not in responses[-1]
    outcome = django_quota.outcomes(responses[-1].wsgi_request)[0]
    assert (outcome.window, outcome.limit, outcome.remaining, outcome.windows) == (
        None, None, None, ()
    )
    # Nothing was charged: the client's counter is untouched.
    assert django_quota.peek(policy_id, {"ip": address}).remaining == 1


@pytest.mark.parametrize(
    "address",
    [
        "198.51.100.7",  # outside every network
        "2001:db8:2:3::2",  # same /64 as the exempt /128: the whole address decides
        "2001:db8:2::1",
    ],
)
@pytest.mark.parametrize("route", ["/mw/", "/dec/", "/drf/"])
def test_other_clients_are_limited(quota: Any, address: str, route: str) -> None:
    configure(quota)
    assert statuses(route, 2, **via_proxy(address)) == [200, 429]


def test_a_forwarded_address_from_an_untrusted_peer_is_not_believed(quota: Any) -> None:
    configure(quota)
    spoofed = {"REMOTE_ADDR": "198.51.100.9", "HTTP_X_FORWARDED_FOR": "192.0.2.7"}
    assert statuses("/mw/", 2, **spoofed) == [200, 429]


def test_the_direct_peer_address_counts_without_proxies(quota: Any) -> None:
    quota(POLICIES={"api": policy(routes=["/mw"], exempt=[OFFICE])})
    assert statuses("/mw/", 3, REMOTE_ADDR="192.0.2.200") == [200, 200, 200]
    assert statuses("/mw/", 2, REMOTE_ADDR="192.0.3.1") == [200, 429]


def test_proxy_count_finds_the_same_client(quota: Any) -> None:
    quota(PROXY_COUNT=1, POLICIES={"api": policy(routes=["/mw"], exempt=[OFFICE])})
    assert statuses("/mw/", 3, **via_proxy("192.0.2.7")) == [200, 200, 200]


def test_exemptions_are_counted_in_the_metrics(quota: Any) -> None:
    configure(quota)
    before = metrics.outcome_counts().get(("api", "skipped", "exempt"), 0)
    statuses("/mw/", 3, **via_proxy("192.0.2.7"))
    assert metrics.outcome_counts()[("api", "skipped", "exempt")] == before + 3


def test_only_the_exempting_policy_is_skipped(quota: Any) -> None:
    quota(
        TRUSTED_PROXIES=TRUSTED,
        POLICIES={
            "api": policy(routes=["/mw"], exempt=[OFFICE]),
            "all": policy(routes=["/mw"], windows="5/m"),
        },
    )
    response = Client().get("/mw/", **via_proxy("192.0.2.7"))
    assert decisions(response) == [("api", "skipped", "exempt"), ("all", "allowed", None)]
    assert response["RateLimit-Policy"] == '"all";q=5;w=60'


def test_async_middleware_skips_exempt_clients(quota: Any) -> None:
    # AsyncClient's peer is the scope's "client", 127.0.0.1: trust it as the proxy.
    configure(quota)
    quota(**{**conf_quota(), "TRUSTED_PROXIES": ["127.0.0.0/8"]})

    async def run() -> list[Any]:
        client = AsyncClient()
        forwarded = {"X-Forwarded-For": "192.0.2.7"}
        return [await client.get("/mw/", headers=forwarded) for _ in range(3)]

    responses = async_to_sync(run)()
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [(o.decision, o.reason) for o in django_quota.outcomes(responses[-1].asgi_request)] == [
        ("skipped", "exempt")
    ]


def conf_quota() -> dict[str, Any]:
    from django.conf import settings

    return dict(settings.QUOTA)


# -- EXEMPT_WHEN -----------------------------------------------------------------------------
WHEN = "tests.test_exemptions.internal"


@pytest.mark.parametrize("route", ["/mw/", "/dec/", "/drf/", "/anon/"])
def test_exempt_when_skips_every_policy_at_every_edge(
    quota: Any, settings: Any, route: str
) -> None:
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "1/min"}}
    configure(quota, EXEMPT_WHEN=WHEN)
    outside = via_proxy("198.51.100.7")
    assert statuses(route, 3, HTTP_X_INTERNAL="yes", **outside) == [200, 200, 200]
    response = Client().get(route, HTTP_X_INTERNAL="yes", **outside)
    assert {(decision, reason) for _, decision, reason in decisions(response)} == {
        ("skipped", "exempt")
    }
    # The same client without the header is limited as ever.
    assert statuses(route, 2, **outside) == [200, 429]


def test_exempt_when_exempts_the_health_check(quota: Any) -> None:
    configure(quota, EXEMPT_WHEN=WHEN)
    assert statuses("/health/", 3, **via_proxy("198.51.100.7")) == [200, 200, 200]


def test_exempt_when_on_the_async_path(quota: Any) -> None:
    configure(quota, EXEMPT_WHEN=WHEN)

    async def run() -> list[int]:
        client = AsyncClient()
        return [(await client.get("/health/")).status_code for _ in range(3)]

    assert async_to_sync(run)() == [200, 200, 200]


def test_exempt_when_with_an_async_decorated_view(quota: Any) -> None:
    configure(quota, EXEMPT_WHEN=WHEN)

    async def run(headers: dict[str, str]) -> list[int]:
        client = AsyncClient()
        return [(await client.get("/adec/", headers=headers)).status_code for _ in range(3)]

    assert async_to_sync(run)({"X-Internal": "yes"}) == [200, 200, 200]
    assert async_to_sync(run)({}) == [200, 429, 429]


def test_exempt_when_in_the_django_ratelimit_drop_in(quota: Any) -> None:
    quota(EXEMPT_WHEN=WHEN)
    factory = RequestFactory()

    def request(**extra: Any) -> Any:
        made = factory.get("/", REMOTE_ADDR="198.51.100.7", **extra)
        made.user = AnonymousUser()
        return made

    for _ in range(3):
        exempt = request(HTTP_X_INTERNAL="yes")
        assert not is_ratelimited(exempt, group="g", key="ip", rate="1/m", increment=True)
        assert decisions_of(exempt) == [("skipped", "exempt")]
    peeked = get_usage(request(HTTP_X_INTERNAL="yes"), group="g", key="ip", rate="1/m")
    assert peeked is not None and not peeked["should_limit"]
    limited = [
        is_ratelimited(request(), group="g", key="ip", rate="1/m", increment=True)
        for _ in range(2)
    ]
    assert limited == [False, True]


def broken(request: Any) -> bool:
    """An ``EXEMPT_WHEN`` with a bug in it."""
    raise LookupError("the allowlist service is down")


BROKEN = "tests.test_exemptions.broken"


def assert_logged_not_exempt(caplog: Any) -> None:
    logged = [r for r in caplog.records if r.name == "django_quota" and r.exc_info]
    assert logged, "the failure of EXEMPT_WHEN was not logged"
    assert logged[0].getMessage() == f"EXEMPT_WHEN {BROKEN} raised: the request is not exempt"
    assert isinstance(logged[0].exc_info[1], LookupError)


@pytest.mark.parametrize("route", ["/mw/", "/dec/", "/drf/", "/anon/"])
def test_an_exempt_when_that_raises_exempts_nobody_and_never_answers_500(
    quota: Any, settings: Any, caplog: Any, route: str
) -> None:
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "1/min"}}
    configure(quota, EXEMPT_WHEN=BROKEN)
    assert statuses(route, 2, **via_proxy("198.51.100.7")) == [200, 429]
    assert_logged_not_exempt(caplog)


@pytest.mark.parametrize("route", ["/mw/", "/adec/"])
def test_an_exempt_when_that_raises_on_the_async_path_exempts_nobody(
    quota: Any, caplog: Any, route: str
) -> None:
    configure(quota, EXEMPT_WHEN=BROKEN)

    async def run() -> list[int]:
        client = AsyncClient()
        return [(await client.get(route)).status_code for _ in range(2)]

    assert async_to_sync(run)() == [200, 429]
    assert_logged_not_exempt(caplog)


def test_an_exempt_when_that_raises_in_the_django_ratelimit_drop_in(
    quota: Any, caplog: Any
) -> None:
    from django_quota.ratelimit.core import ais_ratelimited

    quota(EXEMPT_WHEN=BROKEN)
    request = RequestFactory().get("/", REMOTE_ADDR="198.51.100.7")
    request.user = AnonymousUser()
    assert not is_ratelimited(request, group="g", key="ip", rate="1/m", increment=True)
    assert async_to_sync(ais_ratelimited)(
        request, group="g", key="ip", rate="1/m", increment=True
    )
    assert_logged_not_exempt(caplog)


def decisions_of(request: Any) -> list[tuple[str, str | None]]:
    return [(o.decision, o.reason) for o in django_quota.outcomes(request)]


def errors() -> list[Any]:
    """The settings' errors (this module's views name policies the checks look for)."""
    return [
        message
        for message in check_settings()
        if message.id in ("django_quota.E004", "django_quota.E008")
    ]


# -- checks ----------------------------------------------------------------------------------
def test_an_entry_that_is_not_a_network_is_e004_naming_policy_and_entry(settings: Any) -> None:
    settings.QUOTA = {
        "HMAC_KEY": "tests-hmac-key-0123456789",
        "POLICIES": {"api": policy(exempt=["10.0.0.0/8", "10.0.0.0/33"])},
    }
    (message,) = errors()
    assert message.id == "django_quota.E004"
    assert message.msg.startswith("QUOTA['POLICIES']['api']['exempt'][1]: '10.0.0.0/33'")
    settings.QUOTA = {
        "HMAC_KEY": "tests-hmac-key-0123456789",
        "POLICIES": {"api": policy(exempt="10.0.0.0/8")},
    }
    (message,) = errors()
    assert (message.id, message.msg.split(":")[0]) == (
        "django_quota.E004",
        "QUOTA['POLICIES']['api']['exempt']",
    )
    settings.QUOTA = {
        "HMAC_KEY": "tests-hmac-key-0123456789",
        "POLICIES": {"api": policy(exempt=["10.0.0.0/8", "2001:db8::/32", "192.0.2.1"])},
    }
    assert [message for message in errors() if message.id == "django_quota.E004"] == []


def test_exempt_when_must_import(settings: Any) -> None:
    settings.QUOTA = {"HMAC_KEY": "tests-hmac-key-0123456789", "EXEMPT_WHEN": "tests.nowhere.f"}
    (message,) = errors()
    assert message.id == "django_quota.E008"
    assert message.msg.startswith("QUOTA['EXEMPT_WHEN']")


def test_exempt_networks_do_not_change_the_revision() -> None:
    from django_quota.core.policy import parse_policy

    plain = parse_policy("api", policy())
    exempting = parse_policy("api", policy(exempt=[OFFICE]))
    assert plain.revision == exempting.revision
