"""The arithmetic of concurrency leases (``docs/concurrency.md``): the Python model of a
concurrency policy's part of ``evaluate.lua`` and of ``release.lua``.

A policy's state is its leases, one "log" (the memory backend's), as Redis holds them in
one sorted set at the counter's key (:mod:`django_quota.core.windows`). No numbers, no
ledger: a lease's member is its evaluation's fingerprint, so a held lease is what
remembers the evaluation. :func:`django_quota.core.model.evaluate_group` calls these for
the group's concurrency policies.
"""

from __future__ import annotations

from collections.abc import Sequence

from django_quota.core.calls import CHARGED, UNCHARGED, PolicyCall, Write
from django_quota.core.policy import CONCURRENCY, Window
from django_quota.core.windows import (
    Log,
    acquired_leases,
    holds_lease,
    lease_view,
    leases_ttl,
    released_leases,
)


def leases_of(stored: Sequence[Log]) -> Log:
    return stored[0] if stored else ()


def leases_at(
    window: Window, stored: Sequence[Log], now: int, cost: int
) -> tuple[list[tuple[int, int]], None, bool]:
    """A concurrency policy's window at ``now`` (:func:`_windows_at`): its view (units
    held, ms until the oldest held lease expires) and whether ``cost`` more fits."""
    held, wait = lease_view(leases_of(stored), now)
    return [(held, wait)], None, held + cost <= window.limit


def holds_leases(
    calls: Sequence[PolicyCall],
    logs: Sequence[Sequence[Log]] | None,
    nows: Sequence[int],
    fingerprint: bytes,
) -> bool:
    """Whether a concurrency policy of the group holds a lease of ``fingerprint``: the
    evaluation repeats one that acquired it."""
    if logs is None or not fingerprint:
        return False
    number = int.from_bytes(fingerprint, "big")
    for index, call in enumerate(calls):
        if call.algorithm == CONCURRENCY and holds_lease(
            leases_of(logs[index]), number, nows[index]
        ):
            return True
    return False


def replayed_lease(stored: Sequence[Log], now: int, fingerprint: bytes) -> int:
    """A concurrency policy's status in a replay: :data:`CHARGED` when it holds the
    evaluation's lease, else :data:`UNCHARGED`."""
    number = int.from_bytes(fingerprint, "big") if fingerprint else -1
    return CHARGED if holds_lease(leases_of(stored), number, now) else UNCHARGED


def lease_charge(
    index: int,
    call: PolicyCall,
    stored: Sequence[Log],
    now: int,
    fingerprint: bytes,
    cleanup_grace_ms: int,
) -> Write:
    """The write of a concurrency policy acquiring ``call.cost`` units at ``now``: its
    leases (expired ones dropped, the new one added) and their set's time to live: until
    the later of the latest lease held before and the new one expires, plus the grace."""
    before = leases_of(stored)
    period = call.windows[0].period_ms
    leases = acquired_leases(before, now, int.from_bytes(fingerprint, "big"), call.cost, period)
    latest = now + period
    if before and before[-3] > latest:
        latest = before[-3]
    return Write(index, {}, latest - now + cleanup_grace_ms, b"", (leases,))


def release_leases(
    stored: Sequence[Log], now: int, fingerprint: bytes, cleanup_grace_ms: int
) -> tuple[int, Log | None, int]:
    """``release.lua``'s model: the units the evaluation of ``fingerprint`` held at
    ``now``; the leases left (its own and the expired ones dropped), None when nothing
    was removed (nothing written); and the set's new time to live (ms: until the latest
    lease left expires, plus the grace; 0 when none is left, the key is gone)."""
    leases = leases_of(stored)
    released, kept = released_leases(leases, now, int.from_bytes(fingerprint, "big"))
    if len(kept) == len(leases):
        return released, None, 0
    return released, kept, (leases_ttl(kept, now) + cleanup_grace_ms) if kept else 0
