"""DRF throttles end to end through DRF's ``APIClient`` (docs/subjects.md, arithmetic.md,
failures.md, http.md):
``QuotaThrottle`` and the drop-in ``AnonRateThrottle``, ``UserRateThrottle`` and
``ScopedRateThrottle``, on the memory backend and on a real Redis.

Most tests decide on a frozen clock, either DRF's ``timer`` seam or ``QUOTA["CLOCK"]``,
so that ``wait()`` and ``Retry-After`` are exact."""

from __future__ import annotations

import math
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.urls import path
from rest_framework.response import Response
from rest_framework.test import APIClient, APIRequestFactory
from rest_framework.views import APIView

import django_quota
from django_quota import policies
from django_quota.core.policy import generated_policy_id
from django_quota.core.windows import sliding_wait
from django_quota.signals import quota_denied
from django_quota.throttling import (
    AnonRateThrottle,
    QuotaThrottle,
    QuotaUnavailable,
    ScopedRateThrottle,
    SimpleRateThrottle,
    UserRateThrottle,
    parse_drf_rate,
)
from tests.test_http import parse_sf_list
from tests.test_middleware import dead_redis_url

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

#: 20.4 s into a minute (1_700_000_040 is a multiple of 60).
FROZEN_NOW = 1_700_000_060.4
CLOCK = "tests.test_throttling.frozen_clock"
WITHOUT_MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ORDERS = {"algorithm": "fixed_window", "windows": "3/m", "selector": ["ip"]}


class Clock:
    now = FROZEN_NOW


def frozen_clock() -> float:
    return Clock.now


@pytest.fixture(autouse=True)
def _reset_clock() -> None:
    Clock.now = FROZEN_NOW


# -- throttles and views -------------------------------------------------------------------
class FrozenQuotaThrottle(QuotaThrottle):
    def timer(self) -> float:  # type: ignore[override]
        return Clock.now


class TightThrottle(QuotaThrottle):
    quota_policies = ["tight"]


class LooseThrottle(QuotaThrottle):
    quota_policies = ["loose"]


class CostlyThrottle(QuotaThrottle):
    def get_quota_cost(self, request: Any, view: Any) -> int:
        return int(request.query_params.get("cost", "1"))


class Ok(APIView):
    def get(self, request: Any) -> Response:
        return Response({"ok": True})


class OrdersView(Ok):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["orders"]


class FrozenOrdersView(Ok):
    throttle_classes = [FrozenQuotaThrottle]
    quota_policies = ["orders"]


class ScopeView(Ok):
    throttle_classes = [QuotaThrottle]
    throttle_scope = "orders"


class BothView(Ok):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["orders", "search"]


class LoopView(Ok):
    throttle_classes = [TightThrottle, LooseThrottle]


class CostlyView(Ok):
    throttle_classes = [CostlyThrottle]
    quota_policies = ["orders"]


class NoPolicyView(Ok):
    throttle_classes = [QuotaThrottle]


class AnonView(Ok):
    throttle_classes = [AnonRateThrottle]


class UserView(Ok):
    throttle_classes = [UserRateThrottle]


class ScopedXView(Ok):
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "x"


class ScopedYView(Ok):
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "y"


class FrozenUserThrottle(UserRateThrottle):
    scope = "frozen"

    def timer(self) -> float:  # type: ignore[override]
        return Clock.now


class FrozenUserView(Ok):
    throttle_classes = [FrozenUserThrottle]


class HeaderKeyThrottle(SimpleRateThrottle):
    scope = "keyed"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        return request.headers.get("X-Customer")


class HeaderKeyView(Ok):
    throttle_classes = [HeaderKeyThrottle]


urlpatterns = [
    path("drf/orders/", OrdersView.as_view(), name="orders"),
    path("drf/frozen/", FrozenOrdersView.as_view(), name="frozen"),
    path("drf/scope/", ScopeView.as_view(), name="scope"),
    path("drf/both/", BothView.as_view(), name="both"),
    path("drf/loop/", LoopView.as_view(), name="loop"),
    path("drf/costly/", CostlyView.as_view(), name="costly"),
    path("drf/none/", NoPolicyView.as_view(), name="none"),
    path("drf/anon/", AnonView.as_view(), name="anon"),
    path("drf/user/", UserView.as_view(), name="user"),
    path("drf/x/", ScopedXView.as_view(), name="x"),
    path("drf/y/", ScopedYView.as_view(), name="y"),
    path("drf/frozen-user/", FrozenUserView.as_view(), name="frozen-user"),
    path("drf/keyed/", HeaderKeyView.as_view(), name="keyed"),
]


