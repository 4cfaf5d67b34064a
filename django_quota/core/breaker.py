"""A circuit breaker for the backend: after ``threshold`` consecutive failures the
backend is skipped for ``cool_down`` seconds; then one evaluation probes it, and its
result closes or reopens the breaker. Pure and clock-injected; the limiter owns one per
backend node (``django_quota.core.admission.NodeGuard``)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerError:
    """One recorded backend failure: when (epoch seconds), its reason, the driver's
    message, and its label when it has a name of its own (``maxclients``,
    ``clusterdown``, ``tryagain``; ``docs/failures.md``), else ``""``."""

    at: float
    reason: str
    detail: str
    label: str = ""


class CircuitBreaker:
    """Thread-safe breaker state (``closed``, ``open``, ``half_open``).

    ``allow()`` says whether to call the backend now; ``success()`` and ``failure()``
    report what the call did. Only failures the caller counts (timeouts, unavailability,
    indeterminate calls) should be reported; ``NOSCRIPT`` never reaches here.
    """

    def __init__(
        self,
        threshold: int = 5,
        cool_down: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        keep_errors: int = 20,
        recent_errors: deque[BreakerError] | None = None,
    ) -> None:
        self.threshold = threshold
        self.cool_down = cool_down
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self._probe_started = 0.0
        #: When (``clock``) a call that the node answered last started: a lower bound of
        #: when the node last answered (-inf: never).
        self.answered_at = float("-inf")
        #: Recent failures, of every kind (:meth:`failure` and :meth:`note`), newest last;
        #: possibly shared with other breakers of the same limiter.
        self.recent_errors: deque[BreakerError] = (
            recent_errors if recent_errors is not None else deque(maxlen=keep_errors)
        )

    @property
    def state(self) -> str:
        """The current state, ``open`` turning ``half_open`` once the cool-down passed."""
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.cool_down:
                return HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """True when the backend may be called now (closed, or this caller is the probe).

        A probe that reported nothing for a whole cool-down (its caller was cancelled, or
        died) is presumed lost and another caller becomes the probe: the breaker never
        stays half-open for good.
        """
        if self._state == CLOSED:  # the common case needs no lock: one attribute read
            return True
        with self._lock:
            if self._state == CLOSED:
                return True
            now = self._clock()
            if self._state == OPEN and now - self._opened_at >= self.cool_down:
                self._state = HALF_OPEN
                self._probing = False
            if self._state == HALF_OPEN and (
                not self._probing or now - self._probe_started >= self.cool_down
            ):
                self._probing = True
                self._probe_started = now
                return True
            return False

    def success(self) -> str | None:
        """Record a successful call; return the new state when it changed."""
        if self._state == CLOSED and self._failures == 0 and not self._probing:
            return None  # nothing to change: the common case takes no lock
        with self._lock:
            self._failures = 0
            self._probing = False
            if self._state != CLOSED:
                self._state = CLOSED
                return CLOSED
            return None

    def answered(self, started: float) -> None:
        """Record that the node answered a call started at ``started`` (``clock``
        seconds): its connections work. One attribute write, no lock: a race keeps one of
        two close times."""
        if started > self.answered_at:
            self.answered_at = started

    def answering(self) -> bool:
        """Whether the node answered a call started within the last ``cool_down``
        seconds (docs/failures.md, "The circuit breaker")."""
        return self._clock() - self.answered_at < self.cool_down

    def note(self, reason: str, detail: str = "", label: str = "") -> None:
        """Record a failure that does not count against the node (the server answered:
        an error reply, a clock refusal; or it refused a new connection while its
        connections answer), for the status page."""
        with self._lock:
            self.recent_errors.append(BreakerError(self._wall_clock(), reason, detail, label))

    def failure(self, reason: str, detail: str = "", label: str = "") -> str | None:
        """Record a failed call; return the new state when it changed."""
        with self._lock:
            self.recent_errors.append(BreakerError(self._wall_clock(), reason, detail, label))
            self._failures += 1
            self._probing = False
            if self._state == HALF_OPEN or (
                self._state == CLOSED and self._failures >= self.threshold
            ):
                self._state = OPEN
                self._opened_at = self._clock()
                return OPEN
            return None

    def reset(self) -> None:
        """Back to closed, forgetting failures (settings changed)."""
        with self._lock:
            self._state = CLOSED
            self._failures = 0
            self._probing = False
            self.answered_at = float("-inf")
            self.recent_errors.clear()
