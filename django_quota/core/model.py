"""The pure-Python model of the arithmetic of every algorithm (``docs/arithmetic.md``).

This is the memory backend's engine, the local fallback's engine and the oracle of the
differential tests: ``django_quota/scripts/evaluate.lua`` mirrors it function by function
(views, admission, charges, ledgers, expiries) and must return identical results, and
store identical state, for identical inputs. The script replies the windows' views of
the algorithms other than the sliding log, and :func:`window_result` turns them into
the reported numbers on the client, as it does here.

State layout (one counter per (policy, revision, identity); in Redis a binary string,
``evaluate.lua``'s header and :func:`~django_quota.core.protocol.decode_counter` give its
bytes), all integers:

* ``t``: the last ``now`` (ms) the counter accepted; fixed and sliding windows derive
  their stored window start from it, the token bucket its last refill.
* ``c<i>`` for window ``i`` (1-based): fixed and sliding, the count of the window that
  contains ``t``; token bucket, the whole part of the deficit ``D`` (see below); sliding
  log, every unit the window ever recorded, modulo :data:`LOG_MODULUS` (see below).
* ``p<i>``: sliding window, the count of the window before ``t``'s; token bucket, the
  remainder of the deficit (``D = c * P + p``, ``0 <= p < P``).
* the evaluation-id ledger, the last :data:`LEDGER_SIZE` charged evaluations, oldest
  first: here one byte string of :data:`ENTRY_BYTES`-byte entries (the evaluation id's
  :data:`FINGERPRINT_BYTES`-byte fingerprint, then the ``now`` it was charged at, modulo
  2**32 ms, about 49.7 days, as 4 big-endian bytes), the same bytes in Redis.
* ``d``: the charge time (ms) of the newest entry the ledger dropped to make room while
  it was younger than ``DEDUP_TTL``.

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

Evaluation ids (``docs/failures.md``): a charged evaluation appends its fingerprint and
time to the ledger of every counter it charged. An evaluation that may repeat an earlier
one (a retry, or an id the caller chose) first looks for its fingerprint among the
entries younger than ``DEDUP_TTL``: found in any counter of the group, nothing is
charged and every policy is allowed with its current numbers; not found while some
counter dropped an entry charged less than ``DEDUP_TTL`` ago, the evaluation is
*indeterminate* (the dropped one may have been this id); otherwise it is decided
afresh. So a repeated id never charges twice, and the ledger stays bounded.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from django_quota.core.policy import (
    FIXED_WINDOW,
    SLIDING_LOG,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    Window,
)

#: Builds a named tuple from a tuple of its fields: the hot path's results are built this
#: way, without the Python-level ``__new__`` a named tuple's constructor calls (about
#: 0.15 µs each, several per decision: docs/benchmarks.md).
new_tuple = tuple.__new__

#: Policy statuses: what a group's decision did to one policy (:func:`decide_policy`; the
#: script replies them only when a group replays). Not decisions: an outcome's decision
#: (``core.outcome``'s ``ALLOWED``, ``DENIED_DECISION``…) follows from them.
REFUSED = 0  # its windows refuse the cost: nothing charged
CHARGED = 1  # its windows allow, and the cost was charged
UNCHARGED = 2  # its windows allow, nothing charged (peek, cost 0, the group refused)

#: Group statuses, the first integer of the script's reply.
GROUP_DECIDED = 0
GROUP_CLOCK_UNSAFE = 1
GROUP_INDETERMINATE = 2  # a possible repeat whose ledger entry may have been dropped
GROUP_REPLAYED = 3  # a repeat of a charged evaluation: nothing charged

#: Evaluation modes (the script's third argument).
MODE_FRESH = 0  # a new evaluation id: the ledger is not searched
MODE_MAY_REPEAT = 1  # a retry or a caller's id: the ledger is searched first
MODE_PEEK = 2  # decide as cost 1 would, write nothing

#: How many charged evaluation ids each counter remembers.
LEDGER_SIZE = 8
#: Bytes of one evaluation id's fingerprint (40 bits).
FINGERPRINT_BYTES = 5
#: Bytes of one ledger entry: the fingerprint, then the charge time modulo 2**32 ms.
ENTRY_BYTES = FINGERPRINT_BYTES + 4
STAMP_MODULUS = 2**32
#: Bytes of a full ledger.
LEDGER_FULL = LEDGER_SIZE * ENTRY_BYTES
#: An entry's charge time (modulo 2**32 ms), as it is stored.
_STAMP = struct.Struct(">I")

ALGORITHM_CODES = {FIXED_WINDOW: 1, SLIDING_WINDOW: 2, TOKEN_BUCKET: 3, SLIDING_LOG: 4}

State = dict[str, int]
#: One window's sliding log, as its Redis list: newest event first, each event its time
#: (ms) then the window's unit count before it (``(t1, n1, t2, n2, ...)``).
Log = tuple[int, ...]
#: Sliding-log counts wrap at this (above every limit, far below 2**53).
LOG_MODULUS = 10**12

#: The packed arguments of ``evaluate.lua`` (see its header): unsigned big-endian.
#: The group's header: mode, policy count, now + 1 (0: Redis TIME), max clock regression
#: + 1 (0: clamp), DEDUP_TTL and cleanup grace (ms).
PACKED_HEADER = struct.Struct(">BH4Q")
#: A policy: algorithm code, enforce (1 or 0), window count, cost.
PACKED_POLICY = struct.Struct(">BBHQ")
#: A window: limit, period (ms), capacity.
PACKED_WINDOW = struct.Struct(">3Q")
#: Every packed number stays below this: the script reads the low six bytes of each.
PACKABLE = 2**48


def check_packable(value: int) -> int:
    """``value`` when ``0 <= value < 2**48`` (what the script reads), else ``ValueError``."""
    if not 0 <= value < PACKABLE:
        raise ValueError(f"{value} is outside 0..2**48 and cannot be sent to evaluate.lua")
    return value


#: ``c<i>``/``p<i>`` field names, 1-based (index 0 unused).
COUNT_FIELDS = tuple(f"c{i}" for i in range(64))
EXTRA_FIELDS = tuple(f"p{i}" for i in range(64))


@dataclass(frozen=True, slots=True)
class PolicyCall:
    """One policy of a group call: its algorithm, windows, cost and enforcement.

    ``packed`` is this call's part of the script's packed arguments (``evaluate.lua``'s
    header: algorithm, enforce, window count, cost, then limit, period in ms and capacity
    per window), encoded once. Raises ``ValueError`` for more than 65,535 windows or a
    number outside 0..2**48.
    """

    algorithm: str
    windows: tuple[Window, ...]
    cost: int
    enforce: bool = True
    packed: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            head = PACKED_POLICY.pack(
                ALGORITHM_CODES[self.algorithm],
                1 if self.enforce else 0,
                len(self.windows),
                check_packable(self.cost),
            )
            windows = [
                PACKED_WINDOW.pack(
                    check_packable(window.limit),
                    check_packable(window.period_ms),
                    check_packable(window.capacity),
                )
                for window in self.windows
            ]
        except struct.error as exc:
            raise ValueError(f"cannot pack this policy call for evaluate.lua: {exc}") from exc
        object.__setattr__(self, "packed", head + b"".join(windows))


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


class PolicyResult(NamedTuple):
    """The result of one policy: status (:data:`REFUSED`, :data:`CHARGED`,
    :data:`UNCHARGED`), the effective ``now`` (ms) and its windows."""

    status: int
    now_ms: int
    windows: tuple[WindowResult, ...]


class Write(NamedTuple):
    """The new state of policy ``index``'s counter (numbers, and the ledger ``records``),
    with a time to live in milliseconds; a sliding log's new lists in ``logs``, one per
    window (``()`` for the other algorithms). ``keep_ttl``: the counter keeps the expiry
    it has (``SET … KEEPTTL``) instead of ``ttl_ms`` from now, because that expiry is
    already late enough (:func:`keeps_expiry`)."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index on purpose
    state: State
    ttl_ms: int
    records: bytes = b""
    logs: tuple[Log, ...] = ()
    keep_ttl: bool = False


