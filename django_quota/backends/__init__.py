"""Backends: where counters live. I/O only; the arithmetic is the core's (memory) or the
Lua scripts' (redis)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

from django_quota.core.protocol import GroupReply, GroupRequest


class Backend(Protocol):
    """What the limiter needs of a backend.

    Methods raise :class:`django_quota.core.errors.BackendError` (with a failure reason
    of ``docs/failures.md``) for every failure; nothing else escapes. ``evaluate`` is
    one atomic decision without the limiter's admission control (in-flight bound,
    circuit breaker): the memory backend's path, and what ``quota inspect`` uses.
    """

    mode: str

    def evaluate(self, request: GroupRequest) -> GroupReply:
        """Decide ``request`` in one atomic step."""
        ...

    async def aevaluate(self, request: GroupRequest) -> GroupReply:
        """Async twin of :meth:`evaluate`."""
        ...

    def reset(self, counter: str, window_count: int) -> int:
        """Delete one counter; return how many of its windows had state."""
        ...

    async def areset(self, counter: str, window_count: int) -> int:
        """Async twin of :meth:`reset`."""
        ...

    def ttl_ms(self, counter: str) -> int:
        """Milliseconds until ``counter`` expires (-2: none). For ``quota inspect``."""
        ...

    def preload(self) -> list[tuple[str, str]]:
        """Load every script where scripts run; return (name, SHA1) pairs."""
        ...

    def close(self) -> None:
        """Release connections (called when settings change)."""
        ...


class ScriptBackend(Backend, Protocol):
    """A backend that runs Lua scripts on one or more nodes (Redis, Sentinel, Cluster).

    The limiter drives :meth:`plan` itself, running each call with :meth:`run` (or
    :meth:`arun`) inside the in-flight bound and circuit breaker of the node
    :meth:`node_of` names.
    """

    def node_of(self, call: Any) -> str:
        """The node a call runs on (``"default"`` for a single primary)."""
        ...

    def plan(self, request: GroupRequest) -> Generator[Any, Any, GroupReply]:
        """The calls deciding ``request``: yields each, receives its raw reply (failures
        thrown in as ``BackendError``), returns the reply."""
        ...

    def run(self, call: Any) -> Any:
        """Run one call; its raw reply."""
        ...

    async def arun(self, call: Any) -> Any:
        """Async twin of :meth:`run`."""
        ...
