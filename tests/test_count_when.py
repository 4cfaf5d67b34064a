"""``count_when`` (docs/refunds.md): the edges charge before the view and refund after
the response when its status is not listed; a view that raises counts as a 500. The
middleware, ``@quota`` (sync and async) and ``QuotaThrottle``; 16 threads against a view
that fails half the time never admit more successes than the limit. Against the memory
backend and a real Redis."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.checks import run_checks
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

import django_quota
from django_quota import limiter
from django_quota.core.errors import ConfigurationError
from django_quota.core.policy import parse_policy
from django_quota.decorators import quota
from tests import leases

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

IP = {"ip": "127.0.0.1"}
LIMIT = 10
POLICIES = {
    "mw": {
        "windows": f"{LIMIT}/h", "selector": ["ip"], "routes": ["/mw/"], "count_when": ["2xx"],
    },
    "billable": {"windows": f"{LIMIT}/h", "selector": ["ip"], "count_when": ["2xx"]},
    "failures": {"windows": f"{LIMIT}/h", "selector": ["ip"], "count_when": [401, "5XX"]},
    "flaky": {"algorithm": "sliding_log", "windows": f"{LIMIT}/h", "selector": ["ip"],
              "count_when": ["2xx"]},
    # One layer of two count_when policies: one refund call for both.
    "pair-a": {"windows": f"{LIMIT}/h", "selector": ["ip"], "routes": ["/pair"],
               "count_when": ["2xx"]},
    "pair-b": {"algorithm": "token_bucket", "windows": f"{LIMIT}/h", "selector": ["ip"],
               "routes": ["/pair"], "count_when": ["2xx"]},
}


def status_of(request: HttpRequest) -> int:
    return int(request.GET.get("status", "200"))


# -- views ---------------------------------------------------------------------------------
def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", status=status_of(request))


def boom(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("the view failed")


@quota("billable")
def decorated(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", status=status_of(request))


@quota("failures")
def failures(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", status=status_of(request))


@quota("billable")
async def decorated_async(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", status=status_of(request))


class Throttled(APIView):
    from django_quota.throttling import QuotaThrottle

    throttle_classes = [QuotaThrottle]
    quota_policies = ["billable"]

    def get(self, request: Any) -> Response:
        return Response({"ok": True}, status=int(request.query_params.get("status", "200")))


#: What the flaky view did: attempts it ran and successes it answered.
FLAKY = {"attempts": 0, "successes": 0}
_flaky_lock = threading.Lock()


@quota("flaky")
def flaky(request: HttpRequest) -> HttpResponse:
    with _flaky_lock:
        FLAKY["attempts"] += 1
        fails = FLAKY["attempts"] % 2 == 1
        if not fails:
            FLAKY["successes"] += 1
    return HttpResponse("failed" if fails else "ok", status=503 if fails else 200)


urlpatterns = [
    path("pair", plain),
    path("mw/plain", plain),
    path("mw/boom", boom),
    path("decorated", decorated),
    path("failures", failures),
    path("decorated-async", decorated_async),
    path("throttled", Throttled.as_view()),
    path("flaky", flaky),
]


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, quota: Any) -> Iterator[str]:
    # Roomy time budgets on Redis: the tests pin arithmetic, not latency.
    with leases.configured(request, quota, POLICIES, IP, TIMEOUT=2.0, DEADLINE=5.0) as name:
        yield name


@pytest.fixture
def refunds(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every refund the edges ask for (a release has its own kind of request)."""
    calls: list[Any] = []
    sync, asynchronous = limiter.refund_charge, limiter.arefund_charge

    def counted(request: Any) -> int:
        calls.append(request)
        return sync(request)

    async def acounted(request: Any) -> int:
        calls.append(request)
        return await asynchronous(request)

    monkeypatch.setattr(limiter, "refund_charge", counted)
    monkeypatch.setattr(limiter, "arefund_charge", acounted)
    return calls


def remaining(policy: str) -> int:
    return django_quota.peek(policy, IP).remaining or 0


