"""What the Redis and Redis Cluster backends share in running scripts: the script calls
a plan is made of, the one loop that runs a script with ``EVALSHA`` and recovers
``NOSCRIPT``, and the drivers that run a plan synchronously or under asyncio. Failures
become reasons in :mod:`django_quota.backends.failures`; the clients are kept by
:mod:`django_quota.backends.clients`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from redis import exceptions as redis_exceptions

from django_quota.backends.failures import CONNECT_ERRORS as CONNECT_ERRORS
from django_quota.backends.failures import ConnectFailed as ConnectFailed
from django_quota.backends.failures import classify as classify
from django_quota.backends.failures import deadline_spent as deadline_spent
from django_quota.backends.failures import is_connect_failure as is_connect_failure
from django_quota.backends.failures import mark_connect_failure as mark_connect_failure
from django_quota.core.errors import BackendError
from django_quota.core.outcome import BACKEND_ERROR
from django_quota.core.protocol import (
    GroupReply,
    GroupRequest,
    ReleaseRequest,
    parse_reply,
    reset_keys,
)
from django_quota.core.refunds import RefundRequest
from django_quota.core.windows import new_tuple
from django_quota.scripts import ScriptSource, all_scripts
from django_quota.scripts.shapes import SINGLE_WINDOW_SCRIPTS

#: EVALSHA attempts when SCRIPT FLUSH keeps racing the reload (each one ran nothing).
NOSCRIPT_ATTEMPTS = 8


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
        script = SINGLE_WINDOW_SCRIPTS.get(calls[0].algorithm, "evaluate")  # concurrency: none
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

    async def arun(self, call: Call, deadline: float | None = None) -> Any:
        """Async twin of :meth:`run`."""
        raise NotImplementedError

    def evaluate(self, request: GroupRequest) -> GroupReply:
        """Decide ``request``: its plan, driven here."""
        return drive(self.plan(request), self.run)

    async def aevaluate(self, request: GroupRequest) -> GroupReply:
        """Async twin of :meth:`evaluate`."""
        return await adrive(self.plan(request), self.arun)

    def release(self, request: ReleaseRequest) -> int:
        """Run ``release.lua``: free the leases one evaluation acquired from a concurrency
        policy (on a cluster, on its counter's slot); the units released."""
        return int(self.run(Call("release", (request.counter,), request.args())))

    async def arelease(self, request: ReleaseRequest) -> int:
        """Async twin of :meth:`release`."""
        return int(await self.arun(Call("release", (request.counter,), request.args())))

    def refund(self, request: RefundRequest) -> int:
        """Run ``refund.lua`` at most once (on a cluster, on its counter's slot); the
        units refunded."""
        return int(self.run(Call("refund", request.keys(), request.args())))

    async def arefund(self, request: RefundRequest) -> int:
        """Async twin of :meth:`refund`."""
        return int(await self.arun(Call("refund", request.keys(), request.args())))

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
