"""The Python API: evaluate, peek and reset (and their async twins), HTTP-free.

Each call runs on the :class:`~django_quota.engine.Limiter` of the current settings
(:func:`get_limiter`): built on first use with the backend the settings name, dropped
(its connections closed) when a watched setting changes. :func:`evaluate_policies` and
:func:`aevaluate_policies` decide several policies as one layer; :func:`policy_unknown`
is the outcome of a policy named but not defined.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from django_quota import conf, metrics, policies
from django_quota.backends import Backend, backend_from_settings
from django_quota.backends.memory import MemoryBackend
from django_quota.core.breaker import BreakerError, CircuitBreaker
from django_quota.core.log import logger
from django_quota.core.outcome import (
    FAILED_CLOSED,
    FAILED_OPEN,
    POLICY_UNKNOWN,
    Outcome,
)
from django_quota.core.policy import CONCURRENCY, Policy
from django_quota.core.protocol import (
    ReleaseRequest,
    check_evaluation_id,
    counter_key,
    fingerprint,
)
from django_quota.core.refunds import RefundCall, RefundRequest
from django_quota.core.windows import calendar_place
from django_quota.engine import Clock, Limiter, Subject, SubjectSource
from django_quota.engine.prepared import Compiled, validate_cost
from django_quota.engine.short_path import ShortCall
from django_quota.messages import Codes


# -- the current limiter -------------------------------------------------------------------
class _CurrentLimiter:
    """The limiter of the current settings, if one was built since they last changed.

    One instance, ``_current``: :func:`get_limiter` reads ``limiter`` without the lock
    (a plain attribute load on every call); building and dropping take it.
    """

    __slots__ = ("limiter", "lock")

    def __init__(self) -> None:
        self.limiter: Limiter | None = None
        self.lock = threading.Lock()

    def build(self) -> Limiter:
        """Build the limiter of the current settings unless another thread just did."""
        with self.lock:
            if self.limiter is None:
                settings = conf.get_settings()
                self.limiter = Limiter(settings, backend_from_settings(settings))
            return self.limiter

    def drop(self) -> None:
        """Forget the limiter and close its connections."""
        with self.lock:
            found, self.limiter = self.limiter, None
        if found is not None:
            found.close()


_current = _CurrentLimiter()


def get_limiter() -> Limiter:
    """The limiter of the current settings, built on first use."""
    found = _current.limiter
    if found is None:
        found = _current.build()
    return found


def get_backend() -> Backend:
    """The current backend."""
    return get_limiter().backend


def get_fallback() -> MemoryBackend | None:
    """The local fallback, when ``LOCAL_FALLBACK["ENABLED"]``."""
    return get_limiter().fallback


def get_breaker(node: str = "default") -> CircuitBreaker:
    """The circuit breaker of ``node`` (a standalone Redis is the one node ``default``;
    a cluster primary is named ``host:port``)."""
    return get_limiter().guard(node).breaker


def recent_errors() -> list[BreakerError]:
    """The current limiter's recent backend failures, of every kind, newest last."""
    return list(get_limiter().recent_errors)


def settings_changed() -> None:
    """Drop the current limiter and close its connections: the next call builds one from
    the new settings, with nothing remembered (connected in ``AppConfig.ready()``)."""
    _current.drop()


# -- policies named but not defined ---------------------------------------------------------
def policy_unknown(
    policy_id: str,
    failure_mode: str | None = None,
    *,
    cause: str | None = None,
) -> Outcome:
    """The outcome of ``policy_id`` when a view, throttle or decorator names it but no
    source defines it: the failure mode (``failure_mode``, else ``FAILURE_MODE``) with
    reason ``policy_unknown``, never an exception. Counted in the metrics; logged as an
    error once per policy id and process (``cause`` completes that line).
    """
    settings = conf.get_settings()
    mode = failure_mode or settings.failure_mode
    current = get_limiter()
    if policy_id not in current.unknown_logged:
        current.unknown_logged.add(policy_id)
        logger.error(
            "quota policy %r %s; its failure mode (%s) applies with reason policy_unknown",
            policy_id,
            cause or f"is named but not defined ({Codes.E_UNKNOWN_VIEW_POLICY})",
            mode,
        )
    backend_mode = current.backend_mode
    if mode == "open":
        outcome = Outcome(policy_id, FAILED_OPEN, POLICY_UNKNOWN, backend_mode=backend_mode)
    else:
        retry_after = float(settings.failure_retry_after)
        outcome = Outcome(
            policy_id,
            FAILED_CLOSED,
            POLICY_UNKNOWN,
            retry_after=retry_after,
            backend_mode=backend_mode,
        )
    metrics.record_outcomes((), [outcome])
    return outcome


