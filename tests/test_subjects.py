"""Subjects users can trust, through the HTTP layer and on a real Redis (docs/subjects.md):
the forwarded-chain table through ``request_ip``, the ``auto`` dimension, the API key
sources, ``request.user`` read only when needed, identity errors and ``on_missing``,
spoofed ``X-Forwarded-For``, the HMAC key settings, and a scan of every Redis key, value
and log line for raw identities."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import logging
import random
import socket
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.http import HttpRequest, HttpResponse
from django.test import Client, RequestFactory

import django_quota
from django_quota import conf, ledger, policies, subjects
from django_quota.core.identity import IdentityError, build_identity
from django_quota.metrics import prometheus_client
from django_quota.middleware import QuotaMiddleware
from tests.test_identity import FORWARDED_CHAINS, ForwardedFor, independent_pseudonym

INVALID = "selector_identity_invalid"
MISSING = "selector_identity_missing"
HMAC_KEY = "tests-hmac-key-0123456789"
FROZEN_NOW = 1_700_000_060.4
CLOCK = "tests.test_subjects.frozen_clock"
LIMITED = {"algorithm": "fixed_window", "windows": "3/m", "selector": ["ip"], "routes": ["/api"]}

factory = RequestFactory()


def frozen_clock() -> float:
    return FROZEN_NOW


# -- test resolvers and a header-driven authentication middleware ---------------------------
resolver_calls: list[str] = []
VERIFIED_KEYS = {"sk_live_SECRET123": "key-7", "sk_live_OTHER": "key-8"}


def resolve_api_key(request: HttpRequest) -> str | None:
    """An ``API_KEY_RESOLVER``: the verified key id of a known ``X-Api-Key``, else None."""
    resolver_calls.append(request.path)
    return VERIFIED_KEYS.get(request.META.get("HTTP_X_API_KEY", ""))


def resolve_tenant(request: HttpRequest) -> str | None:
    """A ``TENANT_RESOLVER``: the ``X-Tenant`` header."""
    return request.META.get("HTTP_X_TENANT")


class _User:
    def __init__(self, pk: object) -> None:
        self.pk = pk
        self.is_authenticated = pk is not None


class HeaderUserMiddleware:
    """Authenticates ``X-Test-User: <pk>`` (so a user pk can be a known string)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if "HTTP_X_TEST_USER" in request.META:
            request.user = _User(request.META["HTTP_X_TEST_USER"])  # type: ignore[assignment]
        return self.get_response(request)


def policy(**definition: Any) -> Any:
    from django_quota.core.policy import parse_policy

    return parse_policy("p", {"windows": "5/m", **definition})


def identity_of(subject: dict[str, object], selector: list[str]) -> str | None:
    settings = conf.get_settings()
    found = build_identity(
        selector,
        subject,
        hmac_key=settings.hmac_key,
        hmac_key_version=settings.hmac_key_version,
        ipv6_prefix=settings.ipv6_prefix,
    )
    return found.pseudonym


def chain_request(remote: str, forwarded_for: ForwardedFor, **extra: Any) -> HttpRequest:
    meta: dict[str, Any] = {"REMOTE_ADDR": remote, **extra}
    if forwarded_for is not None:
        # Servers hand several header lines to Django joined with commas.
        meta["HTTP_X_FORWARDED_FOR"] = (
            forwarded_for if isinstance(forwarded_for, str) else ",".join(forwarded_for)
        )
    return factory.get("/api/items/", **meta)


def statuses(client: Client, count: int, path: str = "/api/items/", **extra: Any) -> list[int]:
    return [client.get(path, **extra).status_code for _ in range(count)]


def recorded(response: Any) -> list[tuple[str, str, str | None]]:
    return [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(response.wsgi_request)]


# -- 1. the forwarded-chain table through the HTTP layer -------------------------------------
@pytest.mark.parametrize(
    ("description", "remote", "forwarded_for", "trusted", "proxy_count", "expected"),
    FORWARDED_CHAINS,
    ids=[row[0] for row in FORWARDED_CHAINS],
)
def test_request_ip_agrees_with_the_core_on_every_forwarded_chain(
    quota: Any,
    description: str,
    remote: str,
    forwarded_for: ForwardedFor,
    trusted: list[str],
    proxy_count: int | None,
    expected: str,
) -> None:
    quota(TRUSTED_PROXIES=trusted, PROXY_COUNT=proxy_count)
    request = chain_request(remote, forwarded_for)
    try:
        found = subjects.request_ip(request)
    except IdentityError as exc:
        found = exc.reason
    assert found == expected


