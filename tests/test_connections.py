"""The synchronous pool's own stack of idle connections (the fence's ``IdleStack``,
``backends/redispy.py``): a connection given back is taken again without redis-py's
per-checkout bookkeeping, but with its checks, so that one the server closed while idle is
replaced before anything is written (the decision is made, never ``indeterminate``), the
pool never creates more than ``MAX_INFLIGHT`` connections, and a forked child never shares
its parent's socket. On redis-py's public path (``DJANGO_QUOTA_REDIS_PUBLIC_PATH=1``, a
lane of CI) the same holds of redis-py's own pool; what only the fence does is skipped."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest

import django_quota
from django_quota import limiter
from django_quota.backends import clients
from django_quota.backends import redis as redis_backend
from django_quota.backends.redispy import public_path

SUBJECT = {"ip": "192.0.2.77"}
#: This run takes redis-py's public path (the CI lane's environment variable).
PUBLIC = public_path()
fence_only = pytest.mark.skipif(
    PUBLIC, reason="the fence's own mechanics: off on redis-py's public path"
)


def idle_of(pool: Any) -> list[Any]:
    """The idle connections of a sync pool: the fence's stack, or redis-py's own list."""
    return list(pool._available_connections if PUBLIC else pool._idle)


@pytest.fixture
def on_redis(quota: Any, redis_url: str) -> Any:
    quota(REDIS_URL=redis_url, MAX_INFLIGHT=4, POLICIES={"p": {"windows": "1000/h"}})
    return limiter.get_backend().client.connection_pool


def test_a_connection_given_back_is_taken_again(on_redis: Any) -> None:
    for _ in range(50):
        assert django_quota.evaluate("p", SUBJECT).decision == "allowed"
    idle = idle_of(on_redis)
    assert len(idle) == 1  # one connection did all 50
    first = idle[0]
    django_quota.evaluate("p", SUBJECT)
    assert idle_of(on_redis) == [first]
    if PUBLIC:
        assert len(on_redis._in_use_connections) == 0
    else:
        assert len(on_redis._in_use_connections) == 1  # redis-py still counts it as taken
        assert on_redis._available_connections == []


def test_a_connection_the_server_closed_while_idle_is_replaced_before_any_write(
    on_redis: Any, redis_client: Any
) -> None:
    assert django_quota.evaluate("p", SUBJECT).remaining == 999
    # Close every client connection but the test's own, as a server timeout or restart
    # of connections would: the idle one now reads as end of file.
    assert redis_client.client_kill_filter(_type="normal", skipme=True) >= 1
    outcome = django_quota.evaluate("p", SUBJECT)
    assert (outcome.decision, outcome.reason, outcome.remaining) == ("allowed", None, 998)
    # Decided on the first attempt: no failed call (an EVALSHA written into the closed
    # socket would be indeterminate, and only the retry with the same id would decide).
    assert list(limiter.get_limiter().recent_errors) == []


def test_threads_never_take_more_connections_than_max_inflight(
    on_redis: Any, redis_client: Any
) -> None:
    outcomes: list[str] = []

    def work() -> None:
        for _ in range(25):
            outcomes.append(django_quota.evaluate("p", SUBJECT).decision)

    threads = [threading.Thread(target=work) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert outcomes.count("allowed") == 300
    assert len(on_redis._in_use_connections) + len(on_redis._available_connections) <= 4
    assert 1 <= len(idle_of(on_redis)) <= 4
    assert django_quota.peek("p", SUBJECT).remaining == 1000 - 300


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_makes_its_own_connection(on_redis: Any, redis_client: Any) -> None:
    django_quota.evaluate("p", SUBJECT)
    parent_connection = idle_of(on_redis)[0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: decide, and say whether it used the parent's connection
        code = 1
        try:
            outcome = django_quota.evaluate("p", SUBJECT)
            shared = any(c is parent_connection for c in idle_of(on_redis))
            os.write(write, f"{outcome.decision} {outcome.remaining} {shared}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    reported = os.read(read, 100).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reported == "allowed 998 False"
    # The parent's connection still works: the child never wrote on its socket.
    assert idle_of(on_redis) == [parent_connection]
    assert django_quota.evaluate("p", SUBJECT).remaining == 997


@pytest.fixture(params=["thread", "pipelined"])
def async_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which async path a new loop's decisions take: the sync client in a worker thread (a
    loop's first decisions), or the loop's own pipelined connections."""
    if request.param == "pipelined":
        monkeypatch.setattr(clients, "PIPELINE_AFTER", 0)
    return str(request.param)


