"""Refunds (docs/refunds.md): what undoing one charged evaluation does to its counter.

``refund.lua`` mirrors :func:`refund_counter` (its mode 1, "at most once"); the memory
backend runs it under its lock, and the differential tests hold the two to the same
replies and the same stored state.

An evaluation is refunded only while its counter's evaluation-id ledger holds its
fingerprint (:mod:`django_quota.core.evaluation_ids`): the refund removes that entry, so
a second refund of the same evaluation finds nothing and returns 0. The entry's charge
time (stored modulo 2**32 ms, about 49.7 days) is recovered from the counter's ``t``,
the last ``now`` it accepted (never earlier than the charge). Each window then gives the
cost back while the window that counted it is still the current one at ``now`` (clamped
to ``t``, as an evaluation clamps it):

* fixed window (and a calendar window): its count drops by the cost, never below 0;
* sliding window counter: the current window's count drops; once that window has
  passed, its count is the next window's ``prev`` and the refund leaves it alone;
* token bucket: while the bucket is not full, the deficit drops by ``cost`` tokens,
  never below 0;
* sliding log: while the charge is inside ``(now - P, now]``, its units leave the event
  recorded at the charge time (the event goes when none is left), so every newer event's
  number, and ``c<i>``, drop by the cost. When an edge's measured refund (below) took
  that event's units, the newest event before it gives them instead.

The units given back are what the entry says the evaluation charged, or fewer when the
caller caps them (a partial refund; the entry goes all the same); the units refunded
are those when some window gave them back, else 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

from django_quota.core.calls import ALGORITHM_CODES, Packing, check_packable
from django_quota.core.evaluation_ids import LedgerLayout, entries
from django_quota.core.policy import FIXED_WINDOW, SLIDING_LOG, SLIDING_WINDOW, TOKEN_BUCKET
from django_quota.core.protocol import log_key
from django_quota.core.windows import (
    COUNT_FIELDS,
    EXTRA_FIELDS,
    LOG_MODULUS,
    Log,
    ceil_div,
    floor_div,
)


class RefundCall(NamedTuple):
    """One counter's refund: its algorithm, windows' periods (ms) and, token bucket,
    limits; ``cost``, the most units to give back (0: all the evaluation charged, as its
    ledger entry says; an edge's measured refund, whose entry is gone, gives ``cost``);
    and, for a fixed window call with calendar windows, each window's ``[start, end)``
    around the caller's ``now`` (flat; ``()`` otherwise)."""

    algorithm: str
    periods: tuple[int, ...]
    limits: tuple[int, ...]
    cost: int
    places: tuple[int, ...] = ()


class Refunded(NamedTuple):
    """What a refund found and left: the units refunded, then the counter's numbers,
    ledger and sliding-log lists to store (its expiry stays)."""

    units: int
    state: dict[str, int]
    records: bytes
    logs: tuple[Log, ...]


class Charge(NamedTuple):
    """The ledger without an evaluation's entries, and what its first one says: the
    charge time (None when the ledger does not hold it) and the cost charged."""

    kept: bytes
    at: int | None
    cost: int


def charge_time(records: bytes, fingerprint: bytes, last: int) -> Charge:
    """The ledger without ``fingerprint``'s entries, and the charge time and cost of its
    first one (time None when the ledger does not hold it), the time recovered from the
    counter's ``t`` (``last``), which is never earlier than the charge."""
    kept = []
    found = None
    start = 0
    for entry in entries(records):
        if entry.fingerprint != fingerprint:
            kept.append(records[start : entry.end])
        elif found is None:
            found = entry
        start = entry.end
    if found is None:
        return Charge(records, None, 0)
    age = (last - found.stamp) % LedgerLayout.STAMP_MODULUS
    return Charge(b"".join(kept), last - age, found.cost)


def log_refund(
    count: int, log: Log, at: int, cost: int, exact: bool = True
) -> tuple[int, Log] | None:
    """``cost`` units taken out of the event recorded at ``at`` (not ``exact``: the
    newest event at or before ``at``) of a sliding log whose window count is ``count``:
    the new count and log, or None when there is no such event or it holds fewer
    units."""
    events = len(log) // 2
    found = 0
    for event in range(1, events + 1):
        time = log[2 * event - 2]
        if time <= at:
            if time == at or not exact:
                found = event
            break
    if found == 0:
        return None
    newer = count if found == 1 else log[2 * found - 3]
    units = (newer - log[2 * found - 1]) % LOG_MODULUS
    if units < cost:
        return None
    out = list(log)
    for event in range(1, found):
        out[2 * event - 1] = (out[2 * event - 1] - cost) % LOG_MODULUS
    if units == cost:
        del out[2 * found - 2 : 2 * found]
    return (count - cost) % LOG_MODULUS, tuple(out)


def refund_counter(
    call: RefundCall,
    state: Mapping[str, int] | None,
    records: bytes,
    logs: Sequence[Log],
    now: int,
    fingerprint: bytes,
    since_ms: int | None = None,
) -> Refunded | None:
    """``refund.lua``'s model (mode 1): undo the charge of ``fingerprint``'s evaluation
    on one counter at ``now`` (ms). None when the ledger does not hold it: nothing is
    written (refunded already, never charged, or dropped from the bounded ledger).

    The units given back are the entry's cost, at most ``call.cost`` when that is not 0.
    ``since_ms``, the ms since the charge as an edge measured them, places a charge
    whose entry the bounded ledger dropped: at ``now`` (clamped to ``t``) minus them,
    never after ``t``, for ``call.cost`` units; a sliding log's units then leave the
    newest event at or before that time. The edge refunds each charge at most once
    itself."""
    numbers = dict(state or {})
    last = numbers.get("t")
    kept, charged, cost = charge_time(records, fingerprint, 0 if last is None else last)
    measured = charged is None and since_ms is not None and call.cost > 0
    if charged is None and not measured:
        return None
    stored_logs = tuple(logs)
    if last is None:  # reset since the charge: nothing left to give back
        return Refunded(0, numbers, kept, stored_logs)
    at = now if now > last else last
    if charged is None:
        assert since_ms is not None
        charged = min(last, at - since_ms)
        cost = call.cost
    elif 0 < call.cost < cost:
        cost = call.cost
    algorithm = call.algorithm
    refunded = False
    new_logs = list(stored_logs)
    for index, period in enumerate(call.periods, 1):
        count = numbers.get(COUNT_FIELDS[index], 0)
        if call.places:  # a calendar call: the window of [start, end) around now
            start, end = call.places[2 * index - 2], call.places[2 * index - 1]
            if start <= charged and start <= at < end:
                numbers[COUNT_FIELDS[index]] = max(0, count - cost)
                refunded = True
        elif algorithm in (FIXED_WINDOW, SLIDING_WINDOW):
            if charged - charged % period == at - at % period:
                numbers[COUNT_FIELDS[index]] = max(0, count - cost)
                refunded = True
        elif algorithm == TOKEN_BUCKET:
            deficit = count * period + numbers.get(EXTRA_FIELDS[index], 0)
            if at - last < ceil_div(deficit, call.limits[index - 1]):  # not full at now
                deficit = max(0, deficit - cost * period)
                whole = floor_div(deficit, period)
                numbers[COUNT_FIELDS[index]] = whole
                numbers[EXTRA_FIELDS[index]] = deficit - whole * period
                refunded = True
        elif algorithm == SLIDING_LOG and charged > at - period and index <= len(new_logs):
            taken = log_refund(count, new_logs[index - 1], charged, cost, not measured)
            if taken is None and not measured:  # its event went to a measured refund
                taken = log_refund(count, new_logs[index - 1], charged, cost, False)
            if taken is not None:
                numbers[COUNT_FIELDS[index]], new_logs[index - 1] = taken
                refunded = True
    return Refunded(cost if refunded else 0, numbers, kept, tuple(new_logs))


class RefundMode:
    """``refund.lua``'s modes: the cluster's refunds after a later slot refused (best
    effort, at the charge's own now), and a refund of one evaluation at most once."""

    BEST_EFFORT: Final = 0
    AT_MOST_ONCE: Final = 1


class RefundRequest(NamedTuple):
    """A refund of one evaluation (``refund.lua``, mode 1) on the counters of a group it
    charged: the counters, what each policy charged (:class:`RefundCall`, in the same
    order), the evaluation's fingerprint (one per evaluation, whatever the group) and
    ``now_ms`` (None: Redis ``TIME``)."""

    counters: tuple[str, ...]
    calls: tuple[RefundCall, ...]
    fingerprint: bytes
    now_ms: int | None
    #: ms since the charge as an edge measured them (None: the ledgers must hold it).
    since_ms: int | None = None

    def keys(self) -> list[str]:
        """KEYS: the counters, then each sliding log's lists (as for ``evaluate.lua``)."""
        keys = list(self.counters)
        for counter, call in zip(self.counters, self.calls, strict=True):
            if call.algorithm == SLIDING_LOG:
                lists = range(1, len(call.periods) + 1)
                keys += [log_key(counter, index) for index in lists]
        return keys

    def args(self) -> list[int | str | bytes]:
        """ARGV for ``refund.lua`` in mode 1 (its header)."""
        now = 0 if self.now_ms is None else check_packable(self.now_ms) + 1
        since = 0 if self.since_ms is None else check_packable(self.since_ms) + 1
        args: list[int | str | bytes] = [
            len(self.calls), self.fingerprint, RefundMode.AT_MOST_ONCE, now
        ]
        for call in self.calls:
            code = Packing.CALENDAR_CODE if call.places else ALGORITHM_CODES[call.algorithm]
            args += [code, call.cost, since, len(call.periods)]
            for index, period in enumerate(call.periods):
                if call.places:
                    args += [period, call.places[2 * index], call.places[2 * index + 1]]
                elif call.algorithm == TOKEN_BUCKET:
                    args += [period, call.limits[index], 0]
                else:
                    args += [period, 0, 0]
        return args

    def joined(self, other: RefundRequest) -> RefundRequest:
        """This request and ``other`` (the same evaluation) as one call."""
        return self._replace(
            counters=self.counters + other.counters, calls=self.calls + other.calls
        )

    def part(self, indexes: Sequence[int]) -> RefundRequest:
        """The request for the counters at ``indexes`` only (a cluster's hash slot)."""
        return self._replace(
            counters=tuple(self.counters[i] for i in indexes),
            calls=tuple(self.calls[i] for i in indexes),
        )
