"""The group call's vocabulary: what a client sends ``evaluate.lua`` and what comes back.

The statuses (per policy, per group), the evaluation modes, the algorithm codes and the
packed layout of the script's arguments (its header), :class:`PolicyCall` (one policy of
a call, packed once), and the results: :class:`PolicyResult`, :class:`Write` and
:class:`GroupResult`. The arithmetic that decides them is :mod:`django_quota.core.model`'s;
the script's reply is parsed in :mod:`django_quota.core.protocol`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, NamedTuple

from django_quota.core.policy import (
    CONCURRENCY,
    FIXED_WINDOW,
    SLIDING_LOG,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
)
from django_quota.core.windows import Log, WindowResult

if TYPE_CHECKING:  # in annotations only
    from django_quota.core.policy import Window

#: Policy statuses: what a group's decision did to one policy
#: (:func:`~django_quota.core.model.decide_policy`; the script replies them only when a
#: group replays). Not decisions: an outcome's decision
#: (``core.outcome``'s ``ALLOWED``, ``DENIED_DECISION``…) follows from them.
REFUSED = 0  # its windows refuse the cost: nothing charged
CHARGED = 1  # its windows allow, and the cost was charged
UNCHARGED = 2  # its windows allow, nothing charged (peek, cost 0, the group refused)

#: Group statuses, the first integer of the script's reply.
GROUP_DECIDED = 0
GROUP_CLOCK_UNSAFE = 1
GROUP_INDETERMINATE = 2  # a possible repeat whose ledger entry may have been dropped
GROUP_REPLAYED = 3  # a repeat of a charged evaluation: nothing charged


class Mode:
    """Evaluation modes (the script's third argument)."""

    FRESH: Final = 0  # a new evaluation id: the ledger is not searched
    MAY_REPEAT: Final = 1  # a retry or a caller's id: the ledger is searched first
    PEEK: Final = 2  # decide as cost 1 would, write nothing


#: The script's code of each algorithm (5: :attr:`Packing.CALENDAR_CODE`).
ALGORITHM_CODES = MappingProxyType(
    {FIXED_WINDOW: 1, SLIDING_WINDOW: 2, TOKEN_BUCKET: 3, SLIDING_LOG: 4, CONCURRENCY: 6}
)

State = dict[str, int]


class Packing:
    """The packed arguments of ``evaluate.lua`` (see its header): unsigned big-endian."""

    #: The group's header: mode, policy count, now + 1 (0: Redis TIME), max clock
    #: regression + 1 (0: clamp), DEDUP_TTL and cleanup grace (ms).
    HEADER: Final = struct.Struct(">BH4Q")
    #: A policy: algorithm code, enforce (1 or 0), window count, cost.
    POLICY: Final = struct.Struct(">BBHQ")
    #: A window: limit, period (ms), capacity.
    WINDOW: Final = struct.Struct(">3Q")
    #: The algorithm code of a fixed window call with calendar windows (the script's
    #: header).
    CALENDAR_CODE: Final = 5
    #: A window of such a call: limit, then its boundaries b1, b0, b2 (ms:
    #: core/calendar.py); an epoch-aligned window of the call: limit, period (ms), 0, 0.
    CALENDAR_WINDOW: Final = struct.Struct(">4Q")
    #: Every packed number stays below this: the script reads the low six bytes of each.
    BOUND: Final = 2**48


def check_packable(value: int) -> int:
    """``value`` when ``0 <= value < 2**48`` (what the script reads), else ``ValueError``."""
    if not 0 <= value < Packing.BOUND:
        raise ValueError(f"{value} is outside 0..2**48 and cannot be sent to evaluate.lua")
    return value


#: The algorithms whose one-window call may take :func:`~django_quota.core.model.decide_one`.
_SHORT_ALGORITHMS = frozenset({FIXED_WINDOW, SLIDING_WINDOW, TOKEN_BUCKET})


@dataclass(frozen=True, slots=True)
class PolicyCall:
    """One policy of a group call: its algorithm, windows, cost and enforcement.

    ``packed`` is this call's part of the script's packed arguments (``evaluate.lua``'s
    header: algorithm, enforce, window count, cost, then limit, period in ms and capacity
    per window), encoded once. Raises ``ValueError`` for more than 65,535 windows or a
    number outside 0..2**48.

    ``bounds``: a fixed window call with calendar windows holds three boundaries per
    window (:func:`~django_quota.core.calendar.calendar_bounds`; 0, 0, 0 for its
    epoch-aligned windows), packed with each window's limit under the algorithm code
    ``Packing.CALENDAR_CODE`` (``Packing.CALENDAR_WINDOW``); ``()`` for every other call.
    """

    algorithm: str
    windows: tuple[Window, ...]
    cost: int
    enforce: bool = True
    bounds: tuple[int, ...] = ()
    packed: bytes = field(init=False, repr=False, compare=False)
    #: Whether a group of this call alone may take
    #: :func:`~django_quota.core.model.decide_one` (one window of a fixed window, sliding
    #: window counter or token bucket, without calendar bounds).
    short: bool = field(init=False, repr=False, compare=False)
    #: Whether a charge of this call alone may be read by
    #: :func:`~django_quota.core.protocol.charged_result` (the Redis short path): a fixed
    #: window, sliding window counter or token bucket, of any number of windows, without
    #: calendar bounds.
    short_reply: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        short_reply = not self.bounds and self.algorithm in _SHORT_ALGORITHMS
        object.__setattr__(self, "short_reply", short_reply)
        object.__setattr__(self, "short", short_reply and len(self.windows) == 1)
        if self.bounds:
            object.__setattr__(self, "packed", self._calendar_packed())
            return
        try:
            head = Packing.POLICY.pack(
                ALGORITHM_CODES[self.algorithm],
                1 if self.enforce else 0,
                len(self.windows),
                check_packable(self.cost),
            )
            windows = [
                Packing.WINDOW.pack(
                    check_packable(window.limit),
                    check_packable(window.period_ms),
                    check_packable(window.capacity),
                )
                for window in self.windows
            ]
        except struct.error as exc:
            raise ValueError(f"cannot pack this policy call for evaluate.lua: {exc}") from exc
        object.__setattr__(self, "packed", head + b"".join(windows))

    def _calendar_packed(self) -> bytes:
        """The packed arguments of a call with ``bounds`` (``Packing.CALENDAR_CODE``)."""
        bounds = self.bounds
        if self.algorithm != FIXED_WINDOW or len(bounds) != 3 * len(self.windows):
            raise ValueError("calendar bounds need a fixed window and three per window")
        try:
            head = Packing.POLICY.pack(
                Packing.CALENDAR_CODE,
                1 if self.enforce else 0,
                len(self.windows),
                check_packable(self.cost),
            )
            windows = []
            for i, window in enumerate(self.windows):
                b0, b1, b2 = (check_packable(bound) for bound in bounds[3 * i : 3 * i + 3])
                if b1 == 0:  # epoch-aligned
                    b1 = check_packable(window.period_ms)
                limit = check_packable(window.limit)
                windows.append(Packing.CALENDAR_WINDOW.pack(limit, b1, b0, b2))
        except struct.error as exc:
            raise ValueError(f"cannot pack this policy call for evaluate.lua: {exc}") from exc
        return head + b"".join(windows)


class PolicyResult(NamedTuple):
    """The result of one policy: status (:data:`REFUSED`, :data:`CHARGED`,
    :data:`UNCHARGED`), the effective ``now`` (ms) and its windows."""

    status: int
    now_ms: int
    windows: tuple[WindowResult, ...]


class Write(NamedTuple):
    """The new state of policy ``index``'s counter (numbers, and the ledger ``records``),
    with a time to live in milliseconds; a sliding log's new lists in ``logs``, one per
    window (``()`` for the other algorithms). ``keep_ttl``: the counter keeps the expiry
    it has (``SET … KEEPTTL``) instead of ``ttl_ms`` from now, because that expiry is
    already late enough (:func:`~django_quota.core.model.keeps_expiry`)."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index on purpose
    state: State
    ttl_ms: int
    records: bytes = b""
    logs: tuple[Log, ...] = ()
    keep_ttl: bool = False


class GroupResult(NamedTuple):
    """What a group call decided: the group status (:data:`GROUP_DECIDED`…), per policy
    results and the writes to apply (none unless decided)."""

    status: int
    results: tuple[PolicyResult, ...]
    writes: tuple[Write, ...]

    @property
    def clock_unsafe(self) -> bool:
        """True when a client clock ran backwards past the bound: nothing decided."""
        return self.status == GROUP_CLOCK_UNSAFE


class GroupInputs(NamedTuple):
    """What a group is decided with besides its calls and its counters' stored numbers,
    ledgers and logs: :func:`evaluate_group`'s other arguments, named."""

    now_ms: int
    peek: bool
    max_regression_ms: int
    cleanup_grace_ms: int
    fingerprint: bytes
    may_repeat: bool
    dedup_ttl_ms: int
    server_clock: bool
