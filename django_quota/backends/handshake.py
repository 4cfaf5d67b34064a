"""A new connection's handshake written in one write, so that a server's refusal is read
(``docs/failures.md``, "How a failure is classified").

A Redis at ``maxclients`` (or refusing a client for another reason before reading any
command) writes its error on the new connection and closes it. The error waits in the
client's socket, readable, but the server's kernel answers the first command written
after the close with a reset, and a second write after that fails with a broken pipe:
redis-py then closes the socket with the refusal unread, and a server that said "full"
reads as a dropped connection. redis-py 8.2 writes the handshake's commands (``CLIENT
SETNAME``, ``CLIENT SETINFO`` twice, ``SELECT``) before it reads any reply, and its
asyncio connection always did (``CLIENT SETINFO`` twice, ``SELECT``): up to 100 of 100
new connections lost the ``maxclients`` reason that way, how many moving with the
machine's load (the probe in ``docs/development.md``, "Versions CI runs").

The connections here keep the handshake's commands back and write them together, in
one write, right before its first reply is read (the same round trips as redis-py's).
The first write on a connection never fails that way (no reset came before it), so the
refusal is then read as the reply, and redis-py's parser raises it as the
``ConnectionError`` it always was. Everything is redis-py's public API (the pools'
``connection_class``, a connection's ``connect_check_health``, ``send_packed_command``,
``read_response`` and ``check_health``), so redis-py's public path
(``REDIS_PUBLIC_PATH``) takes it too.

Relies on: redis-py running a new connection's handshake, every command of it written
through ``send_packed_command`` and every reply read through ``read_response``, inside
``connect_check_health`` (redis-py 8.0 to 8.2, sync and asyncio), which both ``connect``
and a first command on an unconnected connection call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
import redis.asyncio as redis_asyncio
from redis.asyncio.connection import AbstractConnection as AsyncAbstractConnection

from django_quota.core.process import PROCESS

__all__ = [
    "AsyncOneWriteHandshake",
    "AsyncOneWriteHandshakePool",
    "OneWriteHandshake",
    "OneWriteHandshakePool",
    "one_write_handshake",
]


def _packed(command: str | bytes | Iterable[bytes]) -> list[bytes]:
    """A packed command as ``send_packed_command`` takes it (bytes, text, or chunks), as
    a list of byte chunks."""
    if isinstance(command, str):
        return [command.encode()]
    if isinstance(command, bytes):
        return [command]
    return list(command)


#: The methods a connection's own attributes replace during its handshake.
_HELD_METHODS = ("send_packed_command", "read_response")


class OneWriteHandshake:
    """Connection mixin (redis-py's sync connections): the commands of the handshake
    are held and written in one write before its first reply is read; commands after
    the handshake are written as redis-py writes them.

    Only the handshake pays: for its length, attributes of the connection itself stand
    in for redis-py's ``send_packed_command`` and ``read_response``, and are removed
    after it. Overridden in the class instead, ``read_response`` cost every reply of
    every decision 0.3 to 0.4 µs here (a frame and ``super()``; best of 7 loops of
    200,000, the parser stubbed out), against 0 this way."""

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        redis_py = super()  # redis-py's own methods, past this mixin
        held: list[bytes] = []

        def write_held() -> None:
            if held:
                packed = b"".join(held)
                # In place: a send that took the list before a health check still holds.
                held.clear()
                redis_py.send_packed_command([packed], check_health=False)  # type: ignore[attr-defined]

        def hold(command: Any, check_health: bool = True) -> None:
            if check_health:
                self.check_health()  # type: ignore[attr-defined]
            held.extend(_packed(command))

        def read_response(*args: Any, **kwargs: Any) -> Any:
            write_held()
            return redis_py.read_response(*args, **kwargs)  # type: ignore[attr-defined]

        self.__dict__.update(zip(_HELD_METHODS, (hold, read_response), strict=True))
        try:
            redis_py.connect_check_health(*args, **kwargs)  # type: ignore[attr-defined]
            write_held()  # written but not answered within the handshake
        finally:
            for name in _HELD_METHODS:
                self.__dict__.pop(name, None)


class AsyncOneWriteHandshake:
    """The asyncio twin of :class:`OneWriteHandshake`."""

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        redis_py = super()  # redis-py's own methods, past this mixin
        held: list[bytes] = []

        async def write_held() -> None:
            if held:
                packed = b"".join(held)
                held.clear()
                await redis_py.send_packed_command([packed], check_health=False)  # type: ignore[attr-defined]

        async def hold(command: Any, check_health: bool = True) -> None:
            if check_health:
                await self.check_health()  # type: ignore[attr-defined]
            held.extend(_packed(command))

        async def read_response(*args: Any, **kwargs: Any) -> Any:
            await write_held()
            return await redis_py.read_response(*args, **kwargs)  # type: ignore[attr-defined]

        self.__dict__.update(zip(_HELD_METHODS, (hold, read_response), strict=True))
        try:
            await redis_py.connect_check_health(*args, **kwargs)  # type: ignore[attr-defined]
            await write_held()
        finally:
            for name in _HELD_METHODS:
                self.__dict__.pop(name, None)


def one_write_handshake(connection_class: type[Any]) -> type[Any]:
    """redis-py's connection class ``connection_class`` (sync or asyncio: plain, TLS,
    Unix socket, Sentinel-managed) with its handshake written in one write, made once
    per class; a class that already does is returned as it is."""
    if issubclass(connection_class, OneWriteHandshake | AsyncOneWriteHandshake):
        return connection_class
    made = PROCESS.handshakes.get(connection_class)
    if made is None:
        mixin: type[Any] = (
            AsyncOneWriteHandshake
            if issubclass(connection_class, AsyncAbstractConnection)
            else OneWriteHandshake
        )
        name = connection_class.__name__
        made = PROCESS.handshakes.setdefault(
            connection_class,
            type(
                name,
                (mixin, connection_class),
                {
                    "__module__": __name__,
                    "__doc__": f"redis-py's {name}, its handshake in one write.",
                },
            ),
        )
    return made


class OneWriteHandshakePool(redis.ConnectionPool):
    """Pool mixin (redis-py's sync pools): the pool's connections, whatever class the URL
    or the Sentinel pool chose, write their handshake in one write. It comes right
    before ``ConnectionPool`` in a pool's bases, so that it sees the class the
    Sentinel pool picks."""

    def __init__(self, connection_class: type[Any] = redis.Connection, **kwargs: Any) -> None:
        super().__init__(connection_class=one_write_handshake(connection_class), **kwargs)


class AsyncOneWriteHandshakePool(redis_asyncio.ConnectionPool):
    """The asyncio twin of :class:`OneWriteHandshakePool`."""

    def __init__(
        self, connection_class: type[Any] = redis_asyncio.Connection, **kwargs: Any
    ) -> None:
        super().__init__(connection_class=one_write_handshake(connection_class), **kwargs)
