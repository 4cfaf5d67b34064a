"""What guards one backend node: a bound on concurrent evaluations (``MAX_INFLIGHT``)
that a caller waits on for the rest of its ``DEADLINE``, and the node's circuit breaker.
Pure (stdlib only), clock-injected where it matters; the limiter owns one
:class:`NodeGuard` per node, per settings generation (``docs/failures.md``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from django_quota.core.breaker import BreakerError, CircuitBreaker

#: How long an async caller sleeps between looks at a full node (seconds).
ASYNC_POLL = 0.0005


class Slots:
    """At most ``size`` evaluations in flight at once, across threads and event loops.

    :meth:`acquire` waits up to ``timeout`` seconds for a slot; :meth:`aacquire` is its
    async twin, which never blocks the event loop (it polls every :data:`ASYNC_POLL`
    seconds while the node is full).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._used = 0
        self._waiting = 0  # threads inside acquire's wait: release notifies only then
        # The fast paths take the lock itself (a C-level context manager); the
        # condition's own __enter__ and __exit__ are Python calls around the same lock.
        self._lock = threading.Lock()
        self._condition = threading.Condition(self._lock)

    @property
    def in_use(self) -> int:
        """Slots taken now."""
        return self._used

    def try_acquire(self) -> bool:
        """Take a slot if one is free now."""
        with self._lock:
            if self._used >= self.size:
                return False
            self._used += 1
            return True

    def acquire(self, timeout: float) -> bool:
        """Take a slot, waiting at most ``timeout`` seconds; False when none freed up."""
        with self._lock:
            if self._used < self.size:
                self._used += 1
                return True
            if timeout <= 0:
                return False
            deadline = time.monotonic() + timeout
            self._waiting += 1
            try:
                while self._used >= self.size:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._condition.wait(remaining):
                        if self._used < self.size:
                            break
                        return False
            finally:
                self._waiting -= 1
            self._used += 1
            return True

    async def aacquire(self, timeout: float) -> bool:
        """Async twin of :meth:`acquire`."""
        if self.try_acquire():
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(ASYNC_POLL)
            if self.try_acquire():
                return True
        return False

    def release(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._used -= 1
            if self._waiting:
                self._condition.notify()


class NodeGuard:
    """One node's admission: its in-flight :class:`Slots` and its :class:`CircuitBreaker`.

    ``name`` is the node (``host:port`` of a cluster primary, or ``"default"``).
    ``recent_errors`` is shared by every guard of one limiter, so that the status page
    shows each failure, of every kind, once.
    """

    def __init__(
        self,
        name: str,
        *,
        max_inflight: int,
        threshold: int,
        cool_down: float,
        recent_errors: deque[BreakerError],
    ) -> None:
        self.name = name
        self.slots = Slots(max_inflight)
        self.breaker = CircuitBreaker(threshold, cool_down, recent_errors=recent_errors)
