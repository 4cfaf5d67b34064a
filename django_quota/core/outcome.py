"""Outcome types and the vocabulary of decisions and reasons (``docs/failures.md``),
and the rules that turn a script's per-window numbers into one :class:`Outcome`
(``docs/arithmetic.md``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_quota.core.calls import REFUSED, PolicyResult
from django_quota.core.policy import Policy, Window
from django_quota.core.windows import WindowResult

ALLOWED = "allowed"
DENIED_DECISION = "denied"
SHADOW_DENIED = "shadow_denied"
SKIPPED = "skipped"
FAILED_OPEN = "failed_open"
FAILED_CLOSED = "failed_closed"
DECISIONS = (ALLOWED, DENIED_DECISION, SHADOW_DENIED, SKIPPED, FAILED_OPEN, FAILED_CLOSED)
PROCEEDING_DECISIONS = frozenset({ALLOWED, SHADOW_DENIED, SKIPPED, FAILED_OPEN})

QUOTA_EXHAUSTED_SUFFIX = "_quota_exhausted"
SELECTOR_IDENTITY_MISSING = "selector_identity_missing"
SELECTOR_IDENTITY_INVALID = "selector_identity_invalid"
COST_EXCEEDS_LIMIT = "cost_exceeds_limit"
BACKEND_TIMEOUT = "backend_timeout"
BACKEND_UNAVAILABLE = "backend_unavailable"
BACKEND_ERROR = "backend_error"
CLOCK_UNSAFE = "clock_unsafe"
INDETERMINATE = "indeterminate"
#: A view, throttle or decorator names a policy no source defines (docs/failures.md).
POLICY_UNKNOWN = "policy_unknown"
#: The request's client is exempt: a policy's ``exempt`` networks or ``EXEMPT_WHEN``
#: (docs/policies.md#exemptions); the decision is ``skipped``.
EXEMPT = "exempt"
FAILURE_REASONS = frozenset(
    {BACKEND_TIMEOUT, BACKEND_UNAVAILABLE, BACKEND_ERROR, CLOCK_UNSAFE, INDETERMINATE}
)
FIXED_REASONS = frozenset(
    {
        SELECTOR_IDENTITY_MISSING,
        SELECTOR_IDENTITY_INVALID,
        COST_EXCEEDS_LIMIT,
        POLICY_UNKNOWN,
        EXEMPT,
        *FAILURE_REASONS,
    }
)

BACKEND_MODE_REDIS = "redis"
BACKEND_MODE_MEMORY = "memory"
BACKEND_MODE_FALLBACK = "fallback"
#: A refusal Redis gave, answered again by this process (``QUOTA["DENIAL_CACHE"]``).
BACKEND_MODE_CACHE = "cache"


def is_known_reason(reason: str | None) -> bool:
    """True for ``None`` and every reason of the vocabulary (``docs/failures.md``)."""
    return reason is None or reason in FIXED_REASONS or reason.endswith(QUOTA_EXHAUSTED_SUFFIX)


@dataclass(frozen=True, slots=True)
class WindowState:
    """One window of an :class:`Outcome`. Times are float seconds.

    * ``name``: the window's name (``"default"`` when the policy has a single rate).
    * ``limit``: its limit (a token bucket's capacity).
    * ``period``: its period, in seconds.
    * ``remaining``: units left after this decision (after its charge, if it charged).
    * ``reset_after``: seconds until the window resets, per algorithm
      (``docs/arithmetic.md``).
    * ``retry_after``: seconds until a retry can succeed when this window denied, else
      None.
    * ``replenish_after``: seconds until ``remaining`` next increases, the ``t`` of the
      IETF ``RateLimit`` header (per algorithm in ``docs/arithmetic.md``).
    """

    name: str
    limit: int
    period: float
    remaining: int
    reset_after: float
    retry_after: float | None
    replenish_after: float = 0.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """The decision for one policy, as :func:`~django_quota.evaluate`,
    :func:`~django_quota.peek` and every layer (middleware, throttle, decorator) give it.
    Times are float seconds.

    * ``policy``: the policy id.
    * ``decision``: ``"allowed"``; ``"denied"``; ``"shadow_denied"`` (a shadow policy that
      would have refused: the request proceeds); ``"skipped"`` (a disabled policy, or a
      missing identity with ``on_missing="skip"``); ``"failed_open"`` or
      ``"failed_closed"`` (the backend could not decide and the policy's failure mode
      applied). :attr:`allowed` says whether the request proceeds.
    * ``reason``: None when allowed; ``"<window>_quota_exhausted"`` for a quota denial;
      else ``"selector_identity_missing"``, ``"selector_identity_invalid"``,
      ``"cost_exceeds_limit"``, ``"policy_unknown"`` or a failure reason
      (``"backend_timeout"``, ``"backend_unavailable"``, ``"backend_error"``,
      ``"clock_unsafe"``, ``"indeterminate"``: ``docs/failures.md``).
    * ``window``, ``limit``, ``remaining``, ``reset_after``: the reported window (a denial
      reports the denying window with the largest ``retry_after``, an admission the one
      with the fewest ``remaining``) and its numbers, as in :class:`WindowState`; None
      when the backend did not decide.
    * ``retry_after``: seconds until a retry can succeed, for a quota denial
      (``denied`` or ``shadow_denied``) and for ``failed_closed`` (``FAILURE_RETRY_AFTER``);
      None otherwise (waiting cannot help an identity error or ``cost_exceeds_limit``).
    * ``windows``: every window's :class:`WindowState`, in declaration order (empty when
      the backend did not decide).
    * ``certainty``: ``"approximate"`` for the sliding window counter, else ``"exact"``.
    * ``backend_mode``: ``"redis"``, ``"memory"``, ``"fallback"`` (the local fallback
      decided) or ``"cache"`` (a refusal Redis gave, answered again by this process:
      ``docs/failures.md``).
    * ``evaluation_id``: the evaluation's id (the caller's, or a fresh random one); empty
      for an outcome decided before any backend call (skipped, an identity error,
      ``cost_exceeds_limit``, ``policy_unknown``), and on the memory backend unless the
      caller passed one or the edges undo the group's charge by its id (leases,
      ``count_when``: ``docs/outcomes.md``).
    """

    policy: str
    decision: str
    reason: str | None = None
    window: str | None = None
    limit: int | None = None
    remaining: int | None = None
    reset_after: float | None = None
    retry_after: float | None = None
    windows: tuple[WindowState, ...] = ()
    certainty: str = "exact"
    backend_mode: str = BACKEND_MODE_MEMORY
    evaluation_id: str = ""

    @property
    def allowed(self) -> bool:
        """True when the request may proceed (allowed, shadow_denied, skipped, failed_open)."""
        return self.decision in PROCEEDING_DECISIONS

    @property
    def reported_window(self) -> WindowState | None:
        """The :class:`WindowState` named by ``window``; None when the backend did not
        decide."""
        return next((w for w in self.windows if w.name == self.window), None)


def _builder(cls: type[Any]) -> Callable[..., Any]:
    """A positional constructor of the frozen, slotted dataclass ``cls`` for the hot path
    (one :class:`Outcome` and one :class:`WindowState` are built per decision:
    ``docs/benchmarks.md``): every field, in declaration order, no defaults.

    It fills an instance of a mutable twin of ``cls`` (the same slots, nothing else) with
    plain attribute stores, then gives it ``cls`` as its class: Python allows
    ``__class__`` assignment between classes whose slots are the same. A frozen class's
    ``__init__`` stores each field through a call instead. Kept because it moves a goal
    (STYLE.md, "Speed"): the memory backend's Python instructions per decision
    (``benchmarks/python_instructions.py``) are 136,093 with ``Outcome(...)`` and
    ``WindowState(...)`` against 112,752 with the builders (-17 %). The
    result is an ordinary instance of ``cls``: frozen, equal, hashed, copied and pickled
    like one built by ``cls(...)``. Raises ``TypeError`` for a class with a
    ``__post_init__`` (the builder would skip it) or a base class other than ``object``
    (its slots would not be the twin's).
    """
    if hasattr(cls, "__post_init__") or cls.__bases__ != (object,):
        raise TypeError(f"{cls.__name__} cannot have a slot-store builder")
    names = [item.name for item in dataclasses.fields(cls)]
    twin = type(f"{cls.__name__}Builder", (), {"__slots__": cls.__slots__})
    stores = "".join(f"    _self.{name} = {name}\n" for name in names)
    source = (
        f"def build({', '.join(names)}):\n"
        f"    _self = _new(_twin)\n{stores}"
        "    _self.__class__ = _cls\n"
        "    return _self\n"
    )
    namespace: dict[str, Any] = {
        "__name__": cls.__module__,
        "_new": object.__new__,
        "_twin": twin,
        "_cls": cls,
    }
    exec(source, namespace)
    build: Callable[..., Any] = namespace["build"]
    build.__qualname__ = build.__name__ = f"build_{cls.__name__}"
    return build


if TYPE_CHECKING:  # the builders' signatures, for the type checker

    def build_outcome(
        policy: str,
        decision: str,
        reason: str | None,
        window: str | None,
        limit: int | None,
        remaining: int | None,
        reset_after: float | None,
        retry_after: float | None,
        windows: tuple[WindowState, ...],
        certainty: str,
        backend_mode: str,
        evaluation_id: str,
        /,
    ) -> Outcome:
        """An :class:`Outcome`, every field given in order (:func:`_builder`)."""

    def build_window_state(
        name: str,
        limit: int,
        period: float,
        remaining: int,
        reset_after: float,
        retry_after: float | None,
        replenish_after: float,
        /,
    ) -> WindowState:
        """A :class:`WindowState`, every field given in order (:func:`_builder`)."""

else:
    build_outcome = _builder(Outcome)
    build_window_state = _builder(WindowState)


def outcome_from_result(
    policy: Policy, result: PolicyResult, backend_mode: str, evaluation_id: str
) -> Outcome:
    """Build the :class:`Outcome` of ``policy`` from a script or model result.

    Denied: the reported window is the denying one with the largest ``retry_after``
    (ties: longer period, then declaration order). Allowed: the one with the smallest
    ``remaining`` (ties: larger ``reset_after``, then declaration order).
    """
    token_bucket = policy.algorithm == "token_bucket"
    if len(policy.windows) == 1 and len(result.windows) == 1:  # the common shape, unrolled
        reported = _window_state(policy.windows[0], result.windows[0], token_bucket)
        return _outcome(policy, result.status, reported, (reported,), backend_mode, evaluation_id)
    windows = policy.windows
    numbers = result.windows
    states = tuple(
        _window_state(window, found, token_bucket)
        for window, found in zip(windows, numbers, strict=True)
    )
    return _outcome(
        policy,
        result.status,
        states[reported_index(windows, numbers, result.status == REFUSED)],
        states,
        backend_mode,
        evaluation_id,
    )


def reported_index(windows: Sequence[Window], numbers: Sequence[WindowResult], denied: bool) -> int:
    """The index of the window an outcome reports, among a policy's ``windows`` and
    their ``numbers``. Denied: the denying window (``retry_after_ms`` >= 0) with the
    largest ``retry_after_ms``, ties to the longer period, then the first declared.
    Allowed: the smallest ``remaining``, ties to the larger ``reset_after_ms``, then the
    first declared. One pass, no key tuples: this runs on every multi-window decision."""
    chosen = -1
    if denied:
        best_retry = best_period = 0
        for index, found in enumerate(numbers):
            retry = found.retry_after_ms
            if retry < 0:
                continue
            period = windows[index].period_ms
            if chosen < 0 or retry > best_retry or (retry == best_retry and period > best_period):
                chosen, best_retry, best_period = index, retry, period
        if chosen < 0:
            raise ValueError("a denied policy without a denying window")
        return chosen
    best_remaining = best_reset = 0
    for index, found in enumerate(numbers):
        remaining = found.remaining
        if (
            chosen < 0
            or remaining < best_remaining
            or (remaining == best_remaining and found.reset_after_ms > best_reset)
        ):
            chosen, best_remaining, best_reset = index, remaining, found.reset_after_ms
    if chosen < 0:
        raise ValueError("a policy result without windows")
    return chosen


def _window_state(window: Window, numbers: WindowResult, token_bucket: bool) -> WindowState:
    return build_window_state(
        window.name,
        window.capacity if token_bucket else window.limit,
        window.period_ms / 1000,
        numbers.remaining,
        numbers.reset_after_ms / 1000,
        None if numbers.retry_after_ms < 0 else numbers.retry_after_ms / 1000,
        numbers.replenish_after_ms / 1000,
    )


def _outcome(
    policy: Policy,
    status: int,
    reported: WindowState,
    states: tuple[WindowState, ...],
    backend_mode: str,
    evaluation_id: str,
) -> Outcome:
    if status == REFUSED:
        decision = SHADOW_DENIED if policy.shadow else DENIED_DECISION
        reason: str | None = reported.name + QUOTA_EXHAUSTED_SUFFIX
        retry_after = reported.retry_after
    else:
        decision, reason, retry_after = ALLOWED, None, None
    return build_outcome(
        policy.id,
        decision,
        reason,
        reported.name,
        reported.limit,
        reported.remaining,
        reported.reset_after,
        retry_after,
        states,
        policy.certainty,
        backend_mode,
        evaluation_id,
    )


def bare_outcome(
    policy: Policy,
    decision: str,
    reason: str | None,
    *,
    backend_mode: str,
    evaluation_id: str = "",
    retry_after: float | None = None,
) -> Outcome:
    """An outcome without an evaluation (identity errors, cost refusals, failures)."""
    return build_outcome(
        policy.id,
        decision,
        reason,
        None,
        None,
        None,
        None,
        retry_after,
        (),
        policy.certainty,
        backend_mode,
        evaluation_id,
    )
