"""What :meth:`~django_quota.engine.Limiter.prepare` makes a group into: each policy
compiled once per revision (:class:`Compiled`), the early outcome of a policy that is
not sent (:func:`refusal`), the evaluation id, and the group ready for one backend call
(:class:`Prepared`)."""

from __future__ import annotations

import time
from binascii import b2a_base64
from dataclasses import dataclass, replace
from os import urandom

from django_quota import conf
from django_quota.core.calendar import windows_bounds
from django_quota.core.calls import PolicyCall
from django_quota.core.identity import Identity
from django_quota.core.outcome import (
    DENIED_DECISION,
    SELECTOR_IDENTITY_MISSING,
    SHADOW_DENIED,
    SKIPPED,
    Outcome,
    bare_outcome,
)
from django_quota.core.policy import CONCURRENCY, TOKEN_BUCKET, Policy, Selector
from django_quota.core.protocol import GroupRequest, counter_key, counter_tail

#: Standard base64's two last symbols to base64url's (RFC 4648, section 5).
_BASE64URL = bytes.maketrans(b"+/", b"-_")


def new_evaluation_id() -> str:
    """A fresh 128-bit random evaluation id from ``os.urandom``: 22 base64url characters
    (RFC 4648, section 5, unpadded), as ``secrets.token_urlsafe(16)`` gives, in fewer
    calls."""
    return b2a_base64(urandom(16), newline=False)[:22].translate(_BASE64URL).decode()


def validate_cost(cost: object) -> int:
    """``cost`` when it is an ``int >= 0`` (raises ``TypeError``, ``ValueError``)."""
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise TypeError(f"cost must be an int, not {type(cost).__name__}")
    if cost < 0:
        raise ValueError(f"cost must be >= 0, not {cost}")
    return cost


# -- compiled policies ---------------------------------------------------------------------
class Compiled:
    """What one policy (at one revision) needs on every evaluation, computed once: the
    counter key's tail, the largest cost its windows can ever admit, its script
    arguments per cost, and its failure mode under the current settings."""

    __slots__ = (
        "calendar",
        "calendar_calls",
        "calls",
        "cost_bound",
        "counters",
        "dimension",
        "fail_open",
        "key_tail",
        "needs_id",
        "plans",
        "policy",
        "selector_label",
        "settings",
        "short_calls",
    )

    def __init__(
        self,
        policy: Policy,
        settings: conf.QuotaSettings,
        counters: dict[object, str] | None = None,
    ) -> None:
        self.policy = policy
        self.settings = settings
        #: This policy under each of its plans asked for so far (``docs/plans.md``).
        self.plans: dict[str, Compiled] = {}
        self.key_tail = counter_tail(policy)
        #: Whether the edges undo its charge by the evaluation's id (a lease released, a
        #: ``count_when`` refund, a successful login's refund): the memory backend then
        #: gives its evaluations an id.
        self.needs_id = (
            policy.algorithm == CONCURRENCY
            or policy.count_when is not None
            or policy.id in settings.login_policies
        )
        #: The ``selector_dimensions`` label of its outcomes' metrics.
        self.selector_label = "+".join(policy.selector)
        #: The selector's one dimension when a subject's counter key follows from that
        #: dimension's value alone (not ``auto``, which reads several), else None.
        self.dimension = (
            policy.selector[0]
            if len(policy.selector) == 1 and policy.selector[0] != Selector.AUTO
            else None
        )
        #: Counter keys already derived, by the raw value of :attr:`dimension` (a ``str``
        #: or an ``int``), as the identity cache keeps raw subjects: a repeated subject's
        #: key costs one lookup, not its identity's and key's derivation. Shared with the
        #: policy's plans (same id and revision, same counter); the limiter bounds it.
        self.counters: dict[object, str] = {} if counters is None else counters
        bounds = [
            window.capacity if policy.algorithm == TOKEN_BUCKET else window.limit
            for window in policy.windows
        ]
        if policy.max_cost is not None:
            bounds.append(policy.max_cost)
        self.cost_bound = min(bounds) if bounds else 0
        self.fail_open = policy.shadow or settings.failure_mode_of(policy) == "open"
        self.calls: dict[int, PolicyCall] = {}
        #: Whether a window is a calendar window (its calls carry boundaries).
        self.calendar = any(window.calendar for window in policy.windows)
        #: Per cost: the call with boundaries, and the client times it holds for.
        self.calendar_calls: dict[int, tuple[int, int, PolicyCall]] = {}
        #: Per cost: the script and packed arguments of the limiter's short path
        #: (:meth:`~django_quota.engine.Limiter.shortcut`).
        self.short_calls: dict[int, tuple[str, bytes]] = {}

    def call(self, cost: int) -> PolicyCall:
        """The policy's :class:`PolicyCall` at ``cost`` (script arguments encoded once)."""
        call = self.calls.get(cost)
        if call is None:
            policy = self.policy
            call = PolicyCall(policy.algorithm, policy.windows, cost, not policy.shadow)
            if len(self.calls) < 16:
                self.calls[cost] = call
        return call

    def for_plan(self, plan: str) -> Compiled:
        """This policy with the windows of ``plan`` (same id and revision: the same
        counter), or itself when the policy has no such plan."""
        found = self.plans.get(plan)
        if found is None:
            windows = self.policy.plan_windows(plan)
            if windows is None:
                return self
            found = Compiled(
                replace(self.policy, windows=windows, plans=()), self.settings, self.counters
            )
            self.plans[plan] = found
        return found

    def calendar_call(self, call: PolicyCall, now_ms: int) -> PolicyCall:
        """``call`` with the boundaries of its calendar windows around the client's
        ``now_ms`` (:func:`~django_quota.core.calendar.windows_bounds`), computed again
        only when they change."""
        cached = self.calendar_calls.get(call.cost)
        if (
            cached is not None
            and cached[0] <= now_ms < cached[1]
            and cached[2].enforce == call.enforce
        ):
            return cached[2]
        bounds, valid_from, valid_until = windows_bounds(call.windows, now_ms)
        placed = PolicyCall(call.algorithm, call.windows, call.cost, call.enforce, bounds)
        if len(self.calendar_calls) < 16:
            self.calendar_calls[call.cost] = (valid_from, valid_until, placed)
        return placed

    def counter(self, prefix: str, identity: Identity) -> str:
        """The counter key of ``identity`` (:func:`~django_quota.core.protocol.counter_key`)."""
        return counter_key(prefix, self.policy, identity, self.key_tail)