def test_async_decisions_of_one_loop_share_one_connection(on_redis: Any) -> None:
    async def run() -> tuple[int, int]:
        for _ in range(30):
            assert (await django_quota.aevaluate("p", SUBJECT)).decision == "allowed"
        pipeline = limiter.get_backend()._async()
        return pipeline.opened, len(pipeline.pipes)

    # The loop's first decisions ran on the sync client (one connection), the rest on
    # one pipelined connection of the loop's own.
    assert asyncio.run(run()) == (1, 1)
    assert len(idle_of(on_redis)) == 1


def test_async_a_connection_the_server_closed_while_idle_is_replaced_before_any_write(
    on_redis: Any, redis_client: Any, async_path: str
) -> None:
    async def run() -> Any:
        assert (await django_quota.aevaluate("p", SUBJECT)).remaining == 999
        assert redis_client.client_kill_filter(_type="normal", skipme=True) >= 1
        return await django_quota.aevaluate("p", SUBJECT)

    outcome = asyncio.run(run())
    assert (outcome.decision, outcome.reason, outcome.remaining) == ("allowed", None, 998)
    assert list(limiter.get_limiter().recent_errors) == []  # decided on the first attempt


def _configure_proxied(quota: Any, url: str, **extra: Any) -> None:
    quota(
        REDIS_URL=url,
        FAILURE_MODE="closed",
        LOCAL_FALLBACK={"ENABLED": False},
        POLICIES={"p": {"algorithm": "fixed_window", "windows": "100/h", "selector": ["ip"]}},
        **extra,
    )


@pytest.mark.redis
def test_a_slow_link_every_round_trip_of_which_fits_timeout_is_decided_async(
    quota: Any, async_path: str
) -> None:
    """Each reply 60 ms late, ``TIMEOUT`` 0.1 s: a new connection's connect and handshake
    take several round trips, each within ``TIMEOUT``, as the command's does. Async must
    decide as sync does: on a new event loop (a new client, so a new connection) and
    again and again on one loop."""
    from tests.faults import proxy_to, redis_process

    with redis_process() as server, proxy_to(server) as proxy:
        _configure_proxied(quota, proxy.url, TIMEOUT=0.1, DEADLINE=0.25)
        # Scripts loaded: a NOSCRIPT's two more round trips would outlast DEADLINE.
        limiter.get_backend().preload()  # type: ignore[attr-defined]
        limiter.get_backend().close()
        proxy.latency(0.06)
        sync = [django_quota.evaluate("p", SUBJECT) for _ in range(3)]

        async def three() -> list[Any]:
            return [await django_quota.aevaluate("p", SUBJECT) for _ in range(3)]

        fresh_loops = [asyncio.run(django_quota.aevaluate("p", SUBJECT)) for _ in range(3)]
        one_loop = asyncio.run(three())
        assert [(o.decision, o.reason) for o in sync + fresh_loops + one_loop] == [
            ("allowed", None)
        ] * 9


@pytest.mark.redis
def test_pipelined_connections_the_server_closed_are_dropped_not_piled_up(
    quota: Any, async_path: str
) -> None:
    """A pipelined connection the server closed while the loop sat idle is found closed
    before anything is written on it (a zero-timeout ``poll``), dropped, and replaced:
    after repeated closures the loop holds one connection, and every decision is made on
    its first attempt."""
    from tests.faults import redis_process

    with redis_process() as server:
        _configure_proxied(quota, server.url, TIMEOUT=0.5, DEADLINE=1.0)
        admin = server.client()

        async def run() -> tuple[list[Any], int]:
            outcomes = []
            for _ in range(3):
                outcomes.append(await django_quota.aevaluate("p", SUBJECT))
                admin.client_kill_filter(_type="normal", skipme=True)
                time.sleep(0.05)  # the idle connection now reads as end of file
            outcomes.append(await django_quota.aevaluate("p", SUBJECT))
            pipeline = limiter.get_backend()._async_clients.get(asyncio.get_running_loop())
            return outcomes, 0 if pipeline is None else len(pipeline.pipes)

        outcomes, pipes = asyncio.run(run())
        assert [(o.decision, o.reason) for o in outcomes] == [("allowed", None)] * 4
        assert pipes == (1 if async_path == "pipelined" else 0)
        assert list(limiter.get_limiter().recent_errors) == []


