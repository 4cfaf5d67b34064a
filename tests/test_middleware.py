"""``QuotaMiddleware`` end to end through Django's test clients (docs/policies.md, subjects.md,
failures.md, http.md):
refusals, route matching, rate-limit headers, backend failures, identity errors, the
async path, ``DENIED_VIEW`` and policies decided together.

Most tests run on a frozen client clock (``CLOCK`` = :func:`frozen_clock`) so that window
boundaries and ``Retry-After`` are exact; the tests on Redis's own ``TIME`` use
minute-long windows and step over a minute boundary that is about to pass."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.http import HttpResponse
from django.test import AsyncClient, Client

import django_quota
from django_quota import routes
from django_quota.signals import quota_denied
from tests.conftest import require_redis_server
from tests.test_http import parse_sf_list

#: 20.4 s into a minute (1_700_000_040 is a multiple of 60) and 860.4 s into an hour.
FROZEN_NOW = 1_700_000_060.4
CLOCK = "tests.test_middleware.frozen_clock"
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
RATE_LIMIT_HEADERS = (
    "RateLimit-Policy",
    "RateLimit",
    "X-RateLimit-Limit",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
)
API = {"algorithm": "fixed_window", "windows": "3/m", "selector": ["ip"], "routes": ["/api"]}
BURST = {
    "algorithm": "fixed_window",
    "windows": {"burst": "2/m", "sustained": "5/h"},
    "selector": ["ip"],
    "routes": ["/api"],
}


def frozen_clock() -> float:
    """The ``CLOCK`` of most tests: epoch seconds that never move."""
    return FROZEN_NOW


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def away_from_minute_boundary() -> None:
    """Let a minute boundary that is under 2 s away pass, so that a test on Redis
    ``TIME`` never sees a fixed window roll over."""
    into_minute = time.time() % 60
    if into_minute > 58:
        time.sleep(60 - into_minute + 0.05)


def problem(response: Any) -> dict[str, Any]:
    assert response["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(response.content)
    return body


def statuses(client: Any, path: str, count: int, **extra: Any) -> list[int]:
    return [client.get(path, **extra).status_code for _ in range(count)]


def recorded(response: Any) -> list[tuple[str, str, str | None]]:
    return [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(response.wsgi_request)]


def rate_limit_headers(response: Any) -> dict[str, str]:
    return {name: response[name] for name in RATE_LIMIT_HEADERS if name in response}


# -- 1. refusals -----------------------------------------------------------------------------
def assert_fourth_request_refused(client: Client, retry_after: float | None = None) -> None:
    assert statuses(client, "/api/items/", 3) == [200, 200, 200]
    response = client.get("/api/items/")
    assert response.status_code == 429
    body = problem(response)
    if retry_after is None:
        retry_after = body["retry_after"]
        assert 0 < retry_after <= 60
    assert response["Retry-After"] == str(max(1, math.ceil(retry_after)))
    assert int(response["Retry-After"]) >= 1
    assert body == {
        "type": QUOTA_EXCEEDED,
        "title": "Quota exceeded",
        "status": 429,
        "detail": "The default window of policy api is exhausted.",
        "reason": "default_quota_exhausted",
        "policy": "api",
        "retry_after": retry_after,
        "violated-policies": ["api"],
    }


def test_denied_request_gets_429_with_retry_after_and_problem_body(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": API})
    assert_fourth_request_refused(Client(), retry_after=39.6)


def test_denied_request_on_memory_backend_with_wall_clock(quota: Any) -> None:
    quota(POLICIES={"api": API})
    away_from_minute_boundary()
    assert_fourth_request_refused(Client())


@pytest.mark.redis
def test_denied_request_on_redis_gets_the_same_429(quota: Any, redis_url: str) -> None:
    quota(REDIS_URL=redis_url, CLOCK=CLOCK, POLICIES={"api": API})
    assert_fourth_request_refused(Client(), retry_after=39.6)
    assert django_quota.peek("api", {"ip": "127.0.0.1"}).backend_mode == "redis"


@pytest.mark.redis
def test_denied_request_on_redis_time_gets_the_same_429(quota: Any, redis_url: str) -> None:
    quota(REDIS_URL=redis_url, POLICIES={"api": API})
    away_from_minute_boundary()
    assert_fourth_request_refused(Client())


@pytest.mark.parametrize("backend", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_denied_burst_window_is_named_policy_dot_window(
    quota: Any, request: pytest.FixtureRequest, backend: str
) -> None:
    extra = {"REDIS_URL": request.getfixturevalue("redis_url")} if backend == "redis" else {}
    quota(CLOCK=CLOCK, POLICIES={"api": BURST}, **extra)
    client = Client()
    assert statuses(client, "/api/items/", 2) == [200, 200]
    response = client.get("/api/items/")
    assert response.status_code == 429
    assert response["Retry-After"] == "40"
    assert problem(response) == {
        "type": QUOTA_EXCEEDED,
        "title": "Quota exceeded",
        "status": 429,
        "detail": "The burst window of policy api is exhausted.",
        "reason": "burst_quota_exhausted",
        "policy": "api",
        "retry_after": 39.6,
        "violated-policies": ["api.burst"],
    }


def test_every_denying_window_is_violated_and_the_longest_wait_is_reported(quota: Any) -> None:
    windows = {"burst": "2/m", "sustained": "2/h"}
    quota(CLOCK=CLOCK, POLICIES={"api": {**BURST, "windows": windows}})
    client = Client()
    assert statuses(client, "/api/items/", 2) == [200, 200]
    response = client.get("/api/items/")
    body = problem(response)
    assert response.status_code == 429
    assert response["Retry-After"] == "2740"  # 3600 - 860.4, rounded up
    assert body["reason"] == "sustained_quota_exhausted"
    assert body["retry_after"] == 2739.6
    assert body["violated-policies"] == ["api.burst", "api.sustained"]


def test_denial_sends_quota_denied_with_the_request_and_outcome(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "windows": "1/m"}})
    seen: list[tuple[str, str]] = []

    def receiver(sender: Any, request: Any, outcome: Any, **kwargs: Any) -> None:
        seen.append((request.path, outcome.decision))

    quota_denied.connect(receiver)
    try:
        assert statuses(Client(), "/api/items/", 2) == [200, 429]
    finally:
        quota_denied.disconnect(receiver)
    assert seen == [("/api/items/", "denied")]


def test_clients_with_different_addresses_have_separate_counters(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "windows": "1/m"}})
    assert statuses(Client(REMOTE_ADDR="198.51.100.1"), "/api/items/", 2) == [200, 429]
    assert statuses(Client(REMOTE_ADDR="198.51.100.2"), "/api/items/", 2) == [200, 429]


# -- 2. route matching -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("routes", "path", "expected"),
    [
        (["/api"], "/api/items/", True),
        (["/api"], "/apiary/", False),
        (["/api/items"], "/api/items/", True),
        (["/api/items"], "/api/search/", False),
        (["*"], "/health/", True),
        (["*"], "/nowhere/", True),
        (["api:*"], "/api/items/", True),
        (["api:*"], "/api/v2/items/", True),
        (["api:*"], "/apiary/", False),
        (["api:items"], "/api/items/", True),
        (["api:items"], "/api/search/", False),
        (["api:items"], "/api/v2/items/", False),
        (["health", "api:search"], "/api/search/", True),
        (None, "/api/items/", False),
        ([], "/api/items/", False),
    ],
)
def test_policy_applies_only_on_matching_routes(
    quota: Any, routes: Any, path: str, expected: bool
) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "routes": routes}})
    response = Client().get(path)
    assert [policy for policy, _, _ in recorded(response)] == (["api"] if expected else [])
    assert ("RateLimit" in response) is expected


def test_prefix_route_refuses_matching_paths_only(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "windows": "1/m"}})
    client = Client()
    assert statuses(client, "/api/items/", 2) == [200, 429]
    assert statuses(client, "/api/search/", 1) == [429]
    assert statuses(client, "/apiary/", 3) == [200, 200, 200]


def test_wildcard_route_limits_unresolved_paths_too(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"all": {**API, "routes": ["*"], "windows": "1/m"}})
    client = Client()
    assert statuses(client, "/nowhere/", 2) == [404, 429]


def test_policy_without_routes_is_not_applied_but_still_evaluates(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "routes": None, "windows": "1/m"}})
    assert statuses(Client(), "/api/items/", 3) == [200, 200, 200]
    assert django_quota.evaluate("api", {"ip": "127.0.0.1"}).decision == "allowed"
    assert django_quota.evaluate("api", {"ip": "127.0.0.1"}).decision == "denied"


@pytest.mark.parametrize(
    ("methods", "method", "expected"),
    [
        (["POST"], "post", True),
        (["POST"], "get", False),
        (["POST"], "put", False),
        (["GET"], "get", True),
        (["GET"], "head", False),
        (["GET"], "options", False),
        (["GET", "HEAD"], "head", True),
        (["OPTIONS"], "options", True),
        ([], "get", True),
        ([], "head", True),
        ([], "options", True),
        ([], "delete", True),
    ],
)
def test_methods_select_requests_and_head_options_only_when_listed(
    quota: Any, methods: list[str], method: str, expected: bool
) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "methods": methods}})
    response = getattr(Client(), method)("/api/items/")
    assert [policy for policy, _, _ in recorded(response)] == (["api"] if expected else [])


def test_post_only_policy_refuses_posts_and_lets_gets_through(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "methods": ["POST"], "windows": "1/m"}})
    client = Client()
    assert [client.post("/api/items/").status_code for _ in range(2)] == [200, 429]
    assert statuses(client, "/api/items/", 2) == [200, 200]


def test_exempt_paths_are_never_limited(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        EXEMPT_PATHS=["/api/search", "/health"],
        POLICIES={"all": {**API, "routes": ["*"], "windows": "1/m"}},
    )
    client = Client()
    assert statuses(client, "/api/search/", 3) == [200, 200, 200]
    assert statuses(client, "/health/", 3) == [200, 200, 200]
    response = client.get("/api/search/")
    assert recorded(response) == []
    assert rate_limit_headers(response) == {}
    assert statuses(client, "/api/items/", 2) == [200, 429]


def test_disabled_app_limits_nothing_and_writes_no_headers(quota: Any) -> None:
    quota(CLOCK=CLOCK, ENABLED=False, POLICIES={"api": {**API, "windows": "1/m"}})
    client = Client()
    assert statuses(client, "/api/items/", 4) == [200, 200, 200, 200]
    response = client.get("/api/items/")
    assert recorded(response) == []
    assert rate_limit_headers(response) == {}


def test_disabled_policy_is_not_applied(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "windows": "1/m", "enabled": False}})
    assert statuses(Client(), "/api/items/", 3) == [200, 200, 200]


# -- 3. headers --------------------------------------------------------------------------------
def ietf(response: Any) -> tuple[Any, Any]:
    return parse_sf_list(response["RateLimit-Policy"]), parse_sf_list(response["RateLimit"])


def test_ietf_headers_describe_the_single_default_window(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": API})
    client = Client()
    expected_policy = [("api", {"q": 3, "w": 60})]
    for remaining in (2, 1, 0):
        response = client.get("/api/items/")
        assert response.status_code == 200
        assert ietf(response) == (expected_policy, [("api", {"r": remaining, "t": 40})])
        assert "X-RateLimit-Limit" not in response
        assert "Retry-After" not in response
    response = client.get("/api/items/")
    assert response.status_code == 429
    assert ietf(response) == (expected_policy, [("api", {"r": 0, "t": 40})])
    assert int(response["Retry-After"]) >= 40


def test_ietf_headers_have_one_item_per_window(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": BURST})
    response = Client().get("/api/items/")
    assert ietf(response) == (
        [("api.burst", {"q": 2, "w": 60}), ("api.sustained", {"q": 5, "w": 3600})],
        [("api.burst", {"r": 1, "t": 40}), ("api.sustained", {"r": 4, "t": 2740})],
    )


def test_ietf_headers_of_token_bucket_and_sliding_window(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={
            "bucket": {**API, "algorithm": "token_bucket", "capacity": 5},
            "slide": {**API, "algorithm": "sliding_window"},
        },
    )
    response = Client().get("/api/items/")
    assert response.status_code == 200
    assert ietf(response) == (
        [("bucket", {"q": 5, "w": 60}), ("slide", {"q": 3, "w": 60})],
        # a token every 20 s; the sliding estimate first drops 1 ms into the next window
        [("bucket", {"r": 4, "t": 20}), ("slide", {"r": 2, "t": 40})],
    )


def test_ietf_headers_of_the_sliding_log_wait_for_the_oldest_unit(quota: Any) -> None:
    from tests import clock

    quota(CLOCK="tests.clock.now", POLICIES={"log": {**API, "algorithm": "sliding_log"}})
    client = Client()
    start = clock.current
    try:
        for offset in (0.0, 10.0, 25.5):
            clock.set_to(start + offset)
            response = client.get("/api/items/")
        # three units, at 0, 10 and 25.5 s: r rises when the oldest leaves, at 60 s
        assert ietf(response) == ([("log", {"q": 3, "w": 60})], [("log", {"r": 0, "t": 35})])
        clock.set_to(start + 30.2)
        denied = client.get("/api/items/")
        assert denied.status_code == 429
        assert ietf(denied)[1] == [("log", {"r": 0, "t": 30})]
        assert denied["Retry-After"] == "30"  # 29.8 s, rounded up: never before t
        clock.set_to(start + 60)
        assert client.get("/api/items/").status_code == 200
    finally:
        clock.set_to(start)


@pytest.mark.redis
def test_ietf_headers_on_redis_match_the_memory_backend(quota: Any, redis_url: str) -> None:
    quota(REDIS_URL=redis_url, CLOCK=CLOCK, POLICIES={"api": BURST})
    client = Client()
    client.get("/api/items/")
    response = client.get("/api/items/")
    assert ietf(response) == (
        [("api.burst", {"q": 2, "w": 60}), ("api.sustained", {"q": 5, "w": 3600})],
        [("api.burst", {"r": 0, "t": 40}), ("api.sustained", {"r": 3, "t": 2740})],
    )


def test_legacy_headers_report_the_tightest_window(quota: Any) -> None:
    quota(CLOCK=CLOCK, HEADERS="legacy", POLICIES={"api": BURST})
    response = Client().get("/api/items/")
    assert rate_limit_headers(response) == {
        "X-RateLimit-Limit": "2",
        "X-RateLimit-Remaining": "1",
        "X-RateLimit-Reset": "40",
    }


def test_legacy_headers_on_a_denial_report_the_denied_window(quota: Any) -> None:
    quota(CLOCK=CLOCK, HEADERS="legacy", POLICIES={"api": API})
    client = Client()
    statuses(client, "/api/items/", 3)
    response = client.get("/api/items/")
    assert response.status_code == 429
    assert rate_limit_headers(response) == {
        "X-RateLimit-Limit": "3",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "40",
    }


def test_both_header_styles_together(quota: Any) -> None:
    quota(CLOCK=CLOCK, HEADERS="both", POLICIES={"api": API})
    response = Client().get("/api/items/")
    assert rate_limit_headers(response) == {
        "RateLimit-Policy": '"api";q=3;w=60',
        "RateLimit": '"api";r=2;t=40',
        "X-RateLimit-Limit": "3",
        "X-RateLimit-Remaining": "2",
        "X-RateLimit-Reset": "40",
    }


def test_header_style_none_writes_no_rate_limit_headers(quota: Any) -> None:
    quota(CLOCK=CLOCK, HEADERS="none", POLICIES={"api": {**API, "windows": "1/m"}})
    client = Client()
    assert rate_limit_headers(client.get("/api/items/")) == {}
    response = client.get("/api/items/")
    assert response.status_code == 429
    assert rate_limit_headers(response) == {}
    assert response["Retry-After"] == "40"


def test_shadow_policy_never_refuses_and_never_writes_headers(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        HEADERS="both",
        POLICIES={"watch": {**API, "windows": "1/m", "enforcement": "shadow"}},
    )
    client = Client()
    first = client.get("/api/items/")
    assert first.status_code == 200
    assert recorded(first) == [("watch", "allowed", None)]
    assert rate_limit_headers(first) == {}
    for _ in range(2):
        response = client.get("/api/items/")
        assert response.status_code == 200
        assert recorded(response) == [("watch", "shadow_denied", "default_quota_exhausted")]
        assert rate_limit_headers(response) == {}
        assert "Retry-After" not in response


def test_shadow_policy_beside_an_enforced_one_leaves_headers_to_the_enforced(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={
            "watch": {**API, "windows": "1/m", "enforcement": "shadow"},
            "api": API,
        },
    )
    client = Client()
    client.get("/api/items/")
    response = client.get("/api/items/")
    assert response.status_code == 200
    assert recorded(response) == [
        ("watch", "shadow_denied", "default_quota_exhausted"),
        ("api", "allowed", None),
    ]
    assert ietf(response) == ([("api", {"q": 3, "w": 60})], [("api", {"r": 1, "t": 40})])


# -- 4. backend failures -----------------------------------------------------------------------
def dead_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


FAILURE_DETAIL = "The rate limiter could not decide and this policy fails closed."


def test_unreachable_redis_fails_closed_with_503_problem(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), POLICIES={"api": {**API, "failure_mode": "closed"}})
    response = Client().get("/api/items/")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert problem(response) == {
        "type": "about:blank",
        "title": "Service Unavailable",
        "status": 503,
        "detail": FAILURE_DETAIL,
        "reason": "backend_unavailable",
        "policy": "api",
    }
    assert recorded(response) == [("api", "failed_closed", "backend_unavailable")]
    assert rate_limit_headers(response) == {}


def test_failure_retry_after_setting_is_the_503_retry_after(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), FAILURE_RETRY_AFTER=7, POLICIES={"api": API})
    response = Client().get("/api/items/")
    assert response.status_code == 503
    assert response["Retry-After"] == "7"


def test_unreachable_redis_fails_open_with_the_view_response(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), POLICIES={"api": {**API, "failure_mode": "open"}})
    client = Client()
    for _ in range(4):
        response = client.get("/api/items/")
        assert response.status_code == 200
        assert response.content == b"ok"
        assert recorded(response) == [("api", "failed_open", "backend_unavailable")]
        assert rate_limit_headers(response) == {}
        assert "Retry-After" not in response


def test_policy_failure_mode_defaults_to_the_global_setting(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), FAILURE_MODE="open", POLICIES={"api": API})
    assert statuses(Client(), "/api/items/", 2) == [200, 200]


def test_one_fail_closed_policy_refuses_the_whole_group(quota: Any) -> None:
    quota(
        REDIS_URL=dead_redis_url(),
        POLICIES={
            "lenient": {**API, "failure_mode": "open"},
            "strict": {**API, "failure_mode": "closed"},
        },
    )
    response = Client().get("/api/items/")
    assert response.status_code == 503
    assert problem(response)["policy"] == "strict"
    assert recorded(response) == [
        ("lenient", "failed_open", "backend_unavailable"),
        ("strict", "failed_closed", "backend_unavailable"),
    ]


def test_local_fallback_decides_while_redis_is_unreachable(quota: Any) -> None:
    quota(
        REDIS_URL=dead_redis_url(),
        CLOCK=CLOCK,
        LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 100},
        POLICIES={"api": {**API, "failure_mode": "closed"}},
    )
    client = Client()
    assert statuses(client, "/api/items/", 3) == [200, 200, 200]
    response = client.get("/api/items/")
    assert response.status_code == 429
    assert response["Retry-After"] == "40"
    assert problem(response)["reason"] == "default_quota_exhausted"
    assert [o.backend_mode for o in django_quota.outcomes(response.wsgi_request)] == ["fallback"]


class OwnRedis:
    """A redis-server of this test alone, on a fixed port, that can be stopped and
    started again (the session's server is shared and must stay up)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        assert self.process is None
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on {self.port}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.terminate()
            process.wait(timeout=10)


@pytest.fixture
def own_redis() -> Iterator[OwnRedis]:
    require_redis_server()
    server = OwnRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.redis
def test_redis_outage_follows_failure_modes_and_recovers_without_restart(
    quota: Any, own_redis: OwnRedis
) -> None:
    quota(
        REDIS_URL=own_redis.url,
        CLOCK=CLOCK,
        POLICIES={
            "strict": {**API, "routes": ["/api/items"], "failure_mode": "closed"},
            "lenient": {**API, "routes": ["/api/search"], "failure_mode": "open"},
        },
    )
    client = Client()
    assert statuses(client, "/api/items/", 1) == [200]
    assert statuses(client, "/api/search/", 1) == [200]

    own_redis.stop()
    for _ in range(2):
        down = client.get("/api/items/")
        assert down.status_code == 503
        assert down["Retry-After"] == "1"
        assert problem(down)["policy"] == "strict"
        assert problem(down)["reason"] == "backend_unavailable"
        passed = client.get("/api/search/")
        assert passed.status_code == 200
        assert recorded(passed)[0][1] == "failed_open"

    own_redis.start()
    # Counters were lost with the process (no persistence): a fresh window.
    for remaining in (2, 1):
        response = client.get("/api/items/")
        assert response.status_code == 200
        assert recorded(response) == [("strict", "allowed", None)]
        assert ietf(response)[1] == [("strict", {"r": remaining, "t": 40})]
    assert statuses(client, "/api/items/", 2) == [200, 429]
    assert client.get("/api/search/").status_code == 200


# -- 5. identity errors ------------------------------------------------------------------------
def test_anonymous_request_under_a_user_policy_is_refused_without_retry_after(
    quota: Any,
) -> None:
    quota(CLOCK=CLOCK, POLICIES={"members": {**API, "selector": ["user"]}})
    response = Client().get("/api/items/")
    assert response.status_code == 429
    assert "Retry-After" not in response
    assert rate_limit_headers(response) == {}
    assert problem(response) == {
        "type": QUOTA_EXCEEDED,
        "title": "Quota exceeded",
        "status": 429,
        "detail": (
            "The request has no valid identity for policy members (selector_identity_missing)."
        ),
        "reason": "selector_identity_missing",
        "policy": "members",
        "retry_after": None,
        "violated-policies": [],
    }


def test_missing_identity_with_on_missing_skip_passes(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"members": {**API, "selector": ["user"], "on_missing": "skip"}})
    client = Client()
    for _ in range(4):
        response = client.get("/api/items/")
        assert response.status_code == 200
        assert recorded(response) == [("members", "skipped", "selector_identity_missing")]
        assert rate_limit_headers(response) == {}


