"""Backends: where counters live. I/O only; the arithmetic is the core's (memory) or the
Lua scripts' (redis)."""

from __future__ import annotations

from typing import Protocol

from django_quota.core.protocol import GroupReply, GroupRequest


class Backend(Protocol):
    """What the limiter needs of a backend.

    Methods raise :class:`django_quota.core.errors.BackendError` (with a contract
    reason) for every failure; nothing else escapes.
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
