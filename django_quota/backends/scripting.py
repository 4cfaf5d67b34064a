"""What the Redis and Redis Cluster backends share: the script calls a plan is made of,
the one loop that runs a script with ``EVALSHA`` and recovers ``NOSCRIPT``, the drivers
that run a plan synchronously or under asyncio, the one place where redis-py's
exceptions become the failure reasons of ``docs/failures.md``, and the bookkeeping of
their clients (:class:`BaseRedisBackend`: one sync client, one async client per live
event loop, ``close`` and ``quota check``'s rows)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from redis import exceptions as redis_exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from django_quota.backends import unusable_url
from django_quota.backends.probe import Row, run_probe
from django_quota.core.errors import (
    BLAME_SELF,
    BLAME_UNLESS_ANSWERING,
    MAXCLIENTS,
    BackendError,
)
from django_quota.core.outcome import (
    BACKEND_ERROR,
    BACKEND_MODE_REDIS,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    INDETERMINATE,
)
from django_quota.core.protocol import GroupReply, GroupRequest, Probe, parse_reply, reset_keys
from django_quota.core.windows import new_tuple
from django_quota.scripts import ScriptSource, all_scripts
from django_quota.scripts.shapes import SINGLE_WINDOW_SCRIPTS

#: EVALSHA attempts when SCRIPT FLUSH keeps racing the reload (each one ran nothing).
NOSCRIPT_ATTEMPTS = 8

#: What redis-py raises when a connection fails (the built-in TimeoutError is an OSError).
CONNECT_ERRORS = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError)
#: Replies that say the server refuses this client, whatever it sends: never the fallback.
_REFUSALS = (
    redis_exceptions.AuthenticationError,
    redis_exceptions.AuthorizationError,
    redis_exceptions.NoPermissionError,
    redis_exceptions.ResponseError,
)


#: What a Redis at ``maxclients`` sends a new connection, then closes it (redis-py raises
#: it as a ``ConnectionError`` with this text).
MAXCLIENTS_REPLY = "max number of clients reached"


def is_maxclients(exc: BaseException) -> bool:
    """Whether ``exc`` is a server at ``maxclients`` refusing a new connection: it
    accepted the connection, answered with that error and closed it, reading nothing."""
    return isinstance(exc, redis_exceptions.ConnectionError) and MAXCLIENTS_REPLY in str(exc)


class ConnectFailed(redis_exceptions.ConnectionError):
    """Raised by our pools when no connection could be had: nothing was written.

    ``timed_out`` tells a connect timeout from a refusal (or a full pool);
    ``maxclients`` a server at ``maxclients`` refusing the new connection.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.timed_out = isinstance(cause, redis_exceptions.TimeoutError | TimeoutError)
        self.maxclients = is_maxclients(cause)