def keeps_expiry(
    algorithm: str,
    windows: Sequence[Window],
    state: Mapping[str, int],
    now: int,
    ttl: int,
    dedup_ttl_ms: int,
    *,
    server_clock: bool,
) -> bool:
    """Whether a charge at ``now`` (ms, not clamped to the stored ``t``) may keep the
    counter's expiry: on the clock the expiry follows (``server_clock``: Redis ``TIME``,
    or the memory backend's own clock), a fixed window or sliding window counter whose
    every window is still the one of ``t``, and whose windows outlive ``now`` by
    ``dedup_ttl_ms`` at least (``ttl``, the longest window time to live from ``now``).

    The charge at ``t`` set the expiry at ``t + max(its ttl + grace, DEDUP_TTL)`` on that
    clock, and within the same windows ``t + its ttl`` equals ``now + ttl``: so the kept
    expiry is at least ``now + ttl`` (the numbers are needed that long) and
    ``now + DEDUP_TTL`` (the ledger remembers this evaluation that long), whatever the
    grace was then. A client clock may run slower than the expiry's, or stand still while
    clamped to ``t``: then every charge sets the expiry afresh.
    """
    if not server_clock or (algorithm != FIXED_WINDOW and algorithm != SLIDING_WINDOW):
        return False
    last = state.get("t")
    if last is None or now < last or ttl < dedup_ttl_ms:
        return False
    for window in windows:
        period = window.period_ms
        if now - now % period != last - last % period:
            return False
    return True


