"""The arithmetic of one window: its view at ``now``, admission and reported numbers.

:mod:`django_quota.core.model` decides groups with these, and
``django_quota/scripts/evaluate.lua`` mirrors them function by function;
:func:`window_result` also turns the script's replied views into the reported numbers on
the client. A window reads its counter's ``t``, ``c<i>`` and ``p<i>`` (the state layout:
:mod:`django_quota.core.model`).

The token bucket stores the deficit ``D = C*P - T`` where ``T`` is the token level
scaled by the period ``P`` (tokens * P), so refilling ``L`` tokens per ``P`` ms adds
exactly ``L`` scaled units per millisecond: integer arithmetic only, never a float rate.
A missing counter therefore reads as a full bucket and as empty windows alike. The
deficit is split into two numbers so that every stored number stays below 2**48 (six
bytes in Redis).

The sliding log keeps, beside the counter, one Redis list per window (its key:
:func:`~django_quota.core.protocol.log_key`), newest event first, two integers an event:
the ``now`` (ms) of an admission and ``c<i>`` just before it, so an event holds the units
between its number and the next newer one's (``c<i>`` for the newest). Admissions at one
``now`` share an event. So the units inside the window ``(now - P, now]`` are ``c<i>``
minus the number of the oldest event inside, the newest unit that must leave for a cost
to fit is found by a binary search on those numbers, and a charge trims every event that
has left: at most ``L`` events and ``L`` units stay, whatever the attempts, and a cost of
any size is one event. Counts are kept modulo :data:`LOG_MODULUS` (above any limit), so
they never grow past exact doubles; the differences read are always ``<= L``. The model
holds each list as a flat tuple in that same order (:data:`Log`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from django_quota.core.policy import (
    CONCURRENCY,
    FIXED_WINDOW,
    SLIDING_LOG,
    TOKEN_BUCKET,
    Window,
)

#: Builds a named tuple from a tuple of its fields: the hot path's results are built this
#: way, without the Python-level ``__new__`` a named tuple's constructor calls (several per
#: decision). Kept because it moves a goal (STYLE.md, "Speed"): the memory backend's
#: Python instructions per decision (``benchmarks/python_instructions.py``) are 144,796
#: with every ``new_tuple`` replaced by the constructor against 136,093 with it (-6.0 %;
#: both without :func:`~django_quota.core.outcome._builder`'s builders).
new_tuple = tuple.__new__

#: One window's sliding log, as its Redis list: newest event first, each event its time
#: (ms) then the window's unit count before it (``(t1, n1, t2, n2, ...)``).
Log = tuple[int, ...]
#: Sliding-log counts wrap at this (above every limit, far below 2**53).
LOG_MODULUS = 10**12

#: ``c<i>``/``p<i>`` field names, 1-based (index 0 unused).
COUNT_FIELDS = tuple(f"c{i}" for i in range(64))
EXTRA_FIELDS = tuple(f"p{i}" for i in range(64))


class WindowResult(NamedTuple):
    """One window after the decision; every time in milliseconds (a named tuple: the
    hot path builds one per window per decision).

    ``retry_after_ms`` is -1 unless this window denied; ``replenish_after_ms`` is the time
    until ``remaining`` next increases (0 when nothing is counted).
    """

    remaining: int
    reset_after_ms: int
    retry_after_ms: int
    replenish_after_ms: int


def floor_div(a: int, b: int) -> int:
    """``floor(a / b)`` for integers (the Lua twin corrects the double's rounding)."""
    return a // b


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -((-a) // b)


def _view(
    algorithm: str, window: Window, index: int, state: Mapping[str, int], now: int
) -> tuple[int, int]:
    """A window's state seen at ``now`` (after roll-over or refill), before this call:
    (used, prev). ``used`` is the fixed count, the sliding ``cur`` or the bucket's scaled
    deficit; ``prev`` the sliding window's previous count, else 0."""
    last = state.get("t")
    if last is None:
        return 0, 0
    period = window.period_ms
    count = state.get(COUNT_FIELDS[index], 0)
    if algorithm == FIXED_WINDOW:
        # the same window: now - now % P == last - last % P, one division each
        return (count if now // period == last // period else 0), 0
    extra = state.get(EXTRA_FIELDS[index], 0)
    if algorithm == TOKEN_BUCKET:
        deficit = count * period + extra
        elapsed = now - last
        if elapsed >= ceil_div(deficit, window.limit):
            return 0, 0
        return deficit - elapsed * window.limit, 0
    start = now - now % period
    stored_start = last - last % period
    if start == stored_start:
        return count, extra
    if start == stored_start + period:
        return 0, count
    return 0, 0


def _sliding_estimate(prev: int, cur: int, elapsed: int, period: int) -> int:
    return floor_div(prev * (period - elapsed), period) + cur


def sliding_wait(prev: int, cur: int, elapsed: int, period: int, target: int) -> int:
    """Smallest ``t >= 1`` (ms) after which the sliding estimate is ``<= target`` if
    nothing else arrives; ``target`` must be ``>= 0``.

    Within the current window the estimate is ``floor(prev * (P - e) / P) + cur`` with
    ``e`` growing; from the next window on it is ``floor(cur * (P - u) / P)``; two windows
    later it is 0. The estimate never increases with time, so the first solution of each
    piece, in order, is the answer.
    """
    room = target - cur
    if room >= 0:
        # prev * (P - e) <= (room + 1) * P - 1  <=>  e >= P - floor(((room + 1) * P - 1) / prev)
        needed = 0 if prev == 0 else period - floor_div((room + 1) * period - 1, prev)
        needed = max(needed, 0)
        if needed < period:
            return max(1, needed - elapsed)
    # Next window: prev' = cur, cur' = 0, u ms after its start.
    if cur == 0:
        offset = 0
    else:
        offset = max(0, period - floor_div((target + 1) * period - 1, cur))
    return max(1, period - elapsed + offset)


def allows(algorithm: str, window: Window, used: int, prev: int, now: int, cost: int) -> bool:
    """Whether ``cost`` fits in a window whose view before the call is (``used``,
    ``prev``: :func:`_view`, or a sliding log's used units) at ``now`` (ms)."""
    if algorithm == FIXED_WINDOW:
        return used + cost <= window.limit
    if algorithm == SLIDING_LOG:
        return used + cost <= window.limit
    period = window.period_ms
    if algorithm == TOKEN_BUCKET:
        return used + cost * period <= window.capacity * period
    return _sliding_estimate(prev, used, now % period, period) + cost <= window.limit


def window_result(
    algorithm: str, window: Window, used: int, prev: int, now: int, cost: int, charged: bool
) -> tuple[WindowResult, int]:
    """The reported numbers of one window of a fixed window, sliding window counter or
    token bucket, and its time to live (ms) after the call, from the window's view before
    it (``used``, ``prev``: :func:`_view`), ``now`` (ms), the cost and whether it charged.
    The script reports the view; every backend's numbers come from here."""
    period = window.period_ms
    limit = window.limit
    if algorithm == FIXED_WINDOW:
        reset_after = period - now % period
        count = used + cost if charged else used
        retry_after = -1 if used + cost <= limit else reset_after
        remaining = limit - count if count < limit else 0
        result = new_tuple(WindowResult, (remaining, reset_after, retry_after, reset_after))
        return result, reset_after
    if algorithm == TOKEN_BUCKET:
        capacity_scaled = window.capacity * period
        deficit = used + cost * period if charged else used
        remaining = floor_div(capacity_scaled - deficit, period)
        if remaining < 0:  # a deficit kept from a plan with a larger capacity
            remaining = 0
        reset_after = ceil_div(deficit, limit)
        wanted = used + cost * period
        retry_after = -1 if wanted <= capacity_scaled else ceil_div(wanted - capacity_scaled, limit)
        if remaining >= window.capacity:
            replenish = 0
        else:
            replenish = ceil_div(deficit - (capacity_scaled - (remaining + 1) * period), limit)
        result = new_tuple(WindowResult, (remaining, reset_after, retry_after, replenish))
        return result, reset_after
    if algorithm == CONCURRENCY:  # the view: held units and the oldest lease's wait
        return lease_result(window, used, prev, cost, charged)
    elapsed = now % period
    reset_after = period - elapsed
    cur = used + cost if charged else used
    estimate = _sliding_estimate(prev, used, elapsed, period)
    counted = estimate + cost if charged else estimate
    retry_after = (
        -1 if estimate + cost <= limit else sliding_wait(prev, used, elapsed, period, limit - cost)
    )
    replenish = 0 if counted == 0 else sliding_wait(prev, cur, elapsed, period, counted - 1)
    remaining = limit - counted if counted < limit else 0
    result = new_tuple(WindowResult, (remaining, reset_after, retry_after, replenish))
    return result, reset_after + period


@dataclass(frozen=True, slots=True)
class LogView:
    """A sliding log seen at ``now``: ``used`` units inside the window, held by the
    ``inside`` newest events; ``newest`` and ``oldest`` are the times of the newest event
    and of the oldest one inside (0 when ``inside`` is 0); ``events`` stored (-1: not
    read, as for a counter without ``t``)."""

    used: int
    inside: int
    newest: int
    oldest: int
    events: int


def _log_time(log: Log, event: int) -> int:
    """The time of the ``event``-th newest event (1-based), as ``LINDEX 2e-2``."""
    return log[2 * event - 2]


def _log_before(log: Log, event: int) -> int:
    """The window's count before the ``event``-th newest event, as ``LINDEX 2e-1``."""
    return log[2 * event - 1]


def log_units(count: int, log: Log) -> int:
    """Units a sliding log holds, expired ones included: ``count`` (``c<i>``) minus the
    oldest event's number (0 for an empty log)."""
    if not log:
        return 0
    return (count - log[-1]) % LOG_MODULUS


def _log_view(window: Window, count: int, log: Log, now: int) -> LogView:
    """The units of ``log`` inside ``(now - P, now]``: events are newest first, so the
    ones inside are a prefix, found by a binary search when the oldest has left."""
    events = floor_div(len(log), 2)
    if events == 0:
        return LogView(0, 0, 0, 0, 0)
    edge = now - window.period_ms  # a unit recorded at or before it has left
    newest = _log_time(log, 1)
    if newest <= edge:
        return LogView(0, 0, 0, 0, events)
    inside = events
    oldest = _log_time(log, events)
    if oldest <= edge:
        low, high = 1, events  # low is inside, high is not
        oldest = newest
        while high - low > 1:
            middle = floor_div(low + high, 2)
            time = _log_time(log, middle)
            if time > edge:
                low, oldest = middle, time
            else:
                high = middle
        inside = low
    used = (count - _log_before(log, inside)) % LOG_MODULUS
    return LogView(used, inside, newest, oldest, events)


def _log_wait(window: Window, view: LogView, count: int, log: Log, now: int, cost: int) -> int:
    """ms until ``cost`` fits in a window it does not fit now: until the unit of rank
    ``L - cost + 1`` (newest first) leaves, at its time ``+ P``. A cost above the limit
    never fits: then until the window is empty (a whole period when it is)."""
    if view.inside == 0:
        return window.period_ms
    rank = max(1, window.limit - cost + 1)
    low, high = 0, view.inside  # events 1..low hold fewer than rank units, 1..high enough
    while high - low > 1:
        middle = floor_div(low + high, 2)
        if (count - _log_before(log, middle)) % LOG_MODULUS >= rank:
            high = middle
        else:
            low = middle
    return _log_time(log, high) + window.period_ms - now


def _log_result(
    window: Window,
    view: LogView,
    count: int,
    log: Log,
    now: int,
    cost: int,
    charged: bool,
) -> tuple[WindowResult, int]:
    """A sliding log window's reported numbers and its time to live (ms) after the call:
    until the newest unit leaves (a whole period after a charge)."""
    period = window.period_ms
    limit = window.limit
    if charged:
        counted = view.used + cost
        reset_after = period
        replenish = period if view.inside == 0 else view.oldest + period - now
    else:
        counted = view.used
        reset_after = 0 if view.inside == 0 else view.newest + period - now
        replenish = 0 if view.inside == 0 else view.oldest + period - now
    retry_after = -1
    if view.used + cost > limit:
        retry_after = _log_wait(window, view, count, log, now, cost)
    remaining = limit - counted if counted < limit else 0
    return new_tuple(WindowResult, (remaining, reset_after, retry_after, replenish)), reset_after


# -- calendar windows ----------------------------------------------------------------------
# A fixed window's call with a calendar window (docs/policies.md, "Calendar windows")
# carries, per window, the boundaries b0 < b1 < b2 the client computed
# (core/calendar.py; 0, 0, 0 for an epoch-aligned window of the same call). Whoever
# decides places its own now between them; evaluate.lua mirrors these functions.


def calendar_place(bounds: tuple[int, ...], index: int, now: int, period: int) -> tuple[int, int]:
    """The window ``[start, end)`` holding ``now`` of window ``index`` (0-based) of a call
    whose flat ``bounds`` hold three numbers per window: ``[b0, b1)`` or ``[b1, b2)``;
    ``(0, 0)`` when ``now`` is in neither (clock unsafe). An epoch-aligned window
    (``b1 == 0``) is the period's multiple holding ``now``."""
    at = 3 * index
    b1 = bounds[at + 1]
    if b1 == 0:
        start = now - now % period
        return start, start + period
    if now < b1:
        if now >= bounds[at]:
            return bounds[at], b1
        return 0, 0
    b2 = bounds[at + 2]
    if now < b2:
        return b1, b2
    return 0, 0


def calendar_view(index: int, state: Mapping[str, int], start: int, end: int) -> tuple[int, int]:
    """A calendar call's window ``index`` (1-based) seen in ``[start, end)``: its stored
    count when the stored ``t`` is inside, else 0 (as :func:`_view`)."""
    last = state.get("t")
    if last is None or not start <= last < end:
        return 0, 0
    return state.get(COUNT_FIELDS[index], 0), 0


def calendar_result(
    window: Window, used: int, end: int, now: int, cost: int, charged: bool
) -> tuple[WindowResult, int]:
    """A calendar call's window's reported numbers and time to live (ms), as
    :func:`window_result` for a fixed window, but ending at ``end``."""
    limit = window.limit
    reset_after = end - now
    count = used + cost if charged else used
    retry_after = -1 if used + cost <= limit else reset_after
    remaining = limit - count if count < limit else 0
    return new_tuple(WindowResult, (remaining, reset_after, retry_after, reset_after)), reset_after


# Concurrency (docs/concurrency.md). A policy's leases, as its Redis sorted set holds them:
# one member per lease, the evaluation's fingerprint then its units (two bytes,
# big-endian), scored by its expiry (ms). The model holds them as a flat tuple of
# (expiry, fingerprint as an integer, units) triples in the set's order (score, then
# member), so that a fingerprint's member sorts as its integer does.

def lease_member(fingerprint: bytes, units: int) -> bytes:
    """The sorted-set member of a lease: ``fingerprint`` then ``units`` (2 bytes)."""
    return fingerprint + units.to_bytes(2, "big")  # the bytes of a lease's units


def lease_view(leases: Log, now: int) -> tuple[int, int]:
    """The leases held at ``now`` (those expiring after it): (units held, ms until the
    oldest held one expires, 0 when none)."""
    held = 0
    wait = 0
    for index in range(0, len(leases), 3):
        expiry = leases[index]
        if expiry > now:
            if held == 0:
                wait = expiry - now
            held += leases[index + 2]
    return held, wait


def holds_lease(leases: Log, fingerprint: int, now: int) -> bool:
    """Whether a lease of ``fingerprint`` (an integer) is held at ``now``: a repeat of
    the evaluation that acquired it acquires nothing."""
    for index in range(0, len(leases), 3):
        if leases[index + 1] == fingerprint and leases[index] > now:
            return True
    return False


def lease_result(
    window: Window, held: int, wait: int, cost: int, charged: bool
) -> tuple[WindowResult, int]:
    """A concurrency window's reported numbers from its view (``held`` units, ``wait``
    ms until the oldest held lease expires) and its time to live: ``remaining`` = N -
    held after the call, ``reset_after`` = until the oldest held lease expires (the new
    one's period when it is the only one; 0 when none), which is also a denial's
    ``retry_after`` (a whole period when nothing is held: a cost above N never fits)."""
    count = held + cost if charged else held
    reset_after = wait if wait > 0 else (window.period_ms if charged else 0)
    retry_after = -1
    if held + cost > window.limit:
        retry_after = wait if wait > 0 else window.period_ms
    remaining = window.limit - count if count < window.limit else 0
    return new_tuple(WindowResult, (remaining, reset_after, retry_after, reset_after)), reset_after


def acquired_leases(leases: Log, now: int, fingerprint: int, units: int, period: int) -> Log:
    """The leases after acquiring ``units`` for ``fingerprint`` at ``now``: the expired
    ones dropped, a member of the same fingerprint and units replaced (as ``ZADD``
    rescores it), the new one expiring at ``now + period``; in the set's order."""
    kept = [
        (leases[index], leases[index + 1], leases[index + 2])
        for index in range(0, len(leases), 3)
        if leases[index] > now and (leases[index + 1], leases[index + 2]) != (fingerprint, units)
    ]
    kept.append((now + period, fingerprint, units))
    kept.sort()
    return tuple(value for lease in kept for value in lease)


def released_leases(leases: Log, now: int, fingerprint: int) -> tuple[int, Log]:
    """The units ``fingerprint`` held at ``now`` and the leases after releasing them: its
    members and the expired ones dropped (``release.lua``)."""
    released = 0
    kept: list[int] = []
    for index in range(0, len(leases), 3):
        expiry, member, units = leases[index], leases[index + 1], leases[index + 2]
        if expiry <= now:
            continue
        if member == fingerprint:
            released += units
            continue
        kept += (expiry, member, units)
    return released, tuple(kept)


def leases_ttl(leases: Log, now: int) -> int:
    """ms until the latest lease expires (the set's expiry); 0 when none is left."""
    return leases[-3] - now if leases else 0