@fence_only
@pytest.mark.redis
def test_peer_hung_up_sees_what_the_loop_has_not_read_yet(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``peer_hung_up`` (the cluster connections' check; the pipelines' ``readable`` does
    the same) is False for an idle open connection, True once the server closed it even
    though the loop has not run since, True for a closing transport, and polls a new
    transport afresh after a reconnect."""
    import time

    from django_quota.backends.redispy_transport import peer_hung_up
    from tests.faults import redis_process

    monkeypatch.setattr(clients, "PIPELINE_AFTER", 0)
    with redis_process() as server:
        _configure_proxied(quota, server.url)
        admin = server.client()

        async def run() -> list[bool]:
            assert (await django_quota.aevaluate("p", SUBJECT)).decision == "allowed"
            pipeline = limiter.get_backend()._async()
            (pipe,) = pipeline.pipes
            connection = pipe.connection
            seen = [peer_hung_up(connection), peer_hung_up(connection)]
            assert not pipe.readable()
            first_probe = connection._quota_probe
            admin.client_kill_filter(_type="normal", skipme=True)
            time.sleep(0.05)  # the loop does not run: it has read nothing
            seen.append(peer_hung_up(connection))
            assert pipe.readable()
            assert (await django_quota.aevaluate("p", SUBJECT)).decision == "allowed"
            (again_pipe,) = pipeline.pipes
            again = again_pipe.connection
            seen.append(peer_hung_up(again))
            assert again._quota_probe is not first_probe  # a new transport, a new poll
            again._writer.transport.close()
            seen.append(peer_hung_up(again))
            return seen

        assert asyncio.run(run()) == [False, False, True, False, True]


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_stalled_server_is_indeterminate_after_timeout_even_under_frequent_signals(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    # A receive bounded by the kernel's SO_RCVTIMEO restarts in full after each signal
    # (Python retries it): a timer signal every 50 ms would keep it waiting for the whole
    # stall. Python's own socket timeout keeps one deadline across the retries.
    quota(
        REDIS_URL=redis_url,
        TIMEOUT=0.2,
        DEADLINE=0.3,  # no time for the retry: the one call's outcome is seen
        POLICIES={"p": {"windows": "1000/h"}},
    )
    assert django_quota.evaluate("p", SUBJECT).remaining == 999  # a pooled connection
    previous = signal.signal(signal.SIGALRM, lambda number, frame: None)
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    try:
        redis_client.client_pause(2000, all=False)  # WRITE: pauses the EVALSHA
        started = time.monotonic()
        outcome = django_quota.evaluate("p", SUBJECT)
        waited = time.monotonic() - started
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert (outcome.decision, outcome.reason) == ("failed_closed", "indeterminate")
    assert waited < 1.0, waited  # TIMEOUT (0.2 s), never the stall's 2 s
    time.sleep(2.0)
    # Whether the paused EVALSHA ran is not knowable from here; nothing ran twice.
    assert django_quota.peek("p", SUBJECT).remaining in (998, 999)


@fence_only
@pytest.mark.skipif(
    redis_backend.pack_command is None, reason="without hiredis redis-py packs and sends"
)
def test_a_command_goes_out_in_one_write_of_the_descriptor(
    on_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert django_quota.evaluate("p", SUBJECT).remaining == 999  # a pooled connection
    (connection,) = idle_of(on_redis)
    descriptor = connection._sock.fileno()
    writes: list[int] = []
    real_write = os.write

    def recording_write(fd: int, data: Any) -> int:
        if fd == descriptor:
            writes.append(len(data))
        return real_write(fd, data)

    def polled_send(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("sent through redis-py's sendall, which polls first")

    monkeypatch.setattr(os, "write", recording_write)
    monkeypatch.setattr(connection, "send_packed_command", polled_send)
    assert django_quota.evaluate("p", SUBJECT).remaining == 998
    assert len(writes) == 1 and writes[0] > 100  # the whole EVALSHA, at once


def test_what_one_write_cannot_take_is_sent_under_the_socket_timeout(
    quota: Any, redis_url: str
) -> None:
    from django_quota.backends.redis import send

    quota(REDIS_URL=redis_url, TIMEOUT=2.0, DEADLINE=4.0, POLICIES={"p": {"windows": "9/h"}})
    django_quota.evaluate("p", SUBJECT)
    pool = limiter.get_backend().client.connection_pool
    (connection,) = idle_of(pool)
    connection._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    payload = bytes(range(256)) * 1024  # 256 KiB: more than one write of the buffer takes
    assert send(pool, ("ECHO", payload), fast=not PUBLIC) == payload
    assert idle_of(pool) == [connection]  # still connected, given back
    assert django_quota.evaluate("p", SUBJECT).remaining == 7


def test_a_health_check_due_is_made_before_the_command_never_inside_it(redis_url: str) -> None:
    from django_quota.backends.redis import MarkingConnectionPool, send

    pool = MarkingConnectionPool.from_url(
        f"{redis_url}?health_check_interval=1", socket_timeout=1.0
    )
    try:
        assert send(pool, ("PING",)) == b"PONG"
        (connection,) = pool._idle
        connection._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        connection.next_health_check = 0  # due: redis-py would PING before the next command
        payload = bytes(range(256)) * 1024  # 256 KiB: the first write takes only part
        # A PING written into the middle of the command would wait for a PONG that never
        # comes (the server still reads the command): a TimeoutError after 1 s.
        assert send(pool, ("ECHO", payload)) == payload
        assert connection.next_health_check > 0  # the check was made
    finally:
        pool.disconnect()


#: A script that keeps the server busy for about 200 ms, then replies "first".
_SLOW_FIRST = (
    "local s = redis.call('TIME') local n repeat n = redis.call('TIME') until "
    "(n[1] - s[1]) * 1000000 + (n[2] - s[2]) > 200000 return 'first'"
)


class _Interrupted(BaseException):
    """What a signal handler may raise between a command's write and its read."""


def test_a_command_interrupted_before_its_reply_leaves_nothing_for_the_next(
    redis_url: str,
) -> None:
    from django_quota.backends.redis import MarkingConnectionPool, send

    pool = MarkingConnectionPool.from_url(redis_url, socket_timeout=2.0)
    try:
        assert send(pool, ("PING",)) == b"PONG"
        (connection,) = pool._idle

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            raise _Interrupted

        connection.read_response = interrupted  # the write goes out; the read never starts
        with pytest.raises(_Interrupted):
            send(pool, ("EVAL", _SLOW_FIRST, 0))
        del connection.read_response
        # The script's reply is still on its way when the next command is sent: on the
        # same connection, it would be read as the next command's.
        assert send(pool, ("ECHO", "second")) == b"second"
    finally:
        pool.disconnect()


def test_async_a_command_interrupted_before_its_reply_leaves_nothing_for_the_next(
    redis_url: str,
) -> None:
    """``asend``, the path of a ``client_factory``'s asyncio client."""
    import redis.asyncio

    from django_quota.backends.redis import asend

    async def scenario() -> None:
        pool = redis.asyncio.ConnectionPool.from_url(redis_url)
        try:
            assert await asend(pool, ("PING",), 2.0) == b"PONG"
            (connection,) = pool._available_connections

            async def interrupted(*args: Any, **kwargs: Any) -> Any:
                raise _Interrupted

            connection.read_response = interrupted
            with pytest.raises(_Interrupted):
                await asend(pool, ("EVAL", _SLOW_FIRST, 0), 2.0)
            del connection.read_response
            assert await asend(pool, ("ECHO", "second"), 2.0) == b"second"
        finally:
            await pool.disconnect()

    asyncio.run(scenario())
