"""The Redis backend: redis-py clients built as ``docs/settings.md`` says, the Lua scripts
run with ``EVALSHA`` (``NOSCRIPT`` recovered in :mod:`django_quota.backends.scripting`),
and every driver error turned into one :class:`BackendError` there and nowhere else."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as redis_asyncio
from redis import exceptions as redis_exceptions
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.backoff import NoBackoff
from redis.sentinel import SentinelConnectionPool

from django_quota.backends.clients import BaseRedisBackend, client_options
from django_quota.backends.failures import (
    ConnectFailed,
    classify,
    cut_short,
    deadline_spent,
    mark_connect_failure,
)
from django_quota.backends.handshake import AsyncOneWriteHandshakePool, OneWriteHandshakePool
from django_quota.backends.pipeline import Pipeline
from django_quota.backends.pipeline import pack_command as pack_command
from django_quota.backends.redispy import IdleStack, write
from django_quota.backends.scripting import NOSCRIPT_ATTEMPTS, Call, arun_script, run_script
from django_quota.core.errors import BackendError

__all__ = [
    "NOSCRIPT_ATTEMPTS",
    "ConnectFailed",
    "MarkingConnectionPool",
    "PublicMarkingConnectionPool",
    "RedisBackend",
    "classify",
    "client_options",
    "pinned_url",
]


class _MarkConnectFailures:
    """Pool mixin: failures inside ``get_connection`` (connect, pool exhausted) happen
    before anything is written, so they become :class:`ConnectFailed`; every later
    failure is then known to come after the command may have been written."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get_connection(*args, **kwargs)  # type: ignore[misc]
        except Exception as exc:
            mark_connect_failure(exc)
            raise


class MarkingConnectionPool(IdleStack, _MarkConnectFailures, OneWriteHandshakePool):
    """redis-py's pool, telling connect failures apart (a refusal read whole: the
    connections' :class:`~django_quota.backends.handshake.OneWriteHandshake`), with its
    own stack of idle connections (the fence's
    :class:`~django_quota.backends.redispy.IdleStack`)."""


class PublicMarkingConnectionPool(_MarkConnectFailures, OneWriteHandshakePool):
    """redis-py's pool, telling connect failures apart: redis-py's public path
    (``docs/settings.md``, ``REDIS_PUBLIC_PATH``)."""


class MarkingSentinelConnectionPool(
    _MarkConnectFailures, SentinelConnectionPool, OneWriteHandshakePool
):
    """redis-py's Sentinel pool, telling connect failures apart."""


class AsyncSentinelPool(AsyncSentinelConnectionPool, AsyncOneWriteHandshakePool):
    """redis-py's asyncio Sentinel pool, its connections' handshake in one write
    (:class:`~django_quota.backends.handshake.AsyncOneWriteHandshake`)."""


def pinned_url(url: str) -> str:
    """``url`` without the query options the backend pins (timeouts, pool size, retries;
    ``docs/failures.md``): redis-py lets a URL's query override keyword arguments. A URL
    without them is returned as it is."""
    # The URL query options that would undo the pinned client settings.
    pinned = {
        "socket_timeout",
        "socket_connect_timeout",
        "timeout",
        "max_connections",
        "retry_on_timeout",
        "retry_on_error",
    }
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    kept = [(k, v) for k, v in query if k not in pinned]
    if len(kept) == len(query):
        return url
    return urlunsplit(parts._replace(query=urlencode(kept)))


