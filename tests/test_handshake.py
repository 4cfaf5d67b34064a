"""A new connection writes its handshake in one write (``backends/handshake.py``), so
that a Redis at ``maxclients``, which writes its refusal and closes, is read as a
refusal on every connection class the backends make, sync and asyncio, standalone,
Sentinel and cluster node: redis-py wrote the handshake's commands one after the other,
and the second write failed with a broken pipe, the refusal unread. Real servers on
loopback (tests/faults.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as redis_asyncio
from redis.asyncio import connection as async_connection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection

from django_quota.backends.clients import client_options
from django_quota.backends.failures import ConnectFailed, classify
from django_quota.backends.handshake import (
    AsyncOneWriteHandshake,
    AsyncOneWriteHandshakePool,
    OneWriteHandshake,
    one_write_handshake,
)
from django_quota.backends.redis import (
    AsyncSentinelPool,
    MarkingConnectionPool,
    MarkingSentinelConnectionPool,
    PublicMarkingConnectionPool,
)
from django_quota.backends.redispy import AsyncMarkingClusterConnection
from django_quota.core.errors import Label
from tests.faults import redis_process
from tests.test_blame import at_maxclients

#: New connections tried per connection class at maxclients.
ATTEMPTS = 20


#: What a connection's own attributes replace while its handshake is held.
HELD = {"send_packed_command", "read_response"}
#: The handshake's commands when the URL names a client and a database.
HANDSHAKE = (b"SETNAME", b"LIB-NAME", b"LIB-VER", b"SELECT")


def recorded(
    monkeypatch: pytest.MonkeyPatch, base: type[Any], asynchronous: bool
) -> list[bytes | None]:
    """What redis-py's connection class ``base`` does on the socket, in order: each write
    (its bytes, joined) and each reply read (None)."""
    events: list[bytes | None] = []
    write: Callable[..., Any] = base.send_packed_command
    read: Callable[..., Any] = base.read_response

    def joined(command: Any) -> bytes:
        return command if isinstance(command, bytes) else b"".join(command)

    if asynchronous:

        async def async_write(self: Any, command: Any, check_health: bool = True) -> None:
            events.append(joined(command))
            await write(self, command, check_health)

        async def async_read(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(None)
            return await read(self, *args, **kwargs)

        monkeypatch.setattr(base, "send_packed_command", async_write)
        monkeypatch.setattr(base, "read_response", async_read)
    else:

        def sync_write(self: Any, command: Any, check_health: bool = True) -> None:
            events.append(joined(command))
            write(self, command, check_health)

        def sync_read(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(None)
            return read(self, *args, **kwargs)

        monkeypatch.setattr(base, "send_packed_command", sync_write)
        monkeypatch.setattr(base, "read_response", sync_read)
    return events


def assert_never_two_writes_unanswered(events: list[bytes | None]) -> None:
    """Every write of the handshake is followed by a read before the next write: a
    refusal waiting in the socket is read, never written over. (redis-py 8.2 wrote
    SETNAME, SETINFO twice and SELECT, then read; its asyncio connection SETINFO twice
    and SELECT, in every redis-py 8.)"""
    written = [event for event in events if event is not None]
    assert written, events
    for command in HANDSHAKE:
        assert sum(command in write for write in written) == 1, (command, events)
    for before, after in itertools.pairwise(events):
        assert before is None or after is None, f"two writes unanswered: {events}"


@pytest.mark.redis
def test_no_handshake_write_follows_another_unanswered(monkeypatch: pytest.MonkeyPatch) -> None:
    with redis_process() as server:
        events = recorded(monkeypatch, AbstractConnection, asynchronous=False)
        connection = one_write_handshake(redis.Connection)(
            port=server.port, db=1, client_name="quota-handshake", protocol=2
        )
        connection.connect()
        assert_never_two_writes_unanswered(events)
        assert not HELD & set(vars(connection))  # after the handshake, redis-py's methods
        # Every reply was read: the connection is in step, named, on database 1.
        connection.send_command("CLIENT", "GETNAME")
        assert connection.read_response() == b"quota-handshake"
        connection.send_command("SET", "k", "v")
        connection.send_command("SET", "k2", "v2")  # not held: the handshake is over
        assert events[-2:] == [
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n",
            b"*3\r\n$3\r\nSET\r\n$2\r\nk2\r\n$2\r\nv2\r\n",
        ]
        assert [connection.read_response(), connection.read_response()] == [b"OK", b"OK"]
        assert server.client(db=1).get("k2") == b"v2"
        connection.disconnect()


@pytest.mark.redis
def test_no_async_handshake_write_follows_another_unanswered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with redis_process() as server:
        events = recorded(monkeypatch, async_connection.AbstractConnection, asynchronous=True)

        async def scenario() -> Any:
            connection = one_write_handshake(redis_asyncio.Connection)(
                port=server.port, db=1, client_name="quota-handshake", **async_options()
            )
            await connection.connect()
            assert_never_two_writes_unanswered(events)
            assert not HELD & set(vars(connection))
            await connection.send_command("CLIENT", "GETNAME")
            name = await connection.read_response()
            await connection.disconnect()
            return name

        assert asyncio.run(scenario()) == b"quota-handshake"


@pytest.mark.redis
@pytest.mark.parametrize("protocol", [2, 3])
def test_a_health_check_due_within_the_handshake_leaves_it_in_step(protocol: int) -> None:
    """A new connection's health check is due at once: redis-py writes a PING (and reads
    its PONG) before the handshake's first command, HELLO under RESP3."""
    with redis_process() as server:
        connection = one_write_handshake(redis.Connection)(
            port=server.port, protocol=protocol, health_check_interval=1, client_name="h"
        )
        connection.connect()
        connection.send_command("CLIENT", "GETNAME")
        assert connection.read_response() in (b"h", "h")
        connection.disconnect()

        async def scenario() -> Any:
            options = {**async_options(), "protocol": protocol, "health_check_interval": 1}
            connection = one_write_handshake(redis_asyncio.Connection)(
                port=server.port, client_name="h", **options
            )
            await connection.connect()
            await connection.send_command("CLIENT", "GETNAME")
            name = await connection.read_response()
            await connection.disconnect()
            return name

        assert asyncio.run(scenario()) in (b"h", "h")