# -- helpers -------------------------------------------------------------------------------
def statuses(client: Any, url: str, count: int, **extra: Any) -> list[int]:
    return [client.get(url, **extra).status_code for _ in range(count)]


def recorded(response: Any) -> list[tuple[str, str, str | None]]:
    return [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(response.wsgi_request)]


def ietf(response: Any) -> tuple[Any, Any]:
    return parse_sf_list(response["RateLimit-Policy"]), parse_sf_list(response["RateLimit"])


def throttled_detail(seconds: int) -> dict[str, str]:
    unit = "second" if seconds == 1 else "seconds"
    return {"detail": f"Request was throttled. Expected available in {seconds} {unit}."}


def backend(request: pytest.FixtureRequest, name: str) -> dict[str, Any]:
    return {"REDIS_URL": request.getfixturevalue("redis_url")} if name == "redis" else {}


def drf_request(**extra: Any) -> Any:
    """A DRF ``Request`` as a view's ``initial()`` builds it, anonymous."""
    from django.contrib.auth.models import AnonymousUser
    from rest_framework.request import Request

    request = Request(APIRequestFactory().get("/drf/orders/", **extra))
    request.user = AnonymousUser()
    return request


# -- 1. QuotaThrottle: refusals --------------------------------------------------------------
@pytest.mark.parametrize("backend_name", ["memory", "redis"])
def test_quota_throttle_refuses_the_fourth_request_with_drf_429(
    quota: Any, request: pytest.FixtureRequest, backend_name: str
) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS}, **backend(request, backend_name))
    client = APIClient()
    assert statuses(client, "/drf/orders/", 3) == [200, 200, 200]
    response = client.get("/drf/orders/")
    assert response.status_code == 429
    # 39.6 s to the end of the minute: DRF rounds wait() up.
    assert response["Retry-After"] == "40"
    assert response.json() == throttled_detail(40)
    assert recorded(response) == [("orders", "denied", "default_quota_exhausted")]


def test_wait_is_the_outcomes_retry_after_on_a_frozen_timer(quota: Any) -> None:
    quota(POLICIES={"orders": ORDERS})
    view = FrozenOrdersView()
    throttle = FrozenQuotaThrottle()
    for _ in range(3):
        assert throttle.allow_request(drf_request(), view) is True
        assert throttle.wait() is None
    assert throttle.allow_request(drf_request(), view) is False
    assert throttle.wait() == 39.6
    Clock.now = FROZEN_NOW + 39.6
    assert throttle.allow_request(drf_request(), view) is True


def test_throttle_scope_names_the_policy(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS})
    client = APIClient()
    assert statuses(client, "/drf/scope/", 4) == [200, 200, 200, 429]


def test_view_without_policies_is_not_throttled(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": {**ORDERS, "windows": "1/m"}})
    response = APIClient().get("/drf/none/")
    assert response.status_code == 200
    assert recorded(response) == []


def test_unknown_policy_id_fails_closed_not_500(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    response = APIClient().get("/drf/orders/")
    assert response.status_code == 503
    assert recorded(response) == [("orders", "failed_closed", "policy_unknown")]


def test_policies_of_one_throttle_are_decided_together(quota: Any) -> None:
    search = {"algorithm": "fixed_window", "windows": "2/m", "selector": ["ip"]}
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS, "search": search})
    client = APIClient()
    assert statuses(client, "/drf/both/", 3) == [200, 200, 429]
    # The refused request charged neither policy: "orders" still has 1 of 3 left.
    subject = {"ip": "127.0.0.1"}
    assert django_quota.peek("orders", subject).remaining == 1
    assert django_quota.peek("search", subject).remaining == 0


