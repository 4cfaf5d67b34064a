"""``QUOTA["CLUSTER"] = True`` against a real Redis Cluster started here: three primaries on
free loopback ports (``tests/cluster.py``), one cluster for the module, every node killed
at the end (docs/settings.md, arithmetic.md, subjects.md, failures.md, operations.md,
cluster.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.core.management import call_command
from redis.cluster import RedisCluster

import django_quota
from django_quota import engine, limiter, policies
from django_quota.backends.cluster import (
    Call,
    RedisClusterBackend,
    classify_cluster,
    plan,
    slot_of,
    split_by_slot,
)
from django_quota.backends.redispy import AsyncMarkingClusterConnection
from django_quota.backends.scripting import drive
from django_quota.core.calls import GROUP_CLOCK_UNSAFE
from django_quota.core.errors import BackendError
from django_quota.core.outcome import Outcome
from django_quota.core.protocol import GroupReply, decode_counter, log_key
from django_quota.core.windows import log_units
from django_quota.scripts import all_scripts
from tests import clock
from tests.cluster import Cluster, redis_cluster

pytestmark = pytest.mark.redis

START = 1_764_000_000.0  # a whole hour: fixed windows of an hour start here
ALGORITHMS = ("fixed_window", "sliding_window", "sliding_log", "token_bucket")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with redis_cluster() as started:
        yield started


@pytest.fixture
def on_cluster(cluster: Cluster, quota: Any) -> Iterator[Any]:
    """``configure(POLICIES=..., **QUOTA)``: the cluster backend, a client clock at
    :data:`START`, every node flushed before the test."""
    cluster.wait_ok()
    cluster.flushall()
    clock.set_to(START)

    def configure(**values: Any) -> Any:
        values.setdefault("REDIS_URL", cluster.url)
        values.setdefault("CLUSTER", True)
        values.setdefault("CLOCK", "tests.clock.now")
        values.setdefault("TIMEOUT", 2.0)
        values.setdefault("DEADLINE", 5.0)
        quota(**values)
        return limiter.get_backend()

    yield configure
    clock.set_to(START)


# -- helpers -----------------------------------------------------------------------------------
def counter_of(policy_id: str, subject: dict[str, str]) -> str:
    prepared = limiter.get_limiter().prepare(
        [policies.get_policy(policy_id)], subject, 1, peek=True
    )
    assert prepared.request is not None
    return prepared.request.counters[0]


def state(cluster: Cluster, key: str) -> dict[str, int]:
    """A counter's numbers read back from the node that serves it (``{}`` for none), in
    the layout of the policy its key names."""
    length, rest = key.split("}:", 1)[1].split(":", 1)
    policy = policies.get_policy(rest[: int(length)])
    with contextlib.closing(cluster.client(cluster.node_of(key))) as client:
        numbers, _ = decode_counter(client.get(key), policy.algorithm, len(policy.windows))
        return numbers or {}


def logs(cluster: Cluster, key: str, window_count: int = 1) -> list[list[int]]:
    """The sliding-log lists of a counter (one per window; empty for other algorithms)."""
    with contextlib.closing(cluster.client(cluster.node_of(key))) as client:
        return [
            [int(v) for v in client.lrange(log_key(key, index), 0, -1)]
            for index in range(1, window_count + 1)
        ]


def evalsha_calls(cluster: Cluster, port: int | None = None) -> int:
    """``EVALSHA`` calls the node(s) executed (``INFO commandstats``)."""
    total = 0
    for node in cluster.nodes:
        if port is not None and node.port != port:
            continue
        with contextlib.closing(cluster.client(node.port)) as client:
            total += int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    return total


def subjects_on_distinct_nodes(cluster: Cluster, policy_id: str, dimension: str) -> list[dict]:
    """One subject per node for ``policy_id`` (pseudonyms are HMACs: search a few)."""
    found: dict[int, dict[str, str]] = {}
    for number in range(200):
        value = f"10.0.{number // 250}.{number % 250 + 1}" if dimension == "ip" else f"u{number}"
        subject = {dimension: value}
        found.setdefault(cluster.node_of(counter_of(policy_id, subject)), subject)
        if len(found) == len(cluster.nodes):
            break
    return list(found.values())


def comparable(outcome: Outcome) -> Outcome:
    return dataclasses.replace(outcome, backend_mode="", evaluation_id="")


# -- tests -------------------------------------------------------------------------------------
def test_settings_build_the_cluster_backend_with_retries_off(on_cluster: Any) -> None:
    backend = on_cluster(TIMEOUT=0.3, MAX_INFLIGHT=7, POLICIES={"p": {"windows": "1/h"}})
    assert isinstance(backend, RedisClusterBackend) and backend.mode == "redis"
    client = backend.client
    assert isinstance(client, RedisCluster)
    assert client.retry.get_retries() == 0
    nodes = client.get_nodes()
    assert len(nodes) == 3
    for node in nodes:
        pool = node.redis_connection.connection_pool
        assert type(pool).__name__ == (
            "PublicMarkingConnectionPool" if backend.public else "MarkingConnectionPool"
        )
        assert pool.max_connections == 7
        assert pool.connection_kwargs["socket_timeout"] == 0.3
        assert pool.connection_kwargs["socket_connect_timeout"] == 0.3
        assert pool.connection_kwargs["retry"].get_retries() == 0
        assert pool.connection_kwargs["protocol"] == 2
    assert django_quota.evaluate("p", {"ip": "192.0.2.1"}).decision == "allowed"
    if backend.public:  # async decisions run on that client, in a worker thread
        assert asyncio.run(django_quota.aevaluate("p", {"ip": "192.0.2.2"})).allowed
        assert backend.async_client_count == 0
        return

    async def async_client() -> Any:
        assert (await django_quota.aevaluate("p", {"ip": "192.0.2.2"})).decision == "allowed"
        return backend._async()  # this loop's client

    aclient = asyncio.run(async_client())
    assert aclient.retry.get_retries() == 0
    anodes = aclient.get_nodes()
    assert len(anodes) == 3
    for anode in anodes:
        assert anode.connection_class is AsyncMarkingClusterConnection
        assert anode.max_connections == 7
        assert anode.connection_kwargs["socket_timeout"] == 0.3
        assert anode.connection_kwargs["socket_connect_timeout"] == 0.3
        assert anode.connection_kwargs["protocol"] == 2


def test_url_query_options_cannot_undo_the_pinned_client_settings(
    on_cluster: Any, cluster: Cluster
) -> None:
    backend = on_cluster(
        REDIS_URL=cluster.url + "?socket_timeout=30&max_connections=999",
        TIMEOUT=0.2,
        MAX_INFLIGHT=5,
        POLICIES={"p": {"windows": "1/h"}},
    )
    for node in backend.client.get_nodes():
        pool = node.redis_connection.connection_pool
        assert (pool.max_connections, pool.connection_kwargs["socket_timeout"]) == (5, 0.2)


def test_cache_alias_with_cluster_borrows_the_cache_url(
    on_cluster: Any, cluster: Cluster, settings: Any
) -> None:
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "quota": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": cluster.url},
    }
    backend = on_cluster(REDIS_URL=None, CACHE_ALIAS="quota", POLICIES={"p": {"windows": "2/h"}})
    assert isinstance(backend, RedisClusterBackend) and backend.url == cluster.url
    assert django_quota.evaluate("p", {"ip": "192.0.2.1"}).remaining == 1


# -- exact outcomes: the same as the memory backend for the same client clock ----------------
WINDOWS = {"burst": "4/10s", "sustained": "9/m"}
#: (seconds to advance the injected client clock, cost); cost 0 is a peek, 5 is refused
#: before any backend (above the burst limit).
STEPS = [
    (0, 1), (0, 1), (0, 2), (0, 1), (0.5, 1), (2.0, 1), (7.6, 3), (0.001, 1), (9.999, 1),
    (0, 0), (29.9, 2), (0, 5), (31, 1), (0.25, 4), (60, 1), (3600, 2), (0, 1),
]  # fmt: skip


def _run(group_ids: list[str], subject: dict[str, str]) -> list[list[Outcome]]:
    group = [policies.get_policy(policy_id) for policy_id in group_ids]
    clock.set_to(START)
    runs = []
    for advance, cost in STEPS:
        clock.set_to(clock.current + advance)
        runs.append(limiter.evaluate_policies(group, subject, cost))
    runs.append([limiter.peek(policy_id, subject) for policy_id in group_ids])
    return runs


def _cluster_then_memory(
    on_cluster: Any,
    quota: Any,
    definitions: dict[str, Any],
    group_ids: list[str],
    subject: dict[str, str],
) -> tuple[list[list[Outcome]], list[list[Outcome]]]:
    on_cluster(POLICIES=definitions)
    on_redis = _run(group_ids, subject)
    quota(CLOCK="tests.clock.now", POLICIES=definitions)
    assert limiter.get_backend().mode == "memory"
    return on_redis, _run(group_ids, subject)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_gives_the_memory_backends_exact_outcomes(
    on_cluster: Any, quota: Any, algorithm: str
) -> None:
    definitions = {"p": {"algorithm": algorithm, "windows": WINDOWS, "selector": ["user"]}}
    on_redis, in_memory = _cluster_then_memory(
        on_cluster, quota, definitions, ["p"], {"user": "42"}
    )
    assert [[comparable(o) for o in step] for step in on_redis] == [
        [comparable(o) for o in step] for step in in_memory
    ]
    decisions = {o.decision for step in on_redis for o in step}
    # Decided by the cluster, a repeated refusal by the denial cache (docs/failures.md).
    assert {"allowed", "denied"} <= decisions and all(
        o.backend_mode == "redis" or (o.backend_mode == "cache" and o.decision == "denied")
        for step in on_redis
        for o in step
    )


def split_subject(cluster: Cluster, first: str, second: str) -> dict[str, str]:
    """A subject whose ``user`` counter of ``first`` and ``ip`` counter of ``second`` are
    on different nodes (so: different slots)."""
    for number in range(200):
        subject = {"user": f"u{number}", "ip": f"10.1.{number // 250}.{number % 250 + 1}"}
        if cluster.node_of(counter_of(first, {"user": subject["user"]})) != cluster.node_of(
            counter_of(second, {"ip": subject["ip"]})
        ):
            return subject
    raise AssertionError("no subject split over two nodes")


def _group_definitions(algorithm: str) -> dict[str, Any]:
    return {
        "a": {"algorithm": algorithm, "windows": "5/m", "selector": ["user"]},
        "b": {
            "algorithm": algorithm,
            "windows": {"burst": "2/10s", "sustained": "4/m"},
            "selector": ["ip"],
        },
    }


@pytest.mark.parametrize("order", [["a", "b"], ["b", "a"]], ids=["refund", "dry-run"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_group_across_slots_decides_as_one_script_would(
    on_cluster: Any, quota: Any, cluster: Cluster, algorithm: str, order: list[str]
) -> None:
    definitions = _group_definitions(algorithm)
    on_cluster(POLICIES=definitions)
    subject = split_subject(cluster, "a", "b")
    on_redis, in_memory = _cluster_then_memory(on_cluster, quota, definitions, order, subject)

    def decided(runs: list[list[Outcome]]) -> list[list[tuple[Any, ...]]]:
        return [
            [
                (
                    o.policy,
                    o.decision,
                    o.reason,
                    o.window,
                    o.remaining,
                    o.retry_after,
                    tuple(w.remaining for w in o.windows),
                )
                for o in step
            ]
            for step in runs
        ]

    assert decided(on_redis) == decided(in_memory)
    # The final peeks read the counters: every refund restored the exact state.
    assert [comparable(o) for o in on_redis[-1]] == [comparable(o) for o in in_memory[-1]]
    assert any(o.policy == "b" and o.decision == "denied" for step in on_redis for o in step)


# -- slots and nodes --------------------------------------------------------------------------
def test_keys_of_several_subjects_land_on_different_nodes(
    on_cluster: Any, cluster: Cluster
) -> None:
    backend = on_cluster(
        POLICIES={
            "p": {"windows": "5/h", "selector": ["ip"]},
            "q": {"windows": "7/h", "selector": ["ip"]},
        }
    )
    subjects = subjects_on_distinct_nodes(cluster, "p", "ip")
    holders = set()
    for subject in subjects:
        outcomes = limiter.evaluate_policies(
            [policies.get_policy("p"), policies.get_policy("q")], subject
        )
        assert [o.remaining for o in outcomes] == [4, 6]
        key, other = counter_of("p", subject), counter_of("q", subject)
        with contextlib.closing(cluster.client(cluster.nodes[1].port)) as client:
            assert int(client.cluster("KEYSLOT", key)) == slot_of(key) == slot_of(other)
        port = cluster.node_of(key)
        holders.add(port)
        with contextlib.closing(cluster.client(port)) as client:
            assert client.exists(key, other) == 2
            _, records = decode_counter(client.get(key), "fixed_window", 1)
            assert len(records) == 9  # one evaluation in the counter's ledger
        for node in cluster.nodes:
            if node.port != port:
                with contextlib.closing(cluster.client(node.port)) as client:
                    assert not {key.encode(), other.encode()} & set(client.keys("*"))
        assert 0 < backend.ttl_ms(key) <= 3_601_000
    assert len(holders) == 3


def test_two_policies_on_one_subject_share_a_slot_and_one_evalsha(
    on_cluster: Any, cluster: Cluster
) -> None:
    on_cluster(
        POLICIES={
            "a": {"windows": "5/h", "selector": ["user"]},
            "b": {"algorithm": "token_bucket", "windows": "3/h", "selector": ["user"]},
        }
    )
    limiter.get_backend().preload()
    subject = {"user": "7"}
    assert slot_of(counter_of("a", subject)) == slot_of(counter_of("b", subject))
    before = evalsha_calls(cluster)
    group = [policies.get_policy("a"), policies.get_policy("b")]
    outcomes = limiter.evaluate_policies(group, subject)
    assert evalsha_calls(cluster) - before == 1
    assert [(o.decision, o.remaining) for o in outcomes] == [("allowed", 4), ("allowed", 2)]
    assert state(cluster, counter_of("a", subject))["c1"] == 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_group_on_two_slots_charges_both_or_refunds_the_first(
    on_cluster: Any, cluster: Cluster, algorithm: str
) -> None:
    on_cluster(
        POLICIES={
            "a": {"algorithm": algorithm, "windows": "5/h", "selector": ["user"]},
            "b": {"algorithm": algorithm, "windows": "1/h", "selector": ["ip"]},
        }
    )
    limiter.get_backend().preload()
    subject = split_subject(cluster, "a", "b")
    a_key = counter_of("a", {"user": subject["user"]})
    b_key = counter_of("b", {"ip": subject["ip"]})
    a, b = policies.get_policy("a"), policies.get_policy("b")

    before = evalsha_calls(cluster)
    both = limiter.evaluate_policies([a, b], subject)
    assert [(o.decision, o.remaining) for o in both] == [("allowed", 4), ("allowed", 0)]
    assert evalsha_calls(cluster) - before == 2  # one per slot
    charged_a, charged_b = state(cluster, a_key), state(cluster, b_key)
    assert (charged_a["c1"], charged_b["c1"]) == (1, 1)
    logged_a, logged_b = logs(cluster, a_key), logs(cluster, b_key)
    if algorithm == "sliding_log":  # one event each: (time, units before it)
        assert logged_a == logged_b == [[int(START * 1000), 0]]

    before = evalsha_calls(cluster)
    refused = limiter.evaluate_policies([a, b], subject)
    assert [(o.decision, o.remaining) for o in refused] == [("allowed", 4), ("denied", 0)]
    assert refused[1].reason == "default_quota_exhausted"
    assert evalsha_calls(cluster) - before == 3  # a charged, b denied, a refunded
    assert state(cluster, a_key) == charged_a and state(cluster, b_key) == charged_b
    assert logs(cluster, a_key) == logged_a and logs(cluster, b_key) == logged_b

    before = evalsha_calls(cluster)
    reversed_order = limiter.evaluate_policies([b, a], subject)
    assert [(o.policy, o.decision, o.remaining) for o in reversed_order] == [
        ("b", "denied", 0),
        ("a", "allowed", 4),
    ]
    assert evalsha_calls(cluster) - before == 2  # b denied, then a decided, not charged
    assert state(cluster, a_key) == charged_a
    assert logs(cluster, a_key) == logged_a


def test_the_async_api_splits_and_refunds_the_same_way(on_cluster: Any, cluster: Cluster) -> None:
    on_cluster(
        POLICIES={
            "a": {"windows": "5/h", "selector": ["user"]},
            "b": {"windows": "1/h", "selector": ["ip"]},
        }
    )
    subject = split_subject(cluster, "a", "b")
    a_key = counter_of("a", {"user": subject["user"]})
    group = [policies.get_policy("a"), policies.get_policy("b")]

    async def scenario() -> list[list[Outcome]]:
        return [await limiter.aevaluate_policies(group, subject) for _ in range(3)]

    runs = asyncio.run(scenario())
    assert [[(o.decision, o.remaining) for o in run] for run in runs] == [
        [("allowed", 4), ("allowed", 0)],
        [("allowed", 4), ("denied", 0)],
        [("allowed", 4), ("denied", 0)],
    ]
    assert state(cluster, a_key)["c1"] == 1
    assert asyncio.run(django_quota.areset("a", {"user": subject["user"]})) == 1


# -- concurrency --------------------------------------------------------------------------------
THREADS = 16
ATTEMPTS_PER_THREAD = 12


def _admitted_by_threads(group_ids: list[str], subject: dict[str, str]) -> int:
    group = [policies.get_policy(policy_id) for policy_id in group_ids]
    barrier = threading.Barrier(THREADS)
    counts: list[int] = []
    failures: list[Outcome] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        admitted = 0
        for _ in range(ATTEMPTS_PER_THREAD):
            outcomes = limiter.evaluate_policies(group, subject)
            with lock:
                failures.extend(o for o in outcomes if o.decision not in ("allowed", "denied"))
            admitted += all(o.decision == "allowed" for o in outcomes)
        with lock:
            counts.append(admitted)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == [] and len(counts) == THREADS
    return sum(counts)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sixteen_threads_admit_exactly_the_limit_on_the_cluster(
    on_cluster: Any, cluster: Cluster, algorithm: str
) -> None:
    on_cluster(
        POLICIES={
            "one": {"algorithm": algorithm, "windows": "37/h", "selector": ["user"]},
            # Two slots; the second one binds, so every refusal refunds the first.
            "a": {"algorithm": algorithm, "windows": "60/h", "selector": ["user"]},
            "b": {"algorithm": algorithm, "windows": "23/h", "selector": ["ip"]},
        }
    )
    subject = split_subject(cluster, "a", "b")
    assert _admitted_by_threads(["one"], {"user": subject["user"]}) == 37
    assert _admitted_by_threads(["a", "b"], subject) == 23
    # 192 evaluations charged "a" and 169 of them were refunded: exactly 23 remain.
    assert state(cluster, counter_of("a", {"user": subject["user"]}))["c1"] == 23
    assert state(cluster, counter_of("b", {"ip": subject["ip"]}))["c1"] == 23
    if algorithm == "sliding_log":  # the refunds removed every unit they gave back
        a_key = counter_of("a", {"user": subject["user"]})
        for key in (a_key, counter_of("b", {"ip": subject["ip"]})):
            assert log_units(state(cluster, key)["c1"], tuple(logs(cluster, key)[0])) == 23


# -- scripts ------------------------------------------------------------------------------------
def _flush_scripts(cluster: Cluster) -> None:
    for node in cluster.nodes:
        with contextlib.closing(cluster.client(node.port)) as client:
            client.script_flush()


def test_script_flush_on_every_node_is_invisible(on_cluster: Any, cluster: Cluster) -> None:
    on_cluster(
        POLICIES={
            "a": {"windows": "5/h", "selector": ["user"]},
            "b": {"windows": "1/h", "selector": ["ip"]},
        }
    )
    subject = split_subject(cluster, "a", "b")
    group = [policies.get_policy("a"), policies.get_policy("b")]
    assert [o.decision for o in limiter.evaluate_policies(group, subject)] == ["allowed"] * 2
    _flush_scripts(cluster)
    # evaluate.lua on both slots and refund.lua are all missing: each NOSCRIPT reloads.
    refused = limiter.evaluate_policies(group, subject)
    assert [(o.decision, o.reason, o.remaining) for o in refused] == [
        ("allowed", None, 4),
        ("denied", "default_quota_exhausted", 0),
    ]
    assert state(cluster, counter_of("a", {"user": subject["user"]}))["c1"] == 1
    _flush_scripts(cluster)
    assert asyncio.run(django_quota.aevaluate("a", {"user": subject["user"]})).remaining == 3
    _flush_scripts(cluster)
    assert django_quota.reset("a", {"user": subject["user"]}) == 1


def test_quota_preload_loads_every_script_on_every_primary(
    on_cluster: Any, cluster: Cluster
) -> None:
    on_cluster()
    _flush_scripts(cluster)
    scripts = all_scripts()
    assert {s.name for s in scripts} == {
        "evaluate",
        "evaluate_fixed_window",
        "evaluate_sliding_window",
        "evaluate_token_bucket",
        "evaluate_sliding_log",
        "reset",
        "refund",
        "release",
    }
    out = io.StringIO()
    call_command("quota", "preload", stdout=out, no_color=True)
    assert out.getvalue() == "".join(f"{s.name} {s.sha1}\n" for s in scripts)
    for node in cluster.nodes:
        with contextlib.closing(cluster.client(node.port)) as client:
            assert client.script_exists(*(s.sha1 for s in scripts)) == [True] * len(scripts)


def test_quota_check_passes_on_the_cluster(on_cluster: Any) -> None:
    on_cluster()
    out = io.StringIO()
    call_command("quota", "check", stdout=out, no_color=True)
    lines = out.getvalue().splitlines()
    assert [line.split(":", 1)[0] for line in lines] == [
        "connectivity",
        "latency",
        "scripts",
        "evaluation",
        "clock offset",
        "maxmemory-policy",
    ]
    assert all(": ok - " in line for line in lines), lines
    assert lines[0] == "connectivity: ok - PING answered by 3 primaries"
    assert lines[3] == (
        "evaluation: ok - evaluate.lua peeked and charged a probe counter of each algorithm "
        "in use (fixed_window, sliding_log (3 charges, the list trimmed)), reset.lua reset "
        "them, and they were removed"
    )


# -- failures -----------------------------------------------------------------------------------
def _raised_while_handling(handled: Exception, raised: Exception) -> Exception:
    try:
        try:
            raise handled
        except Exception:
            raise raised  # noqa: B904 - redis-py raises its refresh failure like this
    except Exception as exc:
        return exc


def _raised_from(cause: Exception, raised: Exception) -> Exception:
    try:
        raise raised from cause
    except Exception as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (
            redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
            "backend_unavailable",
        ),
        (redis.exceptions.TryAgainError("TRYAGAIN"), "backend_unavailable"),
        (redis.exceptions.MovedError("3999 127.0.0.1:6381"), "backend_unavailable"),
        (redis.exceptions.AskError("3999 127.0.0.1:6381"), "backend_unavailable"),
        (redis.exceptions.ClusterError("TTL exhausted."), "backend_unavailable"),
        (redis.exceptions.SlotNotCoveredError("Slot 1 is not covered"), "backend_unavailable"),
        (redis.exceptions.MaxConnectionsError("Too many connections"), "backend_unavailable"),
        (redis.exceptions.TimeoutError("Timeout reading from socket"), "indeterminate"),
        (redis.exceptions.ConnectionError("Connection closed by server."), "indeterminate"),
        (redis.exceptions.ResponseError("ERR something"), "backend_error"),
        (
            _raised_while_handling(
                redis.exceptions.TimeoutError("read"),
                redis.exceptions.RedisClusterException("cannot be connected"),
            ),
            "indeterminate",
        ),
        (
            _raised_from(
                redis.exceptions.TimeoutError("connect"),
                redis.exceptions.RedisClusterException("cannot be connected"),
            ),
            "backend_timeout",
        ),
        (
            _raised_from(
                redis.exceptions.ConnectionError("refused"),
                redis.exceptions.RedisClusterException("cannot be connected"),
            ),
            "backend_unavailable",
        ),
        (
            redis.exceptions.RedisClusterException("Cluster mode is not enabled on this node"),
            "backend_error",
        ),
    ],
)
def test_cluster_errors_map_to_the_documented_reasons(exc: Exception, reason: str) -> None:
    assert classify_cluster(exc).reason == reason


def settled(call: Callable[[], Outcome], tries: int = 3) -> Outcome:
    """``call()``'s outcome, taken again (up to ``tries`` in all) while it is
    ``backend_timeout``: for the calls before a fault, which only connect."""
    for _ in range(tries - 1):
        outcome = call()
        if outcome.reason != "backend_timeout":
            return outcome
        time.sleep(0.05)
    return call()


def test_a_stopped_node_fails_by_failure_mode_and_never_raises(
    on_cluster: Any, cluster: Cluster
) -> None:
    on_cluster(
        TIMEOUT=0.1,
        DEADLINE=0.25,
        FAILURE_RETRY_AFTER=3,
        POLICIES={
            "closed": {"windows": "5/h", "selector": ["ip"], "failure_mode": "closed"},
            "open": {"windows": "5/h", "selector": ["ip"], "failure_mode": "open"},
            "a": {"windows": "5/h", "selector": ["user"]},
        },
    )
    by_node = {
        cluster.node_of(counter_of("closed", s)): s
        for s in subjects_on_distinct_nodes(cluster, "closed", "ip")
    }
    # Not the node the URL names: a client created while that one is down finds no cluster.
    victim = cluster.nodes[1]
    lost, kept = by_node[victim.port], by_node[cluster.nodes[0].port]
    user = next(
        {"user": f"u{n}"}
        for n in range(200)
        if cluster.node_of(counter_of("a", {"user": f"u{n}"})) != victim.port
    )
    group = [policies.get_policy("a"), policies.get_policy("closed")]
    loop = asyncio.new_event_loop()  # one async client, whose connections outlive a call
    try:
        for subject in (lost, kept):  # pooled connections to every node, sync and async
            # The first calls connect under TIMEOUT=0.1, which a loaded machine can miss
            # (backend_timeout charges nothing): they alone may be taken again.
            warm = settled(lambda s=subject: django_quota.evaluate("closed", s))
            assert warm.decision == "allowed"
            assert settled(
                lambda s=subject: loop.run_until_complete(django_quota.aevaluate("open", s))
            ).allowed

        victim.stop()
        try:
            started = time.monotonic()
            closed = django_quota.evaluate("closed", lost)
            opened = django_quota.evaluate("open", lost)
            elapsed = time.monotonic() - started
            assert (closed.decision, closed.reason, closed.retry_after) == (
                "failed_closed",
                "backend_unavailable",
                3.0,
            )
            assert (opened.decision, opened.reason) == ("failed_open", "backend_unavailable")
            assert elapsed < 0.5, elapsed
            assert django_quota.evaluate("closed", kept).decision == "allowed"
            # The async client's pooled connection to the stopped node is found closed
            # before EVALSHA is written: unavailable, not indeterminate.
            later = loop.run_until_complete(django_quota.aevaluate("closed", lost))
            assert (later.decision, later.reason) == ("failed_closed", "backend_unavailable")
            # Across slots: "a" is charged on a live node, then the lost node refuses: "a"
            # is refunded and the group fails by its failure modes, sync and async.
            failed = limiter.evaluate_policies(group, {**user, **lost})
            afailed = loop.run_until_complete(limiter.aevaluate_policies(group, {**user, **lost}))
            for outcomes in (failed, afailed):
                assert [(o.decision, o.reason) for o in outcomes] == [
                    ("failed_closed", "backend_unavailable")
                ] * 2
            assert state(cluster, counter_of("a", user))["c1"] == 0
        finally:
            victim.start()
            cluster.wait_ok()
    finally:
        loop.close()
    on_cluster(TIMEOUT=0.1, DEADLINE=0.25, POLICIES={"closed": {"windows": "5/h"}})
    back = django_quota.evaluate("closed", lost)  # the node restarted empty
    assert (back.decision, back.remaining) == ("allowed", 4)


def _cluster_state(node: Any) -> str:
    with contextlib.closing(node.client(socket_timeout=1.0)) as client:
        return str(client.cluster("INFO")["cluster_state"])


def test_clusterdown_during_a_failover_leaves_the_healthy_primaries_breakers_closed(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A primary dies; once the others flag it failed (a short node timeout here), they
    answer CLUSTERDOWN for every slot. Their connections answer: their breakers stay
    closed, each refusal is labelled, and none waits out redis-py's 0.25 s sleep (the
    calls go straight to the slot's primary). The dead primary's breaker opens."""
    with redis_cluster(3, "--cluster-node-timeout", "300") as failing:
        quota(
            REDIS_URL=failing.url,
            CLUSTER=True,
            TIMEOUT=0.1,
            DEADLINE=0.25,
            FAILURE_RETRY_AFTER=30,
            POLICIES={"p": {"windows": "1000/h", "selector": ["ip"]}},
        )
        by_port = {
            failing.node_of(counter_of("p", s)): s
            for s in subjects_on_distinct_nodes(failing, "p", "ip")
        }
        victim = failing.nodes[1]
        healthy = [node for node in failing.nodes if node is not victim]
        for subject in by_port.values():  # pooled connections to every primary
            assert django_quota.evaluate("p", subject).decision == "allowed"
        sleeps = 0
        original = time.sleep

        def counting_sleep(seconds: float) -> None:
            nonlocal sleeps
            sleeps += 1
            original(seconds)

        victim.stop()
        deadline = time.monotonic() + 20
        while _cluster_state(healthy[0]) != "fail" or _cluster_state(healthy[1]) != "fail":
            assert time.monotonic() < deadline, "the cluster never flagged the primary failed"
            time.sleep(0.05)
        with caplog.at_level("WARNING", "django_quota"), pytest.MonkeyPatch.context() as patch:
            patch.setattr(time, "sleep", counting_sleep)  # redis-py's is time.sleep
            for node in healthy:
                for _ in range(3 * engine.Sizes.BREAKER_THRESHOLD):
                    outcome = django_quota.evaluate("p", by_port[node.port])
                    assert (outcome.decision, outcome.reason) == (
                        "failed_closed",
                        "backend_unavailable",
                    )
                breaker = limiter.get_breaker(f"127.0.0.1:{node.port}")
                assert breaker.state == "closed", node.port
            for _ in range(engine.Sizes.BREAKER_THRESHOLD):
                lost = django_quota.evaluate("p", by_port[victim.port])
                assert lost.reason == "backend_unavailable"
        assert sleeps == 0, "redis-py's CLUSTERDOWN sleep was waited out"
        assert limiter.get_breaker(f"127.0.0.1:{victim.port}").state == "open"
        labels = [error.label for error in limiter.recent_errors()]
        assert labels.count("clusterdown") >= len(labels) - engine.Sizes.BREAKER_THRESHOLD - 1
        assert "label=clusterdown (not counted: it answers)" in caplog.text


