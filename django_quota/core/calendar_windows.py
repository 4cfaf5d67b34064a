"""The model's decisions for calendar windows (``docs/arithmetic.md``): the windows of a
call placed between the boundaries the client sent, viewed, reported and kept as
:mod:`django_quota.core.model` does for epoch-aligned windows. ``evaluate.lua`` mirrors
them in its calendar branch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from django_quota.core.calls import PolicyCall
from django_quota.core.windows import WindowResult, calendar_result, calendar_view

#: Per window of a call, the ``[start, end)`` (ms) it is decided in.
Place = list[tuple[int, int]]



def calendar_at(
    call: PolicyCall, state: Mapping[str, int], place: Place, cost: int
) -> tuple[list[tuple[int, int]], None, bool]:
    """The model's ``_windows_at`` for a call with calendar windows placed in
    ``place``."""
    views = [calendar_view(index, state, start, end) for index, (start, end) in enumerate(place, 1)]
    fits = True
    for index, (used, _) in enumerate(views):
        if used + cost > call.windows[index].limit:
            fits = False
            break
    return views, None, fits


def calendar_reported(
    call: PolicyCall,
    views: Sequence[tuple[int, int]],
    place: Place,
    now: int,
    peek: bool,
    charged: bool,
) -> tuple[tuple[WindowResult, ...], int]:
    """The model's ``_reported`` for a call with calendar windows placed in ``place``:
    every window counts to its end."""
    cost = 1 if peek else call.cost
    results = []
    ttl = 0
    for index, window in enumerate(call.windows):
        result, window_ttl = calendar_result(
            window, views[index][0], place[index][1], now, cost, charged
        )
        results.append(result)
        if window_ttl > ttl:
            ttl = window_ttl
    return tuple(results), ttl


def calendar_keeps(
    state: Mapping[str, int],
    place: Place,
    now: int,
    ttl: int,
    dedup_ttl_ms: int,
    *,
    server_clock: bool,
) -> bool:
    """:func:`~django_quota.core.model.keeps_expiry` for a call with calendar windows: on
    the expiries' clock, not behind ``t``, every window still the one of ``t`` (then its
    end, hence the expiry set at ``t``, is the same) and outliving ``now`` by
    ``dedup_ttl_ms``."""
    last = state.get("t")
    if not server_clock or last is None or now < last or ttl < dedup_ttl_ms:
        return False
    return all(start <= last < end for start, end in place)
