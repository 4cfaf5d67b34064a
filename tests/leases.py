"""What the concurrency-lease tests share (tests/test_leases_api.py,
tests/test_leases_edges.py): each runs on a real Redis and on the memory backend."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest

import django_quota

#: The ``params`` of a test module's ``backend`` fixture.
BACKENDS = ["redis", "memory"]


@contextmanager
def configured(
    request: pytest.FixtureRequest,
    quota: Any,
    policies: Mapping[str, Any],
    subject: Any,
    **on_redis: Any,
) -> Iterator[str]:
    """``policies`` on the backend ``request.param`` names (a real Redis, with the
    settings ``on_redis``, or memory), as the ``quota`` fixture sets them; every policy
    reset for ``subject`` afterwards."""
    values: dict[str, Any] = {"POLICIES": policies}
    if request.param == "redis":
        values.update(REDIS_URL=request.getfixturevalue("redis_url"), **on_redis)
    else:
        values["BACKEND"] = "memory"
    quota(**values)
    yield request.param
    for policy in policies:
        django_quota.reset(policy, subject)
