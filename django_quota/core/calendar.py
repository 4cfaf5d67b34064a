"""Calendar windows' boundaries: local midnights in a policy's timezone (docs/policies.md,
"Calendar windows"; docs/arithmetic.md).

A calendar window (a ``fixed_window`` window of exactly one day, week, month or year)
starts at local midnight of the day, of the ISO week's Monday, of the 1st, of 1 January,
and ends at the next one. The counters' clock may be Redis ``TIME``, which the client
cannot read, so the client sends, per calendar window, three boundaries ``b0 < b1 < b2``
(:func:`calendar_bounds`) and whoever decides (``evaluate.lua``, or the model for the
memory backend) places its own ``now`` between them
(:func:`~django_quota.core.windows.calendar_place`): ``[b0, b1)`` or ``[b1, b2)``, else
the group is ``clock_unsafe``.
"""

from __future__ import annotations

import zoneinfo
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache

from django_quota.core.policy import Window

#: How far behind the client's clock the counters' clock may be at a boundary and still
#: be placed: the boundaries sent are those around ``now - SKEW_MS`` (docs/policies.md).
SKEW_MS = 60_000

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


@lru_cache(maxsize=64)
def _zone(name: str) -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(name)


def _first_day(calendar: str, day: date) -> date:
    """The first local day of the ``calendar`` window holding ``day``."""
    if calendar == "week":
        return day - timedelta(days=day.weekday())  # ISO weeks start on Monday
    if calendar == "month":
        return day.replace(day=1)
    if calendar == "year":
        return date(day.year, 1, 1)
    return day


def _next_first_day(calendar: str, first: date) -> date:
    """The first local day of the ``calendar`` window after the one starting ``first``."""
    if calendar == "week":
        return first + timedelta(days=7)
    if calendar == "month":
        return (
            date(first.year + 1, 1, 1)
            if first.month == 12
            else first.replace(month=first.month + 1)
        )
    if calendar == "year":
        return date(first.year + 1, 1, 1)
    return first + timedelta(days=1)


def _midnight(day: date, zone: zoneinfo.ZoneInfo) -> int:
    """The instant (ms since the epoch) local ``day`` starts in ``zone``: its midnight, or
    the first instant after it when a change of offset skips midnight (fold 0: the
    offset before the change)."""
    local = datetime(day.year, day.month, day.day, tzinfo=zone)
    return (local - _EPOCH) // _MS


def window_start(calendar: str, zone_name: str, now_ms: int) -> int:
    """The start (ms) of the ``calendar`` window (``"day"``, ``"week"``, ``"month"``,
    ``"year"``) holding ``now_ms`` in the timezone ``zone_name``."""
    zone = _zone(zone_name)
    day = datetime.fromtimestamp(now_ms // 1000, zone).date()
    first = _first_day(calendar, day)
    start = _midnight(first, zone)
    if start > now_ms:  # now before the start of its local date (a fold at midnight)
        first = _first_day(calendar, first - timedelta(days=1))
        start = _midnight(first, zone)
    return start


def window_end(calendar: str, zone_name: str, start_ms: int) -> int:
    """The end (ms) of the ``calendar`` window that starts at ``start_ms``: the next
    window's start."""
    zone = _zone(zone_name)
    first = _first_day(calendar, datetime.fromtimestamp(start_ms // 1000, zone).date())
    return _midnight(_next_first_day(calendar, first), zone)


def calendar_bounds(calendar: str, zone_name: str, now_ms: int) -> tuple[int, int, int]:
    """``(b0, b1, b2)``: the window holding ``now_ms - SKEW_MS`` is ``[b0, b1)``, the next
    one ``[b1, b2)``. ``now_ms`` is always inside ``[b0, b2)`` (a window lasts 23 hours at
    least), and so is a counters' clock up to ``SKEW_MS`` behind the client's or ahead of
    it until ``b2``."""
    b0 = window_start(calendar, zone_name, now_ms - SKEW_MS)
    b1 = window_end(calendar, zone_name, b0)
    return b0, b1, window_end(calendar, zone_name, b1)


def windows_bounds(windows: Sequence[Window], now_ms: int) -> tuple[tuple[int, ...], int, int]:
    """The flat boundaries of a call with calendar windows at the client's ``now_ms``
    (three per window, 0, 0, 0 for an epoch-aligned one: ``PolicyCall.bounds``), and the
    range ``[valid_from, valid_until)`` of client times that give the same ones."""
    bounds: list[int] = []
    valid_from, valid_until = 0, 2**63
    for window in windows:
        if not window.calendar:
            bounds += (0, 0, 0)
            continue
        b0, b1, b2 = calendar_bounds(window.calendar, window.timezone, now_ms)
        bounds += (b0, b1, b2)
        valid_from = max(valid_from, b0 + SKEW_MS)
        valid_until = min(valid_until, b1 + SKEW_MS)
    return tuple(bounds), valid_from, valid_until
