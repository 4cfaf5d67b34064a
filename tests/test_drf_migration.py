"""Migrating from DRF's throttles: DRF's well-known throttling scenarios, run once against
``rest_framework.throttling`` and once against ``django_quota.throttling``, the same
code with only the module swapped (a project switches by changing its imports).

The scenarios re-create those of DRF's own ``tests/test_throttling.py`` from its
documented behaviour, with its ``timer`` seam (a class attribute ``timer = lambda self:
value``) and ``APIRequestFactory`` requests sent straight to the view.

The implementations running each scenario: ``drf`` (DRF's classes, a sliding log in the
cache), ``log`` (ours with the default ``DRF_ALGORITHM``, ``sliding_log``) on the memory
backend and ``log-redis``, the same on a real Redis, ``fixed`` (ours with
``DRF_ALGORITHM = "fixed_window"``) and ``sliding`` (ours with ``sliding_window``). The
sliding log is DRF's own algorithm, so ``log`` and ``log-redis`` must give DRF's
statuses and ``Retry-After`` exactly. DRF's timer starts at 0, on a window boundary, so
wherever DRF's log and a fixed window agree (every scenario here), ``fixed`` must give
them too. The sliding window counter legitimately differs: just after a window boundary
it still weighs the whole previous window (docs/arithmetic.md), so it refuses where DRF's log
(which forgets requests one by one) and a fixed window (which forgets all at once)
admit, and its ``retry_after`` is 1 ms after the boundary. Those expectations are
computed from that arithmetic and commented where they appear.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import rest_framework.throttling as drf_throttling
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory, force_authenticate
from rest_framework.views import APIView

import django_quota.throttling as quota_throttling

pytestmark = pytest.mark.django_db

DRF, LOG, LOG_REDIS, FIXED, SLIDING = "drf", "log", "log-redis", "fixed", "sliding"


class Impl:
    """One implementation of the throttling module, and its name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module: types.ModuleType = drf_throttling if name == DRF else quota_throttling

    def expect(self, same: Any, sliding: Any) -> Any:
        """DRF's value (the sliding log and ``fixed`` give the same), or the sliding
        window counter's."""
        return sliding if self.name == SLIDING else same


@pytest.fixture(params=[DRF, LOG, LOG_REDIS, FIXED, SLIDING])
def impl(request: pytest.FixtureRequest, quota: Any) -> Impl:
    cache.clear()  # DRF's throttles keep their history in the default cache
    if request.param == LOG_REDIS:
        # The default algorithm; time budgets no busy machine reaches: these tests pin the
        # throttles' arithmetic, not the latency (a 503 under both cores busy, once).
        quota(REDIS_URL=request.getfixturevalue("redis_url"), TIMEOUT=2.0, DEADLINE=5.0)
    elif request.param == LOG:
        quota()
    else:
        algorithm = "sliding_window" if request.param == SLIDING else "fixed_window"
        quota(DRF_ALGORITHM=algorithm)
    return Impl(request.param)


@pytest.fixture(params=[DRF, FIXED])
def fixed_impl(request: pytest.FixtureRequest, quota: Any) -> Impl:
    cache.clear()
    quota(DRF_ALGORITHM="fixed_window")
    return Impl(request.param)


factory = APIRequestFactory()


def throttle_class(base: type, name: str, **attributes: Any) -> type[drf_throttling.BaseThrottle]:
    return type(name, (base,), attributes)


def view_class(*throttles: type, **attributes: Any) -> type[APIView]:
    def get(self: Any, request: Any) -> Response:
        return Response("foo")

    return type("MockView", (APIView,), {"throttle_classes": throttles, "get": get, **attributes})


def set_throttle_timer(view: type[APIView], value: float) -> None:
    """DRF's seam: explicitly set the timer, overriding time.time()."""
    for cls in view.throttle_classes:
        cls.timer = lambda self: value  # type: ignore[attr-defined]


def user_throttles(impl: Impl) -> dict[str, type]:
    user = impl.module.UserRateThrottle
    return {
        "3sec": throttle_class(user, "User3SecRateThrottle", rate="3/sec", scope="seconds"),
        "3min": throttle_class(user, "User3MinRateThrottle", rate="3/min", scope="minutes"),
        "6min": throttle_class(user, "User6MinRateThrottle", rate="6/min", scope="minutes"),
    }