def test_drf_runs_every_throttle_after_one_refuses(quota: Any) -> None:
    tight = {"algorithm": "fixed_window", "windows": "1/m", "selector": ["ip"]}
    loose = {"algorithm": "fixed_window", "windows": "5/h", "selector": ["ip"]}
    quota(CLOCK=CLOCK, POLICIES={"tight": tight, "loose": loose})
    client = APIClient()
    assert client.get("/drf/loop/").status_code == 200
    response = client.get("/drf/loop/")
    assert response.status_code == 429
    # DRF asked the second throttle too: it charged (layers charge on their own).
    assert recorded(response) == [
        ("tight", "denied", "default_quota_exhausted"),
        ("loose", "allowed", None),
    ]
    assert django_quota.peek("loose", {"ip": "127.0.0.1"}).remaining == 3
    assert response["Retry-After"] == "40"


def test_longest_wait_of_the_refusing_throttles_is_the_retry_after(quota: Any) -> None:
    tight = {"algorithm": "fixed_window", "windows": "1/m", "selector": ["ip"]}
    loose = {"algorithm": "fixed_window", "windows": "1/h", "selector": ["ip"]}
    quota(CLOCK=CLOCK, POLICIES={"tight": tight, "loose": loose})
    client = APIClient()
    client.get("/drf/loop/")
    response = client.get("/drf/loop/")
    # 860.4 s into the hour: 2739.6 s left, rounded up.
    assert response["Retry-After"] == "2740"
    assert [decision for _, decision, _ in recorded(response)] == ["denied", "denied"]


def test_denial_sends_quota_denied(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": {**ORDERS, "windows": "1/m"}})
    seen: list[Any] = []

    def receiver(sender: Any, request: Any, outcome: Any, **kwargs: Any) -> None:
        seen.append((sender, outcome.policy, outcome.decision))

    quota_denied.connect(receiver)
    try:
        statuses(APIClient(), "/drf/orders/", 2)
    finally:
        quota_denied.disconnect(receiver)
    assert seen == [(QuotaThrottle, "orders", "denied")]


def test_quota_denied_is_sent_once_when_several_throttles_refuse(quota: Any) -> None:
    tight = {"algorithm": "fixed_window", "windows": "1/m", "selector": ["ip"]}
    loose = {"algorithm": "fixed_window", "windows": "1/h", "selector": ["ip"]}
    quota(CLOCK=CLOCK, POLICIES={"tight": tight, "loose": loose})
    seen: list[str] = []

    def receiver(sender: Any, request: Any, outcome: Any, **kwargs: Any) -> None:
        seen.append(outcome.policy)

    quota_denied.connect(receiver)
    try:
        assert statuses(APIClient(), "/drf/loop/", 3) == [200, 429, 429]
    finally:
        quota_denied.disconnect(receiver)
    assert seen == ["tight", "tight"]


# -- 2. headers ------------------------------------------------------------------------------
def test_middleware_writes_rate_limit_headers_of_the_throttles_outcomes(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS})
    client = APIClient()
    response = client.get("/drf/orders/")
    assert ietf(response) == ([("orders", {"q": 3, "w": 60})], [("orders", {"r": 2, "t": 40})])
    statuses(client, "/drf/orders/", 2)
    refused = client.get("/drf/orders/")
    assert refused.status_code == 429
    policy_items, limit_items = ietf(refused)
    assert policy_items == [("orders", {"q": 3, "w": 60})]
    assert limit_items == [("orders", {"r": 0, "t": 40})]
    assert int(refused["Retry-After"]) >= limit_items[0][1]["t"]


def test_without_the_middleware_a_throttle_sets_only_retry_after(quota: Any, settings: Any) -> None:
    settings.MIDDLEWARE = WITHOUT_MIDDLEWARE
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS})
    client = APIClient()
    allowed = client.get("/drf/orders/")
    assert "RateLimit" not in allowed
    statuses(client, "/drf/orders/", 2)
    refused = client.get("/drf/orders/")
    assert refused.status_code == 429
    assert refused["Retry-After"] == "40"
    assert "RateLimit" not in refused and "RateLimit-Policy" not in refused


def test_sliding_window_retry_after_is_never_earlier_than_the_items_t(quota: Any) -> None:
    orders = {**ORDERS, "algorithm": "sliding_window"}
    quota(CLOCK=CLOCK, POLICIES={"orders": orders})
    client = APIClient()
    statuses(client, "/drf/orders/", 3)
    refused = client.get("/drf/orders/")
    assert refused.status_code == 429
    ((_, params),) = parse_sf_list(refused["RateLimit"])
    assert int(refused["Retry-After"]) >= params["t"]
    # 39.6 s to the window's end, then 1 ms until the estimate drops (docs/arithmetic.md).
    assert refused["Retry-After"] == "40"
    assert sliding_wait(0, 3, 20_400, 60_000, 2) == 39_601


