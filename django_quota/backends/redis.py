"""The Redis backend: redis-py clients built as ``docs/settings.md`` says, the Lua scripts
run with ``EVALSHA`` (``NOSCRIPT`` recovered in :mod:`django_quota.backends.scripting`),
and every driver error turned into one :class:`BackendError` there and nowhere else."""

from __future__ import annotations

import asyncio
import os
import select
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
import redis.asyncio as redis_asyncio
from redis import exceptions as redis_exceptions
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.backoff import NoBackoff
from redis.sentinel import SentinelConnectionPool

from django_quota.backends.pipeline import Pipeline
from django_quota.backends.pipeline import pack_command as pack_command
from django_quota.backends.scripting import (
    NOSCRIPT_ATTEMPTS,
    BaseRedisBackend,
    Call,
    ConnectFailed,
    arun_script,
    classify,
    client_options,
    deadline_spent,
    mark_connect_failure,
    run_script,
)
from django_quota.core.errors import BackendError

__all__ = [
    "NOSCRIPT_ATTEMPTS",
    "ConnectFailed",
    "MarkingConnectionPool",
    "RedisBackend",
    "classify",
    "client_options",
    "peer_hung_up",
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


def peer_hung_up(connection: Any) -> bool:
    """Whether an asyncio connection's socket holds an end of file (or stray bytes, or an
    error) that the event loop has not read yet: redis-py's ``can_read`` sees only what
    the loop already read, and a loop that did not run since the server closed the
    connection has read nothing.

    Asks the kernel without reading: ``poll`` with a zero timeout on the socket under
    asyncio's transport (a poll object made once per transport and kept on the
    connection: about 0.3 µs a checkout, against 1.5 µs for a ``MSG_PEEK`` receive and
    the ``BlockingIOError`` it raises when nothing is there). Where ``select.poll`` does
    not exist, peeks (``MSG_PEEK``, consuming nothing) on the socket, or on a duplicate
    of its descriptor where the transport's wrapper hides it.
    """
    transport = getattr(getattr(connection, "_writer", None), "transport", None)
    if transport is None:
        return False
    if transport.is_closing():
        return True  # its socket is closed or about to be: nothing can be sent on it
    probe = getattr(connection, "_quota_probe", None)
    if probe is None or probe[0] is not transport:
        # An open transport's socket keeps its descriptor: polling it is polling this
        # connection (a new transport, after a reconnect, gets a new poll object).
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        if _poll is None:
            return _peeked(sock)
        descriptor = sock.fileno()
        if descriptor < 0:
            return True
        poller = _poll()
        poller.register(descriptor, _POLL_EVENTS)
        probe = (transport, poller)
        connection._quota_probe = probe
    return bool(probe[1].poll(0))


_poll: Callable[[], Any] | None = getattr(select, "poll", None)
_POLL_EVENTS = getattr(select, "POLLIN", 1) | getattr(select, "POLLPRI", 2)
_PEEK_FLAGS = int(socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))


def _peeked(sock: Any) -> bool:
    raw = getattr(sock, "_sock", None)
    try:
        if isinstance(raw, socket.socket):
            raw.recv(1, _PEEK_FLAGS)
        else:
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as probe:
                probe.recv(1, _PEEK_FLAGS)
    except BlockingIOError:
        return False  # nothing to read: idle and open
    except OSError:
        return True
    return True


class _IdleStack:
    """Pool mixin: connections given back wait in a last-in first-out stack of the pool's
    own, and are taken from it again with the checks redis-py's ``get_connection`` makes
    (connected; nothing unread, so the server did not close it), without its
    per-checkout bookkeeping: its lock, four connection-state counters and a release
    event, 12 µs of a decision's 35 µs of Python here (a loop of 50,000, best of 3),
    against 2 µs for the checks.

    The stack's connections stay "in use" for redis-py: the pool still creates at most
    ``max_connections``, ``disconnect()`` still reaches them (the next taker reconnects),
    and after a fork the child drops the parent's (their ``pid``). redis-py's
    connection-count metrics, when enabled, count them as in use.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idle: list[Any] = []

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        idle = self._idle
        pid = os.getpid()
        while idle:
            try:
                connection = idle.pop()  # atomic: no lock needed
            except IndexError:
                break
            if connection.pid != pid:
                continue  # the parent's, after a fork: redis-py resets the pool itself
            if connection.is_connected:
                try:
                    if not connection.can_read():
                        return connection
                except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError):
                    pass
                connection.disconnect()  # closed by the server, or stray bytes
            # Back to redis-py, which connects it again (once, its failure marked).
            super().release(connection)  # type: ignore[misc]
            break
        return super().get_connection(*args, **kwargs)  # type: ignore[misc]

    def release(self, connection: Any) -> None:
        # A parent's connection given back in a forked child is skipped when taken.
        if self.owns_connection(connection):  # type: ignore[attr-defined]
            self._idle.append(connection)
        else:
            super().release(connection)  # type: ignore[misc]


class MarkingConnectionPool(_IdleStack, _MarkConnectFailures, redis.ConnectionPool):
    """redis-py's pool, telling connect failures apart, with its own stack of idle
    connections (:class:`_IdleStack`)."""


class MarkingSentinelConnectionPool(_MarkConnectFailures, SentinelConnectionPool):
    """redis-py's Sentinel pool, telling connect failures apart."""