def is_connect_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised while a connection was being had, means nothing was
    written (so it becomes :class:`ConnectFailed`). Authentication and permission replies
    of the handshake are not: the server answered, and refused this client."""
    return isinstance(exc, CONNECT_ERRORS) and not isinstance(exc, _REFUSALS)


def mark_connect_failure(exc: BaseException) -> None:
    """Raise :class:`ConnectFailed` from ``exc`` when ``exc``, raised while a connection
    was being had, means nothing was written (:func:`is_connect_failure`); else return,
    for the caller to raise ``exc`` as it is."""
    if is_connect_failure(exc) and not isinstance(exc, ConnectFailed):
        raise ConnectFailed(exc) from exc


def classify(exc: BaseException) -> BackendError:
    """Map a redis-py exception to its failure reason (``docs/failures.md``).

    A failure to get a connection (refused, unreachable, pool exhausted) is
    ``backend_unavailable``, a connect timeout ``backend_timeout``: nothing was written.
    A ``LOADING`` reply is ``backend_unavailable`` (the command did not run). A timeout or
    a lost connection once a connection was had is ``indeterminate``: the command may
    have run. ``WRONGPASS``, ``NOAUTH``, ``NOPERM``, ``OOM`` and every other error reply
    (``BUSY``, ``READONLY``…) are ``backend_error``: the server answered, so the local
    fallback never takes over from a misconfigured one.

    A server at ``maxclients`` refusing a new connection is ``backend_unavailable``
    labelled :data:`~django_quota.core.errors.MAXCLIENTS`: it refused before reading
    anything, so nothing ran, and it counts toward the node's breaker only when none of
    the node's connections answered lately (``docs/failures.md``, "The circuit breaker").
    """
    if isinstance(exc, BackendError):
        return exc
    if exc.maxclients if isinstance(exc, ConnectFailed) else is_maxclients(exc):
        return BackendError(
            BACKEND_UNAVAILABLE,
            f"{type(exc).__name__}: {exc}",
            label=MAXCLIENTS,
            blame=BLAME_UNLESS_ANSWERING,
        )
    if isinstance(exc, ConnectFailed):
        reason = BACKEND_TIMEOUT if exc.timed_out else BACKEND_UNAVAILABLE
    elif isinstance(exc, redis_exceptions.BusyLoadingError):
        reason = BACKEND_UNAVAILABLE
    elif isinstance(exc, _REFUSALS):
        reason = BACKEND_ERROR
    elif isinstance(exc, CONNECT_ERRORS):  # the built-in TimeoutError is an OSError
        reason = INDETERMINATE
    else:
        reason = BACKEND_ERROR
    return BackendError(reason, f"{type(exc).__name__}: {exc}")


def deadline_spent(command: Sequence[Any]) -> BackendError:
    """``DEADLINE`` ran out before ``command`` could be written: ``backend_timeout``
    (nothing ran), never counted by the node's breaker (docs/failures.md)."""
    return BackendError(
        BACKEND_TIMEOUT, f"DEADLINE spent before {command[0]} was written", blame=BLAME_SELF
    )


class Call(NamedTuple):
    """One script run of a plan: the script's name, its KEYS and its ARGV. A named tuple:
    one is made per decision, and a tuple is the cheapest record to make."""

    script: str
    keys: Sequence[str]
    args: Sequence[int | str | bytes]


def evaluate_call(request: GroupRequest) -> Call:
    """The call deciding ``request``: one policy with one window runs the variant of
    ``evaluate.lua`` made for its algorithm, any other group the general script
    (:mod:`django_quota.scripts.shapes`); the same KEYS, ARGV and reply either way."""
    calls = request.calls
    script = "evaluate"
    if len(calls) == 1 and len(calls[0].windows) == 1:
        script = SINGLE_WINDOW_SCRIPTS[calls[0].algorithm]
    return new_tuple(Call, (script, request.keys(), request.args()))


def parse(reply: Any, request: GroupRequest) -> GroupReply:
    """Parse an ``evaluate.lua`` reply; a malformed one is ``backend_error``."""
    try:
        return parse_reply(reply, request.calls, request.peek)
    except (TypeError, ValueError) as exc:
        raise BackendError(BACKEND_ERROR, f"unexpected script reply: {exc}") from exc


#: A plan: yields each :class:`Call`, receives its raw reply (a failure is thrown in as
#: :class:`BackendError`), returns the group's reply.
Plan = Generator[Call, Any, GroupReply]


def single_plan(request: GroupRequest) -> Plan:
    """The plan of a standalone Redis: one ``EVALSHA`` deciding the whole group."""
    return parse((yield evaluate_call(request)), request)


#: One Redis command, as positional arguments of ``execute_command``.
Command = tuple[Any, ...]
T = TypeVar("T")


def script_steps(
    source: ScriptSource, call: Call, *, missing: bool = False
) -> Generator[Command, Any, Any]:
    """Run ``call``: ``EVALSHA``; on ``NOSCRIPT`` (restart, failover, ``SCRIPT FLUSH``)
    ``SCRIPT LOAD`` and again, up to :data:`NOSCRIPT_ATTEMPTS` times: a script that did not
    run charged nothing. ``missing``: an ``EVALSHA`` already answered ``NOSCRIPT``, so
    start with the load. Yields commands, receives their replies (redis-py exceptions
    are thrown in), returns the script's reply."""
    evalsha = ("EVALSHA", source.sha1, len(call.keys), *call.keys, *call.args)
    for attempt in range(NOSCRIPT_ATTEMPTS):
        if missing or attempt:
            yield ("SCRIPT", "LOAD", source.source)
        try:
            return (yield evalsha)
        except redis_exceptions.NoScriptError:
            if attempt == NOSCRIPT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def drive(
    steps: Generator[Any, Any, T],
    run: Callable[[Any], Any],
    errors: tuple[type[BaseException], ...] = (BackendError,),
) -> T:
    """Run a plan (or :func:`script_steps`) with ``run`` doing each step; an exception
    of ``errors`` raised by ``run`` is thrown into the plan, which may handle it."""
    try:
        step = next(steps)
        while True:
            try:
                raw = run(step)
            except errors as error:
                step = steps.throw(error)
            else:
                step = steps.send(raw)
    except StopIteration as stop:
        result: T = stop.value
        return result