@pytest.mark.django_db
def test_authenticated_users_are_counted_apart(quota: Any, django_user_model: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"members": {**API, "selector": ["user"], "windows": "1/m"}})
    alice = Client()
    alice.force_login(django_user_model.objects.create_user("alice"))
    bob = Client()
    bob.force_login(django_user_model.objects.create_user("bob"))
    assert statuses(alice, "/api/items/", 2) == [200, 429]
    assert statuses(bob, "/api/items/", 2) == [200, 429]
    assert "Cookie" in bob.get("/api/items/")["Vary"]


def test_user_is_read_only_when_a_matching_policy_selects_it(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={
            "by_ip": {**API, "routes": ["/api/items"]},
            "by_user": {**API, "routes": ["/api/search"], "selector": ["user"],
                        "on_missing": "skip"},
        },
    )
    client = Client()
    assert "Cookie" not in client.get("/api/items/").get("Vary", "")
    assert "Cookie" in client.get("/api/search/")["Vary"]


def test_route_selector_counts_each_view_apart(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={"per_view": {**API, "routes": ["*"], "selector": ["route"], "windows": "1/m"}},
    )
    client = Client()
    assert statuses(client, "/api/items/", 2) == [200, 429]
    assert statuses(client, "/api/search/", 2) == [200, 429]
    assert statuses(client, "/plain/1/", 1) == [200]
    assert statuses(client, "/plain/2/", 1) == [429]  # one unnamed pattern, one counter
    assert statuses(client, "/nowhere/", 1) == [404]
    assert statuses(client, "/elsewhere/", 1) == [429]  # every unresolved path is "-"
    assert django_quota.peek("per_view", {"route": "plain/<int:pk>/"}).remaining == 0