@pytest.mark.parametrize(
    ("description", "remote", "forwarded_for", "trusted", "proxy_count", "expected"),
    FORWARDED_CHAINS,
    ids=[row[0] for row in FORWARDED_CHAINS],
)
def test_middleware_subject_gives_the_identity_of_the_table_address(
    quota: Any,
    description: str,
    remote: str,
    forwarded_for: ForwardedFor,
    trusted: list[str],
    proxy_count: int | None,
    expected: str,
) -> None:
    quota(TRUSTED_PROXIES=trusted, PROXY_COUNT=proxy_count)
    subject = subjects.RequestSubject(chain_request(remote, forwarded_for))
    raw = subject.for_policy(policy(selector=["ip"]))
    try:
        found = identity_of(raw, ["ip"])
    except IdentityError as exc:
        assert exc.reason == expected
        return
    # The middleware, the Python API and `quota inspect --ip` meet on one identity.
    assert found == identity_of({"ip": expected}, ["ip"])
    assert found == independent_pseudonym([("ip", expected)], HMAC_KEY.encode())


def test_forwarded_header_of_rfc_7239_is_ignored(quota: Any) -> None:
    quota(TRUSTED_PROXIES=["10.0.0.0/8"])
    request = factory.get(
        "/", REMOTE_ADDR="10.0.0.1", HTTP_FORWARDED="for=198.51.100.7;proto=https"
    )
    assert subjects.request_ip(request) == "10.0.0.1"
    request = factory.get(
        "/",
        REMOTE_ADDR="10.0.0.1",
        HTTP_FORWARDED='for="[2001:db8::1]:443"',
        HTTP_X_FORWARDED_FOR="203.0.113.5",
    )
    assert subjects.request_ip(request) == "203.0.113.5"
    quota(PROXY_COUNT=1)
    assert (
        subjects.request_ip(
            factory.get("/", REMOTE_ADDR="10.0.0.1", HTTP_FORWARDED="for=198.51.100.7")
        )
        == "10.0.0.1"
    )


# -- 2. IPv6 clients through the middleware ----------------------------------------------------
def test_ipv6_clients_of_one_slash_64_share_one_budget_through_the_middleware(
    quota: Any,
) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": LIMITED})
    assert statuses(Client(REMOTE_ADDR="2001:db8:1:2::1"), 2) == [200, 200]
    assert statuses(Client(REMOTE_ADDR="2001:db8:1:2:ffff::9"), 2) == [200, 429]
    assert statuses(Client(REMOTE_ADDR="2001:db8:1:3::1"), 1) == [200]
    assert django_quota.peek("api", {"ip": "2001:db8:1:2::77"}).remaining == 0
    assert django_quota.peek("api", {"ip": "2001:db8:1:3::77"}).remaining == 2


def test_ipv6_prefix_setting_is_honoured_by_the_middleware(quota: Any) -> None:
    quota(CLOCK=CLOCK, IPV6_PREFIX=48, TRUSTED_PROXIES=["10.0.0.0/8"], POLICIES={"api": LIMITED})
    client = Client(REMOTE_ADDR="10.0.0.1")
    for address in ("[2001:db8:1:2::1]:443", "2001:db8:1:ffff::1", "2001:db8:1::"):
        assert statuses(client, 1, HTTP_X_FORWARDED_FOR=address) == [200]
    assert statuses(client, 1, HTTP_X_FORWARDED_FOR="2001:db8:1:9::1") == [429]
    assert statuses(client, 1, HTTP_X_FORWARDED_FOR="2001:db8:2::1") == [200]
    quota(CLOCK=CLOCK, IPV6_PREFIX=128, POLICIES={"api": {**LIMITED, "windows": "1/m"}})
    assert statuses(Client(REMOTE_ADDR="2001:db8::1"), 2) == [200, 429]
    assert statuses(Client(REMOTE_ADDR="2001:db8::2"), 1) == [200]