async def adrive(
    steps: Generator[Any, Any, T],
    run: Callable[[Any], Awaitable[Any]],
    errors: tuple[type[BaseException], ...] = (BackendError,),
) -> T:
    """Async twin of :func:`drive`."""
    try:
        step = next(steps)
        while True:
            try:
                raw = await run(step)
            except errors as error:
                step = steps.throw(error)
            else:
                step = steps.send(raw)
    except StopIteration as stop:
        result: T = stop.value
        return result


def run_script(
    source: ScriptSource, call: Call, execute: Callable[[Command], Any], *, missing: bool = False
) -> Any:
    """Run :func:`script_steps` with ``execute`` sending each command (sync)."""
    steps = script_steps(source, call, missing=missing)
    return drive(steps, execute, (redis_exceptions.NoScriptError,))


async def arun_script(
    source: ScriptSource,
    call: Call,
    execute: Callable[[Command], Awaitable[Any]],
    *,
    missing: bool = False,
) -> Any:
    """Async twin of :func:`run_script`."""
    steps = script_steps(source, call, missing=missing)
    return await adrive(steps, execute, (redis_exceptions.NoScriptError,))


class ScriptedBackend:
    """What every script-running backend derives from its ``plan``, ``run`` and ``arun``:
    decisions without the limiter's admission control (``quota inspect``, tests) and
    resets."""

    def plan(self, request: GroupRequest) -> Plan:
        """The calls deciding ``request`` (one ``EVALSHA`` on a single primary)."""
        return single_plan(request)

    def run(self, call: Call, deadline: float | None = None) -> Any:
        """Run one script call; its raw reply (raises :class:`BackendError`).
        ``deadline`` (``time.monotonic()`` seconds): when the evaluation's ``DEADLINE``
        ends, which bounds each round trip where the backend can (docs/settings.md,
        "Time budgets")."""
        raise NotImplementedError

    async def arun(self, call: Call) -> Any:
        """Async twin of :meth:`run`."""
        raise NotImplementedError

    def evaluate(self, request: GroupRequest) -> GroupReply:
        """Decide ``request``: its plan, driven here."""
        return drive(self.plan(request), self.run)

    async def aevaluate(self, request: GroupRequest) -> GroupReply:
        """Async twin of :meth:`evaluate`."""
        return await adrive(self.plan(request), self.arun)

    def reset(self, counter: str, window_count: int) -> int:
        """Run ``reset.lua`` for one counter (and its sliding-log lists); how many of its
        windows had state."""
        return int(self.run(Call("reset", reset_keys(counter, window_count), [window_count])))

    async def areset(self, counter: str, window_count: int) -> int:
        """Async twin of :meth:`reset`."""
        call = Call("reset", reset_keys(counter, window_count), [window_count])
        return int(await self.arun(call))


def sources() -> dict[str, ScriptSource]:
    """Every script by name: ``evaluate.lua``, its variants per policy shape, ``reset.lua``
    and ``refund.lua`` (what ``preload`` loads)."""
    return {source.name: source for source in all_scripts()}


# -- the clients of a Redis backend ---------------------------------------------------------
#: Async clients kept at once (one per live event loop); clients of closed loops are
#: closed and forgotten whenever a new loop needs one.
MAX_ASYNC_CLIENTS = 64
#: A loop's decisions run on the process's synchronous client, in a worker thread, until
#: it has started this many, or has two in flight at once; then it gets pipelined
#: connections of its own (docs/failures.md, "Async connections"). An async view under WSGI
#: (a new loop per request) so reuses the process's connections.
PIPELINE_AFTER = 8


