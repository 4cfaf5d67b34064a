"""``@quota`` end to end through Django's ``Client`` and ``AsyncClient`` (docs/drf.md,
docs/policies.md, docs/failures.md): function and class-based views, sync and async,
named and generated policies, stacked decorators, costs, headers with and without the
middleware, failures.

Decisions use a frozen ``QUOTA["CLOCK"]`` (20.4 s into a minute, 860.4 s into an hour)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.response import Response
from rest_framework.views import APIView

import django_quota
from django_quota import policies
from django_quota.decorators import middleware_installed, quota
from django_quota.signals import quota_denied
from django_quota.throttling import QuotaThrottle
from tests.test_http import parse_sf_list
from tests.test_middleware import dead_redis_url

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

FROZEN_NOW = 1_700_000_060.4
CLOCK = "tests.test_decorators.frozen_clock"
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
WITHOUT_MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
FIXED_IP = {"algorithm": "fixed_window", "selector": ["ip"]}
LIMITED = "view:tests.test_decorators.limited"


def frozen_clock() -> float:
    return FROZEN_NOW


def cost_from_query(request: HttpRequest) -> int:
    return int(request.GET.get("cost", "1"))


async def acost_from_query(request: HttpRequest) -> int:
    return int(request.GET.get("cost", "1"))


# -- views ---------------------------------------------------------------------------------
@quota(rate="3/m", **FIXED_IP)
def limited(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@quota(rate="3/m", **FIXED_IP)
def twin(request: HttpRequest) -> HttpResponse:
    return HttpResponse("twin")


@quota("shared")
def shared_a(request: HttpRequest) -> HttpResponse:
    return HttpResponse("a")


@quota("shared")
def shared_b(request: HttpRequest) -> HttpResponse:
    return HttpResponse("b")


@quota(rate="3/m", **FIXED_IP)
async def alimited(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async ok")


@quota(rate="3/m", algorithm="fixed_window")
async def aauto(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async auto")


@quota(rate="2/m", algorithm="fixed_window", selector="ip")
class LimitedView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("class ok")


@quota(rate="2/m", algorithm="fixed_window", selector="ip")
class AsyncLimitedView(View):
    async def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("async class ok")


@quota("outer")
@quota("inner")
def stacked(request: HttpRequest) -> HttpResponse:
    return HttpResponse("stacked")


@quota("outer")
@quota("outer")
def stacked_same(request: HttpRequest) -> HttpResponse:
    return HttpResponse("same")


@quota(rate="10/m", cost=cost_from_query, **FIXED_IP)
def costly(request: HttpRequest) -> HttpResponse:
    return HttpResponse("costly")


@quota(rate="10/m", cost=acost_from_query, **FIXED_IP)
async def acostly(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async costly")


@quota(rate={"burst": "2/m", "sustained": "5/h"}, **FIXED_IP)
def windowed(request: HttpRequest) -> HttpResponse:
    return HttpResponse("windowed")


@quota(rate="2/m")
def defaults(request: HttpRequest) -> HttpResponse:
    return HttpResponse("defaults")


@quota("named")
def named(request: HttpRequest) -> HttpResponse:
    return HttpResponse("named")


@quota("named")
class DrfView(APIView):
    def get(self, request: Any) -> Response:
        return Response({"ok": True})


@quota("named")
class DrfThrottledView(APIView):
    throttle_classes = [QuotaThrottle]
    quota_policies = ["named"]

    def get(self, request: Any) -> Response:
        return Response({"ok": True})


class MethodView(View):
    @method_decorator(quota(rate="1/m", **FIXED_IP))
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("method")


urlpatterns = [
    path("limited/", limited, name="limited"),
    path("twin/", twin, name="twin"),
    path("shared-a/", shared_a),
    path("shared-b/", shared_b),
    path("alimited/", alimited),
    path("aauto/", aauto),
    path("class/", LimitedView.as_view()),
    path("aclass/", AsyncLimitedView.as_view()),
    path("stacked/", stacked),
    path("stacked-same/", stacked_same),
    path("costly/", costly),
    path("acostly/", acostly),
    path("windowed/", windowed),
    path("defaults/", defaults),
    path("named/", named),
    path("drf/", DrfView.as_view()),
    path("drf-throttled/", DrfThrottledView.as_view()),
    path("method/", MethodView.as_view()),
]


# -- helpers -------------------------------------------------------------------------------
def statuses(client: Any, url: str, count: int, **extra: Any) -> list[int]:
    return [client.get(url, **extra).status_code for _ in range(count)]


async def astatuses(client: AsyncClient, url: str, count: int) -> list[int]:
    return [(await client.get(url)).status_code for _ in range(count)]


def problem(response: Any) -> dict[str, Any]:
    assert response["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(response.content)
    return body


def recorded(response: Any) -> list[tuple[str, str, str | None]]:
    request = getattr(response, "wsgi_request", None) or response.asgi_request
    return [(o.policy, o.decision, o.reason) for o in django_quota.outcomes(request)]


def ietf(response: Any) -> tuple[Any, Any]:
    return parse_sf_list(response["RateLimit-Policy"]), parse_sf_list(response["RateLimit"])


def remaining(policy_id: str) -> int | None:
    return django_quota.peek(policy_id, {"ip": "127.0.0.1"}).remaining


def backend(request: pytest.FixtureRequest, name: str) -> dict[str, Any]:
    return {"REDIS_URL": request.getfixturevalue("redis_url")} if name == "redis" else {}


@pytest.fixture
def no_middleware(settings: Any) -> None:
    settings.MIDDLEWARE = WITHOUT_MIDDLEWARE


# -- 1. refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend_name", ["memory", "redis"])
def test_refused_request_gets_429_problem_with_retry_after(
    quota: Any, request: pytest.FixtureRequest, backend_name: str
) -> None:
    quota(CLOCK=CLOCK, **backend(request, backend_name))
    client = Client()
    assert statuses(client, "/limited/", 3) == [200, 200, 200]
    response = client.get("/limited/")
    assert response.status_code == 429
    assert response["Retry-After"] == "40"
    assert problem(response) == {
        "type": QUOTA_EXCEEDED,
        "title": "Quota exceeded",
        "status": 429,
        "detail": f"The default window of policy {LIMITED} is exhausted.",
        "reason": "default_quota_exhausted",
        "policy": LIMITED,
        "retry_after": 39.6,
        "violated-policies": [LIMITED],
    }
    assert recorded(response) == [(LIMITED, "denied", "default_quota_exhausted")]


def test_refused_request_never_reaches_the_view(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = Client()
    statuses(client, "/limited/", 3)
    assert client.get("/limited/").content != b"ok"


def test_named_policy_is_applied(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"named": {**FIXED_IP, "windows": "1/m"}})
    response = Client().get("/named/")
    assert response.status_code == 200
    assert recorded(response) == [("named", "allowed", None)]
    assert Client().get("/named/").status_code == 429


def test_every_denying_window_is_violated(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = Client()
    assert statuses(client, "/windowed/", 3) == [200, 200, 429]
    body = problem(client.get("/windowed/"))
    assert body["violated-policies"] == ["view:tests.test_decorators.windowed.burst"]
    assert body["reason"] == "burst_quota_exhausted"


def test_denial_sends_quota_denied_with_the_view_as_sender(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"named": {**FIXED_IP, "windows": "1/m"}})
    seen: list[Any] = []

    def receiver(sender: Any, request: Any, outcome: Any, **kwargs: Any) -> None:
        seen.append((sender, outcome.policy))

    quota_denied.connect(receiver)
    try:
        statuses(Client(), "/named/", 2)
    finally:
        quota_denied.disconnect(receiver)
    assert seen == [(named.__wrapped__, "named")]  # type: ignore[attr-defined]


def test_denied_view_replaces_the_body(quota: Any) -> None:
    quota(CLOCK=CLOCK, DENIED_VIEW="tests.urls.denied")
    client = Client()
    statuses(client, "/limited/", 3)
    response = client.get("/limited/")
    assert response.status_code == 429
    assert response.content == f"slow down: {LIMITED} default_quota_exhausted".encode()
    assert response["Retry-After"] == "40"


def test_missing_identity_is_refused_without_retry_after(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"named": {**FIXED_IP, "windows": "5/m", "selector": ["user"]}})
    response = Client().get("/named/")
    assert response.status_code == 429
    assert "Retry-After" not in response
    assert problem(response)["reason"] == "selector_identity_missing"
    assert problem(response)["retry_after"] is None


# -- 2. policies: implicit ids, defaults, configuration --------------------------------------
def test_views_share_a_counter_only_when_they_name_the_same_policy(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"shared": {**FIXED_IP, "windows": "3/m"}})
    client = Client()
    # Same rate, but each view has its own implicit policy id, hence its own counter.
    assert statuses(client, "/limited/", 3) == [200, 200, 200]
    assert statuses(client, "/twin/", 3) == [200, 200, 200]
    assert policies.get_policy("view:tests.test_decorators.twin").id != LIMITED
    # Two views naming "shared" draw from one counter.
    assert statuses(client, "/shared-a/", 2) == [200, 200]
    assert statuses(client, "/shared-b/", 2) == [200, 429]


def test_generated_policy_defaults_to_sliding_window_and_auto(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    Client().get("/defaults/")
    generated = policies.get_policy("view:tests.test_decorators.defaults")
    assert generated.algorithm == "sliding_window"
    assert generated.selector == ("auto",)
    assert generated.source == "decorator"


def test_configured_policy_with_the_implicit_id_wins(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={LIMITED: {**FIXED_IP, "windows": "1/h"}})
    assert statuses(Client(), "/limited/", 2) == [200, 429]
    quota(CLOCK=CLOCK)
    assert statuses(Client(), "/limited/", 4) == [200, 200, 200, 429]


def test_disabled_app_limits_nothing_and_writes_no_headers(quota: Any) -> None:
    quota(ENABLED=False, CLOCK=CLOCK)
    client = Client()
    responses = [client.get("/limited/") for _ in range(5)]
    assert [r.status_code for r in responses] == [200] * 5
    assert "RateLimit" not in responses[-1]
    assert recorded(responses[-1]) == []


# -- 3. decoration-time errors ----------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"policy": "x", "rate": "1/m"},
        {"policy": "x", "selector": ["ip"]},
        {"policy": "x", "selector": "user"},
        {"policy": "x", "algorithm": "fixed_window"},
        {"rate": "1/m", "cost": 1.5},
        {"rate": "1/m", "cost": True},
        {"rate": "1/m", "cost": "2"},
    ],
)
def test_invalid_arguments_raise_type_error_at_decoration(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError):
        quota(**kwargs)


def test_bare_decorator_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="with arguments"):
        quota(limited)  # type: ignore[arg-type]


def test_negative_cost_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        quota(rate="1/m", cost=-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": "1/fortnight"},
        {"rate": "0/m"},
        {"rate": "1/m", "selector": ["nope"]},
        {"rate": "1/m", "algorithm": "leaky"},
        {"rate": {"Burst": "1/s"}},
    ],
)
def test_invalid_rate_selector_or_algorithm_fail_when_decorating(kwargs: dict[str, Any]) -> None:
    decorator = quota(**kwargs)
    with pytest.raises(ImproperlyConfigured):
        decorator(limited)


def test_decorating_reads_no_settings(settings: Any) -> None:
    # Decorating runs at import: an invalid QUOTA must not break it (checks report it).
    settings.QUOTA = {"ENABLED": "yes"}

    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    assert callable(quota(rate="1/m")(view))
    assert callable(quota("orders")(view))


def test_selector_default_spelled_out_is_accepted_with_a_policy() -> None:
    assert callable(quota("x", selector=["auto"]))


# -- 4. class-based, async ---------------------------------------------------------------------
def test_decorating_a_class_wraps_dispatch(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = Client()
    assert statuses(client, "/class/", 3) == [200, 200, 429]
    response = client.get("/class/")
    assert problem(response)["policy"] == "view:tests.test_decorators.limitedview"
    # Methods the view does not allow are still charged and answered by dispatch.
    assert client.post("/class/").status_code == 429


def test_decorated_drf_view_is_limited_before_drf_runs(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"named": {**FIXED_IP, "windows": "1/m"}})
    client = Client()
    assert client.get("/drf/").status_code == 200
    refused = client.get("/drf/")
    assert refused.status_code == 429
    assert problem(refused)["policy"] == "named"


def test_async_function_view(quota: Any) -> None:
    quota(CLOCK=CLOCK)

    async def scenario() -> tuple[list[int], Any]:
        client = AsyncClient()
        return await astatuses(client, "/alimited/", 3), await client.get("/alimited/")

    codes, response = async_to_sync(scenario)()
    assert codes == [200, 200, 200]
    assert response.status_code == 429
    assert response["Retry-After"] == "40"
    assert problem(response)["policy"] == "view:tests.test_decorators.alimited"
    assert ietf(response) == (
        [("view:tests.test_decorators.alimited", {"q": 3, "w": 60})],
        [("view:tests.test_decorators.alimited", {"r": 0, "t": 40})],
    )


def test_async_class_based_view(quota: Any) -> None:
    quota(CLOCK=CLOCK)

    async def scenario() -> list[Any]:
        client = AsyncClient()
        return [await client.get("/aclass/") for _ in range(3)]

    responses = async_to_sync(scenario)()
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert responses[0].content == b"async class ok"
    assert problem(responses[2])["policy"] == "view:tests.test_decorators.asynclimitedview"


def test_sync_view_under_asgi(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    codes = async_to_sync(astatuses)(AsyncClient(), "/limited/", 4)
    assert codes == [200, 200, 200, 429]


@pytest.mark.django_db(transaction=True)
def test_async_view_reads_the_session_user_off_the_event_loop(
    quota: Any, django_user_model: Any
) -> None:
    quota(CLOCK=CLOCK)
    user = django_user_model.objects.create(username="alice")

    async def scenario() -> list[int]:
        client = AsyncClient()
        await sync_to_async(client.force_login)(user)  # aforce_login is Django 5.0+
        return await astatuses(client, "/aauto/", 4)

    # "auto" reads request.user (a database query) for an async view: no
    # SynchronousOnlyOperation, and the user is the identity.
    assert async_to_sync(scenario)() == [200, 200, 200, 429]
    assert (
        django_quota.peek("view:tests.test_decorators.aauto", {"user": str(user.pk)}).remaining == 0
    )


def test_async_cost_callable(quota: Any) -> None:
    quota(CLOCK=CLOCK)

    async def scenario() -> list[int]:
        client = AsyncClient()
        return [(await client.get(f"/acostly/?cost={cost}")).status_code for cost in (6, 5, 4)]

    assert async_to_sync(scenario)() == [200, 429, 200]


# -- 5. stacked decorators and layers ------------------------------------------------------------
def test_stacked_decorators_naming_one_policy_charge_once(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"outer": {**FIXED_IP, "windows": "3/m"}})
    client = Client()
    response = client.get("/stacked-same/")
    assert response.status_code == 200
    assert recorded(response) == [("outer", "allowed", None)]
    assert remaining("outer") == 2


def test_request_refused_by_the_outer_decorator_never_charges_the_inner(quota: Any) -> None:
    outer = {**FIXED_IP, "windows": "1/m"}
    inner = {**FIXED_IP, "windows": "5/m"}
    quota(CLOCK=CLOCK, POLICIES={"outer": outer, "inner": inner})
    client = Client()
    assert statuses(client, "/stacked/", 3) == [200, 429, 429]
    assert remaining("inner") == 4
    refused = client.get("/stacked/")
    assert recorded(refused) == [("outer", "denied", "default_quota_exhausted")]


def test_outer_charge_stands_when_the_inner_decorator_refuses(quota: Any) -> None:
    outer = {**FIXED_IP, "windows": "5/m"}
    inner = {**FIXED_IP, "windows": "1/m"}
    quota(CLOCK=CLOCK, POLICIES={"outer": outer, "inner": inner})
    client = Client()
    assert statuses(client, "/stacked/", 3) == [200, 429, 429]
    # Layers charge on their own: the outer layer allowed and charged all three.
    assert remaining("outer") == 2
    refused = client.get("/stacked/")
    assert recorded(refused) == [
        ("outer", "allowed", None),
        ("inner", "denied", "default_quota_exhausted"),
    ]
    assert problem(refused)["policy"] == "inner"


def test_policy_decided_by_the_middleware_is_reused(quota: Any) -> None:
    named = {**FIXED_IP, "windows": "3/m", "routes": ["/named"]}
    quota(CLOCK=CLOCK, POLICIES={"named": named})
    client = Client()
    response = client.get("/named/")
    assert recorded(response) == [("named", "allowed", None)]
    assert remaining("named") == 2


def test_decorator_and_drf_throttle_naming_one_policy_charge_once(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"named": {**FIXED_IP, "windows": "2/m"}})
    client = Client()
    response = client.get("/drf-throttled/")
    assert response.status_code == 200
    assert recorded(response) == [("named", "allowed", None)]
    assert remaining("named") == 1
    assert statuses(client, "/drf-throttled/", 2) == [200, 429]


def test_one_request_object_sent_again_is_charged_again(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    request = RequestFactory().get("/limited/")
    # Once a decorated view returned, its outcome is no longer reused: a test sending one
    # RequestFactory request several times sees each call charged.
    assert [limited(request).status_code for _ in range(4)] == [200, 200, 200, 429]
    assert [(o.policy, o.decision) for o in django_quota.outcomes(request)] == [(LIMITED, "denied")]


def test_method_decorator_on_a_view_method(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = Client()
    assert statuses(client, "/method/", 2) == [200, 429]
    assert problem(client.get("/method/"))["policy"] == "view:tests.test_decorators.methodview.get"


# -- 6. cost -------------------------------------------------------------------------------
def test_cost_callable_decides_the_charge(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = Client()
    assert client.get("/costly/?cost=7").status_code == 200
    assert remaining("view:tests.test_decorators.costly") == 3
    assert client.get("/costly/?cost=4").status_code == 429
    assert client.get("/costly/?cost=3").status_code == 200
    refused = client.get("/costly/?cost=11")
    assert problem(refused)["reason"] == "cost_exceeds_limit"
    assert "Retry-After" not in refused


@pytest.mark.parametrize(("query", "problem"), [("-1", "returned -1"), ("x", "raised")])
def test_a_cost_callable_that_fails_charges_one_and_is_logged(
    quota: Any, caplog: pytest.LogCaptureFixture, query: str, problem: str
) -> None:
    # Never a 500, never free (docs/settings.md#when-a-projects-callable-fails).
    quota(CLOCK=CLOCK)
    assert Client().get(f"/costly/?cost={query}").status_code == 200
    assert remaining("view:tests.test_decorators.costly") == 9
    assert (
        f"the cost callable tests.test_decorators.cost_from_query of policy "
        f"view:tests.test_decorators.costly {problem}"
    ) in caplog.text


# -- 7. headers ----------------------------------------------------------------------------
def test_without_middleware_the_decorator_writes_its_headers(
    quota: Any, no_middleware: None
) -> None:
    assert not middleware_installed()
    quota(CLOCK=CLOCK)
    client = Client()
    allowed = client.get("/limited/")
    assert ietf(allowed) == ([(LIMITED, {"q": 3, "w": 60})], [(LIMITED, {"r": 2, "t": 40})])
    statuses(client, "/limited/", 2)
    refused = client.get("/limited/")
    assert refused.status_code == 429
    _, limit_items = ietf(refused)
    assert limit_items == [(LIMITED, {"r": 0, "t": 40})]
    assert int(refused["Retry-After"]) >= limit_items[0][1]["t"]


def test_without_middleware_stacked_decorators_write_every_layers_items(
    quota: Any, no_middleware: None
) -> None:
    outer = {**FIXED_IP, "windows": "5/m"}
    inner = {**FIXED_IP, "windows": "2/h"}
    quota(CLOCK=CLOCK, POLICIES={"outer": outer, "inner": inner})
    response = Client().get("/stacked/")
    assert ietf(response) == (
        [("outer", {"q": 5, "w": 60}), ("inner", {"q": 2, "w": 3600})],
        [("outer", {"r": 4, "t": 40}), ("inner", {"r": 1, "t": 2740})],
    )


def test_with_middleware_headers_cover_the_middlewares_and_the_decorators_policies(
    quota: Any,
) -> None:
    assert middleware_installed()
    site = {**FIXED_IP, "windows": "10/m", "routes": ["/limited"]}
    quota(CLOCK=CLOCK, POLICIES={"site": site})
    response = Client().get("/limited/")
    assert ietf(response) == (
        [("site", {"q": 10, "w": 60}), (LIMITED, {"q": 3, "w": 60})],
        [("site", {"r": 9, "t": 40}), (LIMITED, {"r": 2, "t": 40})],
    )


def test_with_middleware_a_refusal_carries_the_headers(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = Client()
    statuses(client, "/limited/", 3)
    refused = client.get("/limited/")
    assert ietf(refused) == ([(LIMITED, {"q": 3, "w": 60})], [(LIMITED, {"r": 0, "t": 40})])


def test_sliding_window_retry_after_is_never_earlier_than_t(quota: Any) -> None:
    quota(CLOCK=CLOCK)
    client = Client()
    statuses(client, "/defaults/", 2)
    refused = client.get("/defaults/")
    assert refused.status_code == 429
    ((_, params),) = parse_sf_list(refused["RateLimit"])
    # 39.6 s to the window's end, 1 ms more for the previous window's weight to drop.
    assert problem(refused)["retry_after"] == 39.601
    assert refused["Retry-After"] == "40"
    assert int(refused["Retry-After"]) >= params["t"]


# -- 8. failures and shadow ----------------------------------------------------------------------
def test_fail_closed_is_a_503_problem(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), FAILURE_RETRY_AFTER=3)
    response = Client().get("/limited/")
    assert response.status_code == 503
    assert response["Retry-After"] == "3"
    assert problem(response) == {
        "type": "about:blank",
        "title": "Service Unavailable",
        "status": 503,
        "detail": "The rate limiter could not decide and this policy fails closed.",
        "reason": "backend_unavailable",
        "policy": LIMITED,
    }


def test_async_fail_closed_is_a_503(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url())
    response = async_to_sync(AsyncClient().get)("/alimited/")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"


def test_fail_open_lets_the_request_through(quota: Any) -> None:
    quota(REDIS_URL=dead_redis_url(), FAILURE_MODE="open")
    response = Client().get("/limited/")
    assert response.status_code == 200
    assert recorded(response) == [(LIMITED, "failed_open", "backend_unavailable")]


def test_shadow_policy_never_refuses(quota: Any) -> None:
    shadow = {**FIXED_IP, "windows": "1/m", "enforcement": "shadow"}
    quota(CLOCK=CLOCK, POLICIES={"named": shadow})
    client = Client()
    responses = [client.get("/named/") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert recorded(responses[-1]) == [("named", "shadow_denied", "default_quota_exhausted")]
    assert "RateLimit" not in responses[-1]
