"""Only the node is blamed for the node's failures (docs/failures.md, "The circuit
breaker"): a Redis at ``maxclients`` that still serves the process's pooled connections
costs no failure and never opens the breaker; a refused new connection is
``backend_unavailable`` labelled ``maxclients``; ``CLUSTERDOWN`` and ``TRYAGAIN`` are
labelled and never counted; a dead node still opens its breaker. Real servers on
loopback (tests/faults.py); the cluster cases are in tests/test_cluster.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.test import Client

import django_quota
from django_quota import engine, limiter
from django_quota.backends import clients
from django_quota.backends.cluster import classify_cluster
from django_quota.backends.scripting import ConnectFailed, classify
from django_quota.core.breaker import CLOSED, OPEN, CircuitBreaker
from django_quota.core.errors import BackendError, Blame, Label
from tests.faults import RedisProcess, proxy_to, redis_process
from tests.test_admin import STATUS, cells

LIMIT = 1000
SUBJECT = {"ip": "127.0.0.1"}


def configure(quota: Any, url: str, **extra: Any) -> None:
    values: dict[str, Any] = {
        "REDIS_URL": url,
        "FAILURE_MODE": "closed",
        "FAILURE_RETRY_AFTER": 5,
        "TIMEOUT": 0.5,
        "DEADLINE": 1.0,
        "POLICIES": {"p": {"windows": f"{LIMIT}/h", "selector": ["ip"]}},
    }
    quota(**{**values, **extra})


@contextlib.contextmanager
def at_maxclients(server: RedisProcess) -> Iterator[int]:
    """The server at ``maxclients``: the limit set to the clients connected now, and raw
    sockets checked refused. Yields the clients connected; the limit is lifted at the end."""
    admin = server.client()
    connected = int(admin.info("clients")["connected_clients"])
    admin.config_set("maxclients", connected)
    try:
        with socket.create_connection(("127.0.0.1", server.port), 2.0) as probe:
            probe.sendall(b"PING\r\n")
            assert probe.recv(100).startswith(b"-ERR max number of clients reached")
        yield connected
    finally:
        admin.config_set("maxclients", 10000)
        admin.close()


def labels() -> list[tuple[str, str]]:
    return [(error.reason, error.label) for error in limiter.recent_errors()]


@pytest.mark.redis
@pytest.mark.django_db
def test_a_redis_at_maxclients_serving_the_pooled_connection_costs_no_failure(
    quota: Any, admin_client: Client
) -> None:
    with redis_process() as server:
        configure(quota, server.url)
        assert django_quota.evaluate("p", SUBJECT).remaining == LIMIT - 1  # one pooled
        pool = limiter.get_backend().client.connection_pool  # type: ignore[attr-defined]
        with at_maxclients(server):
            decided = [django_quota.evaluate("p", SUBJECT) for _ in range(50)]
            assert [o.decision for o in decided] == ["allowed"] * 50
            assert decided[-1].remaining == LIMIT - 51

            # A decision that needs a new connection: the pooled one is held here.
            held = pool.get_connection()
            try:
                calls = 3 * engine.Sizes.BREAKER_THRESHOLD
                refused = [django_quota.evaluate("p", SUBJECT) for _ in range(calls)]
            finally:
                pool.release(held)
            assert {(o.decision, o.reason) for o in refused} == {
                ("failed_closed", "backend_unavailable")
            }
            assert limiter.get_breaker().state == CLOSED  # its connection answers
            assert labels()[-1] == ("backend_unavailable", Label.MAXCLIENTS)
            assert len(labels()) == 3 * engine.Sizes.BREAKER_THRESHOLD

            after = django_quota.evaluate("p", SUBJECT)  # the pooled connection again
            assert (after.decision, after.remaining) == ("allowed", LIMIT - 52)
        assert limiter.get_breaker().state == CLOSED
        errors = cells(admin_client.get(STATUS), "quota-errors")
        assert {(row[1], row[3]) for row in errors} == {("backend_unavailable", Label.MAXCLIENTS)}
        assert "max number of clients reached" in errors[0][2]


@pytest.mark.redis
def test_maxclients_counts_when_no_connection_of_the_node_answered_lately(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with redis_process() as server:
        configure(quota, server.url)
        with at_maxclients(server), caplog.at_level(logging.WARNING, "django_quota"):
            # No connection of this process ever answered: backing off is right.
            for _ in range(engine.Sizes.BREAKER_THRESHOLD):
                outcome = django_quota.evaluate("p", SUBJECT)
                assert (outcome.decision, outcome.reason) == (
                    "failed_closed",
                    "backend_unavailable",
                )
            assert limiter.get_breaker().state == OPEN
            assert set(labels()) == {("backend_unavailable", Label.MAXCLIENTS)}
        assert "label=maxclients (counted by its circuit breaker)" in caplog.text


@pytest.mark.redis
def test_an_async_decision_refused_at_maxclients_keeps_its_label(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the loop's pipelined connections: redis-py's asyncio connection writes its
    handshake's commands one after the other (every redis-py 8), the refusal's reset
    made the second write fail, and the refusal read as a dropped connection (up to 100
    of 100 new connections here before the handshake went out in one write)."""
    monkeypatch.setattr(clients, "PIPELINE_AFTER", 0)  # no decision on the sync client
    with redis_process() as server:
        configure(quota, server.url)
        with at_maxclients(server):

            async def decide() -> list[tuple[str, str | None]]:
                decided = []
                for _ in range(engine.Sizes.BREAKER_THRESHOLD):
                    outcome = await django_quota.aevaluate("p", SUBJECT)
                    decided.append((outcome.decision, outcome.reason))
                return decided

            decided = asyncio.run(decide())
            assert decided == [("failed_closed", "backend_unavailable")] * len(decided)
            full = ("backend_unavailable", Label.MAXCLIENTS)
            assert labels() == [full] * engine.Sizes.BREAKER_THRESHOLD
            assert limiter.get_breaker().state == OPEN  # no connection of it ever answered