def client_options(timeout: float, max_inflight: int) -> dict[str, Any]:
    """Keyword arguments every pool gets: no hidden retry, timeouts, pool size (docs/settings.md).

    RESP2 is pinned (a ``protocol`` in the URL still wins): redis-py 8 defaults to RESP3,
    which turns on its "maintenance notifications", and with them its pools skip the
    check that finds a pooled connection already closed by the server, so the asyncio
    client writes ``EVALSHA`` into a dead socket and a refused Redis reads as
    ``indeterminate``; they may also relax socket timeouts beyond ``TIMEOUT``. RESP2 also
    spares each new connection the ``HELLO`` and ``CLIENT MAINT_NOTIFICATIONS`` round
    trips.
    """
    return {
        "retry": Retry(NoBackoff(), 0),
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "max_connections": max_inflight,
        "protocol": 2,
    }


def abandon(connections: Iterable[Any]) -> None:
    """Close the sockets of asyncio connections whose event loop has closed: their
    ``disconnect()`` needs that loop, so the socket under the transport is closed
    directly (else it stays open until garbage collection, one per finished loop)."""
    for connection in connections:
        writer = getattr(connection, "_writer", None)
        if writer is None:
            continue
        wrapped = writer.get_extra_info("socket")
        raw = getattr(wrapped, "_sock", wrapped)
        with contextlib.suppress(Exception):
            raw.close()


#: Every Redis backend of the process: reset in a forked child (``_after_fork``).
_BACKENDS: weakref.WeakSet[BaseRedisBackend] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for backend in list(_BACKENDS):
        backend._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def text(value: Any) -> str:
    """A reply's value as text (redis-py gives bytes, or a number)."""
    return value.decode() if isinstance(value, bytes) else str(value)