# -- public API ----------------------------------------------------------------------------
def evaluate_policies(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int = 1,
    *,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
    plan: str | None = None,
) -> list[Outcome]:
    """Decide several policies together, as one layer (``docs/arithmetic.md``): one
    backend call (one per hash slot on a Redis Cluster) that charges ``cost`` units only
    when every enforced policy admits the request (a shadow policy is charged when it
    admits, and never refuses).

    ``group`` holds :class:`~django_quota.core.policy.Policy` objects (from
    :func:`~django_quota.policies.get_policy`). ``subject`` is a mapping of dimensions to
    raw identities, as for :func:`evaluate`, or a callable that takes a policy and
    returns its subject. ``clock``, a callable returning the time in epoch seconds,
    decides on that clock instead of ``QUOTA["CLOCK"]``. ``evaluation_id`` and ``plan``
    are as for :func:`evaluate`.

    Returns the outcomes in ``group`` order. When an enforced policy is refused before
    the backend (an identity error, ``cost_exceeds_limit``), nothing is charged and the
    policies that would have been sent get no outcome, so the list can be shorter than
    ``group``. Never raises for backend trouble; raises ``TypeError`` or ``ValueError``
    for a bad ``cost`` or ``evaluation_id``, as :func:`evaluate` does.
    """
    limiter = get_limiter()
    return limiter.run(
        limiter.prepare(group, subject, cost, evaluation_id=evaluation_id, clock=clock, plan=plan)
    )


async def aevaluate_policies(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int = 1,
    *,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
    plan: str | None = None,
) -> list[Outcome]:
    """Async twin of :func:`evaluate_policies`."""
    limiter = get_limiter()
    return await limiter.arun(
        limiter.prepare(group, subject, cost, evaluation_id=evaluation_id, clock=clock, plan=plan)
    )


def evaluate(
    policy_id: str,
    subject: Subject,
    cost: int = 1,
    evaluation_id: str | None = None,
    plan: str | None = None,
) -> Outcome:
    """Decide one request of ``cost`` units for ``subject`` under ``policy_id``, and
    charge it when the policy admits it.

    ``subject`` maps dimensions to raw identities (``{"user": "42"}``,
    ``{"ip": "203.0.113.9"}``), normalised as the middleware normalises them; a missing
    or invalid identity is an outcome (``selector_identity_missing``,
    ``selector_identity_invalid``), not an exception. ``cost`` is an ``int >= 0`` in units
    of the policy's limit; 0 decides without charging, as :func:`peek`.
    ``evaluation_id`` (printable, 1 to 128 characters), when given, makes a repeat of a
    charged evaluation charge nothing (``docs/failures.md``). ``plan``, when the policy
    has a plan of that name, decides with that plan's limits on the policy's one
    counter; None or another name, with the policy's own windows (``docs/plans.md``).

    Returns the policy's :class:`~django_quota.core.outcome.Outcome`. Never raises for
    backend trouble: failures come back as outcomes. Raises
    :class:`~django_quota.policies.UnknownPolicy` when no source defines ``policy_id``;
    ``TypeError`` or ``ValueError`` for a bad ``cost`` or ``evaluation_id``;
    ``TypeError`` for an identity value that is not ``str``, ``int`` or ``uuid.UUID``, and
    for a ``plan`` that is neither a ``str`` nor None.
    """
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    short = limiter.shortcut(policy, subject, cost, evaluation_id, plan)
    if short is not None:  # the common call (docs/architecture.md, "One decision")
        return limiter.run_short(short) if isinstance(short, ShortCall) else short
    prepared = limiter.prepare([policy], subject, cost, evaluation_id=evaluation_id, plan=plan)
    return limiter.run(prepared)[0]


