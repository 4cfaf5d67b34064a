"""The denial cache (``QUOTA["DENIAL_CACHE"]``, ``docs/failures.md``): a group that Redis
refused is answered again in this process, without a backend call, for as long as its
numbers can be told exactly from the refusal's.

A refused group charged nothing, so until some counter of the group is written again its
stored state is the one the refusal read, and the numbers of every later evaluation of
the same policies, identities and cost follow from time alone. This module says how, for
every algorithm (``docs/arithmetic.md``): from the refusal at ``now`` until ``now + hold``
(:func:`hold_ms`), each window keeps its ``remaining`` and every time it reports
(``reset_after``, ``retry_after``, ``replenish_after``) shrinks by the milliseconds
elapsed (:func:`advanced`), and every policy keeps its status. ``hold`` is the first
moment a number would move otherwise:

* a fixed window or sliding window counter rolls over (``reset_after``);
* a window's ``remaining`` grows (``replenish_after``, when something is counted): a
  token bucket's next token, a sliding log's oldest unit leaving, a sliding window
  counter's estimate dropping;
* a window stops refusing (``retry_after``: never before the above, kept as a bound).

Nothing here knows Django, Redis or the settings: the limiter decides which groups to
remember and when to forget them (``django_quota.engine``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from django_quota.core.calls import GROUP_DECIDED, GroupResult, PolicyResult
from django_quota.core.policy import CONCURRENCY, FIXED_WINDOW, SLIDING_WINDOW
from django_quota.core.protocol import GroupReply, GroupRequest
from django_quota.core.windows import WindowResult

#: A hold longer than any window can give (ms): the entry then lives ``MAX_TTL``.
UNBOUNDED_MS = 2**62

#: What identifies a group's evaluation: its counter keys (policy, revision, identity)
#: and each call's packed arguments (algorithm, enforcement, cost, every window's limit,
#: period and capacity).
Key = tuple[object, ...]


def hold_ms(algorithm: str, windows: Sequence[WindowResult]) -> int:
    """How long (ms) after a refusal the numbers of one policy's uncharged ``windows``
    stay those :func:`advanced` gives: the first roll-over of a fixed window or sliding
    window counter, the first growth of a ``remaining`` (``replenish_after``, when
    positive) and the first window that stops refusing (``retry_after``), whichever
    comes first; :data:`UNBOUNDED_MS` when none of those will happen (nothing is
    counted)."""
    hold = UNBOUNDED_MS
    rolls = algorithm in (FIXED_WINDOW, SLIDING_WINDOW)
    for window in windows:
        if rolls and window.reset_after_ms < hold:
            hold = window.reset_after_ms
        if 0 < window.replenish_after_ms < hold:
            hold = window.replenish_after_ms
        if 0 <= window.retry_after_ms < hold:
            hold = window.retry_after_ms
    return hold


def advanced(result: PolicyResult, elapsed_ms: int) -> PolicyResult:
    """``result`` as the same state reads ``elapsed_ms`` later, ``0 <= elapsed_ms <
    hold`` (:func:`hold_ms`): the same status and ``remaining``, every positive time
    shorter by ``elapsed_ms`` (a time of 0, or a ``retry_after`` of -1, stays)."""
    if elapsed_ms == 0:
        return result
    windows = tuple(
        WindowResult(
            window.remaining,
            window.reset_after_ms - elapsed_ms if window.reset_after_ms > 0 else 0,
            window.retry_after_ms - elapsed_ms if window.retry_after_ms >= 0 else -1,
            window.replenish_after_ms - elapsed_ms if window.replenish_after_ms > 0 else 0,
        )
        for window in result.windows
    )
    return PolicyResult(result.status, result.now_ms + elapsed_ms, windows)


def key_of(request: GroupRequest) -> Key:
    """The cache key of ``request``'s group (:data:`Key`)."""
    calls = request.calls
    if len(calls) == 1:
        return (request.counters, calls[0].packed)
    return (request.counters, *(call.packed for call in calls))


class Denial(NamedTuple):
    """A remembered refusal: the ``now_ms`` its request gave (None: the backend's clock),
    ``sent_at`` (this process's monotonic clock, seconds) just before the request was
    sent, ``expires`` (the same clock) after which it is never used, the reply's
    results, and each one's :func:`hold_ms`."""

    now_ms: int | None
    sent_at: float
    expires: float
    results: tuple[PolicyResult, ...]
    holds: tuple[int, ...]