#: Connection options a URL may not override (docs/settings.md).
PINNED_OPTIONS = ("retry", "socket_timeout", "socket_connect_timeout")


class RedisBackend(BaseRedisBackend):
    """Counters in Redis (standalone or Sentinel-managed primary).

    ``url`` is a ``redis://``, ``rediss://`` or ``unix://`` URL; ``sentinel`` a dict with
    ``SENTINELS`` and ``SENTINEL``'s ``SERVICE``. Clients are kept as
    :class:`~django_quota.backends.scripting.BaseRedisBackend` says.
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
    ) -> None:
        super().__init__(timeout=timeout, max_inflight=max_inflight, url_options=url_options)
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
                AsyncSentinelConnectionPool if asynchronous else MarkingSentinelConnectionPool
            )
            client = sentinel.master_for(
                self.sentinel["SERVICE"], connection_pool_class=pool_class, **options
            )
        else:
            assert self.url is not None
            pool_class = redis_asyncio.ConnectionPool if asynchronous else MarkingConnectionPool
            pool = pool_class.from_url(self.url, **options)
            # redis-py lets URL query options (?socket_timeout=, ?max_connections=) override
            # keyword arguments; our retries, timeouts and pool size must hold anyway.
            for name in PINNED_OPTIONS:
                pool.connection_kwargs[name] = options[name]
            pool.max_connections = options["max_connections"]
            client_class = redis_asyncio.Redis if asynchronous else redis.Redis
            client = client_class(connection_pool=pool)
        if asynchronous:
            # The pool only makes the connections (redis-py's handshake, TLS, Sentinel's
            # discovery); the pipeline keeps them (docs/failures.md, "Async connections").
            return Pipeline(client.connection_pool.make_connection, self.timeout, owner=client)
        return client

    def _async_connections(self, client: Any) -> list[Any]:
        """Every connection a loop's :class:`Pipeline` (or a ``client_factory``'s asyncio
        client) holds."""
        if isinstance(client, Pipeline):
            return client.connections()
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            return [
                *getattr(pool, "_available_connections", ()),
                *getattr(pool, "_in_use_connections", ()),
            ]
        nodes = getattr(getattr(client, "nodes_manager", None), "nodes_cache", {})
        return [connection for node in nodes.values() for connection in node._connections]

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
        try:
            evalsha = ("EVALSHA", source.sha1, len(call.keys), *call.keys, *call.args)
            try:
                return send(pool, evalsha, deadline, timeout)
            except redis_exceptions.NoScriptError:
                return run_script(
                    source,
                    call,
                    lambda command: send(pool, command, deadline, timeout),
                    missing=True,
                )
        except Exception as exc:
            raise classify(exc) from exc

    async def arun(self, call: Call) -> Any:
        """Async twin of :meth:`run`: on the running loop's :class:`Pipeline`, or, while
        the loop is young (:meth:`young`), on :meth:`run` in a worker thread."""
        try:
            loop = asyncio.get_running_loop()
            pipeline = self._async_clients.get(loop)
            if pipeline is None or self.client_factory is not None:
                if self.client_factory is not None:
                    return await self._arun_on_client(call)
                young = self.young(loop)
                if young is not None:
                    return await self.in_thread(loop, young, call)
                pipeline = self._async()
            source = self._sources[call.script]
            evalsha = ("EVALSHA", source.sha1, len(call.keys), *call.keys, *call.args)
            try:
                return await pipeline.execute(evalsha)
            except redis_exceptions.NoScriptError:
                return await arun_script(source, call, pipeline.execute, missing=True)
        except Exception as exc:
            raise classify(exc) from exc

    async def _arun_on_client(self, call: Call) -> Any:
        """:meth:`arun` on a ``client_factory``'s asyncio client (a test's fakeredis)."""
        pool = self._async().connection_pool
        source = self._sources[call.script]
        timeout = self.timeout
        evalsha = ("EVALSHA", source.sha1, len(call.keys), *call.keys, *call.args)
        try:
            return await asend(pool, evalsha, timeout)
        except redis_exceptions.NoScriptError:
            return await arun_script(
                source, call, lambda command: asend(pool, command, timeout), missing=True
            )

    def _retire(self, loop: asyncio.AbstractEventLoop, client: Any, *, close_live: bool) -> None:
        """Close a loop's pipeline in that loop when it still may run; else close the
        sockets directly (:func:`~django_quota.backends.scripting.abandon`)."""
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


def write(connection: Any, packed: bytes) -> None:
    """Write the packed command ``packed`` on a connected sync ``connection`` (commands
    packed by hiredis; without it, redis-py packs and sends them itself).

    A socket with a timeout is polled by Python before every send, a system call that a
    command into an empty send buffer never needs: the connection's last reply was read,
    so everything it sent before has been acknowledged. So the bytes go out with one
    ``write`` of the socket's descriptor, which a socket with a timeout keeps
    non-blocking: it never waits. What it could not write (a command larger than the
    buffer, a full buffer) goes through redis-py's ``send_packed_command``, under the
    socket's timeout as ever. Only a plain TCP or Unix socket with a timeout is written
    this way (a TLS socket must encrypt; a socket without a timeout would block). A
    failed write disconnects the connection and raises redis-py's ``ConnectionError``,
    as redis-py does: the command may have been written in part (``indeterminate``).
    redis-py's health check, when due, runs first, as in ``send_packed_command``.
    """
    sock = getattr(connection, "_sock", None)
    if type(sock) is socket.socket and sock.gettimeout():
        connection.check_health()  # a PING when the URL sets health_check_interval
        try:
            written = os.write(sock.fileno(), packed)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            connection.disconnect()
            raise redis_exceptions.ConnectionError(
                f"Error {exc.errno} while writing to socket. {exc.strerror}."
            ) from exc
        if written == len(packed):
            return
        connection.send_packed_command([packed[written:]], check_health=False)
        return
    connection.send_packed_command([packed])


#: How long a reply found in the socket as its wait timed out may take to read whole (s).
LATE_REPLY_GRACE = 0.001


def send(
    pool: Any,
    command: tuple[Any, ...],
    deadline: float | None = None,
    timeout: float | None = None,
) -> Any:
    """Send one command on a connection of ``pool`` and read its raw reply.

    What ``Redis.execute_command`` does for us, without its per-command bookkeeping
    (retries, which are off; response callbacks, which the scripts' integer replies do
    not need; observability hooks): a connection whose command did not end with a
    whole reply (it failed, timed out, or was interrupted between the write and the
    read) is disconnected before it returns to the pool, so that the next command
    starts afresh and never reads this one's late reply; an error reply leaves it in
    step. The command is packed by hiredis when it is installed: redis-py's own packer
    wraps the same call in about 2 µs of argument checks (it splits a command name given
    as text on spaces, copies each argument) that our commands never need.

    ``deadline`` (``time.monotonic()`` seconds, the end of the evaluation's
    ``DEADLINE``) bounds the command: once it has passed, nothing is written
    (:func:`~django_quota.backends.scripting.deadline_spent`), and the reply is awaited
    until then when that is sooner than the socket's own ``timeout`` (``TIMEOUT``).
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
        if pack_command is None:
            connection.send_command(*command)
        else:
            write(connection, pack_command(command))
        try:
            if wait is None:
                return connection.read_response(disconnect_on_error=False)
            return connection.read_response(timeout=wait, disconnect_on_error=False)
        except redis_exceptions.TimeoutError:
            if not connection.can_read(timeout=0):
                raise
            # It came as the wait ended: the command ran, its reply is here.
            return connection.read_response(timeout=LATE_REPLY_GRACE, disconnect_on_error=False)
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


async def asend(pool: Any, command: tuple[Any, ...], timeout: float) -> Any:
    """Async twin of :func:`send` for a ``client_factory``'s asyncio client (pipelined
    connections are :class:`Pipeline`'s); the command (its write and its read) is bounded
    by ``timeout`` seconds.

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
    try:
        connection.socket_timeout = None
        async with asyncio.timeout(timeout):
            if pack_command is not None:
                await connection.send_packed_command(pack_command(command))
            else:
                await connection.send_command(*command)
            return await connection.read_response()
    except TimeoutError as exc:
        await connection.disconnect(nowait=True)
        raise TimeoutError(f"no reply within TIMEOUT ({timeout} s): {command[0]}") from exc
    except redis_exceptions.ResponseError:
        raise  # an error reply, read whole: the connection is in step
    except BaseException:  # broken, cancelled or interrupted: as in send()
        await connection.disconnect(nowait=True)
        raise
    finally:
        connection.socket_timeout = socket_timeout
        await pool.release(connection)