def test_a_path_is_resolved_once_for_the_routes_and_the_route_dimension(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The middleware's matching resolves the path; the step reads the route dimension
    # from the same resolution, kept in request._quota.
    quota(
        CLOCK=CLOCK,
        POLICIES={
            "per_view": {**API, "routes": ["api:items"], "selector": ["route"], "windows": "1/m"}
        },
    )
    resolved: list[str] = []
    resolve = routes.resolve

    def counting(path: str, urlconf: Any = None) -> Any:
        resolved.append(path)
        return resolve(path, urlconf=urlconf)

    monkeypatch.setattr(routes, "resolve", counting)
    assert statuses(Client(), "/api/items/", 2) == [200, 429]
    assert resolved == ["/api/items/", "/api/items/"]
    assert django_quota.peek("per_view", {"route": "api:items"}).remaining == 0


@pytest.mark.parametrize("selector", [["ip"], ["auto"]])
@pytest.mark.parametrize("on_missing", ["deny", "skip"])
def test_unparseable_client_address_is_refused_as_invalid_identity(
    quota: Any, selector: list[str], on_missing: str
) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "selector": selector, "on_missing": on_missing}})
    response = Client(REMOTE_ADDR="garbage").get("/api/items/")
    assert response.status_code == 429
    assert "Retry-After" not in response
    body = problem(response)
    assert (body["reason"], body["policy"], body["retry_after"]) == (
        "selector_identity_invalid",
        "api",
        None,
    )
    assert recorded(response) == [("api", "denied", "selector_identity_invalid")]


