"""The pure-Python model of the arithmetic of contract section 5.

This is the memory backend's engine, the local fallback's engine and the oracle of the
differential tests: ``django_quota/scripts/evaluate.lua`` mirrors it function by function
and must return identical results for identical inputs.

State layout (one hash per (policy, revision, identity), section 5.5), all integers:

* ``t``: the last ``now`` (ms) the counter accepted; fixed and sliding windows derive
  their stored window start from it, the token bucket its last refill.
* ``c<i>`` for window ``i`` (1-based): fixed and sliding, the count of the window that
  contains ``t``; token bucket, the whole part of the deficit ``D`` (see below).
* ``p<i>``: sliding window, the count of the window before ``t``'s; token bucket, the
  remainder of the deficit (``D = c * P + p``, ``0 <= p < P``).

The token bucket stores the deficit ``D = C*P - T`` where ``T`` is the token level
scaled by the period ``P`` (tokens * P), so refilling ``L`` tokens per ``P`` ms adds
exactly ``L`` scaled units per millisecond: integer arithmetic only, never a float rate.
A missing hash therefore reads as a full bucket and as empty windows alike. The deficit
is split into two fields so that every stored number stays below 10**14 (exact in any
Lua number formatting).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django_quota.core.policy import FIXED_WINDOW, SLIDING_WINDOW, TOKEN_BUCKET, Window

#: Policy statuses, as the script returns them.
DENIED = 0
ALLOWED = 1  # allowed and charged
ALLOWED_UNCHARGED = 2  # allowed by its windows, charged nothing (peek, cost 0, group denied)

ALGORITHM_CODES = {FIXED_WINDOW: 1, SLIDING_WINDOW: 2, TOKEN_BUCKET: 3}

State = dict[str, int]


@dataclass(frozen=True, slots=True)
class PolicyCall:
    """One policy of a group call: its algorithm, windows, cost and enforcement."""

    algorithm: str
    windows: tuple[Window, ...]
    cost: int
    enforce: bool = True


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One window after the decision; every time in milliseconds.

    ``retry_after_ms`` is -1 unless this window denied; ``replenish_after_ms`` is the time
    until ``remaining`` next increases (0 when nothing is counted).
    """

    remaining: int
    reset_after_ms: int
    retry_after_ms: int
    replenish_after_ms: int


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """The result of one policy: status (:data:`DENIED`, :data:`ALLOWED`,
    :data:`ALLOWED_UNCHARGED`), the effective ``now`` (ms) and its windows."""

    status: int
    now_ms: int
    windows: tuple[WindowResult, ...]

    def encode(self) -> list[int]:
        """Flatten to the script's reply shape: status, now, then 4 integers a window."""
        out = [self.status, self.now_ms]
        for window in self.windows:
            out += [
                window.remaining,
                window.reset_after_ms,
                window.retry_after_ms,
                window.replenish_after_ms,
            ]
        return out

    @classmethod
    def decode(cls, values: Sequence[int], window_count: int) -> PolicyResult:
        """Inverse of :meth:`encode` for ``window_count`` windows."""
        windows = tuple(
            WindowResult(*(int(v) for v in values[2 + 4 * i : 6 + 4 * i]))
            for i in range(window_count)
        )
        return cls(int(values[0]), int(values[1]), windows)


@dataclass(frozen=True, slots=True)
class Write:
    """A state to store for policy ``index`` with a time to live in milliseconds."""

    index: int
    state: State
    ttl_ms: int


@dataclass(frozen=True, slots=True)
class GroupResult:
    """What a group call decided: per policy results and the writes to apply.

    ``clock_unsafe`` is True when a client clock ran backwards past the bound; then
    ``results`` is empty and nothing is written.
    """

    clock_unsafe: bool
    results: tuple[PolicyResult, ...]
    writes: tuple[Write, ...]


