"""The rate grammar ``"N/P"`` and its numeric bounds (docs/policies.md)."""

from __future__ import annotations

import pytest

from django_quota.core.errors import ConfigurationError
from django_quota.core.rates import (
    Bounds,
    Rate,
    check_rate_bounds,
    format_period,
    format_rate,
    parse_rate,
)

DAY_MS = 86_400_000


def test_bounds_are_the_documented_numbers() -> None:
    assert Bounds.MAX_LIMIT == 1_000_000_000
    assert Bounds.MIN_PERIOD_MS == 1_000
    assert Bounds.MAX_PERIOD_MS == 366 * DAY_MS == 31_622_400_000
    assert Bounds.MAX_PRODUCT == 4_503_599_627_370_496


@pytest.mark.parametrize(
    ("text", "limit", "period_ms"),
    [
        ("10/s", 10, 1_000),
        ("100/5m", 100, 300_000),
        ("1/sec", 1, 1_000),
        ("2/min", 2, 60_000),
        ("3/hour", 3, 3_600_000),
        ("4/day", 4, 86_400_000),
        ("5/2h", 5, 7_200_000),
        ("6/m", 6, 60_000),
        ("7/h", 7, 3_600_000),
        ("8/d", 8, 86_400_000),
        ("9/30sec", 9, 30_000),
        ("10/1s", 10, 1_000),
        ("1000/h", 1000, 3_600_000),
        ("11/second", 11, 1_000),
        ("12/seconds", 12, 1_000),
        ("13/minute", 13, 60_000),
        ("14/minutes", 14, 60_000),
        ("15/hours", 15, 3_600_000),
        ("16/days", 16, 86_400_000),
        ("10/minute", 10, 60_000),
        ("100/5minutes", 100, 300_000),
        ("1/2days", 1, 172_800_000),
    ],
)
def test_valid_rate_parses_to_limit_and_period_in_ms(text: str, limit: int, period_ms: int) -> None:
    assert parse_rate(text) == Rate(limit=limit, period_ms=period_ms)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10/S", Rate(10, 1_000)),
        ("10/SEC", Rate(10, 1_000)),
        ("10/Second", Rate(10, 1_000)),
        ("10/M", Rate(10, 60_000)),
        ("10/Minutes", Rate(10, 60_000)),
        ("10/MIN", Rate(10, 60_000)),
        ("10/H", Rate(10, 3_600_000)),
        ("10/HoUr", Rate(10, 3_600_000)),
        ("10/D", Rate(10, 86_400_000)),
        ("10/5DAYS", Rate(10, 432_000_000)),
    ],
)
def test_period_names_are_read_in_any_case(text: str, expected: Rate) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" 10/s ", Rate(10, 1_000)),
        ("10 / s", Rate(10, 1_000)),
        ("100 / 5 m", Rate(100, 300_000)),
        ("\t3/hour\n", Rate(3, 3_600_000)),
    ],
)
def test_whitespace_around_the_parts_is_tolerated(text: str, expected: Rate) -> None:
    assert parse_rate(text) == expected


def test_leading_zeros_in_the_count_are_accepted() -> None:
    assert parse_rate("010/s") == Rate(10, 1_000)


def test_rate_period_is_reported_in_seconds() -> None:
    assert parse_rate("100/5m").period == 300.0
    assert parse_rate("1/s").period == 1.0


def test_rate_is_a_frozen_value_object() -> None:
    rate = parse_rate("10/s")
    with pytest.raises(AttributeError):
        rate.limit = 11  # type: ignore[misc]
    assert rate == Rate(10, 1_000)
    assert hash(rate) == hash(Rate(10, 1_000))


@pytest.mark.parametrize(
    "text",
    [
        "0/s",
        "-1/s",
        "1.5/s",
        "10/x",
        "10/0s",
        "10",
        "",
        "   ",
        "/s",
        "10/",
        "10/secs",
        "10/mins",
        "10/hr",
        "10/mon",
        "10/2month",
        "10/3y",
        "10/wk",
        "10/ms",
        "10/minutez",
        "10/2-sec",
        "10/1.5h",
        "10/-1s",
        "+10/s",
        "1_000/s",
        "10/s/s",
        "10 per s",
        "ten/s",
        "10/s extra",
    ],
)
def test_text_outside_the_grammar_is_rejected(text: str) -> None:
    with pytest.raises(ConfigurationError):
        parse_rate(text)


@pytest.mark.parametrize("value", [10, 10.0, None, b"10/s", ["10/s"], ("10", "s"), True])
def test_non_string_rate_is_rejected(value: object) -> None:
    with pytest.raises(ConfigurationError, match="must be a string"):
        parse_rate(value)


def test_rejection_names_the_key_it_was_given() -> None:
    key = "QUOTA['POLICIES']['orders']['windows']['burst']"
    with pytest.raises(ConfigurationError) as info:
        parse_rate("10/x", key)
    assert info.value.key == key
    assert str(info.value).startswith(key + ": ")
    assert "'x'" in info.value.message