# -- 5. identity errors and on_missing ---------------------------------------------------------
@pytest.mark.parametrize("on_missing", ["deny", "skip"])
def test_on_missing_skip_skips_a_missing_dimension_but_never_an_invalid_one(
    quota: Any, on_missing: str
) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={
            "by_user": {"windows": "5/m", "selector": ["user"], "on_missing": on_missing},
            "by_key": {"windows": "5/m", "selector": ["api_key"], "on_missing": on_missing},
            "by_ip": {"windows": "5/m", "selector": ["ip"], "on_missing": on_missing},
        },
    )
    missing_decision = "skipped" if on_missing == "skip" else "denied"
    for policy_id, subject in (
        ("by_user", {}),
        ("by_user", {"user": None}),
        ("by_key", {"api_key": ""}),
        ("by_ip", {"ip": None}),
    ):
        outcome = django_quota.evaluate(policy_id, subject)
        assert (outcome.decision, outcome.reason) == (missing_decision, MISSING)
        assert (outcome.retry_after, outcome.windows) == (None, ())
    for policy_id, subject in (
        ("by_key", {"api_key": "k" * 257}),
        ("by_key", {"api_key": "sk\nlive"}),
        ("by_ip", {"ip": "garbage"}),
        ("by_ip", {"ip": "fe80::1%eth0"}),
    ):
        outcome = django_quota.evaluate(policy_id, subject)
        assert (outcome.decision, outcome.reason) == ("denied", INVALID)
        assert (outcome.retry_after, outcome.allowed) == (None, False)


def test_reset_refuses_a_missing_or_invalid_identity(quota: Any) -> None:
    quota(POLICIES={"by_ip": {"windows": "5/m", "selector": ["ip"]}})
    for subject in ({}, {"ip": "garbage"}):
        with pytest.raises(ValueError, match="by_ip"):
            django_quota.reset("by_ip", subject)


@pytest.mark.parametrize("on_missing", ["deny", "skip"])
def test_invalid_api_key_header_is_refused_without_retry_after(quota: Any, on_missing: str) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={"keys": {**LIMITED, "selector": ["api_key"], "on_missing": on_missing}},
    )
    client = Client()
    for key in ("k" * 257, "sk_live\x01x"):
        response = client.get("/api/items/", HTTP_X_API_KEY=key)
        assert response.status_code == 429
        assert "Retry-After" not in response
        assert recorded(response) == [("keys", "denied", INVALID)]
    response = client.get("/api/items/")
    expected = (200, "skipped") if on_missing == "skip" else (429, "denied")
    assert (response.status_code, recorded(response)[0][1]) == expected


def test_invalid_forwarded_client_never_falls_back_to_remote_addr(quota: Any) -> None:
    quota(CLOCK=CLOCK, TRUSTED_PROXIES=["10.0.0.0/8"], POLICIES={"api": LIMITED})
    proxy = Client(REMOTE_ADDR="10.0.0.1")
    for header in ("garbage", "198.51.100.7, garbage", "fe80::1%eth0", "x" * 5000):
        response = proxy.get("/api/items/", HTTP_X_FORWARDED_FOR=header)
        assert (response.status_code, recorded(response)) == (429, [("api", "denied", INVALID)])
    # Nothing was charged to the proxy's address or to the client left of the bad entry.
    assert django_quota.peek("api", {"ip": "10.0.0.1"}).remaining == 3
    assert django_quota.peek("api", {"ip": "198.51.100.7"}).remaining == 3


def test_verified_key_resolver_returning_none_is_missing_not_the_raw_header(quota: Any) -> None:
    quota(API_KEY_RESOLVER="tests.test_subjects.resolve_api_key")
    request = factory.get("/", HTTP_X_API_KEY="sk_live_UNKNOWN")
    assert subjects.RequestSubject(request).for_policy(policy(selector=["api_key"])) == {
        "api_key": None
    }


# -- 6. api_key sources and auto ---------------------------------------------------------------
def test_api_key_is_the_resolver_key_else_drf_auth_else_the_raw_header(quota: Any) -> None:
    class Token:
        pk = "tok-1"

    by_key = policy(selector=["api_key"])
    request = factory.get("/", HTTP_X_API_KEY="sk_live_SECRET123")
    quota()
    assert subjects.RequestSubject(request).for_policy(by_key) == {"api_key": "sk_live_SECRET123"}
    assert subjects.RequestSubject(request, drf_auth=Token()).for_policy(by_key) == {
        "api_key": "tok-1"
    }
    assert subjects.RequestSubject(request, drf_auth="jwt-string").for_policy(by_key) == {
        "api_key": "jwt-string"
    }
    # An auth object with neither pk nor a string form we can trust is no key at all.
    assert subjects.RequestSubject(request, drf_auth=object()).for_policy(by_key) == {
        "api_key": None
    }
    quota(API_KEY_RESOLVER="tests.test_subjects.resolve_api_key")
    assert subjects.RequestSubject(request, drf_auth=Token()).for_policy(by_key) == {
        "api_key": "key-7"
    }


