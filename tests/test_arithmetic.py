"""The arithmetic of docs/arithmetic.md on the Python model: exact numbers from its
definitions, and brute-force oracles for retry_after and the replenish time (the Lua
script is held to the same numbers by tests/test_differential.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from django_quota.core.calls import CHARGED, REFUSED, UNCHARGED, PolicyCall, PolicyResult, State
from django_quota.core.model import evaluate_group
from django_quota.core.policy import Window
from django_quota.core.windows import Log, log_units

T0 = 1_764_000_000_000  # a whole second, minute, hour and day boundary


def one(
    algorithm: str,
    windows: tuple[Window, ...],
    state: State | None,
    now: int,
    cost: int = 1,
    peek: bool = False,
    regression: int = -1,
) -> tuple[PolicyResult, State | None]:
    group = evaluate_group(
        [PolicyCall(algorithm, windows, cost)],
        [state],
        now,
        peek=peek,
        max_regression_ms=regression,
    )
    assert not group.clock_unsafe
    new_state = group.writes[0].state if group.writes else state
    return group.results[0], new_state


def run(
    algorithm: str, windows: tuple[Window, ...], times: list[int], cost: int = 1
) -> tuple[list[PolicyResult], State | None]:
    state: State | None = None
    results = []
    for now in times:
        result, state = one(algorithm, windows, state, now, cost)
        results.append(result)
    return results, state


W = Window  # name, limit, period_ms, capacity


# -- fixed window -------------------------------------------------------------------------
def test_fixed_window_counts_down_and_denies_until_the_window_ends() -> None:
    windows = (W("default", 3, 1_000, 3),)
    results, _ = run("fixed_window", windows, [T0 + 250] * 4)
    assert [r.status for r in results] == [CHARGED, CHARGED, CHARGED, REFUSED]
    assert [r.windows[0].remaining for r in results] == [2, 1, 0, 0]
    assert results[3].windows[0].retry_after_ms == 750
    assert results[3].windows[0].reset_after_ms == 750


def test_fixed_window_is_aligned_to_the_epoch_and_resets_at_the_boundary() -> None:
    windows = (W("default", 2, 1_000, 2),)
    results, _ = run("fixed_window", windows, [T0 + 998, T0 + 999, T0 + 999, T0 + 1_000])
    assert [r.status for r in results] == [CHARGED, CHARGED, REFUSED, CHARGED]
    assert results[2].windows[0].retry_after_ms == 1
    assert results[3].windows[0].remaining == 1


def test_denied_request_consumes_no_window() -> None:
    windows = (W("burst", 2, 1_000, 2), W("sustained", 3, 60_000, 3))
    results, state = run("fixed_window", windows, [T0, T0, T0, T0 + 1_000, T0 + 1_000])
    assert [r.status for r in results] == [CHARGED, CHARGED, REFUSED, CHARGED, REFUSED]
    assert state == {"t": T0 + 1_000, "c1": 1, "c2": 3}
    # the sustained window denied the last one; burst was not charged for it
    assert results[4].windows[0].retry_after_ms == -1
    assert results[4].windows[1].retry_after_ms == 59_000


def test_cost_counts_in_every_window() -> None:
    windows = (W("burst", 5, 1_000, 5), W("sustained", 8, 60_000, 8))
    results, _ = run("fixed_window", windows, [T0, T0 + 1_000], cost=4)
    assert [w.remaining for w in results[1].windows] == [1, 0]


# -- sliding window ---------------------------------------------------------------------------
def test_sliding_window_weights_the_previous_window() -> None:
    windows = (W("default", 10, 10_000, 10),)
    state: State | None = None
    for _ in range(10):
        _, state = one("sliding_window", windows, state, T0 + 5_000)
    # 2.5 s into the next window: estimate = floor(10 * 7_500 / 10_000) + 0 = 7
    result, state = one("sliding_window", windows, state, T0 + 12_500)
    assert result.status == CHARGED
    assert result.windows[0].remaining == 10 - 7 - 1
    assert result.windows[0].reset_after_ms == 7_500


def test_sliding_retry_after_is_the_true_minimum_not_the_window_end() -> None:
    windows = (W("default", 10, 10_000, 10),)
    state: State | None = None
    for _ in range(10):
        _, state = one("sliding_window", windows, state, T0 + 5_000)
    result, _ = one("sliding_window", windows, state, T0 + 10_000, cost=2)
    # estimate 10 at elapsed 0; two units fit when floor(10 * (10000 - e) / 10000) <= 8,
    # i.e. e > 1000: retry after 1001 ms, far earlier than the window end (10000 ms).
    assert result.status == REFUSED
    assert result.windows[0].retry_after_ms == 1_001
    assert result.windows[0].reset_after_ms == 10_000
    # one unit frees 1 ms later already: the estimate floors
    result, _ = one("sliding_window", windows, state, T0 + 10_000, cost=1)
    assert result.windows[0].retry_after_ms == 1


# -- token bucket -----------------------------------------------------------------------------
def test_token_bucket_refills_continuously_with_integer_arithmetic() -> None:
    windows = (W("default", 10, 1_000, 10),)
    results, state = run("token_bucket", windows, [T0] * 11)
    assert [r.windows[0].remaining for r in results[:10]] == list(range(9, -1, -1))
    assert results[10].status == REFUSED
    assert results[10].windows[0].retry_after_ms == 100
    assert results[9].windows[0].reset_after_ms == 1_000
    result, _ = one("token_bucket", windows, state, T0 + 99)
    assert result.status == REFUSED and result.windows[0].retry_after_ms == 1
    result, _ = one("token_bucket", windows, state, T0 + 100)
    assert result.status == CHARGED


def test_token_bucket_keeps_fractional_refill() -> None:
    windows = (W("default", 3, 1_000, 3),)  # one token per 333.33 ms
    _, state = run("token_bucket", windows, [T0] * 3)
    for offset in (100, 200, 300):  # 300 ms = 0.9 token: still denied
        result, _ = one("token_bucket", windows, state, T0 + offset)
        assert result.status == REFUSED
    result, _ = one("token_bucket", windows, state, T0 + 334)  # 1.002 tokens
    assert result.status == CHARGED


def test_token_bucket_capacity_bounds_the_burst_and_limit_is_capacity() -> None:
    windows = (W("default", 1, 1_000, 5),)
    results, _ = run("token_bucket", windows, [T0] * 6)
    assert [r.status for r in results] == [CHARGED] * 5 + [REFUSED]
    assert results[0].windows[0].remaining == 4
    assert results[5].windows[0].retry_after_ms == 1_000


def test_new_token_bucket_is_full_with_reset_after_zero() -> None:
    windows = (W("default", 10, 1_000, 10),)
    result, _ = one("token_bucket", windows, None, T0, peek=True)
    assert result.status == UNCHARGED
    assert (result.windows[0].remaining, result.windows[0].reset_after_ms) == (10, 0)
    assert result.windows[0].replenish_after_ms == 0


# -- groups, peek, clocks ------------------------------------------------------------------------
def test_group_denial_charges_no_policy_and_shadow_never_blocks() -> None:
    tight = PolicyCall("fixed_window", (W("default", 1, 60_000, 1),), 1, True)
    loose = PolicyCall("fixed_window", (W("default", 5, 60_000, 5),), 1, True)
    shadow = PolicyCall("fixed_window", (W("default", 0 + 1, 60_000, 1),), 1, False)
    first = evaluate_group([tight, loose], [None, None], T0)
    states = [w.state for w in first.writes]
    second = evaluate_group([tight, loose], states, T0)
    assert [r.status for r in second.results] == [REFUSED, UNCHARGED]
    assert second.writes == ()
    # a denying shadow policy neither blocks nor prevents charging the enforced one
    shadow_state = evaluate_group([shadow], [None], T0).writes[0].state
    third = evaluate_group([loose, shadow], [states[1], shadow_state], T0)
    assert [r.status for r in third.results] == [CHARGED, REFUSED]
    assert [w.index for w in third.writes] == [0]


def test_peek_reports_remaining_before_consumption_and_writes_nothing() -> None:
    windows = (W("default", 3, 60_000, 3),)
    _, state = run("fixed_window", windows, [T0])
    group = evaluate_group([PolicyCall("fixed_window", windows, 1)], [state], T0, peek=True)
    assert group.writes == ()
    assert group.results[0].windows[0].remaining == 2


def test_clock_never_runs_backwards_for_a_counter() -> None:
    windows = (W("default", 1, 1_000, 1),)
    _, state = run("fixed_window", windows, [T0 + 1_500])
    # an earlier now is clamped to the stored one: still in the same (full) window
    result, _ = one("fixed_window", windows, state, T0 + 900)
    assert result.status == REFUSED and result.now_ms == T0 + 1_500


def test_client_clock_regression_past_the_bound_is_unsafe() -> None:
    windows = (W("default", 5, 1_000, 5),)
    _, state = run("fixed_window", windows, [T0 + 5_000])
    group = evaluate_group(
        [PolicyCall("fixed_window", windows, 1)], [state], T0 + 3_999, max_regression_ms=1_000
    )
    assert group.clock_unsafe and group.writes == ()
    group = evaluate_group(
        [PolicyCall("fixed_window", windows, 1)], [state], T0 + 4_000, max_regression_ms=1_000
    )
    assert not group.clock_unsafe


# -- brute-force oracles ------------------------------------------------------------------------
def _allowed_at(
    algorithm: str,
    windows: tuple[Window, ...],
    state: State | None,
    now: int,
    cost: int,
    window_index: int,
) -> bool:
    """Whether window ``window_index`` alone would allow ``cost`` at ``now``."""
    single = (windows[window_index],)
    projected = None
    if state is not None:
        projected = {"t": state["t"]}
        for field in ("c", "p"):
            key = f"{field}{window_index + 1}"
            if key in state:
                projected[f"{field}1"] = state[key]
    result, _ = one(algorithm, single, projected, now, cost, peek=False)
    return result.status == CHARGED


histories = st.lists(st.tuples(st.integers(0, 3_000), st.integers(1, 4)), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(
    algorithm=st.sampled_from(["sliding_window", "token_bucket", "fixed_window"]),
    limit=st.integers(1, 9),
    period=st.sampled_from([1_000, 2_000, 7_000]),
    capacity_extra=st.integers(0, 3),
    history=histories,
    cost=st.integers(1, 4),
)
def test_a_request_exactly_retry_after_later_is_allowed_and_one_ms_earlier_is_not(
    algorithm: str, limit: int, period: int, capacity_extra: int, history: Any, cost: int
) -> None:
    capacity = limit + capacity_extra if algorithm == "token_bucket" else limit
    windows = (W("default", limit, period, capacity),)
    cost = min(cost, capacity)
    state: State | None = None
    now = T0 + 123
    for step, step_cost in history:
        now += step
        _, state = one(algorithm, windows, state, now, min(step_cost, capacity))
    result, _ = one(algorithm, windows, state, now, cost)
    if result.status != REFUSED:
        return
    wait = result.windows[0].retry_after_ms
    assert wait >= 1
    assert _allowed_at(algorithm, windows, state, now + wait, cost, 0)
    if wait > 1:
        assert not _allowed_at(algorithm, windows, state, now + wait - 1, cost, 0)


@settings(max_examples=300, deadline=None)
@given(
    algorithm=st.sampled_from(["sliding_window", "token_bucket", "fixed_window"]),
    limit=st.integers(1, 9),
    period=st.sampled_from([1_000, 3_000]),
    history=histories,
)
def test_remaining_rises_exactly_replenish_after_later(
    algorithm: str, limit: int, period: int, history: Any
) -> None:
    windows = (W("default", limit, period, limit),)
    state: State | None = None
    now = T0 + 77
    for step, step_cost in history:
        now += step
        _, state = one(algorithm, windows, state, now, min(step_cost, limit))
    here, _ = one(algorithm, windows, state, now, peek=True)
    wait = here.windows[0].replenish_after_ms
    remaining = here.windows[0].remaining
    if remaining == limit:
        assert wait == 0 or algorithm == "fixed_window"
        return
    later, _ = one(algorithm, windows, state, now + wait, peek=True)
    assert later.windows[0].remaining > remaining
    if wait > 1:
        before, _ = one(algorithm, windows, state, now + wait - 1, peek=True)
        assert before.windows[0].remaining == remaining


# -- the evaluation-id ledger ------------------------------------------------------------------
def _charge_with_id(state: State | None, records: bytes, now: int, evaluation_id: str) -> Any:
    from django_quota.core.protocol import fingerprint

    return evaluate_group(
        [PolicyCall("fixed_window", (W("default", 100, 86_400_000, 100),), 1)],
        [state],
        now,
        records=[records],
        fingerprint=fingerprint(evaluation_id),
        may_repeat=True,
        dedup_ttl_ms=5_000,
    )


def _run_ids(times_and_ids: list[tuple[int, str]]) -> tuple[list[Any], State | None, bytes]:
    state: State | None = None
    records = b""
    groups = []
    for now, evaluation_id in times_and_ids:
        group = _charge_with_id(state, records, now, evaluation_id)
        groups.append(group)
        if group.writes:
            state, records = group.writes[0].state, group.writes[0].records
    return groups, state, records


def test_a_ledger_drop_older_than_dedup_ttl_leaves_fresh_ids_decided() -> None:
    # Charges 1 s apart, each with the caller's own id: from the ninth on every charge
    # drops an entry, but one charged 8 s earlier, older than DEDUP_TTL (5 s).
    groups, state, records = _run_ids([(T0 + i * 1_000, f"id-{i}") for i in range(10)])
    assert [g.status for g in groups] == [0] * 10
    assert [g.results[0].status for g in groups] == [CHARGED] * 10
    assert state is not None and "d" not in state and len(records) == 8 * 9


def test_a_young_ledger_drop_makes_an_unknown_id_indeterminate_and_a_kept_one_a_replay() -> None:
    groups, state, records = _run_ids([(T0 + i, f"id-{i}") for i in range(9)])
    assert [g.status for g in groups] == [0] * 9
    assert state is not None and state["d"] == T0  # id-0, charged at T0, was dropped
    unknown = _charge_with_id(state, records, T0 + 100, "never-seen")
    assert unknown.status == 2 and unknown.writes == ()  # GROUP_INDETERMINATE
    kept = _charge_with_id(state, records, T0 + 100, "id-8")
    assert kept.status == 3 and kept.writes == () and kept.results[0].status == CHARGED
    # Once the dropped entry is older than DEDUP_TTL, an unknown id is decided afresh.
    later = _charge_with_id(state, records, T0 + 5_000, "never-seen")
    assert later.status == 0 and later.results[0].status == CHARGED


# -- sliding log --------------------------------------------------------------------------------
#: A sliding_log counter as the model stores it: the hash numbers and one log per window.
LogCounter = tuple[State | None, tuple[Log, ...]]
EMPTY: LogCounter = (None, ())


def slog(
    windows: tuple[Window, ...],
    counter: LogCounter,
    now: int,
    cost: int = 1,
    peek: bool = False,
) -> tuple[PolicyResult, LogCounter]:
    state, logs = counter
    group = evaluate_group(
        [PolicyCall("sliding_log", windows, cost)], [state], now, peek=peek, logs=[logs]
    )
    if group.writes:
        write = group.writes[0]
        return group.results[0], (write.state, write.logs)
    return group.results[0], counter


def slog_run(
    windows: tuple[Window, ...], times: list[int], cost: int = 1
) -> tuple[list[PolicyResult], LogCounter]:
    counter = EMPTY
    results = []
    for now in times:
        result, counter = slog(windows, counter, now, cost)
        results.append(result)
    return results, counter


def units(counter: LogCounter, window: int = 0) -> int:
    """Units a window's log holds, expired or not (the sliding log's bound, docs/arithmetic.md)."""
    state, logs = counter
    assert state is not None
    return log_units(state[f"c{window + 1}"], logs[window])


def test_sliding_log_counts_every_unit_for_exactly_one_period() -> None:
    windows = (W("default", 3, 10_000, 3),)
    results, counter = slog_run(windows, [T0, T0 + 1_000, T0 + 2_000, T0 + 3_000])
    assert [r.status for r in results] == [CHARGED, CHARGED, CHARGED, REFUSED]
    assert [r.windows[0].remaining for r in results] == [2, 1, 0, 0]
    # the oldest unit (T0) leaves at T0 + 10_000: 7_000 ms from T0 + 3_000
    assert results[3].windows[0].retry_after_ms == 7_000
    # reset: the newest unit (T0 + 2_000) leaves 9_000 ms later; t: the oldest, 7_000
    assert results[3].windows[0].reset_after_ms == 9_000
    assert results[3].windows[0].replenish_after_ms == 7_000
    # the window is (now - P, now]: at T0 + 9_999 the unit of T0 still counts, at T0 + 10_000 not
    before, _ = slog(windows, counter, T0 + 9_999, peek=True)
    at, _ = slog(windows, counter, T0 + 10_000, peek=True)
    assert (before.status, before.windows[0].remaining) == (REFUSED, 0)
    assert (at.status, at.windows[0].remaining) == (UNCHARGED, 1)


def test_sliding_log_request_exactly_retry_after_later_is_allowed_one_ms_earlier_denied() -> None:
    windows = (W("default", 2, 60_000, 2),)
    _, counter = slog_run(windows, [T0 + 500, T0 + 20_000])
    denied, _ = slog(windows, counter, T0 + 30_000)
    assert denied.status == REFUSED
    wait = denied.windows[0].retry_after_ms
    assert wait == T0 + 500 + 60_000 - (T0 + 30_000) == 30_500
    early, _ = slog(windows, counter, T0 + 30_000 + wait - 1)
    exact, after = slog(windows, counter, T0 + 30_000 + wait)
    assert early.status == REFUSED and early.windows[0].retry_after_ms == 1
    assert exact.status == CHARGED and exact.windows[0].remaining == 0
    # no wait 1 ms longer than DRF's: the next unit leaves exactly 60 s after T0 + 20_000
    denied_again, _ = slog(windows, after, T0 + 60_500)
    assert denied_again.windows[0].retry_after_ms == 20_000 + 60_000 - 60_500


def test_sliding_log_retry_after_for_a_cost_waits_for_enough_units_to_leave() -> None:
    windows = (W("default", 5, 10_000, 5),)
    _, counter = slog_run(windows, [T0, T0 + 1_000, T0 + 2_000, T0 + 3_000, T0 + 4_000])
    # cost 3 fits once three units have left: the third oldest (T0 + 2_000) leaves last
    result, _ = slog(windows, counter, T0 + 5_000, cost=3)
    assert result.status == REFUSED and result.windows[0].retry_after_ms == 7_000
    early, _ = slog(windows, counter, T0 + 11_999, cost=3)
    exact, _ = slog(windows, counter, T0 + 12_000, cost=3)
    assert (early.status, exact.status) == (REFUSED, CHARGED)


def test_sliding_log_cost_records_that_many_units_at_one_time() -> None:
    windows = (W("default", 5, 10_000, 5),)
    results, counter = slog_run(windows, [T0, T0 + 4_000], cost=2)
    assert [r.windows[0].remaining for r in results] == [3, 1]
    assert units(counter) == 4
    # both units of T0 leave together: 2 + 1 = 3 remain at T0 + 10_000
    at, _ = slog(windows, counter, T0 + 10_000, peek=True)
    assert at.windows[0].remaining == 3
    assert at.windows[0].reset_after_ms == 4_000 and at.windows[0].replenish_after_ms == 4_000


def test_sliding_log_empty_window_reports_zero_reset_and_replenish() -> None:
    windows = (W("default", 4, 1_000, 4),)
    result, _ = slog(windows, EMPTY, T0, peek=True)
    assert result.status == UNCHARGED
    assert (result.windows[0].remaining, result.windows[0].reset_after_ms) == (4, 0)
    assert result.windows[0].replenish_after_ms == 0
    _, counter = slog_run(windows, [T0])
    later, _ = slog(windows, counter, T0 + 1_000, peek=True)
    assert (later.windows[0].remaining, later.windows[0].reset_after_ms) == (4, 0)
    assert later.windows[0].replenish_after_ms == 0


def test_sliding_log_charge_reports_numbers_after_consumption() -> None:
    windows = (W("default", 4, 1_000, 4),)
    results, _ = slog_run(windows, [T0, T0 + 300])
    second = results[1].windows[0]
    assert (second.remaining, second.retry_after_ms) == (2, -1)
    assert second.reset_after_ms == 1_000  # the unit just recorded leaves last
    assert second.replenish_after_ms == 700  # the unit of T0 leaves first


def test_sliding_log_denial_records_nothing() -> None:
    windows = (W("burst", 2, 1_000, 2), W("sustained", 3, 60_000, 3))
    results, counter = slog_run(windows, [T0, T0, T0, T0 + 1_000, T0 + 1_000])
    assert [r.status for r in results] == [CHARGED, CHARGED, REFUSED, CHARGED, REFUSED]
    # the sustained window denied the last one; burst was not charged for it
    assert results[4].windows[0].retry_after_ms == -1
    assert results[4].windows[1].retry_after_ms == 59_000
    assert [units(counter, 0), units(counter, 1)] == [1, 3]
    again = evaluate_group(
        [PolicyCall("sliding_log", windows, 1)], [counter[0]], T0 + 1_500, logs=[counter[1]]
    )
    assert again.results[0].status == REFUSED and again.writes == ()


def test_sliding_log_state_is_bounded_by_the_limit_whatever_the_attempts() -> None:
    windows = (W("default", 50, 60_000, 50),)
    counter = EMPTY
    admitted = 0
    for attempt in range(200):
        result, counter = slog(windows, counter, T0 + attempt * 7, cost=1 + attempt % 3)
        admitted += result.status == CHARGED
    assert units(counter) <= 50
    assert len(counter[1][0]) <= 2 * 50  # one (time, cumulative count) pair per event
    # and over several periods the expired units are dropped when the next one is charged
    for attempt in range(200):
        result, counter = slog(windows, counter, T0 + attempt * 1_000, cost=1)
        assert units(counter) <= 50
    assert admitted > 0


def test_sliding_log_clock_never_runs_backwards() -> None:
    windows = (W("default", 1, 1_000, 1),)
    _, counter = slog_run(windows, [T0 + 1_500])
    result, _ = slog(windows, counter, T0 + 900)
    assert result.status == REFUSED and result.now_ms == T0 + 1_500
    assert result.windows[0].retry_after_ms == 1_000


def test_sliding_log_is_drf_history_exactly() -> None:
    """DRF's SimpleRateThrottle keeps request times newer than now - duration and allows
    while fewer than num_requests remain; its wait() (once full) is duration minus the age
    of the oldest. The model agrees on every step of a long random walk."""
    import random

    rng = random.Random(12)
    limit, period = 5, 3_000
    windows = (W("default", limit, period, limit),)
    history: list[int] = []
    counter = EMPTY
    now = T0
    for _ in range(2_000):
        now += rng.choice([0, 1, 7, 300, 599, 600, 601, 2_999, 3_000, 3_001])
        history = [t for t in history if t > now - period]
        drf_allows = len(history) < limit
        result, counter = slog(windows, counter, now)
        assert (result.status == CHARGED) == drf_allows
        if drf_allows:
            history.insert(0, now)
        else:
            assert result.windows[0].retry_after_ms == period - (now - history[-1])
        assert result.windows[0].remaining == limit - len(history)


def _slog_allowed_at(
    windows: tuple[Window, ...], counter: LogCounter, now: int, cost: int, index: int
) -> bool:
    """Whether window ``index`` alone would allow ``cost`` at ``now``."""
    state, logs = counter
    projected: LogCounter = EMPTY
    if state is not None:
        projected = ({"t": state["t"], "c1": state[f"c{index + 1}"]}, (logs[index],))
    result, _ = slog((windows[index],), projected, now, cost)
    return result.status == CHARGED


@settings(max_examples=300, deadline=None)
@given(
    limits=st.lists(st.integers(1, 9), min_size=1, max_size=2),
    period=st.sampled_from([1_000, 2_000, 7_000]),
    history=histories,
    cost=st.integers(1, 4),
)
def test_sliding_log_retry_after_and_replenish_are_exact_against_brute_force(
    limits: list[int], period: int, history: Any, cost: int
) -> None:
    windows = tuple(
        W(f"w{i}", limit, period * (i + 1), limit) for i, limit in enumerate(limits)
    )
    smallest = min(limits)
    cost = min(cost, smallest)
    counter = EMPTY
    now = T0 + 123
    for step, step_cost in history:
        now += step
        _, counter = slog(windows, counter, now, min(step_cost, smallest))
    result, _ = slog(windows, counter, now, cost)
    for index, window in enumerate(result.windows):
        wait = window.retry_after_ms
        if wait == -1:
            assert _slog_allowed_at(windows, counter, now, cost, index)
            continue
        assert wait >= 1
        assert _slog_allowed_at(windows, counter, now + wait, cost, index)
        assert not _slog_allowed_at(windows, counter, now + wait - 1, cost, index)
    here, _ = slog(windows, counter, now, peek=True)
    for index, window in enumerate(here.windows):
        single = (windows[index],)
        state, logs = counter
        projected: LogCounter = EMPTY
        if state is not None:
            projected = ({"t": state["t"], "c1": state[f"c{index + 1}"]}, (logs[index],))
        if window.remaining == windows[index].limit:
            assert window.replenish_after_ms == 0 and window.reset_after_ms == 0
            continue
        later, _ = slog(single, projected, now + window.replenish_after_ms, peek=True)
        assert later.windows[0].remaining > window.remaining
        before, _ = slog(single, projected, now + window.replenish_after_ms - 1, peek=True)
        assert before.windows[0].remaining == window.remaining
        empty, _ = slog(single, projected, now + window.reset_after_ms, peek=True)
        assert empty.windows[0].remaining == windows[index].limit
        not_yet, _ = slog(single, projected, now + window.reset_after_ms - 1, peek=True)
        assert not_yet.windows[0].remaining < windows[index].limit


# -- the one-policy path ---------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(
    algorithm=st.sampled_from(["sliding_window", "token_bucket", "fixed_window"]),
    limits=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    periods=st.lists(st.sampled_from([1_000, 2_000, 7_000]), min_size=3, max_size=3),
    capacity_extra=st.integers(0, 3),
    enforce=st.booleans(),
    steps=st.lists(
        st.tuples(
            st.integers(-1_500, 3_000),  # a step back is a client clock running backwards
            st.integers(0, 4),
            st.booleans(),  # peek
            st.sampled_from([-1, 0, 1_000]),  # max clock regression
            st.booleans(),  # server clock
        ),
        min_size=1,
        max_size=30,
    ),
    # b"": the memory backend's own evaluations, which carry no id and append no entry; a
    # fingerprint's first bit is 0 (protocol.fingerprint: it is the entry's cost flag)
    fingerprints=st.lists(
        st.one_of(
            st.just(b""),
            st.binary(min_size=5, max_size=5).map(lambda b: bytes((b[0] & 0x7F,)) + b[1:]),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_one_policy_decides_as_the_general_path_does(
    algorithm: str,
    limits: list[int],
    periods: list[int],
    capacity_extra: int,
    enforce: bool,
    steps: Any,
    fingerprints: list[bytes],
) -> None:
    """evaluate_group takes a shorter path for one policy of one window, not a sliding log, that
    does not repeat an id: its results and writes are the general path's, step by step
    (peeks, cost 0, denials, clamped and unsafe clocks, a full ledger, kept expiries)."""
    from django_quota.core import model
    from django_quota.core.calls import GroupInputs

    windows = tuple(
        W(f"w{i}", limit, period, limit + capacity_extra)
        for i, (limit, period) in enumerate(zip(limits, periods, strict=False))
    )
    state: State | None = None
    records = b""
    now = T0 + 321
    for number, (step, cost, peek, regression, server_clock) in enumerate(steps):
        now += step
        call = PolicyCall(algorithm, windows, cost, enforce)
        fingerprint = fingerprints[number % len(fingerprints)]
        arguments = (now, peek, regression, 1_000, fingerprint, False, 5_000, server_clock)
        short = evaluate_group(
            [call],
            [state],
            now,
            peek=peek,
            max_regression_ms=regression,
            cleanup_grace_ms=1_000,
            records=[records],
            fingerprint=fingerprint,
            dedup_ttl_ms=5_000,
            server_clock=server_clock,
        )
        general = model._evaluate_general(
            [call], [state], [records], None, GroupInputs(*arguments)
        )
        assert short == general
        if short.writes:
            state, records = short.writes[0].state, short.writes[0].records
