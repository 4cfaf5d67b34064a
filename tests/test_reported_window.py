"""Which window an outcome of a multi-window policy reports
(``django_quota.core.outcome.reported_index``, docs/outcomes.md): denied, the denying
window with the largest retry_after (ties: the longer period, then the first declared);
allowed, the smallest remaining (ties: the larger reset_after, then the first declared)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_quota.core.outcome import reported_index
from django_quota.core.policy import Window
from django_quota.core.windows import WindowResult


def _window(period_ms: int) -> Window:
    return Window(f"w{period_ms}", 10, period_ms, 10)


def _numbers(remaining: int, reset_after: int, retry_after: int) -> WindowResult:
    return WindowResult(remaining, reset_after, retry_after, reset_after)


def test_a_denial_reports_the_longest_wait_then_the_longer_period() -> None:
    windows = [_window(1_000), _window(60_000), _window(3_600_000)]
    numbers = [_numbers(0, 900, 900), _numbers(5, 50_000, -1), _numbers(0, 900, 900)]
    assert reported_index(windows, numbers, denied=True) == 2  # tie on 900 ms: longer period
    numbers[0] = _numbers(0, 950, 950)
    assert reported_index(windows, numbers, denied=True) == 0
    with pytest.raises(ValueError, match="without a denying window"):
        reported_index(windows, [_numbers(1, 1, -1)] * 3, denied=True)


def test_an_admission_reports_the_fewest_remaining_then_the_later_reset() -> None:
    windows = [_window(1_000), _window(60_000), _window(3_600_000)]
    numbers = [_numbers(3, 500, -1), _numbers(3, 40_000, -1), _numbers(7, 3_000_000, -1)]
    assert reported_index(windows, numbers, denied=False) == 1
    numbers[1] = _numbers(3, 500, -1)  # a full tie: the first declared
    assert reported_index(windows, numbers, denied=False) == 0
    numbers[2] = _numbers(2, 10, -1)
    assert reported_index(windows, numbers, denied=False) == 2


windows_and_numbers = st.lists(
    st.tuples(
        st.sampled_from([1_000, 60_000, 3_600_000]),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(-1, 3),
    ),
    min_size=1,
    max_size=5,
)


@given(windows_and_numbers, st.booleans())
def test_the_choice_is_the_first_minimum_of_the_documented_order(
    drawn: list[tuple[int, int, int, int]], denied: bool
) -> None:
    windows = [_window(period) for period, *_ in drawn]
    numbers = [_numbers(remaining, reset, retry) for _, remaining, reset, retry in drawn]
    indexes = range(len(drawn))
    if denied:
        denying = [i for i in indexes if numbers[i].retry_after_ms >= 0]
        if not denying:
            return
        expected = min(
            denying, key=lambda i: (-numbers[i].retry_after_ms, -windows[i].period_ms, i)
        )
    else:
        expected = min(indexes, key=lambda i: (numbers[i].remaining, -numbers[i].reset_after_ms, i))
    assert reported_index(windows, numbers, denied) == expected


def test_a_result_without_windows_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="without windows"):
        reported_index([], [], denied=False)
