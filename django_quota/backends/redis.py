"""The Redis backend: redis-py clients built as contract section 2 says, the Lua scripts
run with ``EVALSHA`` through redis-py's ``Script`` (which reloads on ``NOSCRIPT``), and
every driver error turned into one :class:`BackendError` here and nowhere else."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as redis_asyncio
from redis import exceptions as redis_exceptions
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from django_quota.core.errors import BackendError
from django_quota.core.outcome import (
    BACKEND_ERROR,
    BACKEND_MODE_REDIS,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    INDETERMINATE,
)
from django_quota.core.protocol import GroupReply, GroupRequest, parse_reply
from django_quota.scripts import all_scripts, load

#: EVALSHA attempts when SCRIPT FLUSH keeps racing the reload (each one ran nothing).
NOSCRIPT_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class _Bound:
    """A client with its scripts (redis-py ``Script`` objects, called with ``client=``)."""

    client: Any
    evaluate: Any
    reset: Any


class ConnectFailed(redis_exceptions.ConnectionError):
    """Raised by our pools when no connection could be had: nothing was written.

    ``timed_out`` tells a connect timeout from a refusal (or a full pool).
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.timed_out = isinstance(cause, redis_exceptions.TimeoutError | TimeoutError)


_CONNECT_ERRORS = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError)


class _MarkConnectFailures:
    """Pool mixin: failures inside ``get_connection`` (connect, pool exhausted) happen
    before anything is written, so they become :class:`ConnectFailed`; every later
    failure is then known to come after the command may have been written."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get_connection(*args, **kwargs)  # type: ignore[misc]
        except ConnectFailed:
            raise
        except _CONNECT_ERRORS as exc:
            raise ConnectFailed(exc) from exc


def peer_hung_up(connection: Any) -> bool:
    """Whether an asyncio connection's socket holds an end of file (or stray bytes) that
    the event loop has not read yet: redis-py's ``can_read`` sees only what the loop
    already read, and a loop that did not run since the server closed the connection has
    read nothing. Peeks on a duplicate of the descriptor, consuming nothing."""
    writer = getattr(connection, "_writer", None)
    transport = getattr(writer, "transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    flags = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
    try:
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as probe:
            probe.recv(1, flags)
    except BlockingIOError:
        return False  # nothing to read: idle and open
    except OSError:
        return True
    return True


class _AsyncMarkConnectFailures:
    """Async twin of :class:`_MarkConnectFailures`; also replaces a pooled connection the
    server closed while the event loop was idle (:func:`peer_hung_up`), so that a stopped
    server is ``backend_unavailable`` rather than ``indeterminate``."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            connection = await super().get_connection(*args, **kwargs)  # type: ignore[misc]
        except ConnectFailed:
            raise
        except _CONNECT_ERRORS as exc:
            raise ConnectFailed(exc) from exc
        if peer_hung_up(connection):
            try:
                await connection.disconnect()
                await connection.connect()
            except BaseException as exc:
                await self.release(connection)  # type: ignore[attr-defined]
                if isinstance(exc, _CONNECT_ERRORS):
                    raise ConnectFailed(exc) from exc
                raise
        return connection


class MarkingConnectionPool(_MarkConnectFailures, redis.ConnectionPool):
    """redis-py's pool, telling connect failures apart."""


class MarkingSentinelConnectionPool(_MarkConnectFailures, SentinelConnectionPool):
    """redis-py's Sentinel pool, telling connect failures apart."""


class AsyncMarkingConnectionPool(_AsyncMarkConnectFailures, redis_asyncio.ConnectionPool):
    """redis-py's asyncio pool, telling connect failures apart."""


class AsyncMarkingSentinelConnectionPool(_AsyncMarkConnectFailures, AsyncSentinelConnectionPool):
    """redis-py's asyncio Sentinel pool, telling connect failures apart."""


def classify(exc: BaseException) -> BackendError:
    """Map a redis-py exception to the contract's failure reason (contract 6).

    A failure to get a connection (refused, unreachable, pool exhausted) is
    ``backend_unavailable``, a connect timeout ``backend_timeout``: nothing was written.
    A ``LOADING`` reply is ``backend_unavailable`` (the command did not run). A timeout or
    a lost connection once a connection was had is ``indeterminate``: the command may
    have run. Any other error reply (``BUSY``, ``OOM``, ``READONLY``…) is
    ``backend_error``.
    """
    if isinstance(exc, ConnectFailed):
        reason = BACKEND_TIMEOUT if exc.timed_out else BACKEND_UNAVAILABLE
    elif isinstance(exc, redis_exceptions.BusyLoadingError):
        reason = BACKEND_UNAVAILABLE
    elif isinstance(exc, _CONNECT_ERRORS):  # the built-in TimeoutError is an OSError
        reason = INDETERMINATE
    else:
        reason = BACKEND_ERROR
    return BackendError(reason, f"{type(exc).__name__}: {exc}")


