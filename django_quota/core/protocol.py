"""The one call every backend answers: a prepared group of policies, its key names and
script arguments, and the parsed reply. Pure, so sync and async paths share it (the
prepare/interpret pair around one I/O call)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from django_quota.core.calls import (
    CHARGED,
    GROUP_CLOCK_UNSAFE,
    GROUP_DECIDED,
    GROUP_INDETERMINATE,
    GROUP_REPLAYED,
    Mode,
    Packing,
    PolicyCall,
    PolicyResult,
    check_packable,
)
from django_quota.core.evaluation_ids import LedgerLayout, entry_head
from django_quota.core.identity import Identity
from django_quota.core.model import decide_policy, group_allows
from django_quota.core.policy import (
    CONCURRENCY,
    FIXED_WINDOW,
    SLIDING_LOG,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    Policy,
)
from django_quota.core.windows import (
    WindowResult,
    calendar_place,
    calendar_result,
    new_tuple,
    window_result,
)


def counter_tail(policy: Policy) -> str:
    """What follows a counter key's hash tag, the same for every subject of ``policy``:
    ``}:<len(policy id)>:<policy id>:<revision>`` (the limiter computes it once)."""
    return f"}}:{len(policy.id)}:{policy.id}:{policy.revision}"


def counter_key(prefix: str, policy: Policy, identity: Identity, tail: str | None = None) -> str:
    """``<prefix>:{<hash tag>}:<len(policy id)>:<policy id>:<revision>`` plus ``:<route>``
    when the selector has a route besides other dimensions; ``tail`` is
    :func:`counter_tail` of ``policy`` when the caller has it already.

    One counter per (policy, revision, identity), tagged so that the policies of one subject
    share a Redis Cluster slot. The policy id is length-prefixed and the revision never
    contains ``:``, so a route or policy id containing ``:`` can never make two counters
    share a name.
    """
    key = f"{prefix}:{{{identity.hash_tag}{tail or counter_tail(policy)}"
    if identity.route is not None and identity.pseudonym is not None:
        key += f":{identity.route}"
    return key


def log_key(counter: str, index: int) -> str:
    """The sliding-log list of window ``index`` (1-based) of ``counter``: the counter key
    with ``l<index>`` before its ``{``, e.g. ``quota:l1{tag}:6:orders:1a2b3c4d``.

    Same hash tag, so the same cluster slot; and never another counter's name, nor
    another log's: a counter key has ``:`` right before its first ``{`` (``KEY_PREFIX``
    has no braces), a log key a digit.
    """
    brace = counter.index("{")
    return f"{counter[:brace]}l{index}{counter[brace:]}"


def reset_keys(counter: str, window_count: int) -> list[str]:
    """KEYS for ``reset.lua``: the counter and the sliding-log list of each window (an
    algorithm without logs has none of those keys; deleting them is a no-op)."""
    return [counter, *(log_key(counter, index) for index in range(1, window_count + 1))]


def decode_counter(
    value: bytes | None, algorithm: str, window_count: int
) -> tuple[dict[str, int] | None, bytes]:
    """A counter as ``evaluate.lua`` stores it in Redis, read back: its numbers as the
    model keeps them (``t``, ``d``, ``c<i>`` and, for the sliding window counter and
    the token bucket, ``p<i>``; times in ms) and its ledger records (the entries,
    oldest first, as :func:`~django_quota.core.evaluation_ids.appended` builds them).

    The value (the script's header documents it): one byte of the ledger's length in
    bytes, the entries, 6 bytes of ``d + 1`` (0: none), then, unless reset, 6 bytes of
    ``t`` and 6 bytes per stored number, each big-endian. ``None`` (no key) reads as
    ``(None, b"")``. Raises ``ValueError`` for a value of another length.
    """
    if value is None:
        return None, b""
    ledger_end = 1 + (value[0] if value else 0)
    numbers = (2 if algorithm in (SLIDING_WINDOW, TOKEN_BUCKET) else 1) * window_count
    if len(value) not in (ledger_end + 6, ledger_end + 12 + 6 * numbers):
        raise ValueError(f"a counter value of {len(value)} bytes is not in evaluate.lua's layout")
    state: dict[str, int] = {}
    dropped = int.from_bytes(value[ledger_end : ledger_end + 6], "big") - 1
    if dropped >= 0:
        state["d"] = dropped
    if len(value) > ledger_end + 6:
        fields = [
            int.from_bytes(value[start : start + 6], "big")
            for start in range(ledger_end + 6, len(value), 6)
        ]
        state["t"] = fields[0]
        per_window = numbers // window_count
        for index in range(window_count):
            state[f"c{index + 1}"] = fields[1 + per_window * index]
            if per_window == 2:
                state[f"p{index + 1}"] = fields[2 + 2 * index]
    return state, bytes(value[1:ledger_end])


def check_evaluation_id(evaluation_id: object) -> str:
    """Return a caller's evaluation id when it is printable text of 1 to 128 characters.

    Raises ``TypeError`` for anything but a ``str`` and ``ValueError`` for an empty id
    (one id shared by every call would make each a repeat that charges nothing), a longer
    one, or one with control characters or lone surrogates (which UTF-8 cannot carry to
    Redis), so every backend refuses the same ids before any call.
    """
    if not isinstance(evaluation_id, str):
        raise TypeError(f"evaluation_id must be a str, not {type(evaluation_id).__name__}")
    longest = 128  # the longest evaluation id a caller may give, in characters
    if not 1 <= len(evaluation_id) <= longest:
        raise ValueError(
            f"evaluation_id must be 1 to {longest} characters, "
            f"not {len(evaluation_id)}"
        )
    try:
        evaluation_id.encode()
    except UnicodeEncodeError:
        printable = False
    else:
        printable = evaluation_id.isprintable()
    if not printable:
        raise ValueError(
            "evaluation_id must be printable text (no control characters or lone surrogates)"
        )
    return evaluation_id


def fingerprint(evaluation_id: str) -> bytes:
    """The ledger fingerprint of an evaluation id: the 5-byte BLAKE2b digest of its UTF-8
    bytes, its first bit cleared (a ledger entry's cost flag:
    :mod:`~django_quota.core.evaluation_ids`), so 39 bits. Two ids share one with
    probability 2**-39."""
    digest = hashlib.blake2b(
        evaluation_id.encode(), digest_size=LedgerLayout.FINGERPRINT_BYTES
    ).digest()
    if digest[0] & LedgerLayout.COST_FLAG:
        return bytes((digest[0] ^ LedgerLayout.COST_FLAG,)) + digest[1:]
    return digest


#: Added to the header's mode when the group gives ``now`` (the client's clock): without
#: it the script reads Redis ``TIME``.
CLIENT_CLOCK = 4

#: Packed headers of the server clock's groups (no ``now`` in them): a handful per
#: process (mode, policy count and the settings' lifetimes), packed once each.
_HEADERS: dict[tuple[int, ...], bytes] = {}


def _pack_header(fields: tuple[int, ...]) -> bytes:
    mode, count, now, regression, dedup_ttl, grace = fields
    try:
        header = Packing.HEADER.pack(
            mode,
            count,
            now,  # 0 (Redis TIME) or now + 1, checked by args()
            check_packable(regression),
            check_packable(dedup_ttl),
            check_packable(grace),
        )
    except struct.error as exc:
        raise ValueError(f"cannot pack this group for evaluate.lua: {exc}") from exc
    if now == 0 and len(_HEADERS) < 64:
        _HEADERS[fields] = header
    return header


class GroupRequest(NamedTuple):
    """Everything a backend needs to decide a group of policies in one call.

    ``now_ms`` is None to use the backend's clock (Redis ``TIME``); ``max_regression_ms``
    is -1 to clamp silently; lifetimes are in milliseconds. ``fingerprint`` is the
    evaluation id's (:func:`fingerprint`); ``may_repeat`` asks the backend to search the
    counters' ledgers for it first (a retry, or an id the caller chose).
    """

    counters: tuple[str, ...]
    calls: tuple[PolicyCall, ...]
    now_ms: int | None
    peek: bool
    max_regression_ms: int
    dedup_ttl_ms: int
    cleanup_grace_ms: int
    fingerprint: bytes = b""
    may_repeat: bool = False

    @property
    def mode(self) -> int:
        """The script's evaluation mode (:class:`~django_quota.core.calls.Mode`)."""
        if self.peek:
            return Mode.PEEK
        return Mode.MAY_REPEAT if self.may_repeat else Mode.FRESH

    def keys(self) -> Sequence[str]:
        """KEYS for ``evaluate.lua``: one counter per policy, then the sliding-log
        lists (:func:`log_key`) of each sliding_log policy's windows, in call order."""
        calls = self.calls
        counters = self.counters
        if len(calls) == 1 == len(counters) and calls[0].algorithm != SLIDING_LOG:
            return counters  # the common group: one counter, no list after it
        keys = list(self.counters)
        for counter, call in zip(self.counters, self.calls, strict=True):
            if call.algorithm == SLIDING_LOG:
                keys += [log_key(counter, index) for index in range(1, len(call.windows) + 1)]
        return keys

    def args(self) -> list[int | str | bytes]:
        """ARGV for ``evaluate.lua`` (see its header): the head of the ledger entry a
        charge appends (the fingerprint, and the cost when it is not 1:
        :func:`~django_quota.core.evaluation_ids.entry_head`), then every number packed
        in one string. Raises ``ValueError`` for more than 65,535 policies or a
        time outside 0..2**48 ms."""
        fields = (
            self.mode if self.now_ms is None else self.mode + CLIENT_CLOCK,
            len(self.calls),
            0 if self.now_ms is None else check_packable(self.now_ms) + 1,
            self.max_regression_ms + 1,
            self.dedup_ttl_ms,
            self.cleanup_grace_ms,
        )
        header = _HEADERS.get(fields)
        if header is None:
            header = _pack_header(fields)
        if len(self.calls) == 1:
            packed = header + self.calls[0].packed
        else:
            packed = header + b"".join(call.packed for call in self.calls)
        if self.peek:
            return [b"", packed]
        head = self.fingerprint
        cost = self.calls[0].cost  # one cost for the whole group
        if cost != 1 and head:
            head = entry_head(head, cost)
        return [head, packed]


class GroupReply(NamedTuple):
    """A backend's answer: ``status`` (decided, clock unsafe, indeterminate or replayed,
    :data:`~django_quota.core.calls.GROUP_DECIDED`…) and one :class:`PolicyResult` per
    call (none unless decided or replayed)."""

    status: int
    results: tuple[PolicyResult, ...]

    @property
    def clock_unsafe(self) -> bool:
        """A client clock ran backwards past ``MAX_CLOCK_REGRESSION``: nothing decided."""
        return self.status == GROUP_CLOCK_UNSAFE

    @property
    def indeterminate(self) -> bool:
        """A possible repeat whose ledger entry may have been dropped: nothing decided."""
        return self.status == GROUP_INDETERMINATE

    @property
    def replayed(self) -> bool:
        """A repeat of a charged evaluation: allowed, nothing charged."""
        return self.status == GROUP_REPLAYED


@dataclass(frozen=True, slots=True)
class Probe:
    """What ``quota check`` runs on a backend for one ``algorithm`` in use: ``peek``, then
    each of ``charges`` (cost 1) with the ``remaining`` it must report, all through the
    real evaluation script, on the one-window ``counter`` of ``limit`` units; then the
    counter is reset and removed."""

    counter: str
    limit: int
    algorithm: str
    peek: GroupRequest
    charges: tuple[tuple[GroupRequest, int], ...]


def parse_reply(reply: Sequence[int], calls: Sequence[PolicyCall], peek: bool) -> GroupReply:
    """Parse ``evaluate.lua``'s flat integer reply to the group of ``calls`` (``peek``: the
    group was a peek) into results (``ValueError`` when malformed).

    A sliding log's windows come with their reported numbers; the other algorithms' with
    their views (used, and prev for the sliding window counter), from which
    :func:`~django_quota.core.windows.window_result` computes the numbers, as the model does
    for the memory backend: the arithmetic of a reported number exists once, in Python.
    Per policy the reply holds its status only when the group replayed. Otherwise the
    statuses are the model's rule (:func:`~django_quota.core.model.group_allows`,
    :func:`~django_quota.core.model.decide_policy`) applied to the windows as the script
    saw them: a window allows iff its ``retry_after`` is -1.
    """
    if not reply:
        raise ValueError("empty script reply")
    status = int(reply[0])
    replayed = status == GROUP_REPLAYED
    if status != GROUP_DECIDED and not replayed:
        if status not in (GROUP_CLOCK_UNSAFE, GROUP_INDETERMINATE):
            raise ValueError(f"unknown script status {status}")
        if len(reply) != 1:
            raise ValueError("script reply longer than its status")
        return GroupReply(status, ())
    size = len(reply)
    position = 1
    results: list[PolicyResult] = []
    fits: list[bool] = []
    may_charge = not peek and not replayed
    for call in calls:
        if replayed:
            if position >= size:
                raise ValueError("script reply shorter than its windows")
            policy_status = int(reply[position])
            position += 1
        end = position + 1 + _WIDTHS[call.algorithm] * len(call.windows)
        if end > size:
            raise ValueError("script reply shorter than its windows")
        now = int(reply[position])
        cost = 1 if peek else call.cost
        charge = may_charge and call.cost > 0  # computed as charged when it may be
        windows, fit = _windows(reply, position + 1, call, now, cost, charge)
        if not replayed:  # as if the group is allowed: checked below
            policy_status = decide_policy(call, fit, True, peek)
            if charge and policy_status != CHARGED and call.algorithm != SLIDING_LOG:
                windows = _windows(reply, position + 1, call, now, cost, False)[0]
        elif call.algorithm != SLIDING_LOG:
            windows = [result._replace(retry_after_ms=-1) for result in windows]
        position = end
        fits.append(fit)
        results.append(new_tuple(PolicyResult, (policy_status, now, tuple(windows))))
    if position != size:
        raise ValueError("script reply longer than its windows")
    if not replayed and not group_allows(calls, fits):
        _refused(reply, calls, fits, peek, results)
    return new_tuple(GroupReply, (status, tuple(results)))


def charged_result(reply: object, call: PolicyCall) -> PolicyResult | None:
    """The result of a fresh one-policy group of ``call`` (no calendar bounds:
    :attr:`~django_quota.core.calls.PolicyCall.short_reply`) from ``evaluate.lua``'s
    reply, when the script decided it and charged it: read as :func:`parse_reply` reads
    it (:func:`_windows`, :func:`~django_quota.core.model.group_allows`,
    :func:`~django_quota.core.model.decide_policy`), without a :class:`GroupReply`.
    None for any other reply (a refusal, another status, a malformed reply):
    :func:`parse_reply` then reads it (the limiter's short path,
    ``docs/architecture.md``)."""
    if type(reply) is not list or len(reply) != 2 + _WIDTHS[call.algorithm] * len(call.windows):
        return None
    try:
        if int(reply[0]) != GROUP_DECIDED:
            return None
        now = int(reply[1])
        windows, fit = _windows(reply, 2, call, now, call.cost, True)
    except (TypeError, ValueError):
        return None
    if decide_policy(call, fit, group_allows((call,), (fit,)), False) != CHARGED:
        return None
    return new_tuple(PolicyResult, (CHARGED, now, tuple(windows)))


def _windows(
    reply: Sequence[int], position: int, call: PolicyCall, now: int, cost: int, charged: bool
) -> tuple[list[WindowResult], bool]:
    """The windows of ``call``, whose part of the reply starts at ``position``, and whether
    each allows: a sliding log's numbers as the script reports them, the other
    algorithms' computed from their views as ``charged`` or not (whether a window allows
    does not depend on it: its ``retry_after`` is -1 iff it does)."""
    if call.bounds:
        return _calendar_windows(reply, position, call, now, cost, charged)
    algorithm = call.algorithm
    fit = True
    windows = []
    for window in call.windows:
        if algorithm == SLIDING_LOG:
            result = WindowResult(
                int(reply[position]),
                int(reply[position + 1]),
                int(reply[position + 2]),
                int(reply[position + 3]),
            )
            position += 4
        else:
            used = int(reply[position])
            prev = 0
            if algorithm in (SLIDING_WINDOW, CONCURRENCY):
                prev = int(reply[position + 1])
                position += 1
            position += 1
            result = window_result(algorithm, window, used, prev, now, cost, charged)[0]
        if result.retry_after_ms != -1:
            fit = False
        windows.append(result)
    return windows, fit


def _calendar_windows(
    reply: Sequence[int], position: int, call: PolicyCall, now: int, cost: int, charged: bool
) -> tuple[list[WindowResult], bool]:
    """:func:`_windows` for a call with calendar windows: each placed by the script's
    ``now`` between the call's boundaries, as the script placed it
    (:func:`~django_quota.core.windows.calendar_place`), and counted to its end."""
    fit = True
    windows = []
    for index, window in enumerate(call.windows):
        end = calendar_place(call.bounds, index, now, window.period_ms)[1]
        if end == 0:
            raise ValueError("script reply's now outside the calendar boundaries sent")
        result = calendar_result(window, int(reply[position + index]), end, now, cost, charged)[0]
        if result.retry_after_ms != -1:
            fit = False
        windows.append(result)
    return windows, fit


def _refused(
    reply: Sequence[int],
    calls: Sequence[PolicyCall],
    fits: Sequence[bool],
    peek: bool,
    results: list[PolicyResult],
) -> None:
    """Correct ``results``, decided as if their group were allowed, for a group refused:
    each policy as :func:`~django_quota.core.model.decide_policy` then decides it, the
    windows of those no longer charged computed again (a sliding log's numbers came from
    the script, which knew)."""
    start = 1
    for index, call in enumerate(calls):
        decided = results[index]
        policy_status = decide_policy(call, fits[index], False, peek)
        if policy_status != decided.status:
            windows = decided.windows
            if call.algorithm != SLIDING_LOG:
                now = decided.now_ms
                windows = tuple(_windows(reply, start + 1, call, now, call.cost, False)[0])
            results[index] = PolicyResult(policy_status, decided.now_ms, windows)
        start += 1 + _WIDTHS[call.algorithm] * len(call.windows)


#: Integers per window in the reply: a view (used; used and prev for the sliding window
#: counter) or a sliding log's four numbers. Read once per policy of every reply: a dict
#: (a MappingProxyType costs 48 more machine instructions a lookup), read-only as typed.
_WIDTHS: Final[Mapping[str, int]] = {
    FIXED_WINDOW: 1,
    TOKEN_BUCKET: 1,
    SLIDING_WINDOW: 2,
    SLIDING_LOG: 4,
    CONCURRENCY: 2,
}


def decode_leases(members: Sequence[tuple[bytes, float]]) -> tuple[int, ...]:
    """A concurrency policy's sorted set (``ZRANGE … WITHSCORES``: (member, expiry)
    pairs in order) in the model's terms: flat (expiry, fingerprint as an integer,
    units) triples (:mod:`django_quota.core.windows`, docs/concurrency.md)."""
    out: list[int] = []
    fingerprint_bytes = LedgerLayout.FINGERPRINT_BYTES
    for member, score in members:
        out += (
            int(score),
            int.from_bytes(member[:fingerprint_bytes], "big"),
            int.from_bytes(member[fingerprint_bytes:], "big"),
        )
    return tuple(out)


class ReleaseRequest(NamedTuple):
    """A release of the leases one evaluation acquired (``release.lua``): the counter,
    the evaluation's fingerprint and ``now_ms`` (None: Redis ``TIME``)."""

    counter: str
    fingerprint: bytes
    now_ms: int | None
    cleanup_grace_ms: int

    def args(self) -> list[int | str | bytes]:
        """ARGV for ``release.lua``: the fingerprint, now + 1 (0: Redis ``TIME``), the
        grace."""
        now = 0 if self.now_ms is None else check_packable(self.now_ms) + 1
        return [self.fingerprint, now, self.cleanup_grace_ms]