class RedisBackend(BaseRedisBackend):
    """Counters in Redis (standalone or Sentinel-managed primary).

    ``url`` is a ``redis://``, ``rediss://`` or ``unix://`` URL; ``sentinel`` a dict with
    ``SENTINELS`` and ``SENTINEL``'s ``SERVICE``. Clients are kept as
    :class:`~django_quota.backends.clients.BaseRedisBackend` says.
    """

    def __init__(
        self,
        *,
        url: str | None,
        timeout: float,
        max_inflight: int,
        sentinel: Mapping[str, Any] | None = None,
        url_options: Mapping[str, Any] | None = None,
        client_factory: Callable[[bool], Any] | None = None,
        public: bool = False,
    ) -> None:
        super().__init__(
            timeout=timeout, max_inflight=max_inflight, url_options=url_options, public=public
        )
        self.url = url
        self.sentinel = sentinel
        #: Builds a client (argument: asynchronous?) instead of the URL; tests pass fakeredis.
        self.client_factory = client_factory

    # -- clients -----------------------------------------------------------------------
    def _build(self, asynchronous: bool) -> Any:
        if self.client_factory is not None:
            return self.client_factory(asynchronous)
        options = self._options()
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
                AsyncSentinelPool if asynchronous else MarkingSentinelConnectionPool
            )
            client = sentinel.master_for(
                self.sentinel["SERVICE"], connection_pool_class=pool_class, **options
            )
        else:
            assert self.url is not None
            if asynchronous:
                pool_class = AsyncOneWriteHandshakePool
            elif self.public:
                pool_class = PublicMarkingConnectionPool
            else:
                pool_class = MarkingConnectionPool
            # redis-py lets URL query options (?socket_timeout=, ?max_connections=) override
            # keyword arguments; our retries, timeouts and pool size must hold anyway.
            pool = pool_class.from_url(pinned_url(self.url), **options)
            client_class = redis_asyncio.Redis if asynchronous else redis.Redis
            client = client_class(connection_pool=pool)
        if asynchronous:
            # The pool only makes the connections (redis-py's handshake, TLS, Sentinel's
            # discovery); the pipeline keeps them (docs/failures.md, "Async connections").
            return Pipeline(
                client.connection_pool.make_connection,
                self.timeout,
                owner=client,
                public=self.public,
            )
        return client

    def _async_connections(self, client: Any) -> list[Any]:
        """Every connection a loop's :class:`Pipeline` (or a ``client_factory``'s asyncio
        client) holds."""
        if isinstance(client, Pipeline):
            return client.connections()
        return super()._async_connections(client)

    # -- script calls ------------------------------------------------------------------
    def node_of(self, call: Call) -> str:
        """The node a call runs on: a standalone or Sentinel primary is one node."""
        return "default"

    def run(self, call: Call, deadline: float | None = None) -> Any:
        """Run one script call (``EVALSHA``; ``NOSCRIPT`` loads the script and retries),
        each command bounded by ``deadline`` as :func:`send` says."""
        pool = self.client.connection_pool
        source = self._sources[call.script]
        timeout = self.timeout
        fast = not self.public
        try:
            evalsha = ("EVALSHA", source.sha1, len(call.keys), *call.keys, *call.args)
            try:
                return send(pool, evalsha, deadline, timeout, fast)
            except redis_exceptions.NoScriptError:
                return run_script(
                    source,
                    call,
                    lambda command: send(pool, command, deadline, timeout, fast),
                    missing=True,
                )
        except Exception as exc:
            raise classify(exc) from exc

    async def arun(self, call: Call, deadline: float | None = None) -> Any:
        """Async twin of :meth:`run`: on the running loop's :class:`Pipeline`, or, while
        the loop is young (:meth:`young`), on :meth:`run` in a worker thread; each
        command bounded by ``deadline`` as on :meth:`run`."""
        try:
            loop = asyncio.get_running_loop()
            pipeline = self._async_clients.get(loop)
            if pipeline is None or self.client_factory is not None:
                if self.client_factory is not None:
                    return await self._arun_on_client(call, deadline)
                young = self.young(loop)
                if young is not None:
                    return await self.in_thread(loop, young, call, deadline)
                pipeline = self._async()
            source = self._sources[call.script]
            evalsha = ("EVALSHA", source.sha1, len(call.keys), *call.keys, *call.args)
            try:
                return await pipeline.execute(evalsha, deadline)
            except redis_exceptions.NoScriptError:
                return await arun_script(
                    source,
                    call,
                    lambda command: pipeline.execute(command, deadline),
                    missing=True,
                )
        except Exception as exc:
            raise classify(exc) from exc

    async def _arun_on_client(self, call: Call, deadline: float | None) -> Any:
        """:meth:`arun` on a ``client_factory``'s asyncio client (a test's fakeredis)."""
        pool = self._async().connection_pool
        source = self._sources[call.script]
        timeout = self.timeout
        evalsha = ("EVALSHA", source.sha1, len(call.keys), *call.keys, *call.args)
        try:
            return await asend(pool, evalsha, timeout, deadline)
        except redis_exceptions.NoScriptError:
            return await arun_script(
                source,
                call,
                lambda command: asend(pool, command, timeout, deadline),
                missing=True,
            )

    def _retire(self, loop: asyncio.AbstractEventLoop, client: Any, *, close_live: bool) -> None:
        """Close a loop's pipeline in that loop when it still may run; else close the
        sockets directly (:func:`~django_quota.backends.redispy.abandon`)."""
        if isinstance(client, Pipeline) and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(client.close)
            except RuntimeError:  # closed meanwhile
                pass
            else:
                return
        super()._retire(loop, client, close_live=close_live)

    def preload(self) -> list[tuple[str, str]]:
        """``SCRIPT LOAD`` every script; return (name, SHA1) pairs."""
        client = self.client
        loaded = []
        try:
            for source in self._sources.values():
                loaded.append((source.name, str(client.script_load(source.source))))
        except Exception as exc:
            raise classify(exc) from exc
        return loaded


