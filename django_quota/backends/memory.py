"""The memory backend: the core's Python model behind a bounded map and a lock.

Process-local: with several processes each holds its own counters (a system check warns
when ``DEBUG`` is False). Also the engine of ``LOCAL_FALLBACK``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from django_quota.core.calls import GroupResult, PolicyCall, State
from django_quota.core.errors import BackendError
from django_quota.core.leases import release_leases
from django_quota.core.model import decide_one, evaluate_group
from django_quota.core.outcome import BACKEND_MODE_MEMORY, BACKEND_UNAVAILABLE
from django_quota.core.protocol import GroupReply, GroupRequest, Probe, ReleaseRequest
from django_quota.core.refunds import RefundRequest, refund_counter
from django_quota.core.windows import COUNT_FIELDS, EXTRA_FIELDS, Log, new_tuple


def wall_clock_ms() -> int:
    """Milliseconds since the epoch, floored (as the scripts floor Redis ``TIME``)."""
    return time.time_ns() // 1_000_000


class _Entry:
    """One counter: its numbers, its evaluation-id ledger, a sliding log's lists and when
    it expires (wall clock, ms), as one Redis counter with a TTL (the lists expire with it:
    a unit that has left the window is never counted, whenever it is dropped)."""

    __slots__ = ("expires_at", "logs", "records", "state")

    def __init__(
        self, state: State, records: bytes, expires_at: int, logs: tuple[Log, ...] = ()
    ) -> None:
        self.state = state
        self.records = records
        self.expires_at = expires_at
        self.logs = logs


class MemoryBackend:
    """Counters in a dict bounded by ``max_entries`` live counters.

    When full, expired counters are dropped; if none has expired the evaluation fails
    with ``backend_unavailable`` (live counters are never evicted). Each counter holds
    its own bounded evaluation-id ledger, as in Redis.
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
        self._counters: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._counters)

    def _entry(self, key: str, now_ms: int) -> _Entry | None:
        entry = self._counters.get(key)
        if entry is not None and entry.expires_at <= now_ms:
            del self._counters[key]
            return None
        return entry

    def _make_room(self, needed: int, now_ms: int) -> None:
        if len(self._counters) + needed <= self.max_entries:
            return
        expired = [key for key, entry in self._counters.items() if entry.expires_at <= now_ms]
        for key in expired:
            del self._counters[key]
        if len(self._counters) + needed > self.max_entries:
            raise BackendError(
                BACKEND_UNAVAILABLE, f"memory backend full ({self.max_entries} live counters)"
            )

    def evaluate(self, request: GroupRequest) -> GroupReply:
        """Decide ``request`` with the Python model under the lock (atomic per process)."""
        status, results, _ = self.decide(request)
        return new_tuple(GroupReply, (status, results))

    def decide(self, request: GroupRequest) -> GroupResult:
        """:meth:`evaluate`, answered with the model's own result, its writes applied:
        the limiter reads its status and results as a reply's, without a copy."""
        calls = request.calls
        if len(calls) == 1 and calls[0].short and not request.may_repeat:
            return self.decide_call(
                request.counters[0],
                calls[0],
                request.now_ms,
                request.peek,
                request.max_regression_ms,
                request.cleanup_grace_ms,
                request.fingerprint,
                request.dedup_ttl_ms,
            )
        clock_now = self._clock_ms()
        now_ms = clock_now if request.now_ms is None else request.now_ms
        counters = self._counters
        keys = request.counters
        with self._lock:
            entries: list[_Entry | None] = []
            for key in keys:
                entry = counters.get(key)
                if entry is not None and entry.expires_at <= clock_now:
                    del counters[key]
                    entry = None
                entries.append(entry)
            if len(entries) == 1:  # the common call, without three more lists
                only = entries[0]
                # A counter that does not exist: no state, an empty ledger, no logs (the
                # tuples are constants: nothing is built for them).
                states: Sequence[State | None] = (None,) if only is None else (only.state,)
                records: Sequence[bytes] = (b"",) if only is None else (only.records,)
                logs: Sequence[tuple[Log, ...]] = ((),) if only is None else (only.logs,)
            else:
                states = [None if entry is None else entry.state for entry in entries]
                records = [b"" if entry is None else entry.records for entry in entries]
                logs = [() if entry is None else entry.logs for entry in entries]
            decided = evaluate_group(  # positional: the hot path's call
                request.calls,
                states,
                now_ms,
                request.peek,
                request.max_regression_ms,
                request.cleanup_grace_ms,
                records,
                request.fingerprint,
                request.may_repeat,
                request.dedup_ttl_ms,
                logs,
                request.now_ms is None,
            )
            writes = decided.writes
            if writes and None in entries:  # room for every new counter, before any write
                self._make_room(sum(entries[write.index] is None for write in writes), clock_now)
            for write in writes:
                old = entries[write.index]
                if old is None:
                    counters[keys[write.index]] = _Entry(
                        write.state, write.records, clock_now + write.ttl_ms, write.logs
                    )
                    continue
                old.state = write.state
                old.records = write.records
                old.logs = write.logs
                # Expiry follows the wall clock, like a Redis TTL, whatever `now` was used;
                # a write that keeps its expiry keeps the entry's (KEEPTTL).
                if not write.keep_ttl:
                    old.expires_at = clock_now + write.ttl_ms
        return decided

    def decide_call(
        self,
        key: str,
        call: PolicyCall,
        now_ms: int | None,
        peek: bool,
        max_regression_ms: int,
        cleanup_grace_ms: int,
        fingerprint: bytes,
        dedup_ttl_ms: int,
    ) -> GroupResult:
        """:meth:`decide` of the common group, one ``call`` (its :attr:`~PolicyCall.short`
        holds, and the evaluation repeats none) on counter ``key``, that the model decides
        with :func:`~django_quota.core.model.decide_one`: its one counter, no lists. The
        arguments are the request's fields (``now_ms`` None: this backend's clock).

        The lock is taken with ``acquire``/``release`` rather than ``with``, which looks up
        and calls ``__enter__`` and ``__exit__``: kept because it moves a goal (STYLE.md,
        "Speed"). With the outcome count's lock taken the same way
        (:meth:`django_quota.metrics._Counts.count_outcome`), a memory decision's Python
        instructions (``benchmarks/python_instructions.py``) went from 79,621 to 77,470
        (-2.7 %; about 1,070 for each lock)."""
        clock_now = self._clock_ms()
        server_clock = now_ms is None
        if now_ms is None:
            now_ms = clock_now
        counters = self._counters
        lock = self._lock
        lock.acquire()
        try:
            entry = counters.get(key)
            if entry is not None and entry.expires_at <= clock_now:
                del counters[key]
                entry = None
            decided = decide_one(  # positional: the hot path's call
                call,
                None if entry is None else entry.state,
                now_ms,
                peek,
                max_regression_ms,
                cleanup_grace_ms,
                b"" if entry is None else entry.records,
                fingerprint,
                dedup_ttl_ms,
                server_clock,
            )
            writes = decided.writes
            if writes:
                write = writes[0]
                if entry is None:
                    self._make_room(1, clock_now)
                    counters[key] = _Entry(write.state, write.records, clock_now + write.ttl_ms)
                else:
                    entry.state = write.state
                    entry.records = write.records
                    if not write.keep_ttl:  # as above: a Redis TTL, or KEEPTTL
                        entry.expires_at = clock_now + write.ttl_ms
        finally:
            lock.release()
        return decided

    async def aevaluate(self, request: GroupRequest) -> GroupReply:
        """Async twin: the model never blocks on I/O, so it runs inline."""
        return self.evaluate(request)

    def reset(self, counter: str, window_count: int) -> int:
        """Forget ``counter``'s numbers (its evaluation-id ledger stays, as ``reset.lua``
        keeps it); return how many windows had state."""
        with self._lock:
            entry = self._entry(counter, self._clock_ms())
            if entry is None:
                return 0
            state = entry.state
            had = sum(1 for index in range(1, window_count + 1) if COUNT_FIELDS[index] in state)
            if entry.logs and "t" not in state:  # a concurrency policy's leases
                had = window_count
            state.pop("t", None)
            entry.logs = ()
            for index in range(1, window_count + 1):
                state.pop(COUNT_FIELDS[index], None)
                state.pop(EXTRA_FIELDS[index], None)
            if not state and not entry.records:
                del self._counters[counter]
            return had

    async def areset(self, counter: str, window_count: int) -> int:
        """Async twin of :meth:`reset`."""
        return self.reset(counter, window_count)

    def release(self, request: ReleaseRequest) -> int:
        """Free the leases one evaluation acquired from a concurrency policy (the model of
        ``release.lua``); the units released."""
        with self._lock:
            clock_now = self._clock_ms()
            now = clock_now if request.now_ms is None else request.now_ms
            entry = self._entry(request.counter, clock_now)
            if entry is None:
                return 0
            released, kept, ttl = release_leases(
                entry.logs, now, request.fingerprint, request.cleanup_grace_ms
            )
            if kept is None:
                return released
            if not kept:
                del self._counters[request.counter]
            else:
                entry.logs = (kept,)
                entry.expires_at = clock_now + ttl
            return released

    async def arelease(self, request: ReleaseRequest) -> int:
        """Async twin of :meth:`release`."""
        return self.release(request)

    def refund(self, request: RefundRequest) -> int:
        """Undo one evaluation's charge on each counter of the request, at most once (the
        model of ``refund.lua``, :func:`~django_quota.core.refunds.refund_counter`); the
        units refunded. The counters' expiries stay."""
        units = 0
        with self._lock:
            clock_now = self._clock_ms()
            now = clock_now if request.now_ms is None else request.now_ms
            for counter, call in zip(request.counters, request.calls, strict=True):
                entry = self._entry(counter, clock_now)
                if entry is None:
                    continue
                found = refund_counter(
                    call, entry.state, entry.records, entry.logs, now, request.fingerprint,
                    request.since_ms,
                )
                if found is not None:
                    entry.state, entry.records, entry.logs = found.state, found.records, found.logs
                    units += found.units
        return units

    async def arefund(self, request: RefundRequest) -> int:
        """Async twin of :meth:`refund`."""
        return self.refund(request)

    def peek_state(self, counter: str) -> State | None:
        """The raw stored numbers of ``counter`` (for ``quota inspect`` and tests)."""
        with self._lock:
            entry = self._entry(counter, self._clock_ms())
            return None if entry is None else dict(entry.state)

    def peek_logs(self, counter: str) -> tuple[Log, ...]:
        """The sliding-log lists of ``counter``, one per window (``()`` when none)."""
        with self._lock:
            entry = self._entry(counter, self._clock_ms())
            return () if entry is None else entry.logs

    def peek_records(self, counter: str) -> bytes:
        """The evaluation-id ledger of ``counter`` (``b""`` when none; for tests)."""
        with self._lock:
            entry = self._entry(counter, self._clock_ms())
            return b"" if entry is None else entry.records

    def ttl_ms(self, counter: str) -> int:
        """Milliseconds until ``counter`` expires; -2 when it does not exist (as PTTL)."""
        with self._lock:
            now = self._clock_ms()
            entry = self._entry(counter, now)
            return -2 if entry is None else entry.expires_at - now

    def preload(self) -> list[tuple[str, str]]:
        """Nothing to load: the memory backend runs the Python model."""
        return []

    def diagnose(self, probes: Sequence[Probe]) -> list[tuple[str, str, str]]:
        """(check, status, detail) rows for ``quota check`` (the probe has nothing to
        prove here: the model runs in this process)."""
        return [
            ("backend", "ok", f"memory: process-local, {len(self)} of {self.max_entries} "
                              "counters in use"),
        ]

    def clear(self) -> None:
        """Forget every counter."""
        with self._lock:
            self._counters.clear()

    def close(self) -> None:
        """Nothing to release."""