class GroupResult(NamedTuple):
    """What a group call decided: the group status (:data:`GROUP_DECIDED`…), per policy
    results and the writes to apply (none unless decided)."""

    status: int
    results: tuple[PolicyResult, ...]
    writes: tuple[Write, ...]

    @property
    def clock_unsafe(self) -> bool:
        """True when a client clock ran backwards past the bound: nothing decided."""
        return self.status == GROUP_CLOCK_UNSAFE


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
        return (count if now - now % period == last - last % period else 0), 0
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
        reset_after = ceil_div(deficit, limit)
        wanted = used + cost * period
        retry_after = -1 if wanted <= capacity_scaled else ceil_div(wanted - capacity_scaled, limit)
        if remaining >= window.capacity:
            replenish = 0
        else:
            replenish = ceil_div(deficit - (capacity_scaled - (remaining + 1) * period), limit)
        result = new_tuple(WindowResult, (remaining, reset_after, retry_after, replenish))
        return result, reset_after
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


def _charged_log(view: LogView, count: int, log: Log, now: int) -> Log:
    """The log after charging at ``now``: a new newest event (its number the count before
    it) unless the newest is already at ``now``, and no event that has left."""
    kept = log[: 2 * view.inside]
    if view.inside > 0 and view.newest == now:
        return kept
    return (now, count, *kept)


def _charged_state(
    call: PolicyCall, views: Sequence[tuple[int, int]], now: int, old: Mapping[str, int]
) -> State:
    """The counter's numbers after charging ``call.cost``: the ones the script's ``SET``
    writes over the stored ones (``d`` stays)."""
    state: State = {**old}
    state["t"] = now
    algorithm, cost = call.algorithm, call.cost
    for index, window in enumerate(call.windows, 1):
        used, prev = views[index - 1]
        if algorithm == FIXED_WINDOW:
            state[COUNT_FIELDS[index]] = used + cost
        elif algorithm == SLIDING_WINDOW:
            state[COUNT_FIELDS[index]] = used + cost
            state[EXTRA_FIELDS[index]] = prev
        elif algorithm == TOKEN_BUCKET:
            period = window.period_ms
            deficit = used + cost * period
            whole = floor_div(deficit, period)
            state[COUNT_FIELDS[index]] = whole
            state[EXTRA_FIELDS[index]] = deficit - whole * period
        else:  # sliding log
            count = old.get(COUNT_FIELDS[index], 0)
            state[COUNT_FIELDS[index]] = (count + cost) % LOG_MODULUS
    return state


