"""DRF's ``NUM_PROXIES`` through the drop-in throttles (docs/subjects.md, docs/drf.md).

When neither ``QUOTA["TRUSTED_PROXIES"]`` nor ``QUOTA["PROXY_COUNT"]`` is set, the
drop-ins pick the ``X-Forwarded-For`` entry that DRF's own ``BaseThrottle.get_ident()``
picks for the same request, then normalise it as every client IP in django-quota (ports
and brackets stripped, IPv6 grouped by ``IPV6_PREFIX``)."""

from __future__ import annotations

from typing import Any

import pytest
import rest_framework.throttling as drf_throttling
from django.contrib.auth.models import AnonymousUser
from rest_framework.request import Request
from rest_framework.test import APIClient, APIRequestFactory

import django_quota
from django_quota.checks import check_settings
from django_quota.core.identity import client_ip
from django_quota.throttling import AnonRateThrottle, ScopedRateThrottle, UserRateThrottle

pytestmark = [pytest.mark.urls("tests.test_throttling"), pytest.mark.django_db]

CLOCK = "tests.test_throttling.frozen_clock"
LOAD_BALANCER = "192.0.2.1"

#: (NUM_PROXIES, X-Forwarded-For as the app receives it, the client django-quota keys on)
SHAPES = [
    (1, None, LOAD_BALANCER),
    (1, "198.51.100.7", "198.51.100.7"),
    (1, "198.51.100.7, 10.0.0.1", "10.0.0.1"),
    (1, "203.0.113.9,198.51.100.7,10.0.0.1", "10.0.0.1"),
    (1, "  198.51.100.7 ,  10.0.0.2  ", "10.0.0.2"),
    (1, "198.51.100.7:4711", "198.51.100.7"),
    (1, "10.0.0.1, 2001:db8::1", "2001:db8::/64"),
    (2, None, LOAD_BALANCER),
    (2, "198.51.100.7", "198.51.100.7"),
    (2, "198.51.100.7, 10.0.0.1", "198.51.100.7"),
    (2, "203.0.113.9,198.51.100.7,10.0.0.1", "198.51.100.7"),
    (2, "203.0.113.9, 198.51.100.7, 10.0.0.2, 10.0.0.1", "10.0.0.2"),
    (2, "[2001:db8::1]:443, 10.0.0.1", "2001:db8::/64"),
    (0, "198.51.100.7, 10.0.0.1", LOAD_BALANCER),
]
DROP_INS = [AnonRateThrottle, UserRateThrottle, ScopedRateThrottle]


def anonymous(forwarded_for: str | None) -> Request:
    extra: dict[str, str] = {"REMOTE_ADDR": LOAD_BALANCER}
    if forwarded_for is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded_for
    request = Request(APIRequestFactory().get("/drf/anon/", **extra))
    request.user = AnonymousUser()
    return request


def normalised(address: str) -> str:
    """An address as django-quota keys on it (ports stripped, IPv6 as its /64)."""
    return client_ip(address, None, trusted_proxies=(), proxy_count=None, ipv6_prefix=64)


@pytest.fixture
def rates(settings: Any) -> Any:
    def apply(num_proxies: int | None, **rates: str) -> None:
        settings.REST_FRAMEWORK = {"NUM_PROXIES": num_proxies, "DEFAULT_THROTTLE_RATES": rates}

    return apply