async def aevaluate(
    policy_id: str,
    subject: Subject,
    cost: int = 1,
    evaluation_id: str | None = None,
    plan: str | None = None,
) -> Outcome:
    """Async twin of :func:`evaluate`."""
    if policies.needs_refresh():  # else no coroutine to await (docs/benchmarks.md)
        await policies.aget_registry()
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    short = limiter.shortcut(policy, subject, cost, evaluation_id, plan)
    if short is not None:  # the common call (docs/architecture.md, "One decision")
        return await limiter.arun_short(short) if isinstance(short, ShortCall) else short
    prepared = limiter.prepare([policy], subject, cost, evaluation_id=evaluation_id, plan=plan)
    return (await limiter.arun(prepared))[0]


def peek(policy_id: str, subject: Subject, plan: str | None = None) -> Outcome:
    """What ``evaluate(cost=1)`` would decide now, ``remaining`` before consumption
    (under ``plan``'s limits, as for :func:`evaluate`).

    Writes nothing: no key, no TTL, no evaluation-id ledger entry. Raises as
    :func:`evaluate` does (:class:`~django_quota.policies.UnknownPolicy`, ``TypeError``
    for an identity value of another type); backend failures are outcomes.
    """
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    return limiter.run(limiter.prepare([policy], subject, 1, peek=True, plan=plan))[0]


async def apeek(policy_id: str, subject: Subject, plan: str | None = None) -> Outcome:
    """Async twin of :func:`peek`."""
    await policies.aget_registry()
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    prepared = limiter.prepare([policy], subject, 1, peek=True, plan=plan)
    return (await limiter.arun(prepared))[0]


def _reset_target(policy_id: str, subject: Subject) -> tuple[str, int]:
    policy = policies.get_policy(policy_id)
    identity = get_limiter().identity_for(policy, subject, "reset")
    return counter_key(conf.get_settings().key_prefix, policy, identity), len(policy.windows)


def _reset_fallback(counter: str, window_count: int) -> int:
    fallback = get_fallback()
    return fallback.reset(counter, window_count) if fallback is not None else 0


def reset(policy_id: str, subject: Subject) -> int:
    """Delete every window of ``subject``'s counter for the policy's current revision, in
    the backend and in this process's fallback, and forget this process's remembered
    refusals of every group holding it (the denial cache, ``docs/failures.md``); return
    how many windows had state (an ``int``, 0 when there was none).

    Raises :class:`~django_quota.policies.UnknownPolicy` when no source defines
    ``policy_id``, ``ValueError`` for a missing or invalid identity, and
    :class:`~django_quota.core.errors.BackendError` when the backend fails (unlike
    :func:`evaluate`, a reset has no failure mode to fall back on).
    """
    counter, window_count = _reset_target(policy_id, subject)
    try:
        cleared = get_backend().reset(counter, window_count)
    finally:  # the counter may be gone even when the reply was lost
        get_limiter().forget_denials((counter,))
    return max(cleared, _reset_fallback(counter, window_count))


async def areset(policy_id: str, subject: Subject) -> int:
    """Async twin of :func:`reset`."""
    await policies.aget_registry()
    counter, window_count = _reset_target(policy_id, subject)
    local = _reset_fallback(counter, window_count)
    try:
        cleared = await get_backend().areset(counter, window_count)
    finally:  # the counter may be gone even when the reply was lost
        get_limiter().forget_denials((counter,))
    return max(cleared, local)


__all__ = [
    "Clock",
    "Subject",
    "SubjectSource",
    "aevaluate",
    "aevaluate_policies",
    "apeek",
    "arefund",
    "arelease",
    "areset",
    "evaluate",
    "evaluate_policies",
    "get_backend",
    "get_breaker",
    "get_fallback",
    "get_limiter",
    "peek",
    "policy_unknown",
    "recent_errors",
    "refund",
    "release",
    "reset",
]


# -- concurrency leases (docs/concurrency.md) ------------------------------------------------
def _release_request(policy_id: str, subject: Subject, evaluation_id: str) -> ReleaseRequest | None:
    """What releases the leases ``evaluation_id`` acquired from ``subject``'s counter of
    ``policy_id``; None when the policy is not a concurrency policy (nothing to free)."""
    check_evaluation_id(evaluation_id)
    return lease_request(policies.get_policy(policy_id), subject, evaluation_id)