def test_unparseable_forwarded_address_from_a_trusted_proxy_is_invalid(quota: Any) -> None:
    quota(CLOCK=CLOCK, TRUSTED_PROXIES=["10.0.0.0/8"], POLICIES={"api": API})
    client = Client(REMOTE_ADDR="10.1.2.3", HTTP_X_FORWARDED_FOR="198.51.100.7, garbage")
    response = client.get("/api/items/")
    assert response.status_code == 429
    assert problem(response)["reason"] == "selector_identity_invalid"


def test_cost_above_max_cost_is_refused_without_retry_after(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "max_cost": 0}})
    response = Client().get("/api/items/")
    assert response.status_code == 429
    assert "Retry-After" not in response
    assert rate_limit_headers(response) == {}
    body = problem(response)
    assert (body["reason"], body["retry_after"], body["violated-policies"]) == (
        "cost_exceeds_limit",
        None,
        [],
    )
    assert body["detail"] == "The request costs more than policy api can ever admit."


def test_identity_error_refuses_the_group_and_charges_no_policy(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        POLICIES={"members": {**API, "selector": ["user"]}, "api": API},
    )
    response = Client().get("/api/items/")
    assert response.status_code == 429
    assert problem(response)["policy"] == "members"
    assert django_quota.peek("api", {"ip": "127.0.0.1"}).remaining == 3


