"""The fence: the one module that uses redis-py's private or undocumented state, or writes
on a socket itself (``docs/architecture.md``, "The redis-py fence").

Everything else in the package uses redis-py's public API. What is here is used only
while :func:`public_path` is False; with it True (``QUOTA["REDIS_PUBLIC_PATH"]``, the
``DJANGO_QUOTA_REDIS_PUBLIC_PATH`` environment variable, or a redis-py this module was not
read against) the backends take redis-py's public path for every call, with the same
outcomes, failure reasons and deadlines; only speed differs. What each piece buys:

* :class:`IdleStack` and :func:`write`, the synchronous path: a pool checkout without
  redis-py's bookkeeping, and a command written with one ``write`` of the descriptor.
* :func:`buffered_replies`, under the asyncio pipeline: the replies a read brought in
  beyond the one awaited are taken from hiredis's reader in one go, not one awaited
  ``read_response`` each.
* :func:`take_over`, under the asyncio pipeline: once redis-py has connected, the
  connection's transport answers the pipeline's callers itself (:class:`DirectReplies`:
  hiredis parses each read as the loop makes it, with no reader task between the reply
  and its caller) and is written on without an awaited drain.
* :func:`socket_of`, under the asyncio connections: the kernel asked whether a connection
  holds bytes (or an end of file) the event loop has not read yet, and the sockets of a
  closed loop closed at once (:func:`abandon`, :func:`client_connections`).
* :func:`fence_async_cluster`: redis-py's asyncio cluster client made to tell connect
  failures apart, to ask ``COMMAND`` only when needed, and to start from every node known.

Read against redis-py :data:`READ_AGAINST` (``pyproject.toml`` says so too); another
version takes the public path, with one warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis import exceptions as redis_exceptions
from redis._parsers import AsyncCommandsParser
from redis._parsers import hiredis as _hiredis_parser
from redis.asyncio import cluster as async_cluster
from redis.asyncio import connection as async_connection

from django_quota.backends.failures import CONNECT_ERRORS, mark_connect_failure
from django_quota.backends.handshake import AsyncOneWriteHandshake
from django_quota.core.log import logger

__all__ = [
    "NOTHING_BUFFERED",
    "PUBLIC_PATH_ENV",
    "READ_AGAINST",
    "AsyncMarkingClusterConnection",
    "AsyncMarkingClusterSSLConnection",
    "DirectReplies",
    "IdleStack",
    "abandon",
    "buffered_replies",
    "client_connections",
    "fence_async_cluster",
    "peer_hung_up",
    "public_path",
    "socket_of",
    "take_over",
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


# -- the replies under asyncio connections ----------------------------------------------------
#: What :func:`buffered_replies`' function returns when no whole reply is buffered.
NOTHING_BUFFERED: Any = getattr(_hiredis_parser, "NOT_ENOUGH_DATA", object())


def _resp2_hiredis_reader(connection: Any) -> Any:
    """The hiredis reader of a connected asyncio ``connection`` that parses with hiredis
    on RESP2 (RESP3's push frames are ``read_response``'s to skip), or None."""
    parser = getattr(connection, "_parser", None)
    if type(parser) is not _hiredis_parser._AsyncHiredisParser:
        return None
    if connection.protocol not in (2, "2"):
        return None
    return getattr(parser, "_reader", None)


def buffered_replies(connection: Any) -> Callable[[], Any] | None:
    """A function that returns the next reply a connected asyncio ``connection`` already
    holds whole (read from the socket with an earlier one), or :data:`NOTHING_BUFFERED`;
    None where the connection does not parse with hiredis on RESP2 (then every reply is
    read with ``read_response``).

    What ``read_response`` does with a reply, it does: an error reply comes back as its
    exception (``ResponseError``, ``BusyLoadingError``: the connection stays in step),
    another ``ConnectionError`` reply is raised, as is a malformed stream's
    ``InvalidResponse`` (the caller then closes the connection).

    The caller calls it only in the step of the loop in which ``read_response`` last
    returned (the connection cannot have been disconnected since).

    Relies on: the connection's parser (``_parser``) and its hiredis reader
    (``_reader``). Pays: a read that brought in several replies (64 tasks on one
    connection) costs one awaited ``read_response`` and a ``gets`` per further reply,
    not three coroutines and redis-py's per-read checks each (``docs/benchmarks.md``,
    "The engine")."""
    reader = _resp2_hiredis_reader(connection)
    if reader is None:
        return None
    gets = reader.gets
    connection_error = redis_exceptions.ConnectionError
    loading = redis_exceptions.BusyLoadingError

    def next_reply() -> Any:
        reply = gets()
        if type(reply) is list:  # a script's reply
            if reply and isinstance(reply[0], connection_error):
                if not isinstance(reply[0], loading):
                    raise reply[0]
                return reply[0]  # LOADING: whole, as read_response raises it
        elif isinstance(reply, connection_error) and not isinstance(reply, loading):
            raise reply
        return reply

    return next_reply


class DirectReplies(asyncio.Protocol):
    """The protocol of a connection :func:`take_over` took: each read the loop makes is fed
    to the connection's hiredis reader, and every whole reply goes to ``answer(reply,
    failed)`` in order, in the same step of the loop (``failed``: an error reply, which
    leaves the connection in step). A reply that breaks the connection (a
    ``ConnectionError`` reply other than ``LOADING``, a malformed stream's
    ``InvalidResponse``, or ``answer`` raising) closes the transport and is given to
    ``lost``; so is the end of the connection (``connection_lost``), once.

    Writes go to the transport at once (:meth:`write`); :attr:`paused` says the
    transport's buffer is past its high-water mark (:meth:`drained` waits until it is
    not). redis-py's stream protocol still learns of flow control and of the connection's
    end, so that its stream writer's ``close`` and ``wait_closed`` behave as before."""

    def __init__(
        self,
        transport: asyncio.Transport,
        reader: Any,
        stream_protocol: asyncio.Protocol,
        answer: Callable[[Any, bool], None],
        lost: Callable[[BaseException], None],
    ) -> None:
        self.transport = transport
        self._feed = reader.feed
        self._gets = reader.gets
        self._stream_protocol = stream_protocol
        self._answer = answer
        self._lost = lost
        self._ended = False
        #: The transport's buffer is past its high-water mark: write no more for now.
        self.paused = False
        self._resumed: asyncio.Future[None] | None = None

    @property
    def closing(self) -> bool:
        """Whether nothing can be written any more (the transport is closing or closed)."""
        return self._ended or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        """Hand ``data`` to the transport (the caller checked :attr:`closing` in the same
        step of the loop). A failed send ends the connection: ``lost`` is called."""
        self.transport.write(data)

    async def drained(self) -> None:
        """Wait until the transport takes writes again (or the connection ended)."""
        while self.paused and not self._ended:
            resumed = self._resumed
            if resumed is None or resumed.done():
                resumed = self._resumed = asyncio.get_running_loop().create_future()
            await resumed

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        self._feed(data)
        gets = self._gets
        answer = self._answer
        connection_error = redis_exceptions.ConnectionError
        loading = redis_exceptions.BusyLoadingError
        try:
            while (reply := gets()) is not NOTHING_BUFFERED:
                failed = False
                if type(reply) is list:  # a script's reply
                    if reply and isinstance(reply[0], connection_error):
                        if not isinstance(reply[0], loading):
                            raise reply[0]
                        reply, failed = reply[0], True  # LOADING: whole, as read_response
                elif isinstance(reply, Exception):
                    if isinstance(reply, connection_error) and not isinstance(reply, loading):
                        raise reply
                    failed = True
                answer(reply, failed)
        except Exception as exc:
            self._end(exc)
            self.transport.close()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        with contextlib.suppress(Exception):
            self._stream_protocol.connection_lost(exc)
        self._end(exc or redis_exceptions.ConnectionError("Connection closed by server."))

    def pause_writing(self) -> None:
        self.paused = True
        self._stream_protocol.pause_writing()

    def resume_writing(self) -> None:
        self.paused = False
        self._wake()
        self._stream_protocol.resume_writing()

    def _wake(self) -> None:
        resumed = self._resumed
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def _end(self, exc: BaseException) -> None:
        if self._ended:
            return
        self._ended = True
        self._wake()
        self._lost(exc)