#: Connection options a URL may not override (contract 2).
CONTRACT_OPTIONS = ("retry", "socket_timeout", "socket_connect_timeout")


def client_options(timeout: float, max_inflight: int) -> dict[str, Any]:
    """Keyword arguments every pool gets: no hidden retry, timeouts, pool size (contract 2).

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


class RedisBackend:
    """Counters in Redis (standalone or Sentinel-managed primary).

    ``url`` is a ``redis://``, ``rediss://`` or ``unix://`` URL; ``sentinel`` a dict with
    ``SENTINELS`` and ``SERVICE``. Clients are created lazily and shared per process; the
    async client is kept per event loop (pools belong to one loop).
    """

    mode = BACKEND_MODE_REDIS

    def __init__(
        self,
        *,
        url: str | None,
        timeout: float,
        max_inflight: int,
        sentinel: Mapping[str, Any] | None = None,
        url_options: Mapping[str, Any] | None = None,
        client_factory: Callable[[bool], Any] | None = None,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.max_inflight = max_inflight
        self.sentinel = sentinel
        self.url_options = dict(url_options or {})
        #: Builds a client (argument: asynchronous?) instead of the URL; tests pass fakeredis.
        self.client_factory = client_factory
        self._lock = threading.Lock()
        self._bound: _Bound | None = None
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Bound] = (
            weakref.WeakKeyDictionary()
        )
        self._evaluate_source = load("evaluate")
        self._reset_source = load("reset")

    # -- clients -----------------------------------------------------------------------
    def _build(self, asynchronous: bool) -> Any:
        if self.client_factory is not None:
            return self.client_factory(asynchronous)
        options = {**client_options(self.timeout, self.max_inflight), **self.url_options}
        if asynchronous:
            options["retry"] = AsyncRetry(NoBackoff(), 0)
        if self.sentinel is not None:
            sentinel_class = redis_asyncio.Sentinel if asynchronous else redis.Sentinel
            sentinel = sentinel_class(
                [tuple(address) for address in self.sentinel["SENTINELS"]],
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
            )
            pool_class: Any = (
                AsyncMarkingSentinelConnectionPool
                if asynchronous
                else MarkingSentinelConnectionPool
            )
            return sentinel.master_for(
                self.sentinel["SERVICE"], connection_pool_class=pool_class, **options
            )
        assert self.url is not None
        pool_class = AsyncMarkingConnectionPool if asynchronous else MarkingConnectionPool
        pool = pool_class.from_url(self.url, **options)
        # redis-py lets URL query options (?socket_timeout=, ?max_connections=) override
        # keyword arguments; contract 2's retries, timeouts and pool size must hold anyway.
        for name in CONTRACT_OPTIONS:
            pool.connection_kwargs[name] = options[name]
        pool.max_connections = options["max_connections"]
        client_class = redis_asyncio.Redis if asynchronous else redis.Redis
        return client_class(connection_pool=pool)

    def _bind(self, client: Any) -> _Bound:
        return _Bound(
            client,
            client.register_script(self._evaluate_source.source),
            client.register_script(self._reset_source.source),
        )

    @property
    def client(self) -> Any:
        """The shared synchronous client (created on first use)."""
        return self._sync().client

    def _sync(self) -> _Bound:
        bound = self._bound
        if bound is None:
            with self._lock:
                if self._bound is None:
                    self._bound = self._bind(self._build(asynchronous=False))
                bound = self._bound
        return bound

    def _async(self) -> _Bound:
        loop = asyncio.get_running_loop()
        bound = self._async_clients.get(loop)
        if bound is None:
            bound = self._bind(self._build(asynchronous=True))
            self._async_clients[loop] = bound
        return bound

    # -- script calls ------------------------------------------------------------------
    @staticmethod
    def _call(script: Any, client: Any, keys: list[str], args: list[int]) -> Any:
        """``EVALSHA``; redis-py's ``Script`` reloads once on ``NOSCRIPT``, and a flush
        racing that reload is retried here: a script that did not run charged nothing."""
        from redis.exceptions import NoScriptError

        for _ in range(NOSCRIPT_ATTEMPTS - 1):
            try:
                return script(keys=keys, args=args, client=client)
            except NoScriptError:
                continue
        return script(keys=keys, args=args, client=client)

    @staticmethod
    async def _acall(script: Any, client: Any, keys: list[str], args: list[int]) -> Any:
        from redis.exceptions import NoScriptError

        for _ in range(NOSCRIPT_ATTEMPTS - 1):
            try:
                return await script(keys=keys, args=args, client=client)
            except NoScriptError:
                continue
        return await script(keys=keys, args=args, client=client)

    def evaluate(self, request: GroupRequest) -> GroupReply:
        """Run ``evaluate.lua`` once (``EVALSHA``; ``NOSCRIPT`` reloads and retries)."""
        bound = self._sync()
        try:
            reply = self._call(bound.evaluate, bound.client, request.keys(), request.args())
        except Exception as exc:
            raise classify(exc) from exc
        return _parse(reply, request)

    async def aevaluate(self, request: GroupRequest) -> GroupReply:
        """Async twin of :meth:`evaluate`."""
        bound = self._async()
        try:
            reply = await self._acall(bound.evaluate, bound.client, request.keys(), request.args())
        except Exception as exc:
            raise classify(exc) from exc
        return _parse(reply, request)

    def reset(self, counter: str, window_count: int) -> int:
        """Run ``reset.lua`` for one counter."""
        bound = self._sync()
        try:
            return int(self._call(bound.reset, bound.client, [counter], [window_count]))
        except Exception as exc:
            raise classify(exc) from exc

    async def areset(self, counter: str, window_count: int) -> int:
        """Async twin of :meth:`reset`."""
        bound = self._async()
        try:
            return int(await self._acall(bound.reset, bound.client, [counter], [window_count]))
        except Exception as exc:
            raise classify(exc) from exc

    def ttl_ms(self, counter: str) -> int:
        """``PTTL`` of ``counter`` (-2: no such key). Not on the hot path."""
        try:
            return int(self._sync().client.pttl(counter))
        except Exception as exc:
            raise classify(exc) from exc

    def preload(self) -> list[tuple[str, str]]:
        """``SCRIPT LOAD`` every script; return (name, SHA1) pairs."""
        client = self._sync().client
        loaded = []
        try:
            for source in all_scripts():
                loaded.append((source.name, str(client.script_load(source.source))))
        except Exception as exc:
            raise classify(exc) from exc
        return loaded

    def diagnose(self, probe_key: str) -> list[tuple[str, str, str]]:
        """(check, status, detail) rows for ``quota check``: connectivity, latency, script
        load, permissions (the scripts run on ``probe_key``), clock offset and
        ``maxmemory-policy``. ``status`` is ``ok``, ``warning`` or ``error``."""
        import statistics
        import time

        client = self._sync().client
        rows: list[tuple[str, str, str]] = []
        try:
            client.ping()
        except Exception as exc:
            return [("connectivity", "error", str(classify(exc)))]
        rows.append(("connectivity", "ok", "PING answered"))
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            client.ping()
            samples.append((time.perf_counter() - started) * 1000)
        rows.append(("latency", "ok", f"{statistics.median(samples):.2f} ms median of 5 PINGs"))
        try:
            loaded = self.preload()
            rows.append(("scripts", "ok", ", ".join(f"{name} {sha}" for name, sha in loaded)))
        except BackendError as exc:
            rows.append(("scripts", "error", str(exc)))
        try:
            self.reset(probe_key, 1)  # EVALSHA, HEXISTS and DEL on a key of our prefix
            rows.append(("permissions", "ok", "EVALSHA, HGETALL/HSET/DEL allowed"))
        except BackendError as exc:
            rows.append(("permissions", "error", str(exc)))
        try:
            seconds, micros = client.time()
            offset = (seconds + micros / 1e6 - time.time()) * 1000
            status = "ok" if abs(offset) < 1000 else "warning"
            rows.append(("clock offset", status, f"{offset:+.1f} ms (Redis TIME - this host)"))
        except Exception as exc:
            rows.append(("clock offset", "warning", f"TIME failed: {exc}"))
        try:
            config = client.config_get("maxmemory*")
            policy = str(_text(config.get("maxmemory-policy", "unknown")))
            limit = int(_text(config.get("maxmemory", "0")))
            if policy == "noeviction" or limit == 0:
                rows.append(("maxmemory-policy", "ok", f"{policy} (maxmemory {limit})"))
            else:
                rows.append((
                    "maxmemory-policy",
                    "warning",
                    f"{policy} with maxmemory {limit} can evict live counters, which resets "
                    "limits; use noeviction for the rate-limit database",
                ))
        except Exception as exc:
            rows.append(("maxmemory-policy", "warning", f"CONFIG GET not allowed: {exc}"))
        return rows

    def close(self) -> None:
        """Disconnect the synchronous pool; async pools die with their loops."""
        bound, self._bound = self._bound, None
        if bound is not None:
            with contextlib.suppress(Exception):  # closing never raises into setting_changed
                bound.client.close()
        self._async_clients = weakref.WeakKeyDictionary()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse(reply: Any, request: GroupRequest) -> GroupReply:
    try:
        return parse_reply(reply, request.window_counts)
    except (TypeError, ValueError) as exc:
        raise BackendError(BACKEND_ERROR, f"unexpected script reply: {exc}") from exc