def _stamp_age(records: bytes, start: int, now: int) -> int:
    """Milliseconds since the entry at ``start`` was charged (modulo 2**32)."""
    at = int.from_bytes(records[start + FINGERPRINT_BYTES : start + ENTRY_BYTES], "big")
    return (now - at) % STAMP_MODULUS


def remembers(records: bytes, fingerprint: bytes, now: int, dedup_ttl_ms: int) -> bool:
    """Whether the ledger ``records`` holds ``fingerprint`` in an entry charged less than
    ``dedup_ttl_ms`` before ``now``."""
    for start in range(0, len(records), ENTRY_BYTES):
        if (
            records[start : start + FINGERPRINT_BYTES] == fingerprint
            and _stamp_age(records, start, now) < dedup_ttl_ms
        ):
            return True
    return False


def appended(
    records: bytes, fingerprint: bytes, now: int, dedup_ttl_ms: int
) -> tuple[bytes, int | None]:
    """The ledger with ``fingerprint`` charged at ``now`` appended, the oldest entry
    dropped when full; and that entry's charge time when it was younger than
    ``dedup_ttl_ms`` (else None)."""
    stamp = now % STAMP_MODULUS
    entry = fingerprint + _STAMP.pack(stamp)
    if len(records) < LEDGER_FULL:
        return records + entry, None
    age = (stamp - _STAMP.unpack_from(records, FINGERPRINT_BYTES)[0]) % STAMP_MODULUS
    return records[ENTRY_BYTES:] + entry, (now - age if age < dedup_ttl_ms else None)


#: The state of a counter that does not exist.
_EMPTY: Mapping[str, int] = {}

_CLOCK_UNSAFE_RESULT = GroupResult(GROUP_CLOCK_UNSAFE, (), ())
_INDETERMINATE_RESULT = GroupResult(GROUP_INDETERMINATE, (), ())


def group_allows(calls: Sequence[PolicyCall], fits: Sequence[bool]) -> bool:
    """The group rule: a group is allowed iff every enforced policy's windows allow its
    cost (``fits``, one per call). Shadow policies never refuse a group. Written once in
    Python (the model, :func:`~django_quota.core.protocol.parse_reply` and the cluster
    backend call it; ``evaluate.lua`` mirrors it)."""
    if False not in fits:  # the common group: allowed, whatever the enforcement
        return True
    # A loop, not all() over a generator: that costs five times as much per refusal.
    refused = False
    for index, call in enumerate(calls):
        if call.enforce and not fits[index]:
            refused = True
            break
    return not refused


def decide_policy(call: PolicyCall, fits: bool, allowed: bool, peek: bool) -> int:
    """What a group's decision does to one policy: :data:`REFUSED` when its own windows
    refuse its cost (``fits`` False); :data:`CHARGED` when they allow it, the group is
    ``allowed`` (:func:`group_allows`) and the call charges (not a ``peek``, a cost above
    0), shadow policies included; else :data:`UNCHARGED`. A refused group charges nothing
    anywhere."""
    if not fits:
        return REFUSED
    if allowed and not peek and call.cost > 0:
        return CHARGED
    return UNCHARGED


def _clamped_now(state: Mapping[str, int], now_ms: int, max_regression_ms: int) -> int | None:
    """The ``now`` a counter is decided at: ``now_ms``, or its stored ``t`` when later (a
    client clock behind it); None when ``t`` is later by more than ``max_regression_ms``
    (``>= 0``: a client clock's bound)."""
    last = state.get("t")
    if last is None or now_ms >= last:
        return now_ms
    if max_regression_ms >= 0 and last - now_ms > max_regression_ms:
        return None
    return last


