"""Failures stay where they happen and state stays bounded (docs/arithmetic.md, failures.md; issue
10),
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
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path

import django_quota
from django_quota import engine, limiter, policies
from django_quota.backends import clients
from django_quota.backends.clients import MAX_ASYNC_CLIENTS
from django_quota.backends.cluster import slot_of
from django_quota.backends.redispy import public_path
from django_quota.core.protocol import decode_counter
from django_quota.decorators import quota as quota_view
from tests import clock
from tests.cluster import Cluster, redis_cluster
from tests.differential import fake_backend
from tests.faults import RedisProcess, redis_process
from tests.test_admin import STATUS, cells

pytestmark = pytest.mark.redis

#: How many event loops (or requests, or decisions) each test runs.
RUNS = 60
#: Connections a test may see over the start: the current loop's client and the one of
#: the loop before it, whose socket the server may not have seen closed yet.
CONNECTION_SLACK = 2
#: A whole hour (epoch seconds): hour windows start here.
START = 1_764_000_000.0


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


#: These tests count connections and charges, not latency: time budgets no scheduling
#: hiccup of a loaded machine reaches (a fresh-clone CI run beside other work once saw the
#: default 0.1 s TIMEOUT expire here: failed_closed where Redis was healthy).
ROOMY: dict[str, Any] = {"TIMEOUT": 2.0, "DEADLINE": 5.0}


# -- 1. connections bounded whatever the number of event loops ------------------------------
def test_async_evaluations_in_many_event_loops_keep_connections_bounded(
    server: RedisProcess, quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota(REDIS_URL=server.url, POLICIES={"p": fixed(1000)}, **ROOMY)
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
    # Each loop decided once: on the process's sync client, none with connections of its own.
    assert limiter.get_backend().async_client_count == 0  # type: ignore[attr-defined]
    monkeypatch.setattr(clients, "PIPELINE_AFTER", 0)  # every loop pipelined from now
    assert_live_loops_bounded(subject)


@pytest.mark.urls(__name__)
def test_async_views_under_wsgi_keep_connections_bounded(server: RedisProcess, quota: Any) -> None:
    quota(REDIS_URL=server.url, **ROOMY)
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
        if public_path():  # every async decision on the sync client, in a worker thread
            assert limiter.get_backend().async_client_count == 0  # type: ignore[attr-defined]
            return
        assert limiter.get_backend().async_client_count == 1  # type: ignore[attr-defined]
        assert_live_loops_bounded(subjects[0])


def assert_live_loops_bounded(subject: dict[str, str]) -> None:
    """Loops that stay open keep their clients, up to ``MAX_ASYNC_CLIENTS``: past that the
    oldest is forgotten."""
    loops = [asyncio.new_event_loop() for _ in range(MAX_ASYNC_CLIENTS + 2)]
    try:
        for loop in loops:
            outcome = loop.run_until_complete(django_quota.aevaluate("p", subject))
            assert outcome.decision == "allowed"
        assert limiter.get_backend().async_client_count == MAX_ASYNC_CLIENTS  # type: ignore[attr-defined]
    finally:
        limiter.get_backend().close()
        for loop in loops:
            loop.run_until_complete(asyncio.sleep(0))  # a forgotten client closes in its loop
            loop.close()


# -- 2. a full Redis under noeviction still denies ------------------------------------------
def fill_to_oom(admin: redis.Redis) -> int:
    """``maxmemory`` just above what the server uses, ``noeviction``, then filler keys
    until a write is refused with OOM; returns how many filler keys fit. Then ``maxmemory``
    goes 1 MiB below what the server uses: the last filler left it at most 16 KiB over,
    and memory freed meanwhile (a client's buffers shrinking, a connection closing) could
    otherwise let a small write in (seen once in CI: a charge allowed)."""
    admin.config_set("maxmemory-policy", "noeviction")
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", used + 512 * 1024)
    filler = b"x" * 16_384
    for number in range(10_000):
        try:
            admin.set(f"filler:{number}", filler)
        except redis.exceptions.OutOfMemoryError:
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory", used - 1024 * 1024)
            return number
    raise AssertionError("never reached maxmemory")


def test_a_full_redis_under_noeviction_still_denies_and_only_charges_fail(
    server: RedisProcess, quota: Any
) -> None:
    exhausted = {"ip": "127.0.0.1"}  # the test client's REMOTE_ADDR: the middleware's too
    quota(
        REDIS_URL=server.url,
        LOCAL_FALLBACK={"ENABLED": True},
        # Every refusal below must be Redis's own, not one this process remembers.
        DENIAL_CACHE={"ENABLED": False},
        **ROOMY,
        POLICIES={"p": fixed(3, routes=["/api"])},
    )
    assert [django_quota.evaluate("p", exhausted).remaining for _ in range(3)] == [2, 1, 0]
    with contextlib.closing(server.client()) as admin:
        assert fill_to_oom(admin) > 0
        keys = admin.dbsize()

        denied = django_quota.evaluate("p", exhausted)
        assert (denied.decision, denied.reason, denied.remaining) == (
            "denied",
            "default_quota_exhausted",
            0,
        )
        adenied = asyncio.run(django_quota.aevaluate("p", exhausted))
        assert (adenied.decision, adenied.reason) == ("denied", "default_quota_exhausted")
        response = Client().get("/api/items/")
        assert response.status_code == 429
        (outcome,) = django_quota.outcomes(response.wsgi_request)
        assert (outcome.decision, outcome.backend_mode) == ("denied", "redis")

        for charge in (
            lambda: django_quota.evaluate("p", {"ip": "192.0.2.3"}),
            lambda: asyncio.run(django_quota.aevaluate("p", {"ip": "192.0.2.4"})),
        ):
            failed = charge()
            assert (failed.decision, failed.reason, failed.backend_mode) == (
                "failed_closed",
                "backend_error",
                "redis",
            )
        assert Client(REMOTE_ADDR="192.0.2.5").get("/api/items/").status_code == 503
        assert admin.dbsize() == keys  # neither the denials nor the failed charges wrote
    errors = limiter.recent_errors()
    assert [error.reason for error in errors] == ["backend_error"] * 3
    assert all("OutOfMemoryError" in error.detail for error in errors), errors


# -- 3. keys do not grow with decisions -----------------------------------------------------
@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket"])
def test_keys_after_sixty_decisions_equal_keys_after_one(
    quota: Any, redis_url: str, redis_client: Any, algorithm: str
) -> None:
    clock.set_to(START)
    quota(
        REDIS_URL=redis_url,
        CLOCK="tests.clock.now",
        POLICIES={"p": {"algorithm": algorithm, "windows": "40/h", "selector": ["ip"]}},
        **ROOMY,
    )
    subject = {"ip": "192.0.2.6"}
    first = django_quota.evaluate("p", subject)
    assert (first.decision, first.remaining) == ("allowed", 39)
    after_one = redis_client.dbsize()
    (key,) = redis_client.keys("*")
    decisions = [first] + [django_quota.evaluate("p", subject) for _ in range(RUNS - 1)]
    assert [o.decision for o in decisions] == ["allowed"] * 40 + ["denied"] * (RUNS - 40)
    assert after_one == 1
    assert redis_client.keys("*") == [key]
    state, records = decode_counter(redis_client.get(key), algorithm, 1)
    # the ledger holds the last 8 charged evaluations: fingerprint and charge time each
    assert state is not None and len(records) == 8 * 9
    assert "d" in state  # and says when it last dropped one


# -- 5. refusals of the server are backend_error, never the fallback, and shown -------------
PASSWORD = "right-secret"


@contextlib.contextmanager
def refusing(kind: str) -> Iterator[str]:
    """A server that refuses this client's charges in the way ``kind`` says; yields the
    ``REDIS_URL`` to use."""
    if kind in ("WRONGPASS", "NOAUTH"):
        with redis_process() as started, contextlib.closing(started.client()) as admin:
            admin.config_set("requirepass", PASSWORD)
            password = "wrong-secret" if kind == "WRONGPASS" else None
            yield f"redis://:{password}@127.0.0.1:{started.port}/0" if password else started.url
        return
    with redis_process() as started, contextlib.closing(started.client()) as admin:
        if kind == "OOM":
            fill_to_oom(admin)
            yield started.url
            return
        command = {"NOPERM EVALSHA": "evalsha", "NOPERM SET": "set"}[kind]
        admin.acl_setuser(
            "quota",
            enabled=True,
            passwords=["+quota-secret"],
            keys=["*"],
            commands=["+@all", f"-{command}"],
        )
        yield f"redis://quota:quota-secret@127.0.0.1:{started.port}/0"


#: What the recorded detail of each refusal says: the redis-py exception, or Redis's own
#: words. An unauthenticated client's EVALSHA has more than 10 arguments, which Redis 7
#: refuses as a protocol error before it can say NOAUTH.
REFUSALS = {
    "WRONGPASS": "AuthenticationError: invalid username-password pair",
    "NOAUTH": r"Authentication required|Protocol error: unauthenticated multibulk length",
    "NOPERM EVALSHA": "NoPermissionError",
    "NOPERM SET": "can't run this command",
    "OOM": "OutOfMemoryError",
}


@pytest.mark.django_db
@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_refusing_server_is_backend_error_never_the_fallback_and_on_the_status_page(
    quota: Any, admin_client: Client, kind: str
) -> None:
    with refusing(kind) as url:
        quota(REDIS_URL=url, LOCAL_FALLBACK={"ENABLED": True}, POLICIES={"p": fixed(5)})
        sync = django_quota.evaluate("p", {"ip": "192.0.2.7"})
        asynchronous = asyncio.run(django_quota.aevaluate("p", {"ip": "192.0.2.8"}))
        for outcome in (sync, asynchronous):
            assert (outcome.decision, outcome.reason, outcome.backend_mode) == (
                "failed_closed",
                "backend_error",
                "redis",
            )
        errors = limiter.recent_errors()
        assert [error.reason for error in errors] == ["backend_error"] * 2
        assert all(re.search(REFUSALS[kind], error.detail) for error in errors), errors
        assert limiter.get_breaker().state == "closed"  # the server answered: reachable
        response = admin_client.get(STATUS)
    assert response.status_code == 200
    rows = cells(response, "quota-errors")
    assert [row[1] for row in rows] == ["backend_error"] * 2
    assert all(re.search(REFUSALS[kind], row[2]) for row in rows), rows
    assert PASSWORD not in response.content.decode()


# -- 4. the bounded evaluation-id ledger ----------------------------------------------------
DEDUP_TTL = 2.0


def own_id(on_backend: Any, number: int) -> dict[str, str]:
    """No arguments on Redis (the library's ids); on the memory backend, which gives its
    own evaluations none and so never fills a ledger with them (docs/outcomes.md), an id
    of the caller's: the ledger then fills and drops as Redis's does."""
    return {"evaluation_id": f"other-{number}"} if on_backend.kind == "memory" else {}


@pytest.fixture(params=["memory", "fakeredis", "redis"])
def on_backend(
    request: pytest.FixtureRequest, quota: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Any]]:
    """``configure(**QUOTA)`` on the parametrised backend, with a settable client clock at
    :data:`START` and a small ``DEDUP_TTL``."""
    values: dict[str, Any] = {"CLOCK": "tests.clock.now", "DEDUP_TTL": DEDUP_TTL}
    if request.param == "memory":
        values["BACKEND"] = "memory"
    elif request.param == "redis":
        values["REDIS_URL"] = request.getfixturevalue("redis_url")
    else:
        fake = fakeredis.FakeServer()
        original = limiter.backend_from_settings

        def build(settings: Any) -> Any:
            if settings.backend != "redis":
                return original(settings)
            return fake_backend(fake)

        monkeypatch.setattr(limiter, "backend_from_settings", build)
        values["REDIS_URL"] = "redis://fakeredis.invalid:6379/0"
    clock.set_to(START)

    def configure(**extra: Any) -> Any:
        quota(**values, **extra)
        return limiter.get_backend()

    configure.kind = request.param  # type: ignore[attr-defined]
    yield configure
    clock.set_to(START)


def test_a_repeat_after_its_record_was_dropped_is_indeterminate_never_a_second_charge(
    on_backend: Any,
) -> None:
    on_backend(POLICIES={"p": fixed(1000)})
    mode = "memory" if on_backend.kind == "memory" else "redis"
    subject = {"ip": "192.0.2.9"}
    first = django_quota.evaluate("p", subject, evaluation_id="first")
    assert (first.decision, first.remaining) == ("allowed", 999)
    others = [  # ids of their own (on the memory backend, the caller's for 8 of them)
        django_quota.evaluate("p", subject, **(own_id(on_backend, n) if n < 8 else {}))
        for n in range(80)
    ]
    assert [o.remaining for o in others] == list(range(998, 918, -1))
    ids = {o.evaluation_id for o in others} | {"first"}
    assert len(ids) == (10 if on_backend.kind == "memory" else 81)  # memory: 8, "" and first

    before = django_quota.peek("p", subject).remaining
    again = django_quota.evaluate("p", subject, evaluation_id="first")
    assert (again.decision, again.reason, again.backend_mode) == (
        "failed_closed",
        "indeterminate",
        mode,
    )
    assert (again.remaining, again.evaluation_id) == (None, "first")
    assert django_quota.peek("p", subject).remaining == before == 919  # nothing charged
    assert limiter.recent_errors()[-1].reason == "indeterminate"

    # Once DEDUP_TTL has passed since the drop, no record can still be remembered: the
    # same id is decided afresh.
    clock.set_to(START + DEDUP_TTL + 0.001)
    fresh = django_quota.evaluate("p", subject, evaluation_id="first")
    assert (fresh.decision, fresh.reason, fresh.remaining) == ("allowed", None, 918)
    assert django_quota.peek("p", subject).remaining == 918


def test_a_repeat_the_ledger_still_holds_is_allowed_and_charges_nothing(
    on_backend: Any,
) -> None:
    on_backend(POLICIES={"p": fixed(1000)})
    subject = {"ip": "192.0.2.10"}
    first = django_quota.evaluate("p", subject, evaluation_id="kept")
    assert first.remaining == 999
    for n in range(7):  # the ledger keeps 8: "kept" is its oldest now
        django_quota.evaluate("p", subject, **own_id(on_backend, n))
    before = django_quota.peek("p", subject).remaining
    assert before == 992
    again = django_quota.evaluate("p", subject, evaluation_id="kept")
    assert (again.decision, again.reason, again.remaining) == ("allowed", None, 992)
    assert django_quota.peek("p", subject).remaining == 992
    # One more charge drops "kept" (within DEDUP_TTL): its repeat is now indeterminate.
    assert django_quota.evaluate("p", subject, **own_id(on_backend, 7)).remaining == 991
    dropped = django_quota.evaluate("p", subject, evaluation_id="kept")
    assert (dropped.decision, dropped.reason) == ("failed_closed", "indeterminate")
    assert django_quota.peek("p", subject).remaining == 991


def test_an_indeterminate_repeat_follows_the_failure_mode(on_backend: Any) -> None:
    on_backend(FAILURE_MODE="open", POLICIES={"p": fixed(1000)})
    subject = {"ip": "192.0.2.11"}
    django_quota.evaluate("p", subject, evaluation_id="first")
    for n in range(8):
        django_quota.evaluate("p", subject, **own_id(on_backend, n))
    again = asyncio.run(django_quota.aevaluate("p", subject, evaluation_id="first"))
    assert (again.decision, again.reason, again.allowed) == ("failed_open", "indeterminate", True)
    assert django_quota.peek("p", subject).remaining == 991


# -- 6. a dead cluster primary fails only its own slots --------------------------------------
def counter_of(policy_id: str, subject: dict[str, str]) -> str:
    prepared = limiter.get_limiter().prepare(
        [policies.get_policy(policy_id)], subject, 1, peek=True
    )
    assert prepared.request is not None
    return prepared.request.counters[0]


def subjects_by_node(cluster: Cluster, policy_id: str, per_node: int) -> dict[int, list[Any]]:
    """``per_node`` subjects for each primary (by port), found from the slot table."""
    with contextlib.closing(cluster.nodes[0].client()) as admin:
        ranges = [(int(s), int(e), int(primary[1])) for s, e, primary, *_ in admin.cluster("SLOTS")]
    found: dict[int, list[Any]] = {node.port: [] for node in cluster.nodes}
    for number in range(5_000):
        subject = {"ip": f"10.{number // 250}.0.{number % 250 + 1}"}
        slot = slot_of(counter_of(policy_id, subject))
        port = next(port for start, end, port in ranges if start <= slot <= end)
        if len(found[port]) < per_node:
            found[port].append(subject)
        if all(len(subjects) == per_node for subjects in found.values()):
            return found
    raise AssertionError("too few subjects per node")


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("victim", [0, 1], ids=["the URL's node", "another node"])
def test_a_killed_primary_opens_only_its_own_breaker(quota: Any, driver: str, victim: int) -> None:
    def decide(subject: dict[str, str]) -> Any:
        if driver == "sync":
            return django_quota.evaluate("p", subject)
        return asyncio.run(django_quota.aevaluate("p", subject))  # a new loop each, as WSGI

    with redis_cluster(3, "--cluster-require-full-coverage", "no") as cluster:
        quota(
            REDIS_URL=cluster.url,
            CLUSTER=True,
            TIMEOUT=0.5,
            DEADLINE=1.0,
            FAILURE_RETRY_AFTER=60,  # the breaker's cool-down: longer than the test
            POLICIES={"p": fixed(1000)},
        )
        subjects = subjects_by_node(cluster, "p", per_node=engine.Sizes.BREAKER_THRESHOLD + 3)
        for port in subjects:  # every primary answers, and the clients learn the slots
            assert decide(subjects[port][0]).remaining == 999
        dead = cluster.nodes[victim]
        dead.kill()  # SIGKILL

        failing = [decide(subject) for subject in subjects[dead.port][1:]]
        assert {o.decision for o in failing} == {"failed_closed"}
        assert {o.reason for o in failing} <= {
            "backend_unavailable",
            "backend_timeout",
            "indeterminate",
        }
        details = [error.detail for error in limiter.recent_errors()]
        assert f"circuit breaker open for 127.0.0.1:{dead.port}" in details  # calls stopped
        healthy = [
            decide(subject)
            for port, some in subjects.items()
            if port != dead.port
            for subject in some
        ]
        assert [(o.decision, o.reason) for o in healthy] == [("allowed", None)] * len(healthy), [
            error.detail for error in limiter.recent_errors()
        ]
        assert {o.remaining for o in healthy} == {999, 998}  # the first of each was warm-up

        states = {
            name: guard.breaker.state for name, guard in limiter.get_limiter().guards().items()
        }
        assert states.pop(f"127.0.0.1:{dead.port}") == "open", states
        for node in cluster.nodes:
            if node is not dead:
                assert states.pop(f"127.0.0.1:{node.port}") == "closed", states
        assert set(states.values()) <= {"closed"}, states  # e.g. "cluster", before slots
