"""The Python API: evaluate, peek and reset (and their async twins), HTTP-free.

Every call is a pure *prepare* (identities, costs, keys, script arguments), one backend
call, and a pure *interpret* (outcomes, failure modes, fallback), so the sync and async
paths differ by one ``await``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.utils.module_loading import import_string

from django_quota import conf, metrics, policies
from django_quota.backends import Backend
from django_quota.backends.memory import MemoryBackend
from django_quota.core.breaker import CircuitBreaker
from django_quota.core.errors import BackendError
from django_quota.core.identity import Identity, IdentityError, build_identity
from django_quota.core.model import PolicyCall
from django_quota.core.outcome import (
    BACKEND_MODE_FALLBACK,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    CLOCK_UNSAFE,
    COST_EXCEEDS_LIMIT,
    DENIED_DECISION,
    FAILED_CLOSED,
    FAILED_OPEN,
    INDETERMINATE,
    SELECTOR_IDENTITY_MISSING,
    SHADOW_DENIED,
    SKIPPED,
    Outcome,
    bare_outcome,
    outcome_from_result,
)
from django_quota.core.policy import TOKEN_BUCKET, Policy
from django_quota.core.protocol import (
    GroupReply,
    GroupRequest,
    counter_key,
    evaluation_key,
)

logger = logging.getLogger("django_quota")

Subject = Mapping[str, object]
#: A subject, or a function giving each policy its subject (the HTTP layer's, so that
#: ``auto`` and an explicit ``api_key`` read different sources).
SubjectSource = Subject | Callable[[Policy], Subject]
Clock = Callable[[], float]
FALLBACK_REASONS = frozenset({BACKEND_TIMEOUT, BACKEND_UNAVAILABLE})


# -- backends ----------------------------------------------------------------------------
_backend_lock = threading.Lock()
_backend: Backend | None = None
_fallback: MemoryBackend | None = None
_breaker: CircuitBreaker | None = None
_inflight = 0
_inflight_lock = threading.Lock()
#: Consecutive failures that open the circuit breaker.
BREAKER_THRESHOLD = 5
#: Failures that count for the breaker: the backend could not be reached or did not answer.
BREAKER_REASONS = frozenset({BACKEND_TIMEOUT, BACKEND_UNAVAILABLE, INDETERMINATE})


def _build_backend(settings: conf.QuotaSettings) -> Backend:
    if settings.backend == "memory":
        return MemoryBackend(settings.memory_max_entries)
    from django_quota.backends.redis import RedisBackend

    url = settings.redis_url
    url_options: dict[str, object] = {}
    if settings.cache_alias is not None:
        url, url_options = _cache_connection(settings.cache_alias)
    if settings.cluster and url is not None:
        from django_quota.backends.cluster import RedisClusterBackend

        return RedisClusterBackend(
            url=url,
            timeout=settings.timeout,
            max_inflight=settings.max_inflight,
            url_options=url_options,
        )
    return RedisBackend(
        url=url,
        timeout=settings.timeout,
        max_inflight=settings.max_inflight,
        sentinel=settings.sentinel,
        url_options=url_options,
    )


def _cache_connection(alias: str) -> tuple[str, dict[str, object]]:
    """URL and credentials of a django-redis cache (our own pool is opened with them)."""
    from django.conf import settings as django_settings

    cache = django_settings.CACHES[alias]
    location = cache["LOCATION"]
    url = location[0] if isinstance(location, list | tuple) else str(location).split(",")[0]
    options = cache.get("OPTIONS", {})
    extra: dict[str, object] = {}
    if options.get("PASSWORD"):
        extra["password"] = options["PASSWORD"]
    return url, extra


def get_backend() -> Backend:
    """The process's backend, built from settings on first use."""
    global _backend
    backend = _backend
    if backend is None:
        with _backend_lock:
            if _backend is None:
                _backend = _build_backend(conf.get_settings())
            backend = _backend
    return backend


def get_fallback() -> MemoryBackend | None:
    """The local fallback, when ``LOCAL_FALLBACK["ENABLED"]``."""
    global _fallback
    settings = conf.get_settings()
    if not settings.local_fallback_enabled:
        return None
    if _fallback is None:
        with _backend_lock:
            if _fallback is None:
                _fallback = MemoryBackend(
                    settings.local_fallback_max_entries, mode=BACKEND_MODE_FALLBACK
                )
    return _fallback