class BaseRedisBackend(ScriptedBackend):
    """What the standalone and cluster backends share: a synchronous client created on
    first use and shared per process; an async client per running event loop (pools
    belong to one loop), those of loops that have closed closed and forgotten, so that
    connections stay bounded whatever the number of loops (async views under WSGI each
    run in a new one); ``close``, ``ttl_ms``, and ``quota check``'s rows over every
    primary (:meth:`diagnose`).

    A subclass says how it builds a client (:meth:`_build`) and finds an async client's
    connections (:meth:`_async_connections`), and how it routes calls: :meth:`node_of`,
    :meth:`run`, :meth:`arun`, :meth:`preload` and, for ``quota check``,
    :meth:`primaries` and :meth:`command`.
    """

    mode = BACKEND_MODE_REDIS
    #: Whether ``quota check``'s rows speak of several primaries (a cluster's).
    clustered = False
    #: redis-py's exception as a failure reason (the cluster's adds its own refusals).
    classify = staticmethod(classify)

    def __init__(
        self, *, timeout: float, max_inflight: int, url_options: Mapping[str, Any] | None
    ) -> None:
        self.timeout = timeout
        self.max_inflight = max_inflight
        self.url_options = dict(url_options or {})
        self._lock = threading.Lock()
        self._client: Any = None
        self._async_clients: dict[asyncio.AbstractEventLoop, Any] = {}
        #: Loops without a client yet: [decisions started, decisions in flight].
        self._young: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[int]] = (
            weakref.WeakKeyDictionary()
        )
        self._threads: ThreadPoolExecutor | None = None
        self._sources = sources()
        _BACKENDS.add(self)

    # -- clients -----------------------------------------------------------------------
    def _build(self, asynchronous: bool) -> Any:
        """A new client (a redis-py asyncio one when ``asynchronous``)."""
        raise NotImplementedError

    def _async_connections(self, client: Any) -> list[Any]:
        """Every connection the async ``client`` holds (closed with its loop)."""
        raise NotImplementedError

    def _options(self) -> dict[str, Any]:
        """The keyword arguments of every client: :func:`client_options`, then the URL
        options of a ``CACHE_ALIAS`` cache."""
        return {**client_options(self.timeout, self.max_inflight), **self.url_options}

    @property
    def client(self) -> Any:
        """The shared synchronous client (created on first use)."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._buildable(asynchronous=False)
                client = self._client
        return client

    def _async(self) -> Any:
        """The running event loop's async client (created on its first use)."""
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            with self._lock:
                # Built before the clients of closed loops are forgotten: a cluster's new
                # client starts from every node they had learnt too.
                client = self._buildable(asynchronous=True)
                self._forget_closed_loops()
                self._async_clients[loop] = client
        return client

    def _buildable(self, *, asynchronous: bool) -> Any:
        """:meth:`_build`, with what redis-py refuses to build a client from (a URL whose
        port is out of range, say: ``CACHE_ALIAS`` takes a cache's ``LOCATION`` as it is)
        raised as ``backend_error``, so the failure mode answers, never a 500."""
        try:
            return self._build(asynchronous=asynchronous)
        except ValueError as exc:
            detail = f"the Redis URL cannot make a client: {unusable_url(exc)}"
            raise BackendError(BACKEND_ERROR, detail) from exc

    def _forget_closed_loops(self) -> None:
        """Close the connections of async clients whose loop has closed, and forget them;
        past :data:`MAX_ASYNC_CLIENTS` live ones, forget the oldest too (:meth:`_retire`)."""
        for loop in [loop for loop in self._async_clients if loop.is_closed()]:
            self._retire(loop, self._async_clients.pop(loop), close_live=False)
        while len(self._async_clients) >= MAX_ASYNC_CLIENTS:
            oldest = next(iter(self._async_clients))
            self._retire(oldest, self._async_clients.pop(oldest), close_live=False)

    def _retire(self, loop: asyncio.AbstractEventLoop, client: Any, *, close_live: bool) -> None:
        """Close the connections of a forgotten async ``client`` of ``loop``: a closed
        loop's directly (:func:`abandon`), and a live loop's too when ``close_live``
        (else they close with the loop's transports)."""
        if close_live or loop.is_closed():
            abandon(self._async_connections(client))

    # -- young loops: on the synchronous client, in a worker thread ------------------------
    def young(self, loop: asyncio.AbstractEventLoop) -> list[int] | None:
        """``loop``'s counts ([started, in flight]) while its decisions still run in a
        worker thread (:data:`PIPELINE_AFTER`), else None."""
        counts = self._young.get(loop)
        if counts is None:
            counts = self._young[loop] = [0, 0]
        if counts[0] >= PIPELINE_AFTER or counts[1]:
            return None
        return counts

    async def in_thread(
        self, loop: asyncio.AbstractEventLoop, counts: list[int], call: Call
    ) -> Any:
        """Run ``call`` with :meth:`run` (the process's synchronous client and its pool)
        in one of the backend's worker threads; ``counts`` are the loop's (:meth:`young`)."""
        counts[0] += 1
        counts[1] += 1
        try:
            return await loop.run_in_executor(self._executor(), self.run, call)
        finally:
            counts[1] -= 1

    def _executor(self) -> ThreadPoolExecutor:
        executor = self._threads
        if executor is None:
            with self._lock:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(
                        max_workers=self.max_inflight, thread_name_prefix="django-quota"
                    )
                executor = self._threads
        return executor

    def _after_fork(self) -> None:
        """In a forked child: never touch the parent's async connections or threads."""
        self._lock = threading.Lock()
        self._async_clients = {}
        self._young = weakref.WeakKeyDictionary()
        self._threads = None

    @property
    def async_client_count(self) -> int:
        """Async clients held now (one per live event loop that used this backend)."""
        return len(self._async_clients)

    def close(self) -> None:
        """Disconnect the synchronous client, close every loop's async connections (in
        their loop when it may still run) and stop the worker threads once idle."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing never raises into setting_changed
                client.close()
        with self._lock:
            clients, self._async_clients = self._async_clients, {}
            threads, self._threads = self._threads, None
        for loop, async_client in clients.items():
            self._retire(loop, async_client, close_live=True)
        if threads is not None:
            threads.shutdown(wait=False)

    def ttl_ms(self, counter: str) -> int:
        """``PTTL`` of ``counter`` (-2: no such key). Not on the hot path."""
        try:
            return int(self.client.pttl(counter))
        except Exception as exc:
            raise self.classify(exc) from exc

    def preload(self) -> list[tuple[str, str]]:
        """``SCRIPT LOAD`` every script where scripts run; return (name, SHA1) pairs."""
        raise NotImplementedError

    # -- quota check -------------------------------------------------------------------
    def primaries(self) -> list[Any]:
        """The nodes ``quota check`` asks: a standalone or Sentinel primary is one node,
        named None."""
        return [None]

    def command(self, node: Any, *command: Any) -> Any:
        """Send ``command`` to ``node`` (one of :meth:`primaries`); its parsed reply."""
        return self.client.execute_command(*command)

    def memory_info(self) -> list[tuple[str, str, int, int]]:
        """``(node, maxmemory-policy, maxmemory, evicted_keys)`` of every primary, from
        ``INFO memory`` and ``INFO stats`` (raises what redis-py raises). A standalone or
        Sentinel primary is named ``default``, a cluster's by host and port."""
        found = []
        for node in self.primaries():
            memory = self.command(node, "INFO", "memory")
            stats = self.command(node, "INFO", "stats")
            name = node.name if self.clustered else "default"
            found.append(
                (
                    name,
                    text(memory.get("maxmemory_policy", "unknown")),
                    int(memory.get("maxmemory", 0)),
                    int(stats.get("evicted_keys", 0)),
                )
            )
        return found

    def diagnose(self, probes: Sequence[Probe]) -> list[Row]:
        """(check, status, detail) rows for ``quota check``, over every primary:
        connectivity, latency, script load, the evaluation ``probes`` (one per algorithm
        in use, :func:`~django_quota.backends.probe.run_probe`), clock offset (the
        worst) and ``maxmemory-policy`` (any that can evict). ``status`` is ``ok``,
        ``warning`` or ``error``."""
        try:
            nodes = self.primaries()
            for node in nodes:
                self.command(node, "PING")
        except Exception as exc:
            error = self.classify(exc)
            label = f"{error.label}: " if error.label else ""  # maxclients, clusterdown…
            return [("connectivity", "error", f"{label}{error}")]
        by = f" by {len(nodes)} primaries" if self.clustered else ""
        rows: list[Row] = [("connectivity", "ok", f"PING answered{by}")]
        checks = (self._latency, self._scripts, self._evaluation, self._clock, self._maxmemory)
        return rows + [check(nodes, probes) for check in checks]

    def _latency(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            self.command(nodes[0], "PING")
            samples.append((time.perf_counter() - started) * 1000)
        return ("latency", "ok", f"{statistics.median(samples):.2f} ms median of 5 PINGs")

    def _scripts(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        try:
            loaded = self.preload()
        except BackendError as exc:
            return ("scripts", "error", str(exc))
        detail = ", ".join(f"{name} {sha}" for name, sha in loaded)
        if self.clustered:
            detail = f"{detail} (on {len(nodes)} primaries)"
        return ("scripts", "ok", detail)

    def _evaluation(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        return run_probe(self, probes, self.client.delete)

    def _clock(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        try:
            offsets = []
            for node in nodes:
                seconds, micros = self.command(node, "TIME")
                offsets.append((int(seconds) + int(micros) / 1e6 - time.time()) * 1000)
        except Exception as exc:
            return ("clock offset", "warning", f"TIME failed: {exc}")
        worst = max(offsets, key=abs)
        status = "ok" if abs(worst) < 1000 else "warning"
        against = "worst primary" if self.clustered else "Redis TIME"
        return ("clock offset", status, f"{worst:+.1f} ms ({against} - this host)")

    def _maxmemory(self, nodes: list[Any], probes: Sequence[Probe]) -> Row:
        try:
            found = []
            for node in nodes:
                config = self.command(node, "CONFIG GET", "maxmemory*")
                policy = text(config.get("maxmemory-policy", "unknown"))
                found.append((node, policy, int(text(config.get("maxmemory", "0")))))
        except Exception as exc:
            return ("maxmemory-policy", "warning", f"CONFIG GET not allowed: {exc}")
        evicting = [
            (f"{node.name}: " if self.clustered else "") + f"{policy} with maxmemory {limit}"
            for node, policy, limit in found
            if policy != "noeviction" and limit != 0
        ]
        if evicting:
            return (
                "maxmemory-policy",
                "warning",
                "; ".join(evicting) + " can evict live counters, which resets limits; "
                "use noeviction for the rate-limit database",
            )
        if self.clustered:
            return ("maxmemory-policy", "ok", "no primary can evict counters")
        _, policy, limit = found[0]
        return ("maxmemory-policy", "ok", f"{policy} (maxmemory {limit})")