@pytest.mark.redis
def test_a_stopped_node_still_opens_its_breaker(quota: Any) -> None:
    with redis_process() as server:
        configure(quota, server.url)
        assert django_quota.evaluate("p", SUBJECT).decision == "allowed"  # it answered
        server.stop()
        for _ in range(engine.Sizes.BREAKER_THRESHOLD):
            assert django_quota.evaluate("p", SUBJECT).reason == "backend_unavailable"
        assert limiter.get_breaker().state == OPEN
        assert {label for _, label in labels()} == {""}


def test_maxclients_is_classified_with_its_label_before_and_after_the_write() -> None:
    reply = redis.exceptions.ConnectionError("max number of clients reached")
    for raised in (ConnectFailed(reply), reply):
        error = classify(raised)
        assert (error.reason, error.label, error.blame) == (
            "backend_unavailable",
            Label.MAXCLIENTS,
            Blame.UNLESS_ANSWERING,
        )
    refused = classify(ConnectFailed(ConnectionRefusedError(111, "Connection refused")))
    assert (refused.reason, refused.label, refused.blame) == ("backend_unavailable", None, None)


@pytest.mark.parametrize(
    ("exc", "label"),
    [
        (redis.exceptions.ClusterDownError("The cluster is down"), Label.CLUSTERDOWN),
        (redis.exceptions.TryAgainError("Multiple keys request during rehashing"), Label.TRYAGAIN),
    ],
)
def test_cluster_refusals_are_labelled_and_blame_no_node(exc: Exception, label: str) -> None:
    error = classify_cluster(exc)
    assert (error.reason, error.label, error.blame) == ("backend_unavailable", label, Blame.NONE)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_excuses_a_refused_connection_only_while_the_node_answers(
    quota: Any,
) -> None:
    quota(REDIS_URL="redis://127.0.0.1:1/0", FAILURE_RETRY_AFTER=1)
    current = limiter.get_limiter()
    guard = current.guard("node")
    clock = Clock()
    guard.breaker = CircuitBreaker(
        engine.Sizes.BREAKER_THRESHOLD, 1.0, clock=clock, recent_errors=current.recent_errors
    )
    maxclients = BackendError(
        "backend_unavailable", "full", label=Label.MAXCLIENTS, blame=Blame.UNLESS_ANSWERING
    )
    clusterdown = BackendError(
        "backend_unavailable", "down", label=Label.CLUSTERDOWN, blame=Blame.NONE
    )
    guard.account(None, clock.now)  # a call started now was answered
    clock.now += 0.9
    for _ in range(3 * engine.Sizes.BREAKER_THRESHOLD):
        guard.account(maxclients, clock.now)
        guard.account(clusterdown, clock.now)
    assert guard.breaker.state == CLOSED
    clock.now += 1.1  # the last answer is now older than the cool-down: they count
    for _ in range(engine.Sizes.BREAKER_THRESHOLD - 1):
        guard.account(maxclients, clock.now)
    assert guard.breaker.state == CLOSED
    guard.account(clusterdown, clock.now)  # an answer: the count starts over
    clock.now += 1.1
    for _ in range(engine.Sizes.BREAKER_THRESHOLD - 1):
        guard.account(maxclients, clock.now)
    assert guard.breaker.state == CLOSED
    guard.account(maxclients, clock.now)
    assert guard.breaker.state == OPEN
    assert [e.label for e in current.recent_errors][-1] == Label.MAXCLIENTS


@pytest.mark.redis
@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_reply_received_as_the_wait_times_out_is_used(quota: Any) -> None:
    """The reply comes 80 ms after EVALSHA (TIMEOUT 100 ms). A signal at 40 ms runs a
    handler for 150 ms: when Python goes back to the socket its timeout has passed, and
    it raises without looking. The reply is in the socket by then: it is read and used,
    not called indeterminate (DEADLINE = TIMEOUT: no retry to hide it)."""
    with redis_process() as server, proxy_to(server) as proxy:
        configure(quota, proxy.url, TIMEOUT=0.1, DEADLINE=0.1)
        assert django_quota.evaluate("p", SUBJECT).remaining == LIMIT - 1  # pooled, loaded
        proxy.latency(0.08)
        previous = signal.signal(signal.SIGALRM, lambda number, frame: time.sleep(0.15))
        signal.setitimer(signal.ITIMER_REAL, 0.04)
        try:
            outcome = django_quota.evaluate("p", SUBJECT)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert (outcome.decision, outcome.reason, outcome.remaining) == (
            "allowed",
            None,
            LIMIT - 2,
        )
        assert limiter.recent_errors() == []
