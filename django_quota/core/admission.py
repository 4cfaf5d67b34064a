"""What guards one backend node: a bound on concurrent evaluations (``MAX_INFLIGHT``)
that a caller waits on for the rest of its ``DEADLINE``, and the node's circuit breaker.
Pure (stdlib only), clock-injected where it matters; the limiter owns one
:class:`NodeGuard` per node, per settings generation (``docs/failures.md``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Final

from django_quota.core.breaker import BreakerError, CircuitBreaker
from django_quota.core.errors import BackendError, Blame
from django_quota.core.log import logger
from django_quota.core.outcome import BACKEND_TIMEOUT, BACKEND_UNAVAILABLE, INDETERMINATE

#: Failures that count for the breaker: the node could not be reached or did not answer.
BREAKER_REASONS = frozenset({BACKEND_TIMEOUT, BACKEND_UNAVAILABLE, INDETERMINATE})

class Slots:
    """At most ``size`` evaluations in flight at once, across threads and event loops.

    :meth:`acquire` waits up to ``timeout`` seconds for a slot; :meth:`aacquire` is its
    async twin, which never blocks the event loop (it polls every :attr:`ASYNC_POLL`
    seconds while the node is full).
    """

    #: How long an async caller sleeps between looks at a full node (seconds).
    ASYNC_POLL: Final = 0.0005

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
            await asyncio.sleep(self.ASYNC_POLL)
            if self.try_acquire():
                return True
        return False

    def release(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._used -= 1
            if self._waiting:
                self._condition.notify()


class Refused(BackendError):
    """The limiter itself did not call a node: its in-flight bound stayed full for the
    rest of ``DEADLINE``, or its circuit breaker is open. Not a failure of the node."""


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

    def admit(self, acquired: bool) -> None:
        """Let a call through once a slot is ``acquired``, or raise :class:`Refused` (no
        slot, or the breaker open: the slot is given back)."""
        if not acquired:
            raise Refused(BACKEND_UNAVAILABLE, f"MAX_INFLIGHT reached on {self.name}")
        if not self.breaker.allow():
            self.slots.release()
            raise Refused(BACKEND_UNAVAILABLE, f"circuit breaker open for {self.name}")

    def finish(self, error: BaseException | None, started: float) -> None:
        """End a call that :meth:`admit` let through: give its slot back and tell the
        breaker what it did (:meth:`account`; an exception that is no
        :class:`BackendError`, a cancellation say, tells it nothing)."""
        if error is None:
            # account(None, started) written out: the common case costs no further call.
            self.slots.release()
            breaker = self.breaker
            breaker.answered(started)
            state = breaker.success()
            if state is not None:
                logger.warning("quota circuit breaker %s for node %s", state, self.name)
            return
        if isinstance(error, BackendError):
            self.account(error, started)
        self.slots.release()

    def account(self, error: BackendError | None, started: float) -> None:
        """Tell the node's breaker what a call started at ``started`` did
        (``docs/failures.md``, "The circuit breaker"): only evidence that the node is
        unreachable or unresponsive counts; an answer, whatever it says, shows that its
        connections work; a new connection refused at ``maxclients`` counts only when none
        of them answered lately."""
        breaker = self.breaker
        if error is None:
            breaker.answered(started)
            state = breaker.success()
        else:
            blame = error.blame
            if blame is None:
                blame = Blame.NODE if error.reason in BREAKER_REASONS else Blame.NONE
            label = error.label or ""
            counted = blame == Blame.NODE or (
                blame == Blame.UNLESS_ANSWERING and not breaker.answering()
            )
            if counted:
                state = breaker.failure(error.reason, str(error), label)
            else:
                if blame == Blame.NONE:  # the node answered: it is reachable
                    breaker.answered(started)
                    state = breaker.success()
                else:  # refused a new connection while its connections answer, or
                    state = None  # DEADLINE spent before a command could be written
                breaker.note(error.reason, str(error), label)
            if label:
                logger.warning(
                    "quota node %s: reason=%s label=%s %s",
                    self.name,
                    error.reason,
                    label,
                    "(counted by its circuit breaker)" if counted else "(not counted: it answers)",
                )
        if state is not None:
            logger.warning("quota circuit breaker %s for node %s", state, self.name)
