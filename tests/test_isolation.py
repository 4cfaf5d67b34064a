"""Failures stay where they happen and state stays bounded (contract 5.6 and 6; issue 10),
on real servers started here on loopback ports (tests/faults.py, tests/cluster.py):

* async clients and their connections stay bounded whatever the number of event loops;
* a Redis at ``maxmemory`` under ``noeviction`` still denies (denials write nothing) and
  only charges fail, as ``backend_error``;
* the number of keys does not grow with decisions;
* the bounded evaluation-id ledger never charges a repeated id twice, and a repeat whose
  record may have been dropped is ``indeterminate``;
* authentication, permission and OOM replies are ``backend_error`` (never the local
  fallback) and show on the status page;
* a dead cluster primary opens only its own breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path

import django_quota
from django_quota import limiter
from django_quota.decorators import quota as quota_view
from tests.cluster import redis_cluster
from tests.faults import RedisProcess, redis_process

pytestmark = pytest.mark.redis

#: How many event loops (or requests, or decisions) each test runs.
RUNS = 60
#: Connections a test may see over the start: the current loop's client and the one of
#: the loop before it, whose socket the server may not have seen closed yet.
CONNECTION_SLACK = 2


# -- views (for the async view under WSGI) ---------------------------------------------------
@quota_view(rate="1000/h", algorithm="fixed_window", selector="ip")
async def limited_async(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async ok")


urlpatterns = [path("limited-async/", limited_async)]


# -- helpers ---------------------------------------------------------------------------------
def connected_clients(*servers: RedisProcess) -> int:
    """``connected_clients`` summed over ``servers``, each read on a fresh admin
    connection that is closed right after (it counts itself: subtract it)."""
    total = 0
    for server in servers:
        with contextlib.closing(server.client()) as admin:
            total += int(admin.info("clients")["connected_clients"]) - 1
    return total


def settled_clients(*servers: RedisProcess, at_most: int, seconds: float = 3.0) -> int:
    """``connected_clients`` once it is ``<= at_most`` (a closed socket reaches the server
    a moment later), or what it still is after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        count = connected_clients(*servers)
        if count <= at_most or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


def fixed(limit: int, **extra: Any) -> dict[str, Any]:
    return {"algorithm": "fixed_window", "windows": f"{limit}/h", "selector": ["ip"], **extra}


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_process() as started:
        yield started


# -- 1. connections bounded whatever the number of event loops ------------------------------
def test_async_evaluations_in_many_event_loops_keep_connections_bounded(
    server: RedisProcess, quota: Any
) -> None:
    quota(REDIS_URL=server.url, POLICIES={"p": fixed(1000)})
    start = connected_clients(server)
    subject = {"ip": "192.0.2.1"}
    remaining, peak = [], 0
    for _ in range(RUNS):
        outcome = asyncio.run(django_quota.aevaluate("p", subject))
        assert (outcome.decision, outcome.backend_mode) == ("allowed", "redis")
        remaining.append(outcome.remaining)
        peak = max(peak, connected_clients(server))
    assert remaining == list(range(999, 999 - RUNS, -1))  # each loop really reached Redis
    assert peak <= start + CONNECTION_SLACK + 1, (start, peak)
    assert settled_clients(server, at_most=start + 1) <= start + 1
    assert limiter.get_backend().async_client_count == 1  # type: ignore[attr-defined]


@pytest.mark.urls(__name__)
def test_async_views_under_wsgi_keep_connections_bounded(server: RedisProcess, quota: Any) -> None:
    quota(REDIS_URL=server.url)
    client = Client(REMOTE_ADDR="192.0.2.2")
    start = connected_clients(server)
    statuses, remaining, peak = [], [], 0
    for _ in range(RUNS):
        response = client.get("/limited-async/")  # WSGI: each async view in a new loop
        statuses.append(response.status_code)
        (outcome,) = django_quota.outcomes(response.wsgi_request)
        remaining.append(outcome.remaining)
        peak = max(peak, connected_clients(server))
    assert statuses == [200] * RUNS
    assert remaining == list(range(999, 999 - RUNS, -1))
    assert peak <= start + CONNECTION_SLACK + 1, (start, peak)
    assert settled_clients(server, at_most=start + 1) <= start + 1


def test_async_cluster_evaluations_in_many_event_loops_keep_connections_bounded(
    quota: Any,
) -> None:
    with redis_cluster(3, "--cluster-require-full-coverage", "no") as cluster:
        quota(
            REDIS_URL=cluster.url,
            CLUSTER=True,
            TIMEOUT=2.0,
            DEADLINE=5.0,
            POLICIES={"p": fixed(1000)},
        )
        start = connected_clients(*cluster.nodes)
        subjects = [{"ip": f"192.0.2.{number}"} for number in range(1, 4)]
        remaining, peak = [], 0
        for run in range(RUNS):
            outcome = asyncio.run(django_quota.aevaluate("p", subjects[run % 3]))
            assert (outcome.decision, outcome.backend_mode) == ("allowed", "redis")
            remaining.append(outcome.remaining)
            peak = max(peak, connected_clients(*cluster.nodes))
        assert remaining == [999 - run // 3 for run in range(RUNS)]
        # One loop's client holds a connection per primary it talked to.
        bound = start + 2 * len(cluster.nodes) + 1
        assert peak <= bound, (start, peak)
        assert settled_clients(*cluster.nodes, at_most=start + 3) <= start + 3
        assert limiter.get_backend().async_client_count == 1  # type: ignore[attr-defined]