def take_over(
    connection: Any,
    answer: Callable[[Any, bool], None],
    lost: Callable[[BaseException], None],
) -> DirectReplies | None:
    """Give a connected asyncio ``connection`` (redis-py made it, connected it and ran its
    handshake; nothing is in flight on it) a :class:`DirectReplies` protocol that answers
    ``answer`` and ``lost``, and return it; or None, changing nothing, where the
    connection is not redis-py's own ``read_response`` over hiredis on RESP2 (a Sentinel
    connection's, which turns ``READONLY`` into a reconnect, is not), where its transport
    cannot change protocols, or where anything is unread (then ``read_response`` reads it).

    Relies on: the connection's parser (``_parser``) and its hiredis reader (``_reader``),
    its stream reader (``_reader``) and that reader's buffer (asyncio's ``_buffer``), its
    stream writer (``_writer``; ``transport``, ``get_protocol`` and ``set_protocol`` are
    asyncio's public API), and that redis-py reads a connection only when asked to.
    Pays: no reader task between a reply and its caller, and no awaited drain per write:
    a one-task decision takes two turns of the loop, not three, and 254,453 instructions
    of the client, not 304,780; ``Pipeline.execute`` alone, client and server on one
    core, 35.4 µs, not 44.9 (``docs/benchmarks.md``, "The engine")."""
    if type(connection).read_response is not async_connection.AbstractConnection.read_response:
        return None
    reader = _resp2_hiredis_reader(connection)
    stream = getattr(connection, "_reader", None)
    transport = getattr(getattr(connection, "_writer", None), "transport", None)
    if reader is None or not isinstance(stream, asyncio.StreamReader) or transport is None:
        return None
    has_data = getattr(reader, "has_data", None)  # absent from older hiredis releases
    if transport.is_closing() or has_data is None or has_data():
        return None
    unread = getattr(stream, "_buffer", None)
    if unread is None or unread or stream.at_eof() or stream.exception() is not None:
        return None
    stream_protocol = transport.get_protocol()
    if not isinstance(stream_protocol, asyncio.StreamReaderProtocol):
        return None
    direct = DirectReplies(transport, reader, stream_protocol, answer, lost)
    try:
        transport.set_protocol(direct)
    except NotImplementedError:
        return None
    return direct