def _drop_backends() -> None:
    global _backend, _fallback, _breaker
    with _backend_lock:
        backend, _backend, _fallback, _breaker = _backend, None, None, None
    if backend is not None:
        backend.close()


conf.on_change(_drop_backends)


# -- prepare -------------------------------------------------------------------------------
def identity_of(policy: Policy, subject: Subject) -> Identity:
    """``subject``'s identity for ``policy``'s selector, with the current HMAC settings
    (raises :class:`~django_quota.core.identity.IdentityError`)."""
    settings = conf.get_settings()
    return build_identity(
        policy.selector,
        subject,
        hmac_key=settings.hmac_key,
        hmac_key_version=settings.hmac_key_version,
        ipv6_prefix=settings.ipv6_prefix,
    )


def _identity_or_value_error(policy: Policy, subject: Subject, action: str) -> Identity:
    try:
        return identity_of(policy, subject)
    except IdentityError as exc:
        raise ValueError(f"cannot {action} {policy.id!r}: {exc.reason} ({exc.dimension})") from exc


def _validate_cost(cost: object) -> int:
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise TypeError(f"cost must be an int, not {type(cost).__name__}")
    if cost < 0:
        raise ValueError(f"cost must be >= 0, not {cost}")
    return cost


def _exceeds(policy: Policy, cost: int) -> bool:
    if policy.max_cost is not None and cost > policy.max_cost:
        return True
    for window in policy.windows:
        bound = window.capacity if policy.algorithm == TOKEN_BUCKET else window.limit
        if cost > bound:
            return True
    return False


def new_evaluation_id() -> str:
    """A fresh 128-bit random evaluation id (22 base64url characters)."""
    return secrets.token_urlsafe(16)


@dataclass(slots=True)
class Prepared:
    """A group ready for one backend call: early outcomes and the request, if any."""

    policies: tuple[Policy, ...]
    outcomes: list[Outcome | None]
    request: GroupRequest | None
    sent: list[int] = field(default_factory=list)
    evaluation_id: str = ""
    started: float = 0.0
    peek: bool = False


def _now(settings: conf.QuotaSettings, clock: Clock | None) -> tuple[int | None, int]:
    """The ``now`` to pass (None: backend clock) and the allowed regression (ms, -1: none)."""
    if clock is None and settings.clock == "redis":
        return None, -1
    if clock is None:
        clock = time.time if settings.clock == "client" else import_string(settings.clock)
    assert clock is not None
    return round(float(clock()) * 1000), round(settings.max_clock_regression * 1000)


def prepare(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int,
    *,
    peek: bool = False,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
) -> Prepared:
    """Resolve identities and costs; build the one backend request for what remains.

    An enforced policy refused before the backend (identity error, cost above its
    limit) refuses the group: nothing is sent and the other policies get no outcome.
    """
    settings = conf.get_settings()
    cost = _validate_cost(cost)
    if cost == 0:
        peek = True
    evaluation_id = evaluation_id or new_evaluation_id()
    backend_mode = get_backend().mode
    outcomes: list[Outcome | None] = []
    counters: list[str] = []
    calls: list[PolicyCall] = []
    sent: list[int] = []
    refused = False
    for index, policy in enumerate(group):
        if not policy.enabled:
            outcomes.append(bare_outcome(policy, SKIPPED, None, backend_mode=backend_mode))
            continue
        denied = SHADOW_DENIED if policy.shadow else DENIED_DECISION
        try:
            identity = identity_of(policy, subject(policy) if callable(subject) else subject)
        except IdentityError as exc:
            if exc.reason == SELECTOR_IDENTITY_MISSING and policy.on_missing == "skip":
                decision = SKIPPED
            else:
                decision = denied
            refused = refused or decision == DENIED_DECISION
            outcomes.append(bare_outcome(policy, decision, exc.reason, backend_mode=backend_mode))
            continue
        if not peek and _exceeds(policy, cost):
            refused = refused or not policy.shadow
            outcomes.append(
                bare_outcome(policy, denied, COST_EXCEEDS_LIMIT, backend_mode=backend_mode)
            )
            continue
        outcomes.append(None)
        sent.append(index)
        counters.append(counter_key(settings.key_prefix, policy, identity))
        calls.append(PolicyCall(policy.algorithm, policy.windows, cost, not policy.shadow))
    request = None
    if sent and not refused:
        now_ms, max_regression_ms = _now(settings, clock)
        request = GroupRequest(
            counters=tuple(counters),
            evaluation_keys=tuple(evaluation_key(counter, evaluation_id) for counter in counters),
            calls=tuple(calls),
            now_ms=now_ms,
            peek=peek,
            max_regression_ms=max_regression_ms,
            dedup_ttl_ms=round(settings.dedup_ttl * 1000),
            cleanup_grace_ms=round(settings.cleanup_grace * 1000),
        )
    elif refused:
        sent = []
    return Prepared(
        tuple(group), outcomes, request, sent, evaluation_id, time.monotonic(), peek
    )


