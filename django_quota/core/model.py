"""The pure-Python model of the arithmetic of every algorithm (``docs/arithmetic.md``).

This is the memory backend's engine, the local fallback's engine and the oracle of the
differential tests: ``django_quota/scripts/evaluate.lua`` mirrors it function by function
(views, admission, charges, ledgers, expiries) and must return identical results, and
store identical state, for identical inputs. The script replies the windows' views of
the algorithms other than the sliding log, and the arithmetic of one window
(:func:`~django_quota.core.windows.window_result`) turns them into the reported numbers
on the client, as it does here.

State layout (one counter per (policy, revision, identity); in Redis a binary string,
``evaluate.lua``'s header and :func:`~django_quota.core.protocol.decode_counter` give its
bytes), all integers:

* ``t``: the last ``now`` (ms) the counter accepted; fixed and sliding windows derive
  their stored window start from it, the token bucket its last refill.
* ``c<i>`` for window ``i`` (1-based): fixed and sliding, the count of the window that
  contains ``t``; token bucket, the whole part of the deficit ``D``; sliding log, every
  unit the window ever recorded, modulo :data:`~django_quota.core.windows.LOG_MODULUS`
  (both: :mod:`django_quota.core.windows`).
* ``p<i>``: sliding window, the count of the window before ``t``'s; token bucket, the
  remainder of the deficit (``D = c * P + p``, ``0 <= p < P``).
* the evaluation-id ledger (:mod:`django_quota.core.evaluation_ids`), the last
  ``LedgerLayout.SIZE`` charged evaluations, oldest first: here one byte string of
  entries (the evaluation id's ``LedgerLayout.FINGERPRINT_BYTES``-byte fingerprint, the
  cost it charged when that is not 1, then the ``now`` it was charged at, modulo 2**32 ms,
  about 49.7 days, as 4 big-endian bytes), the same bytes in Redis.
* ``d``: the charge time (ms) of the newest entry the ledger dropped to make room while
  it was younger than ``DEDUP_TTL``.

Evaluation ids (``docs/failures.md``): a charged evaluation appends its fingerprint, cost
and time to the ledger of every counter it charged (one without a fingerprint, which nothing
can repeat, appends nothing: the memory backend's own evaluations). An evaluation that
may repeat an earlier one (a retry, or an id the caller chose) first looks for its
fingerprint among the entries younger than ``DEDUP_TTL``: found in any counter of the
group, nothing is charged and every policy is allowed with its current numbers; not
found while some counter dropped an entry charged less than ``DEDUP_TTL`` ago, the
evaluation is *indeterminate* (the dropped one may have been this id); otherwise it is
decided afresh. So a repeated id never charges twice, and the ledger stays bounded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

from django_quota.core.calendar_windows import Place, calendar_at, calendar_keeps, calendar_reported
from django_quota.core.calls import (
    CHARGED,
    GROUP_CLOCK_UNSAFE,
    GROUP_DECIDED,
    GROUP_INDETERMINATE,
    GROUP_REPLAYED,
    REFUSED,
    UNCHARGED,
    GroupInputs,
    GroupResult,
    PolicyCall,
    PolicyResult,
    State,
    Write,
)
from django_quota.core.evaluation_ids import appended, remembers
from django_quota.core.leases import holds_leases, lease_charge, leases_at, replayed_lease
from django_quota.core.policy import (
    CONCURRENCY,
    FIXED_WINDOW,
    SLIDING_LOG,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    Window,
)
from django_quota.core.windows import (
    COUNT_FIELDS,
    EXTRA_FIELDS,
    LOG_MODULUS,
    Log,
    LogView,
    WindowResult,
    _log_result,
    _log_view,
    _view,
    allows,
    calendar_place,
    floor_div,
    new_tuple,
    window_result,
)


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
        if now // period != last // period:  # another window (as now - now % P ...)
            return False
    return True


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


#: The state of a counter that does not exist. A dict, read-only as typed: as a
#: MappingProxyType it cost 150 Python instructions per decision on the memory row.
_EMPTY: Final[Mapping[str, int]] = {}

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
    if algorithm == CONCURRENCY:
        return leases_at(windows[0], stored, now, cost)
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
    records = ledger
    if fingerprint:  # no fingerprint: an evaluation nothing can repeat (the memory backend's)
        records, dropped_at = appended(ledger, fingerprint, call.cost, now, dedup_ttl_ms)
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
    if len(calls) == 1 and not may_repeat and calls[0].short:
        return decide_one(
            calls[0], states[0], now_ms, peek, max_regression_ms, cleanup_grace_ms,
            b"" if records is None else records[0], fingerprint, dedup_ttl_ms, server_clock,
        )
    group = GroupInputs(
        now_ms, peek, max_regression_ms, cleanup_grace_ms, fingerprint, may_repeat,
        dedup_ttl_ms, server_clock,
    )
    return _evaluate_general(calls, states, records, logs, group)


def decide_one(
    call: PolicyCall,
    stored: Mapping[str, int] | None,
    now_ms: int,
    peek: bool,
    max_regression_ms: int,
    cleanup_grace_ms: int,
    ledger: bytes,
    fingerprint: bytes,
    dedup_ttl_ms: int,
    server_clock: bool,
) -> GroupResult:
    """:func:`evaluate_group` for the common group, one ``call`` whose :attr:`~PolicyCall.short`
    holds, with an id that repeats nothing: the general path's steps without their lists
    (a property test holds the two equal). ``stored`` is its counter's numbers (None when
    absent), ``ledger`` its evaluation-id ledger; the memory backend calls it directly."""
    state = _EMPTY if stored is None else stored
    now = _clamped_now(state, now_ms, max_regression_ms)
    if now is None:
        return _CLOCK_UNSAFE_RESULT
    cost = 1 if peek else call.cost
    algorithm, window = call.algorithm, call.windows[0]
    used, prev = view = _view(algorithm, window, 1, state, now)
    fits = allows(algorithm, window, used, prev, now, cost)
    # A group of this one call is allowed when it fits (group_allows); when it does not,
    # decide_policy refuses it whatever the group's decision.
    status = decide_policy(call, fits, fits, peek)
    charged = status == CHARGED
    result, ttl = window_result(algorithm, window, used, prev, now, cost, charged)
    decided = new_tuple(PolicyResult, (status, now, (result,)))
    if not charged:
        return new_tuple(GroupResult, (GROUP_DECIDED, (decided,), ()))
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
    places = _places(calls, nows)
    if places is None:
        return _CLOCK_UNSAFE_RESULT
    ledgers = records if records is not None else [b""] * len(calls)
    peek = group.peek
    replay = False
    if group.may_repeat and not peek:
        repeat = _repeats(seen, nows, ledgers, group.fingerprint, group.dedup_ttl_ms)
        if repeat is not True and holds_leases(calls, logs, nows, group.fingerprint):
            repeat = True
        if repeat is None:
            return _INDETERMINATE_RESULT
        replay = repeat
    sights = []
    fits = []
    for index, call in enumerate(calls):
        stored = logs[index] if logs is not None else ()
        cost = 1 if peek else call.cost
        if places[index]:
            views, log, fit = calendar_at(call, seen[index], places[index], cost)
        else:
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
            if call.algorithm == CONCURRENCY and logs is not None:
                status = replayed_lease(logs[index], now, group.fingerprint)
        else:
            status = decide_policy(call, fits[index], allowed, peek)
        charged = status == CHARGED and not replay
        if places[index]:
            windows, ttl = calendar_reported(call, views, places[index], now, peek, charged)
        else:
            windows, ttl = _reported(call, views, log, now, 1 if peek else call.cost, charged)
        if replay:
            windows = tuple(result._replace(retry_after_ms=-1) for result in windows)
        results.append(new_tuple(PolicyResult, (status, now, windows)))
        if charged:
            stored = logs[index] if logs is not None else ()
            sight = (views, log, seen[index], stored, places[index])
            writes.append(_charged_write(index, call, sight, now, ttl, ledgers[index], group))
    group_status = GROUP_REPLAYED if replay else GROUP_DECIDED
    return new_tuple(GroupResult, (group_status, tuple(results), tuple(writes)))


def _charged_write(
    index: int,
    call: PolicyCall,
    sight: tuple[
        list[tuple[int, int]], _LogWindows | None, Mapping[str, int], Sequence[Log], Place
    ],
    now: int,
    ttl: int,
    ledger: bytes,
    group: GroupInputs,
) -> Write:
    """The write of charged policy ``index`` (:func:`_evaluate_general`): its leases, or
    its numbers, ledger and log (:func:`_charge`), keeping a calendar counter's expiry
    when it may. ``sight``: its views and sliding log, stored numbers and leases, place."""
    views, log, state, stored, place = sight
    if call.algorithm == CONCURRENCY:
        return lease_charge(index, call, stored, now, group.fingerprint, group.cleanup_grace_ms)
    write = _charge(
        index, call, views, log, state, now, ttl, ledger,
        now_ms=group.now_ms, fingerprint=group.fingerprint,
        cleanup_grace_ms=group.cleanup_grace_ms, dedup_ttl_ms=group.dedup_ttl_ms,
        server_clock=group.server_clock,
    )
    if place:
        keep = calendar_keeps(
            state, place, group.now_ms, ttl, group.dedup_ttl_ms, server_clock=group.server_clock
        )
        write = write._replace(keep_ttl=keep)
    return write


# -- calendar windows (core/calendar.py; docs/policies.md, "Calendar windows") ---------------


def _places(calls: Sequence[PolicyCall], nows: Sequence[int]) -> list[Place] | None:
    """Per call, the window ``[start, end)`` each of its windows is decided in, placed by
    the decider's effective ``now`` between the boundaries the client sent
    (:func:`~django_quota.core.windows.calendar_place`); ``[]`` for a call without
    boundaries. None when a calendar window's ``now`` is outside them: the group is
    clock unsafe (evaluate.lua checks it before the ledgers, as here)."""
    places: list[Place] = []
    for call, now in zip(calls, nows, strict=True):
        place: Place = []
        if call.bounds:
            for index, window in enumerate(call.windows):
                start, end = calendar_place(call.bounds, index, now, window.period_ms)
                if end == 0:
                    return None
                place.append((start, end))
        places.append(place)
    return places

