"""Calendar windows (docs/policies.md#calendar-windows): a fixed window of exactly one
day, week, month or year starts at local midnight in the policy's timezone. The model
(the memory backend), the script on fakeredis and on a real redis-server decide alike on
generated sequences across DST changes, month ends, year ends and ISO weeks; the script
places Redis ``TIME`` among the boundaries the client sent; a UTC day is the epoch day."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_quota.core.calendar import SKEW_MS, calendar_bounds, windows_bounds
from django_quota.core.calls import GROUP_CLOCK_UNSAFE, PolicyCall
from django_quota.core.model import evaluate_group
from django_quota.core.policy import Window, parse_policy, written_rate
from django_quota.core.protocol import GroupReply, GroupRequest, counter_tail, fingerprint
from tests import differential
from tests.differential import SEQUENCES, expected_script

EXAMPLES = int(os.environ.get("QUOTA_DIFFERENTIAL_EXAMPLES", "150"))
HUGE_MS = 10 * 365 * 86_400_000
DAY = 86_400_000


def ms(text: str) -> int:
    """An ISO UTC time in ms since the epoch."""
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


def utc(value: int) -> str:
    return datetime.fromtimestamp(value / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S")


# -- boundaries ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("calendar", "zone", "now", "expected"),
    [
        # Berlin springs forward on 29 March 2026: a 23-hour day.
        ("day", "Europe/Berlin", "2026-03-29T12:00:00",
         ("2026-03-28T23:00:00", "2026-03-29T22:00:00", "2026-03-30T22:00:00")),
        # ... and falls back on 25 October: a 25-hour day.
        ("day", "Europe/Berlin", "2026-10-25T12:00:00",
         ("2026-10-24T22:00:00", "2026-10-25T23:00:00", "2026-10-26T23:00:00")),
        # Lord Howe moves by 30 minutes (5 April 2026: a 24.5-hour day).
        ("day", "Australia/Lord_Howe", "2026-04-05T12:00:00",
         ("2026-04-04T13:00:00", "2026-04-05T13:30:00", "2026-04-06T13:30:00")),
        # New York: February (28 days) then March (31 days, with the change to EDT).
        ("month", "America/New_York", "2026-02-15T00:00:00",
         ("2026-02-01T05:00:00", "2026-03-01T05:00:00", "2026-04-01T04:00:00")),
        # A leap February: 29 days; then April's 30.
        ("month", "UTC", "2028-03-31T23:59:59",
         ("2028-03-01T00:00:00", "2028-04-01T00:00:00", "2028-05-01T00:00:00")),
        ("month", "UTC", "2028-02-10T00:00:00",
         ("2028-02-01T00:00:00", "2028-03-01T00:00:00", "2028-04-01T00:00:00")),
        # ISO weeks across a year end: Monday 28 December 2026, Monday 4 January 2027.
        ("week", "UTC", "2026-12-31T00:00:00",
         ("2026-12-28T00:00:00", "2027-01-04T00:00:00", "2027-01-11T00:00:00")),
        ("year", "Europe/Berlin", "2026-06-01T00:00:00",
         ("2025-12-31T23:00:00", "2026-12-31T23:00:00", "2027-12-31T23:00:00")),
    ],
)  # fmt: skip
def test_boundaries_are_local_midnights(
    calendar: str, zone: str, now: str, expected: tuple[str, str, str]
) -> None:
    assert tuple(utc(bound) for bound in calendar_bounds(calendar, zone, ms(now))) == expected


def test_boundaries_cover_a_counters_clock_a_minute_behind() -> None:
    """Just after a boundary the client sends the window before it too: a counters' clock
    up to SKEW_MS behind still places its now."""
    boundary = ms("2026-04-30T22:00:00")  # 1 May in Berlin
    b0, b1, _ = calendar_bounds("month", "Europe/Berlin", boundary + SKEW_MS - 1)
    assert (utc(b0), utc(b1)) == ("2026-03-31T22:00:00", "2026-04-30T22:00:00")
    b0, _, _ = calendar_bounds("month", "Europe/Berlin", boundary + SKEW_MS)
    assert utc(b0) == "2026-04-30T22:00:00"


# -- policies, revisions, checks -------------------------------------------------------------
def test_a_utc_day_keeps_todays_counter_key_and_revision() -> None:
    """Recorded with main before calendar windows existed (8f26be6): in UTC a one-day
    window is the epoch-aligned day, so upgrading changes no counter."""
    day = parse_policy("orders", {"windows": "5/d"})
    assert day.windows[0].calendar == ""
    assert counter_tail(day) == "}:6:orders:b3fc8648"
    two = parse_policy("orders", {"windows": {"a": "5/d", "b": "100/h"}, "selector": ["user"]})
    assert counter_tail(two) == "}:6:orders:7a67847e"
    assert parse_policy("orders", {"windows": "2/7d"}).revision == "03d2b52e"
    bucket = parse_policy("orders", {"windows": "10/s", "algorithm": "token_bucket"})
    assert bucket.revision == "d346fbab"
    # A UTC day decides exactly as the epoch-aligned day: the same call, the same result.
    assert (
        PolicyCall("fixed_window", day.windows, 1).packed
        == PolicyCall("fixed_window", (Window("default", 5, DAY, 5),), 1).packed
    )


def test_the_revision_covers_the_timezone_of_calendar_windows() -> None:
    berlin = parse_policy("p", {"windows": "5/d", "timezone": "Europe/Berlin"})
    tokyo = parse_policy("p", {"windows": "5/d", "timezone": "Asia/Tokyo"})
    utc_day = parse_policy("p", {"windows": "5/d"})
    assert len({berlin.revision, tokyo.revision, utc_day.revision}) == 3
    # A week is a calendar week (from Monday) in UTC too, not the epoch's 7 days.
    assert (
        parse_policy("p", {"windows": "5/w"}).revision
        != parse_policy("p", {"windows": "5/7d"}).revision
    )
    # The timezone of a policy without calendar windows changes nothing.
    assert parse_policy("p", {"windows": "5/h", "timezone": "Asia/Tokyo"}).revision == (
        parse_policy("p", {"windows": "5/h"}).revision
    )


def test_weeks_are_seven_days_outside_fixed_windows() -> None:
    (window,) = parse_policy("p", {"windows": "5/w", "algorithm": "token_bucket"}).windows
    assert (window.period_ms, window.calendar) == (7 * DAY, "")
    (window,) = parse_policy("p", {"windows": "5/2w"}).windows
    assert (window.period_ms, window.calendar) == (14 * DAY, "")


@pytest.mark.parametrize(
    ("definition", "key", "words"),
    [
        ({"windows": "5/d", "timezone": "Mars/Olympus"}, "['timezone']", "unknown timezone"),
        ({"windows": "5/d", "timezone": 3}, "['timezone']", "IANA name"),
        ({"windows": "5/2mo"}, "['windows']", "a month takes no multiplier"),
        ({"windows": "5/2y"}, "['windows']", "a year takes no multiplier"),
        ({"windows": "5/month", "algorithm": "token_bucket"}, "['windows']", "fixed_window only"),
        ({"windows": {"a": "1/s", "b": "5/y"}, "algorithm": "sliding_window"}, "['windows']",
         "fixed_window only"),
    ],
)  # fmt: skip
def test_checks_name_the_policy_of_a_bad_calendar_window(
    definition: dict[str, Any], key: str, words: str
) -> None:
    from django_quota.conf import parse_settings

    _, problems = parse_settings({"POLICIES": {"plans": definition}})
    assert [(problem.id, problem.key) for problem in problems] == [
        ("django_quota.E004", f"QUOTA['POLICIES']['plans']{key}")
    ]
    assert words in problems[0].message


def test_an_unknown_timezone_setting_is_e003() -> None:
    from django_quota.conf import parse_settings

    _parsed, problems = parse_settings(
        {"TIMEZONE": "Europe/Nowhere", "POLICIES": {"p": {"windows": "5/d"}}}
    )
    assert [(problem.id, problem.key) for problem in problems] == [
        ("django_quota.E003", "QUOTA['TIMEZONE']")
    ]
    assert "Europe/Nowhere" in problems[0].message


@pytest.mark.parametrize("zone", ["localtime", "posixrules", "Factory", "right/UTC",
                                  "posix/Europe/Berlin"])
def test_a_host_zoneinfo_file_is_no_timezone(zone: str) -> None:
    """``zoneinfo`` opens ``localtime`` (the host's zone, where the system has that file)
    and the like; each host may hold another zone there, so processes would disagree on
    when a day starts."""
    from django_quota.conf import parse_settings

    _parsed, problems = parse_settings(
        {"TIMEZONE": zone, "POLICIES": {"p": {"windows": "5/d", "timezone": zone}}}
    )
    assert [(problem.id, problem.key) for problem in problems] == [
        ("django_quota.E003", "QUOTA['TIMEZONE']"),
        ("django_quota.E004", "QUOTA['POLICIES']['p']['timezone']"),
    ]
    for problem in problems:
        assert f"{zone!r} is this host's zoneinfo file, not an IANA zone name" in (
            problem.message
        )


def test_timezone_setting_is_the_policies_default() -> None:
    from django_quota.conf import parse_settings

    parsed, problems = parse_settings(
        {
            "TIMEZONE": "America/New_York",
            "POLICIES": {
                "own": {"windows": "5/month", "timezone": "Europe/Berlin"},
                "default": {"windows": "5/month"},
            },
        }
    )
    assert problems == []
    assert parsed is not None
    assert parsed.timezone == "America/New_York"
    assert parsed.policies["own"].windows[0].timezone == "Europe/Berlin"
    assert parsed.policies["default"].windows[0].timezone == "America/New_York"
    default = parsed.policies["default"]
    assert written_rate(default.algorithm, default.windows[0]) == "5/month (America/New_York)"


# -- exact counts at the boundaries ----------------------------------------------------------
MONTH = Window("m", 3, 31 * DAY, 3, "month", "Europe/Berlin")


def decide(engine: Any, windows: tuple[Window, ...], now: int, cost: int = 1) -> GroupReply:
    call = PolicyCall("fixed_window", windows, cost, True, windows_bounds(windows, now)[0])
    request = GroupRequest(
        ("q:{s}:cal",), (call,), now, False, -1, 5_000, 1_000, fingerprint(f"id{now}")
    )
    reply = engine.evaluate(request)
    assert isinstance(reply, GroupReply), reply
    return reply


@pytest.fixture(scope="module")
def engines(redis_server: Any) -> list[Any]:
    return differential.engines_on(redis_server, db=2)


@pytest.mark.redis
@pytest.mark.parametrize(
    ("window", "boundary"),
    [
        (MONTH, "2026-03-31T22:00:00"),  # 1 April in Berlin (after the change to CEST)
        (Window("d", 3, DAY, 3, "day", "Australia/Lord_Howe"), "2026-04-05T13:30:00"),
        (Window("w", 3, 7 * DAY, 3, "week", "America/New_York"), "2027-01-04T05:00:00"),
        (Window("y", 3, 366 * DAY, 3, "year", "Europe/Berlin"), "2026-12-31T23:00:00"),
        (Window("m", 3, 31 * DAY, 3, "month", "UTC"), "2028-03-01T00:00:00"),  # leap Feb
    ],
)
def test_the_limit_holds_to_the_boundary_and_the_budget_is_whole_after(
    engines: list[Any], window: Window, boundary: str
) -> None:
    edge = ms(boundary)
    for engine in engines:
        engine.reset()
        before = [decide(engine, (window,), edge - 4 + step) for step in range(4)]
        assert [r.results[0].status for r in before] == [1, 1, 1, 0]
        assert [r.results[0].windows[0].remaining for r in before] == [2, 1, 0, 0]
        assert [r.results[0].windows[0].reset_after_ms for r in before] == [4, 3, 2, 1]
        assert before[-1].results[0].windows[0].retry_after_ms == 1
        after = [decide(engine, (window,), edge + step) for step in range(4)]
        assert [r.results[0].status for r in after] == [1, 1, 1, 0], engine.name
        assert [r.results[0].windows[0].remaining for r in after] == [2, 1, 0, 0]
        end = calendar_bounds(window.calendar, window.timezone, edge + SKEW_MS)[1]
        assert after[-1].results[0].windows[0].retry_after_ms == end - edge - 3


# -- the model against the script, generated --------------------------------------------------
ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "UTC", "Asia/Kathmandu"]
#: Instants near which the sequences start: DST changes, month ends of 28 to 31 days, year
#: ends, ISO weeks starting in one year and ending in the next.
STARTS = [
    ms(text)
    for text in [
        "2026-03-29T00:59:00",  # Berlin: 02:00 -> 03:00
        "2026-10-25T00:59:00",  # Berlin: 03:00 -> 02:00
        "2026-03-08T06:59:00",  # New York: 02:00 -> 03:00
        "2026-11-01T05:59:00",  # New York: 02:00 -> 01:00
        "2026-04-04T14:59:00",  # Lord Howe: 02:00 -> 01:30
        "2026-10-03T15:29:00",  # Lord Howe: 02:00 -> 02:30
        "2026-02-28T22:59:00",  # end of a 28-day February
        "2028-02-29T22:59:00",  # end of a 29-day February
        "2026-04-30T21:59:00",  # end of a 30-day April (Berlin)
        "2026-01-31T23:59:00",  # end of a 31-day January
        "2026-12-31T22:59:00",  # a year's end (Berlin), inside ISO week 53
        "2027-01-03T23:59:00",  # ISO week 1 of 2027 starts (UTC)
    ]
]
CALENDARS = {"day": DAY, "week": 7 * DAY, "month": 31 * DAY, "year": 366 * DAY}


@st.composite
def calendar_windows(draw: Any) -> tuple[Window, ...]:
    count = draw(st.integers(1, 3))
    zone = draw(st.sampled_from(ZONES))
    out = []
    for index in range(count):
        limit = draw(st.integers(1, 6))
        if index > 0 and draw(st.booleans()):  # an epoch-aligned window of the same call
            period = draw(st.sampled_from([1_000, 60_000, 3_600_000, DAY]))
            out.append(Window(f"w{index}", limit, period, limit))
            continue
        calendar = draw(st.sampled_from(sorted(CALENDARS)))
        out.append(Window(f"w{index}", limit, CALENDARS[calendar], limit, calendar, zone))
    if not any(window.calendar for window in out):
        return (Window("w0", 2, DAY, 2, "day", zone),)
    return tuple(out)


@st.composite
def calendar_steps(draw: Any) -> list[tuple[Any, int, bool, bool]]:
    """(time step ms or "boundary" +-1 ms, cost, peek, repeat the previous id)."""
    out = []
    for _ in range(draw(st.integers(1, 30))):
        step = draw(
            st.one_of(
                st.tuples(st.just("reset"), st.sampled_from([-1, 0, 0, 1])),
                st.integers(0, 2_000),
                st.sampled_from([-1_000, -1, 1, 59_999, 60_000, 1_800_000, 3_600_000, DAY]),
                st.sampled_from([7 * DAY, 29 * DAY, 31 * DAY]),
            )
        )
        out.append((step, draw(st.integers(0, 3)), draw(st.booleans()), draw(st.booleans())))
    return out


def _run_calendar(
    engines: list[Any],
    windows: tuple[Window, ...],
    start: int,
    sequence: list[tuple[Any, int, bool, bool]],
    regression: int,
) -> None:
    for engine in engines:
        engine.reset()
    now = start
    last: GroupReply | str | None = None
    evaluation_id = "c0"
    counter = "q:{s}:cal"
    for number, (step, cost, peek, repeat) in enumerate(sequence):
        if isinstance(step, tuple):  # to the first window's reset, +-1 ms
            if isinstance(last, GroupReply) and last.results:
                now += max(0, last.results[0].windows[0].reset_after_ms + step[1])
        else:
            now += step
        if not repeat:
            evaluation_id = f"c{number + 1}"
        call = PolicyCall("fixed_window", windows, cost, True, windows_bounds(windows, now)[0])
        request = GroupRequest(
            (counter,), (call,), now, peek or cost == 0, regression, HUGE_MS, HUGE_MS,
            fingerprint(evaluation_id), repeat or number % 3 == 0,
        )  # fmt: skip
        replies = [engine.evaluate(request) for engine in engines]
        script = expected_script(request)
        for engine in engines[1:]:
            assert engine.scripts[-1:] == [script]
            engine.scripts.clear()
        expected = last = replies[0]
        for engine, reply in zip(engines[1:], replies[1:], strict=True):
            assert reply == expected, (
                f"{engine.name} differs at step {number} ({utc(now)}, cost {cost}): "
                f"{reply} != {expected}"
            )
        want = engines[0].state(counter, call)
        for engine in engines[1:]:
            assert engine.state(counter, call) == want, f"{engine.name} stored another state"
        # The lifetime each charge set: to the window's end, plus the grace (the model's
        # wall clock stands at 0, so its expiry is the lifetime; Redis counts down).
        entry = engines[0].backend._counters.get(counter)
        for engine in engines[1:]:
            pttl = engine.client.pttl(counter)
            if entry is None:
                assert pttl == -2, f"{engine.name}: a counter the model does not hold"
            else:
                assert entry.expires_at - 2_000 < pttl <= entry.expires_at, (
                    f"{engine.name} step {number}: PTTL {pttl}, model {entry.expires_at}"
                )
    for engine in engines:
        SEQUENCES[("calendar", engine.name)] += 1


@pytest.mark.redis
def test_lua_matches_model_across_dst_month_and_year_ends(engines: list[Any]) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=st.data())
    def check(data: Any) -> None:
        windows = data.draw(calendar_windows())
        start = data.draw(st.sampled_from(STARTS)) + data.draw(st.integers(-3_600_000, 3_600_000))
        sequence = data.draw(calendar_steps())
        regression = data.draw(st.sampled_from([-1, -1, 0, 1_000]))
        _run_calendar(engines, windows, start, sequence, regression)

    check()


# -- the counters' clock: Redis TIME -----------------------------------------------------------
def _server_now(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _on_server_clock(engine: Any, window: Window, bounds: tuple[int, int, int]) -> GroupReply:
    call = PolicyCall("fixed_window", (window,), 1, True, bounds)
    request = GroupRequest(("q:{s}:srv",), (call,), None, False, -1, 5_000, 1_000, b"abcde")
    reply = engine.evaluate(request)
    assert isinstance(reply, GroupReply), reply
    return reply


@pytest.mark.redis
def test_the_script_places_redis_time_among_the_boundaries(engines: list[Any]) -> None:
    """Boundaries around the real now, with one 400 ms ahead: the script counts in
    [b0, b1) until Redis TIME reaches b1, then in [b1, b2) with the whole budget, and
    reports the time to the boundary on its own clock."""
    engine = engines[2]
    engine.reset()
    window = Window("d", 2, DAY, 2, "day", "Europe/Berlin")
    server = _server_now(engine.client)
    bounds = (server - 3_600_000, server + 400, server + 400 + DAY)
    first = _on_server_clock(engine, window, bounds)
    second = _on_server_clock(engine, window, bounds)
    third = _on_server_clock(engine, window, bounds)
    assert [r.results[0].status for r in (first, second, third)] == [1, 1, 0]
    now = third.results[0].now_ms
    assert bounds[0] <= now < bounds[1]
    assert third.results[0].windows[0].reset_after_ms == bounds[1] - now
    while _server_now(engine.client) < bounds[1]:
        time.sleep(0.05)
    after = _on_server_clock(engine, window, bounds)
    assert after.results[0].status == 1
    assert after.results[0].windows[0].remaining == 1
    assert after.results[0].windows[0].reset_after_ms == bounds[2] - after.results[0].now_ms
    assert engine.client.pttl("q:{s}:srv") > DAY - 60_000  # lives to its window's end


@pytest.mark.redis
@pytest.mark.parametrize("offset", ["ahead", "behind"])
def test_clocks_that_disagree_past_the_boundaries_are_clock_unsafe(
    engines: list[Any], offset: str
) -> None:
    """A counters' clock outside [b0, b2) (a client clock over SKEW_MS ahead of Redis, or
    Redis past b2): nothing charged, nothing stored, the group is clock_unsafe."""
    engine = engines[2]
    engine.reset()
    window = Window("d", 2, DAY, 2, "day", "Europe/Berlin")
    server = _server_now(engine.client)
    if offset == "ahead":  # the client's window starts an hour after Redis's now
        bounds = (server + 3_600_000, server + DAY, server + 2 * DAY)
    else:  # Redis is past both windows the client knows
        bounds = (server - 2 * DAY, server - DAY, server - 1)
    reply = _on_server_clock(engine, window, bounds)
    assert reply.status == GROUP_CLOCK_UNSAFE
    assert engine.client.keys("*") == []
    # The model says the same on its clock.
    model = evaluate_group(
        [PolicyCall("fixed_window", (window,), 1, True, bounds)], [None], server,
        server_clock=True,
    )  # fmt: skip
    assert (model.status, model.writes) == (GROUP_CLOCK_UNSAFE, ())


def test_a_refusal_is_held_only_until_the_local_boundary() -> None:
    """The denial cache holds a refusal until its window rolls over: a calendar window
    rolls over at its local midnight (hold_ms reads reset_after, counted to it)."""
    from django_quota.core.denials import hold_ms

    edge = ms("2026-03-31T22:00:00")  # 1 April in Berlin
    call = PolicyCall("fixed_window", (MONTH,), 1, True, windows_bounds((MONTH,), edge - 5)[0])
    state = {"t": edge - 3_600_000, "c1": 3}
    result = evaluate_group([call], [state], edge - 5)
    assert result.results[0].status == 0  # refused
    assert hold_ms("fixed_window", result.results[0].windows) == 5


@pytest.mark.parametrize("rate", ["5/month", "5/mo", "5/Months", "5/y", "5/year"])
def test_the_drf_drop_ins_refuse_months_and_years(rate: str) -> None:
    """DRF reads "5/month" as 5 per minute, the grammar as a calendar month: a drop-in
    refuses it (check E013) rather than choosing either silently. A week is 7 days."""
    from django.core.exceptions import ImproperlyConfigured

    from django_quota.throttling import parse_drf_rate

    with pytest.raises(ImproperlyConfigured, match="calendar window"):
        parse_drf_rate(rate)
    assert parse_drf_rate("5/week") == (5, 7 * 86_400)


@pytest.mark.redis
def test_on_redis_time_a_charge_in_the_same_window_keeps_its_expiry(engines: list[Any]) -> None:
    """keeps_expiry for calendar windows: on the server clock, t and now in one window
    that outlives now by DEDUP_TTL, the script writes KEEPTTL (a marker expiry stays),
    and the model says keep_ttl; after the boundary a charge sets the expiry afresh."""
    engine = engines[2]
    engine.reset()
    window = Window("d", 5, DAY, 5, "day", "Europe/Berlin")
    server = _server_now(engine.client)
    bounds = (server - 3_600_000, server + 3_600_000, server + 3_600_000 + DAY)
    first = _on_server_clock(engine, window, bounds)
    marker = 30 * DAY
    assert engine.client.pexpire("q:{s}:srv", marker)
    _on_server_clock(engine, window, bounds)
    assert engine.client.pttl("q:{s}:srv") > marker - 60_000  # kept
    call = PolicyCall("fixed_window", (window,), 1, True, bounds)
    state = {"t": first.results[0].now_ms, "c1": 1}
    now = first.results[0].now_ms + 10
    (write,) = evaluate_group([call], [state], now, server_clock=True).writes
    assert write.keep_ttl
    (write,) = evaluate_group([call], [state], bounds[1], server_clock=True).writes
    assert not write.keep_ttl  # the next window: a new expiry
