"""The fence: with :mod:`django_quota.backends.redispy_transport` (an asyncio
connection's replies and socket), the one place that uses redis-py's private or
undocumented state, or writes on a socket itself (``docs/architecture.md``, "The redis-py
fence"); this module holds the switch that turns all of it off, and the rest.

Everything else in the package uses redis-py's public API. What the fence holds is used
only while :func:`public_path` is False; with it True (``QUOTA["REDIS_PUBLIC_PATH"]``, the
``DJANGO_QUOTA_REDIS_PUBLIC_PATH`` environment variable, or a redis-py this module was not
read against) the backends take redis-py's public path for every call, with the same
outcomes, failure reasons and deadlines; only speed differs. What each piece here buys:

* :class:`IdleStack` and :func:`write`, the synchronous path: a pool checkout without
  redis-py's bookkeeping, and a command written with one ``write`` of the descriptor.
* :func:`abandon` and :func:`client_connections`: the sockets of a closed loop's asyncio
  connections closed at once.
* :func:`fence_async_cluster`: redis-py's asyncio cluster client made to tell connect
  failures apart, to ask ``COMMAND`` only when needed, and to start from every node known.

Read against redis-py :data:`READ_AGAINST` (``pyproject.toml`` says so too); another
version takes the public path, with one warning.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterable
from typing import Any

import redis
from redis import exceptions as redis_exceptions
from redis._parsers import AsyncCommandsParser
from redis.asyncio import cluster as async_cluster
from redis.asyncio import connection as async_connection

from django_quota.backends.failures import CONNECT_ERRORS, mark_connect_failure
from django_quota.backends.handshake import AsyncOneWriteHandshake
from django_quota.backends.redispy_transport import peer_hung_up
from django_quota.core.log import logger

__all__ = [
    "PUBLIC_PATH_ENV",
    "READ_AGAINST",
    "AsyncMarkingClusterConnection",
    "AsyncMarkingClusterSSLConnection",
    "IdleStack",
    "abandon",
    "client_connections",
    "fence_async_cluster",
    "public_path",
    "write",
]

#: The redis-py releases (major, minor) whose source this module was read against.
READ_AGAINST = ((8, 0), (8, 1), (8, 2))
#: Set (to anything but ``""`` or ``"0"``) to take redis-py's public path in this process.
PUBLIC_PATH_ENV = "DJANGO_QUOTA_REDIS_PUBLIC_PATH"

_warned = threading.Event()


def read_against(version: str) -> bool:
    """Whether the redis-py ``version`` (``"8.1.0"``) is one of :data:`READ_AGAINST`."""
    parts = version.split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return found in READ_AGAINST


def public_path(setting: bool = False) -> bool:
    """Whether the backends use redis-py's public API only: ``setting``
    (``QUOTA["REDIS_PUBLIC_PATH"]``), :data:`PUBLIC_PATH_ENV`, or an installed redis-py
    outside :data:`READ_AGAINST` (logged once per process as a warning)."""
    if setting or os.environ.get(PUBLIC_PATH_ENV, "") not in ("", "0"):
        return True
    version = str(getattr(redis, "__version__", ""))
    if read_against(version):
        return False
    if not _warned.is_set():
        _warned.set()
        logger.warning(
            "quota: redis-py %s is not one django-quota's fast paths were read against (%s): "
            "taking redis-py's public path (docs/settings.md, REDIS_PUBLIC_PATH)",
            version,
            ", ".join(f"{major}.{minor}" for major, minor in READ_AGAINST),
        )
    return True


# -- the synchronous path -------------------------------------------------------------------
class IdleStack:
    """Pool mixin: connections given back wait in a last-in first-out stack of the pool's
    own, and are taken from it again with the checks redis-py's ``get_connection`` makes
    (connected; nothing unread, so the server did not close it), without its
    per-checkout bookkeeping: its lock, four connection-state counters and a release
    event, 12 µs of a decision's 35 µs of Python here (a loop of 50,000, best of 3),
    against 2 µs for the checks.

    Relies on: a connection's ``pid`` (the process that made it), the pool's
    ``owns_connection`` and ``release``. The stack's connections stay "in use" for
    redis-py: the pool still creates at most ``max_connections``, ``disconnect()`` still
    reaches them (the next taker reconnects), and after a fork the child drops the
    parent's (their ``pid``). redis-py's connection-count metrics, when enabled, count
    them as in use. (redis-py 8.2 moved those checks into the pool's ``ensure_connection``,
    where, with RESP3 maintenance notifications on, bytes waiting on an idle connection
    are read as push notifications; the stack reconnects such a connection instead, as it
    did under 8.1. The backends pin RESP2, so only a URL's ``protocol=3`` meets this.)
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


def write(connection: Any, packed: bytes) -> None:
    """Write the packed command ``packed`` on a connected sync ``connection``.

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

    Relies on: the connection's socket (``_sock``).
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


# -- the sockets of a closed event loop ---------------------------------------------------------
def abandon(connections: Iterable[Any]) -> None:
    """Close the sockets of asyncio connections whose event loop has closed: their
    ``disconnect()`` needs that loop, so the socket under the transport is closed
    directly (else it stays open until garbage collection, one per finished loop).

    Relies on: the connection's stream writer (``_writer``) and the socket under
    asyncio's transport wrapper (``_sock``)."""
    for connection in connections:
        writer = getattr(connection, "_writer", None)
        if writer is None:
            continue
        wrapped = writer.get_extra_info("socket")
        raw = getattr(wrapped, "_sock", wrapped)
        with contextlib.suppress(Exception):  # best effort: the loop is gone
            raw.close()


def client_connections(client: Any) -> list[Any]:
    """Every connection a redis-py asyncio client holds, for :func:`abandon`: a standalone
    client's pool's (idle and in use), or a cluster client's nodes' and its startup
    nodes' (redis-py keeps the startup node it asked ``CLUSTER SLOTS`` as an object of its
    own, with its own connection, beside the node of the same address in its node cache).

    Relies on: a pool's ``_available_connections`` and ``_in_use_connections``; a cluster
    client's ``nodes_manager`` (``nodes_cache``, ``startup_nodes``) and a node's
    ``_connections``."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return [
            *getattr(pool, "_available_connections", ()),
            *getattr(pool, "_in_use_connections", ()),
        ]
    manager = getattr(client, "nodes_manager", None)
    if manager is None:
        return []
    nodes = {
        id(node): node
        for node in (
            *getattr(manager, "nodes_cache", {}).values(),
            *getattr(manager, "startup_nodes", {}).values(),
        )
    }  # by identity: ClusterNode compares equal by name
    return [
        connection for node in nodes.values() for connection in getattr(node, "_connections", ())
    ]


# -- redis-py's asyncio cluster client ------------------------------------------------------------
class _MarkConnectFailuresBeforeWrite:
    """asyncio connection mixin: what the sync pools do in ``get_connection`` (a failure
    to connect is :class:`~django_quota.backends.failures.ConnectFailed`), done right
    before a command is written (docs/failures.md). redis-py's asyncio cluster nodes keep
    bare connections, so there is no pool class to choose.

    Relies on: redis-py's asyncio ``send_packed_command`` connecting through
    ``connect_check_health`` first."""

    _quota_connecting = False

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if self.is_connected:  # type: ignore[attr-defined]
            return
        self._quota_connecting = True
        try:
            await super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        except Exception as exc:
            mark_connect_failure(exc)
            raise
        finally:
            self._quota_connecting = False

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self.is_connected and not self._quota_connecting:  # type: ignore[attr-defined]
            # An idle connection with something to read was closed by the server (or is
            # out of step): drop it, so super() connects afresh, marked.
            try:
                stale = await self.can_read() or peer_hung_up(self)  # type: ignore[attr-defined]
            except CONNECT_ERRORS:
                stale = True
            if stale:
                await self.disconnect()  # type: ignore[attr-defined]
        await super().send_packed_command(command, check_health)  # type: ignore[misc]


class AsyncMarkingClusterConnection(
    _MarkConnectFailuresBeforeWrite, AsyncOneWriteHandshake, async_connection.Connection
):
    """redis-py's asyncio connection, telling connect failures apart (cluster nodes), its
    handshake in one write (:class:`~django_quota.backends.handshake.AsyncOneWriteHandshake`:
    a refusal read whole)."""


class AsyncMarkingClusterSSLConnection(
    _MarkConnectFailuresBeforeWrite, AsyncOneWriteHandshake, async_connection.SSLConnection
):
    """The TLS twin of :class:`AsyncMarkingClusterConnection`."""


class LazyCommandsParser(AsyncCommandsParser):
    """redis-py's asyncio cluster client, as it initializes, asks its default node for
    ``COMMAND``: a client per event loop, so with that node a dead primary every
    evaluation of a new loop failed, on healthy slots too. ``EVALSHA``'s keys come from
    its own arguments (redis-py reads them without the table), so ``COMMAND`` is asked
    only when a command needs the table, on the node redis-py picked.

    Relies on: ``redis._parsers.AsyncCommandsParser`` (``initialize``, ``get_keys``,
    ``commands``, ``node``); the client calling ``initialize(node)`` after each topology
    refresh while ``commands`` is empty (redis-py 8.2 sets ``node`` itself once it is
    not), and asking ``get_keys`` of no ``EVALSHA``."""

    async def initialize(self, node: Any = None) -> None:
        if node is not None:
            self.node = node

    async def get_keys(self, *args: Any) -> Any:
        if not self.commands:
            await AsyncCommandsParser.initialize(self)
        return await super().get_keys(*args)


def fence_async_cluster(client: Any, known: Iterable[tuple[str, int]]) -> None:
    """Make a new redis-py asyncio cluster ``client`` (not initialized yet) tell connect
    failures apart (:class:`AsyncMarkingClusterConnection` on every node), ask ``COMMAND``
    only when a command needs it (:class:`LazyCommandsParser`), and start from every node
    in ``known`` ((host, port), what the other clients learnt) besides the URL's, so that
    a new loop's client still starts when the URL's node is the one that is down.

    Relies on: the client's ``commands_parser`` and ``connection_kwargs``, its
    ``nodes_manager``'s ``startup_nodes`` and ``connection_kwargs``, a node's
    ``connection_class``."""
    client.commands_parser = LazyCommandsParser()
    manager = client.nodes_manager
    for host, port in known:
        name = f"{host}:{port}"
        if name not in manager.startup_nodes:
            manager.startup_nodes[name] = async_cluster.ClusterNode(
                host, port, **manager.connection_kwargs
            )
    marking = (
        AsyncMarkingClusterSSLConnection
        if issubclass(client.connection_kwargs["connection_class"], async_connection.SSLConnection)
        else AsyncMarkingClusterConnection
    )
    client.connection_kwargs["connection_class"] = marking
    for node in manager.startup_nodes.values():
        node.connection_class = marking