def retry_afters(
    view: type[APIView], timeline: Iterable[float], request: Any = None
) -> list[str | None]:
    """Send one request at each timer value; the ``Retry-After`` of each (None: 200)."""
    request = request or factory.get("/")
    found = []
    for moment in timeline:
        set_throttle_timer(view, moment)
        response = view.as_view()(request)
        assert (response.status_code == 429) == ("Retry-After" in response)
        found.append(response.get("Retry-After"))
    return found


# -- ThrottlingTests ---------------------------------------------------------------------------
def test_requests_are_throttled(impl: Impl) -> None:
    view = view_class(user_throttles(impl)["3sec"])
    set_throttle_timer(view, 0)
    request = factory.get("/")
    codes = [view.as_view()(request).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]


def test_request_throttling_expires(impl: Impl) -> None:
    view = view_class(user_throttles(impl)["3sec"])
    set_throttle_timer(view, 0)
    request = factory.get("/")
    for _ in range(4):
        response = view.as_view()(request)
    assert response.status_code == 429
    # Advance the timer by one second.
    set_throttle_timer(view, 1)
    # Sliding: at 1.000 s the 3 requests of [0, 1) weigh in full (elapsed 0); 1 ms later
    # floor(3 * 999 / 1000) = 2 and the request passes.
    assert view.as_view()(request).status_code == impl.expect(200, 429)
    set_throttle_timer(view, 1.001)
    assert view.as_view()(request).status_code == 200


def test_request_throttling_is_per_user(impl: Impl) -> None:
    view = view_class(user_throttles(impl)["3sec"])
    set_throttle_timer(view, 0)
    request = factory.get("/")
    request.user = get_user_model().objects.create(username="a")
    for _ in range(3):
        view.as_view()(request)
    request.user = get_user_model().objects.create(username="b")
    assert view.as_view()(request).status_code == 200


def test_request_throttling_multiple_throttles(impl: Impl) -> None:
    throttles = user_throttles(impl)
    view = view_class(throttles["3sec"], throttles["6min"])
    request = factory.get("/")
    # 4 requests in one second: the 4th is refused by 3/sec and still charged by 6/min
    # (DRF asks every throttle). Sliding: the 3/sec refusal waits 1.001 s, rounded up.
    assert retry_afters(view, [0, 0, 0, 0], request)[-1] == impl.expect("1", "2")
    if impl.name == SLIDING:
        # At 1.000 s the 3/sec window still weighs 3 (refused, 1 ms to wait), while
        # 6/min admits and charges its 5th; at 1.001 s both admit (6th), then 6/min
        # refuses: 1 ms into the next minute its 6 requests still weigh floor(6 *
        # 59999 / 60000) = 5, so the wait is 60.001 - 1.001 = 59 s, exactly.
        assert retry_afters(view, [1, 1.001, 1.001], request) == ["1", None, "59"]
    else:
        # Advancing one second, the client may make 2 more before 6/min refuses.
        assert retry_afters(view, [1, 1, 1], request) == [None, None, "59"]
    # Just to make sure, check again after two more seconds. Sliding: 6/min waits for
    # 1 ms into the next minute, 58.001 s, rounded up.
    assert retry_afters(view, [2], request) == [impl.expect("58", "59")]


def test_throttle_rate_change_negative(impl: Impl) -> None:
    throttles = user_throttles(impl)
    view = view_class(throttles["3sec"], throttles["6min"])
    request = factory.get("/")
    set_throttle_timer(view, 0)
    for _ in range(24):
        response = view.as_view()(request)
    # Sliding: 6 requests counted at 0 s weigh 6 until 1 ms into the next minute.
    assert response["Retry-After"] == impl.expect("60", "61")
    # A lower rate: DRF's history still holds 3 requests; ours is a new revision (fresh
    # counters), so the first request passes 1/sec, and 6/min refuses anyway.
    throttles["3sec"].rate = "1/sec"  # type: ignore[attr-defined]
    for _ in range(24):
        response = view.as_view()(request)
    assert response.status_code == 429
    assert response["Retry-After"] == impl.expect("60", "61")


def test_seconds_fields(impl: Impl) -> None:
    view = view_class(user_throttles(impl)["3sec"])
    # Sliding: 1.001 s, rounded up.
    assert retry_afters(view, [0, 0, 0, 0]) == [None, None, None, impl.expect("1", "2")]


