"""Async commands pipelined on one connection per event loop and node
(``docs/failures.md``, "Async connections").

A :class:`Pipeline` belongs to one event loop and one node. It keeps
``Pacing.CONNECTIONS`` connection that takes new commands (:class:`Pipe`), made and
connected by redis-py (``pool.make_connection()``, then ``connect()``: the handshake, TLS,
``AUTH``, ``SELECT`` and a Sentinel's primary discovery stay redis-py's), and writes the
commands of concurrent callers onto them as they come: a command sent to a connection with
nothing in flight goes out at once, the others submitted during one turn of the loop go
out together in one write at the next. The replies are read in order and answer the
callers first in, first out: by the connection's transport itself once redis-py has
connected it (the fence's :func:`~django_quota.backends.redispy_transport.take_over`: the
turn of the loop that reads a reply answers its caller, and writes need no awaited
drain), else by a reader task per connection (``read_response``). A burst of
callers needs no connection each: ``MAX_INFLIGHT`` bounds the decisions queued, not
sockets.

Deadlines never disconnect a connection that still answers. A command whose reply is not
there ``TIMEOUT`` seconds after its write fails its caller as late (``indeterminate``),
but stays in line: its reply, when it comes, is read and dropped, so no later caller ever
reads it as its own. A caller whose evaluation's ``DEADLINE`` ends sooner stops waiting
then (``indeterminate`` too, but no evidence against the node), and a command whose
``DEADLINE`` has passed before it could be written is never written. Before either, the
reader gets its turn (a reply the kernel already holds, or the loop already read, is
used: a loop that was busy when the reply came is not the node's fault). A connection
with a late command takes no new ones; if it stays silent for another ``TIMEOUT`` it is
closed. A broken connection fails every command on it: those written as
``indeterminate``, those never written as
:class:`~django_quota.backends.scripting.ConnectFailed` (nothing was written).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from redis import exceptions as redis_exceptions

from django_quota.backends.failures import (
    ConnectFailed,
    cut_short,
    deadline_spent,
    is_connect_failure,
)
from django_quota.backends.redispy_transport import (
    NOTHING_BUFFERED,
    DirectReplies,
    buffered_replies,
    poller_of,
    socket_of,
    take_over,
)

#: hiredis's RESP packer (the ``hiredis`` extra), else None (redis-py's packs).
pack_command: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack_command
except ImportError:  # pragma: no cover - the oldest-versions lane has no hiredis
    pack_command = None
else:
    pack_command = _hiredis_pack_command

__all__ = ["Late", "Pacing", "Pipe", "Pipeline"]


class Pacing:
    """How many connections a pipeline keeps per event loop and node, and how many turns
    of the loop it gives a reply or a connection."""

    #: Connections that take new commands. Redis runs one command at a time, so a loop's
    #: commands gain nothing from being spread over connections, and each connection
    #: costs the server a read and a write a turn: with 4, 64 tasks of one loop cost the
    #: server 0.12 reads (and writes) per decision, with 1, 0.03, and its CPU per decision
    #: fell from about 8.2 to 6.9 µs (docs/benchmarks.md, "The engine"). Another
    #: connection is opened only when this one has a command past ``TIMEOUT``.
    CONNECTIONS: Final = 1
    #: Connections at most, those waiting for a late reply included.
    MAX_CONNECTIONS: Final = 8
    #: A new connection is opened (up to ``CONNECTIONS``) when every usable one has at
    #: least this many commands unanswered.
    SPREAD: Final = 1
    #: Turns of the loop a deadline waits at most for a reply the kernel already holds.
    RECHECKS: Final = 3
    #: On redis-py's public path (no socket to poll), turns of the loop given before a
    #: command is written on an idle connection: enough for the loop to read an end of
    #: file the kernel holds and for the connection's reader to fail on it.
    SETTLE_TURNS: Final = 3


class Late(TimeoutError):
    """No reply within ``TIMEOUT`` of the write: the command may have run."""


#: A caller without a ``DEADLINE`` (loop time): it waits ``TIMEOUT`` from the write.
NEVER = float("inf")


class _Entry:
    """One command: its caller's future, its bytes, when its reply is due (``TIMEOUT``
    after the write) and when its caller stops waiting (the end of its ``DEADLINE``, in
    the loop's time)."""

    __slots__ = ("deadline", "future", "give_up", "late", "packed")

    def __init__(self, future: asyncio.Future[Any], packed: bytes, give_up: float = NEVER) -> None:
        self.future = future
        self.packed = packed
        self.deadline = 0.0
        self.give_up = give_up
        self.late = False


class Pipe:
    """One pipelined connection of a :class:`Pipeline`: commands written (``pending``, in
    order) and not yet written (``queued``), a reader task (which connects, then reads
    the replies, or only waits to disconnect when the transport answers itself:
    :attr:`direct`), and a writer task for the commands that come while others are in
    flight."""

    def __init__(self, pipeline: Pipeline, connection: Any) -> None:
        self.pipeline = pipeline
        self.connection = connection
        self.loop = pipeline.loop
        self.timeout = pipeline.timeout
        self.pending: deque[_Entry] = deque()
        self.queued: list[_Entry] = []
        #: Connected, its reader running.
        self.ready = False
        self.closed = False
        #: The first ``late`` entries of ``pending`` failed as late; their replies are owed.
        self.late = 0
        self.writing = False
        #: Replies read so far (a connection with late commands must keep answering).
        self.replies = 0
        self._stalled_at = 0.0
        self._stalled_replies = 0
        self._timer: asyncio.TimerHandle | None = None
        self._wake: asyncio.Future[None] | None = None
        self._poller: Any = None
        self._writer: asyncio.Task[None] | None = None
        #: The connection's transport answering this pipe itself (the fence's
        #: :func:`~django_quota.backends.redispy_transport.take_over`), or None: the
        #: reader task reads with ``read_response`` and commands are written with
        #: redis-py's ``send_packed_command``.
        self.direct: DirectReplies | None = None
        self._reader = self.loop.create_task(self._run())

    @property
    def load(self) -> int:
        """Commands unanswered or unwritten."""
        return len(self.pending) + len(self.queued)

    # -- writing ----------------------------------------------------------------------
    def queue(self, entry: _Entry) -> bool:
        """Queue ``entry`` for the writer (one write for every command queued during
        this turn of the loop) and return True; or return False, queuing nothing, when
        nothing is in flight here: the caller then writes it at once (:meth:`send`)."""
        if self.ready and not self.writing and not self.pending and not self.queued:
            return False
        self.queued.append(entry)
        self._wake_writer()
        return True

    async def send(self, entry: _Entry) -> None:
        """Write ``entry`` now (nothing is in flight here: :meth:`queue` said so)."""
        entry.deadline = self.loop.time() + self.timeout
        self.pending.append(entry)
        await self._write([entry.packed], entry.give_up)

    def send_direct(self, direct: DirectReplies, entry: _Entry) -> None:
        """:meth:`send` on a transport taken over (:attr:`direct`): no awaited drain."""
        if direct.closing:
            # Closing, its end not delivered yet: nothing is written (ConnectFailed).
            self.queued.append(entry)
            self.abort(redis_exceptions.ConnectionError("Connection closed by server."))
            return
        entry.deadline = self.loop.time() + self.timeout
        self.pending.append(entry)
        direct.write(entry.packed)
        self._written(entry.give_up)

    async def _write(self, packed: list[bytes], give_up: float) -> None:
        """Write ``packed``; then a timer is armed, or moved earlier when a caller's
        ``DEADLINE`` (the soonest ``give_up`` of the batch) ends before it fires."""
        self.writing = True
        try:
            await self.connection.send_packed_command(packed, check_health=False)
        except BaseException as exc:
            # redis-py has disconnected: what was written may have run (indeterminate).
            self.abort(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            self._written(give_up)
        finally:
            self.writing = False
        if self.queued:
            self._wake_writer()

    def _written(self, give_up: float) -> None:
        """After a write: the pipe's timer armed, or moved earlier for ``give_up``."""
        timer = self._timer
        if timer is None:
            self._arm()
        elif give_up < timer.when():
            timer.cancel()
            self._arm()

    def _wake_writer(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write_queued(self) -> None:
        loop = self.loop
        direct = self.direct
        while not self.closed:
            if not self.queued or self.writing:
                self._wake = loop.create_future()
                await self._wake
                continue
            if direct is not None:
                if direct.paused:
                    await direct.drained()  # the transport's buffer is past its high mark
                    continue
                if direct.closing:
                    self.abort(redis_exceptions.ConnectionError("Connection closed by server."))
                    return
            now = loop.time()
            batch = []
            for entry in self.queued:
                future = entry.future
                if future.done():
                    continue
                if entry.give_up <= now:
                    future.set_exception(deadline_spent(("a pipelined command",)))
                    continue
                batch.append(entry)
            self.queued = []
            if not batch:
                continue  # every caller gave up before the write: nothing to send
            deadline = now + self.timeout
            give_up = NEVER
            for entry in batch:
                entry.deadline = deadline
                if entry.give_up < give_up:
                    give_up = entry.give_up
            self.pending.extend(batch)
            if direct is not None:
                direct.write(b"".join([entry.packed for entry in batch]))
                self._written(give_up)
            else:
                await self._write([entry.packed for entry in batch], give_up)

    # -- reading ----------------------------------------------------------------------
    async def _run(self) -> None:
        connection = self.connection
        try:
            await connection.connect()
        except BaseException as exc:
            self.abort(exc, connecting=True)
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
            if not isinstance(exc, Exception):
                raise
            return
        disowned = False
        try:
            # No per-read timer: deadlines are the pipe's own (redis-py bounded the connect
            # and the handshake with the socket timeouts).
            connection.socket_timeout = None
            if not self.pipeline.public:
                self.direct = take_over(connection, self._answer, self.abort)
            self.ready = True
            self._writer = self.loop.create_task(self._write_queued())
            if self.direct is not None:
                # The transport answers the callers (and ends the pipe) itself; this task
                # waits to be cancelled, then disconnects.
                await self.loop.create_future()
            read = connection.read_response
            # The replies the same read brought in are taken without awaiting each.
            buffered = None if self.pipeline.public else buffered_replies(connection)
            while True:
                try:
                    self._answer(await read(disconnect_on_error=False), False)
                # Replies that are whole (the connection stays in step): an error reply,
                # LOADING.
                except (redis_exceptions.ResponseError, redis_exceptions.BusyLoadingError) as error:
                    self._answer(error, True)
                if buffered is not None:
                    while (reply := buffered()) is not NOTHING_BUFFERED:
                        self._answer(reply, isinstance(reply, Exception))
        except GeneratorExit:
            # Its loop closed with the task pending: nothing can be awaited or scheduled.
            self.closed = disowned = True
            raise
        except BaseException as exc:
            self.abort(exc)
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
        finally:
            if not disowned:
                with contextlib.suppress(Exception):
                    await connection.disconnect(nowait=True)

    def _answer(self, reply: Any, failed: bool) -> None:
        """Give the first command in line its reply (``failed``: an error reply)."""
        pending = self.pending
        if not pending:
            raise redis_exceptions.ConnectionError("a reply came for no command")
        self.replies += 1
        entry = pending.popleft()
        if entry.late:
            self.late -= 1
        future = entry.future
        if not future.done():
            if failed:
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def readable(self) -> bool:
        """Whether the kernel holds bytes (or an end of file) the loop has not read yet:
        a zero-timeout ``poll`` of the connection's socket (the fence's
        :func:`~django_quota.backends.redispy_transport.socket_of`). On redis-py's public
        path, where no socket is polled, always True: the caller gives the loop its
        turns."""
        if self.pipeline.public:
            return True
        poller = self._poller
        if poller is None:
            sock = socket_of(self.connection)
            if sock is None:
                return self.connection.is_connected is False
            poller = poller_of(sock)
            if poller is None:
                return bool(sock.fileno() < 0)
            self._poller = poller
        return bool(poller.poll(0))

    # -- deadlines ----------------------------------------------------------------------
    def _arm(self) -> None:
        """One timer per pipe: at the first deadline not yet passed, the first caller's
        ``DEADLINE`` end before it, or the check that a pipe with late commands still
        answers."""
        pending = self.pending
        late = self.late
        when = self._stalled_at if late else NEVER
        if late < len(pending):
            due = pending[late].deadline
            if due < when:
                when = due
            for index in range(late, len(pending)):
                entry = pending[index]
                if entry.give_up < when and not entry.future.done():
                    when = entry.give_up
        self._timer = None if when == NEVER else self.loop.call_at(when, self._due)

    def _due(self) -> None:
        self._timer = None
        if self.closed:
            return
        now = self.loop.time()
        if self.late and now >= self._stalled_at:
            if self.replies == self._stalled_replies:
                error = redis_exceptions.TimeoutError(
                    f"no reply for {self.timeout} s after a late one: connection closed"
                )
                self.abort(error)
                return
            self._stalled_at = now + self.timeout
            self._stalled_replies = self.replies
        if self._due_entries(now):
            # Give the reader its turn first: a reply already received is used.
            self.loop.call_soon(self._recheck, 1)
            return
        self._arm()

    def _due_entries(self, now: float) -> bool:
        """Whether a command is late at ``now``, or a caller's ``DEADLINE`` has ended."""
        pending = self.pending
        late = self.late
        if late < len(pending) and pending[late].deadline <= now:
            return True
        for index in range(late, len(pending)):
            entry = pending[index]
            if entry.give_up <= now and not entry.future.done():
                return True
        return False

    def _recheck(self, turn: int) -> None:
        if self.closed:
            return
        if turn < Pacing.RECHECKS and self.readable():
            self.loop.call_soon(self._recheck, turn + 1)
            return
        now = self.loop.time()
        pending = self.pending
        was_late = self.late
        index = was_late
        while index < len(pending) and pending[index].deadline <= now:
            entry = pending[index]
            entry.late = True
            future = entry.future
            if not future.done():
                future.set_exception(
                    Late(f"no reply within TIMEOUT ({self.timeout} s) of the write")
                )
            index += 1
        self.late = index
        if index > was_late and not was_late:
            self._stalled_at = now + self.timeout
            self._stalled_replies = self.replies
        for waiting in range(index, len(pending)):
            entry = pending[waiting]
            future = entry.future
            if entry.give_up <= now and not future.done():
                # Written, not yet late: its reply is read and dropped when it comes.
                future.set_exception(cut_short(("a pipelined command",)))
        self._arm()

    # -- closing ------------------------------------------------------------------------
    def abort(self, exc: BaseException, *, connecting: bool = False) -> None:
        """Close this pipe for good: its written commands fail as ``indeterminate``, those
        never written as :class:`ConnectFailed` (or with the handshake's error reply)."""
        if self.closed:
            return
        self.closed = True
        self.ready = False
        self.pipeline.forget(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self.pending = self.pending, deque()
        queued, self.queued = self.queued, []
        for entry in pending:
            if not entry.future.done():
                entry.future.set_exception(_broken(exc))
        for entry in queued:
            if not entry.future.done():
                entry.future.set_exception(_unwritten(exc, connecting))
        self._wake_writer()
        current = asyncio.current_task(self.loop)
        for task in (self._reader, self._writer):
            if task is not None and task is not current:
                task.cancel()


def _broken(exc: BaseException) -> BaseException:
    """What a written command's caller gets when its connection broke: a lost connection
    (``indeterminate``: it may have run)."""
    return redis_exceptions.ConnectionError(f"connection lost: {type(exc).__name__}: {exc}")


def _unwritten(exc: BaseException, connecting: bool) -> BaseException:
    """What a command never written gets: :class:`ConnectFailed` (nothing ran), or the
    handshake's error reply itself (the server answered and refused this client)."""
    if connecting and not is_connect_failure(exc) and isinstance(exc, Exception):
        return exc
    if isinstance(exc, ConnectFailed):
        return exc
    cause = exc if isinstance(exc, Exception) else redis_exceptions.ConnectionError("closed")
    return ConnectFailed(cause)


class Pipeline:
    """The pipelined connections of one event loop to one node; see the module's text.

    ``make_connection`` makes a new, unconnected redis-py asyncio connection (a pool's
    ``make_connection``); ``timeout`` is ``TIMEOUT``. ``public``: redis-py's public path
    (``docs/settings.md``, ``REDIS_PUBLIC_PATH``), where no socket is polled: an idle
    connection is written on after ``Pacing.SETTLE_TURNS`` turns of the loop, and a deadline
    always gives the reader ``Pacing.RECHECKS`` turns.
    """

    def __init__(
        self,
        make_connection: Callable[[], Any],
        timeout: float,
        owner: Any = None,
        *,
        public: bool = False,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.public = public
        self.make_connection = make_connection
        self.timeout = timeout
        self._pack: Callable[[tuple[Any, ...]], bytes] = pack_command or self._redis_pack
        self._packer: Any = None
        #: What must live as long as the connections (the redis-py client of the pool).
        self.owner = owner
        self.pipes: list[Pipe] = []
        #: Connections opened so far.
        self.opened = 0

    def forget(self, pipe: Pipe) -> None:
        """Drop a closed pipe."""
        with contextlib.suppress(ValueError):
            self.pipes.remove(pipe)

    def _choose(self) -> Pipe:
        pipes = self.pipes
        if len(pipes) == Pacing.CONNECTIONS == 1:
            pipe = pipes[0]
            if pipe.pending and not pipe.late:  # busy and answering: it takes the command
                return pipe
        best: Pipe | None = None
        best_load = 0
        usable = 0
        for pipe in list(self.pipes):
            if pipe.late:
                continue
            if usable == Pacing.CONNECTIONS:
                # A spare, opened while those before it had a late command: kept for the
                # next one, not given commands beside them (spreading gains nothing).
                break
            load = pipe.load
            if not load:
                if pipe.ready and not self.public and pipe.readable():
                    # Idle, yet the kernel holds something: the server closed it (or sent
                    # stray bytes) while the loop did not run. Nothing is written on it.
                    pipe.abort(redis_exceptions.ConnectionError("closed by the server"))
                    continue
                return pipe
            usable += 1
            if best is None or load < best_load:
                best, best_load = pipe, load
        if (
            (best is None or best_load >= Pacing.SPREAD)
            and usable < Pacing.CONNECTIONS
            and len(self.pipes) < Pacing.MAX_CONNECTIONS
        ):
            self.opened += 1
            pipe = Pipe(self, self.make_connection())
            self.pipes.append(pipe)
            return pipe
        if best is None:
            raise ConnectFailed(
                redis_exceptions.TimeoutError(
                    "every connection to the node has a command past TIMEOUT"
                )
            )
        return best

    def _redis_pack(self, command: tuple[Any, ...]) -> bytes:
        """redis-py's packer (without hiredis), on a connection never connected."""
        packer = self._packer
        if packer is None:
            packer = self._packer = self.make_connection()
        return b"".join(packer.pack_command(*command))

    async def execute(self, command: tuple[Any, ...], deadline: float | None = None) -> Any:
        """Send ``command`` on one of the loop's connections to the node; its reply.
        ``deadline`` (``time.monotonic()`` seconds): when the evaluation's ``DEADLINE``
        ends; the command is not written after it, nor its reply awaited past it."""
        give_up = NEVER
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise deadline_spent(command)
            give_up = self.loop.time() + left
        pipe = self._choose()
        if self.public and pipe.ready and not pipe.load:
            # Nothing polls the socket: the loop's turns read an end of file the server
            # sent an idle connection, whose reader then closes it (nothing written).
            for _ in range(Pacing.SETTLE_TURNS):
                await asyncio.sleep(0)
            if pipe.closed:
                pipe = self._choose()
        future: asyncio.Future[Any] = self.loop.create_future()
        entry = _Entry(future, self._pack(command), give_up)
        if not pipe.queue(entry):
            direct = pipe.direct
            if direct is None:
                await pipe.send(entry)
            else:
                pipe.send_direct(direct, entry)
        try:
            return await future
        except Late as exc:
            raise Late(f"{exc}: {command[0]}") from None

    def close(self) -> None:
        """Close every connection (in the loop's thread): their commands fail."""
        for pipe in list(self.pipes):
            pipe.abort(redis_exceptions.ConnectionError("the backend was closed"))

    def connections(self) -> list[Any]:
        """The redis-py connections held now."""
        return [pipe.connection for pipe in self.pipes]
