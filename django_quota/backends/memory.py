"""The memory backend: the core's Python model behind a bounded map and a lock.

Process-local: with several processes each holds its own counters (a system check warns
when ``DEBUG`` is False). Also the engine of ``LOCAL_FALLBACK``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from django_quota.core.errors import BackendError
from django_quota.core.model import State, evaluate_group
from django_quota.core.outcome import BACKEND_MODE_MEMORY, BACKEND_UNAVAILABLE
from django_quota.core.protocol import GroupReply, GroupRequest


def wall_clock_ms() -> int:
    """Milliseconds since the epoch, floored (as the scripts floor Redis ``TIME``)."""
    return time.time_ns() // 1_000_000


class MemoryBackend:
    """Counters in a dict bounded by ``max_entries`` live counters.

    When full, expired counters are dropped; if none has expired the evaluation fails
    with ``backend_unavailable`` (live counters are never evicted). Evaluation-id records
    live in a second map with the same bound, oldest dropped first (they only serve
    retries, which this backend never needs).
    """

    def __init__(
        self,
        max_entries: int,
        *,
        mode: str = BACKEND_MODE_MEMORY,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.mode = mode
        self.max_entries = max_entries
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._counters: dict[str, tuple[State, int]] = {}
        self._records: OrderedDict[str, tuple[list[int], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counters)

    def _state(self, key: str, now_ms: int) -> State | None:
        entry = self._counters.get(key)
        if entry is None:
            return None
        state, expires_at = entry
        if expires_at <= now_ms:
            del self._counters[key]
            return None
        return state

    def _make_room(self, needed: int, now_ms: int) -> None:
        if len(self._counters) + needed <= self.max_entries:
            return
        expired = [key for key, (_, expires_at) in self._counters.items() if expires_at <= now_ms]
        for key in expired:
            del self._counters[key]
        if len(self._counters) + needed > self.max_entries:
            raise BackendError(
                BACKEND_UNAVAILABLE, f"memory backend full ({self.max_entries} live counters)"
            )

    def evaluate(self, request: GroupRequest) -> GroupReply:
        """Decide ``request`` with the Python model under the lock (atomic per process)."""
        from django_quota.core.model import PolicyResult

        clock_now = self._clock_ms()
        now_ms = clock_now if request.now_ms is None else request.now_ms
        with self._lock:
            if not request.peek:
                stored = [self._records.get(key) for key in request.evaluation_keys]
                if all(entry is not None and entry[1] > clock_now for entry in stored):
                    results = tuple(
                        PolicyResult.decode(entry[0], count)
                        for entry, count in zip(stored, request.window_counts, strict=True)
                        if entry is not None
                    )
                    return GroupReply(False, True, results)
            states = [self._state(key, clock_now) for key in request.counters]
            group = evaluate_group(
                request.calls,
                states,
                now_ms,
                peek=request.peek,
                max_regression_ms=request.max_regression_ms,
                cleanup_grace_ms=request.cleanup_grace_ms,
            )
            if group.clock_unsafe:
                return GroupReply(True, False, ())
            new_keys = sum(
                1 for write in group.writes if request.counters[write.index] not in self._counters
            )
            self._make_room(new_keys, clock_now)
            for write in group.writes:
                # Expiry follows the wall clock, like a Redis TTL, whatever `now` the model used.
                self._counters[request.counters[write.index]] = (
                    write.state,
                    clock_now + write.ttl_ms,
                )
            if not request.peek:
                for key, result in zip(request.evaluation_keys, group.results, strict=True):
                    self._records[key] = (result.encode(), clock_now + request.dedup_ttl_ms)
                    self._records.move_to_end(key)
                while len(self._records) > self.max_entries:
                    self._records.popitem(last=False)
            return GroupReply(False, False, group.results)

    async def aevaluate(self, request: GroupRequest) -> GroupReply:
        """Async twin: the model never blocks on I/O, so it runs inline."""
        return self.evaluate(request)

    def reset(self, counter: str, window_count: int) -> int:
        """Forget ``counter``; return how many windows had state."""
        with self._lock:
            entry = self._counters.pop(counter, None)
        if entry is None or entry[1] <= self._clock_ms():
            return 0
        return sum(1 for index in range(1, window_count + 1) if f"c{index}" in entry[0])

    async def areset(self, counter: str, window_count: int) -> int:
        """Async twin of :meth:`reset`."""
        return self.reset(counter, window_count)

    def peek_state(self, counter: str) -> State | None:
        """The raw stored state of ``counter`` (for ``quota inspect`` and tests)."""
        with self._lock:
            return self._state(counter, self._clock_ms())

    def ttl_ms(self, counter: str) -> int:
        """Milliseconds until ``counter`` expires; -2 when it does not exist (as PTTL)."""
        with self._lock:
            entry = self._counters.get(counter)
            now = self._clock_ms()
            if entry is None or entry[1] <= now:
                return -2
            return entry[1] - now

    def preload(self) -> list[tuple[str, str]]:
        """Nothing to load: the memory backend runs the Python model."""
        return []

    def diagnose(self, probe_key: str) -> list[tuple[str, str, str]]:
        """(check, status, detail) rows for ``quota check``."""
        return [
            ("backend", "ok", f"memory: process-local, {len(self)} of {self.max_entries} "
                              "counters in use"),
        ]

    def clear(self) -> None:
        """Forget every counter and record."""
        with self._lock:
            self._counters.clear()
            self._records.clear()

    def close(self) -> None:
        """Nothing to release."""
