"""The fence's asyncio half: an asyncio connection's replies and socket, read past
redis-py (``docs/architecture.md``, "The redis-py fence"). The rest of the fence, and the
switch that turns all of it off (:func:`~django_quota.backends.redispy.public_path`), is
:mod:`django_quota.backends.redispy`; what is here is used only while that switch says
False, and was read against the same redis-py releases
(:data:`~django_quota.backends.redispy.READ_AGAINST`). What each piece buys:

* :func:`buffered_replies`, under the asyncio pipeline: the replies a read brought in
  beyond the one awaited are taken from hiredis's reader in one go, not one awaited
  ``read_response`` each.
* :func:`take_over`, under the asyncio pipeline: once redis-py has connected, the
  connection's transport answers the pipeline's callers itself (:class:`DirectReplies`:
  hiredis parses each read as the loop makes it, with no reader task between the reply
  and its caller) and is written on without an awaited drain.
* :func:`socket_of`, :func:`poller_of` and :func:`peer_hung_up`, under the asyncio
  connections: the kernel asked whether a connection holds bytes (or an end of file)
  the event loop has not read yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
from collections.abc import Callable
from typing import Any

from redis import exceptions as redis_exceptions
from redis._parsers import hiredis as _hiredis_parser
from redis.asyncio import connection as async_connection

__all__ = [
    "NOTHING_BUFFERED",
    "DirectReplies",
    "buffered_replies",
    "peer_hung_up",
    "poller_of",
    "socket_of",
    "take_over",
]


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
