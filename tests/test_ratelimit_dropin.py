"""``django_quota.ratelimit``: django-ratelimit 4.x's API on the engine
(docs/django-ratelimit.md). django-ratelimit's own tests run in ``scripts/ratelimit-tests``;
these hold what they do not: async views, the 403/429 answers, peeks, where counters
live, failure modes on a dead Redis, pseudonymised keys and exactness under concurrency.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import threading
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.cache import InvalidCacheBackendError
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import RequestFactory
from django.urls import path

from django_quota import conf, limiter, outcomes
from django_quota.ratelimit import ALL, UNSAFE
from django_quota.ratelimit.core import aget_usage, get_usage, is_ratelimited
from django_quota.ratelimit.decorators import ratelimit
from django_quota.ratelimit.exceptions import Ratelimited

rf = RequestFactory()
IP = "203.0.113.77"


class User:
    """An authenticated user as ``request.user`` offers it."""

    is_authenticated = True

    def __init__(self, pk: int) -> None:
        self.pk = pk


def get(ip: str = IP, **extra: Any) -> Any:
    request = rf.get("/", REMOTE_ADDR=ip, **extra)
    request.user = AnonymousUser()
    return request


def limited(view: Any, requests: list[Any]) -> list[bool]:
    found = []
    for request in requests:
        view(request)
        found.append(request.limited)
    return found


# -- views of this module (their default group is their dotted name) ----------------------
@ratelimit(key="ip", rate="2/m", block=False)
def login_view(request: Any) -> HttpResponse:
    return HttpResponse("limited" if request.limited else "ok")


@ratelimit(key="ip", rate="1/m")
def blocking_view(request: Any) -> HttpResponse:
    return HttpResponse("ok")


@ratelimit(key="ip", rate="1/m", block=False)
async def async_view(request: Any) -> HttpResponse:
    return HttpResponse("limited" if request.limited else "ok")


@ratelimit(key="ip", rate="1/m")
async def async_blocking_view(request: Any) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [
    path("blocking/", blocking_view),
    path("async-blocking/", async_blocking_view),
    path("login/", login_view),
]


def key_fn(group: str, request: Any) -> str:
    return request.META["HTTP_X_TENANT"]


def rate_fn(group: str, request: Any) -> str | None:
    return {"gold": "3/m", "free": "1/m", "hourly": "2/h"}.get(request.GET.get("plan", ""))


# -- the decorator -------------------------------------------------------------------------
def test_block_false_sets_request_limited_after_the_rate() -> None:
    assert limited(login_view, [get(), get(), get(), get("198.51.100.1")]) == [
        False,
        False,
        True,
        False,
    ]


def test_block_true_raises_ratelimited_with_the_refusing_outcome() -> None:
    assert blocking_view(get()).status_code == 200
    with pytest.raises(Ratelimited) as raised:
        blocking_view(get())
    outcome = raised.value.outcome
    assert outcome is not None
    assert (outcome.policy, outcome.decision, outcome.reason) == (
        "ratelimit:tests.test_ratelimit_dropin.blocking_view",
        "denied",
        "default_quota_exhausted",
    )
    assert outcome.limit == 1 and outcome.remaining == 0


@pytest.mark.urls("tests.test_ratelimit_dropin")
def test_django_answers_403_for_a_blocked_request(client: Any) -> None:
    assert client.get("/blocking/").status_code == 200
    assert client.get("/blocking/").status_code == 403
    assert client.get("/async-blocking/").status_code == 200
    assert client.get("/async-blocking/").status_code == 403


@pytest.mark.urls("tests.test_ratelimit_dropin")
def test_ratelimit_view_answers_through_the_middleware(client: Any, settings: Any) -> None:
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE,
        "django_quota.ratelimit.middleware.RatelimitMiddleware",
    ]
    settings.RATELIMIT_VIEW = "django_quota.ratelimit.views.too_many_requests"
    assert client.get("/blocking/").status_code == 200
    refused = client.get("/blocking/")
    assert refused.status_code == 429
    assert refused["Content-Type"] == "application/problem+json"
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert refused.json()["policy"] == "ratelimit:tests.test_ratelimit_dropin.blocking_view"


@pytest.mark.urls("tests.test_ratelimit_dropin")
def test_the_middleware_writes_the_headers_of_the_decision(client: Any) -> None:
    response = client.get("/login/")
    assert response.content == b"ok"
    assert (
        response["RateLimit-Policy"]
        == '"ratelimit:tests.test_ratelimit_dropin.login_view";q=2;w=60'
    )
    assert response["RateLimit"].startswith(
        '"ratelimit:tests.test_ratelimit_dropin.login_view";r=1;t='
    )


def test_async_views_are_limited_on_the_engine() -> None:
    first, second = get(), get()
    assert asyncio.run(async_view(first)).content == b"ok"
    assert asyncio.run(async_view(second)).content == b"limited"
    assert second.limited is True
    with pytest.raises(Ratelimited):
        asyncio.run(async_blocking_view(get()))
        asyncio.run(async_blocking_view(get()))
    assert [o.decision for o in outcomes(second)] == ["denied"]


def test_an_earlier_limit_stays_on_the_request() -> None:
    @ratelimit(key="ip", rate="1/m", block=False, group="strict")
    @ratelimit(key="ip", rate="5/m", block=False, group="lenient")
    def view(request: Any) -> bool:
        return bool(request.limited)

    assert [view(get()) for _ in range(3)] == [False, True, True]


def test_stacked_rates_of_one_group_count_apart() -> None:
    @ratelimit(key="ip", rate="3/m", block=False, group="login")
    @ratelimit(key="post:username", rate="1/m", block=False, group="login")
    def view(request: Any) -> bool:
        return bool(request.limited)

    def post(username: str) -> Any:
        return rf.post("/", {"username": username}, REMOTE_ADDR=IP)

    assert [view(post(name)) for name in ("ann", "ann", "bob", "cid")] == [
        False,
        True,  # ann's second try
        False,  # bob's first: the ip's counter holds 3
        True,  # the ip's fourth
    ]


def test_the_default_group_is_the_views_dotted_name() -> None:
    request = get()
    login_view(request)
    assert [o.policy for o in outcomes(request)] == [
        "ratelimit:tests.test_ratelimit_dropin.login_view"
    ]
    assert get_usage(get(), fn=login_view.__wrapped__, key="ip", rate="2/m")["count"] == 1


# -- keys ----------------------------------------------------------------------------------
def usage(request: Any, key: Any, rate: Any = "1/m", **kwargs: Any) -> bool:
    return is_ratelimited(request, group="g", key=key, rate=rate, increment=True, **kwargs)


def test_key_ip_uses_remote_addr_and_the_masks(settings: Any) -> None:
    assert [usage(get(), "ip"), usage(get(), "ip"), usage(get("203.0.113.78"), "ip")] == [
        False,
        True,
        False,
    ]
    settings.RATELIMIT_IPV4_MASK = 24
    assert [usage(get("192.0.2.1"), "ip"), usage(get("192.0.2.200"), "ip")] == [False, True]


def test_key_user_and_user_or_ip() -> None:
    def as_user(pk: int | None) -> Any:
        request = get()
        request.user = User(pk) if pk is not None else AnonymousUser()
        return request

    assert [usage(as_user(1), "user"), usage(as_user(1), "user"), usage(as_user(2), "user")] == [
        False,
        True,
        False,
    ]
    assert [
        usage(as_user(7), "user_or_ip"),
        usage(as_user(None), "user_or_ip"),  # anonymous: by ip
        usage(as_user(None), "user_or_ip"),
        usage(as_user(7), "user_or_ip"),
    ] == [False, False, True, True]


def test_accessor_keys_get_post_and_header() -> None:
    assert [usage(rf.get("/?q=a"), "get:q"), usage(rf.get("/?q=a"), "get:q")] == [False, True]
    assert usage(rf.get("/?q=b"), "get:q") is False
    assert [
        usage(rf.post("/", {"u": "x"}), "post:u"),
        usage(rf.post("/", {"u": "x"}), "post:u"),
    ] == [
        False,
        True,
    ]
    headers = {"HTTP_X_REAL_IP": "10.0.0.1"}
    assert [usage(rf.get("/", **headers), "header:x-real-ip") for _ in range(2)] == [False, True]
    # An absent header, parameter or field is the empty value: one shared counter.
    assert [usage(rf.get("/"), "header:x-missing") for _ in range(2)] == [False, True]


def test_callable_and_dotted_keys() -> None:
    def tenant(acme: str) -> Any:
        return rf.get("/", HTTP_X_TENANT=acme)

    assert [usage(tenant("acme"), key_fn), usage(tenant("acme"), key_fn)] == [False, True]
    dotted = "tests.test_ratelimit_dropin.key_fn"
    assert [usage(tenant("umbrella"), dotted), usage(tenant("umbrella"), dotted)] == [False, True]


def test_an_unknown_key_or_no_key_or_a_bad_rate_is_a_clear_error() -> None:
    with pytest.raises(ImproperlyConfigured, match="Unknown ratelimit key: cookie:x"):
        usage(get(), "cookie:x")
    with pytest.raises(ImproperlyConfigured, match="Could not understand ratelimit key"):
        usage(get(), "nonsense")
    with pytest.raises(ImproperlyConfigured, match="Ratelimit key must be specified"):
        usage(get(), None)
    with pytest.raises(ImproperlyConfigured, match="Invalid ratelimit rate 'ten/m'"):
        usage(get(), "ip", rate="ten/m")
    with pytest.raises(ImproperlyConfigured, match="Invalid ratelimit rate 1/31708800s"):
        usage(get(), "ip", rate="1/367d")


def test_a_tuple_rate_of_two_integers_works_like_its_string() -> None:
    assert [usage(get(), "ip", rate=(2, 60)) for _ in range(3)] == [False, False, True]
    assert [usage(get(), "ip", rate=lambda group, request: (1, 3600)) for _ in range(2)] == [
        False, True
    ]


@pytest.mark.parametrize(
    "rate", [(5, "60"), ("5", 60), (5,), (5, 60, 1), (5.0, 60), (True, 60), (5, 60.5)]
)
def test_a_tuple_rate_that_is_not_two_integers_is_a_clear_error(rate: Any) -> None:
    with pytest.raises(ImproperlyConfigured) as raised:
        usage(get(), "ip", rate=rate)
    assert str(raised.value) == (
        f"Invalid ratelimit rate {rate!r}: a tuple rate is (count, seconds), two integers "
        "such as (100, 3600); or use a string such as '100/h'"
    )


def test_an_address_that_does_not_parse_is_an_invalid_identity_not_a_500(settings: Any) -> None:
    settings.RATELIMIT_IP_META_KEY = "HTTP_X_CLIENT_IP"
    request = get(HTTP_X_CLIENT_IP="not-an-address")
    found = get_usage(request, group="g", key="ip", rate="5/m", increment=True)
    assert found is not None and found["should_limit"] is True
    assert [(o.decision, o.reason) for o in outcomes(request)] == [
        ("denied", "selector_identity_invalid")
    ]


# -- rates ---------------------------------------------------------------------------------
def test_callable_and_dotted_rates_choose_the_limit_per_request() -> None:
    def plan(name: str) -> Any:
        return rf.get(f"/?plan={name}", REMOTE_ADDR=IP)

    for rate in (rate_fn, "tests.test_ratelimit_dropin.rate_fn"):
        group = "callable" if callable(rate) else "dotted"

        def run(name: str, times: int, rate: Any = rate, group: str = group) -> list[bool]:
            return [
                is_ratelimited(plan(name), group=group, key="ip", rate=rate, increment=True)
                for _ in range(times)
            ]

        # One group, one counter per period (docs/plans.md): the 3 units used at "3/m"
        # are over "1/m"; a rate of another period counts apart. (django-ratelimit's
        # cache key holds the rate: there, "1/m" would start afresh.)
        assert (run("gold", 4), run("free", 2), run("hourly", 3), run("none", 3)) == (
            [False, False, False, True],
            [True, True],
            [False, False, True],
            [False] * 3,
        )


def test_a_rate_of_zero_limits_without_a_counter() -> None:
    assert get_usage(get(), group="g", key="ip", rate="0/m", increment=True) == {
        "count": 1,
        "limit": 0,
        "should_limit": True,
        "time_left": 60,
    }


# -- methods -------------------------------------------------------------------------------
def test_methods_all_unsafe_and_lists() -> None:
    def call(method: str, limit_methods: Any) -> bool:
        request = rf.generic(method, "/", REMOTE_ADDR=IP)
        return is_ratelimited(
            request, group="m", key="ip", rate="0/m", method=limit_methods, increment=True
        )

    assert [
        call(m, UNSAFE) for m in ("GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE")
    ] == [
        False,
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    assert [call(m, ALL) for m in ("GET", "POST")] == [True, True]
    assert [call(m, ["get", "Put"]) for m in ("GET", "PUT", "POST")] == [True, True, False]
    assert is_ratelimited.ALL is ALL and ratelimit.UNSAFE is UNSAFE  # type: ignore[attr-defined]


def test_a_method_list_and_its_reordering_share_a_counter_other_lists_do_not() -> None:
    def call(methods: Any) -> bool:
        return is_ratelimited(
            rf.get("/", REMOTE_ADDR=IP), group="m", key="ip", rate="1/m", method=methods,
            increment=True,
        )  # fmt: skip

    assert [call(["GET", "POST"]), call(["POST", "GET"]), call("GET"), call(ALL)] == [
        False,
        True,
        False,
        False,
    ]


# -- peeks and usage -----------------------------------------------------------------------
def test_increment_false_counts_nothing_and_says_whether_the_next_request_is_limited() -> None:
    def peek() -> dict[str, Any] | None:
        return get_usage(get(), group="p", key="ip", rate="2/m")

    for _ in range(5):
        assert is_ratelimited(get(), group="p", key="ip", rate="2/m") is False
    first = peek()
    assert first is not None and (first["count"], first["limit"], first["should_limit"]) == (
        0,
        2,
        False,
    )
    assert 0 < first["time_left"] <= 60
    counted = [get_usage(get(), group="p", key="ip", rate="2/m", increment=True) for _ in range(3)]
    assert [(u["count"], u["should_limit"]) for u in counted if u] == [
        (1, False),
        (2, False),
        (3, True),
    ]
    after = peek()
    assert after is not None and (after["count"], after["should_limit"]) == (3, True)


def test_peeks_record_nothing_on_the_request() -> None:
    request = get()
    assert is_ratelimited(request, group="p", key="ip", rate="2/m") is False
    assert outcomes(request) == []


def test_async_get_usage() -> None:
    found = [
        asyncio.run(aget_usage(get(), group="a", key="ip", rate="1/m", increment=True))
        for _ in range(2)
    ]
    assert [u["should_limit"] for u in found if u] == [False, True]


# -- settings ------------------------------------------------------------------------------
def test_ratelimit_enable_false_limits_nothing(settings: Any) -> None:
    settings.RATELIMIT_ENABLE = False
    assert limited(login_view, [get() for _ in range(4)]) == [False] * 4
    assert get_usage(get(), group="g", key="ip", rate="1/m", increment=True) is None


def test_exception_class_setting(settings: Any) -> None:
    settings.RATELIMIT_EXCEPTION_CLASS = "django.core.exceptions.SuspiciousOperation"
    from django.core.exceptions import SuspiciousOperation

    blocking_view(get())
    with pytest.raises(SuspiciousOperation):
        blocking_view(get())


def test_a_use_cache_naming_no_cache_raises(settings: Any) -> None:
    settings.RATELIMIT_USE_CACHE = "nowhere"
    with pytest.raises(InvalidCacheBackendError, match="'nowhere'"):
        blocking_view(get())


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.urls("tests.test_ratelimit_dropin")
@pytest.mark.parametrize("fail_open", [True, False])
def test_a_dead_redis_fails_as_ratelimit_fail_open_says_never_500(
    client: Any, quota: Any, settings: Any, fail_open: bool
) -> None:
    quota(REDIS_URL=f"redis://127.0.0.1:{closed_port()}/0", TIMEOUT=0.05, DEADLINE=0.1)
    settings.RATELIMIT_FAIL_OPEN = fail_open
    assert [client.get("/blocking/").status_code for _ in range(3)] == (
        [200] * 3 if fail_open else [403] * 3
    )
    found = get_usage(get(), group="g", key="ip", rate="1/m", increment=True)
    if fail_open:
        assert found is None
    else:
        assert found == {"count": 0, "limit": 0, "should_limit": True, "time_left": -1}


# -- where counters live -------------------------------------------------------------------
def test_without_quota_a_django_redis_use_cache_holds_the_counters(
    settings: Any, redis_url: str, redis_client: Any
) -> None:
    del settings.QUOTA
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "limits": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_url},
    }
    settings.RATELIMIT_USE_CACHE = "limits"
    conf.clear()  # ``del settings.X`` sends no setting_changed
    assert limited(login_view, [get() for _ in range(3)]) == [False, False, True]
    assert conf.get_settings().cache_alias == "limits"
    assert limiter.get_limiter().backend_mode == "redis"
    assert len(redis_client.keys("quota:*")) == 1


@pytest.mark.parametrize(
    "backend",
    [
        "django.core.cache.backends.memcached.PyMemcacheCache",
        "django.core.cache.backends.locmem.LocMemCache",
        "django.core.cache.backends.redis.RedisCache",
    ],
)
def test_without_quota_any_other_use_cache_means_the_memory_backend(
    settings: Any, backend: str
) -> None:
    del settings.QUOTA
    settings.CACHES = {"default": {"BACKEND": backend, "LOCATION": "redis://127.0.0.1:1/0"}}
    conf.clear()
    assert conf.get_settings().backend == "memory"
    assert limited(login_view, [get() for _ in range(3)]) == [False, False, True]


def test_quota_wins_over_use_cache(settings: Any, quota: Any) -> None:
    settings.CACHES = {
        "default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://h:1/0"}
    }
    quota()
    assert conf.get_settings().backend == "memory"


# -- Redis: pseudonyms and exactness -------------------------------------------------------
def test_redis_keys_hold_pseudonyms_never_the_key_value(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    quota(REDIS_URL=redis_url)
    assert limited(login_view, [get() for _ in range(3)]) == [False, False, True]
    is_ratelimited(rf.post("/", {"username": "alice@example.com"}), group="login",
                   key="post:username", rate="5/m", increment=True)  # fmt: skip
    keys = [key.decode() for key in redis_client.keys("*")]
    assert len(keys) == 2
    assert all(key.startswith("quota:{v1.") for key in keys)
    for secret in (IP, "alice", "example.com"):
        assert not any(secret in key for key in keys)
    for key in keys:
        values = redis_client.hgetall(key) if redis_client.type(key) == b"hash" else {}
        assert not any(IP.encode() in field + value for field, value in values.items())


RATE = "100/h"
TOTAL = 400


@ratelimit(key="ip", rate=RATE, block=False)
def counted_view(request: Any) -> HttpResponse:
    return HttpResponse("limited" if request.limited else "ok")


def admitted(count: int, threads: int) -> int:
    """Send ``count`` requests from ``threads`` threads; how many were not limited."""
    results: list[bool] = []
    lock = threading.Lock()

    def work(share: int) -> None:
        mine = [counted_view(get()).content == b"ok" for _ in range(share)]
        with lock:
            results.extend(mine)

    workers = [threading.Thread(target=work, args=(count // threads,)) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(results) == count
    return sum(results)


def test_exact_under_threads_on_redis(quota: Any, redis_url: str) -> None:
    quota(REDIS_URL=redis_url, TIMEOUT=5.0, DEADLINE=10.0)
    assert admitted(TOTAL, threads=8) == 100
    assert limiter.recent_errors() == []


def _process(queue: Any) -> None:
    queue.put(admitted(TOTAL // 4, threads=2))


def test_exact_under_processes_on_redis(quota: Any, redis_url: str) -> None:
    quota(REDIS_URL=redis_url, TIMEOUT=5.0, DEADLINE=10.0)
    conf.get_settings()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_process, args=(queue,)) for _ in range(4)]
    for process in processes:
        process.start()
    counts = [queue.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert sum(counts) == 100


def test_core_keeps_the_names_django_ratelimits_core_has() -> None:
    """django-ratelimit's own tests (the CI lane) and projects import these from ``core``."""
    from django_quota.ratelimit import core, keys

    assert (core._get_ip, core.user_or_ip, core.get_header) == (
        keys._get_ip,
        keys.user_or_ip,
        keys.get_header,
    )
    assert core._SIMPLE_KEYS["user_or_ip"] is keys.user_or_ip
    assert core._ACCESSOR_KEYS["header"] is keys.get_header
    assert core._split_rate("5/m") == (5, 60)
