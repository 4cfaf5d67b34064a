"""Test isolation for projects that use django-quota (docs/testing.md).

:func:`reset` forgets every counter, so that one test's requests never use up the next
test's budget. The package's pytest plugin (:mod:`django_quota.pytest_plugin`) calls
:func:`reset_memory` before each test; projects on Redis call :func:`reset` from a
fixture of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django_quota import conf, limiter
from django_quota.core.outcome import Outcome
from django_quota.ledger import outcomes

__all__ = ["outcome", "reset", "reset_memory"]

def reset() -> None:
    """Forget every counter of the configured backend and of this process's fallback.

    Memory backend: cleared. Redis (standalone, Sentinel, Cluster): every key under
    ``QUOTA["KEY_PREFIX"]`` + ``":"`` is deleted (on a cluster, on every primary); no
    other key of that database is touched. The fallback and this process's denial cache
    are cleared first, so they are forgotten even when Redis cannot be reached;
    redis-py's error is then raised.
    """
    fallback = limiter.get_fallback()
    if fallback is not None:
        fallback.clear()
    current = limiter.get_limiter()
    if current.denials is not None:  # its refusals are of counters about to go
        current.denials.clear()
    backend: Any = current.backend
    client = getattr(backend, "client", None)
    if client is None:
        backend.clear()
        return
    pattern = glob_escape(conf.get_settings().key_prefix) + ":*"
    if _is_cluster(client):
        for node in client.get_primaries():
            _delete_matching(client.get_redis_connection(node), pattern, same_slot=False)
    else:
        _delete_matching(client, pattern, same_slot=True)


def reset_memory() -> None:
    """:func:`reset` when the configured backend is the memory backend; otherwise only
    this process's fallback (never a Redis call).

    Reads no setting: when nothing has read them since they last changed, no counter
    exists, and this does nothing (so it never caches settings a test is about to change
    without ``setting_changed``, as pytest-django's ``del settings.X`` does, and never
    reports an invalid ``QUOTA``: the project's own checks and tests do that).
    """
    settings = conf.cached_settings()
    if settings is None:
        return
    if settings.backend == "memory":
        reset()
        return
    fallback = limiter.get_fallback()
    if fallback is not None:
        fallback.clear()


def outcome(request: Any, policy: str) -> Outcome:
    """The outcome ``policy`` got on ``request`` (the test client's
    ``response.wsgi_request``), whatever else was recorded: DRF's usual pair of default
    throttles records ``drf:anon`` and ``drf:user`` on one request, so
    ``[found] = django_quota.outcomes(request)`` cannot take it apart.

    Raises ``AssertionError`` naming the policies that were recorded when ``policy`` is
    not among them (``docs/testing.md``).
    """
    recorded = outcomes(request)
    for found in recorded:
        if found.policy == policy:
            return found
    names = ", ".join(repr(found.policy) for found in recorded) or "none"
    raise AssertionError(f"no outcome of policy {policy!r} on this request; recorded: {names}")


def glob_escape(text: str) -> str:
    """``text`` as a Redis ``MATCH`` pattern that matches only itself."""
    return "".join("\\" + char if char in "\\*?[]" else char for char in text)


def _is_cluster(client: Any) -> bool:
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def _batches(client: Any, pattern: str) -> Iterator[list[Any]]:
    size = 500  # keys asked for per SCAN call and deleted per UNLINK (or pipeline) batch
    batch: list[Any] = []
    for key in client.scan_iter(match=pattern, count=size):
        batch.append(key)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _delete_matching(client: Any, pattern: str, *, same_slot: bool) -> None:
    """Delete the keys of ``client``'s database matching ``pattern``, in batches.

    Keys are collected before deleting (SCAN may return a key twice, and deleting while
    scanning is allowed but collecting keeps each call simple). A cluster node refuses a
    multi-key UNLINK across hash slots, so there each key is its own command, sent in a
    pipeline per batch.
    """
    for batch in list(_batches(client, pattern)):
        if same_slot:
            client.unlink(*batch)
            continue
        pipeline = client.pipeline(transaction=False)
        for key in batch:
            pipeline.unlink(key)
        pipeline.execute()
