"""Backends: where counters live. I/O only; the arithmetic is the core's (memory) or the
Lua scripts' (redis). :func:`backend_from_settings` builds the one the settings name."""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Mapping
from typing import Any, Protocol

from django_quota.core.protocol import GroupReply, GroupRequest, ReleaseRequest
from django_quota.core.refunds import RefundRequest


class Backend(Protocol):
    """What the limiter needs of a backend.

    Methods raise :class:`django_quota.core.errors.BackendError` (with a failure reason
    of ``docs/failures.md``) for every failure; nothing else escapes. ``evaluate`` is
    one atomic decision without the limiter's admission control (in-flight bound,
    circuit breaker): the memory backend's path, and what ``quota inspect`` uses.
    """

    mode: str

    def evaluate(self, request: GroupRequest) -> GroupReply:
        """Decide ``request`` in one atomic step."""
        ...

    async def aevaluate(self, request: GroupRequest) -> GroupReply:
        """Async twin of :meth:`evaluate`."""
        ...

    def reset(self, counter: str, window_count: int) -> int:
        """Delete one counter; return how many of its windows had state."""
        ...

    async def areset(self, counter: str, window_count: int) -> int:
        """Async twin of :meth:`reset`."""
        ...

    def release(self, request: ReleaseRequest) -> int:
        """Free the leases one evaluation acquired from a concurrency policy; the units
        released (0 when none was held)."""
        ...

    async def arelease(self, request: ReleaseRequest) -> int:
        """Async twin of :meth:`release`."""
        ...

    def refund(self, request: RefundRequest) -> int:
        """Undo one evaluation's charge on one counter, at most once (``refund.lua``,
        docs/refunds.md); the units refunded (0 when its ledger no longer holds it)."""
        ...

    async def arefund(self, request: RefundRequest) -> int:
        """Async twin of :meth:`refund`."""
        ...

    def ttl_ms(self, counter: str) -> int:
        """Milliseconds until ``counter`` expires (-2: none). For ``quota inspect``."""
        ...

    def preload(self) -> list[tuple[str, str]]:
        """Load every script where scripts run; return (name, SHA1) pairs."""
        ...

    def close(self) -> None:
        """Release connections (called when settings change)."""
        ...


class ScriptBackend(Backend, Protocol):
    """A backend that runs Lua scripts on one or more nodes (Redis, Sentinel, Cluster).

    The limiter drives :meth:`plan` itself, running each call with :meth:`run` (or
    :meth:`arun`) inside the in-flight bound and circuit breaker of the node
    :meth:`node_of` names.
    """

    def node_of(self, call: Any) -> str:
        """The node a call runs on (``"default"`` for a single primary)."""
        ...

    def plan(self, request: GroupRequest) -> Generator[Any, Any, GroupReply]:
        """The calls deciding ``request``: yields each, receives its raw reply (failures
        thrown in as ``BackendError``), returns the reply."""
        ...

    def run(self, call: Any, deadline: float | None = None) -> Any:
        """Run one call; its raw reply. ``deadline``: when the evaluation's ``DEADLINE``
        ends (``time.monotonic()`` seconds), or None."""
        ...

    async def arun(self, call: Any, deadline: float | None = None) -> Any:
        """Async twin of :meth:`run`."""
        ...


class BackendSettings(Protocol):
    """The settings a backend is built from (``django_quota.conf.QuotaSettings`` has them)."""

    @property
    def backend(self) -> str: ...
    @property
    def memory_max_entries(self) -> int: ...
    @property
    def redis_url(self) -> str | None: ...
    @property
    def cache_alias(self) -> str | None: ...
    @property
    def cluster(self) -> bool: ...
    @property
    def sentinel(self) -> Mapping[str, Any] | None: ...
    @property
    def timeout(self) -> float: ...
    @property
    def max_inflight(self) -> int: ...
    @property
    def redis_public_path(self) -> bool: ...


def backend_from_settings(settings: BackendSettings) -> Backend:
    """The backend ``settings`` name: memory, Redis (standalone or Sentinel) or Redis
    Cluster, its drivers imported only when it is built."""
    if settings.backend == "memory":
        from django_quota.backends.memory import MemoryBackend

        return MemoryBackend(settings.memory_max_entries)
    from django_quota.backends.redis import RedisBackend

    url, url_options = _connection(settings)
    if settings.cluster and url is not None:
        from django_quota.backends.cluster import RedisClusterBackend

        return RedisClusterBackend(
            url=url,
            timeout=settings.timeout,
            max_inflight=settings.max_inflight,
            url_options=url_options,
            public=settings.redis_public_path,
        )
    return RedisBackend(
        url=url,
        timeout=settings.timeout,
        max_inflight=settings.max_inflight,
        sentinel=settings.sentinel,
        url_options=url_options,
        public=settings.redis_public_path,
    )


def url_problem(url: str) -> str | None:
    """What redis-py finds wrong with ``url`` when it builds a client from it (its own
    ``parse_url``, which every ``from_url`` calls: port, host, query options), or None.
    The settings check asks this, so a URL passes ``manage.py check`` only if the backend
    can be built from it. The answer never quotes the URL (:func:`unusable_url`)."""
    from redis import connection

    parse_url: Callable[[str], object] = connection.parse_url
    try:
        parse_url(url)
    except ValueError as exc:
        return unusable_url(exc)
    return None


def unusable_url(exc: ValueError) -> str:
    """What is wrong with a URL redis-py refused, in words that quote none of it: its
    messages can (``"pa"`` of a password ``pa#ss`` read as a port)."""
    text = str(exc)
    if text.startswith("Port"):
        return (
            "its port is not a number from 0 to 65535 (a '#', '/', '?' or '@' in the "
            "password must be percent-encoded)"
        )
    if "IPv6" in text:
        return "its host is not a well-formed IPv6 address in brackets"
    option = re.match(r"Invalid value for '([a-z_]{1,64})' in connection URL", text)
    if option is not None:
        return f"its query option {option[1]!r} has an invalid value"
    return "redis-py cannot build a client from it"


def connection_url(settings: BackendSettings) -> str | None:
    """The Redis URL counters live at, as :func:`backend_from_settings` picks it (with its
    password: redact it before showing it); None for the memory backend."""
    if settings.backend == "memory":
        return None
    return _connection(settings)[0]


def _connection(settings: BackendSettings) -> tuple[str | None, dict[str, object]]:
    """The URL the Redis backend opens its pool with, and the options it adds: those of
    the ``CACHE_ALIAS`` cache when one is set (``REDIS_URL`` is then ignored), else
    ``REDIS_URL`` (None with ``SENTINEL`` alone)."""
    if settings.cache_alias is not None:
        return _cache_connection(settings.cache_alias)
    return settings.redis_url, {}


def _cache_connection(alias: str) -> tuple[str, dict[str, object]]:
    """URL and credentials of a django-redis cache (our own pool is opened with them)."""
    from django.conf import settings as django_settings

    cache = django_settings.CACHES[alias]
    location = cache["LOCATION"]
    url = location[0] if isinstance(location, list | tuple) else str(location).split(",")[0]
    options = cache.get("OPTIONS", {})
    extra: dict[str, object] = {}
    if options.get("PASSWORD"):
        extra["password"] = options["PASSWORD"]
    return url, extra