def test_a_timeout_is_never_retried_behind_the_librarys_back(
    on_cluster: Any, cluster: Cluster
) -> None:
    definitions = {"p": {"windows": "100/h", "selector": ["ip"]}}
    on_cluster(TIMEOUT=0.3, DEADLINE=0.3, POLICIES=definitions)  # no room for a retry
    subject = subjects_on_distinct_nodes(cluster, "p", "ip")[0]
    key = counter_of("p", subject)
    port = cluster.node_of(key)
    limiter.get_backend().preload()
    assert django_quota.evaluate("p", subject).remaining == 99  # a pooled connection

    def paused_evaluation(call: Any) -> tuple[Any, int]:
        """``call()`` while the node pauses its clients for 350 ms (it notices the end at
        its next 100 ms tick): the first EVALSHA times out at 300 ms, unexecuted; one sent
        again right then runs when the pause ends, within its own 300 ms."""
        before = evalsha_calls(cluster, port)
        with contextlib.closing(cluster.client(port)) as client:
            client.client_pause(350)
        result = call()
        time.sleep(0.6)  # the pause is over: whatever was (re)sent has run
        return result, evalsha_calls(cluster, port) - before

    timed_out, ran = paused_evaluation(lambda: django_quota.evaluate("p", subject))
    assert (timed_out.decision, timed_out.reason) == ("failed_closed", "indeterminate")
    # The paused EVALSHA died with its connection and nothing was sent again.
    assert ran == 0 and state(cluster, key)["c1"] == 1

    # The same fault with redis-py's own defaults: the cluster client sends EVALSHA again.
    control = RedisCluster.from_url(cluster.url, socket_timeout=0.3, protocol=2)
    try:
        refund = next(s for s in all_scripts() if s.name == "refund")
        answered, ran = paused_evaluation(lambda: control.evalsha(refund.sha1, 1, key, 0))
        assert (answered, ran) == (0, 1)
    finally:
        control.close()

    # The library's own single retry (DEADLINE covers one more TIMEOUT), same evaluation id.
    on_cluster(TIMEOUT=0.3, DEADLINE=1.0, POLICIES=definitions)
    assert django_quota.evaluate("p", subject).remaining == 98
    retried, ran = paused_evaluation(lambda: django_quota.evaluate("p", subject))
    assert (retried.decision, retried.remaining, ran) == ("allowed", 97, 1)
    assert state(cluster, key)["c1"] == 3


