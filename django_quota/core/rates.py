"""Rate strings: ``"N/P"`` with P one of s, m, h, d, w, mo, y (or sec, second, seconds,
min, minute, minutes, hour, hours, day, days, week, weeks, month, months, year, years),
in any case, with an optional integer multiplier (``"100/5m"``, ``"10/minute"``): the one
grammar of settings, the decorator and the DRF drop-ins (docs/policies.md). ``m`` is
minutes; a month or a year takes no multiplier (a calendar window, docs/policies.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

from django_quota.core.errors import ConfigurationError


class Bounds:
    """What a rate may be: a limit up to a billion, a period from a second to a year."""

    MAX_LIMIT: Final = 10**9
    MIN_PERIOD_MS: Final = 1_000
    MAX_PERIOD_MS: Final = 366 * 86_400_000
    #: Largest ``limit * period_ms`` (and ``capacity * period_ms``): keeps every product
    #: the scripts form an exact integer in a Lua double (53-bit mantissa) with room to add.
    MAX_PRODUCT: Final = 2**52


class Grammar:
    """The grammar's tables: the period units and their spellings, and the pattern."""

    #: The period units, shortest first: milliseconds, spellings (lower case; the text is
    #: matched in any case) and the calendar unit (:attr:`Rate.calendar`) a period written
    #: with a multiplier of 1 has (None: none). A month's and a year's milliseconds are
    #: their longest (31 and 366 days), where a number is needed (the bounds, the
    #: revision): their windows follow the calendar.
    UNITS: Final = (
        (1_000, ("s", "sec", "second", "seconds"), None),
        (60_000, ("m", "min", "minute", "minutes"), None),
        (3_600_000, ("h", "hour", "hours"), None),
        (86_400_000, ("d", "day", "days"), "day"),
        (7 * 86_400_000, ("w", "week", "weeks"), "week"),
        (31 * 86_400_000, ("mo", "month", "months"), "month"),
        (366 * 86_400_000, ("y", "year", "years"), "year"),
    )
    #: Calendar unit of each spelling that has one.
    CALENDAR_UNITS: Final = {name: unit for _, names, unit in UNITS if unit for name in names}
    #: Calendar units that exist only as calendar windows (no multiplier, fixed_window only).
    CALENDAR_ONLY: Final = ("month", "year")
    #: Period names (lower case) -> milliseconds.
    UNIT_MS: Final = {name: ms for ms, names, _ in UNITS for name in names}
    #: The units a period is written back in, largest first (:func:`format_period`): day,
    #: hour, minute, second.
    WRITTEN_UNITS: Final = tuple((names[0], ms) for ms, names, _ in reversed(UNITS[:4]))
    #: How error messages and hints spell the grammar.
    SPELLED: Final = (
        "'N/P' with P one of s, m, h, d, w, mo, y (or sec, second(s), min, minute(s), "
        "hour(s), day(s), week(s), month(s), year(s)) and an optional multiplier ('100/5m'; "
        "none for a month or a year)"
    )
    RATE_RE: Final = re.compile(
        r"^\s*(?P<limit>[0-9]+)\s*/\s*(?P<multiplier>[0-9]*)\s*(?P<unit>[A-Za-z]+)\s*$"
    )


@dataclass(frozen=True, slots=True)
class Rate:
    """A limit of ``limit`` units per ``period_ms`` milliseconds; ``calendar`` is the
    unit (``"day"``, ``"week"``, ``"month"``, ``"year"``) of a period written as exactly
    one of them (``"d"``, ``"1w"``, ``"month"``), else ``""``."""

    limit: int
    period_ms: int
    #: How the period was written, not its length: rates of one period compare equal.
    calendar: str = field(default="", compare=False)

    @property
    def period(self) -> float:
        """The period in seconds."""
        return self.period_ms / 1000