def send(
    pool: Any,
    command: tuple[Any, ...],
    deadline: float | None = None,
    timeout: float | None = None,
    fast: bool = True,
) -> Any:
    """Send one command on a connection of ``pool`` and read its raw reply.

    What ``Redis.execute_command`` does for us, without its per-command bookkeeping
    (retries, which are off; response callbacks, which the scripts' integer replies do
    not need; observability hooks): a connection whose command did not end with a
    whole reply (it failed, timed out, or was interrupted between the write and the
    read) is disconnected before it returns to the pool, so that the next command
    starts afresh and never reads this one's late reply; an error reply leaves it in
    step. ``fast`` (not on redis-py's public path): the command is packed by hiredis when
    it is installed (redis-py's own packer wraps the same call in about 2 µs of argument
    checks that our commands never need) and written by the fence's
    :func:`~django_quota.backends.redispy.write`; else redis-py's ``send_command``.

    ``deadline`` (``time.monotonic()`` seconds, the end of the evaluation's
    ``DEADLINE``) bounds the command: once it has passed, nothing is written
    (:func:`~django_quota.backends.failures.deadline_spent`), and the reply is awaited
    until then when that is sooner than the socket's own ``timeout`` (``TIMEOUT``): a
    wait that ``DEADLINE`` ends is ``indeterminate`` without blaming the node
    (:func:`~django_quota.backends.failures.cut_short`).
    A reply that is in the socket when its wait times out (a signal handler ran past
    the timeout, say) is read and used (docs/settings.md, "Time budgets").
    """
    connection = pool.get_connection()
    try:
        wait: float | None = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:  # the wait for a slot or the connect took the rest
                raise deadline_spent(command)
            if timeout is None or left < timeout:
                wait = left
        if fast and pack_command is not None:
            write(connection, pack_command(command))
        else:
            connection.send_command(*command)
        try:
            if wait is None:
                return connection.read_response(disconnect_on_error=False)
            return connection.read_response(timeout=wait, disconnect_on_error=False)
        except redis_exceptions.TimeoutError:
            if not connection.can_read(timeout=0):
                if wait is not None:  # DEADLINE, not TIMEOUT, ended the wait
                    connection.disconnect()  # its reply must never be read as another's
                    raise cut_short(command) from None
                raise
            # It came as the wait ended: the command ran, its reply is here, and may take
            # this long (s) to read whole.
            grace = 0.001
            return connection.read_response(timeout=grace, disconnect_on_error=False)
    except redis_exceptions.ResponseError:
        raise  # an error reply, read whole: the connection is in step
    except BackendError:
        raise  # nothing was written: the connection is in step
    except BaseException:
        # Broken, timed out, or interrupted between the write and the read (an exception
        # from a signal handler, Ctrl-C): the reply may still come, and must never be
        # read as the next command's.
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


async def asend(
    pool: Any, command: tuple[Any, ...], timeout: float, deadline: float | None = None
) -> Any:
    """Async twin of :func:`send` for a ``client_factory``'s asyncio client (pipelined
    connections are :class:`Pipeline`'s); the command (its write and its read) is bounded
    by ``timeout`` seconds, or by the rest of ``deadline`` when that is sooner (as in
    :func:`send`).

    A connection is had as redis-py has it, its connect and handshake bounded by the
    pool's socket timeouts. The command then runs inside one ``asyncio.timeout`` with
    the connection's socket timeout off, because with one redis-py's asyncio connection
    wraps every write in ``asyncio.wait_for`` (a task and two more turns of the event
    loop a command); the socket timeout is restored before the connection goes back. On
    expiry the command may have run: the connection is closed with its reply unread and
    a ``TimeoutError`` is raised (``indeterminate``). The command is packed by hiredis
    when it is installed (redis-py's asyncio connection packs in Python: about 5.8 µs
    for an ``EVALSHA`` here, hiredis 0.6 µs).
    """
    connection = await pool.get_connection()
    socket_timeout = connection.socket_timeout
    wait = timeout
    cut = False
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            await pool.release(connection)
            raise deadline_spent(command)
        if left < timeout:
            wait, cut = left, True
    try:
        connection.socket_timeout = None
        async with asyncio.timeout(wait):
            if pack_command is not None:
                await connection.send_packed_command(pack_command(command))
            else:
                await connection.send_command(*command)
            return await connection.read_response()
    except TimeoutError as exc:
        await connection.disconnect(nowait=True)
        if cut:
            raise cut_short(command) from None
        raise TimeoutError(f"no reply within TIMEOUT ({timeout} s): {command[0]}") from exc
    except redis_exceptions.ResponseError:
        raise  # an error reply, read whole: the connection is in step
    except BaseException:  # broken, cancelled or interrupted: as in send()
        await connection.disconnect(nowait=True)
        raise
    finally:
        connection.socket_timeout = socket_timeout
        await pool.release(connection)
