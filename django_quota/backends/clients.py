"""The bookkeeping of a Redis backend's clients (:class:`BaseRedisBackend`): one sync
client per process, one async client per live event loop (young loops on the sync client
in a worker thread), ``close``, and ``quota check``'s rows over every primary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redis.backoff import NoBackoff
from redis.retry import Retry

from django_quota.backends import unusable_url
from django_quota.backends.failures import classify
from django_quota.backends.probe import Row, run_probe
from django_quota.backends.redispy import abandon, client_connections, public_path
from django_quota.backends.scripting import Call, ScriptedBackend, sources
from django_quota.core.errors import BackendError
from django_quota.core.outcome import BACKEND_ERROR, BACKEND_MODE_REDIS
from django_quota.core.process import PROCESS
from django_quota.core.protocol import Probe

#: Async clients kept at once (one per live event loop); clients of closed loops are
#: closed and forgotten whenever a new loop needs one.
MAX_ASYNC_CLIENTS = 64
#: A loop's decisions run on the process's synchronous client, in a worker thread, until
#: it has started this many, or has two in flight at once; then it gets pipelined
#: connections of its own (docs/failures.md, "Async connections"). An async view under WSGI
#: (a new loop per request) so reuses the process's connections.
PIPELINE_AFTER = 8


def client_options(timeout: float, max_inflight: int) -> dict[str, Any]:
    """Keyword arguments every pool gets: no hidden retry, timeouts, pool size (docs/settings.md).

    RESP2 is pinned (a ``protocol`` in the URL still wins): redis-py 8 defaults to RESP3,
    which turns on its "maintenance notifications", and with them its pools skip the
    check that finds a pooled connection already closed by the server, so the asyncio
    client writes ``EVALSHA`` into a dead socket and a refused Redis reads as
    ``indeterminate``; they may also relax socket timeouts beyond ``TIMEOUT``. RESP2 also
    spares each new connection the ``HELLO`` and ``CLIENT MAINT_NOTIFICATIONS`` round
    trips.
    """
    return {
        "retry": Retry(NoBackoff(), 0),
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "max_connections": max_inflight,
        "protocol": 2,
    }


def _reset_after_fork() -> None:
    for backend in list(PROCESS.backends):
        backend.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def text(value: Any) -> str:
    """A reply's value as text (redis-py gives bytes, or a number)."""
    return value.decode() if isinstance(value, bytes) else str(value)