# -- 6. the async path -------------------------------------------------------------------------
def arecorded(response: Any) -> list[tuple[str, str, str | None]]:
    return [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(response.asgi_request)]


@pytest.mark.parametrize("path", ["/api/async/", "/api/items/"])
def test_async_client_gets_the_same_200_then_429(quota: Any, path: str) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": API})

    async def scenario() -> None:
        client = AsyncClient()
        for remaining in (2, 1, 0):
            response = await client.get(path)
            assert response.status_code == 200
            assert arecorded(response) == [("api", "allowed", None)]
            assert ietf(response)[1] == [("api", {"r": remaining, "t": 40})]
        response = await client.get(path)
        assert response.status_code == 429
        assert response["Retry-After"] == "40"
        assert problem(response)["violated-policies"] == ["api"]

    async_to_sync(scenario)()


@pytest.mark.redis
def test_async_client_on_redis_gets_the_same_200_then_429(quota: Any, redis_url: str) -> None:
    quota(REDIS_URL=redis_url, CLOCK=CLOCK, POLICIES={"api": API})

    async def scenario() -> list[int]:
        client = AsyncClient()
        return [(await client.get("/api/async/")).status_code for _ in range(4)]

    assert async_to_sync(scenario)() == [200, 200, 200, 429]
    assert django_quota.peek("api", {"ip": "127.0.0.1"}).remaining == 0