def test_a_timeout_in_a_later_slot_is_replayed_and_refunded_once(
    on_cluster: Any, cluster: Cluster
) -> None:
    on_cluster(
        TIMEOUT=0.3,
        DEADLINE=1.0,
        POLICIES={
            "a": {"windows": "5/h", "selector": ["user"]},
            "b": {"windows": "1/h", "selector": ["ip"]},
        },
    )
    limiter.get_backend().preload()
    subject = split_subject(cluster, "a", "b")
    a_key = counter_of("a", {"user": subject["user"]})
    b_key = counter_of("b", {"ip": subject["ip"]})
    a_port, b_port = cluster.node_of(a_key), cluster.node_of(b_key)
    group = [policies.get_policy("a"), policies.get_policy("b")]
    assert [o.remaining for o in limiter.evaluate_policies(group, subject)] == [4, 0]

    before = evalsha_calls(cluster, a_port), evalsha_calls(cluster, b_port)
    with contextlib.closing(cluster.client(b_port)) as client:
        client.client_pause(350)
    # "a" is charged, "b" times out unexecuted: indeterminate, retried with the same
    # evaluation id: "a" replays its stored reply, "b" now denies, "a" is refunded once.
    outcomes = limiter.evaluate_policies(group, subject)
    time.sleep(0.6)
    assert [(o.decision, o.remaining) for o in outcomes] == [("allowed", 4), ("denied", 0)]
    assert evalsha_calls(cluster, a_port) - before[0] == 3  # charge, replay, refund
    assert evalsha_calls(cluster, b_port) - before[1] == 1  # the retry only
    assert (state(cluster, a_key)["c1"], state(cluster, b_key)["c1"]) == (1, 1)