def test_non_ascii_api_key_header_names_the_key_the_python_api_names(quota: Any) -> None:
    quota()
    key = "ключ-…-🔑"
    # WSGI and ASGI servers decode header bytes as latin-1.
    request = factory.get("/", HTTP_X_API_KEY=key.encode().decode("latin-1"))
    raw = subjects.RequestSubject(request).for_policy(policy(selector=["api_key"]))
    assert raw == {"api_key": key}
    assert identity_of(raw, ["api_key"]) == identity_of({"api_key": key}, ["api_key"])
    # Bytes that are not UTF-8 are invalid: kept as latin-1 they would alias the UTF-8
    # key "café" spelled with the same characters.
    latin = factory.get("/", HTTP_X_API_KEY="caf\xe9")
    raw_latin = subjects.RequestSubject(latin).for_policy(policy(selector=["api_key"]))
    with pytest.raises(IdentityError) as caught:
        identity_of(raw_latin, ["api_key"])
    assert caught.value.reason == "selector_identity_invalid"


def resolve_empty_api_key(request: HttpRequest) -> str:
    """An ``API_KEY_RESOLVER`` that answers "" for unknown keys."""
    return ""


def test_auto_falls_back_to_ip_when_the_resolver_returns_an_empty_key(quota: Any) -> None:
    quota(API_KEY_RESOLVER="tests.test_subjects.resolve_empty_api_key")
    request = factory.get("/", REMOTE_ADDR="203.0.113.5")
    assert subjects.RequestSubject(request).for_policy(policy(selector=["auto"])) == {
        "ip": "203.0.113.5"
    }


@pytest.mark.parametrize(
    ("user", "header", "resolver", "expected"),
    [
        (_User(42), "sk_live_SECRET123", True, {"user": "42"}),
        (_User(None), "sk_live_SECRET123", True, {"api_key": "key-7"}),
        (_User(None), "sk_live_UNKNOWN", True, {"ip": "203.0.113.9"}),
        (_User(None), None, True, {"ip": "203.0.113.9"}),
        (_User(None), "sk_live_SECRET123", False, {"ip": "203.0.113.9"}),
        (_User(42), None, False, {"user": "42"}),
    ],
)
def test_auto_is_user_else_verified_api_key_else_ip(
    quota: Any, user: _User, header: str | None, resolver: bool, expected: dict[str, str]
) -> None:
    quota(API_KEY_RESOLVER="tests.test_subjects.resolve_api_key" if resolver else None)
    extra: dict[str, Any] = {"HTTP_X_API_KEY": header} if header else {}
    request = factory.get("/api/items/", REMOTE_ADDR="203.0.113.9", **extra)
    request.user = user  # type: ignore[assignment]
    resolver_calls.clear()
    assert subjects.RequestSubject(request).for_policy(policy(selector=["auto"])) == expected
    # The resolver is consulted only for an anonymous request.
    consulted = resolver and not user.is_authenticated
    assert resolver_calls == (["/api/items/"] if consulted else [])


def test_authenticated_user_without_pk_is_missing_not_a_shared_none(quota: Any) -> None:
    quota()

    class PkLess:
        is_authenticated = True
        pk = None

    request = factory.get("/", REMOTE_ADDR="203.0.113.9")
    request.user = PkLess()  # type: ignore[assignment]
    subject = subjects.RequestSubject(request)
    assert subject.for_policy(policy(selector=["user"])) == {"user": None}
    assert subject.for_policy(policy(selector=["auto"])) == {"ip": "203.0.113.9"}