def test_the_middleware_refunds_what_does_not_count(backend: str, refunds: list[Any]) -> None:
    client = Client(raise_request_exception=False)
    assert client.get("/mw/plain").status_code == 200
    assert remaining("mw") == LIMIT - 1 and refunds == []  # a success keeps its charge
    assert client.get("/mw/plain", {"status": "404"}).status_code == 404
    assert remaining("mw") == LIMIT - 1 and len(refunds) == 1
    assert client.get("/mw/boom").status_code == 500  # a view that raised: a 500
    assert remaining("mw") == LIMIT - 1 and len(refunds) == 2


def test_a_layer_of_several_policies_refunds_in_one_call(
    backend: str, refunds: list[Any]
) -> None:
    client = Client()
    assert client.get("/pair", {"status": "200"}).status_code == 200
    assert client.get("/pair", {"status": "500"}).status_code == 500
    assert (remaining("pair-a"), remaining("pair-b")) == (LIMIT - 1, LIMIT - 1)
    assert len(refunds) == 1 and len(refunds[0].counters) == 2


@pytest.mark.parametrize("url", ["/decorated", "/decorated-async", "/throttled"])
def test_each_edge_keeps_only_the_listed_responses_charge(
    backend: str, refunds: list[Any], url: str
) -> None:
    client = Client()
    for status, kept in ((200, 1), (201, 2), (400, 2), (503, 2), (204, 3)):
        assert client.get(url, {"status": str(status)}).status_code == status
        assert remaining("billable") == LIMIT - kept
    assert len(refunds) == 2  # one refund call, only for each response refunded


def test_the_async_client_refunds_too(backend: str) -> None:
    from asgiref.sync import async_to_sync

    async def scenario() -> list[int]:
        client = AsyncClient()
        codes = []
        for status in (500, 200, 404):
            response = await client.get("/decorated-async", {"status": str(status)})
            codes.append(response.status_code)
        return codes

    assert async_to_sync(scenario)() == [500, 200, 404]
    assert remaining("billable") == LIMIT - 1


def test_statuses_and_classes_both_count(backend: str) -> None:
    client = Client()
    for status in (401, 403, 500, 502, 200):
        client.get("/failures", {"status": str(status)})
    assert remaining("failures") == LIMIT - 3  # 401, 500 and 502 count


def test_sixteen_threads_never_admit_more_successes_than_the_limit(backend: str) -> None:
    FLAKY.update(attempts=0, successes=0)
    answered: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def worker() -> None:
        client = Client()
        start.wait()
        for _ in range(100):  # until the successes have used the budget
            if FLAKY["successes"] >= LIMIT:
                break
            code = client.get("/flaky").status_code
            with lock:
                answered.append(code)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Every failure was refunded, so the successes used the whole budget and no more
    # (without refunds the first 10 admitted, half of them failures, would spend it).
    assert FLAKY["successes"] == LIMIT == answered.count(200)
    assert answered.count(503) == FLAKY["attempts"] - LIMIT >= LIMIT - 1
    assert set(answered) <= {200, 503, 429}
    assert remaining("flaky") == 0
    for _ in range(3):
        assert Client().get("/flaky").status_code == 429
    assert FLAKY["successes"] == LIMIT


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("2xx", "['count_when']"),
        ([], "['count_when']"),
        (["6xx"], "['count_when'][0]"),
        ([200, 99], "['count_when'][1]"),
        ([True], "['count_when'][0]"),
    ],
)
def test_a_bad_count_when_names_the_policy_and_key(
    value: object, where: str, settings: Any
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_policy("p", {"windows": "1/s", "count_when": value})
    assert caught.value.key == f"QUOTA['POLICIES']['p']{where}"
    settings.QUOTA = {"POLICIES": {"p": {"windows": "1/s", "count_when": value}}}
    errors = [m for m in run_checks() if m.id.startswith("django_quota.E")]
    assert [m.id for m in errors] == ["django_quota.E004"]
    assert f"QUOTA['POLICIES']['p']{where}" in errors[0].msg


def test_count_when_changes_no_revision() -> None:
    plain = parse_policy("p", {"windows": "1/s"})
    counted = parse_policy("p", {"windows": "1/s", "count_when": ["2xx", 304]})
    assert counted.revision == plain.revision
    assert counted.count_when == ("2xx", 304)
    assert counted.counts(204) and counted.counts(304) and not counted.counts(301)