# -- 3. memo: one charge per policy per request --------------------------------------------
def test_policy_decided_by_the_middleware_is_not_charged_again(quota: Any) -> None:
    orders = {**ORDERS, "routes": ["/drf/orders"]}
    quota(CLOCK=CLOCK, POLICIES={"orders": orders})
    client = APIClient()
    response = client.get("/drf/orders/")
    assert response.status_code == 200
    assert recorded(response) == [("orders", "allowed", None)]
    assert django_quota.peek("orders", {"ip": "127.0.0.1"}).remaining == 2
    assert statuses(client, "/drf/orders/", 3) == [200, 200, 429]


# -- 4. failures, shadow, identities, cost -----------------------------------------------------
@pytest.mark.parametrize("retry_after", [1, 7])
def test_fail_closed_outcome_is_a_503_with_failure_retry_after(
    quota: Any, retry_after: int
) -> None:
    quota(
        REDIS_URL=dead_redis_url(),
        FAILURE_RETRY_AFTER=retry_after,
        POLICIES={"orders": {**ORDERS, "failure_mode": "closed"}},
    )
    response = APIClient().get("/drf/orders/")
    assert response.status_code == 503
    assert response["Retry-After"] == str(retry_after)
    assert response.json() == {"detail": "The rate limiter is unavailable; retry later."}
    assert recorded(response) == [("orders", "failed_closed", "backend_unavailable")]
    assert "RateLimit" not in response


def test_fail_closed_raises_quota_unavailable_from_allow_request(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), POLICIES={"orders": ORDERS})
    with pytest.raises(QuotaUnavailable) as raised:
        QuotaThrottle().allow_request(drf_request(), OrdersView())
    assert raised.value.status_code == 503
    assert raised.value.wait == 1
    assert raised.value.outcome is not None
    assert raised.value.outcome.decision == "failed_closed"


def test_fail_open_outcome_lets_the_request_through(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), POLICIES={"orders": {**ORDERS, "failure_mode": "open"}})
    response = APIClient().get("/drf/orders/")
    assert response.status_code == 200
    assert recorded(response) == [("orders", "failed_open", "backend_unavailable")]