class ClockUnusable(Exception):
    """``QUOTA["CLOCK"]`` (or a caller's clock) raised or gave no usable time: the group
    is not sent, its policies take their failure modes with reason ``clock_unsafe``."""


@dataclass(slots=True)
class Prepared:
    """A group ready for one backend call: early outcomes, and the request if any."""

    compiled: list[Compiled]
    outcomes: list[Outcome | None]
    request: GroupRequest | None
    sent: list[int]
    evaluation_id: str
    started: float
    peek: bool
    backend_mode: str
    #: Ids whose own windows allowed but whose group was refused: nothing charged.
    group_denied: tuple[str, ...] = ()
    #: Why the clock could not give a ``now`` (the request is then never sent).
    clock_error: str | None = None


def placed_calls(
    prepared: Prepared, calls: tuple[PolicyCall, ...], now_ms: int | None
) -> tuple[PolicyCall, ...]:
    """``calls`` with the boundaries of their calendar windows around the client's
    now: ``now_ms``, or this machine's clock when the counters follow Redis ``TIME``
    (the script places its own now among them: docs/policies.md)."""
    client_now = round(time.time() * 1000) if now_ms is None else now_ms
    placed = list(calls)
    for position, index in enumerate(prepared.sent):
        compiled = prepared.compiled[index]
        if compiled.calendar:
            placed[position] = compiled.calendar_call(calls[position], client_now)
    return tuple(placed)


def refusal(policy: Policy, reason: str, backend_mode: str) -> Outcome:
    """The early outcome of ``policy`` when it is not sent for ``reason`` (an identity
    error, ``cost_exceeds_limit``): skipped when its identity is missing and
    ``on_missing`` says so, else denied (shadow denied for a shadow policy)."""
    if reason == SELECTOR_IDENTITY_MISSING and policy.on_missing == "skip":
        decision = SKIPPED
    else:
        decision = SHADOW_DENIED if policy.shadow else DENIED_DECISION
    return bare_outcome(policy, decision, reason, backend_mode=backend_mode)