class _LogWindows(NamedTuple):
    """A sliding log's windows before the call: each one's stored count, list and view."""

    counts: list[int]
    lists: list[Log]
    views: list[LogView]


def _log_windows(
    windows: Sequence[Window], state: Mapping[str, int], now: int, stored: Sequence[Log]
) -> _LogWindows:
    """A sliding log's windows seen at ``now``: ``stored`` holds its lists (missing ones
    empty)."""
    counts = [state.get(COUNT_FIELDS[i], 0) for i in range(1, len(windows) + 1)]
    lists = [stored[i] if i < len(stored) else () for i in range(len(windows))]
    if "t" in state:
        views = [
            _log_view(window, count, log, now)
            for window, count, log in zip(windows, counts, lists, strict=True)
        ]
    else:  # no numbers: whatever a list holds is not this counter's
        views = [LogView(0, 0, 0, 0, -1) for _ in windows]
    return _LogWindows(counts, lists, views)


def _windows_at(
    call: PolicyCall, state: Mapping[str, int], now: int, stored: Sequence[Log], cost: int
) -> tuple[list[tuple[int, int]], _LogWindows | None, bool]:
    """``call``'s windows at ``now``, before the call: each one's view (:func:`_view`; a
    sliding log's used units, and 0), a sliding log's windows (None for the other
    algorithms), and whether every window allows ``cost``."""
    algorithm = call.algorithm
    windows = call.windows
    log = None
    if algorithm == SLIDING_LOG:
        log = _log_windows(windows, state, now, stored)
        views = [(view.used, 0) for view in log.views]
    elif len(windows) == 1:
        views = [_view(algorithm, windows[0], 1, state, now)]
    else:
        views = [_view(algorithm, window, i, state, now) for i, window in enumerate(windows, 1)]
    for index, (used, prev) in enumerate(views):
        if not allows(algorithm, windows[index], used, prev, now, cost):
            return views, log, False
    return views, log, True


def _reported(
    call: PolicyCall,
    views: Sequence[tuple[int, int]],
    log: _LogWindows | None,
    now: int,
    cost: int,
    charged: bool,
) -> tuple[tuple[WindowResult, ...], int]:
    """The windows' reported numbers after the call (:func:`window_result`,
    :func:`_log_result`), and the counter's time to live (ms): its longest window's."""
    results = []
    ttl = 0
    for index, window in enumerate(call.windows):
        if log is None:
            used, prev = views[index]
            result, window_ttl = window_result(
                call.algorithm, window, used, prev, now, cost, charged
            )
        else:
            result, window_ttl = _log_result(
                window, log.views[index], log.counts[index], log.lists[index], now, cost, charged
            )
        results.append(result)
        if window_ttl > ttl:
            ttl = window_ttl
    return tuple(results), ttl


def _charge(
    index: int,
    call: PolicyCall,
    views: Sequence[tuple[int, int]],
    log: _LogWindows | None,
    old: Mapping[str, int],
    now: int,
    ttl: int,
    ledger: bytes,
    *,
    now_ms: int,
    fingerprint: bytes,
    cleanup_grace_ms: int,
    dedup_ttl_ms: int,
    server_clock: bool,
) -> Write:
    """The write of policy ``index`` charged at ``now`` (its effective ``now``; ``now_ms``
    the group's): the new numbers and logs, the ledger with ``fingerprint`` appended and
    the lifetime, ``max(ttl + cleanup_grace_ms, dedup_ttl_ms)`` ms or the kept expiry."""
    state = _charged_state(call, views, now, old)
    records, dropped_at = appended(ledger, fingerprint, now, dedup_ttl_ms)
    if dropped_at is not None:
        state["d"] = dropped_at
    lifetime = ttl + cleanup_grace_ms
    if lifetime < dedup_ttl_ms:
        lifetime = dedup_ttl_ms
    logs: tuple[Log, ...] = ()
    if log is not None:
        logs = tuple(
            _charged_log(view, count, stored, now)
            for view, count, stored in zip(log.views, log.counts, log.lists, strict=True)
        )
    keep = keeps_expiry(
        call.algorithm, call.windows, old, now_ms, ttl, dedup_ttl_ms, server_clock=server_clock
    )
    return new_tuple(Write, (index, state, lifetime, records, logs, keep))