def test_shadow_policy_never_refuses_and_writes_no_headers(quota: Any) -> None:
    shadow = {**ORDERS, "windows": "1/m", "enforcement": "shadow"}
    quota(CLOCK=CLOCK, POLICIES={"orders": shadow})
    client = APIClient()
    responses = [client.get("/drf/orders/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert recorded(responses[-1]) == [("orders", "shadow_denied", "default_quota_exhausted")]
    assert "RateLimit" not in responses[-1]


def test_missing_identity_refuses_without_retry_after_and_wait_is_none(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": {**ORDERS, "selector": ["api_key"]}})
    response = APIClient().get("/drf/orders/")
    assert response.status_code == 429
    assert "Retry-After" not in response
    assert response.json() == {"detail": "Request was throttled."}
    assert recorded(response) == [("orders", "denied", "selector_identity_missing")]
    throttle = QuotaThrottle()
    assert throttle.allow_request(drf_request(), OrdersView()) is False
    assert throttle.wait() is None


def test_api_key_is_drf_request_auth(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": {**ORDERS, "windows": "1/m", "selector": ["api_key"]}})
    first, second = APIClient(), APIClient()
    first.force_authenticate(token="key-a")
    second.force_authenticate(token="key-b")
    assert statuses(first, "/drf/orders/", 2) == [200, 429]
    assert statuses(second, "/drf/orders/", 1) == [200]


def test_user_is_drf_request_user(quota: Any, django_user_model: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": {**ORDERS, "windows": "1/m", "selector": ["user"]}})
    alice = django_user_model.objects.create(username="alice")
    bob = django_user_model.objects.create(username="bob")
    first, second = APIClient(), APIClient()
    # force_authenticate is DRF authentication: no session, so the middleware's
    # Django user would be anonymous.
    first.force_authenticate(alice)
    second.force_authenticate(bob)
    assert statuses(first, "/drf/orders/", 2) == [200, 429]
    assert statuses(second, "/drf/orders/", 1) == [200]
    assert django_quota.peek("orders", {"user": str(alice.pk)}).remaining == 0


def test_route_dimension_is_the_drf_scope(quota: Any) -> None:
    orders = {**ORDERS, "windows": "1/m", "selector": ["route"]}
    quota(CLOCK=CLOCK, POLICIES={"orders": orders})
    assert statuses(APIClient(), "/drf/scope/", 2) == [200, 429]
    assert django_quota.peek("orders", {"route": "orders"}).remaining == 0


def test_get_quota_cost_charges_several_units(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS})
    client = APIClient()
    assert client.get("/drf/costly/?cost=2").status_code == 200
    assert client.get("/drf/costly/?cost=2").status_code == 429
    assert client.get("/drf/costly/?cost=1").status_code == 200
    # Cost 0 answers what peek answers: what a cost of 1 would get now (docs/arithmetic.md).
    assert client.get("/drf/costly/?cost=0").status_code == 429
    assert django_quota.peek("orders", {"ip": "127.0.0.1"}).remaining == 0


def test_cost_above_the_limit_is_refused_without_retry_after(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS})
    response = APIClient().get("/drf/costly/?cost=4")
    assert response.status_code == 429
    assert "Retry-After" not in response
    assert recorded(response) == [("orders", "denied", "cost_exceeds_limit")]


def test_disabled_app_throttles_nothing(quota: Any) -> None:
    quota(ENABLED=False, CLOCK=CLOCK, POLICIES={"orders": {**ORDERS, "windows": "1/m"}})
    client = APIClient()
    assert statuses(client, "/drf/orders/", 3) == [200, 200, 200]
    assert statuses(client, "/drf/user/", 3) == [200, 200, 200]
    assert recorded(client.get("/drf/orders/")) == []


# -- 5. drop-in throttles ----------------------------------------------------------------------
@pytest.fixture
def rates(settings: Any) -> Any:
    def apply(**values: Any) -> None:
        settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": values}

    return apply


@pytest.mark.parametrize("backend_name", ["memory", "redis"])
def test_anon_throttle_limits_anonymous_clients_by_ip(
    quota: Any, rates: Any, request: pytest.FixtureRequest, backend_name: str
) -> None:
    quota(CLOCK=CLOCK, DRF_ALGORITHM="fixed_window", **backend(request, backend_name))
    rates(anon="2/min")
    client = APIClient()
    assert statuses(client, "/drf/anon/", 3) == [200, 200, 429]
    refused = client.get("/drf/anon/")
    assert refused["Retry-After"] == "40"
    assert refused.json() == throttled_detail(40)
    assert recorded(refused) == [("drf:anon", "denied", "default_quota_exhausted")]
    assert ietf(refused) == (
        [("drf:anon", {"q": 2, "w": 60})],
        [("drf:anon", {"r": 0, "t": 40})],
    )
    assert statuses(client, "/drf/anon/", 1, REMOTE_ADDR="10.0.0.2") == [200]


def test_anon_throttle_leaves_authenticated_users_alone(
    quota: Any, rates: Any, django_user_model: Any
) -> None:
    quota(CLOCK=CLOCK)
    rates(anon="1/min")
    client = APIClient()
    client.force_authenticate(django_user_model.objects.create(username="alice"))
    responses = [client.get("/drf/anon/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert recorded(responses[-1]) == []


def test_user_throttle_counts_users_apart_and_anonymous_clients_by_ip(
    quota: Any, rates: Any, django_user_model: Any
) -> None:
    quota(CLOCK=CLOCK)
    rates(user="1/min")
    alice, bob = APIClient(), APIClient()
    alice_user = django_user_model.objects.create(username="alice")
    alice.force_authenticate(alice_user)
    bob.force_authenticate(django_user_model.objects.create(username="bob"))
    assert statuses(alice, "/drf/user/", 2) == [200, 429]
    assert statuses(bob, "/drf/user/", 2) == [200, 429]
    assert statuses(APIClient(), "/drf/user/", 2) == [200, 429]
    # The identity is the user (DRF's request.user), not the address they share.
    assert django_quota.peek("drf:user", {"user": str(alice_user.pk)}).remaining == 0
    assert django_quota.peek("drf:user", {"ip": "127.0.0.1"}).remaining == 0


def test_scoped_throttle_counts_each_scope_apart(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK)
    rates(x="2/min", y="1/min")
    client = APIClient()
    assert statuses(client, "/drf/x/", 3) == [200, 200, 429]
    assert statuses(client, "/drf/y/", 2) == [200, 429]
    assert recorded(client.get("/drf/y/")) == [("drf:y", "denied", "default_quota_exhausted")]


def test_missing_rate_for_a_scope_fails_closed_on_a_request(quota: Any, rates: Any) -> None:
    """DRF answers 500 for a scoped view whose scope has no rate; the drop-in applies the
    failure mode with reason policy_unknown (docs/drf.md). Building a throttle whose
    class scope has no rate still raises, as DRF's does."""
    quota(CLOCK=CLOCK)
    rates(x="2/min")
    response = APIClient().get("/drf/y/")
    assert response.status_code == 503
    assert recorded(response) == [("drf:y", "failed_closed", "policy_unknown")]
    with pytest.raises(ImproperlyConfigured, match="'user' scope"):
        UserRateThrottle()


def test_rate_none_means_no_limit(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK)
    rates(user=None, anon=None)
    client = APIClient()
    assert statuses(client, "/drf/user/", 5) == [200] * 5
    assert recorded(client.get("/drf/anon/")) == []


def test_throttle_rates_are_read_at_call_time(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK, DRF_ALGORITHM="fixed_window")
    rates(user="1/min")
    client = APIClient()
    assert statuses(client, "/drf/user/", 2) == [200, 429]
    rates(user="3/min")
    # A new rate is a new revision: fresh counters.
    assert statuses(client, "/drf/user/", 4) == [200, 200, 200, 429]
    first = policies.get_policy("drf:user")
    rates(user="3/hour")
    client.get("/drf/user/")
    assert policies.get_policy("drf:user").revision != first.revision


def test_drf_algorithm_setting_chooses_the_algorithm(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK)
    rates(user="2/min")
    APIClient().get("/drf/user/")
    assert policies.get_policy("drf:user").algorithm == "sliding_log"  # DRF's own semantics
    quota(CLOCK=CLOCK, DRF_ALGORITHM="token_bucket")
    APIClient().get("/drf/user/")
    generated = policies.get_policy("drf:user")
    assert generated.algorithm == "token_bucket"
    assert generated.selector == ("auto",)
    assert generated.windows[0].limit == 2 and generated.windows[0].period_ms == 60_000


def test_configured_policy_with_a_drf_id_replaces_the_generated_one(quota: Any, rates: Any) -> None:
    configured = {"algorithm": "fixed_window", "windows": "1/h", "selector": ["ip"]}
    quota(CLOCK=CLOCK, POLICIES={"drf:user": configured})
    rates(user="100/min")
    assert statuses(APIClient(), "/drf/user/", 2) == [200, 429]


def test_wait_is_drfs_own_on_a_frozen_timer_by_default(quota: Any, rates: Any) -> None:
    quota()
    rates(frozen="3/min")
    throttle = FrozenUserThrottle()
    view = FrozenUserView()
    assert [throttle.allow_request(drf_request(), view) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    # The sliding log (docs/arithmetic.md), as DRF's history: the three requests leave exactly
    # 60 s after they were made, so DRF's wait() is 60 s and so is ours.
    assert throttle.wait() == 60.0
    Clock.now = FROZEN_NOW + 59.999
    assert throttle.allow_request(drf_request(), view) is False
    assert throttle.wait() == 0.001
    Clock.now = FROZEN_NOW + 60
    assert throttle.allow_request(drf_request(), view) is True


def test_wait_is_exact_on_a_frozen_timer_for_the_sliding_window(quota: Any, rates: Any) -> None:
    quota(DRF_ALGORITHM="sliding_window")
    rates(frozen="3/min")
    throttle = FrozenUserThrottle()
    view = FrozenUserView()
    assert [throttle.allow_request(drf_request(), view) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    # Sliding window counter (docs/arithmetic.md): 39.6 s to the next window, where the 3
    # requests count in full as "prev" at elapsed 0; 1 ms later the estimate is 2.
    assert throttle.wait() == 39.601
    Clock.now = FROZEN_NOW + 39.6
    assert throttle.allow_request(drf_request(), view) is False
    assert throttle.wait() == 0.001
    Clock.now = FROZEN_NOW + 39.601
    assert throttle.allow_request(drf_request(), view) is True


def test_wait_on_a_frozen_timer_for_the_fixed_window(quota: Any, rates: Any) -> None:
    quota(DRF_ALGORITHM="fixed_window")
    rates(frozen="3/min")
    throttle = FrozenUserThrottle()
    view = FrozenUserView()
    for _ in range(3):
        assert throttle.allow_request(drf_request(), view) is True
    assert throttle.allow_request(drf_request(), view) is False
    assert throttle.wait() == 39.6
    response = APIClient().get("/drf/frozen-user/")
    assert response["Retry-After"] == "40"


def test_timer_set_on_an_instance_is_the_clock(quota: Any, rates: Any) -> None:
    quota(DRF_ALGORITHM="fixed_window")
    rates(user="1/min")
    throttle = UserRateThrottle()
    throttle.timer = lambda: 120.5  # type: ignore[method-assign]
    assert throttle.allow_request(drf_request(), UserView()) is True
    assert throttle.allow_request(drf_request(), UserView()) is False
    assert throttle.wait() == 59.5


def test_overridden_scope_rate_and_throttle_rates_are_honoured(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK)
    rates(user="100/min")

    class RateOverride(UserRateThrottle):
        rate = "1/day"

    class ScopeOverride(UserRateThrottle):
        scope = "burst"
        THROTTLE_RATES = {"burst": "1/min"}

    request = drf_request()
    assert RateOverride().allow_request(request, UserView()) is True
    assert RateOverride().allow_request(drf_request(), UserView()) is False
    assert RateOverride().parse_rate(RateOverride.rate) == (1, 86_400)
    assert ScopeOverride().allow_request(drf_request(), UserView()) is True
    assert ScopeOverride().allow_request(drf_request(), UserView()) is False
    assert django_quota.outcomes(request._request)[0].policy == "drf:user"
    assert ScopeOverride().num_requests == 1 and ScopeOverride().duration == 60


def test_get_cache_key_value_is_the_identity(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    HeaderKeyThrottle.rate = "1/min"
    try:
        client = APIClient()
        # The key, not the address, identifies the requester.
        assert client.get("/drf/keyed/", HTTP_X_CUSTOMER="c1").status_code == 200
        assert (
            client.get("/drf/keyed/", HTTP_X_CUSTOMER="c1", REMOTE_ADDR="10.0.0.9").status_code
            == 429
        )
        assert client.get("/drf/keyed/", HTTP_X_CUSTOMER="c2").status_code == 200
        # None: not throttled.
        assert statuses(client, "/drf/keyed/", 3) == [200, 200, 200]
        assert policies.get_policy("drf:keyed").selector == ("drf_cache_key",)
    finally:
        del HeaderKeyThrottle.rate


def test_default_cache_keys_look_like_drfs(quota: Any, rates: Any, django_user_model: Any) -> None:
    quota()
    rates(user="1/min", anon="1/min", x="1/min")
    from rest_framework.test import force_authenticate

    anonymous = drf_request(REMOTE_ADDR="203.0.113.9")
    assert AnonRateThrottle().get_cache_key(anonymous, None) == "throttle_anon_203.0.113.9"
    assert UserRateThrottle().get_cache_key(anonymous, None) == "throttle_user_203.0.113.9"
    user = django_user_model.objects.create(username="alice")
    authenticated = drf_request()
    force_authenticate(authenticated, user)
    authenticated.user = user
    assert AnonRateThrottle().get_cache_key(authenticated, None) is None
    assert UserRateThrottle().get_cache_key(authenticated, None) == f"throttle_user_{user.pk}"
    scoped = ScopedRateThrottle()
    scoped.allow_request(authenticated, ScopedXView())
    assert scoped.get_cache_key(authenticated, ScopedXView()) == f"throttle_x_{user.pk}"


def test_throttle_with_a_rate_and_no_scope_is_named_by_its_class(quota: Any) -> None:
    quota(CLOCK=CLOCK)

    class Unscoped(UserRateThrottle):
        scope = None
        rate = "1/min"

    request = drf_request()
    assert Unscoped().allow_request(request, UserView()) is True
    (outcome,) = django_quota.outcomes(request._request)
    name = f"tests.test_throttling.{Unscoped.__qualname__}"
    assert outcome.policy == generated_policy_id("drf", name)
    assert outcome.policy.startswith("drf:tests.test_throttling.test_throttle_with")


def test_drop_in_outcomes_share_the_memo(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK)
    rates(user="2/min")

    class Twice(Ok):
        throttle_classes = [UserRateThrottle, UserRateThrottle]

    request = drf_request()
    view = Twice()
    assert all(t.allow_request(request, view) for t in view.get_throttles())
    assert [o.policy for o in django_quota.outcomes(request._request)] == ["drf:user"]
    assert django_quota.peek("drf:user", {"ip": "127.0.0.1"}).remaining == 1


@pytest.mark.parametrize(
    ("rate", "parsed"),
    [
        ("5/s", (5, 1)),
        ("5/sec", (5, 1)),
        ("5/second", (5, 1)),
        ("5/minute", (5, 60)),
        ("5/m", (5, 60)),
        ("10/hour", (10, 3600)),
        ("100/day", (100, 86400)),
        ("100/5m", (100, 300)),
        ("1/2-sec", (1, 2)),
        ("60/30-min", (60, 1800)),
        (" 7/d", (7, 86400)),
    ],
)
def test_drf_rate_syntax_is_accepted(rate: str, parsed: tuple[int, int]) -> None:
    assert parse_drf_rate(rate) == parsed


@pytest.mark.parametrize(
    "rate", ["5", "5/", "5/x", "x/m", "0/m", "-1/m", "5/m/m", "5/M0N", "5/ x", "1/0s", "1/367d"]
)
def test_invalid_drf_rates_are_improperly_configured(rate: str) -> None:
    with pytest.raises(ImproperlyConfigured):
        parse_drf_rate(rate)


def test_client_ip_follows_proxy_count_over_num_proxies(
    quota: Any, rates: Any, settings: Any
) -> None:
    quota(CLOCK=CLOCK, PROXY_COUNT=0)
    settings.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"anon": "1/min"}, "NUM_PROXIES": 1}
    client = APIClient()
    assert client.get("/drf/anon/", HTTP_X_FORWARDED_FOR="198.51.100.1").status_code == 200
    # PROXY_COUNT is set, so NUM_PROXIES is not read: the peer is the client.
    assert client.get("/drf/anon/", HTTP_X_FORWARDED_FOR="198.51.100.2").status_code == 429
    quota(CLOCK=CLOCK, PROXY_COUNT=1)
    assert client.get("/drf/anon/", HTTP_X_FORWARDED_FOR="198.51.100.1").status_code == 200
    assert client.get("/drf/anon/", HTTP_X_FORWARDED_FOR="198.51.100.2").status_code == 200
    assert client.get("/drf/anon/", HTTP_X_FORWARDED_FOR="198.51.100.2").status_code == 429


def test_unparseable_client_address_is_refused_as_invalid_identity(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK)
    rates(anon="5/min")
    response = APIClient().get("/drf/anon/", REMOTE_ADDR="not-an-ip")
    assert response.status_code == 429
    assert "Retry-After" not in response
    assert recorded(response) == [("drf:anon", "denied", "selector_identity_invalid")]


def test_drop_in_fails_closed_with_503(quota: Any, rates: Any) -> None:
    quota(REDIS_URL=dead_redis_url())
    rates(anon="5/min")
    response = APIClient().get("/drf/anon/")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"


def test_retry_after_is_the_ceiling_of_wait(quota: Any, rates: Any) -> None:
    quota(CLOCK=CLOCK)
    rates(user="1/s")
    client = APIClient()
    client.get("/drf/user/")
    refused = client.get("/drf/user/")
    # 0.4 s into a second: 0.6 s to the next window and 1 ms more (sliding window).
    assert refused["Retry-After"] == str(math.ceil(0.601))
    ((_, params),) = parse_sf_list(refused["RateLimit"])
    assert int(refused["Retry-After"]) >= params["t"]
