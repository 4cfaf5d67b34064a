"""The Python API: evaluate, peek and reset (and their async twins), HTTP-free.

One evaluation is a plan driven once: :meth:`Limiter.prepare` (identities, costs, keys,
script arguments, with everything that depends only on the policy compiled once per
policy and revision), one backend call (one per hash slot on a Redis Cluster), and
:meth:`Limiter.interpret` (outcomes). Retries, the local fallback and the failure modes
live in one generator, :meth:`Limiter.steps`; :func:`evaluate_policies` and
:func:`aevaluate_policies` drive it and differ by one ``await``. Each backend node has
its own in-flight bound and circuit breaker, owned by the :class:`Limiter` built for the
current settings (``docs/failures.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from binascii import b2a_base64
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from os import urandom
from typing import Any, cast

from django.utils.module_loading import import_string

from django_quota import conf, metrics, policies
from django_quota.backends import Backend, ScriptBackend
from django_quota.backends.memory import MemoryBackend
from django_quota.backends.scripting import adrive, drive
from django_quota.core.admission import NodeGuard
from django_quota.core.breaker import BreakerError, CircuitBreaker
from django_quota.core.errors import BackendError
from django_quota.core.identity import Identity, IdentityError, build_identity
from django_quota.core.model import (
    GROUP_CLOCK_UNSAFE,
    GROUP_INDETERMINATE,
    GROUP_REPLAYED,
    PACKABLE,
    UNCHARGED,
    PolicyCall,
    new_tuple,
)
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
    POLICY_UNKNOWN,
    SELECTOR_IDENTITY_MISSING,
    SHADOW_DENIED,
    SKIPPED,
    Outcome,
    bare_outcome,
    outcome_from_result,
)
from django_quota.core.policy import (
    DEFAULT_WINDOW,
    FIXED_WINDOW,
    TOKEN_BUCKET,
    Policy,
    Window,
    settings_revision,
)
from django_quota.core.protocol import (
    GroupReply,
    GroupRequest,
    Probe,
    check_evaluation_id,
    counter_key,
    counter_tail,
    fingerprint,
)

logger = logging.getLogger("django_quota")

Subject = Mapping[str, object]
#: A subject, or a function giving each policy its subject (the HTTP layer's, so that
#: ``auto`` and an explicit ``api_key`` read different sources).
SubjectSource = Subject | Callable[[Policy], Subject]
Clock = Callable[[], float]
FALLBACK_REASONS = frozenset({BACKEND_TIMEOUT, BACKEND_UNAVAILABLE})
#: Consecutive failures that open a node's circuit breaker.
BREAKER_THRESHOLD = 5
#: Failures that count for the breaker: the node could not be reached or did not answer.
BREAKER_REASONS = frozenset({BACKEND_TIMEOUT, BACKEND_UNAVAILABLE, INDETERMINATE})
#: Identities remembered per process (subject values -> pseudonym), per settings.
IDENTITY_CACHE_SIZE = 4096
#: Compiled policies remembered per process, per settings.
COMPILED_CACHE_SIZE = 1024


class Refused(BackendError):
    """The limiter itself did not call a node: its in-flight bound stayed full for the
    rest of ``DEADLINE``, or its circuit breaker is open. Not a failure of the node."""


#: Standard base64's two last symbols to base64url's (RFC 4648, section 5).
_BASE64URL = bytes.maketrans(b"+/", b"-_")


def new_evaluation_id() -> str:
    """A fresh 128-bit random evaluation id from ``os.urandom``: 22 base64url characters
    (RFC 4648, section 5, unpadded), as ``secrets.token_urlsafe(16)`` gives, in fewer
    calls."""
    return b2a_base64(urandom(16), newline=False)[:22].translate(_BASE64URL).decode()


def _validate_cost(cost: object) -> int:
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

    __slots__ = ("calls", "cost_bound", "fail_open", "key_tail", "policy")

    def __init__(self, policy: Policy, settings: conf.QuotaSettings) -> None:
        self.policy = policy
        self.key_tail = counter_tail(policy)
        bounds = [
            window.capacity if policy.algorithm == TOKEN_BUCKET else window.limit
            for window in policy.windows
        ]
        if policy.max_cost is not None:
            bounds.append(policy.max_cost)
        self.cost_bound = min(bounds) if bounds else 0
        self.fail_open = policy.shadow or settings.failure_mode_of(policy) == "open"
        self.calls: dict[int, PolicyCall] = {}

    def call(self, cost: int) -> PolicyCall:
        """The policy's :class:`PolicyCall` at ``cost`` (script arguments encoded once)."""
        call = self.calls.get(cost)
        if call is None:
            policy = self.policy
            call = PolicyCall(policy.algorithm, policy.windows, cost, not policy.shadow)
            if len(self.calls) < 16:
                self.calls[cost] = call
        return call

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