def test_minutes_fields(impl: Impl) -> None:
    view = view_class(user_throttles(impl)["3min"])
    # Sliding: 60.001 s, rounded up.
    assert retry_afters(view, [0, 0, 0, 0]) == [None, None, None, impl.expect("60", "61")]


def test_next_rate_remains_constant_if_followed(impl: Impl) -> None:
    view = view_class(user_throttles(impl)["3min"])
    # If a client follows the recommended rate, the throttle lets every request through.
    # Sliding: at 60 s the previous minute's 3 requests still weigh 3 (1 ms to wait);
    # at 80 s they weigh floor(3 * 40 / 60) = 2.
    assert retry_afters(view, [0, 20, 40, 60, 80]) == [
        None,
        None,
        None,
        impl.expect(None, "1"),
        None,
    ]


# -- ScopedRateThrottleTests -----------------------------------------------------------------
class Timer:
    seconds = 0


def scoped_views(impl: Impl) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    def timer(self: Any) -> float:
        return Timer.seconds

    throttle = throttle_class(
        impl.module.ScopedRateThrottle,
        "XYScopedRateThrottle",
        THROTTLE_RATES={"x": "3/min", "y": "1/min"},
        timer=timer,
    )
    Timer.seconds = 0
    x_view = view_class(throttle, throttle_scope="x").as_view()
    y_view = view_class(throttle, throttle_scope="y").as_view()
    unscoped = view_class(throttle).as_view()
    return x_view, y_view, unscoped


def hits(view: Callable[..., Any], count: int, request: Any) -> list[int]:
    codes = []
    for _ in range(count):
        codes.append(view(request).status_code)
        Timer.seconds += 1
    return codes


def test_scoped_rate_throttle(impl: Impl) -> None:
    x_view, y_view, _ = scoped_views(impl)
    request = factory.get("/")
    # x allows 3 per minute, y 1 per minute, counted apart.
    assert hits(x_view, 4, request) == [200, 200, 200, 429]
    assert hits(y_view, 2, request) == [200, 429]
    # Advance to the next minute (t = 60): the throttles have reset.
    Timer.seconds += 54
    # Sliding: at 60 s x's 3 requests at 0, 1, 2 s still weigh 3; at 61 s
    # floor(3 * 59 / 60) = 2, at 62 s 2 + 1 counted now = 3: refused.
    assert hits(x_view, 4, request) == impl.expect([200, 200, 200, 429], [429, 200, 429, 429])
    # y: its request at 4 s weighs floor(1 * 56 / 60) = 0 at 64 s.
    assert hits(y_view, 2, request) == [200, 429]


def test_unscoped_view_not_throttled(impl: Impl) -> None:
    _, _, unscoped = scoped_views(impl)
    request = factory.get("/")
    assert hits(unscoped, 10, request) == [200] * 10


def test_get_cache_key_returns_correct_key_if_user_is_authenticated(impl: Impl) -> None:
    class DummyView:
        throttle_scope = "user"

    throttle = throttle_class(
        impl.module.ScopedRateThrottle, "Scoped", THROTTLE_RATES={"user": "3/min"}
    )()
    request = Request(HttpRequest())
    user = get_user_model().objects.create(username="test")
    force_authenticate(request, user)
    request.user = user
    throttle.allow_request(request, DummyView())  # type: ignore[arg-type]
    assert throttle.get_cache_key(request, view=DummyView()) == f"throttle_user_{user.pk}"  # type: ignore[attr-defined]


# -- X-Forwarded-For: DRF's NUM_PROXIES is our PROXY_COUNT ---------------------------------------
def xff_view(impl: Impl) -> Callable[..., Any]:
    throttle = throttle_class(
        impl.module.ScopedRateThrottle,
        "Throttle",
        THROTTLE_RATES={"test_limit": "1/day"},
        timer=lambda self: 0,
    )
    return view_class(throttle, throttle_scope="test_limit").as_view()


def xff_request(forwarded_for: str) -> Any:
    request = factory.get("/some_uri")
    request.META["REMOTE_ADDR"] = "3.3.3.3"
    request.META["HTTP_X_FORWARDED_FOR"] = forwarded_for
    return request


def config_proxy(impl: Impl, settings: Any, quota: Any, proxies: int) -> None:
    """DRF reads ``REST_FRAMEWORK["NUM_PROXIES"]``; django-quota ``QUOTA["PROXY_COUNT"]``
    (the same hop count: ``REMOTE_ADDR`` is the first hop)."""
    if impl.name == DRF:
        settings.REST_FRAMEWORK = {"NUM_PROXIES": proxies}
    else:
        quota(DRF_ALGORITHM="fixed_window", PROXY_COUNT=proxies)


