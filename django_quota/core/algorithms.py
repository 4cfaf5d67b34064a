"""The algorithms a policy counts with and the window each counts over: their names,
:class:`Window`, and a window's rate as a person reads it (``docs/policies.md``)."""

from __future__ import annotations

from dataclasses import dataclass

from django_quota.core.rates import Grammar, format_rate

FIXED_WINDOW = "fixed_window"
SLIDING_WINDOW = "sliding_window"
SLIDING_LOG = "sliding_log"
TOKEN_BUCKET = "token_bucket"
#: At most N units in flight per identity, each lease released by the edge or after P
#: (docs/concurrency.md).
CONCURRENCY = "concurrency"
ALGORITHMS = (FIXED_WINDOW, SLIDING_WINDOW, SLIDING_LOG, TOKEN_BUCKET, CONCURRENCY)
#: A concurrency policy's largest N: a lease's units are two bytes of its member
#: (docs/concurrency.md), and every call reads its held leases.
MAX_CONCURRENCY = 65_535


@dataclass(frozen=True, slots=True)
class Window:
    """One window of a policy: ``limit`` units per ``period_ms`` milliseconds.

    ``capacity`` is the token bucket's size (``limit`` unless configured); other
    algorithms ignore it and keep it equal to ``limit``. ``calendar`` is ``"day"``,
    ``"week"``, ``"month"`` or ``"year"`` for a calendar window (a fixed window of exactly
    one of them, starting at local midnight in ``timezone``, an IANA name:
    docs/policies.md), else ``""``. A one-day window in UTC is no calendar window: it is
    exactly the epoch-aligned day.
    """

    name: str
    limit: int
    period_ms: int
    capacity: int
    calendar: str = ""
    timezone: str = ""

    @property
    def period(self) -> float:
        """The period in seconds."""
        return self.period_ms / 1000

    @property
    def rate(self) -> str:
        """The window's rate as the grammar writes it: ``"100/h"``, ``"10000/month"``."""
        return format_rate(self.limit, self.period_ms, self.calendar)


def counted_calendar(algorithm: str, window: Window) -> tuple[str, str]:
    """The calendar unit and timezone that ``window`` counts in, ``("", "")`` for none.

    A calendar window's own; ``("day", "UTC")`` for a fixed window of exactly one day
    without one, since the epoch-aligned day is the day in UTC (``"5/d"`` in UTC,
    ``"5/24h"`` in any timezone, a database policy's 86,400 seconds). What
    ``quota policies`` and the status page show (docs/policies.md#calendar-windows).
    """
    if window.calendar:
        return window.calendar, window.timezone
    if algorithm == FIXED_WINDOW and window.period_ms == Grammar.UNIT_MS["d"]:
        return "day", "UTC"
    return "", ""


def written_rate(algorithm: str, window: Window) -> str:
    """``window``'s rate as a person reads it: a window counted in a calendar unit in
    words with its timezone (``"10000/month (Europe/Berlin)"``, ``"5/day (UTC)"``),
    any other in its largest whole unit (``"100/30d"``, a rolling day ``"5/d"``)."""
    calendar, timezone = counted_calendar(algorithm, window)
    if calendar:
        return f"{format_rate(window.limit, window.period_ms, calendar)} ({timezone})"
    return window.rate