def parse_rate(text: object, key: str = "rate") -> Rate:
    """Parse ``"N/P"`` into a :class:`Rate`, enforcing the numeric bounds of ``docs/policies.md``.

    P is a period name of :attr:`Grammar.UNIT_MS` in any case (``"10/Minute"``), optionally
    preceded by an integer multiplier (``"100/5m"``); whitespace around the parts is
    ignored. Raises :class:`ConfigurationError` (naming ``key``) for anything else: a non-string,
    a zero or negative count, an unknown unit, a period under 1 s or over 366 d, a
    limit over 10**9, or ``limit * period_ms`` over 2**52.
    """
    if not isinstance(text, str):
        raise ConfigurationError(key, f"a rate must be a string like '10/s', not {text!r}")
    match = Grammar.RATE_RE.match(text)
    if match is None:
        raise ConfigurationError(key, f"{text!r} is not a rate; write {Grammar.SPELLED}")
    unit = match["unit"].lower()
    if unit not in Grammar.UNIT_MS:
        raise ConfigurationError(
            key, f"{text!r}: unknown period {match['unit']!r}; write {Grammar.SPELLED}"
        )
    # int() refuses strings of over 4300 digits (a bare ValueError without the key);
    # anything over 20 significant digits is far outside the bounds anyway.
    if max(len(match["limit"].lstrip("0")), len(match["multiplier"].lstrip("0"))) > 20:
        raise ConfigurationError(
            key,
            f"{text!r}: the count must be at most {Bounds.MAX_LIMIT} and the period at most "
            "1 year",
        )
    limit = int(match["limit"])
    multiplier = int(match["multiplier"]) if match["multiplier"] else 1
    if limit < 1:
        raise ConfigurationError(key, f"{text!r}: the count must be a positive integer")
    if multiplier < 1:
        raise ConfigurationError(key, f"{text!r}: the period multiplier must be positive")
    calendars = Grammar.CALENDAR_UNITS
    calendar = calendars.get(unit, "") if multiplier == 1 else ""
    if calendar == "" and unit in calendars and calendars[unit] in Grammar.CALENDAR_ONLY:
        raise ConfigurationError(
            key, f"{text!r}: a {calendars[unit]} takes no multiplier (a calendar window)"
        )
    rate = Rate(limit=limit, period_ms=multiplier * Grammar.UNIT_MS[unit], calendar=calendar)
    check_rate_bounds(rate.limit, rate.period_ms, key)
    return rate


def check_rate_bounds(limit: int, period_ms: int, key: str) -> None:
    """Raise :class:`ConfigurationError` unless the numeric bounds hold (:class:`Bounds`):
    a limit of 1 to ``MAX_LIMIT``, a period of ``MIN_PERIOD_MS`` to ``MAX_PERIOD_MS``
    milliseconds, and ``limit * period_ms`` at most ``MAX_PRODUCT``."""
    if limit < 1 or limit > Bounds.MAX_LIMIT:
        raise ConfigurationError(
            key, f"the limit must be between 1 and {Bounds.MAX_LIMIT}, not {limit}"
        )
    if period_ms < Bounds.MIN_PERIOD_MS or period_ms > Bounds.MAX_PERIOD_MS:
        raise ConfigurationError(
            key,
            f"the period must be between 1 s and 366 d (a year), not {format_period(period_ms)}",
        )
    if limit * period_ms > Bounds.MAX_PRODUCT:
        raise ConfigurationError(
            key, "limit x period in milliseconds exceeds 2**52; lower the limit or the period"
        )


def bounds_problem(limit: int, period_ms: int) -> str | None:
    """What :func:`check_rate_bounds` refuses in ``limit`` per ``period_ms``, or None: for
    a rate another library's grammar read (django-ratelimit's, DRF's)."""
    try:
        check_rate_bounds(limit, period_ms, "rate")
    except ConfigurationError as exc:
        return exc.message
    return None


def format_period(period_ms: int) -> str:
    """Write a period as the rate grammar reads it, in its largest whole unit: ``"d"``
    for one day, ``"30d"``, ``"90s"``, ``"1500ms"`` for what is no whole second."""
    for unit, unit_ms in Grammar.WRITTEN_UNITS:
        if period_ms % unit_ms == 0:
            count = period_ms // unit_ms
            return unit if count == 1 else f"{count}{unit}"
    return f"{period_ms}ms"


def format_rate(limit: int, period_ms: int, calendar: str = "") -> str:
    """Write a rate as the grammar reads it: ``"5/m"``, ``"10000/30d"``; a calendar
    window in words: ``"10000/month"``."""
    if calendar:
        return f"{limit}/{calendar}"
    return f"{limit}/{format_period(period_ms)}"