def test_auto_counts_a_verified_key_across_addresses_and_raw_keys_per_address(
    quota: Any,
) -> None:
    auto = {**LIMITED, "selector": ["auto"], "windows": "2/m"}
    quota(CLOCK=CLOCK, API_KEY_RESOLVER="tests.test_subjects.resolve_api_key", POLICIES={"a": auto})
    key = {"HTTP_X_API_KEY": "sk_live_SECRET123"}
    assert statuses(Client(REMOTE_ADDR="203.0.113.1"), 1, **key) == [200]
    assert statuses(Client(REMOTE_ADDR="203.0.113.2"), 2, **key) == [200, 429]
    # An unverified key is not an identity: the client is counted by its address.
    unknown = {"HTTP_X_API_KEY": "sk_live_MINTED"}
    assert statuses(Client(REMOTE_ADDR="203.0.113.3"), 3, **unknown) == [200, 200, 429]


@pytest.mark.django_db
def test_auto_counts_an_authenticated_session_user(quota: Any, django_user_model: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"a": {**LIMITED, "selector": ["auto"], "windows": "1/m"}})
    user = django_user_model.objects.create_user("alice")
    first, second = Client(REMOTE_ADDR="203.0.113.1"), Client(REMOTE_ADDR="203.0.113.2")
    first.force_login(user)
    second.force_login(user)
    assert statuses(first, 1) == [200]
    assert statuses(second, 1) == [429]  # same user, another address
    assert django_quota.peek("a", {"user": str(user.pk)}).remaining == 0
    assert django_quota.peek("a", {"ip": "203.0.113.1"}).remaining == 1


def exploding_user_request(path: str = "/api/items/", **extra: Any) -> HttpRequest:
    """A request whose ``user`` attribute fails the test when read."""
    request = factory.get(path, **extra)

    def explode(self: Any) -> Any:
        raise AssertionError("request.user was read")

    request.__class__ = type("ExplodingUserRequest", (type(request),), {"user": property(explode)})
    return request


def test_request_user_is_not_read_when_no_policy_needs_it(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        API_KEY_RESOLVER="tests.test_subjects.resolve_api_key",
        TENANT_RESOLVER="tests.test_subjects.resolve_tenant",
        POLICIES={
            "by_ip": {**LIMITED, "selector": ["ip"]},
            "by_key": {**LIMITED, "selector": ["api_key", "route"], "on_missing": "skip"},
            "by_tenant": {**LIMITED, "selector": ["tenant"], "on_missing": "skip"},
            "user_elsewhere": {**LIMITED, "selector": ["user"], "routes": ["/health"]},
        },
    )
    middleware = QuotaMiddleware(lambda request: HttpResponse("ok"))
    request = exploding_user_request(HTTP_X_API_KEY="sk_live_SECRET123")
    assert middleware(request).status_code == 200
    assert [(o.policy, o.decision) for o in ledger.outcomes(request)] == [
        ("by_ip", "allowed"),
        ("by_key", "allowed"),
        ("by_tenant", "skipped"),
    ]
    # The probe works: a policy that needs the user does read it.
    quota(CLOCK=CLOCK, POLICIES={"by_user": {**LIMITED, "selector": ["user"]}})
    with pytest.raises(AssertionError, match=r"request\.user was read"):
        middleware(exploding_user_request())


def test_request_user_is_not_read_on_the_async_path_either(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"by_ip": {**LIMITED, "selector": ["ip", "route"]}})

    async def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    middleware = QuotaMiddleware(view)
    request = exploding_user_request()
    response = async_to_sync(middleware)(request)
    assert response.status_code == 200
    assert [(o.policy, o.decision) for o in ledger.outcomes(request)] == [("by_ip", "allowed")]


def test_ip_policy_adds_no_vary_cookie_and_a_user_policy_does(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"by_ip": LIMITED})
    response = Client().get("/api/items/")
    assert response.status_code == 200
    assert "RateLimit" in response
    assert "Cookie" not in response.get("Vary", "")
    quota(CLOCK=CLOCK, POLICIES={"by_auto": {**LIMITED, "selector": ["auto"]}})
    assert "Cookie" in Client().get("/api/items/")["Vary"]


# -- 8. spoofed X-Forwarded-For --------------------------------------------------------------
def random_forwarded_for(rng: random.Random) -> str:
    choices = [
        lambda: ".".join(str(rng.randrange(256)) for _ in range(4)),
        lambda: f"[2001:db8:{rng.randrange(65536):x}::1]:443",
        lambda: "10.0.0.1",
        lambda: "garbage-" + str(rng.randrange(10**6)),
        lambda: "," * rng.randrange(5),
        lambda: "1.2.3.4," * 600,  # over 4 KiB
    ]
    return ", ".join(rng.choice(choices)() for _ in range(rng.randrange(1, 4)))