Steps = Generator[Any, Any, list[Outcome]]


# -- the limiter ---------------------------------------------------------------------------
class Limiter:
    """Everything one settings generation decides with: the backend, the local fallback,
    one :class:`~django_quota.core.admission.NodeGuard` per backend node, compiled
    policies and remembered identities. Built by :func:`get_limiter`, dropped when a
    watched setting changes."""

    def __init__(self, settings: conf.QuotaSettings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.backend_mode = backend.mode
        self.local = isinstance(backend, MemoryBackend)
        # The backend as the script-running kind: only those reach execute and steps
        # (the memory backend is decided locally), so this view is typed once, here.
        self.scripts = cast(ScriptBackend, backend)
        self.fallback = (
            MemoryBackend(settings.local_fallback_max_entries, mode=BACKEND_MODE_FALLBACK)
            if settings.local_fallback_enabled
            else None
        )
        self.recent_errors: deque[BreakerError] = deque(maxlen=20)
        self._guards: dict[str, NodeGuard] = {}
        self._lock = threading.Lock()
        self._compiled: dict[int, Compiled] = {}
        self._identities: dict[tuple[object, ...], Identity] = {}
        self.prefix = settings.key_prefix
        self.dedup_ttl_ms = round(settings.dedup_ttl * 1000)
        self.cleanup_grace_ms = round(settings.cleanup_grace * 1000)
        self.max_regression_ms = round(settings.max_clock_regression * 1000)
        self.clock: Clock | None = None
        if settings.clock == "client":
            self.clock = time.time
        elif settings.clock != "redis":
            self.clock = import_string(settings.clock)

    def close(self) -> None:
        """Release the backend's connections."""
        self.backend.close()

    # -- nodes --------------------------------------------------------------------------
    def guard(self, name: str = "default") -> NodeGuard:
        """The guard of node ``name`` (created on first use)."""
        guard = self._guards.get(name)
        if guard is None:
            with self._lock:
                guard = self._guards.get(name)
                if guard is None:
                    guard = NodeGuard(
                        name,
                        max_inflight=self.settings.max_inflight,
                        threshold=BREAKER_THRESHOLD,
                        cool_down=self.settings.failure_retry_after,
                        recent_errors=self.recent_errors,
                    )
                    self._guards[name] = guard
        return guard

    def guards(self) -> dict[str, NodeGuard]:
        """Every node guard created so far, by node name."""
        return dict(self._guards)

    def _admit(self, guard: NodeGuard, acquired: bool) -> None:
        if not acquired:
            raise Refused(BACKEND_UNAVAILABLE, f"MAX_INFLIGHT reached on {guard.name}")
        if not guard.breaker.allow():
            guard.slots.release()
            raise Refused(BACKEND_UNAVAILABLE, f"circuit breaker open for {guard.name}")

    def _account(self, guard: NodeGuard, error: BackendError | None) -> None:
        breaker = guard.breaker
        if error is None:
            state = breaker.success()
        elif error.reason in BREAKER_REASONS:
            state = breaker.failure(error.reason, str(error))
        else:  # the node answered: it is reachable
            state = breaker.success()
            breaker.note(error.reason, str(error))
        if state is not None:
            logger.warning("quota circuit breaker %s for node %s", state, guard.name)

    def _remaining(self, started: float) -> float:
        return self.settings.deadline - (time.monotonic() - started)

    def execute(self, call: Any, started: float) -> Any:
        """Run one backend call on its node, inside that node's in-flight bound and
        breaker (raises :class:`BackendError`)."""
        backend = self.scripts
        guard = self.guard(backend.node_of(call))
        self._admit(guard, guard.slots.acquire(self._remaining(started)))
        try:
            raw = backend.run(call)
        except BackendError as error:
            self._account(guard, error)
            raise
        finally:
            guard.slots.release()
        self._account(guard, None)
        return raw

    async def aexecute(self, call: Any, started: float) -> Any:
        """Async twin of :meth:`execute`."""
        backend = self.scripts
        guard = self.guard(backend.node_of(call))
        self._admit(guard, await guard.slots.aacquire(self._remaining(started)))
        try:
            raw = await backend.arun(call)
        except BackendError as error:
            self._account(guard, error)
            raise
        finally:
            guard.slots.release()
        self._account(guard, None)
        return raw

    # -- prepare ------------------------------------------------------------------------
    def compiled(self, policy: Policy) -> Compiled:
        """``policy`` compiled for these settings (cached per policy object)."""
        found = self._compiled.get(id(policy))
        if found is None or found.policy is not policy:
            if len(self._compiled) >= COMPILED_CACHE_SIZE:
                self._compiled.clear()
            found = Compiled(policy, self.settings)
            self._compiled[id(policy)] = found
        return found

    def identity(self, policy: Policy, subject: Subject) -> Identity:
        """``subject``'s identity for ``policy``'s selector (raises
        :class:`~django_quota.core.identity.IdentityError`). Identities of plain string and
        integer values are remembered (bounded), so a subject's pseudonym is computed
        once, not once per policy and request. Raises ``TypeError`` for a subject that is
        not a mapping."""
        selector = policy.selector
        if type(subject) is not dict and not isinstance(subject, Mapping):
            raise TypeError(
                "a subject maps dimensions to identity values, e.g. {'ip': '203.0.113.9'}, "
                f"not a {type(subject).__name__}"
            )
        items = tuple(subject.items())
        cacheable = True
        for _, value in items:
            kind = type(value)
            if kind is not str and kind is not int and value is not None:
                cacheable = False
                break
        key = (selector, items)
        if cacheable:
            found = self._identities.get(key)
            if found is not None:
                return found
        settings = self.settings
        identity = build_identity(
            selector,
            subject,
            hmac_key=settings.hmac_key,
            hmac_key_version=settings.hmac_key_version,
            ipv6_prefix=settings.ipv6_prefix,
        )
        if cacheable:
            if len(self._identities) >= IDENTITY_CACHE_SIZE:
                self._identities.clear()
            self._identities[key] = identity
        return identity

    def now(self, clock: Clock | None) -> int | None:
        """The ``now`` (ms) to pass, or None for the backend's clock (Redis ``TIME``).

        Raises :class:`ClockUnusable` when the clock raises, or returns anything but a
        number of epoch seconds from 0 to ``2**48`` ms."""
        clock = clock or self.clock
        if clock is None:
            return None
        try:
            seconds = clock()
            now_ms = round(float(seconds) * 1000)
        except Exception as exc:
            raise ClockUnusable(f"the clock raised {type(exc).__name__}: {exc}") from exc
        if not 0 <= now_ms < PACKABLE:
            raise ClockUnusable(f"the clock gave {seconds!r} s, outside 0..2**48 ms")
        return now_ms

    def prepare(
        self,
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
        A caller's ``evaluation_id`` may repeat an earlier one: the backend searches its
        ledgers for it first (``docs/failures.md``).
        """
        if type(cost) is not int or cost < 0:
            cost = _validate_cost(cost)
        if cost == 0:
            peek = True
        caller_id = evaluation_id is not None
        if evaluation_id is None:
            evaluation_id = new_evaluation_id()
        else:
            check_evaluation_id(evaluation_id)
        backend_mode = self.backend_mode
        compiled_group: list[Compiled] = []
        outcomes: list[Outcome | None] = []
        counters: list[str] = []
        calls: list[PolicyCall] = []
        sent: list[int] = []
        refused = False
        known = self._compiled
        for index, policy in enumerate(group):
            compiled = known.get(id(policy))  # self.compiled(policy), inlined
            if compiled is None or compiled.policy is not policy:
                compiled = self.compiled(policy)
            compiled_group.append(compiled)
            if not policy.enabled:
                outcomes.append(bare_outcome(policy, SKIPPED, None, backend_mode=backend_mode))
                continue
            try:
                identity = self.identity(policy, subject(policy) if callable(subject) else subject)
            except IdentityError as exc:
                if exc.reason == SELECTOR_IDENTITY_MISSING and policy.on_missing == "skip":
                    decision = SKIPPED
                else:
                    decision = SHADOW_DENIED if policy.shadow else DENIED_DECISION
                refused = refused or decision == DENIED_DECISION
                outcomes.append(
                    bare_outcome(policy, decision, exc.reason, backend_mode=backend_mode)
                )
                continue
            if not peek and cost > compiled.cost_bound:
                refused = refused or not policy.shadow
                decision = SHADOW_DENIED if policy.shadow else DENIED_DECISION
                outcomes.append(
                    bare_outcome(policy, decision, COST_EXCEEDS_LIMIT, backend_mode=backend_mode)
                )
                continue
            outcomes.append(None)
            sent.append(index)
            counters.append(compiled.counter(self.prefix, identity))
            calls.append(compiled.call(cost))
        request = None
        clock_error = None
        if sent and not refused:
            try:
                clock = clock or self.clock
                now_ms = None if clock is None else self.now(clock)
            except ClockUnusable as exc:
                clock_error = str(exc)
        if clock_error is None and sent and not refused:
            request = new_tuple(  # every field, in order: the hot path's cheaper call
                GroupRequest,
                (
                    tuple(counters),
                    tuple(calls),
                    now_ms,
                    peek,
                    -1 if now_ms is None else self.max_regression_ms,
                    self.dedup_ttl_ms,
                    self.cleanup_grace_ms,
                    b"" if peek else fingerprint(evaluation_id),
                    caller_id,
                ),
            )
        elif refused:
            sent = []
        return Prepared(
            compiled_group,
            outcomes,
            request,
            sent,
            evaluation_id,
            time.monotonic(),
            peek,
            backend_mode,
            clock_error=clock_error,
        )

    # -- interpret ----------------------------------------------------------------------
    def interpret(self, prepared: Prepared, reply: GroupReply, backend_mode: str) -> list[Outcome]:
        """Turn a backend reply into outcomes (failure modes for a refused decision)."""
        status = reply.status
        if status == GROUP_CLOCK_UNSAFE:
            return self.failed(prepared, CLOCK_UNSAFE, backend_mode)
        if status == GROUP_INDETERMINATE:
            return self.failed(prepared, INDETERMINATE, backend_mode)
        outcomes = prepared.outcomes
        compiled = prepared.compiled
        evaluation_id = prepared.evaluation_id
        results = reply.results
        if len(outcomes) == 1 and len(results) == 1:  # one policy, sent: the common call
            result = results[0]
            policy = compiled[0].policy
            outcome = outcome_from_result(policy, result, backend_mode, evaluation_id)
            outcomes[0] = outcome
            if result.status == UNCHARGED and not (
                prepared.peek or status == GROUP_REPLAYED
            ):
                prepared.group_denied = (policy.id,)
            return [outcome]
        uncharged: list[str] = []
        for index, result in zip(prepared.sent, results, strict=True):
            policy = compiled[index].policy
            outcomes[index] = outcome_from_result(policy, result, backend_mode, evaluation_id)
            if result.status == UNCHARGED:
                uncharged.append(policy.id)
        if uncharged and not (prepared.peek or status == GROUP_REPLAYED):
            prepared.group_denied = tuple(uncharged)
        if len(outcomes) == len(prepared.sent):  # every policy decided by the backend
            return cast("list[Outcome]", outcomes.copy())
        return [outcome for outcome in outcomes if outcome is not None]

    def failed(self, prepared: Prepared, reason: str, backend_mode: str) -> list[Outcome]:
        """Apply each sent policy's failure mode for ``reason``."""
        logger.warning(
            "quota backend failure: reason=%s policies=%s",
            reason,
            ",".join(prepared.compiled[i].policy.id for i in prepared.sent),
        )
        retry_after = float(self.settings.failure_retry_after)
        for index in prepared.sent:
            compiled = prepared.compiled[index]
            if compiled.fail_open:
                outcome = bare_outcome(
                    compiled.policy,
                    FAILED_OPEN,
                    reason,
                    backend_mode=backend_mode,
                    evaluation_id=prepared.evaluation_id,
                )
            else:
                outcome = bare_outcome(
                    compiled.policy,
                    FAILED_CLOSED,
                    reason,
                    backend_mode=backend_mode,
                    evaluation_id=prepared.evaluation_id,
                    retry_after=retry_after,
                )
            prepared.outcomes[index] = outcome
        return [outcome for outcome in prepared.outcomes if outcome is not None]

    def degraded(self, prepared: Prepared, error: BackendError) -> list[Outcome]:
        """Decide with the local fallback when the failure allows, else apply the failure
        modes."""
        request = prepared.request
        if self.fallback is not None and error.reason in FALLBACK_REASONS and request:
            logger.warning("quota backend failure, deciding locally: reason=%s", error.reason)
            try:
                reply = self.fallback.evaluate(request._replace(may_repeat=False))
            except BackendError as fallback_error:
                return self.failed(prepared, fallback_error.reason, BACKEND_MODE_FALLBACK)
            return self.interpret(prepared, reply, BACKEND_MODE_FALLBACK)
        return self.failed(prepared, error.reason, self.backend_mode)

    # -- the plan -----------------------------------------------------------------------
    def steps(self, prepared: Prepared) -> Steps:
        """The whole evaluation as a plan: yields each backend call, receives its raw
        reply (failures are thrown in as :class:`BackendError`), returns the outcomes.

        One retry, with the same evaluation id (so the backend's ledgers make sure it
        never charges twice), follows an ``indeterminate`` call when the rest of
        ``DEADLINE`` covers a ``TIMEOUT``. A retry that fails otherwise stays
        ``indeterminate``: the first call may have consumed.
        """
        request = prepared.request
        assert request is not None
        backend = self.scripts
        attempt = 0
        while True:
            try:
                reply: GroupReply = yield from backend.plan(request)
            except BackendError as error:
                if (
                    error.reason == INDETERMINATE
                    and attempt == 0
                    and self._remaining(prepared.started) >= self.settings.timeout
                ):
                    attempt = 1
                    request = request._replace(may_repeat=True)
                    continue
                if attempt and error.reason != INDETERMINATE:
                    error = BackendError(
                        INDETERMINATE, f"retry of an indeterminate call failed: {error}"
                    )
                self._observe_failure(prepared, error)
                return self.degraded(prepared, error)
            self._observe_reply(prepared, reply)
            return self.interpret(prepared, reply, self.backend_mode)

    def _observe_failure(self, prepared: Prepared, error: BackendError) -> None:
        if isinstance(error, Refused):
            # No node was called (no in-flight slot, or its breaker open): a recent error
            # for the status page, but no backend call for the health and latency metrics.
            self.recent_errors.append(BreakerError(time.time(), error.reason, str(error)))
            return
        metrics.record_backend(
            self.backend_mode, error.reason, time.monotonic() - prepared.started
        )

    def _observe_reply(self, prepared: Prepared, reply: GroupReply) -> None:
        reason = metrics.OK
        status = reply.status
        if status in (GROUP_CLOCK_UNSAFE, GROUP_INDETERMINATE):
            reason = CLOCK_UNSAFE if status == GROUP_CLOCK_UNSAFE else INDETERMINATE
            self.recent_errors.append(
                BreakerError(time.time(), reason, "the script refused to decide")
            )
        metrics.record_backend(self.backend_mode, reason, time.monotonic() - prepared.started)

    def decide_locally(self, prepared: Prepared) -> list[Outcome]:
        """The memory backend's evaluation: the model, no I/O, no admission."""
        assert prepared.request is not None
        try:
            reply = self.backend.evaluate(prepared.request)
        except BackendError as error:
            self._observe_failure(prepared, error)
            self.recent_errors.append(BreakerError(time.time(), error.reason, str(error)))
            return self.failed(prepared, error.reason, self.backend_mode)
        self._observe_reply(prepared, reply)
        return self.interpret(prepared, reply, self.backend_mode)

    def _without_io(self, prepared: Prepared) -> list[Outcome] | None:
        """The outcomes when no backend call is needed (nothing to send, or the memory
        backend's model), else None."""
        if prepared.clock_error is not None:
            self.recent_errors.append(BreakerError(time.time(), CLOCK_UNSAFE, prepared.clock_error))
            return self.failed(prepared, CLOCK_UNSAFE, self.backend_mode)
        if prepared.request is None:
            return [outcome for outcome in prepared.outcomes if outcome is not None]
        if self.local:
            return self.decide_locally(prepared)
        return None

    def _recorded(self, prepared: Prepared, outcomes: list[Outcome]) -> list[Outcome]:
        if not prepared.peek:
            metrics.record_outcomes(prepared.compiled, outcomes, prepared.group_denied)
        return outcomes

    def run(self, prepared: Prepared) -> list[Outcome]:
        """Drive a prepared group to its outcomes (sync)."""
        outcomes = self._without_io(prepared)
        if outcomes is None:
            started = prepared.started
            outcomes = drive(self.steps(prepared), lambda call: self.execute(call, started))
        return self._recorded(prepared, outcomes)

    async def arun(self, prepared: Prepared) -> list[Outcome]:
        """Async twin of :meth:`run`."""
        outcomes = self._without_io(prepared)
        if outcomes is None:
            started = prepared.started
            outcomes = await adrive(
                self.steps(prepared), lambda call: self.aexecute(call, started)
            )
        return self._recorded(prepared, outcomes)


# -- the current limiter -------------------------------------------------------------------
_lock = threading.Lock()
_limiter: Limiter | None = None


def _build_backend(settings: conf.QuotaSettings) -> Backend:
    if settings.backend == "memory":
        return MemoryBackend(settings.memory_max_entries)
    from django_quota.backends.redis import RedisBackend

    url, url_options = _connection(settings)
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


def _connection(settings: conf.QuotaSettings) -> tuple[str | None, dict[str, object]]:
    """The URL the Redis backend opens its pool with, and the options it adds: those of
    the ``CACHE_ALIAS`` cache when one is set (``REDIS_URL`` is then ignored), else
    ``REDIS_URL`` (None with ``SENTINEL`` alone)."""
    if settings.cache_alias is not None:
        return _cache_connection(settings.cache_alias)
    return settings.redis_url, {}


def connection_url(settings: conf.QuotaSettings) -> str | None:
    """The Redis URL counters live at, as :func:`_connection` picks it (with its
    password: redact it before showing it); None for the memory backend."""
    if settings.backend == "memory":
        return None
    return _connection(settings)[0]


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


def get_limiter() -> Limiter:
    """The limiter of the current settings, built on first use."""
    global _limiter
    found = _limiter
    if found is None:
        with _lock:
            if _limiter is None:
                settings = conf.get_settings()
                _limiter = Limiter(settings, _build_backend(settings))
            found = _limiter
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


def _drop_backends() -> None:
    global _limiter
    with _lock:
        found, _limiter = _limiter, None
    if found is not None:
        found.close()


conf.on_change(_drop_backends)


def identity_of(policy: Policy, subject: Subject) -> Identity:
    """``subject``'s identity for ``policy``'s selector, with the current HMAC settings
    (raises :class:`~django_quota.core.identity.IdentityError`)."""
    return get_limiter().identity(policy, subject)


def _identity_or_value_error(policy: Policy, subject: Subject, action: str) -> Identity:
    try:
        return identity_of(policy, subject)
    except IdentityError as exc:
        raise ValueError(f"cannot {action} {policy.id!r}: {exc.reason} ({exc.dimension})") from exc


def prepare(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int,
    *,
    peek: bool = False,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
) -> Prepared:
    """:meth:`Limiter.prepare` on the current limiter."""
    return get_limiter().prepare(
        group, subject, cost, peek=peek, evaluation_id=evaluation_id, clock=clock
    )


# -- policies named but not defined ---------------------------------------------------------
_unknown_logged: set[str] = set()


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
    if policy_id not in _unknown_logged:
        _unknown_logged.add(policy_id)
        logger.error(
            "quota policy %r %s; its failure mode (%s) applies with reason policy_unknown",
            policy_id,
            cause or "is named but not defined (django_quota.E009)",
            mode,
        )
    backend_mode = get_limiter().backend_mode
    if mode == "open":
        outcome = Outcome(policy_id, FAILED_OPEN, POLICY_UNKNOWN, backend_mode=backend_mode)
    else:
        retry_after = float(settings.failure_retry_after)
        outcome = Outcome(
            policy_id, FAILED_CLOSED, POLICY_UNKNOWN, retry_after=retry_after,
            backend_mode=backend_mode,
        )
    metrics.record_outcomes((), [outcome])
    return outcome


def forget_unknown_policies() -> None:
    """Log the next :func:`policy_unknown` of every id again (settings changed)."""
    _unknown_logged.clear()


conf.on_change(forget_unknown_policies)


# -- public API ----------------------------------------------------------------------------
def evaluate_policies(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int = 1,
    *,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
) -> list[Outcome]:
    """Decide several policies together, as one layer (``docs/arithmetic.md``): one
    backend call (one per hash slot on a Redis Cluster) that charges ``cost`` units only
    when every enforced policy admits the request (a shadow policy is charged when it
    admits, and never refuses).

    ``group`` holds :class:`~django_quota.core.policy.Policy` objects (from
    :func:`~django_quota.policies.get_policy`). ``subject`` is a mapping of dimensions to
    raw identities, as for :func:`evaluate`, or a callable that takes a policy and
    returns its subject. ``clock``, a callable returning the time in epoch seconds,
    decides on that clock instead of ``QUOTA["CLOCK"]``. ``evaluation_id`` is as for
    :func:`evaluate`.

    Returns the outcomes in ``group`` order. When an enforced policy is refused before
    the backend (an identity error, ``cost_exceeds_limit``), nothing is charged and the
    policies that would have been sent get no outcome, so the list can be shorter than
    ``group``. Never raises for backend trouble; raises ``TypeError`` or ``ValueError``
    for a bad ``cost`` or ``evaluation_id``, as :func:`evaluate` does.
    """
    limiter = get_limiter()
    return limiter.run(
        limiter.prepare(group, subject, cost, evaluation_id=evaluation_id, clock=clock)
    )


async def aevaluate_policies(
    group: Sequence[Policy],
    subject: SubjectSource,
    cost: int = 1,
    *,
    evaluation_id: str | None = None,
    clock: Clock | None = None,
) -> list[Outcome]:
    """Async twin of :func:`evaluate_policies`."""
    limiter = get_limiter()
    return await limiter.arun(
        limiter.prepare(group, subject, cost, evaluation_id=evaluation_id, clock=clock)
    )


def evaluate(
    policy_id: str, subject: Subject, cost: int = 1, evaluation_id: str | None = None
) -> Outcome:
    """Decide one request of ``cost`` units for ``subject`` under ``policy_id``, and
    charge it when the policy admits it.

    ``subject`` maps dimensions to raw identities (``{"user": "42"}``,
    ``{"ip": "203.0.113.9"}``), normalised as the middleware normalises them; a missing
    or invalid identity is an outcome (``selector_identity_missing``,
    ``selector_identity_invalid``), not an exception. ``cost`` is an ``int >= 0`` in units
    of the policy's limit; 0 decides without charging, as :func:`peek`.
    ``evaluation_id`` (printable, 1 to 128 characters), when given, makes a repeat of a
    charged evaluation charge nothing (``docs/failures.md``).

    Returns the policy's :class:`~django_quota.core.outcome.Outcome`. Never raises for
    backend trouble: failures come back as outcomes. Raises
    :class:`~django_quota.policies.UnknownPolicy` when no source defines ``policy_id``;
    ``TypeError`` or ``ValueError`` for a bad ``cost`` or ``evaluation_id``;
    ``TypeError`` for an identity value that is not ``str``, ``int`` or ``uuid.UUID``.
    """
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    return limiter.run(limiter.prepare([policy], subject, cost, evaluation_id=evaluation_id))[0]


async def aevaluate(
    policy_id: str, subject: Subject, cost: int = 1, evaluation_id: str | None = None
) -> Outcome:
    """Async twin of :func:`evaluate`."""
    await policies.aget_registry()
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    prepared = limiter.prepare([policy], subject, cost, evaluation_id=evaluation_id)
    return (await limiter.arun(prepared))[0]


def peek(policy_id: str, subject: Subject) -> Outcome:
    """What ``evaluate(cost=1)`` would decide now, ``remaining`` before consumption.

    Writes nothing: no key, no TTL, no evaluation-id ledger entry. Raises as
    :func:`evaluate` does (:class:`~django_quota.policies.UnknownPolicy`, ``TypeError``
    for an identity value of another type); backend failures are outcomes.
    """
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    return limiter.run(limiter.prepare([policy], subject, 1, peek=True))[0]


async def apeek(policy_id: str, subject: Subject) -> Outcome:
    """Async twin of :func:`peek`."""
    await policies.aget_registry()
    limiter = get_limiter()
    policy = policies.get_policy(policy_id)
    return (await limiter.arun(limiter.prepare([policy], subject, 1, peek=True)))[0]


def _reset_target(policy_id: str, subject: Subject) -> tuple[str, int]:
    policy = policies.get_policy(policy_id)
    identity = _identity_or_value_error(policy, subject, "reset")
    return counter_key(conf.get_settings().key_prefix, policy, identity), len(policy.windows)


def _reset_fallback(counter: str, window_count: int) -> int:
    fallback = get_fallback()
    return fallback.reset(counter, window_count) if fallback is not None else 0


def reset(policy_id: str, subject: Subject) -> int:
    """Delete every window of ``subject``'s counter for the policy's current revision, in
    the backend and in this process's fallback; return how many windows had state (an
    ``int``, 0 when there was none).

    Raises :class:`~django_quota.policies.UnknownPolicy` when no source defines
    ``policy_id``, ``ValueError`` for a missing or invalid identity, and
    :class:`~django_quota.core.errors.BackendError` when the backend fails (unlike
    :func:`evaluate`, a reset has no failure mode to fall back on).
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
        """The ``--json`` shape (``docs/operations.md``)."""
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
    limiter = get_limiter()
    prepared = limiter.prepare([policy], subject, 1, peek=True)
    if prepared.clock_error is not None:
        raise BackendError(CLOCK_UNSAFE, f"QUOTA['CLOCK']: {prepared.clock_error}")
    assert prepared.request is not None
    backend = limiter.backend
    reply = backend.evaluate(prepared.request)
    outcome = limiter.interpret(prepared, reply, backend.mode)[0]
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


#: The probe ``quota check`` evaluates: a route-only identity, so its key stays readable
#: (``<KEY_PREFIX>:{quota-check}:…``), and a one-second window, so it never lingers.
PROBE_POLICY = Policy(
    id="quota-check",
    algorithm=FIXED_WINDOW,
    windows=(Window(DEFAULT_WINDOW, 2, 1000, 2),),
    selector=("route",),
    revision=settings_revision(FIXED_WINDOW, ("route",), (Window(DEFAULT_WINDOW, 2, 1000, 2),)),
    source="check",
)


def probe() -> Probe:
    """The probe of ``quota check``: a peek and a charge of :data:`PROBE_POLICY`, built
    as every evaluation is (this process's clock, prefix and lifetimes)."""
    limiter = get_limiter()
    subject = {"route": "quota-check"}
    peek, charge = (
        limiter.prepare([PROBE_POLICY], subject, 1, peek=True),
        limiter.prepare([PROBE_POLICY], subject, 1),
    )
    if peek.clock_error is not None:
        raise ClockUnusable(peek.clock_error)
    peeking, charging = peek.request, charge.request
    assert peeking is not None and charging is not None
    return Probe(charging.counters[0], PROBE_POLICY.windows[0].limit, peeking, charging)


def diagnose() -> list[tuple[str, str, str]]:
    """(check, status, detail) rows about the backend, for ``quota check``: the backend
    runs the :func:`probe` too."""
    backend: Any = get_backend()
    try:
        checked = probe()
    except ClockUnusable as exc:
        return [("clock", "error", f"QUOTA['CLOCK'] gives no usable time: {exc}")]
    return list(backend.diagnose(checked))


__all__ = [
    "Compiled",
    "Inspection",
    "Limiter",
    "Prepared",
    "aevaluate",
    "aevaluate_policies",
    "apeek",
    "areset",
    "evaluate",
    "evaluate_policies",
    "get_backend",
    "get_breaker",
    "get_fallback",
    "get_limiter",
    "inspect",
    "peek",
    "policy_unknown",
    "reset",
]