# -- interpret ---------------------------------------------------------------------------
def _failed(prepared: Prepared, reason: str, backend_mode: str) -> list[Outcome]:
    settings = conf.get_settings()
    logger.warning(
        "quota backend failure: reason=%s policies=%s",
        reason,
        ",".join(prepared.policies[i].id for i in prepared.sent),
    )
    for index in prepared.sent:
        policy = prepared.policies[index]
        if policy.shadow or settings.failure_mode_of(policy) == "open":
            outcome = bare_outcome(
                policy,
                FAILED_OPEN,
                reason,
                backend_mode=backend_mode,
                evaluation_id=prepared.evaluation_id,
            )
        else:
            outcome = bare_outcome(
                policy,
                FAILED_CLOSED,
                reason,
                backend_mode=backend_mode,
                evaluation_id=prepared.evaluation_id,
                retry_after=float(settings.failure_retry_after),
            )
        prepared.outcomes[index] = outcome
    return _finish(prepared)


def _finish(prepared: Prepared) -> list[Outcome]:
    return [outcome for outcome in prepared.outcomes if outcome is not None]


def interpret(prepared: Prepared, reply: GroupReply, backend_mode: str) -> list[Outcome]:
    """Turn a backend reply into outcomes (failure modes applied for ``clock_unsafe``)."""
    if reply.clock_unsafe:
        return _failed(prepared, CLOCK_UNSAFE, backend_mode)
    for index, result in zip(prepared.sent, reply.results, strict=True):
        prepared.outcomes[index] = outcome_from_result(
            prepared.policies[index],
            result,
            backend_mode=backend_mode,
            evaluation_id=prepared.evaluation_id,
        )
    return _finish(prepared)


def _acquire_slot(settings: conf.QuotaSettings) -> bool:
    global _inflight
    with _inflight_lock:
        if _inflight >= settings.max_inflight:
            return False
        _inflight += 1
        return True


def _release_slot() -> None:
    global _inflight
    with _inflight_lock:
        _inflight -= 1


def get_breaker() -> CircuitBreaker:
    """The process's circuit breaker (cool-down: ``FAILURE_RETRY_AFTER`` seconds)."""
    global _breaker
    if _breaker is None:
        with _backend_lock:
            if _breaker is None:
                settings = conf.get_settings()
                _breaker = CircuitBreaker(BREAKER_THRESHOLD, settings.failure_retry_after)
    return _breaker


def _enter(prepared: Prepared) -> list[Outcome] | None:
    """Admission before the I/O: outcomes when the backend must not be called now."""
    if not _acquire_slot(conf.get_settings()):
        return _degraded(prepared, BackendError(BACKEND_UNAVAILABLE, "MAX_INFLIGHT reached"))
    if not get_breaker().allow():
        _release_slot()
        return _degraded(prepared, BackendError(BACKEND_UNAVAILABLE, "circuit breaker open"))
    return None


def _retry_allowed(prepared: Prepared, error: BackendError, attempt: int) -> bool:
    """One retry, same evaluation id, for ``indeterminate``, when the rest of DEADLINE
    covers a TIMEOUT."""
    settings = conf.get_settings()
    if error.reason != INDETERMINATE or attempt > 0:
        return False
    elapsed = time.monotonic() - prepared.started
    return elapsed + settings.timeout <= settings.deadline


def _verdict(error: BackendError, attempt: int) -> BackendError:
    """The failure of the whole evaluation. A retry only follows an ``indeterminate``
    attempt, which may have consumed: whatever stops the retry (a connect timeout, a
    refusal, an error reply) cannot undo that, so the evaluation stays ``indeterminate``
    (never ``backend_timeout``/``backend_unavailable``, which claim nothing was consumed
    and would let the local fallback decide it)."""
    if attempt == 0 or error.reason == INDETERMINATE:
        return error
    return BackendError(INDETERMINATE, f"retry of an indeterminate call failed: {error}")