@pytest.mark.parametrize("trusted", [[], ["10.0.0.0/8"]])
def test_spoofed_forwarded_for_never_changes_the_subject(quota: Any, trusted: list[str]) -> None:
    quota(CLOCK=CLOCK, TRUSTED_PROXIES=trusted, POLICIES={"api": LIMITED})
    rng = random.Random(4)
    client = Client(REMOTE_ADDR="203.0.113.7")
    found = [
        client.get("/api/items/", HTTP_X_FORWARDED_FOR=random_forwarded_for(rng)).status_code
        for _ in range(8)
    ]
    assert found == [200, 200, 200, 429, 429, 429, 429, 429]
    assert django_quota.peek("api", {"ip": "203.0.113.7"}).remaining == 0


def test_spoofed_forwarded_for_from_outside_the_trusted_cidr_is_ignored(quota: Any) -> None:
    quota(CLOCK=CLOCK, TRUSTED_PROXIES=["10.0.0.0/8"], POLICIES={"api": LIMITED})
    outsider = Client(REMOTE_ADDR="198.51.100.1")
    spoofs = ["10.0.0.2", "203.0.113.1", "203.0.113.2, 10.0.0.3"]
    assert [
        outsider.get("/api/items/", HTTP_X_FORWARDED_FOR=spoof).status_code for spoof in spoofs
    ] + statuses(outsider, 1) == [200, 200, 200, 429]
    # The same header from a trusted proxy does name the client.
    proxy = Client(REMOTE_ADDR="10.0.0.1")
    assert statuses(proxy, 1, HTTP_X_FORWARDED_FOR="203.0.113.1") == [200]


# -- 4. the HMAC key settings on a real Redis ------------------------------------------------
def counter_keys(redis_client: Any) -> set[str]:
    return {key.decode() for key in redis_client.keys("*") if b":e:" not in key}


def test_counter_key_carries_the_pseudonym_derived_from_secret_key(
    quota: Any, settings: Any, redis_url: str, redis_client: Any
) -> None:
    definition = {"windows": "1/m", "selector": ["user"]}
    quota(HMAC_KEY=None, REDIS_URL=redis_url, POLICIES={"p": definition})
    revision = policies.get_policy("p").revision
    derived = hmac.new(settings.SECRET_KEY.encode(), b"django_quota.identity.v1", hashlib.sha256)
    pseudonym = independent_pseudonym([("user", "42")], derived.digest())
    assert django_quota.evaluate("p", {"user": "42"}).decision == "allowed"
    assert counter_keys(redis_client) == {f"quota:{{{pseudonym}}}:1:p:{revision}"}
    assert django_quota.evaluate("p", {"user": "42"}).decision == "denied"

    settings.SECRET_KEY = "another-secret-key-for-this-test"
    assert django_quota.evaluate("p", {"user": "42"}).decision == "allowed"  # fresh counter
    rotated = hmac.new(settings.SECRET_KEY.encode(), b"django_quota.identity.v1", hashlib.sha256)
    assert (
        f"quota:{{{independent_pseudonym([('user', '42')], rotated.digest())}}}:1:p:{revision}"
        in (counter_keys(redis_client))
    )


@pytest.mark.parametrize(
    ("change", "expected_prefix"),
    [
        ({"HMAC_KEY": "a-different-hmac-key-987654"}, "quota:{v1."),
        ({"HMAC_KEY_VERSION": 2}, "quota:{v2."),
        ({"KEY_PREFIX": "staging"}, "staging:{v1."),
    ],
)
def test_changing_hmac_key_version_or_prefix_starts_counters_afresh(
    quota: Any, redis_url: str, redis_client: Any, change: dict[str, Any], expected_prefix: str
) -> None:
    definition = {"windows": "1/m", "selector": ["user"]}
    quota(REDIS_URL=redis_url, POLICIES={"p": definition})
    assert [django_quota.evaluate("p", {"user": "42"}).decision for _ in range(2)] == [
        "allowed",
        "denied",
    ]
    before = counter_keys(redis_client)
    quota(REDIS_URL=redis_url, POLICIES={"p": definition}, **change)
    assert django_quota.evaluate("p", {"user": "42"}).decision == "allowed"
    (new,) = counter_keys(redis_client) - before
    assert new.startswith(expected_prefix)