def test_async_path_fails_closed_and_open(quota: Any) -> None:
    quota(
        REDIS_URL=dead_redis_url(),
        POLICIES={
            "strict": {**API, "routes": ["/api/async"], "failure_mode": "closed"},
            "lenient": {**API, "routes": ["/async"], "failure_mode": "open"},
        },
    )

    async def scenario() -> None:
        client = AsyncClient()
        response = await client.get("/api/async/")
        assert response.status_code == 503
        assert response["Retry-After"] == "1"
        assert problem(response)["reason"] == "backend_unavailable"
        response = await client.get("/async/")
        assert response.status_code == 200
        assert arecorded(response) == [("lenient", "failed_open", "backend_unavailable")]

    async_to_sync(scenario)()


def test_async_path_reports_identity_errors(quota: Any) -> None:
    # AsyncClient's address is the scope's "client" (127.0.0.1): send a bad forwarded one.
    quota(CLOCK=CLOCK, TRUSTED_PROXIES=["127.0.0.0/8"], POLICIES={"api": API})

    async def scenario() -> None:
        response = await AsyncClient().get(
            "/api/async/", headers={"X-Forwarded-For": "garbage"}
        )
        assert response.status_code == 429
        assert "Retry-After" not in response
        assert problem(response)["reason"] == "selector_identity_invalid"

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_async_path_counts_a_session_user(quota: Any, django_user_model: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"members": {**API, "selector": ["user"], "windows": "2/m"}})
    user = django_user_model.objects.create_user("carol")

    async def scenario() -> list[int]:
        client = AsyncClient()
        await sync_to_async(client.force_login)(user)  # aforce_login is Django 5.0+
        return [(await client.get("/api/async/")).status_code for _ in range(3)]

    assert async_to_sync(scenario)() == [200, 200, 429]
    assert django_quota.peek("members", {"user": str(user.pk)}).remaining == 0