def _succeeded(prepared: Prepared, reply: GroupReply, backend_mode: str) -> list[Outcome]:
    metrics.record_backend(backend_mode, metrics.OK, time.monotonic() - prepared.started)
    _log_transition(get_breaker().success())
    return interpret(prepared, reply, backend_mode)


def _failed_call(prepared: Prepared, error: BackendError) -> list[Outcome]:
    metrics.record_backend(get_backend().mode, error.reason, time.monotonic() - prepared.started)
    breaker = get_breaker()
    if error.reason in BREAKER_REASONS:
        _log_transition(breaker.failure(error.reason, str(error)))
    else:
        _log_transition(breaker.success())  # Redis answered: it is reachable
    return _degraded(prepared, error)


def _log_transition(state: str | None) -> None:
    if state is not None:
        logger.warning("quota circuit breaker %s", state)


def _observed(prepared: Prepared, outcomes: list[Outcome]) -> list[Outcome]:
    if not prepared.peek:
        metrics.record_outcomes(prepared.policies, outcomes)
    return outcomes


def run(prepared: Prepared) -> list[Outcome]:
    """Send a prepared group to the backend (one call; one retry for ``indeterminate``)."""
    return _observed(prepared, _run(prepared))


async def arun(prepared: Prepared) -> list[Outcome]:
    """Async twin of :func:`run`."""
    return _observed(prepared, await _arun(prepared))


def _run(prepared: Prepared) -> list[Outcome]:
    request = prepared.request
    if request is None:
        return _finish(prepared)
    refused = _enter(prepared)
    if refused is not None:
        return refused
    backend = get_backend()
    try:
        for attempt in range(2):
            try:
                return _succeeded(prepared, backend.evaluate(request), backend.mode)
            except BackendError as error:
                if not _retry_allowed(prepared, error, attempt):
                    return _failed_call(prepared, _verdict(error, attempt))
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        _release_slot()


async def _arun(prepared: Prepared) -> list[Outcome]:
    request = prepared.request
    if request is None:
        return _finish(prepared)
    refused = _enter(prepared)
    if refused is not None:
        return refused
    backend = get_backend()
    try:
        for attempt in range(2):
            try:
                return _succeeded(prepared, await backend.aevaluate(request), backend.mode)
            except BackendError as error:
                if not _retry_allowed(prepared, error, attempt):
                    return _failed_call(prepared, _verdict(error, attempt))
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        _release_slot()


def _degraded(prepared: Prepared, error: BackendError) -> list[Outcome]:
    """Decide with the local fallback when allowed, else apply the failure modes."""
    backend_mode = get_backend().mode
    fallback = get_fallback()
    if fallback is not None and error.reason in FALLBACK_REASONS and prepared.request:
        logger.warning("quota backend failure, deciding locally: reason=%s", error.reason)
        try:
            reply = fallback.evaluate(prepared.request)
        except BackendError as fallback_error:
            return _failed(prepared, fallback_error.reason, BACKEND_MODE_FALLBACK)
        return interpret(prepared, reply, BACKEND_MODE_FALLBACK)
    return _failed(prepared, error.reason, backend_mode)


# -- public API ----------------------------------------------------------------------------
def evaluate_policies(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int = 1,
    *,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
) -> list[Outcome]:
    """Decide several policies together (one layer, contract 5.4): one backend call."""
    return run(prepare(group, subject, cost, evaluation_id=evaluation_id, clock=clock))


async def aevaluate_policies(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int = 1,
    *,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
) -> list[Outcome]:
    """Async twin of :func:`evaluate_policies`."""
    return await arun(prepare(group, subject, cost, evaluation_id=evaluation_id, clock=clock))


def evaluate(
    policy_id: str, subject: Subject, cost: int = 1, evaluation_id: str | None = None
) -> Outcome:
    """Decide one request of ``cost`` units for ``subject`` under ``policy_id``.

    ``subject`` maps dimensions to raw identities (``{"user": "42"}``,
    ``{"ip": "203.0.113.9"}``), normalised as the middleware normalises them. Never
    raises for backend trouble: failures come back as outcomes. Raises
    :class:`~django_quota.policies.UnknownPolicy`, ``TypeError`` or ``ValueError`` for a
    bad cost.
    """
    return evaluate_policies(
        [policies.get_policy(policy_id)], subject, cost, evaluation_id=evaluation_id
    )[0]


