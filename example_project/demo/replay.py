"""The fixed-window arithmetic (docs/arithmetic.md) as the demo replays it: one policy's
decision, and one request through every layer of a client's policies."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from example_project.demo.policies import Policy, Window
from example_project.demo.scenario import ClientSpec

ALLOWED = "allowed"
DENIED = "denied"
SHADOW_DENIED = "shadow_denied"

State = tuple[tuple[int, ...], tuple[int, ...]]
"""One policy's counters for one client: each window's start and count."""


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    starts: tuple[int, ...]
    before: tuple[int, ...]
    """Each window's count for ``starts`` before this request."""
    counts: tuple[int, ...]
    """Each window's count after charging this request (only applied when charged)."""
    retry_after_ms: int | None


def decide(windows: Sequence[Window], state: State, now_ms: int, cost: int) -> Decision:
    """Decide one request of ``cost`` at ``now_ms`` on a fixed-window policy
    (docs/arithmetic.md): admitted iff ``count + cost <= limit`` in every window; a
    denial's retry_after is the latest end of a denying window."""
    starts, counts = state
    new_starts = tuple(w.start(now_ms) for w in windows)
    current = tuple(
        count if start == new_start else 0
        for count, start, new_start in zip(counts, starts, new_starts, strict=True)
    )
    denying = [
        (w, start)
        for w, start, count in zip(windows, new_starts, current, strict=True)
        if count + cost > w.limit
    ]
    charged = tuple(c + cost for c in current)
    if denying:
        retry_ms = max(start + w.period_ms - now_ms for w, start in denying)
        return Decision(False, new_starts, current, charged, retry_ms)
    return Decision(True, new_starts, current, charged, None)


@dataclass(frozen=True, slots=True)
class Step:
    """One request through every layer of a client."""

    allowed: bool
    states: tuple[State, ...]
    charged: tuple[int, ...]
    """Per policy: 1 when charged (its outcome was ``allowed``)."""
    decisions: tuple[str, ...]
    """Per policy: ``allowed``, ``denied`` or ``shadow_denied``."""
    retry_after_ms: int | None


@dataclass(frozen=True, slots=True)
class Replay:
    """A client's policies and layers, as indexes into ``policies``."""

    policies: tuple[Policy, ...]
    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, spec: ClientSpec, known: Mapping[str, Policy]) -> Replay:
        ids = list(dict.fromkeys(spec.policy_ids))
        return cls(
            tuple(known[pid] for pid in ids),
            tuple(tuple(ids.index(pid) for pid in layer) for layer in spec.layers),
        )

    @property
    def windows(self) -> list[Window]:
        return [w for p in self.policies for w in p.windows]

    def initial(self) -> tuple[State, ...]:
        return tuple(
            (tuple(-1 for _ in p.windows), tuple(0 for _ in p.windows)) for p in self.policies
        )

    def step(self, states: tuple[State, ...], times: Sequence[int], cost: int) -> Step:
        """Decide the layers in order, the i-th at ``times[i]``. A layer charges its
        group only if each enforced policy admits (a shadow policy of the group then
        only if it admits too; it never refuses). Every layer is asked, as DRF asks every
        throttle (the example has no middleware layer in front of another one)."""
        new = list(states)
        charged = [0] * len(self.policies)
        decisions = [""] * len(self.policies)
        allowed = True
        retry: int | None = None
        for layer, now_ms in zip(self.layers, times, strict=True):
            found = {i: decide(self.policies[i].windows, new[i], now_ms, cost) for i in layer}
            group_ok = all(d.allowed for i, d in found.items() if not self.policies[i].shadow)
            for i, d in found.items():
                charge = group_ok and d.allowed
                new[i] = (d.starts, d.counts if charge else d.before)
                charged[i] = int(charge)
                if d.allowed:
                    decisions[i] = ALLOWED
                elif self.policies[i].shadow:
                    decisions[i] = SHADOW_DENIED
                else:
                    decisions[i] = DENIED
                    retry = max(retry or 0, d.retry_after_ms or 0)
            allowed = allowed and group_ok
        return Step(allowed, tuple(new), tuple(charged), tuple(decisions), retry)


def retry_after_header(retry_ms: int) -> int:
    return max(1, math.ceil(retry_ms / 1000))


def boundaries_within(windows: Sequence[Window], lo_ms: int, hi_ms: int) -> list[int]:
    """Return every window boundary b with lo_ms < b <= hi_ms."""
    found: set[int] = set()
    for w in windows:
        b = w.start(lo_ms) + w.period_ms
        while b <= hi_ms:
            found.add(b)
            b += w.period_ms
    return sorted(found)
