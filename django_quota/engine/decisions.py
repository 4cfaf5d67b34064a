"""The engine: the :class:`Limiter`, everything one settings generation decides with, and
the plan it drives.

One evaluation is a plan driven once: :meth:`Limiter.prepare` (identities, costs, keys,
script arguments, with everything that depends only on the policy compiled once per
policy and revision), one backend call (one per hash slot on a Redis Cluster), and
:meth:`Limiter.interpret` (outcomes, with the failure modes, the local fallback and the
denial cache: :mod:`django_quota.engine.interpreting`). Retries and the choice among those
live in one generator, :meth:`Limiter.steps`; :meth:`Limiter.run` and
:meth:`Limiter.arun` drive it and differ by one ``await``. Each backend node has its own
in-flight bound and circuit breaker (``docs/failures.md``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, KeysView, Mapping, Sequence
from typing import Any, Final, cast

from django.utils.module_loading import import_string

from django_quota import conf, metrics
from django_quota.backends import Backend, ScriptBackend
from django_quota.backends.memory import MemoryBackend
from django_quota.backends.scripting import (
    ScriptedBackend,
    adrive,
    drive,
)
from django_quota.core.admission import BREAKER_REASONS as BREAKER_REASONS
from django_quota.core.admission import NodeGuard, Refused
from django_quota.core.breaker import BreakerError
from django_quota.core.calls import (
    GROUP_CLOCK_UNSAFE,
    GROUP_INDETERMINATE,
    Packing,
    PolicyCall,
)
from django_quota.core.denials import DenialCache
from django_quota.core.errors import BackendError
from django_quota.core.identity import Identity, IdentityCache, IdentityError
from django_quota.core.outcome import (
    BACKEND_MODE_FALLBACK,
    BACKEND_MODE_REDIS,
    CLOCK_UNSAFE,
    COST_EXCEEDS_LIMIT,
    DENIED_DECISION,
    INDETERMINATE,
    SKIPPED,
    Outcome,
    bare_outcome,
)
from django_quota.core.policy import Policy
from django_quota.core.protocol import (
    GroupReply,
    GroupRequest,
    check_evaluation_id,
    fingerprint,
)
from django_quota.core.windows import new_tuple
from django_quota.engine.prepared import (
    ClockUnusable,
    Compiled,
    Prepared,
    new_evaluation_id,
    placed_calls,
    refusal,
    validate_cost,
)
from django_quota.engine.short_path import ShortCall, ShortPath

Subject = Mapping[str, object]
#: A subject, or a function giving each policy its subject (the HTTP layer's, so that
#: ``auto`` and an explicit ``api_key`` read different sources).
SubjectSource = Subject | Callable[[Policy], Subject]
Clock = Callable[[], float]


class Sizes:
    """How much a limiter remembers per process, per settings, and its breakers' threshold."""

    #: Consecutive failures that open a node's circuit breaker.
    BREAKER_THRESHOLD: Final = 5
    #: Identities remembered (subject values -> pseudonym).
    IDENTITY_CACHE: Final = 4096
    #: Compiled policies remembered.
    COMPILED_CACHE: Final = 1024
    #: Counter keys remembered over every policy (:meth:`Limiter.counter`): as many as
    #: identities.
    COUNTER_CACHE = IDENTITY_CACHE


Steps = Generator[Any, Any, list[Outcome]]


#: The group statuses of a group the backend refused to decide.
_UNDECIDED = (GROUP_CLOCK_UNSAFE, GROUP_INDETERMINATE)