async def aevaluate(
    policy_id: str, subject: Subject, cost: int = 1, evaluation_id: str | None = None
) -> Outcome:
    """Async twin of :func:`evaluate`."""
    await policies.aget_registry()
    outcomes = await aevaluate_policies(
        [policies.get_policy(policy_id)], subject, cost, evaluation_id=evaluation_id
    )
    return outcomes[0]


def peek(policy_id: str, subject: Subject) -> Outcome:
    """What ``evaluate(cost=1)`` would decide now, ``remaining`` before consumption.

    Writes nothing: no key, no TTL, no evaluation-id record.
    """
    policy = policies.get_policy(policy_id)
    return run(prepare([policy], subject, 1, peek=True))[0]


async def apeek(policy_id: str, subject: Subject) -> Outcome:
    """Async twin of :func:`peek`."""
    await policies.aget_registry()
    policy = policies.get_policy(policy_id)
    return (await arun(prepare([policy], subject, 1, peek=True)))[0]


def _reset_target(policy_id: str, subject: Subject) -> tuple[str, int]:
    policy = policies.get_policy(policy_id)
    identity = _identity_or_value_error(policy, subject, "reset")
    return counter_key(conf.get_settings().key_prefix, policy, identity), len(policy.windows)


def _reset_fallback(counter: str, window_count: int) -> int:
    fallback = get_fallback()
    return fallback.reset(counter, window_count) if fallback is not None else 0


def reset(policy_id: str, subject: Subject) -> int:
    """Delete every window of ``subject``'s counter for the policy's current revision, in
    the backend and in this process's fallback; return how many windows had state.

    Raises ``ValueError`` for a missing or invalid identity and
    :class:`~django_quota.core.errors.BackendError` when the backend fails.
    """
    counter, window_count = _reset_target(policy_id, subject)
    return max(get_backend().reset(counter, window_count), _reset_fallback(counter, window_count))


async def areset(policy_id: str, subject: Subject) -> int:
    """Async twin of :func:`reset`."""
    await policies.aget_registry()
    counter, window_count = _reset_target(policy_id, subject)
    local = _reset_fallback(counter, window_count)
    return max(await get_backend().areset(counter, window_count), local)


# -- operators ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Inspection:
    """What ``quota inspect`` shows: the policy, the subject's pseudonymous identity, and
    per window ``count`` (tokens for a token bucket), ``remaining``, ``reset_after``
    (seconds) and the counter's ``ttl_ms`` (-2: no state)."""

    policy: Policy
    identity: str
    windows: tuple[dict[str, object], ...]

    def as_dict(self) -> dict[str, object]:
        """The ``--json`` shape of contract 8."""
        return {
            "policy": self.policy.id,
            "revision": self.policy.revision,
            "source": self.policy.source,
            "identity": self.identity,
            "windows": list(self.windows),
        }


def inspect(policy_id: str, subject: Subject) -> Inspection:
    """Read a subject's windows without consuming or writing anything.

    Raises ``ValueError`` for a missing or invalid identity, :class:`UnknownPolicy` and
    :class:`BackendError` (the backend could not answer).
    """
    # A disabled policy keeps its counters: inspect them as if it were enabled.
    policy = dataclasses.replace(policies.get_policy(policy_id), enabled=True)
    identity = _identity_or_value_error(policy, subject, "inspect")
    prepared = prepare([policy], subject, 1, peek=True)
    assert prepared.request is not None
    backend = get_backend()
    reply = backend.evaluate(prepared.request)
    outcome = interpret(prepared, reply, backend.mode)[0]
    ttl_ms = backend.ttl_ms(prepared.request.counters[0])
    windows = []
    for window in outcome.windows:
        tokens = policy.algorithm == TOKEN_BUCKET
        windows.append(
            {
                "window": window.name,
                "limit": window.limit,
                "count": window.remaining if tokens else window.limit - window.remaining,
                "remaining": window.remaining,
                "reset_after": window.reset_after,
                "ttl_ms": ttl_ms,
            }
        )
    return Inspection(policy, identity.label, tuple(windows))


def preload() -> list[tuple[str, str]]:
    """Load every script on the backend; (name, SHA1) pairs (``BackendError`` on failure)."""
    return get_backend().preload()


def diagnose() -> list[tuple[str, str, str]]:
    """(check, status, detail) rows about the backend, for ``quota check``."""
    settings = conf.get_settings()
    backend: Any = get_backend()
    return list(backend.diagnose(f"{settings.key_prefix}:{{check}}:quota-check"))
