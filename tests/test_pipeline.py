"""Async decisions pipelined on one connection per event loop and node
(``django_quota/backends/pipeline.py``, docs/failures.md "Connections"), on real
redis-servers started here: a cold burst needs no connection per decision, async views
under WSGI reuse the process's connections, a reply received while the loop was busy is
used, and a late reply is read and dropped without costing its connection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio.connection as async_connection
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path
from redis.utils import HIREDIS_AVAILABLE

import django_quota
from django_quota import limiter
from django_quota.backends import clients, redispy_transport, scripting
from django_quota.backends import pipeline as pipeline_module
from django_quota.backends.redispy import public_path
from django_quota.decorators import quota as quota_view
from tests.faults import RedisProcess, free_port, redis_process

pytestmark = pytest.mark.redis

SUBJECT = {"ip": "192.0.2.60"}
#: Connections' transports answer the pipeline's callers themselves (hiredis, and not
#: redis-py's public path: ``redispy_transport.take_over``).
PUBLIC = public_path()
DIRECT = HIREDIS_AVAILABLE and not PUBLIC
needs_direct = pytest.mark.skipif(
    not DIRECT, reason="a transport is taken over only with hiredis, off the public path"
)


@quota_view(rate="1000/h", algorithm="fixed_window", selector="ip")
async def limited_async(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async ok")


urlpatterns = [path("limited-async/", limited_async)]


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    with redis_process() as started:
        yield started


@pytest.fixture
def pipelined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every loop gets pipelined connections from its first decision (no worker thread)."""
    monkeypatch.setattr(clients, "PIPELINE_AFTER", 0)


def connections_received(server: RedisProcess) -> int:
    """``total_connections_received`` of ``server``, read on a connection of its own
    (counted: each read adds one)."""
    with contextlib.closing(server.client()) as admin:
        return int(admin.info("stats")["total_connections_received"])


def configure(quota: Any, server: RedisProcess, limit: int = 1000, **extra: Any) -> None:
    quota(
        REDIS_URL=server.url,
        FAILURE_MODE="closed",
        LOCAL_FALLBACK={"ENABLED": False},
        POLICIES={"p": {"algorithm": "fixed_window", "windows": f"{limit}/h", "selector": ["ip"]}},
        **extra,
    )


def counting_reads(cls: type[Any]) -> tuple[list[int], Any]:
    """A one-element list counting the calls, and a ``read_response`` that counts each
    call of ``cls``'s in it."""
    reads = [0]
    read_response = cls.read_response

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        reads[0] += 1
        return await read_response(self, *args, **kwargs)

    return reads, counted


def breaker_failures() -> int:
    return sum(guard.breaker._failures for guard in limiter.get_limiter().guards().values())


# -- a cold burst -----------------------------------------------------------------------------
def test_a_cold_burst_of_1000_is_decided_exactly_on_at_most_8_connections(
    quota: Any, server: RedisProcess
) -> None:
    limit = 100
    configure(quota, server, limit, TIMEOUT=1.0, DEADLINE=10.0)
    before = connections_received(server)

    async def burst() -> list[Any]:
        calls = [django_quota.aevaluate("p", SUBJECT) for _ in range(1000)]
        return await asyncio.gather(*calls)

    outcomes = asyncio.run(burst())
    opened = connections_received(server) - before - 1  # the second admin read
    decisions = [outcome.decision for outcome in outcomes]
    assert decisions.count("allowed") == limit
    assert decisions.count("denied") == 1000 - limit
    assert [o.reason for o in outcomes if o.decision not in ("allowed", "denied")] == []
    assert 1 <= opened <= 8, opened
    assert list(limiter.get_limiter().recent_errors) == []


# -- async views under WSGI --------------------------------------------------------------------
@pytest.mark.urls(__name__)
def test_async_views_under_wsgi_reuse_the_process_connections(
    quota: Any, server: RedisProcess
) -> None:
    quota(REDIS_URL=server.url)
    client = Client(REMOTE_ADDR="192.0.2.61")
    before = connections_received(server)
    remaining = []
    for _ in range(200):
        response = client.get("/limited-async/")  # WSGI: each async view in a new loop
        assert response.status_code == 200
        (outcome,) = django_quota.outcomes(response.wsgi_request)
        remaining.append(outcome.remaining)
    opened = connections_received(server) - before - 1
    assert remaining == list(range(999, 799, -1))
    assert opened <= 20, opened