def lease_request(policy: Policy, subject: Subject, evaluation_id: str) -> ReleaseRequest | None:
    """:func:`_release_request` for a policy object (the edges hold theirs, generated
    ones included)."""
    if policy.algorithm != CONCURRENCY:
        return None
    limiter = get_limiter()
    identity = limiter.identity_for(policy, subject, "release")
    counter = counter_key(conf.get_settings().key_prefix, policy, identity)
    return ReleaseRequest(
        counter, fingerprint(evaluation_id), limiter.now(None), limiter.cleanup_grace_ms
    )


def _release_fallback(request: ReleaseRequest) -> int:
    fallback = get_fallback()
    return fallback.release(request) if fallback is not None else 0


def release(policy_id: str, subject: Subject, evaluation_id: str) -> int:
    """Free the units the evaluation ``evaluation_id`` of ``policy_id`` acquired for
    ``subject`` (a concurrency policy's lease); return how many (0 when none is held:
    released already, expired after its period, never acquired, or lost in a failover).
    Releasing twice releases once. A policy of another algorithm holds nothing: 0.

    Raises as :func:`reset` does (:class:`~django_quota.policies.UnknownPolicy`,
    ``ValueError`` for a missing or invalid identity or evaluation id,
    :class:`~django_quota.core.errors.BackendError` when the backend fails: the lease
    then frees itself after the policy's period).
    """
    return release_leases(_release_request(policy_id, subject, evaluation_id))


def release_leases(request: ReleaseRequest | None) -> int:
    """Run ``request`` (None: nothing held) in this process's fallback, then in the
    backend; the units released."""
    if request is None:
        return 0
    local = _release_fallback(request)
    try:
        return local + get_backend().release(request)
    finally:  # a refusal this process remembers for the counter is stale now
        get_limiter().forget_denials((request.counter,))


async def arelease(policy_id: str, subject: Subject, evaluation_id: str) -> int:
    """Async twin of :func:`release`."""
    await policies.aget_registry()
    return await arelease_leases(_release_request(policy_id, subject, evaluation_id))


async def arelease_leases(request: ReleaseRequest | None) -> int:
    """Async twin of :func:`release_leases`."""
    if request is None:
        return 0
    local = _release_fallback(request)
    try:
        return local + await get_backend().arelease(request)
    finally:
        get_limiter().forget_denials((request.counter,))


# -- refunds (docs/refunds.md) ---------------------------------------------------------------
def refund_request(
    policy: Policy,
    subject: Subject,
    evaluation_id: str,
    cost: int | None = None,
    plan: str | None = None,
    since_ms: int | None = None,
) -> RefundRequest | ReleaseRequest | None:
    """What undoes the charge of ``evaluation_id`` on ``subject``'s counter of
    ``policy``: a :class:`~django_quota.core.refunds.RefundRequest`, or for a concurrency
    policy the release of its lease; None when nothing is to be given back (``cost``
    0). ``cost``: at most that many units (None: what the evaluation charged, as its
    counter's ledger says). ``since_ms``: the ms since the charge, as an edge measured
    them, for a charge the bounded ledger dropped (``cost`` units then; ``docs/refunds.md``,
    "At the edges")."""
    check_evaluation_id(evaluation_id)
    if cost is not None:
        cost = validate_cost(cost)
    if policy.algorithm == CONCURRENCY:
        return lease_request(policy, subject, evaluation_id)
    limiter = get_limiter()
    identity = limiter.identity_for(policy, subject, "refund")
    compiled = limiter.compiled(policy)
    if plan is not None and policy.plans:
        compiled = compiled.for_plan(plan)
    counter = compiled.counter(conf.get_settings().key_prefix, identity)
    return counter_undo(compiled, counter, evaluation_id, cost, since_ms)


