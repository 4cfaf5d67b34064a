"""Refunds on a real Redis Cluster (docs/refunds.md): each refund runs on the primary
serving its counter's slot, at most once, for every algorithm."""

from __future__ import annotations

from typing import Any

import pytest

import django_quota
from tests import clock
from tests.cluster import Cluster
from tests.test_cluster import START, counter_of, evalsha_calls, subjects_on_distinct_nodes
from tests.test_cluster import cluster as cluster  # the module's own three primaries
from tests.test_cluster import on_cluster as on_cluster
from tests.test_refunds import POLICIES

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_refund_reaches_its_counters_slot_once(
    on_cluster: Any, cluster: Cluster, policy: str
) -> None:
    backend = on_cluster(
        POLICIES={name: {**p, "selector": ["ip"]} for name, p in POLICIES.items()}
    )
    backend.preload()  # so that each refund is one EVALSHA, never a NOSCRIPT and a retry
    for subject in subjects_on_distinct_nodes(cluster, policy, "ip"):
        port = cluster.node_of(counter_of(policy, subject))
        for evaluation_id in ("a", "b", "c"):
            django_quota.evaluate(policy, subject, evaluation_id=evaluation_id)
        clock.set_to(START + 1)
        assert django_quota.peek(policy, subject).remaining == 2
        before = evalsha_calls(cluster, port)
        assert django_quota.refund(policy, subject, "b") == 1
        assert evalsha_calls(cluster, port) == before + 1  # on the counter's own primary
        assert django_quota.refund(policy, subject, "b") == 0
        assert django_quota.peek(policy, subject).remaining == 3
        clock.set_to(START)