def test_xff_request_under_limit_is_accepted(fixed_impl: Impl, settings: Any, quota: Any) -> None:
    config_proxy(fixed_impl, settings, quota, 0)
    view = xff_view(fixed_impl)
    assert view(xff_request("0.0.0.0, 1.1.1.1, 2.2.2.2")).status_code == 200
    assert view(xff_request("0.0.0.0, 1.1.1.1, 2.2.2.2")).status_code == 429


@pytest.mark.parametrize(
    ("proxies", "spoofed"), [(1, "4.4.4.4, 5.5.5.5, 2.2.2.2"), (2, "4.4.4.4, 1.1.1.1, 2.2.2.2")]
)
def test_xff_spoofing_does_not_change_the_machine_id(
    fixed_impl: Impl, settings: Any, quota: Any, proxies: int, spoofed: str
) -> None:
    config_proxy(fixed_impl, settings, quota, proxies)
    view = xff_view(fixed_impl)
    view(xff_request("0.0.0.0, 1.1.1.1, 2.2.2.2"))
    assert view(xff_request(spoofed)).status_code == 429


@pytest.mark.parametrize(
    ("proxies", "other"), [(1, "0.0.0.0, 1.1.1.1, 7.7.7.7"), (2, "0.0.0.0, 7.7.7.7, 2.2.2.2")]
)
def test_unique_clients_are_counted_independently(
    fixed_impl: Impl, settings: Any, quota: Any, proxies: int, other: str
) -> None:
    config_proxy(fixed_impl, settings, quota, proxies)
    view = xff_view(fixed_impl)
    view(xff_request("0.0.0.0, 1.1.1.1, 2.2.2.2"))
    assert view(xff_request(other)).status_code == 200


def test_without_proxy_settings_a_forwarded_header_buys_no_fresh_budget(
    fixed_impl: Impl,
) -> None:
    view = xff_view(fixed_impl)
    view(xff_request("0.0.0.0, 1.1.1.1, 2.2.2.2"))
    # A deliberate difference: with NUM_PROXIES None, DRF keys on the whole
    # X-Forwarded-For value, which the client writes; django-quota reads the header only
    # behind TRUSTED_PROXIES or PROXY_COUNT, so the peer address identifies the client.
    expected = 200 if fixed_impl.name == DRF else 429
    assert view(xff_request("9.9.9.9")).status_code == expected


# -- AnonRateThrottleTests -------------------------------------------------------------------------
def test_anon_throttle_ignores_authenticated_users(fixed_impl: Impl) -> None:
    throttle = fixed_impl.module.AnonRateThrottle()
    request = Request(HttpRequest())
    user = get_user_model().objects.create(username="test")
    force_authenticate(request, user)
    request.user = user
    assert throttle.get_cache_key(request, view={}) is None


def test_anon_cache_key_without_an_address(fixed_impl: Impl) -> None:
    throttle = fixed_impl.module.AnonRateThrottle()
    request = Request(HttpRequest())
    assert throttle.get_cache_key(request, view={}) == "throttle_anon_None"


def test_anon_and_user_throttles_on_one_view(impl: Impl) -> None:
    anon = throttle_class(impl.module.AnonRateThrottle, "Anon", rate="1/min")
    user = throttle_class(impl.module.UserRateThrottle, "User", rate="2/min")
    view = view_class(anon, user)
    set_throttle_timer(view, 0)
    anonymous = factory.get("/")
    assert [view.as_view()(anonymous).status_code for _ in range(2)] == [200, 429]
    signed_in = factory.get("/")
    signed_in.user = get_user_model().objects.create(username="a")
    # Authenticated: the anon throttle stands aside, the user throttle counts.
    assert [view.as_view()(signed_in).status_code for _ in range(3)] == [200, 200, 429]


# -- SimpleRateThrottleTests -----------------------------------------------------------------------
def simple(impl: Impl, **attributes: Any) -> Any:
    return throttle_class(impl.module.SimpleRateThrottle, "Simple", **attributes)


def test_get_rate_raises_error_if_scope_is_missing(fixed_impl: Impl) -> None:
    throttle = simple(fixed_impl, scope="anon", THROTTLE_RATES={"anon": None})()
    throttle.scope = None
    with pytest.raises(ImproperlyConfigured):
        throttle.get_rate()


