"""The goals block: each engine goal (docs/benchmarks.md) with its figure from this run
and PASS or MISS.

Printed, never asserted: the figures are timings on a shared machine, except the memory
and key counts, which do not move from run to run. A goal whose rows were not measured
(``--only``, a peer not installed) says so instead of a verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks import contenders as c
from benchmarks import engine as e
from benchmarks import whole_request as wr

if TYPE_CHECKING:
    from benchmarks.report import Row

PASS = "PASS"
MISS = "MISS"
NOT_MEASURED = "-"
MAX_BYTES = 256


@dataclass(frozen=True, slots=True)
class Goal:
    """One line of the block."""

    goal: str
    measured: str
    target: str
    verdict: str


def _label(by_key: Mapping[str, Row], key: str) -> str:
    row = by_key.get(key)
    return key if row is None else f"{row.implementation} {row.algorithm}"


def _at_most(value: float | None, limit: float, shown: str) -> tuple[str, str]:
    if value is None:
        return "not measured", NOT_MEASURED
    # The verdict follows the figure as printed (1.004 shows as 1.00x and passes 1.00).
    return shown, PASS if round(value, 2) <= limit else MISS


def _ratio_goal(
    by_key: Mapping[str, Row],
    what: str,
    key: str,
    peer: str,
    limit: float,
    figure: Callable[[Row], float | None],
) -> Goal:
    ours, theirs = by_key.get(key), by_key.get(peer)
    value = None
    if ours is not None and theirs is not None:
        mine, other = figure(ours), figure(theirs)
        if mine is not None and other:
            value = mine / other
    shown = "" if value is None else f"{value:.2f}x"
    measured, verdict = _at_most(value, limit, shown)
    return Goal(
        f"{what}: {_label(by_key, key)} / {_label(by_key, peer)}",
        measured,
        f"<= {limit:.2f}x",
        verdict,
    )


def _p50(row: Row) -> float | None:
    return row.median_us


def _memory_goals(by_key: Mapping[str, Row], key: str) -> list[Goal]:
    row = by_key.get(key)
    label = _label(by_key, key)
    first = row.footprints.get(1) if row else None
    hundred = row.footprints.get(100) if row else None
    if first is None or hundred is None:
        return [
            Goal(
                f"bytes/subject @1 and @100: {label}",
                "not measured",
                f"<= {MAX_BYTES} B",
                NOT_MEASURED,
            ),
            Goal(f"keys/subject @100 == @1: {label}", "not measured", "equal", NOT_MEASURED),
        ]
    largest = max(first.bytes, hundred.bytes)
    return [
        Goal(
            f"bytes/subject @1 and @100: {label}",
            f"{first.bytes:,} B, {hundred.bytes:,} B",
            f"<= {MAX_BYTES} B",
            PASS if largest <= MAX_BYTES else MISS,
        ),
        Goal(
            f"keys/subject @100 == @1: {label}",
            f"{first.keys} -> {hundred.keys}",
            "equal",
            PASS if first.keys == hundred.keys else MISS,
        ),
    ]


def _added_goal(
    by_key: Mapping[str, Row],
    what: str,
    key: str,
    peer: str = wr.DRF_THROTTLED,
    peer_name: str = "DRF AnonRateThrottle",
) -> Goal:
    ours, theirs = by_key.get(key), by_key.get(peer)
    mine = wr.added_us(ours, by_key) if ours else None
    other = wr.added_us(theirs, by_key) if theirs else None
    label = f"{what} added µs / {peer_name} added µs"
    target = "<= 0.50x"
    if mine is None or other is None:
        return Goal(label, "not measured", target, NOT_MEASURED)
    if other <= 0:
        return Goal(label, f"{mine:.0f} / {other:.0f} µs: no ratio", target, NOT_MEASURED)
    value = mine / other
    measured, verdict = _at_most(value, 0.5, f"{value:.2f}x ({mine:.0f} / {other:.0f} µs)")
    return Goal(label, measured, target, verdict)


def _engine_ratio(
    what: str, ours: float | None, theirs: float | None, limit: float, at_least: bool = False
) -> Goal:
    target = f"{'>=' if at_least else '<='} {limit:.2f}x"
    if ours is None or not theirs:
        return Goal(what, "not measured", target, NOT_MEASURED)
    value = ours / theirs
    shown = f"{value:.2f}x"
    if at_least:
        return Goal(what, shown, target, PASS if round(value, 2) >= limit else MISS)
    measured, verdict = _at_most(value, limit, shown)
    return Goal(what, measured, target, verdict)


def _figure(table: Mapping[str, Mapping[str, float]], impl: str, name: str) -> float | None:
    found = table.get(impl)
    return None if found is None else found.get(name)


def engine_goals(figures: e.EngineFigures | None) -> list[Goal]:
    """The engine's goals (issue 24): async throughput and Redis CPU against limits.aio,
    the repeated denial, the cold burst."""
    figures = figures or e.EngineFigures()
    by_tasks = {
        impl: figures.concurrency.get(impl, {}) for impl in (e.DQ, e.LIMITS)
    }

    def at(tasks: int, name: str) -> tuple[float | None, float | None]:
        mine = by_tasks[e.DQ].get(str(tasks), {}).get(name)
        theirs = by_tasks[e.LIMITS].get(str(tasks), {}).get(name)
        return mine, theirs

    goals = [
        _engine_ratio("async p50 @1 task: django-quota / limits.aio", *at(1, "p50_us"), 1.05),
        _engine_ratio(
            "async dec/s @16 tasks: django-quota / limits.aio", *at(16, "throughput"), 1.5, True
        ),
        _engine_ratio(
            "async dec/s @64 tasks: django-quota / limits.aio", *at(64, "throughput"), 2.0, True
        ),
        _engine_ratio(
            "Redis CPU/dec @64 tasks: django-quota / limits.aio", *at(64, "cpu_us"), 1.0
        ),
        _engine_ratio(
            "repeated denial p50: django-quota / limits",
            _figure(figures.hammer, e.DQ, "denied_p50_us"),
            _figure(figures.hammer, e.LIMITS, "denied_p50_us"),
            0.10,
        ),
    ]
    calls = _figure(figures.hammer, e.DQ, "calls_per_request")
    what = f"Redis calls per request at {e.HAMMER_FACTOR}x the limit: django-quota"
    if calls is None:
        goals.append(Goal(what, "not measured", "<= 0.15", NOT_MEASURED))
    else:
        goals.append(Goal(what, f"{calls:.3f}", "<= 0.15", PASS if calls <= 0.15 else MISS))
    burst = figures.burst.get(e.DQ)
    what = f"cold burst of {e.BURST}: every one decided, allowed = limit, <= 8 connections"
    if burst is None:
        goals.append(Goal(what, "not measured", "0 failed, = L, <= 8", NOT_MEASURED))
    else:
        kept = (
            burst["failed"] == 0
            and burst["allowed"] == burst["limit"]
            and burst["connections"] <= 8
        )
        goals.append(
            Goal(
                what,
                f"{burst['failed']:.0f} failed, {burst['allowed']:.0f} of "
                f"{burst['limit']:.0f}, {burst['connections']:.0f} connections",
                "0 failed, = L, <= 8",
                PASS if kept else MISS,
            )
        )
    return goals


def evaluate(rows: Sequence[Row], figures: e.EngineFigures | None = None) -> list[Goal]:
    """Every goal, in the order of the issue (issue 24's goals block; the memory and
    whole-request goals of earlier issues after them)."""
    by_key = {row.key: row for row in rows}
    goals = [
        _ratio_goal(by_key, "p50", c.DQ_FIXED, c.LIMITS_FIXED, 1.05, _p50),
        _ratio_goal(by_key, "p50", c.DQ_SLIDING, c.LIMITS_SLIDING, 1.05, _p50),
        *engine_goals(figures),
        _ratio_goal(by_key, "p50", c.DQ_TWO_WINDOWS, c.DQ_SLIDING, 1.15, _p50),
        _ratio_goal(by_key, "p50", c.DQ_TWO_POLICIES, c.DQ_FIXED, 1.15, _p50),
    ]
    for key in (c.DQ_FIXED, c.DQ_SLIDING, c.DQ_TOKEN, c.DQ_CALENDAR):
        goals += _memory_goals(by_key, key)
    goals.append(_added_goal(by_key, "drop-in AnonRateThrottle", wr.DRF_QUOTA))
    goals.append(_added_goal(by_key, "QuotaMiddleware", wr.PLAIN_MIDDLEWARE))
    goals.append(
        _added_goal(
            by_key,
            "django_quota.ratelimit @ratelimit",
            wr.PLAIN_QUOTA_RATELIMIT,
            wr.PLAIN_RATELIMIT,
            "django-ratelimit @ratelimit",
        )
    )
    return goals