def _repeats(
    states: Sequence[Mapping[str, int]],
    nows: Sequence[int],
    ledgers: Sequence[bytes],
    fingerprint: bytes,
    dedup_ttl_ms: int,
) -> bool | None:
    """Whether an evaluation that may repeat an earlier one does (a ledger remembers
    ``fingerprint``), or None when that cannot be known (a ledger dropped an entry younger
    than ``dedup_ttl_ms``: it may have been this one's)."""
    if any(
        remembers(ledger, fingerprint, now, dedup_ttl_ms)
        for ledger, now in zip(ledgers, nows, strict=True)
    ):
        return True
    if any(
        "d" in state and now - state["d"] < dedup_ttl_ms
        for state, now in zip(states, nows, strict=True)
    ):
        return None
    return False


def _replayed(ledger: bytes, now: int, fingerprint: bytes, dedup_ttl_ms: int) -> int:
    """A policy's status in a replay: :data:`CHARGED` when its ledger holds the id (charged
    by the earlier evaluation: the cluster backend's refunds count it as charged), else
    :data:`UNCHARGED`. Nothing is charged now."""
    return CHARGED if remembers(ledger, fingerprint, now, dedup_ttl_ms) else UNCHARGED


class GroupInputs(NamedTuple):
    """What a group is decided with besides its calls and its counters' stored numbers,
    ledgers and logs: :func:`evaluate_group`'s other arguments, named."""

    now_ms: int
    peek: bool
    max_regression_ms: int
    cleanup_grace_ms: int
    fingerprint: bytes
    may_repeat: bool
    dedup_ttl_ms: int
    server_clock: bool


def evaluate_group(
    calls: Sequence[PolicyCall],
    states: Sequence[Mapping[str, int] | None],
    now_ms: int,
    peek: bool = False,
    max_regression_ms: int = -1,
    cleanup_grace_ms: int = 1000,
    records: Sequence[bytes] | None = None,
    fingerprint: bytes = b"",
    may_repeat: bool = False,
    dedup_ttl_ms: int = 5000,
    logs: Sequence[Sequence[Log]] | None = None,
    server_clock: bool = False,
) -> GroupResult:
    """Decide a group of policies at ``now_ms``, atomically.

    ``states[i]`` is policy ``i``'s stored numbers (``None`` when absent),
    ``records[i]`` its evaluation-id ledger (``""`` when absent) and ``logs[i]`` a
    sliding log's lists, one per window (missing ones empty). ``peek`` decides as
    ``cost=1`` would and writes nothing. ``max_regression_ms >= 0`` (client clocks only)
    makes a ``now`` more than that behind a stored ``t`` unsafe. :func:`group_allows` and
    :func:`decide_policy` decide, and ``fingerprint`` is appended to each charged
    counter's ledger. ``may_repeat`` searches the ledgers first (module docstring). A
    charged counter lives ``max(its windows' time to live + cleanup_grace_ms,
    dedup_ttl_ms)``, or keeps its expiry (:func:`keeps_expiry`; ``server_clock``:
    ``now_ms`` is on the clock expiries follow).
    """
    call = calls[0] if len(calls) == 1 else None
    if call is None or may_repeat or len(call.windows) != 1 or call.algorithm == SLIDING_LOG:
        group = GroupInputs(
            now_ms, peek, max_regression_ms, cleanup_grace_ms, fingerprint, may_repeat,
            dedup_ttl_ms, server_clock,
        )
        return _evaluate_general(calls, states, records, logs, group)
    # The common group (one policy of one window, a fresh id): the general path's steps
    # without their lists.
    state = _EMPTY if states[0] is None else states[0]
    now = _clamped_now(state, now_ms, max_regression_ms)
    if now is None:
        return _CLOCK_UNSAFE_RESULT
    cost = 1 if peek else call.cost
    algorithm, window = call.algorithm, call.windows[0]
    used, prev = view = _view(algorithm, window, 1, state, now)
    fits = allows(algorithm, window, used, prev, now, cost)
    status = decide_policy(call, fits, group_allows(calls, (fits,)), peek)
    charged = status == CHARGED
    result, ttl = window_result(algorithm, window, used, prev, now, cost, charged)
    decided = new_tuple(PolicyResult, (status, now, (result,)))
    if not charged:
        return new_tuple(GroupResult, (GROUP_DECIDED, (decided,), ()))
    ledger = b"" if records is None else records[0]
    write = _charge(
        0, call, (view,), None, state, now, ttl, ledger,
        now_ms=now_ms, fingerprint=fingerprint, cleanup_grace_ms=cleanup_grace_ms,
        dedup_ttl_ms=dedup_ttl_ms, server_clock=server_clock,
    )
    return new_tuple(GroupResult, (GROUP_DECIDED, (decided,), (write,)))