class DenialCache:
    """Refusals of this process by group (:func:`key_of`), at most ``max_entries``, the
    least recently used dropped first, each used at most ``max_ttl`` seconds.

    :meth:`answer` reads without a lock (one dict lookup; a recency update that another
    thread's removal beats is skipped); :meth:`remember`, :meth:`forget` and
    :meth:`clear` take it. ``counters`` maps each counter key of a remembered group to
    the keys of the groups it is in: empty, it tells the limiter in one test that no
    write can concern the cache.
    """

    def __init__(self, max_entries: int, max_ttl: float) -> None:
        self.max_entries = max_entries
        self.max_ttl = max_ttl
        self.entries: OrderedDict[Key, Denial] = OrderedDict()
        self.counters: dict[str, set[Key]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def answer(self, request: GroupRequest, monotonic_now: float) -> GroupReply | None:
        """The reply Redis would give ``request`` now, when a remembered refusal of its
        group tells it exactly, else None.

        On the backend's clock (``request.now_ms`` None) the backend's ``now`` is the
        refusal's plus the milliseconds elapsed on this process's monotonic clock since
        that request was sent, which is never earlier than the backend's own reading
        would be. On a client clock it is the request's ``now_ms`` (each counter's, when
        the refusal found a later stored time); a ``now_ms`` earlier than the refusal's
        is not answered.
        """
        key = key_of(request)
        found = self.entries.get(key)
        if found is None:
            return None
        if monotonic_now >= found.expires:
            self._drop(key, found)
            return None
        now_ms = request.now_ms
        results = []
        if now_ms is None:
            if found.now_ms is not None:
                return None
            elapsed = int((monotonic_now - found.sent_at) * 1000)
            for result, hold in zip(found.results, found.holds, strict=True):
                if elapsed >= hold:
                    return None
                results.append(advanced(result, elapsed))
        else:
            if found.now_ms is None or now_ms < found.now_ms:
                return None
            for result, hold in zip(found.results, found.holds, strict=True):
                elapsed = now_ms - result.now_ms if now_ms > result.now_ms else 0
                if elapsed >= hold:
                    return None
                results.append(advanced(result, elapsed))
        # Forgotten meanwhile by another thread: this answer still holds, as it was read.
        with contextlib.suppress(KeyError):
            self.entries.move_to_end(key)
        return GroupReply(GROUP_DECIDED, tuple(results))

    def remember(
        self, request: GroupRequest, results: Sequence[PolicyResult], sent_at: float
    ) -> bool:
        """Remember a refusal of ``request``'s group: ``results`` as Redis replied them,
        every policy enforced, nothing charged, the request sent at ``sent_at`` (monotonic
        seconds). False when nothing is worth remembering (no policy's numbers hold)."""
        holds = tuple(
            hold_ms(call.algorithm, result.windows)
            for call, result in zip(request.calls, results, strict=True)
        )
        shortest = min(holds)
        if shortest <= 0:
            return False
        expires = sent_at + self.max_ttl
        if request.now_ms is None and shortest < UNBOUNDED_MS:
            expires = min(expires, sent_at + shortest / 1000)
        key = key_of(request)
        denial = Denial(request.now_ms, sent_at, expires, tuple(results), holds)
        with self._lock:
            entries = self.entries
            if key in entries:
                entries.move_to_end(key)
            else:
                while len(entries) >= self.max_entries:
                    old_key, _ = entries.popitem(last=False)
                    self._unindex(old_key)
                for counter in request.counters:
                    self.counters.setdefault(counter, set()).add(key)
            entries[key] = denial
        return True

    def forget(self, counters: Iterable[str]) -> None:
        """Forget every refusal of a group holding one of ``counters`` (a counter was
        written, or may have been: its numbers are no longer the refusal's)."""
        index = self.counters
        found = [counter for counter in counters if counter in index]
        if not found:
            return
        with self._lock:
            for counter in found:
                for key in index.pop(counter, ()):
                    if self.entries.pop(key, None) is not None:
                        self._unindex(key)

    def clear(self) -> None:
        """Forget every refusal."""
        with self._lock:
            self.entries.clear()
            self.counters.clear()

    def _drop(self, key: Key, found: Denial) -> None:
        """Forget ``key``'s refusal ``found`` unless another thread replaced it."""
        with self._lock:
            if self.entries.get(key) is found:
                del self.entries[key]
                self._unindex(key)

    def _unindex(self, key: Key) -> None:
        """Remove ``key`` from the counter index (the lock is held)."""
        counters = key[0]
        assert isinstance(counters, tuple)
        index = self.counters
        for counter in counters:
            keys = index.get(counter)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del index[counter]


def hash_tag(counter: str) -> str:
    """The ``{hash tag}`` of a counter key (its Redis Cluster slot)."""
    return counter[counter.index("{") : counter.index("}") + 1]


def rememberable(
    request: GroupRequest, reply: GroupReply | GroupResult, *, shadow: bool, cluster: bool
) -> bool:
    """Whether a refusal Redis decided may be answered again (``docs/failures.md``): the
    group decided, no shadow policy in it, every policy enforced, none a concurrency
    policy (a release frees it, in any process), and on a Redis Cluster
    (``cluster``) one hash slot (a group split over slots reports its refunded policies'
    numbers best effort)."""
    if shadow or reply.status != GROUP_DECIDED:
        return False
    for call in request.calls:
        if not call.enforce:
            return False
        if call.algorithm == CONCURRENCY:  # a release frees it, in any process
            return False
    return not cluster or len({hash_tag(key) for key in request.counters}) == 1