class SetsNameLate:
    """A connect callback (redis-py's pubsub resubscribes so) that writes and reads
    nothing."""

    def on_connect(self, connection: Any) -> None:
        connection.send_command("CLIENT", "SETNAME", "late")


@pytest.mark.redis
def test_a_command_written_unanswered_within_the_handshake_still_goes_out() -> None:
    with redis_process() as server:
        connection = one_write_handshake(redis.Connection)(port=server.port, protocol=2)
        callback = SetsNameLate()  # redis-py keeps a weak reference to the method
        connection.register_connect_callback(callback.on_connect)
        connection.connect()
        assert connection.read_response() == b"OK"
        connection.send_command("CLIENT", "GETNAME")
        assert connection.read_response() == b"late"
        connection.disconnect()


def async_options() -> dict[str, Any]:
    """What the backends give an asyncio connection: timeouts, RESP2, no retry."""
    return {
        "socket_timeout": 0.5,
        "socket_connect_timeout": 0.5,
        "protocol": 2,
        "retry": AsyncRetry(NoBackoff(), 0),
    }


def test_every_pool_of_the_backends_makes_one_write_connections() -> None:
    options = client_options(0.5, 4)
    for pool_class in (MarkingConnectionPool, PublicMarkingConnectionPool):
        for url, base in (
            ("redis://127.0.0.1:1/0", redis.Connection),
            ("rediss://127.0.0.1:1/0", redis.SSLConnection),
            ("unix:///tmp/quota-nothing.sock", redis.UnixDomainSocketConnection),
        ):
            made = pool_class.from_url(url, **options).connection_class
            assert issubclass(made, OneWriteHandshake) and issubclass(made, base)
    for url, base in (
        ("redis://127.0.0.1:1/0", redis_asyncio.Connection),
        ("rediss://127.0.0.1:1/0", redis_asyncio.SSLConnection),
    ):
        made = AsyncOneWriteHandshakePool.from_url(url, **async_options()).connection_class
        assert issubclass(made, AsyncOneWriteHandshake) and issubclass(made, base)
    sentinels = redis.Sentinel([("127.0.0.1", 1)])
    made = MarkingSentinelConnectionPool("mymaster", sentinels).connection_class
    assert issubclass(made, OneWriteHandshake) and issubclass(
        made, redis.sentinel.SentinelManagedConnection
    )
    async_sentinels = redis_asyncio.Sentinel([("127.0.0.1", 1)])
    made = AsyncSentinelPool("mymaster", async_sentinels).connection_class
    assert issubclass(made, AsyncOneWriteHandshake)
    assert issubclass(AsyncMarkingClusterConnection, AsyncOneWriteHandshake)
    assert one_write_handshake(made) is made  # made once, never wrapped twice


def assert_refused_at_maxclients(exc: BaseException | None) -> None:
    assert exc is not None, "a connection was made at maxclients"
    error = classify(exc if isinstance(exc, ConnectFailed) else ConnectFailed(exc))
    assert (error.reason, error.label) == ("backend_unavailable", Label.MAXCLIENTS), str(exc)


@pytest.mark.redis
@pytest.mark.parametrize("pool_class", [MarkingConnectionPool, PublicMarkingConnectionPool])
def test_a_new_sync_connection_at_maxclients_is_refused_as_such(pool_class: type[Any]) -> None:
    with redis_process() as server, at_maxclients(server):
        url = f"redis://127.0.0.1:{server.port}/0?client_name=quota"  # and SETNAME
        for _ in range(ATTEMPTS):
            pool = pool_class.from_url(url, **client_options(0.5, 4))
            refused: BaseException | None = None
            try:
                pool.get_connection()
            except Exception as exc:
                refused = exc
            pool.disconnect()
            assert_refused_at_maxclients(refused)


@pytest.mark.redis
@pytest.mark.parametrize(
    "make",
    [
        lambda port: AsyncOneWriteHandshakePool(port=port, **async_options()).make_connection(),
        lambda port: AsyncMarkingClusterConnection(port=port, **async_options()),
    ],
    ids=["standalone", "cluster node"],
)
def test_a_new_async_connection_at_maxclients_is_refused_as_such(
    make: Callable[[int], Any],
) -> None:
    with redis_process() as server, at_maxclients(server):

        async def attempt() -> BaseException | None:
            connection = make(server.port)
            try:
                await connection.connect()
            except Exception as exc:
                return exc
            finally:
                assert not HELD & set(vars(connection))  # a failed handshake too
                await connection.disconnect()
            return None

        for _ in range(ATTEMPTS):
            assert_refused_at_maxclients(asyncio.run(attempt()))