# -- the plan's failure paths, scripted (no server) -----------------------------------------------
def _two_slot_request(quota: Any, order: str = "ab") -> Any:
    quota(
        CLOCK="tests.clock.now",
        POLICIES={
            "a": {"windows": "5/h", "selector": ["user"]},
            "b": {"windows": "1/h", "selector": ["ip"]},
        },
    )
    group = [policies.get_policy(policy_id) for policy_id in order]
    for number in range(100):
        subject = {"user": f"u{number}", "ip": f"10.2.0.{number + 1}"}
        request = limiter.get_limiter().prepare(group, subject, 1).request
        if slot_of(request.counters[0]) != slot_of(request.counters[1]):
            return request
    raise AssertionError("no subject on two slots")


def _reply(status: int) -> list[int]:
    """evaluate.lua's reply for one fixed window (decided; now, then the view's used):
    nothing used (allowed, and charged unless another policy refuses), or 5 used for
    ``status`` 0 (denied: above both policies' limits)."""
    used = 0 if status else 5
    return [0, 1_000, used]


def _scripted(request: Any, answers: list[Any]) -> tuple[Any, list[Call]]:
    calls: list[Call] = []

    def run(call: Call) -> Any:
        calls.append(call)
        answer = answers.pop(0)
        if isinstance(answer, BackendError):
            raise answer
        return answer

    try:
        return drive(plan(request, split_by_slot(request, slot_of)), run), calls
    except BackendError as error:
        return error, calls