def floor_div(a: int, b: int) -> int:
    """``floor(a / b)`` for integers (the Lua twin corrects the double's rounding)."""
    return a // b


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -((-a) // b)


@dataclass(slots=True)
class _View:
    """A window's state seen at ``now`` (after roll-over or refill), before this call."""

    used: int  # fixed: count; sliding: cur; token bucket: deficit D (scaled)
    prev: int  # sliding: previous window's count; otherwise 0


def _view(algorithm: str, window: Window, index: int, state: Mapping[str, int], now: int) -> _View:
    period = window.period_ms
    last = state.get("t")
    count = state.get(f"c{index}", 0)
    extra = state.get(f"p{index}", 0)
    if last is None:
        return _View(0, 0)
    if algorithm == TOKEN_BUCKET:
        deficit = count * period + extra
        elapsed = now - last
        if elapsed >= ceil_div(deficit, window.limit):
            return _View(0, 0)
        return _View(deficit - elapsed * window.limit, 0)
    start = now - now % period
    stored_start = last - last % period
    if algorithm == FIXED_WINDOW:
        return _View(count if start == stored_start else 0, 0)
    if start == stored_start:
        return _View(count, extra)
    if start == stored_start + period:
        return _View(0, count)
    return _View(0, 0)


def _sliding_estimate(prev: int, cur: int, elapsed: int, period: int) -> int:
    return floor_div(prev * (period - elapsed), period) + cur


def sliding_wait(prev: int, cur: int, elapsed: int, period: int, target: int) -> int:
    """Smallest ``t >= 1`` (ms) after which the sliding estimate is ``<= target`` if
    nothing else arrives; ``target`` must be ``>= 0``.

    Within the current window the estimate is ``floor(prev * (P - e) / P) + cur`` with
    ``e`` growing; from the next window on it is ``floor(cur * (P - u) / P)``; two windows
    later it is 0. The estimate never increases with time, so the first solution of each
    piece, in order, is the answer.
    """
    room = target - cur
    if room >= 0:
        # prev * (P - e) <= (room + 1) * P - 1  <=>  e >= P - floor(((room + 1) * P - 1) / prev)
        needed = 0 if prev == 0 else period - floor_div((room + 1) * period - 1, prev)
        needed = max(needed, 0)
        if needed < period:
            return max(1, needed - elapsed)
    # Next window: prev' = cur, cur' = 0, u ms after its start.
    if cur == 0:
        offset = 0
    else:
        offset = max(0, period - floor_div((target + 1) * period - 1, cur))
    return max(1, period - elapsed + offset)


def _window_result(
    algorithm: str, window: Window, view: _View, now: int, cost: int, charged: bool
) -> tuple[WindowResult, int]:
    """The reported numbers of one window and its time to live (ms) after the call."""
    period = window.period_ms
    limit = window.limit
    if algorithm == TOKEN_BUCKET:
        capacity_scaled = window.capacity * period
        deficit = view.used + cost * period if charged else view.used
        allows = view.used + cost * period <= capacity_scaled
        remaining = floor_div(capacity_scaled - deficit, period)
        reset_after = ceil_div(deficit, limit)
        retry_after = -1 if allows else ceil_div(view.used + cost * period - capacity_scaled, limit)
        if remaining >= window.capacity:
            replenish = 0
        else:
            replenish = ceil_div(deficit - (capacity_scaled - (remaining + 1) * period), limit)
        return WindowResult(remaining, reset_after, retry_after, replenish), reset_after
    start = now - now % period
    elapsed = now - start
    reset_after = start + period - now
    if algorithm == FIXED_WINDOW:
        used = view.used + cost if charged else view.used
        allows = view.used + cost <= limit
        result = WindowResult(
            max(0, limit - used), reset_after, -1 if allows else reset_after, reset_after
        )
        return result, reset_after
    cur = view.used + cost if charged else view.used
    estimate = _sliding_estimate(view.prev, view.used, elapsed, period)
    allows = estimate + cost <= limit
    used = estimate + cost if charged else estimate
    retry_after = (
        -1 if allows else sliding_wait(view.prev, view.used, elapsed, period, limit - cost)
    )
    replenish = 0 if used == 0 else sliding_wait(view.prev, cur, elapsed, period, used - 1)
    return WindowResult(
        max(0, limit - used), reset_after, retry_after, replenish
    ), reset_after + period


def _allows(algorithm: str, window: Window, view: _View, now: int, cost: int) -> bool:
    period = window.period_ms
    if algorithm == TOKEN_BUCKET:
        return view.used + cost * period <= window.capacity * period
    if algorithm == FIXED_WINDOW:
        return view.used + cost <= window.limit
    elapsed = now % period
    return _sliding_estimate(view.prev, view.used, elapsed, period) + cost <= window.limit


def _charged_state(call: PolicyCall, views: Sequence[_View], now: int) -> State:
    state: State = {"t": now}
    for index, (window, view) in enumerate(zip(call.windows, views, strict=True), start=1):
        if call.algorithm == TOKEN_BUCKET:
            deficit = view.used + call.cost * window.period_ms
            state[f"c{index}"] = floor_div(deficit, window.period_ms)
            state[f"p{index}"] = deficit - state[f"c{index}"] * window.period_ms
        else:
            state[f"c{index}"] = view.used + call.cost
            if call.algorithm == SLIDING_WINDOW:
                state[f"p{index}"] = view.prev
    return state


def evaluate_group(
    calls: Sequence[PolicyCall],
    states: Sequence[Mapping[str, int] | None],
    now_ms: int,
    *,
    peek: bool = False,
    max_regression_ms: int = -1,
    cleanup_grace_ms: int = 1000,
) -> GroupResult:
    """Decide a group of policies at ``now_ms`` (contract 5.4), atomically.

    ``states[i]`` is policy ``i``'s stored hash (``None`` when absent). ``peek`` decides as
    ``cost=1`` would and writes nothing. ``max_regression_ms >= 0`` (client clocks only)
    makes a ``now`` more than that behind a stored ``t`` unsafe. The group is allowed
    iff every enforced policy's every window allows; then every policy whose own windows
    allow is charged (shadow ones included). A denial charges nothing anywhere.
    """
    nows = []
    for state in states:
        last = (state or {}).get("t")
        if last is not None and now_ms < last:
            if max_regression_ms >= 0 and last - now_ms > max_regression_ms:
                return GroupResult(True, (), ())
            nows.append(last)
        else:
            nows.append(now_ms)

    views: list[list[_View]] = []
    own_allows: list[bool] = []
    for call, state, now in zip(calls, states, nows, strict=True):
        cost = 1 if peek else call.cost
        policy_views = [
            _view(call.algorithm, window, index, state or {}, now)
            for index, window in enumerate(call.windows, start=1)
        ]
        views.append(policy_views)
        own_allows.append(
            all(
                _allows(call.algorithm, window, view, now, cost)
                for window, view in zip(call.windows, policy_views, strict=True)
            )
        )
    commit = not peek and all(
        allows for call, allows in zip(calls, own_allows, strict=True) if call.enforce
    )

    results = []
    writes = []
    for index, (call, now) in enumerate(zip(calls, nows, strict=True)):
        cost = 1 if peek else call.cost
        charged = commit and own_allows[index] and call.cost > 0
        window_results = []
        ttl = 0
        for window, view in zip(call.windows, views[index], strict=True):
            result, window_ttl = _window_result(call.algorithm, window, view, now, cost, charged)
            window_results.append(result)
            ttl = max(ttl, window_ttl)
        if charged:
            status = ALLOWED
            writes.append(
                Write(index, _charged_state(call, views[index], now), ttl + cleanup_grace_ms)
            )
        else:
            status = ALLOWED_UNCHARGED if own_allows[index] else DENIED
        results.append(PolicyResult(status, now, tuple(window_results)))
    return GroupResult(False, tuple(results), tuple(writes))
