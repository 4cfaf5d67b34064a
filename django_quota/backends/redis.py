"""The Redis backend: redis-py clients built as contract section 2 says, the Lua scripts
run with ``EVALSHA`` through redis-py's ``Script`` (which reloads on ``NOSCRIPT``), and
every driver error turned into one :class:`BackendError` here and nowhere else."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django_quota.core.errors import BackendError
from django_quota.core.outcome import (
    BACKEND_ERROR,
    BACKEND_MODE_REDIS,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    INDETERMINATE,
)
from django_quota.core.protocol import GroupReply, GroupRequest, parse_reply
from django_quota.scripts import load

#: EVALSHA attempts when SCRIPT FLUSH keeps racing the reload (each one ran nothing).
NOSCRIPT_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class _Bound:
    """A client with its scripts (redis-py ``Script`` objects, called with ``client=``)."""

    client: Any
    evaluate: Any
    reset: Any


def classify(exc: BaseException) -> BackendError:
    """Map a redis-py exception to the contract's failure reason.

    Errors while connecting (refused, unreachable, pool exhausted) are
    ``backend_unavailable``; a connect timeout is ``backend_timeout``; a timeout or a lost
    connection after the command was written is ``indeterminate`` (it may have run); any
    other error reply is ``backend_error``.
    """
    from redis import exceptions

    message = str(exc)
    connecting = "connecting" in message.lower() or "too many connections" in message.lower()
    if isinstance(exc, exceptions.TimeoutError):
        reason = BACKEND_TIMEOUT if connecting else INDETERMINATE
    elif isinstance(exc, exceptions.BusyLoadingError):
        reason = BACKEND_UNAVAILABLE
    elif isinstance(exc, exceptions.ConnectionError):
        reason = BACKEND_UNAVAILABLE if connecting else INDETERMINATE
    elif isinstance(exc, OSError):
        reason = BACKEND_UNAVAILABLE
    else:
        reason = BACKEND_ERROR
    return BackendError(reason, f"{type(exc).__name__}: {message}")


def client_options(timeout: float, max_inflight: int) -> dict[str, Any]:
    """Keyword arguments every client gets: no hidden retry, timeouts, pool size."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return {
        "retry": Retry(NoBackoff(), 0),
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "max_connections": max_inflight,
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
            import redis.asyncio as redis_module
            from redis.asyncio.retry import Retry as AsyncRetry
            from redis.backoff import NoBackoff

            options["retry"] = AsyncRetry(NoBackoff(), 0)
        else:
            import redis as redis_module  # type: ignore[no-redef]
        if self.sentinel is not None:
            sentinel = redis_module.Sentinel(  # type: ignore[no-untyped-call]
                [tuple(address) for address in self.sentinel["SENTINELS"]],
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
            )
            return sentinel.master_for(self.sentinel["SERVICE"], **options)
        assert self.url is not None
        return redis_module.Redis.from_url(self.url, **options)

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

    def close(self) -> None:
        """Disconnect the synchronous pool; async pools die with their loops."""
        bound, self._bound = self._bound, None
        if bound is not None:
            with contextlib.suppress(Exception):  # closing never raises into setting_changed
                bound.client.close()
        self._async_clients = weakref.WeakKeyDictionary()


def _parse(reply: Any, request: GroupRequest) -> GroupReply:
    try:
        return parse_reply(reply, request.window_counts)
    except (TypeError, ValueError) as exc:
        raise BackendError(BACKEND_ERROR, f"unexpected script reply: {exc}") from exc