def counter_undo(
    compiled: Compiled,
    counter: str,
    evaluation_id: str,
    cost: int | None,
    since_ms: int | None,
) -> RefundRequest | ReleaseRequest | None:
    """What undoes the charge of ``evaluation_id`` on the counter ``counter`` of
    ``compiled``'s policy (its plan's limits, if any), as :func:`refund_request` says,
    from the counter itself (the edges keep the counter their evaluation charged): a
    refund of at most ``cost`` units (None: what the evaluation charged), or a
    concurrency policy's release; None when nothing is to be given back (``cost`` 0)."""
    limiter = get_limiter()
    if compiled.policy.algorithm != CONCURRENCY:
        if cost == 0:
            return None
        if cost is None or (cost > compiled.cost_bound and since_ms is None):
            cost = 0  # all the charge: none was above the bound
        now_ms = limiter.now(None)
        call = _refund_call(compiled, cost, now_ms)
        return RefundRequest((counter,), (call,), fingerprint(evaluation_id), now_ms, since_ms)
    return ReleaseRequest(
        counter, fingerprint(evaluation_id), limiter.now(None), limiter.cleanup_grace_ms
    )


def _refund_call(compiled: Compiled, cost: int, now_ms: int | None) -> RefundCall:
    """A refund of ``cost`` units (0: all the charge) on ``compiled``'s windows: their
    periods and limits, and the places of calendar windows around the client's now
    (``now_ms``, or this machine's clock when the counters follow Redis ``TIME``)."""
    windows = compiled.policy.windows
    places: tuple[int, ...] = ()
    if compiled.calendar:
        client_now = round(time.time() * 1000) if now_ms is None else now_ms
        call = compiled.call(cost or 1)
        bounds = compiled.calendar_call(call, client_now).bounds
        for index, window in enumerate(windows):
            places += calendar_place(bounds, index, client_now, window.period_ms)
    return RefundCall(
        compiled.policy.algorithm,
        tuple(window.period_ms for window in windows),
        tuple(window.limit for window in windows),
        cost,
        places,
    )


def refund(
    policy_id: str,
    subject: Subject,
    evaluation_id: str,
    *,
    cost: int | None = None,
    plan: str | None = None,
) -> int:
    """Undo what the evaluation ``evaluation_id`` of ``policy_id`` charged ``subject``,
    at most once, while its window is current; return the units refunded (0 afterwards,
    or when it charged nothing, or was refunded already).

    The units are what that evaluation charged: its counter's ledger records the cost
    of each charge. ``cost`` gives back at most that many of them (a partial refund: the
    rest stays, and the evaluation is refunded all the same); ``plan`` is the plan it
    was decided under (a token bucket's). Each algorithm gives the units back as
    ``docs/refunds.md`` says (the sliding log's event leaves the log; a sliding window
    counter's current count drops, and nothing once that window has passed). A
    concurrency policy's lease is released, as :func:`release` does.

    Raises as :func:`release` does (:class:`~django_quota.policies.UnknownPolicy`,
    ``ValueError`` for a missing or invalid identity or evaluation id, ``TypeError`` or
    ``ValueError`` for a bad ``cost``, :class:`~django_quota.core.errors.BackendError`
    when the backend fails: the charge then stays).
    """
    policy = policies.get_policy(policy_id)
    return refund_charge(refund_request(policy, subject, evaluation_id, cost, plan))


def refund_charge(request: RefundRequest | ReleaseRequest | None) -> int:
    """Run ``request`` (None: nothing to refund) in this process's fallback, then in the
    backend; the units refunded."""
    if request is None:
        return 0
    if isinstance(request, ReleaseRequest):
        return release_leases(request)
    fallback = get_fallback()
    local = fallback.refund(request) if fallback is not None else 0
    try:
        return local + get_backend().refund(request)
    finally:  # a refusal this process remembers for the counter is stale now
        get_limiter().forget_denials(request.counters)


async def arefund(
    policy_id: str,
    subject: Subject,
    evaluation_id: str,
    *,
    cost: int | None = None,
    plan: str | None = None,
) -> int:
    """Async twin of :func:`refund`."""
    await policies.aget_registry()
    policy = policies.get_policy(policy_id)
    return await arefund_charge(refund_request(policy, subject, evaluation_id, cost, plan))


async def arefund_charge(request: RefundRequest | ReleaseRequest | None) -> int:
    """Async twin of :func:`refund_charge`."""
    if request is None:
        return 0
    if isinstance(request, ReleaseRequest):
        return await arelease_leases(request)
    fallback = get_fallback()
    local = fallback.refund(request) if fallback is not None else 0
    try:
        return local + await get_backend().arefund(request)
    finally:
        get_limiter().forget_denials(request.counters)