def test_rejection_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_rate("0/s")


def test_zero_count_is_rejected_as_not_positive() -> None:
    with pytest.raises(ConfigurationError, match="positive"):
        parse_rate("0/s")


def test_zero_multiplier_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="multiplier"):
        parse_rate("10/0s")


def test_limit_of_exactly_one_billion_is_accepted() -> None:
    assert parse_rate("1000000000/s") == Rate(1_000_000_000, 1_000)


def test_limit_above_one_billion_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="limit must be between 1 and 1000000000"):
        parse_rate("1000000001/s")


def test_period_of_exactly_366_days_is_accepted() -> None:
    assert parse_rate("1/366d") == Rate(1, 31_622_400_000)
    assert parse_rate("1/8784h") == Rate(1, 31_622_400_000)


def test_period_over_366_days_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="period must be between 1 s and 366 d"):
        parse_rate("1/367d")
    with pytest.raises(ConfigurationError, match="period must be between 1 s and 366 d"):
        parse_rate("1/8785h")


def test_largest_count_over_366_days_within_two_to_the_52_is_accepted() -> None:
    # 142418 * 31_622_400_000 = 4_503_598_963_200_000 <= 2**52
    assert parse_rate("142418/366d") == Rate(142_418, 31_622_400_000)


def test_count_times_period_over_two_to_the_52_is_rejected() -> None:
    # 142419 * 31_622_400_000 = 4_503_630_585_600_000 > 2**52
    with pytest.raises(ConfigurationError, match=r"2\*\*52"):
        parse_rate("142419/366d")


def test_one_billion_per_366_days_is_rejected_by_the_product_bound() -> None:
    # 10**9 * 31_622_400_000 = 3.16e19: within the count and period bounds, not their product.
    with pytest.raises(ConfigurationError, match=r"2\*\*52"):
        parse_rate("1000000000/366d")


def test_one_billion_per_4503_seconds_is_the_largest_product_accepted() -> None:
    assert parse_rate("1000000000/4503s") == Rate(1_000_000_000, 4_503_000)
    with pytest.raises(ConfigurationError, match=r"2\*\*52"):
        parse_rate("1000000000/4504s")


def test_count_beyond_python_int_digit_limit_is_a_configuration_error() -> None:
    # int() refuses over 4300 digits with a bare ValueError; the key must still be named.
    with pytest.raises(ConfigurationError) as info:
        parse_rate("1" * 5000 + "/s", "QUOTA['POLICIES']['x']['windows']")
    assert info.value.key == "QUOTA['POLICIES']['x']['windows']"


def test_huge_multiplier_is_rejected_as_out_of_bounds() -> None:
    with pytest.raises(ConfigurationError):
        parse_rate("1/" + "9" * 5000 + "s")
    with pytest.raises(ConfigurationError, match="period must be between"):
        parse_rate("1/99999999999999999999d")


@pytest.mark.parametrize(
    ("limit", "period_ms"),
    [(0, 1_000), (-1, 1_000), (10**9 + 1, 1_000), (1, 999), (1, 0), (1, 366 * DAY_MS + 1)],
)
def test_check_rate_bounds_rejects_numbers_outside_the_bounds(limit: int, period_ms: int) -> None:
    with pytest.raises(ConfigurationError) as info:
        check_rate_bounds(limit, period_ms, "QUOTA['POLICIES']['p']")
    assert info.value.key == "QUOTA['POLICIES']['p']"


def test_check_rate_bounds_accepts_the_edges() -> None:
    check_rate_bounds(1, 1_000, "k")
    check_rate_bounds(10**9, 1_000, "k")
    check_rate_bounds(1, 366 * DAY_MS, "k")


def test_product_of_exactly_two_to_the_52_is_accepted_and_one_more_unit_is_not() -> None:
    check_rate_bounds(2**27, 2**25, "k")  # 2**27 * 2**25 == 2**52
    with pytest.raises(ConfigurationError, match=r"2\*\*52"):
        check_rate_bounds(2**27 + 1, 2**25, "k")


@pytest.mark.parametrize(
    ("period_ms", "written"),
    [
        (1_000, "s"),
        (60_000, "m"),
        (90_000, "90s"),
        (3_600_000, "h"),
        (7_200_000, "2h"),
        (86_400_000, "d"),
        (30 * 86_400_000, "30d"),
        (366 * 86_400_000, "366d"),
        (1_500, "1500ms"),
    ],
)
def test_a_period_is_written_in_its_largest_whole_unit(period_ms: int, written: str) -> None:
    assert format_period(period_ms) == written
    if not written.endswith("ms"):  # what the grammar reads back
        assert parse_rate(f"5/{written}").period_ms == period_ms


def test_a_rate_is_written_as_the_grammar_reads_it() -> None:
    assert format_rate(10_000, 30 * 86_400_000) == "10000/30d"
    assert format_rate(5, 60_000) == "5/m"