def test_a_failed_refund_is_logged_and_keeps_the_charge(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    request = _two_slot_request(quota)
    failure = BackendError("indeterminate", "timeout")
    reply, calls = _scripted(request, [_reply(1), _reply(0), failure])
    assert [c.script for c in calls] == ["evaluate_fixed_window", "evaluate_fixed_window", "refund"]
    assert calls[2].keys == [request.counters[0]]
    # n, the evaluation's fingerprint; per policy: fixed, cost, now, m; P
    # n, fingerprint, mode 0 (best effort), no now; fixed window, cost, charged now,
    # one window: its period, 0, 0
    assert calls[2].args == [1, request.fingerprint, 0, 0, 1, 1, 1_000, 1, 3_600_000, 0, 0]
    assert [r.status for r in reply.results] == [1, 0]  # the charge stays, and says so
    assert "quota cluster refund failed, the charge stays: reason=indeterminate" in caplog.text


def test_clock_unsafe_in_a_later_slot_refunds_and_fails_the_group(quota: Any) -> None:
    request = _two_slot_request(quota)
    reply, calls = _scripted(request, [_reply(1), [1], 1])
    assert reply == GroupReply(GROUP_CLOCK_UNSAFE, ())
    assert [c.script for c in calls] == ["evaluate_fixed_window", "evaluate_fixed_window", "refund"]


@pytest.mark.parametrize(
    ("reason", "scripts"),
    [
        ("backend_unavailable", ["evaluate_fixed_window", "evaluate_fixed_window", "refund"]),
        ("backend_error", ["evaluate_fixed_window", "evaluate_fixed_window", "refund"]),
        # the retry replays; no refund yet
        ("indeterminate", ["evaluate_fixed_window", "evaluate_fixed_window"]),
    ],
)
def test_a_failure_in_a_later_slot_fails_the_group(
    quota: Any, reason: str, scripts: list[str]
) -> None:
    request = _two_slot_request(quota)
    error, calls = _scripted(request, [_reply(1), BackendError(reason), 1])
    assert isinstance(error, BackendError) and error.reason == reason
    assert [c.script for c in calls] == scripts


def test_slots_after_a_denial_run_dry_and_charge_nothing(quota: Any) -> None:
    request = _two_slot_request(quota, order="ba")
    veto = [1_000, 0]  # now, then its view (used): its cost of 2 never fits its limit of 1
    reply, calls = _scripted(request, [_reply(0), [*_reply(2), *veto]])
    # one policy per slot runs the fixed-window script; the dry run, two with its veto,
    # the general one
    assert [c.script for c in calls] == ["evaluate_fixed_window", "evaluate"]
    veto_counter = calls[1].keys[-1]
    assert veto_counter == f"{request.counters[1]}:veto"
    assert slot_of(veto_counter) == slot_of(request.counters[1])
    assert [r.status for r in reply.results] == [0, 2]


# -- django_quota.testing.reset() on a cluster ---------------------------------------------------
def test_testing_reset_deletes_prefixed_keys_on_every_primary_only(
    on_cluster: Any, cluster: Cluster
) -> None:
    from django_quota.testing import reset

    prefix = "c[1]*"
    on_cluster(KEY_PREFIX=prefix, POLICIES={"p": {"windows": "2/h", "selector": ["user"]}})
    subjects = subjects_on_distinct_nodes(cluster, "p", "user")
    assert len(subjects) == 3
    for subject in subjects:
        django_quota.evaluate("p", subject)
    for number in range(60):  # many slots per node: one UNLINK across slots is CROSSSLOT
        django_quota.evaluate("p", {"user": f"many{number}"})
    others = {f"c1:{{{n}}}": b"x" for n in range(30)} | {f"quota:{{{n}}}": b"y" for n in range(30)}
    client = limiter.get_backend().client
    for key, value in others.items():
        client.set(key, value)

    def keys_per_node() -> dict[int, set[str]]:
        found = {}
        for node in cluster.nodes:
            with contextlib.closing(cluster.client(node.port)) as client:
                found[node.port] = {key.decode() for key in client.scan_iter()}
        return found

    before = keys_per_node()
    assert all(any(k.startswith(prefix + ":") for k in keys) for keys in before.values())
    reset()
    after = keys_per_node()
    assert set().union(*after.values()) == set(others)
    assert all(django_quota.peek("p", subject).remaining == 2 for subject in subjects)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_plan_change_keeps_the_usage_on_the_cluster(on_cluster: Any, algorithm: str) -> None:
    """docs/plans.md: one counter per identity whatever the plan, so 90 used of a 100/d
    plan leave 9,910 of a 10,000/d one (tests/test_plans.py for the other backends)."""
    on_cluster(
        POLICIES={
            "p": {
                "algorithm": algorithm,
                "windows": "100/d",
                "plans": {"basic": "100/d", "pro": "10000/d"},
                "selector": ["ip"],
            }
        }
    )
    subject = {"ip": "192.0.2.90"}
    for _ in range(90):
        assert django_quota.evaluate("p", subject, plan="basic").decision == "allowed"
    pro = django_quota.peek("p", subject, plan="pro")
    assert (pro.limit, pro.remaining) == (10000, 9910)
    basic = django_quota.evaluate("p", subject, plan="basic")
    assert (basic.decision, basic.limit, basic.remaining) == ("allowed", 100, 9)
