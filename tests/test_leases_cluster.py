"""Concurrency policies on a real Redis Cluster (docs/concurrency.md, cluster.md): the
same outcomes as the memory backend for the same client clock on generated sequences of
acquires, releases, peeks and waits past a lease's expiry, alone and grouped with a rate
policy; a lease lives in its counter's slot; a group refused in a later slot gives the
earlier slot's lease back; a release of what a failover lost releases 0."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import django_quota
from django_quota import limiter, policies
from django_quota.core.outcome import Outcome
from tests import clock
from tests.cluster import Cluster
from tests.test_cluster import START, cluster, counter_of, on_cluster, split_subject

pytestmark = pytest.mark.redis
__all__ = ["cluster", "on_cluster"]  # the fixtures, shared with tests/test_cluster.py

DEFINITIONS = {
    "inflight": {"algorithm": "concurrency", "windows": "2/10s", "selector": ["user"]},
    "burst": {"algorithm": "fixed_window", "windows": "3/5s", "selector": ["user"]},
    "by_ip": {"algorithm": "token_bucket", "windows": "1/m", "selector": ["ip"]},
}
USER = {"user": "42"}

STEP = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from([["inflight"], ["burst", "inflight"]]),
              st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("peek")),
    st.tuples(st.just("wait"), st.sampled_from([0.001, 1.0, 4.999, 5.0, 10.0, 12.5])),
)


def comparable(outcome: Outcome) -> Outcome:
    return dataclasses.replace(outcome, backend_mode="", evaluation_id="")


def run(steps: list[tuple[Any, ...]], prefix: str) -> list[Any]:
    clock.set_to(START)
    seen: list[Any] = []
    ids: list[str] = []
    for number, step in enumerate(steps):
        if step[0] == "wait":
            clock.set_to(clock.current + step[1])
        elif step[0] == "peek":
            seen.append(comparable(django_quota.peek("inflight", USER)))
        elif step[0] == "release":
            chosen = ids[step[1] % len(ids)] if ids else "never"
            seen.append(django_quota.release("inflight", USER, chosen))
        else:
            ids.append(f"{prefix}e{number}")
            group = [policies.get_policy(policy_id) for policy_id in step[1]]
            outcomes = limiter.evaluate_policies(group, USER, step[2], evaluation_id=ids[-1])
            seen.append([comparable(outcome) for outcome in outcomes])
    return seen


def test_the_cluster_decides_as_the_memory_backend(
    on_cluster: Any, quota: Any, cluster: Cluster
) -> None:
    examples = iter(range(10**6))

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(steps=st.lists(STEP, min_size=1, max_size=25))
    def check(steps: list[tuple[Any, ...]]) -> None:
        cluster.flushall()
        on_cluster(POLICIES=DEFINITIONS)
        prefix = f"x{next(examples)}-"  # ids never seen by an earlier example's ledgers
        on_redis = run(steps, prefix)
        quota(CLOCK="tests.clock.now", POLICIES=DEFINITIONS, BACKEND="memory")
        assert run(steps, prefix) == on_redis

    check()


def test_a_lease_lives_in_its_counters_slot_and_leaves_no_key(
    on_cluster: Any, cluster: Cluster
) -> None:
    on_cluster(POLICIES=DEFINITIONS)
    outcomes = limiter.evaluate_policies(
        [policies.get_policy("burst"), policies.get_policy("inflight")], USER, 1,
        evaluation_id="lease",
    )
    assert [o.decision for o in outcomes] == ["allowed", "allowed"]
    counter = counter_of("inflight", USER)
    node = cluster.node_of(counter)
    assert node == cluster.node_of(counter_of("burst", USER))  # one slot: one EVALSHA
    with contextlib.closing(cluster.client(node)) as client:
        assert client.type(counter) == b"zset"
        assert client.zcard(counter) == 1
        assert django_quota.release("inflight", USER, "lease") == 1
        assert client.exists(counter) == 0  # every lease released: no key left


def test_a_group_refused_in_a_later_slot_gives_the_lease_back(
    on_cluster: Any, cluster: Cluster
) -> None:
    on_cluster(POLICIES=DEFINITIONS)
    subject = split_subject(cluster, "inflight", "by_ip")
    group = [policies.get_policy("inflight"), policies.get_policy("by_ip")]
    first = limiter.evaluate_policies(group, subject, 1, evaluation_id="first")
    assert [o.decision for o in first] == ["allowed", "allowed"]
    refused = limiter.evaluate_policies(group, subject, 1, evaluation_id="second")
    assert [o.decision for o in refused] == ["allowed", "denied"]
    assert refused[0].remaining == 1  # reported as given back
    held = django_quota.peek("inflight", {"user": subject["user"]})
    assert held.remaining == 1  # only the first request's lease is held
    assert django_quota.release("inflight", {"user": subject["user"]}, "second") == 0
    assert django_quota.release("inflight", {"user": subject["user"]}, "first") == 1


def test_a_release_of_a_lease_a_failover_lost_releases_nothing(
    on_cluster: Any, cluster: Cluster
) -> None:
    on_cluster(POLICIES=DEFINITIONS)
    assert django_quota.evaluate("inflight", USER, evaluation_id="lost").decision == "allowed"
    counter = counter_of("inflight", USER)
    with contextlib.closing(cluster.client(cluster.node_of(counter))) as client:
        client.delete(counter)  # what a failover to a replica that never saw it leaves
    assert django_quota.release("inflight", USER, "lost") == 0
    assert django_quota.peek("inflight", USER).remaining == 2