def test_loops_that_decide_once_each_open_no_connection_each(
    quota: Any, server: RedisProcess
) -> None:
    configure(quota, server)
    before = connections_received(server)
    outcomes = [asyncio.run(django_quota.aevaluate("p", SUBJECT)) for _ in range(100)]
    opened = connections_received(server) - before - 1
    assert [o.remaining for o in outcomes] == list(range(999, 899, -1))
    assert opened <= 2, opened
    assert limiter.get_backend().async_client_count == 0  # type: ignore[attr-defined]


# -- deadlines ---------------------------------------------------------------------------------
def test_a_reply_received_while_the_loop_was_busy_past_timeout_is_used(
    quota: Any, server: RedisProcess, pipelined: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop is blocked (a synchronous sleep) for three ``TIMEOUT`` right after the
    write; Redis answers at once. The reply is there when the deadline fires: it decides,
    and the node's breaker counts nothing."""
    configure(quota, server, TIMEOUT=0.2, DEADLINE=0.3)
    written = pipeline_module.Pipe._written
    blocked = []

    def written_then_block(self: Any, give_up: float) -> None:
        written(self, give_up)  # the command is on its way, the deadline timer armed
        blocked.append(self.direct is not None)
        time.sleep(0.6)  # the event loop is busy elsewhere

    async def scenario() -> Any:
        assert (await django_quota.aevaluate("p", SUBJECT)).remaining == 999  # connected
        monkeypatch.setattr(pipeline_module.Pipe, "_written", written_then_block)
        return await django_quota.aevaluate("p", SUBJECT)

    outcome = asyncio.run(scenario())
    assert (outcome.decision, outcome.reason, outcome.remaining) == ("allowed", None, 998)
    # The connection's transport answered the caller itself, except on the public path
    # or without hiredis (the reader task then read the reply).
    assert blocked == [DIRECT]
    assert breaker_failures() == 0
    assert list(limiter.get_limiter().recent_errors) == []


def test_a_late_reply_is_read_and_dropped_and_the_connection_serves_the_next(
    quota: Any, server: RedisProcess, pipelined: None
) -> None:
    """``EVALSHA`` held by ``CLIENT PAUSE`` past ``TIMEOUT``: ``indeterminate``. Its reply
    comes later, on the same connection; it is read and dropped, and the next decision on
    that connection reads its own reply (the late script ran: 997, not 998)."""
    configure(quota, server, TIMEOUT=0.5, DEADLINE=0.6)
    admin = server.client()
    admin.ping()  # connected before the count

    async def scenario() -> tuple[Any, Any, int]:
        assert (await django_quota.aevaluate("p", SUBJECT)).remaining == 999
        opened = connections_received(server)
        admin.client_pause(750, all=False)  # WRITE: holds the EVALSHA, not the handshake
        late = await django_quota.aevaluate("p", SUBJECT)
        await asyncio.sleep(0.6)  # the paused script runs; its reply is read and dropped
        after = await django_quota.aevaluate("p", SUBJECT)
        return late, after, connections_received(server) - opened - 1

    try:
        late, after, opened = asyncio.run(scenario())
    finally:
        admin.close()
    assert (late.decision, late.reason) == ("failed_closed", "indeterminate")
    assert (after.decision, after.reason, after.remaining) == ("allowed", None, 997)
    assert opened == 0  # the same connection answered


def test_a_connection_silent_after_a_late_reply_is_closed_and_replaced(
    quota: Any, server: RedisProcess, pipelined: None
) -> None:
    configure(quota, server, TIMEOUT=0.2, DEADLINE=0.25)
    admin = server.client()

    async def scenario() -> tuple[Any, list[Any], Any]:
        assert (await django_quota.aevaluate("p", SUBJECT)).remaining == 999
        pipeline = limiter.get_backend()._async()  # type: ignore[attr-defined]
        (first,) = pipeline.pipes
        admin.client_pause(1500, all=False)
        late = await django_quota.aevaluate("p", SUBJECT)
        await asyncio.sleep(0.6)  # silent for TIMEOUT after the late one: closed
        closed = [first.closed, first in pipeline.pipes]
        await asyncio.sleep(1.0)  # the pause is over
        return late, closed, await django_quota.aevaluate("p", SUBJECT)

    try:
        late, closed, after = asyncio.run(scenario())
    finally:
        admin.close()
    assert late.reason == "indeterminate"
    assert closed == [True, False]
    # Whether the paused script ran once its client was gone is not knowable from here.
    assert (after.decision, after.reason) == ("allowed", None)
    assert after.remaining in (997, 998)


# -- one connection, many callers --------------------------------------------------------------
def test_a_cancelled_caller_reply_is_read_and_dropped(
    server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller cancelled after its write: its reply is still read (and dropped), so the
    next command on the connection reads its own."""
    monkeypatch.setattr(pipeline_module.Pacing, "CONNECTIONS", 1)
    slow = (
        "local s = redis.call('TIME') local n repeat n = redis.call('TIME') until "
        "(n[1] - s[1]) * 1000000 + (n[2] - s[2]) > 200000 return 'first'"
    )

    async def scenario() -> tuple[Any, int]:
        pool = redis.asyncio.ConnectionPool.from_url(server.url, protocol=2)
        pipeline = pipeline_module.Pipeline(pool.make_connection, 2.0)
        assert await pipeline.execute(("PING",)) == b"PONG"
        call = asyncio.ensure_future(pipeline.execute(("EVAL", slow, 0)))
        await asyncio.sleep(0.05)  # written, its reply not there yet
        call.cancel()
        second = await pipeline.execute(("ECHO", "second"))
        pipeline.close()
        return second, pipeline.opened

    assert asyncio.run(scenario()) == (b"second", 1)


def test_concurrent_commands_share_a_few_connections_and_error_replies_stay_their_own(
    server: RedisProcess,
) -> None:
    async def scenario() -> tuple[list[Any], int]:
        pool = redis.asyncio.ConnectionPool.from_url(server.url, protocol=2)
        pipeline = pipeline_module.Pipeline(pool.make_connection, 2.0)
        commands = [("ECHO", str(i)) if i % 7 else ("EVALSHA", "0" * 40, 0) for i in range(200)]
        replies = await asyncio.gather(
            *(pipeline.execute(c) for c in commands), return_exceptions=True
        )
        opened = pipeline.opened
        pipeline.close()
        return replies, opened

    replies, opened = asyncio.run(scenario())
    for i, reply in enumerate(replies):
        if i % 7:
            assert reply == str(i).encode()
        else:
            assert isinstance(reply, redis.exceptions.NoScriptError)
    assert 1 <= opened <= pipeline_module.Pacing.CONNECTIONS


def test_replies_read_together_need_no_awaited_read_each(
    server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replies one read brings in are taken from hiredis's buffer in one go
    (``redispy_transport.buffered_replies``), each to its own caller in order, an error reply
    among them to its caller only: 200 commands written together cost far fewer
    awaited ``read_response`` calls than replies. (A connection whose ``read_response``
    is not redis-py's own, as here, is read by the reader task, never taken over.)"""
    reads, counted = counting_reads(async_connection.Connection)
    monkeypatch.setattr(async_connection.Connection, "read_response", counted)

    async def scenario() -> list[Any]:
        pool = redis.asyncio.ConnectionPool.from_url(server.url, protocol=2)
        pipeline = pipeline_module.Pipeline(pool.make_connection, 2.0)
        await pipeline.execute(("PING",))  # connected: the 200 go out in one write
        commands = [("ECHO", str(i)) if i % 7 else ("EVALSHA", "0" * 40, 0) for i in range(200)]
        replies = await asyncio.gather(
            *(pipeline.execute(c) for c in commands), return_exceptions=True
        )
        pipeline.close()
        return replies

    awaited_before = reads[0]
    replies = asyncio.run(scenario())
    for i, reply in enumerate(replies):
        if i % 7:
            assert reply == str(i).encode()
        else:
            assert isinstance(reply, redis.exceptions.NoScriptError)
    if HIREDIS_AVAILABLE:
        # 201 replies; each read of the socket brings in many (64 KiB at most per read).
        assert 1 <= reads[0] - awaited_before <= 20
    else:  # redis-py's own parser: one awaited read a reply (docs/failures.md)
        assert reads[0] - awaited_before >= 201


def test_a_loops_concurrent_commands_share_one_connection(server: RedisProcess) -> None:
    """Redis runs one command at a time: 64 callers of one loop gain nothing from more
    connections, each of which costs the server a read and a write a turn. One connection
    takes them all, and the server sees one new connection."""

    async def scenario() -> tuple[list[Any], int, int]:
        pool = redis.asyncio.ConnectionPool.from_url(server.url, protocol=2)
        pipeline = pipeline_module.Pipeline(pool.make_connection, 2.0)

        async def caller(index: int) -> list[Any]:
            return [await pipeline.execute(("ECHO", f"{index}.{i}")) for i in range(20)]

        replies = await asyncio.gather(*(caller(index) for index in range(64)))
        opened, held = pipeline.opened, len(pipeline.pipes)
        pipeline.close()
        return replies, opened, held

    before = connections_received(server)
    replies, opened, held = asyncio.run(scenario())
    assert replies == [[f"{index}.{i}".encode() for i in range(20)] for index in range(64)]
    assert (opened, held) == (1, 1)
    # The pipeline's one connection, and the read of the count itself.
    assert connections_received(server) - before == 2


def test_after_a_late_reply_one_connection_takes_the_loops_commands_again(
    server: RedisProcess,
) -> None:
    """A late command sends the next ones to a second connection; once its reply came,
    the loop's commands go to one connection again, not spread over both (the other is
    kept for the next late command: no new connection opened then either)."""
    slow = (
        "local s = redis.call('TIME') local n repeat n = redis.call('TIME') until "
        "(n[1] - s[1]) * 1000000 + (n[2] - s[2]) > 300000 return 'slow'"
    )

    async def scenario() -> tuple[int, list[int], int]:
        pool = redis.asyncio.ConnectionPool.from_url(server.url, protocol=2)
        pipeline = pipeline_module.Pipeline(pool.make_connection, 0.2)
        assert await pipeline.execute(("PING",)) == b"PONG"
        for _ in range(2):
            late = asyncio.ensure_future(pipeline.execute(("EVAL", slow, 0)))
            await asyncio.sleep(0.25)  # past TIMEOUT: late
            assert await pipeline.execute(("PING",)) == b"PONG"  # on another connection
            with pytest.raises(pipeline_module.Late):
                await late
            await asyncio.sleep(0.2)  # the late reply came and was dropped
        held = len(pipeline.pipes)
        before = [pipe.replies for pipe in pipeline.pipes]

        async def caller(index: int) -> None:
            for i in range(20):
                assert await pipeline.execute(("ECHO", f"{index}.{i}")) == f"{index}.{i}".encode()

        await asyncio.gather(*(caller(index) for index in range(64)))
        replies = [pipe.replies - count for pipe, count in zip(pipeline.pipes, before, strict=True)]
        opened = pipeline.opened
        pipeline.close()
        return held, replies, opened

    held, replies, opened = asyncio.run(scenario())
    assert (held, opened) == (2, 2)
    assert sorted(replies) == [0, 64 * 20]


def test_a_broken_connection_fails_written_commands_as_lost_and_the_rest_as_unwritten(
    server: RedisProcess,
) -> None:
    """Written commands whose connection breaks may have run (a connection error:
    ``indeterminate``); commands never written are ``ConnectFailed`` (nothing ran)."""
    slow = (
        "local s = redis.call('TIME') local n repeat n = redis.call('TIME') until "
        "(n[1] - s[1]) * 1000000 + (n[2] - s[2]) > 300000 return 'done'"
    )

    async def scenario() -> tuple[Any, Any]:
        pool = redis.asyncio.ConnectionPool.from_url(server.url, protocol=2)
        pipeline = pipeline_module.Pipeline(pool.make_connection, 5.0)
        assert await pipeline.execute(("PING",)) == b"PONG"
        (pipe,) = pipeline.pipes
        written = asyncio.ensure_future(pipeline.execute(("EVAL", slow, 0)))
        await asyncio.sleep(0.05)
        entry = pipeline_module._Entry(asyncio.get_running_loop().create_future(), b"")
        pipe.queued.append(entry)  # as if it came while a write was under way
        pipe.abort(redis.exceptions.ConnectionError("reset by peer"))
        results = await asyncio.gather(written, entry.future, return_exceptions=True)
        return results[0], results[1]

    written, unwritten = asyncio.run(scenario())
    assert type(written) is redis.exceptions.ConnectionError  # lost: it may have run
    assert isinstance(unwritten, scripting.ConnectFailed)
    assert scripting.classify(written).reason == "indeterminate"
    assert scripting.classify(unwritten).reason == "backend_unavailable"


def test_noscript_is_recovered_on_the_pipelined_path(
    quota: Any, server: RedisProcess, pipelined: None
) -> None:
    configure(quota, server)
    admin = server.client()

    async def scenario() -> list[Any]:
        first = await django_quota.aevaluate("p", SUBJECT)
        admin.script_flush()
        burst = await asyncio.gather(*(django_quota.aevaluate("p", SUBJECT) for _ in range(20)))
        return [first, *burst]

    try:
        outcomes = asyncio.run(scenario())
    finally:
        admin.close()
    assert sorted(o.remaining for o in outcomes) == list(range(979, 1000))
    assert {(o.decision, o.reason) for o in outcomes} == {("allowed", None)}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_uses_the_parent_pipelined_connections(
    quota: Any, server: RedisProcess, pipelined: None
) -> None:
    configure(quota, server)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(django_quota.aevaluate("p", SUBJECT)).remaining == 999
        backend = limiter.get_backend()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the same loop object, but none of the parent's sockets
            code = 1
            try:
                held = backend.async_client_count  # type: ignore[attr-defined]
                outcome = loop.run_until_complete(django_quota.aevaluate("p", SUBJECT))
                os.write(write, f"{held} {outcome.decision} {outcome.remaining}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        reported = os.read(read, 100).decode()
        os.close(read)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert reported == "0 allowed 998"
        # The parent's connection still works: the child never wrote on its socket.
        assert loop.run_until_complete(django_quota.aevaluate("p", SUBJECT)).remaining == 997
    finally:
        limiter.get_backend().close()
        loop.run_until_complete(asyncio.sleep(0.01))  # the pipeline closes in its loop
        loop.close()


# -- the transport taken over (redispy_transport.take_over) ----------------------------------
async def connected_pipeline(
    url: str, timeout: float, **options: Any
) -> tuple[pipeline_module.Pipeline, pipeline_module.Pipe]:
    """A pipeline on ``url`` as the backends make one, its one connection connected."""
    pool = redis.asyncio.ConnectionPool.from_url(url, protocol=2, **options)
    pipeline = pipeline_module.Pipeline(pool.make_connection, timeout, public=PUBLIC)
    assert await pipeline.execute(("PING",)) == b"PONG"
    (pipe,) = pipeline.pipes
    return pipeline, pipe


async def echoed(pipeline: pipeline_module.Pipeline, index: int, big: str, every: int) -> bool:
    """Whether ``ECHO`` of a value made of ``index`` (and ``big`` for every ``every``-th
    one) came back as its own reply."""
    value = f"{index}:{big if index % every == 0 else ''}"
    return bool(await pipeline.execute(("ECHO", value)) == value.encode())


def count_turns(loop: asyncio.AbstractEventLoop) -> list[int]:
    """A one-element list counting the turns of ``loop`` (its selector's ``select``
    calls) from now on."""
    turns = [0]
    selector = loop._selector  # type: ignore[attr-defined]
    select = selector.select

    def counted(timeout: float | None = None) -> Any:
        turns[0] += 1
        return select(timeout)

    selector.select = counted
    return turns


@needs_direct
def test_a_reply_reaches_its_caller_in_the_turn_that_reads_it(server: RedisProcess) -> None:
    """One caller, one command at a time: the turn of the loop that reads a reply hands it
    to the caller, whose task runs in the next. Two turns a command (the reader task of
    the public path adds a third), and no ``read_response`` after the handshake."""
    read_response = async_connection.AbstractConnection.read_response
    reads, counted_read = counting_reads(async_connection.AbstractConnection)

    async def scenario() -> tuple[list[Any], int, int]:
        pipeline, pipe = await connected_pipeline(server.url, 2.0)
        # Patched on the class the check looks at, after the take-over: what redis-py
        # reads from now on is counted.
        async_connection.AbstractConnection.read_response = counted_read  # type: ignore[method-assign]
        reads[0] = 0
        turns = count_turns(asyncio.get_running_loop())
        replies = [await pipeline.execute(("ECHO", str(i))) for i in range(100)]
        taken = turns[0]
        assert pipe.direct is not None
        pipeline.close()
        return replies, taken, reads[0]

    try:
        replies, taken, read = asyncio.run(scenario())
    finally:
        async_connection.AbstractConnection.read_response = read_response  # type: ignore[method-assign]
    assert replies == [str(i).encode() for i in range(100)]
    assert read == 0
    assert taken <= 2 * 100 + 2, taken  # a deadline timer's turn or two at most


@needs_direct
def test_writes_wait_for_a_full_transport_to_drain(
    server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commands larger than the transport's buffer: the transport says it is full
    (``pause_writing``), the pipe's writer waits until it drained before writing the
    next batch, and every caller gets its own reply."""
    paused = 0
    pause_writing = redispy_transport.DirectReplies.pause_writing

    def counted_pause(self: Any) -> None:
        nonlocal paused
        paused += 1
        pause_writing(self)

    monkeypatch.setattr(redispy_transport.DirectReplies, "pause_writing", counted_pause)
    big = "x" * 2_000_000

    async def scenario() -> tuple[list[bool], bool]:
        pipeline, pipe = await connected_pipeline(server.url, 10.0)
        # Two waves: the second is queued while the first is still being written.
        first = [asyncio.ensure_future(echoed(pipeline, i, big, 4)) for i in range(40)]
        await asyncio.sleep(0)
        second = [asyncio.ensure_future(echoed(pipeline, i, big, 4)) for i in range(40, 80)]
        answers = await asyncio.gather(*first, *second)
        direct = pipe.direct is not None and not pipe.direct.paused
        pipeline.close()
        return answers, direct

    answers, direct = asyncio.run(scenario())
    assert answers == [True] * 80
    assert direct
    assert paused >= 1


@needs_direct
def test_a_server_gone_mid_command_fails_it_as_lost_on_a_taken_transport(
    server: RedisProcess,
) -> None:
    """The server dies (SIGKILL) while a command is in flight: the transport's end fails
    it as lost (``indeterminate``), the pipe closes and its connection is disconnected."""
    slow = (
        "local s = redis.call('TIME') local n repeat n = redis.call('TIME') until "
        "(n[1] - s[1]) * 1000000 + (n[2] - s[2]) > 500000 return 'done'"
    )

    async def scenario() -> tuple[Any, bool, bool, bool]:
        pipeline, pipe = await connected_pipeline(server.url, 5.0)
        direct = pipe.direct is not None
        written = asyncio.ensure_future(pipeline.execute(("EVAL", slow, 0)))
        await asyncio.sleep(0.05)
        server.kill()
        (result,) = await asyncio.gather(written, return_exceptions=True)
        for _ in range(5):
            await asyncio.sleep(0)  # the reader task disconnects
        return result, direct, pipe.closed, pipe.connection.is_connected

    result, direct, closed, connected = asyncio.run(scenario())
    assert direct
    assert isinstance(result, redis.exceptions.ConnectionError)
    assert not isinstance(result, scripting.ConnectFailed)
    assert scripting.classify(result).reason == "indeterminate"
    assert (closed, connected) == (True, False)


class _OwnReadResponse(async_connection.Connection):
    """A connection class with a ``read_response`` of its own (as a Sentinel connection,
    which turns ``READONLY`` into a reconnect, has)."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        return await super().read_response(*args, **kwargs)


@pytest.mark.parametrize(
    ("options", "taken"),
    [
        ({"protocol": 2}, DIRECT),
        ({"protocol": 3}, False),  # RESP3: push frames are read_response's to skip
        ({"protocol": 2, "connection_class": _OwnReadResponse}, False),
    ],
    ids=["resp2", "resp3", "own-read-response"],
)
def test_only_redis_pys_own_resp2_reads_are_taken_over(
    server: RedisProcess, options: dict[str, Any], taken: bool
) -> None:
    async def scenario() -> tuple[list[Any], bool]:
        pool = redis.asyncio.ConnectionPool.from_url(server.url, **options)
        pipeline = pipeline_module.Pipeline(pool.make_connection, 2.0, public=PUBLIC)
        replies = await asyncio.gather(
            *(
                pipeline.execute(("ECHO", str(i)) if i % 3 else ("EVALSHA", "0" * 40, 0))
                for i in range(30)
            ),
            return_exceptions=True,
        )
        replies.append(await pipeline.execute(("PING",)))
        (pipe,) = pipeline.pipes
        direct = pipe.direct is not None
        pipeline.close()
        return replies, direct

    replies, direct = asyncio.run(scenario())
    assert direct is taken
    for i, reply in enumerate(replies[:30]):
        if i % 3:
            assert reply == str(i).encode()
        else:
            assert isinstance(reply, redis.exceptions.NoScriptError)
    assert replies[30] in (b"PONG", "PONG", True)


def _self_signed(directory: str) -> tuple[str, str] | None:
    """A certificate and key for 127.0.0.1 made by ``openssl`` in ``directory``, or None."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    try:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                key,
                "-out",
                cert,
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return cert, key


def test_tls_connections_are_pipelined_and_their_transport_taken_over(
    tmp_path: Any,
) -> None:
    """A ``rediss://`` connection: redis-py's TLS handshake, then the same pipelining on
    asyncio's TLS transport (taken over where hiredis is), large commands included."""
    made = _self_signed(str(tmp_path))
    if made is None:
        pytest.skip("openssl cannot make a certificate here")
    cert, key = made
    tls_port = free_port()
    tls = (
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key,
        "--tls-ca-cert-file",
        cert,
        "--tls-auth-clients",
        "no",
    )
    big = "y" * 1_000_000

    async def scenario() -> tuple[list[bool], bool, bool]:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        pipeline, pipe = await connected_pipeline(url, 10.0, ssl_ca_certs=cert)
        answers = list(await asyncio.gather(*(echoed(pipeline, i, big, 10) for i in range(50))))
        answers.append(await pipeline.execute(("ECHO", "last")) == b"last")
        direct = pipe.direct is not None
        pipeline.close()
        for _ in range(5):
            await asyncio.sleep(0)
        return answers, direct, pipe.connection.is_connected

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(redis_process(*tls))
        except RuntimeError as exc:  # a redis-server built without TLS refuses the options
            pytest.skip(f"redis-server without TLS: {exc}")
        answers, direct, connected = asyncio.run(scenario())
    assert answers == [True] * 51
    assert direct is DIRECT
    assert connected is False


def _hiredis_reader() -> Any:
    """A hiredis reader made as redis-py's asyncio parser makes it (``on_connect``)."""
    import hiredis
    from redis._parsers.base import BaseParser

    return hiredis.Reader(
        protocolError=redis.exceptions.InvalidResponse,
        replyError=BaseParser.parse_error,
        notEnoughData=redispy_transport.NOTHING_BUFFERED,
    )


class _Transport:
    """Enough of an asyncio transport for :class:`~redispy_transport.DirectReplies` alone."""

    def __init__(self) -> None:
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


#: A script reply whose head is ``LOADING`` (redis-py's ``read_response`` raises it, and
#: the pipe answers its caller with it, keeping the connection), then an integer reply.
NESTED_LOADING = b"*1\r\n-LOADING nested\r\n:1\r\n"


@pytest.mark.skipif(not HIREDIS_AVAILABLE, reason="the fast paths read hiredis's buffer")
def test_a_nested_loading_reply_fails_only_its_caller_on_every_read_path() -> None:
    """``LOADING`` at the head of a script's reply is a whole error reply on the
    transport taken over and on the buffered replies, as ``read_response`` treats it:
    its caller fails with it, the connection stays, the next reply reaches its caller."""
    answers: list[tuple[Any, bool]] = []
    lost: list[BaseException] = []
    transport = _Transport()
    loop = asyncio.new_event_loop()
    try:
        direct = redispy_transport.DirectReplies(
            transport,  # type: ignore[arg-type]
            _hiredis_reader(),
            asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), loop=loop),
            lambda reply, failed: answers.append((reply, failed)),
            lost.append,
        )
        direct.data_received(NESTED_LOADING)
    finally:
        loop.close()
    assert [(type(reply).__name__, failed) for reply, failed in answers] == [
        ("BusyLoadingError", True),
        ("int", False),
    ]
    assert (lost, transport.closed) == ([], False)

    connection = async_connection.Connection(protocol=2)  # RESP2, as the backends ask
    reader = connection._parser._reader = _hiredis_reader()  # as on_connect sets it
    reader.feed(NESTED_LOADING)
    buffered = redispy_transport.buffered_replies(connection)
    assert buffered is not None
    first, second = buffered(), buffered()
    assert (type(first).__name__, second, buffered()) == (
        "BusyLoadingError",
        1,
        redispy_transport.NOTHING_BUFFERED,
    )