# -- the sockets under asyncio connections ------------------------------------------------------
def socket_of(connection: Any) -> Any:
    """The socket under a connected redis-py asyncio connection's transport, or None
    (not connected, or its transport closing).

    Relies on: the connection's stream writer (``_writer``); its transport's
    ``get_extra_info("socket")`` is asyncio's public API. Pays: a zero-timeout ``poll``
    of it tells whether the kernel holds bytes or an end of file the loop has not read,
    where the public path gives the loop turns to read them (``docs/failures.md``,
    "Async connections").
    """
    transport = getattr(getattr(connection, "_writer", None), "transport", None)
    if transport is None or transport.is_closing():
        return None
    return transport.get_extra_info("socket")


_poll: Callable[[], Any] | None = getattr(select, "poll", None)


def poller_of(sock: Any) -> Any:
    """A ``select.poll`` object watching ``sock`` for input, or None where ``select.poll``
    does not exist or the socket is closed (its descriptor negative)."""
    descriptor = sock.fileno()
    if _poll is None or descriptor < 0:
        return None
    poller = _poll()
    poller.register(descriptor, getattr(select, "POLLIN", 1) | getattr(select, "POLLPRI", 2))
    return poller


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
        poller = poller_of(sock)
        if poller is None:
            return True
        probe = (transport, poller)
        connection._quota_probe = probe
    return bool(probe[1].poll(0))


def _peeked(sock: Any) -> bool:
    raw = getattr(sock, "_sock", None)
    flags = int(socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))
    try:
        if isinstance(raw, socket.socket):
            raw.recv(1, flags)
        else:
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as probe:
                probe.recv(1, flags)
    except BlockingIOError:
        return False  # nothing to read: idle and open
    except OSError:
        return True
    return True


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