def _evaluate_general(
    calls: Sequence[PolicyCall],
    states: Sequence[Mapping[str, int] | None],
    records: Sequence[bytes] | None,
    logs: Sequence[Sequence[Log]] | None,
    group: GroupInputs,
) -> GroupResult:
    """:func:`evaluate_group` for any group: every policy, algorithm and mode."""
    seen = [_EMPTY if state is None else state for state in states]
    nows: list[int] = []
    for state in seen:
        now = _clamped_now(state, group.now_ms, group.max_regression_ms)
        if now is None:
            return _CLOCK_UNSAFE_RESULT
        nows.append(now)
    ledgers = records if records is not None else [b""] * len(calls)
    peek = group.peek
    replay = False
    if group.may_repeat and not peek:
        repeat = _repeats(seen, nows, ledgers, group.fingerprint, group.dedup_ttl_ms)
        if repeat is None:
            return _INDETERMINATE_RESULT
        replay = repeat
    sights = []
    fits = []
    for index, call in enumerate(calls):
        stored = logs[index] if logs is not None else ()
        cost = 1 if peek else call.cost
        views, log, fit = _windows_at(call, seen[index], nows[index], stored, cost)
        sights.append((views, log))
        fits.append(fit)
    allowed = not replay and group_allows(calls, fits)
    results = []
    writes = []
    for index, call in enumerate(calls):
        views, log = sights[index]
        now = nows[index]
        if replay:
            status = _replayed(ledgers[index], now, group.fingerprint, group.dedup_ttl_ms)
        else:
            status = decide_policy(call, fits[index], allowed, peek)
        charged = status == CHARGED and not replay
        windows, ttl = _reported(call, views, log, now, 1 if peek else call.cost, charged)
        if replay:
            windows = tuple(result._replace(retry_after_ms=-1) for result in windows)
        results.append(new_tuple(PolicyResult, (status, now, windows)))
        if charged:
            write = _charge(
                index, call, views, log, seen[index], now, ttl, ledgers[index],
                now_ms=group.now_ms, fingerprint=group.fingerprint,
                cleanup_grace_ms=group.cleanup_grace_ms, dedup_ttl_ms=group.dedup_ttl_ms,
                server_clock=group.server_clock,
            )
            writes.append(write)
    group_status = GROUP_REPLAYED if replay else GROUP_DECIDED
    return new_tuple(GroupResult, (group_status, tuple(results), tuple(writes)))