class BaseRedisBackend(ScriptedBackend):
    """What the standalone and cluster backends share: a synchronous client created on
    first use and shared per process; an async client per running event loop (pools
    belong to one loop), those of loops that have closed closed and forgotten, so that
    connections stay bounded whatever the number of loops (async views under WSGI each
    run in a new one); ``close``, ``ttl_ms``, and ``quota check``'s rows over every
    primary (:meth:`diagnose`).

    A subclass says how it builds a client (:meth:`_build`) and finds an async client's
    connections (:meth:`_async_connections`), and how it routes calls: :meth:`node_of`,
    :meth:`run`, :meth:`arun`, :meth:`preload` and, for ``quota check``,
    :meth:`primaries` and :meth:`command`.
    """

    mode = BACKEND_MODE_REDIS
    #: Whether ``quota check``'s rows speak of several primaries (a cluster's).
    clustered = False
    #: redis-py's exception as a failure reason (the cluster's adds its own refusals).
    classify = staticmethod(classify)

    def __init__(
        self,
        *,
        timeout: float,
        max_inflight: int,
        url_options: Mapping[str, Any] | None,
        public: bool = False,
    ) -> None:
        self.timeout = timeout
        self.max_inflight = max_inflight
        self.url_options = dict(url_options or {})
        #: redis-py's public path only (``REDIS_PUBLIC_PATH``, its environment variable, or
        #: a redis-py the fence was not read against: ``redispy.public_path``).
        self.public = public_path(public)
        self._lock = threading.Lock()
        self._client: Any = None
        self._async_clients: dict[asyncio.AbstractEventLoop, Any] = {}
        #: Loops without a client yet: [decisions started, decisions in flight].
        self._young: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[int]] = (
            weakref.WeakKeyDictionary()
        )
        self._threads: ThreadPoolExecutor | None = None
        self._sources = sources()
        PROCESS.backends.add(self)

    # -- clients -----------------------------------------------------------------------
    def _build(self, asynchronous: bool) -> Any:
        """A new client (a redis-py asyncio one when ``asynchronous``)."""
        raise NotImplementedError

    def _async_connections(self, client: Any) -> list[Any]:
        """Every connection the async ``client`` holds (closed with its loop): a redis-py
        client's, as the fence finds them
        (:func:`~django_quota.backends.redispy.client_connections`)."""
        return client_connections(client)

    def _options(self) -> dict[str, Any]:
        """The keyword arguments of every client: :func:`client_options`, then the URL
        options of a ``CACHE_ALIAS`` cache."""
        return {**client_options(self.timeout, self.max_inflight), **self.url_options}

    @property
    def client(self) -> Any:
        """The shared synchronous client (created on first use)."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._buildable(asynchronous=False)
                client = self._client
        return client

    def _async(self) -> Any:
        """The running event loop's async client (created on its first use)."""
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            with self._lock:
                # Built before the clients of closed loops are forgotten: a cluster's new
                # client starts from every node they had learnt too.
                client = self._buildable(asynchronous=True)
                self._forget_closed_loops()
                self._async_clients[loop] = client
        return client

    def _buildable(self, *, asynchronous: bool) -> Any:
        """:meth:`_build`, with what redis-py refuses to build a client from (a URL whose
        port is out of range, say: ``CACHE_ALIAS`` takes a cache's ``LOCATION`` as it is)
        raised as ``backend_error``, so the failure mode answers, never a 500."""
        try:
            return self._build(asynchronous=asynchronous)
        except ValueError as exc:
            detail = f"the Redis URL cannot make a client: {unusable_url(exc)}"
            raise BackendError(BACKEND_ERROR, detail) from exc

    def _forget_closed_loops(self) -> None:
        """Close the connections of async clients whose loop has closed, and forget them;
        past :data:`MAX_ASYNC_CLIENTS` live ones, forget the oldest too (:meth:`_retire`)."""
        for loop in [loop for loop in self._async_clients if loop.is_closed()]:
            self._retire(loop, self._async_clients.pop(loop), close_live=False)
        while len(self._async_clients) >= MAX_ASYNC_CLIENTS:
            oldest = next(iter(self._async_clients))
            self._retire(oldest, self._async_clients.pop(oldest), close_live=False)

    def _retire(self, loop: asyncio.AbstractEventLoop, client: Any, *, close_live: bool) -> None:
        """Close the connections of a forgotten async ``client`` of ``loop``: a closed
        loop's directly (:func:`~django_quota.backends.redispy.abandon`), and a live
        loop's too when ``close_live`` (else they close with the loop's transports). On
        redis-py's public path they are left to the garbage collector (their
        ``disconnect()`` needs the loop)."""
        if (close_live or loop.is_closed()) and not self.public:
            abandon(self._async_connections(client))

    # -- young loops: on the synchronous client, in a worker thread ------------------------
    def young(self, loop: asyncio.AbstractEventLoop) -> list[int] | None:
        """``loop``'s counts ([started, in flight]) while its decisions still run in a
        worker thread (:data:`PIPELINE_AFTER`), else None."""
        counts = self._young.get(loop)
        if counts is None:
            counts = self._young[loop] = [0, 0]
        if counts[0] >= PIPELINE_AFTER or counts[1]:
            return None
        return counts

    async def in_thread(
        self,
        loop: asyncio.AbstractEventLoop,
        counts: list[int] | None,
        call: Call,
        deadline: float | None = None,
    ) -> Any:
        """Run ``call`` with :meth:`run` (the process's synchronous client and its pool),
        bounded by ``deadline``, in one of the backend's worker threads; ``counts`` are
        the loop's (:meth:`young`), if any."""
        if counts is None:
            return await loop.run_in_executor(self._executor(), self.run, call, deadline)
        counts[0] += 1
        counts[1] += 1
        try:
            return await loop.run_in_executor(self._executor(), self.run, call, deadline)
        finally:
            counts[1] -= 1

    def _executor(self) -> ThreadPoolExecutor:
        executor = self._threads
        if executor is None:
            with self._lock:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(
                        max_workers=self.max_inflight, thread_name_prefix="django-quota"
                    )
                executor = self._threads
        return executor

    def after_fork(self) -> None:
        """In a forked child: never touch the parent's async connections or threads."""
        self._lock = threading.Lock()
        self._async_clients = {}
        self._young = weakref.WeakKeyDictionary()
        self._threads = None

    @property
    def async_client_count(self) -> int:
        """Async clients held now (one per live event loop that used this backend)."""
        return len(self._async_clients)

    def close(self) -> None:
        """Disconnect the synchronous client, close every loop's async connections (in
        their loop when it may still run) and stop the worker threads once idle."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing never raises into setting_changed
                client.close()
        with self._lock:
            clients, self._async_clients = self._async_clients, {}
            threads, self._threads = self._threads, None
        for loop, async_client in clients.items():
            self._retire(loop, async_client, close_live=True)
        if threads is not None:
            threads.shutdown(wait=False)

    def ttl_ms(self, counter: str) -> int:
        """``PTTL`` of ``counter`` (-2: no such key). Not on the hot path."""
        try:
            return int(self.client.pttl(counter))
        except Exception as exc:
            raise self.classify(exc) from exc

    def preload(self) -> list[tuple[str, str]]:
        """``SCRIPT LOAD`` every script where scripts run; return (name, SHA1) pairs."""
        raise NotImplementedError

    # -- quota check -------------------------------------------------------------------
    def primaries(self) -> list[Any]:
        """The nodes ``quota check`` asks: a standalone or Sentinel primary is one node,
        named None."""
        return [None]

    def command(self, node: Any, *command: Any) -> Any:
        """Send ``command`` to ``node`` (one of :meth:`primaries`); its parsed reply."""
        return self.client.execute_command(*command)

    def memory_info(self) -> list[tuple[str, str, int, int]]:
        """``(node, maxmemory-policy, maxmemory, evicted_keys)`` of every primary, from
        ``INFO memory`` and ``INFO stats`` (raises what redis-py raises). A standalone or
        Sentinel primary is named ``default``, a cluster's by host and port."""
        found = []
        for node in self.primaries():
            memory = self.command(node, "INFO", "memory")
            stats = self.command(node, "INFO", "stats")
            name = node.name if self.clustered else "default"
            found.append(
                (
                    name,
                    text(memory.get("maxmemory_policy", "unknown")),
                    int(memory.get("maxmemory", 0)),
                    int(stats.get("evicted_keys", 0)),
                )
            )
        return found

    def diagnose(self, probes: Sequence[Probe]) -> list[Row]:
        """(check, status, detail) rows for ``quota check``, over every primary:
        connectivity, latency, script load, the evaluation ``probes`` (one per algorithm
        in use, :func:`~django_quota.backends.probe.run_probe`), clock offset (the
        worst) and ``maxmemory-policy`` (any that can evict). ``status`` is ``ok``,
        ``warning`` or ``error``."""
        try:
            nodes = self.primaries()
            for node in nodes:
                self.command(node, "PING")
        except Exception as exc:
            error = self.classify(exc)
            label = f"{error.label}: " if error.label else ""  # maxclients, clusterdown…
            return [("connectivity", "error", f"{label}{error}")]
        by = f" by {len(nodes)} primaries" if self.clustered else ""
        rows: list[Row] = [("connectivity", "ok", f"PING answered{by}")]
        checks = (self._latency, self._scripts, self._evaluation, self._clock, self._maxmemory)
        return rows + [check(nodes, probes) for check in checks]

    def _latency(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            self.command(nodes[0], "PING")
            samples.append((time.perf_counter() - started) * 1000)
        return ("latency", "ok", f"{statistics.median(samples):.2f} ms median of 5 PINGs")

    def _scripts(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        try:
            loaded = self.preload()
        except BackendError as exc:
            return ("scripts", "error", str(exc))
        detail = ", ".join(f"{name} {sha}" for name, sha in loaded)
        if self.clustered:
            detail = f"{detail} (on {len(nodes)} primaries)"
        return ("scripts", "ok", detail)

    def _evaluation(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        return run_probe(self, probes, self.client.delete)

    def _clock(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        try:
            offsets = []
            for node in nodes:
                seconds, micros = self.command(node, "TIME")
                offsets.append((int(seconds) + int(micros) / 1e6 - time.time()) * 1000)
        except Exception as exc:
            return ("clock offset", "warning", f"TIME failed: {exc}")
        worst = max(offsets, key=abs)
        status = "ok" if abs(worst) < 1000 else "warning"
        against = "worst primary" if self.clustered else "Redis TIME"
        return ("clock offset", status, f"{worst:+.1f} ms ({against} - this host)")

    def _maxmemory(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        try:
            found = []
            for node in nodes:
                config = self.command(node, "CONFIG GET", "maxmemory*")
                policy = text(config.get("maxmemory-policy", "unknown"))
                found.append((node, policy, int(text(config.get("maxmemory", "0")))))
        except Exception as exc:
            return ("maxmemory-policy", "warning", f"CONFIG GET not allowed: {exc}")
        evicting = [
            (f"{node.name}: " if self.clustered else "") + f"{policy} with maxmemory {limit}"
            for node, policy, limit in found
            if policy != "noeviction" and limit != 0
        ]
        if evicting:
            return (
                "maxmemory-policy",
                "warning",
                "; ".join(evicting) + " can evict live counters, which resets limits; "
                "use noeviction for the rate-limit database",
            )
        if self.clustered:
            return ("maxmemory-policy", "ok", "no primary can evict counters")
        _, policy, limit = found[0]
        return ("maxmemory-policy", "ok", f"{policy} (maxmemory {limit})")