def test_throttle_raises_error_if_rate_is_missing(fixed_impl: Impl) -> None:
    with pytest.raises(ImproperlyConfigured):
        simple(fixed_impl, scope="invalid scope")()


def test_parse_rate_returns_tuple_with_none_if_rate_not_provided(fixed_impl: Impl) -> None:
    throttle = simple(fixed_impl, scope="anon", THROTTLE_RATES={"anon": None})()
    assert throttle.parse_rate(None) == (None, None)


def test_allow_request_returns_true_if_rate_is_none(fixed_impl: Impl) -> None:
    throttle = simple(fixed_impl, scope="anon", THROTTLE_RATES={"anon": None})()
    assert throttle.allow_request(request={}, view={}) is True


def test_get_cache_key_raises_not_implemented_error(fixed_impl: Impl) -> None:
    throttle = simple(fixed_impl, scope="anon", THROTTLE_RATES={"anon": None})()
    with pytest.raises(NotImplementedError):
        throttle.get_cache_key({}, {})


def test_allow_request_returns_true_if_key_is_none(fixed_impl: Impl) -> None:
    throttle = simple(fixed_impl, scope="anon", THROTTLE_RATES={"anon": None})()
    throttle.rate = "some rate"
    throttle.get_cache_key = lambda *args: None
    assert throttle.allow_request(request={}, view={}) is True


# DRF's test_wait_returns_correct_waiting_time_without_history and
# test_wait_returns_none_if_there_are_no_available_requests set DRF's internal
# ``history`` list by hand; django-quota keeps no history in the throttle, and its
# ``wait()`` is the denial's ``retry_after`` (see the wait tests below instead).


# -- wait() ------------------------------------------------------------------------------------
def test_wait_after_a_denial_with_a_frozen_timer(impl: Impl) -> None:
    throttle_type = user_throttles(impl)["3min"]
    throttle_type.timer = lambda self: 0  # type: ignore[attr-defined]
    view = view_class(throttle_type)()
    request = view.initialize_request(factory.get("/"))
    throttle = throttle_type()
    assert [throttle.allow_request(request, view) for _ in range(4)] == [True] * 3 + [False]
    # DRF: 60 s minus the age of the oldest request; fixed window: 60 s to the end of
    # the window; sliding: 1 ms more, while the previous minute still weighs 3.
    assert throttle.wait() == impl.expect(60.0, 60.001)
    throttle_type.timer = lambda self: 45  # type: ignore[attr-defined]
    throttle = throttle_type()
    # A new instance, as DRF makes for each request (and a new request: one request
    # decided by two instances of one throttle is charged once by django-quota).
    request = view.initialize_request(factory.get("/"))
    assert throttle.allow_request(request, view) is False
    assert throttle.wait() == impl.expect(15.0, 15.001)


# -- rate strings --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rate", ["5/s", "5/sec", "5/second", "5/m", "5/min", "5/minute", "5/h", "5/hour", "5/day"]
)
def test_standard_rate_strings_parse_alike(fixed_impl: Impl, rate: str) -> None:
    throttle = simple(fixed_impl, rate=rate)()
    drf = drf_throttling.SimpleRateThrottle.parse_rate(throttle, rate)
    assert (throttle.num_requests, throttle.duration) == drf


@pytest.mark.parametrize(
    ("rate", "window"), [("5/minutes", (5, 60)), ("1/2-sec", (1, 2)), ("100/5m", (100, 300))]
)
def test_non_standard_rate_strings(impl: Impl, rate: str, window: tuple[int, int]) -> None:
    if impl.name == DRF and rate[rate.index("/") + 1].isdigit():
        # DRF 3.18 reads only the first letter of the period: no multiplier.
        with pytest.raises(KeyError):
            simple(impl, rate=rate)()
        return
    throttle = simple(impl, rate=rate)()
    assert (throttle.num_requests, throttle.duration) == window


def test_rate_none_throttles_nothing(impl: Impl, settings: Any) -> None:
    user = throttle_class(impl.module.UserRateThrottle, "User", THROTTLE_RATES={"user": None})
    view = view_class(user)
    set_throttle_timer(view, 0)
    request = factory.get("/")
    assert [view.as_view()(request).status_code for _ in range(5)] == [200] * 5