# -- 7. DENIED_VIEW ----------------------------------------------------------------------------
def test_denied_view_replaces_the_body_and_keeps_retry_after(quota: Any) -> None:
    quota(CLOCK=CLOCK, DENIED_VIEW="tests.urls.denied", POLICIES={"api": {**API, "windows": "1/m"}})
    client = Client()
    assert statuses(client, "/api/items/", 1) == [200]
    response = client.get("/api/items/")
    assert response.status_code == 429
    assert response["Content-Type"] == "text/plain"
    assert response.content == b"slow down: api default_quota_exhausted"
    assert response["Retry-After"] == "40"
    assert ietf(response)[1] == [("api", {"r": 0, "t": 40})]


def test_denied_view_builds_identity_refusals_without_retry_after(quota: Any) -> None:
    quota(CLOCK=CLOCK, DENIED_VIEW="tests.urls.denied", POLICIES={"api": API})
    response = Client(REMOTE_ADDR="garbage").get("/api/items/")
    assert response.content == b"slow down: api selector_identity_invalid"
    assert "Retry-After" not in response


@pytest.mark.parametrize("client_class", [Client, AsyncClient])
def test_async_denied_view_is_awaited(quota: Any, client_class: Any) -> None:
    quota(
        CLOCK=CLOCK, DENIED_VIEW="tests.urls.adenied", POLICIES={"api": {**API, "windows": "1/m"}}
    )

    async def scenario() -> Any:
        client = AsyncClient()
        await client.get("/api/async/")
        return await client.get("/api/async/")

    if client_class is Client:
        client = Client()
        client.get("/api/items/")
        response = client.get("/api/items/")
    else:
        response = async_to_sync(scenario)()
    assert response.status_code == 429
    assert response.content == b"async slow down: api"
    assert response["Retry-After"] == "40"