# -- the limiter ---------------------------------------------------------------------------
class Limiter(ShortPath):
    """Everything one settings generation decides with: the backend, the local fallback,
    one :class:`~django_quota.core.admission.NodeGuard` per backend node, compiled
    policies, remembered identities and refusals (the denial cache). Built by
    :func:`get_limiter`, dropped when a watched setting changes."""

    def __init__(self, settings: conf.QuotaSettings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.backend_mode = backend.mode
        self.local = isinstance(backend, MemoryBackend)
        # The backend as the script-running kind: only those reach execute and steps
        # (the memory backend is decided locally), so this view is typed once, here.
        self.scripts = cast(ScriptBackend, backend)
        #: The backend as the memory backend: only that kind reaches decide_locally.
        self.local_backend = cast(MemoryBackend, backend)
        self.fallback = (
            MemoryBackend(settings.local_fallback_max_entries, mode=BACKEND_MODE_FALLBACK)
            if settings.local_fallback_enabled
            else None
        )
        denial = settings.denial_cache
        #: Refusals Redis gave, answered again without a call (``docs/failures.md``):
        #: None when ``DENIAL_CACHE`` is off, and for a backend without I/O.
        self.denials = (
            DenialCache(denial.max_entries, denial.max_ttl)
            if denial.enabled and self.backend_mode == BACKEND_MODE_REDIS and not self.local
            else None
        )
        #: The counter keys of the groups the denial cache remembers, a live view (empty
        #: without a cache): one lookup tells a request or a write that no remembered
        #: refusal concerns it.
        self.denied_counters: KeysView[str] = (
            {}.keys() if self.denials is None else self.denials.counters.keys()
        )
        self.recent_errors: deque[BreakerError] = deque(maxlen=20)
        #: Undefined policy ids already logged (``limiter.policy_unknown``): once each.
        self.unknown_logged: set[str] = set()
        #: Each primary's first ``evicted_keys`` reading and its time (``operations.eviction``).
        self.first_evicted: dict[str, tuple[int, float]] = {}
        self._guards: dict[str, NodeGuard] = {}
        self._lock = threading.Lock()
        self._compiled: dict[int, Compiled] = {}
        #: Counter keys stored in the compiled policies since they were last emptied.
        self._counters_cached = 0
        #: Whether a policy with calendar windows was compiled: its calls need boundaries.
        self.calendar = False
        self.identities = IdentityCache(
            Sizes.IDENTITY_CACHE,
            hmac_key=settings.hmac_key,
            hmac_key_version=settings.hmac_key_version,
            ipv6_prefix=settings.ipv6_prefix,
        )
        self.prefix = settings.key_prefix
        self.dedup_ttl_ms = round(settings.dedup_ttl * 1000)
        self.cleanup_grace_ms = round(settings.cleanup_grace * 1000)
        self.max_regression_ms = round(settings.max_clock_regression * 1000)
        self.scripted = getattr(type(backend), "plan", None) is ScriptedBackend.plan
        self.shortcuts = self.local or self.scripted
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
                        threshold=Sizes.BREAKER_THRESHOLD,
                        cool_down=self.settings.failure_retry_after,
                        recent_errors=self.recent_errors,
                    )
                    self._guards[name] = guard
        return guard

    def guards(self) -> dict[str, NodeGuard]:
        """Every node guard created so far, by node name."""
        return dict(self._guards)

    def _remaining(self, started: float) -> float:
        return self.settings.deadline - (time.monotonic() - started)

    def execute(self, call: Any, started: float) -> Any:
        """Run one backend call on its node, inside that node's in-flight bound and
        breaker (raises :class:`BackendError`)."""
        backend = self.scripts
        guard = self.guard(backend.node_of(call))
        guard.admit(guard.slots.acquire(self._remaining(started)))
        try:
            raw = backend.run(call, started + self.settings.deadline)
        except BaseException as error:
            guard.finish(error, started)
            raise
        guard.finish(None, started)
        return raw

    async def aexecute(self, call: Any, started: float) -> Any:
        """Async twin of :meth:`execute`."""
        backend = self.scripts
        guard = self.guard(backend.node_of(call))
        slots = guard.slots
        guard.admit(slots.try_acquire() or await slots.aacquire(self._remaining(started)))
        try:
            raw = await backend.arun(call, started + self.settings.deadline)
        except BaseException as error:
            guard.finish(error, started)
            raise
        guard.finish(None, started)
        return raw

    # -- prepare ------------------------------------------------------------------------
    def compiled(self, policy: Policy) -> Compiled:
        """``policy`` compiled for these settings (cached per policy object)."""
        found = self._compiled.get(id(policy))
        if found is None or found.policy is not policy:
            if len(self._compiled) >= Sizes.COMPILED_CACHE:
                self._compiled.clear()
            found = Compiled(policy, self.settings)
            self._compiled[id(policy)] = found
            if found.calendar:
                self.calendar = True
        return found

    def identity(self, policy: Policy, subject: Subject) -> Identity:
        """``subject``'s identity for ``policy``'s selector (raises
        :class:`~django_quota.core.identity.IdentityError`), remembered as
        :class:`~django_quota.core.identity.IdentityCache` says. Raises ``TypeError`` for a
        subject that is not a mapping."""
        if type(subject) is not dict and not isinstance(subject, Mapping):
            raise TypeError(
                "a subject maps dimensions to identity values, e.g. {'ip': '203.0.113.9'}, "
                f"not a {type(subject).__name__}"
            )
        return self.identities.get(policy.selector, subject)

    def counter(self, compiled: Compiled, subject: Subject) -> str:
        """The counter key of ``subject`` for ``compiled``'s policy (raises as
        :meth:`identity`), remembered per policy by the raw value of its one dimension
        (:attr:`Compiled.counters`), at most :attr:`Sizes.COUNTER_CACHE` in all."""
        dimension = compiled.dimension
        value: object = None
        if dimension is not None and type(subject) is dict:
            value = subject.get(dimension)
            kind = type(value)
            if kind is str or kind is int:
                found = compiled.counters.get(value)
                if found is not None:
                    return found
            else:
                value = None
        identity = self.identity(compiled.policy, subject)
        counter = compiled.counter(self.prefix, identity)
        if value is not None:
            if self._counters_cached >= Sizes.COUNTER_CACHE:
                self._forget_counters()
            compiled.counters[value] = counter
            self._counters_cached += 1
        return counter

    def _forget_counters(self) -> None:
        """Empty every policy's remembered counter keys (the bound was reached)."""
        with self._lock:
            for compiled in list(self._compiled.values()):
                compiled.counters.clear()
            self._counters_cached = 0

    def identity_for(self, policy: Policy, subject: Subject, action: str) -> Identity:
        """:meth:`identity`, for an operator's ``action`` on ``policy`` (``reset``,
        ``inspect``): a missing or invalid identity raises ``ValueError`` naming both."""
        try:
            return self.identity(policy, subject)
        except IdentityError as exc:
            raise ValueError(
                f"cannot {action} {policy.id!r}: {exc.reason} ({exc.dimension})"
            ) from exc

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
        if not 0 <= now_ms < Packing.BOUND:
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
        plan: str | None = None,
    ) -> Prepared:
        """Give each policy of ``group`` an early outcome, or its key and call; build the
        one backend request of those keyed. A policy with ``plan`` among its plans is
        decided with that plan's limits, on its one counter (``docs/plans.md``).

        An enforced policy refused early (identity error, cost above its limit) refuses
        the group: nothing is sent and the other policies get no outcome. A ``plan`` that
        is neither a ``str`` nor None is a ``TypeError``. A caller's
        ``evaluation_id`` may repeat an earlier one: the backend searches its ledgers for
        it first (``docs/failures.md``). Without one, the evaluation gets a fresh random
        id, except on the memory backend: its counters live in this process, which never
        retries a call, so only a group whose charge the edges undo by its id (a
        concurrency lease, a ``count_when`` or login refund) gets one there; the others charge
        without a ledger entry (``docs/outcomes.md``).
        """
        if type(cost) is not int or cost < 0:
            cost = validate_cost(cost)
        if cost == 0:
            peek = True
        if plan is not None and not isinstance(plan, str):
            raise TypeError(
                f"plan must be a plan name (str) or None, not {type(plan).__name__}: "
                f"{plan!r} (docs/plans.md)"
            )
        caller_id = evaluation_id is not None
        if caller_id:
            check_evaluation_id(evaluation_id)
        counters: tuple[str, ...] = ()
        calls: tuple[PolicyCall, ...] = ()
        needs_id = False
        if len(group) == 1:  # the common call: one policy, no lists to fill
            compiled, keyed = self.keyed(group[0], subject, cost, plan, peek)
            if isinstance(keyed, str):
                prepared = self._one_sent(compiled, evaluation_id or "", peek)
                counters, calls = (keyed,), (compiled.call(cost),)
                needs_id = compiled.needs_id
            else:
                prepared = Prepared(
                    [compiled],
                    [keyed],
                    None,
                    [],
                    evaluation_id or "",
                    0.0,
                    peek,
                    self.backend_mode,
                )
        else:
            prepared = Prepared([], [], None, [], evaluation_id or "", 0.0, peek, self.backend_mode)
            counters, calls, needs_id = self._keys_and_calls(prepared, group, subject, cost, plan)
        if counters:
            if not caller_id and (not self.local or needs_id):
                prepared.evaluation_id = new_evaluation_id()
            self._request(prepared, counters, calls, caller_id, clock)
        if not self.local:  # the memory backend's evaluations are not timed
            prepared.started = time.monotonic()
        return prepared

    def one_group(self, short: ShortCall) -> Prepared:
        """The group :meth:`prepare` makes of a :meth:`shortcut`'s call."""
        prepared = self._one_sent(short.compiled, short.evaluation_id, False)
        self._request(prepared, (short.counter,), (short.call,), False, None)
        prepared.started = short.started
        return prepared

    def _one_sent(self, compiled: Compiled, evaluation_id: str, peek: bool) -> Prepared:
        """The group of one policy, sent (its request still to make)."""
        return Prepared([compiled], [None], None, [0], evaluation_id, 0.0, peek, self.backend_mode)

    def keyed(
        self, policy: Policy, subject: SubjectSource, cost: int, plan: str | None, peek: bool
    ) -> tuple[Compiled, str | Outcome]:
        """``policy`` compiled (with ``plan``'s limits when it has that plan), and its
        counter key when it is to be sent, else its early outcome: skipped when it is
        disabled, a refusal for an identity error or for a cost above its limit (a peek
        is sent whatever the cost)."""
        compiled = self.compiled(policy)
        if plan is not None and policy.plans:
            compiled = compiled.for_plan(plan)
        if not policy.enabled:
            return compiled, bare_outcome(policy, SKIPPED, None, backend_mode=self.backend_mode)
        try:
            counter = self.counter(compiled, subject(policy) if callable(subject) else subject)
        except IdentityError as exc:
            return compiled, refusal(policy, exc.reason, self.backend_mode)
        if peek or cost <= compiled.cost_bound:
            return compiled, counter
        return compiled, refusal(policy, COST_EXCEEDS_LIMIT, self.backend_mode)

    def _keys_and_calls(
        self,
        prepared: Prepared,
        group: Sequence[Policy],
        subject: SubjectSource,
        cost: int,
        plan: str | None,
    ) -> tuple[tuple[str, ...], tuple[PolicyCall, ...], bool]:
        """Give ``prepared`` each policy's compiled form and early outcome (None for a
        policy to send: :meth:`keyed`); return the counter keys and calls to send, none
        when an enforced policy refused the group, and whether the edges undo a sent
        policy's charge by the evaluation's id (:attr:`Compiled.needs_id`: then the
        memory backend gives the evaluation one too)."""
        peek = prepared.peek
        compiled_group = prepared.compiled
        outcomes = prepared.outcomes
        sent = prepared.sent
        counters: list[str] = []
        calls: list[PolicyCall] = []
        refused = needs_id = False
        for index, policy in enumerate(group):
            compiled, keyed = self.keyed(policy, subject, cost, plan, peek)
            compiled_group.append(compiled)
            if isinstance(keyed, str):
                needs_id = needs_id or compiled.needs_id
                outcomes.append(None)
                sent.append(index)
                counters.append(keyed)
                calls.append(compiled.call(cost))
                continue
            refused = refused or keyed.decision == DENIED_DECISION
            outcomes.append(keyed)
        if refused:
            sent.clear()
            return (), (), False
        return tuple(counters), tuple(calls), needs_id

    def _request(
        self,
        prepared: Prepared,
        counters: tuple[str, ...],
        calls: tuple[PolicyCall, ...],
        caller_id: bool,
        clock: Clock | None,
    ) -> None:
        """Give ``prepared`` its request, or its clock error when the clock gives no
        usable time (the request is then never sent)."""
        try:
            clock = clock or self.clock
            now_ms = None if clock is None else self.now(clock)
        except ClockUnusable as exc:
            prepared.clock_error = str(exc)
            return
        if self.calendar:
            calls = placed_calls(prepared, calls, now_ms)
        peek = prepared.peek
        prepared.request = new_tuple(  # every field, in order: the hot path's cheaper call
            GroupRequest,
            (
                counters,
                calls,
                now_ms,
                peek,
                -1 if now_ms is None else self.max_regression_ms,
                self.dedup_ttl_ms,
                self.cleanup_grace_ms,
                b"" if peek or not prepared.evaluation_id else fingerprint(prepared.evaluation_id),
                caller_id,
            ),
        )

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
                if not self.denied_counters.isdisjoint(request.counters):
                    self._written(request)
                self._observe_failure(prepared, error)
                return self.degraded(prepared, error)
            if not self.denied_counters.isdisjoint(request.counters):
                self._written(request)
            self._observe_reply(reply.status, prepared.started)
            return self.interpret(prepared, reply, self.backend_mode)

    def _observe_failure(self, prepared: Prepared, error: BackendError) -> None:
        if isinstance(error, Refused):
            # No node was called (no in-flight slot, or its breaker open): a recent error
            # for the status page, but no backend call for the health and latency metrics.
            self.recent_errors.append(BreakerError(time.time(), error.reason, str(error)))
            return
        metrics.record_backend(self.backend_mode, error.reason, self._latency(prepared))

    def _observe_reply(self, status: int, started: float) -> None:
        """Count a reply of group ``status`` to an evaluation ``started`` then."""
        reason = metrics.OK
        if status in _UNDECIDED:
            reason = self._undecided(status, "the script refused to decide")
        metrics.record_backend(self.backend_mode, reason, time.monotonic() - started)

    def _undecided(self, status: int, detail: str) -> str:
        """The reason of a group the backend refused to decide (``status``), kept among
        the recent errors of the status page."""
        reason = CLOCK_UNSAFE if status == GROUP_CLOCK_UNSAFE else INDETERMINATE
        self.recent_errors.append(BreakerError(time.time(), reason, detail))
        return reason

    @staticmethod
    def _latency(prepared: Prepared) -> float:
        """The evaluation's time so far (s)."""
        return time.monotonic() - prepared.started

    def decide_locally(self, prepared: Prepared) -> list[Outcome]:
        """The memory backend's evaluation: the model, no I/O, no admission, and no
        health count or latency (it has no node to be healthy or not:
        ``docs/metrics.md``). A failure (the backend full) and a group the model refused
        to decide are recent errors of the status page, and their outcomes say why."""
        assert prepared.request is not None
        try:
            reply = self.local_backend.decide(prepared.request)
        except BackendError as error:
            self.recent_errors.append(BreakerError(time.time(), error.reason, str(error)))
            return self.failed(prepared, error.reason, self.backend_mode)
        if reply.status in _UNDECIDED:
            self._undecided(reply.status, "the model refused to decide")
        return self.interpret(prepared, reply, self.backend_mode)

    def _without_io(self, prepared: Prepared) -> list[Outcome] | None:
        """The outcomes when no backend call is needed (nothing to send, the memory
        backend's model, or a refusal the denial cache answers), else None."""
        if prepared.clock_error is not None:
            self.recent_errors.append(BreakerError(time.time(), CLOCK_UNSAFE, prepared.clock_error))
            return self.failed(prepared, CLOCK_UNSAFE, self.backend_mode)
        request = prepared.request
        if request is None:
            return [outcome for outcome in prepared.outcomes if outcome is not None]
        if self.local:
            return self.decide_locally(prepared)
        if request.counters[0] in self.denied_counters:  # a refusal of this group, maybe
            return self._cached(prepared, request)
        return None

    def _recorded(self, prepared: Prepared, outcomes: list[Outcome]) -> list[Outcome]:
        if prepared.peek:
            return outcomes
        compiled = prepared.compiled
        if len(outcomes) == 1 and len(compiled) == 1 and not prepared.group_denied:
            outcome = outcomes[0]  # one policy: its labels are known
            metrics.record_outcome(outcome, outcome.reason or "", compiled[0].selector_label)
        else:
            metrics.record_outcomes(compiled, outcomes, prepared.group_denied)
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
            outcomes = await adrive(self.steps(prepared), lambda call: self.aexecute(call, started))
        return self._recorded(prepared, outcomes)