@pytest.mark.parametrize("throttle_class", DROP_INS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(("num_proxies", "forwarded_for", "client"), SHAPES)
def test_drop_in_get_ident_picks_drfs_entry(
    quota: Any,
    rates: Any,
    throttle_class: type[Any],
    num_proxies: int,
    forwarded_for: str | None,
    client: str,
) -> None:
    quota(CLOCK=CLOCK)
    rates(num_proxies, anon="5/min", user="5/min")
    request = anonymous(forwarded_for)
    drf_choice = drf_throttling.BaseThrottle().get_ident(request)
    assert normalised(drf_choice) == client
    assert throttle_class().get_ident(request) == client


@pytest.mark.parametrize(("num_proxies", "forwarded_for", "client"), SHAPES)
def test_anon_drop_in_charges_the_client_drf_would_throttle(
    quota: Any, rates: Any, num_proxies: int, forwarded_for: str | None, client: str
) -> None:
    quota(CLOCK=CLOCK)
    rates(num_proxies, anon="2/min")
    extra = {"REMOTE_ADDR": LOAD_BALANCER}
    if forwarded_for is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded_for
    assert APIClient().get("/drf/anon/", **extra).status_code == 200
    assert django_quota.peek("drf:anon", {"ip": client}).remaining == 1
    assert django_quota.peek("drf:anon", {"ip": "198.51.100.99"}).remaining == 2


@pytest.mark.parametrize("num_proxies", [1, 2])
def test_clients_behind_the_proxies_get_their_own_budgets(
    quota: Any, rates: Any, num_proxies: int
) -> None:
    quota(CLOCK=CLOCK)
    rates(num_proxies, user="1/min", x="1/min")
    proxies = ", ".join(["10.0.0.1"] * (num_proxies - 1))
    client = APIClient()
    for url in ("/drf/user/", "/drf/x/"):
        for address in ("198.51.100.1", "198.51.100.2"):
            chain = f"{address}, {proxies}" if proxies else address
            assert client.get(url, HTTP_X_FORWARDED_FOR=chain).status_code == 200
        chain = f"198.51.100.1, {proxies}" if proxies else "198.51.100.1"
        assert client.get(url, HTTP_X_FORWARDED_FOR=chain).status_code == 429


@pytest.mark.parametrize(
    "values", [{"PROXY_COUNT": 0}, {"TRUSTED_PROXIES": ["10.0.0.0/8"]}], ids=["count", "cidrs"]
)
def test_quota_proxy_settings_win_over_num_proxies(
    quota: Any, rates: Any, values: dict[str, Any]
) -> None:
    quota(CLOCK=CLOCK, **values)
    rates(1, anon="5/min")
    request = anonymous("198.51.100.7, 203.0.113.5")
    # PROXY_COUNT 0: REMOTE_ADDR; TRUSTED_PROXIES: REMOTE_ADDR is not trusted, so also it.
    assert AnonRateThrottle().get_ident(request) == LOAD_BALANCER


def test_middleware_does_not_read_num_proxies(quota: Any, rates: Any, settings: Any) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={"site": {"windows": "1/min", "selector": ["ip"], "routes": ["/drf/none/"]}},
    )
    rates(1)
    client = APIClient()
    assert client.get("/drf/none/", HTTP_X_FORWARDED_FOR="198.51.100.1").status_code == 200
    # The middleware keys on REMOTE_ADDR (127.0.0.1): a second client shares that budget.
    assert client.get("/drf/none/", HTTP_X_FORWARDED_FOR="198.51.100.2").status_code == 429


def test_w003_says_which_layers_ignore_num_proxies(quota: Any, settings: Any) -> None:
    settings.DEBUG = True
    quota()
    settings.REST_FRAMEWORK = {"NUM_PROXIES": 1}
    (message,) = [m for m in check_settings() if m.id == "django_quota.W003"]
    assert message.msg == (
        "REST_FRAMEWORK['NUM_PROXIES'] is set but QUOTA['TRUSTED_PROXIES'] and "
        "QUOTA['PROXY_COUNT'] are not: the drop-in DRF throttles follow NUM_PROXIES, but "
        "the middleware, @quota and QuotaThrottle key on REMOTE_ADDR, the proxy's address"
    )
    assert message.hint == (
        "set QUOTA['PROXY_COUNT'] to the same number, or list TRUSTED_PROXIES, so that "
        "every layer sees the same client"
    )
