"""What the Redis and Redis Cluster backends share: the script calls a plan is made of,
the one loop that runs a script with ``EVALSHA`` and recovers ``NOSCRIPT``, the drivers
that run a plan synchronously or under asyncio, and the one place where redis-py's
exceptions become the failure reasons of ``docs/failures.md``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from redis import exceptions as redis_exceptions

from django_quota.core.errors import BackendError
from django_quota.core.model import new_tuple
from django_quota.core.outcome import (
    BACKEND_ERROR,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    INDETERMINATE,
)
from django_quota.core.protocol import GroupReply, GroupRequest, parse_reply, reset_keys
from django_quota.scripts import ScriptSource, load

#: EVALSHA attempts when SCRIPT FLUSH keeps racing the reload (each one ran nothing).
NOSCRIPT_ATTEMPTS = 8

_CONNECT_ERRORS = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError)
#: Replies that say the server refuses this client, whatever it sends: never the fallback.
_REFUSALS = (
    redis_exceptions.AuthenticationError,
    redis_exceptions.AuthorizationError,
    redis_exceptions.NoPermissionError,
    redis_exceptions.ResponseError,
)


class ConnectFailed(redis_exceptions.ConnectionError):
    """Raised by our pools when no connection could be had: nothing was written.

    ``timed_out`` tells a connect timeout from a refusal (or a full pool).
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.timed_out = isinstance(cause, redis_exceptions.TimeoutError | TimeoutError)


def is_connect_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised while a connection was being had, means nothing was
    written (so it becomes :class:`ConnectFailed`). Authentication and permission replies
    of the handshake are not: the server answered, and refused this client."""
    return isinstance(exc, _CONNECT_ERRORS) and not isinstance(exc, _REFUSALS)


def classify(exc: BaseException) -> BackendError:
    """Map a redis-py exception to its failure reason (``docs/failures.md``).

    A failure to get a connection (refused, unreachable, pool exhausted) is
    ``backend_unavailable``, a connect timeout ``backend_timeout``: nothing was written.
    A ``LOADING`` reply is ``backend_unavailable`` (the command did not run). A timeout or
    a lost connection once a connection was had is ``indeterminate``: the command may
    have run. ``WRONGPASS``, ``NOAUTH``, ``NOPERM``, ``OOM`` and every other error reply
    (``BUSY``, ``READONLY``…) are ``backend_error``: the server answered, so the local
    fallback never takes over from a misconfigured one.
    """
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, ConnectFailed):
        reason = BACKEND_TIMEOUT if exc.timed_out else BACKEND_UNAVAILABLE
    elif isinstance(exc, redis_exceptions.BusyLoadingError):
        reason = BACKEND_UNAVAILABLE
    elif isinstance(exc, _REFUSALS):
        reason = BACKEND_ERROR
    elif isinstance(exc, _CONNECT_ERRORS):  # the built-in TimeoutError is an OSError
        reason = INDETERMINATE
    else:
        reason = BACKEND_ERROR
    return BackendError(reason, f"{type(exc).__name__}: {exc}")


class Call(NamedTuple):
    """One script run of a plan: the script's name, its KEYS and its ARGV. A named tuple:
    one is made per decision, and a tuple is the cheapest record to make."""

    script: str
    keys: Sequence[str]
    args: Sequence[int | str | bytes]


def evaluate_call(request: GroupRequest) -> Call:
    """The ``evaluate.lua`` call deciding ``request``."""
    return new_tuple(Call, ("evaluate", request.keys(), request.args()))


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

    def run(self, call: Call) -> Any:
        """Run one script call; its raw reply (raises :class:`BackendError`)."""
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
    """Every script by name."""
    return {name: load(name) for name in ("evaluate", "reset", "refund")}