@pytest.mark.django_db(transaction=True)
def test_async_path_runs_denied_view_and_signal_receivers_outside_the_event_loop(
    quota: Any, django_user_model: Any
) -> None:
    django_user_model.objects.create_user("dave")
    quota(
        CLOCK=CLOCK,
        DENIED_VIEW="tests.urls.denied_from_database",
        POLICIES={"api": {**API, "windows": "1/m"}},
    )
    counted: list[int] = []

    def receiver(sender: Any, request: Any, outcome: Any, **kwargs: Any) -> None:
        counted.append(django_user_model.objects.count())

    async def scenario() -> Any:
        client = AsyncClient()
        await client.get("/api/async/")
        return await client.get("/api/async/")

    quota_denied.connect(receiver)
    try:
        response = async_to_sync(scenario)()
    finally:
        quota_denied.disconnect(receiver)
    assert response.status_code == 429
    assert response.content == b"users: 1"
    assert counted == [1]


def retry_after_99(request: Any, outcome: Any) -> HttpResponse:
    response = HttpResponse("later", status=429)
    response["Retry-After"] = "99"
    return response


def test_denied_view_retry_after_wins(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        DENIED_VIEW="tests.test_middleware.retry_after_99",
        POLICIES={"api": {**API, "windows": "1/m"}},
    )
    assert [r["Retry-After"] for r in [Client().get("/api/items/") for _ in range(2)][1:]] == [
        "99"
    ]


# -- 8. policies decided together --------------------------------------------------------------
@pytest.mark.parametrize("backend", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_denial_by_one_policy_charges_no_other_policy_of_the_layer(
    quota: Any, request: pytest.FixtureRequest, backend: str
) -> None:
    extra = {"REDIS_URL": request.getfixturevalue("redis_url")} if backend == "redis" else {}
    quota(
        CLOCK=CLOCK,
        POLICIES={
            "tight": {**API, "windows": "1/m"},
            "loose": {**API, "windows": "5/m"},
        },
        **extra,
    )
    subject = {"ip": "127.0.0.1"}
    client = Client()
    assert django_quota.peek("loose", subject).remaining == 5
    assert statuses(client, "/api/items/", 1) == [200]
    assert django_quota.peek("loose", subject).remaining == 4
    assert django_quota.peek("tight", subject).remaining == 0
    for _ in range(3):
        response = client.get("/api/items/")
        assert response.status_code == 429
        assert problem(response)["policy"] == "tight"
        assert django_quota.peek("loose", subject).remaining == 4
    assert [(o.policy, o.decision) for o in django_quota.outcomes(response.wsgi_request)] == [
        ("tight", "denied"),
        ("loose", "allowed"),
    ]
    assert ietf(response)[1] == [("tight", {"r": 0, "t": 40}), ("loose", {"r": 4, "t": 40})]


def test_allowed_request_charges_every_policy_of_the_layer(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"one": API, "two": {**API, "routes": ["api:*"]}})
    assert statuses(Client(), "/api/items/", 2) == [200, 200]
    assert django_quota.peek("one", {"ip": "127.0.0.1"}).remaining == 1
    assert django_quota.peek("two", {"ip": "127.0.0.1"}).remaining == 1
