"""The one call every backend answers: a prepared group of policies, its key names and
script arguments, and the parsed reply. Pure, so sync and async paths share it (the
prepare/interpret pair around one I/O call)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django_quota.core.identity import Identity
from django_quota.core.model import ALGORITHM_CODES, PolicyCall, PolicyResult
from django_quota.core.policy import Policy


def counter_key(prefix: str, policy: Policy, identity: Identity) -> str:
    """``<prefix>:{<hash tag>}:<len(policy id)>:<policy id>:<revision>`` plus ``:<route>``
    when the selector has a route besides other dimensions.

    One hash per (policy, revision, identity), tagged so that the policies of one subject
    share a Redis Cluster slot (contract 5.5). The policy id is length-prefixed and the
    revision never contains ``:``, so a route or policy id containing ``:`` can never
    make two counters share a name.
    """
    key = f"{prefix}:{{{identity.hash_tag}}}:{len(policy.id)}:{policy.id}:{policy.revision}"
    if identity.route is not None and identity.pseudonym is not None:
        key += f":{identity.route}"
    return key


def evaluation_key(counter: str, evaluation_id: str) -> str:
    """The evaluation-id record of one call for one counter (same hash tag)."""
    return f"{counter}:e:{evaluation_id}"


@dataclass(frozen=True, slots=True)
class GroupRequest:
    """Everything a backend needs to decide a group of policies in one call.

    ``now_ms`` is None to use the backend's clock (Redis ``TIME``); ``max_regression_ms``
    is -1 to clamp silently; lifetimes are in milliseconds.
    """

    counters: tuple[str, ...]
    evaluation_keys: tuple[str, ...]
    calls: tuple[PolicyCall, ...]
    now_ms: int | None
    peek: bool
    max_regression_ms: int
    dedup_ttl_ms: int
    cleanup_grace_ms: int

    def keys(self) -> list[str]:
        """KEYS for ``evaluate.lua``: counter, evaluation record, per policy."""
        out: list[str] = []
        for counter, record in zip(self.counters, self.evaluation_keys, strict=True):
            out += [counter, record]
        return out

    def args(self) -> list[int]:
        """ARGV for ``evaluate.lua`` (see its header)."""
        out = [
            -1 if self.now_ms is None else self.now_ms,
            self.max_regression_ms,
            1 if self.peek else 0,
            self.dedup_ttl_ms,
            self.cleanup_grace_ms,
            len(self.calls),
        ]
        for call in self.calls:
            out += [ALGORITHM_CODES[call.algorithm], 1 if call.enforce else 0, call.cost]
            out.append(len(call.windows))
            for window in call.windows:
                out += [window.limit, window.period_ms, window.capacity]
        return out

    @property
    def window_counts(self) -> tuple[int, ...]:
        """The window count of each call, to parse the reply."""
        return tuple(len(call.windows) for call in self.calls)


@dataclass(frozen=True, slots=True)
class GroupReply:
    """A backend's answer: ``clock_unsafe`` (nothing decided), ``replayed`` (a stored
    evaluation id answered) and one :class:`PolicyResult` per call."""

    clock_unsafe: bool
    replayed: bool
    results: tuple[PolicyResult, ...]


def parse_reply(reply: Sequence[int], window_counts: Sequence[int]) -> GroupReply:
    """Parse ``evaluate.lua``'s flat integer reply (``ValueError`` when malformed)."""
    values = [int(value) for value in reply]
    if len(values) < 2:
        raise ValueError(f"malformed script reply of length {len(values)}")
    if values[0] == 1:
        return GroupReply(True, False, ())
    position = 2
    results = []
    for count in window_counts:
        size = 2 + 4 * count
        chunk = values[position : position + size]
        if len(chunk) != size:
            raise ValueError("script reply shorter than its windows")
        results.append(PolicyResult.decode(chunk, count))
        position += size
    if position != len(values):
        raise ValueError("script reply longer than its windows")
    return GroupReply(False, values[1] == 1, tuple(results))


def encode_reply(reply: GroupReply) -> list[int]:
    """Inverse of :func:`parse_reply` (the memory backend answers in the script's shape)."""
    if reply.clock_unsafe:
        return [1, 0]
    out = [0, 1 if reply.replayed else 0]
    for result in reply.results:
        out += result.encode()
    return out