def test_route_only_key_is_readable_and_tagged_by_the_route(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    quota(
        REDIS_URL=redis_url,
        POLICIES={"views": {"windows": "5/m", "selector": ["route"], "routes": ["/api"]}},
    )
    assert Client().get("/api/items/").status_code == 200
    revision = policies.get_policy("views").revision
    assert counter_keys(redis_client) == {f"quota:{{api:items}}:5:views:{revision}"}


# -- 7. no raw identity anywhere -------------------------------------------------------------
RAW_IDENTITIES = {
    "user": "alice-42",
    "api_key": "sk_live_SECRET123",
    "ip": "203.0.113.99",
    "ipv6": "2001:db8:42:99",
    "tenant": "acme-corp",
}


def forbidden_forms() -> list[bytes]:
    """Each raw identity as is, in other cases, and hex or base64 encoded."""
    forms: list[bytes] = []
    for raw in RAW_IDENTITIES.values():
        data = raw.encode()
        forms += [data, data.lower(), data.upper(), data.hex().encode()]
        forms += [base64.b64encode(data).rstrip(b"="), base64.urlsafe_b64encode(data).rstrip(b"=")]
    forms += [b"SECRET123", b"alice", b"acme"]
    return forms


def dump_redis(redis_client: Any) -> list[bytes]:
    """Every key name, hash field and value, list item, set member and string in Redis."""
    out: list[bytes] = []
    for key in redis_client.scan_iter("*", count=1000):
        out.append(key)
        kind = redis_client.type(key).decode()
        if kind == "hash":
            for field, value in redis_client.hgetall(key).items():
                out += [field, value]
        elif kind == "list":
            out += redis_client.lrange(key, 0, -1)
        elif kind == "string":
            out.append(redis_client.get(key))
        elif kind == "set":
            out += list(redis_client.smembers(key))
        elif kind == "zset":
            out += [member for member, _ in redis_client.zrange(key, 0, -1, withscores=True)]
        else:
            raise AssertionError(f"unexpected Redis type {kind} at {key!r}")
    return out


def traffic_settings(redis_url: str, **extra: Any) -> dict[str, Any]:
    routes = ["/api"]
    return {
        "REDIS_URL": redis_url,
        "TRUSTED_PROXIES": ["10.0.0.0/8"],
        "TENANT_RESOLVER": "tests.test_subjects.resolve_tenant",
        "POLICIES": {
            "per_user": {
                "windows": "100/m",
                "selector": ["user"],
                "routes": routes,
                "on_missing": "skip",
            },
            "per_key": {
                "algorithm": "token_bucket",
                "windows": "100/m",
                "selector": ["api_key", "ip"],
                "routes": routes,
                "on_missing": "skip",
            },
            "per_ip": {
                "algorithm": "sliding_window",
                "windows": {"burst": "50/s", "sustained": "100/h"},
                "selector": ["ip"],
                "routes": routes,
            },
            "per_tenant_view": {
                "windows": "100/m",
                "selector": ["route", "tenant"],
                "routes": routes,
                "on_missing": "skip",
            },
            "per_view": {"windows": "100/m", "selector": ["route"], "routes": routes},
            "per_auto": {
                "windows": "100/m",
                "selector": ["auto"],
                "routes": routes,
                "enforcement": "shadow",
            },
            "tight": {
                "algorithm": "fixed_window",
                "windows": "1/h",
                "selector": ["ip"],
                "routes": ["/api/search"],
            },
        },
        **extra,
    }


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def send_traffic(responses: list[Any]) -> None:
    identity_headers: dict[str, Any] = {
        "HTTP_X_TEST_USER": RAW_IDENTITIES["user"],
        "HTTP_X_API_KEY": RAW_IDENTITIES["api_key"],
        "HTTP_X_TENANT": RAW_IDENTITIES["tenant"],
    }
    direct = Client(REMOTE_ADDR=RAW_IDENTITIES["ip"])
    proxied = Client(REMOTE_ADDR="10.0.0.1")
    ipv6 = Client(REMOTE_ADDR="2001:db8:42:99::5")
    for path in ("/api/items/", "/api/search/", "/api/search/", "/nowhere/"):
        responses.append(direct.get(path, **identity_headers))
        responses.append(direct.get(path))
        responses.append(
            proxied.get(
                path, HTTP_X_FORWARDED_FOR=f"{RAW_IDENTITIES['ip']}:5678", **identity_headers
            )
        )
        responses.append(ipv6.get(path, HTTP_X_API_KEY=RAW_IDENTITIES["api_key"]))


def python_api_traffic() -> None:
    full = {
        "user": RAW_IDENTITIES["user"],
        "api_key": RAW_IDENTITIES["api_key"],
        "ip": RAW_IDENTITIES["ip"],
        "tenant": RAW_IDENTITIES["tenant"],
        "route": "api:items",
    }
    for policy_id in ("per_user", "per_key", "per_ip", "per_tenant_view", "per_auto", "tight"):
        django_quota.evaluate(policy_id, full, evaluation_id=f"eval-{policy_id}")
        django_quota.peek(policy_id, full)
        async_to_sync(django_quota.aevaluate)(policy_id, full)
    django_quota.evaluate("per_ip", {"ip": "2001:db8:42:99::1"}, cost=3)


@pytest.mark.django_db
def test_no_redis_key_value_or_log_line_contains_a_raw_identity(
    quota: Any, settings: Any, redis_url: str, redis_client: Any, caplog: Any
) -> None:
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE[:-1],
        "tests.test_subjects.HeaderUserMiddleware",
        settings.MIDDLEWARE[-1],
    ]
    caplog.set_level(logging.DEBUG)
    responses: list[Any] = []
    quota(**traffic_settings(redis_url))
    send_traffic(responses)
    python_api_traffic()
    statuses_seen = {response.status_code for response in responses}
    assert statuses_seen == {200, 404, 429}  # tight refused some

    stored = dump_redis(redis_client)
    assert any(b"{v1." in item for item in stored)
    # every key's value was scanned too (counters with their evaluation-id ledgers)
    assert len(stored) >= 2 * len(list(redis_client.scan_iter("*")))
    assert any(b"api:items" in item for item in stored)  # route values may appear
    # `quota inspect` names the counters the middleware wrote from the same raw input.
    inspected: list[bytes] = []
    for args in (
        ("per_ip", "--ip", RAW_IDENTITIES["ip"]),
        ("per_ip", "--ip", "2001:db8:42:99::77"),  # same /64 as the IPv6 client
        ("per_tenant_view", "--route", "api:items", "--tenant", RAW_IDENTITIES["tenant"]),
        ("per_key", "--api-key", RAW_IDENTITIES["api_key"], "--ip", RAW_IDENTITIES["ip"]),
    ):
        out = io.StringIO()
        call_command("quota", "inspect", *args, "--json", stdout=out)
        inspected.append(out.getvalue().encode())
        found = json.loads(out.getvalue())
        assert found["identity"].startswith(("id=v1.", "route=api:items id=v1."))
        if args[0] == "per_ip":
            assert max(window["count"] for window in found["windows"]) > 0
    # Backend failures are logged: fail open, then decide with the local fallback.
    dead = f"redis://127.0.0.1:{closed_port()}/0"
    quota(**traffic_settings(dead, FAILURE_MODE="open"))
    send_traffic(responses)
    python_api_traffic()
    quota(**traffic_settings(dead, LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 100}))
    send_traffic(responses)
    python_api_traffic()
    quota_records = [r for r in caplog.records if r.name.startswith("django_quota")]
    assert any("backend failure" in r.getMessage() for r in quota_records)
    assert any("deciding locally" in r.getMessage() for r in quota_records)

    logged = [caplog.text.encode()] + [
        (r.getMessage() + repr(r.args) + repr(r.__dict__)).encode() for r in caplog.records
    ]
    answered = [
        response.content + repr(sorted(response.items())).encode() for response in responses
    ]
    exposed = [prometheus_client.generate_latest()] if prometheus_client else []
    assert not prometheus_client or b"django_quota_outcomes_total" in exposed[0]
    for form in forbidden_forms():
        for where, items in (
            ("redis", stored),
            ("logs", logged),
            ("responses", answered),
            ("quota inspect", inspected),
            ("metrics", exposed),
        ):
            leaks = [item for item in items if form in item or form.lower() in item.lower()]
            assert not leaks, f"{form!r} found in {where}: {leaks[:3]!r}"
