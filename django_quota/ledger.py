"""One request's ledger, and the step every layer takes against it.

Every layer (the middleware, ``@quota``, the DRF throttles) decides its policies with
:func:`decide` (or :func:`adecide`): outcomes already decided for the request are reused
(one charge per policy per request), the rest are evaluated as one layer, and the new
outcomes are recorded in the request's :class:`RequestLedger`. The layer keeps only what
is its own: the response or the exception of a refusal.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from asgiref.sync import iscoroutinefunction

from django_quota import limiter, releasing
from django_quota.core.outcome import DENIED_DECISION, FAILED_CLOSED, Outcome
from django_quota.core.policy import Policy
from django_quota.exemptions import aexempt_step, exempt_step
from django_quota.prepared import Prepared

#: The one attribute django-quota sets on a request.
LEDGER_ATTR = "_quota"

#: A layer's cost: an ``int >= 0``, or ``callable(request)`` returning one.
Cost = int | Callable[[Any], Any]
Clock = Callable[[], float]


class Subject(Protocol):
    """The raw subject of a request (:class:`~django_quota.subjects.RequestSubject`)."""

    def for_policy(self, policy: Policy) -> Mapping[str, object]:
        """The subject the core needs for ``policy``'s selector."""

    async def aload(self, group: Iterable[Policy]) -> None:
        """Read, off the event loop, the sources ``group`` needs."""

    def plan(self) -> str | None:
        """The request's plan (``PLAN_RESOLVER``, ``docs/plans.md``), or None."""


class Lease:
    """A layer's hold on the outcomes it recorded on a request.

    While the lease is active, later layers reuse those outcomes (one charge per policy
    per request). It ends when the layer's work for that request is over (a decorated
    view returned, a DRF throttle runs again or a new DRF dispatch begins); a later,
    separate use of the same request object, as tests that send one ``RequestFactory``
    request to a view several times do, then decides those policies afresh. Outcomes
    recorded without a lease (the middleware's) never end.
    """

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = True

    def end(self) -> None:
        """Let a later use of the request decide this layer's policies again."""
        self.active = False


class Dispatch:
    """One DRF dispatch of the request: its throttles' leases, and whether one of them
    sent ``quota_denied`` (DRF asks every throttle; the signal goes once)."""

    __slots__ = ("denied_sent", "leases", "request")

    def __init__(self, request: Any) -> None:
        try:
            self.request: Callable[[], Any] = weakref.ref(request)
        except TypeError:  # not weak-referenceable (a test's stand-in request)
            self.request = lambda: request
        self.leases: list[tuple[object, Lease]] = []
        self.denied_sent = False

    def lease(self, throttle: object) -> Lease:
        """A new lease for ``throttle``; its previous one in this dispatch ends."""
        for index, (holder, previous) in enumerate(self.leases):
            if holder is throttle:
                previous.end()
                del self.leases[index]
                break
        lease = Lease()
        self.leases.append((throttle, lease))
        return lease

    def end(self) -> None:
        for _, lease in self.leases:
            lease.end()


class RequestLedger:
    """What the layers decided for one request, under ``request._quota``.

    ``outcomes`` in evaluation order, ``memo`` by policy id, the :class:`Lease` of each
    leased outcome, the resolved ``route`` (a ``ResolverMatch``, a marker for a path that
    does not resolve, or None before the first look) and the current DRF ``dispatch``.
    """

    __slots__ = ("dispatch", "leases", "memo", "outcomes", "route")

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.memo: dict[str, Outcome] = {}
        self.leases: dict[str, Lease] = {}
        self.route: object = None
        self.dispatch: Dispatch | None = None

    def live(self) -> dict[str, Outcome]:
        """The memo without outcomes whose :class:`Lease` has ended."""
        leases = self.leases
        if not leases:
            return self.memo
        return {
            policy: outcome
            for policy, outcome in self.memo.items()
            if policy not in leases or leases[policy].active
        }

    def record(self, new: Sequence[Outcome], lease: Lease | None = None) -> None:
        """Record outcomes of policies not decided yet (for headers, ``outcomes()`` and
        the memo), under ``lease`` when given; an outcome whose lease has ended is
        replaced by the new outcome of its policy."""
        leases = self.leases
        if leases:
            self._drop_ended(new)
        for outcome in new:
            if outcome.policy not in self.memo:
                self.outcomes.append(outcome)
                self.memo[outcome.policy] = outcome
                if lease is not None:
                    leases[outcome.policy] = lease

    def _drop_ended(self, new: Sequence[Outcome]) -> None:
        leases = self.leases
        stale = {o.policy for o in new if o.policy in leases and not leases[o.policy].active}
        if stale:
            for policy in stale:
                self.memo.pop(policy, None)
            self.outcomes[:] = [o for o in self.outcomes if o.policy not in stale]

    def throttle_lease(self, request: Any, throttle: object) -> tuple[Dispatch, Lease]:
        """The dispatch of DRF's ``request`` and a new lease of ``throttle`` in it. A new
        dispatch of the same ``HttpRequest`` (DRF's own tests send one request object to
        a view again and again) ends the leases of the previous one, so it is charged as
        DRF charges it."""
        current = self.dispatch
        if current is None or current.request() is not request:
            if current is not None:
                current.end()
            current = self.dispatch = Dispatch(request)
        return current, current.lease(throttle)


def django_request(request: Any) -> Any:
    """Django's ``HttpRequest``: ``request`` itself, or the one DRF's ``Request`` wraps."""
    return getattr(request, "_request", request)


def ledger_of(request: Any) -> RequestLedger:
    """The ledger of ``request``, made on first use. DRF's ``Request`` keeps it on the
    ``HttpRequest`` it wraps, where every layer finds it."""
    request = django_request(request)
    found: RequestLedger | None = getattr(request, LEDGER_ATTR, None)
    if found is None:
        found = RequestLedger()
        setattr(request, LEDGER_ATTR, found)
    return found


def outcomes(request: Any) -> list[Outcome]:
    """The :class:`~django_quota.core.outcome.Outcome` objects recorded on ``request`` by
    every layer (middleware, decorators, DRF throttles), in evaluation order; an empty
    list when none ran. A policy that several layers name appears once."""
    found: RequestLedger | None = getattr(request, LEDGER_ATTR, None)
    return [] if found is None else list(found.outcomes)


def refusal(found: Sequence[Outcome]) -> Outcome | None:
    """The outcome that refuses the request, if any: a quota or identity denial first,
    then a fail-closed failure."""
    denied = [o for o in found if o.decision == DENIED_DECISION]
    if denied:
        timed = [o for o in denied if o.retry_after is not None]
        return max(timed, key=lambda o: o.retry_after or 0) if timed else denied[0]
    return next((o for o in found if o.decision == FAILED_CLOSED), None)


@dataclass(frozen=True, slots=True)
class Decision:
    """A layer's decision: its ``outcomes`` (its undefined policies', then its group's,
    reused or fresh, in group order), the ``refusing`` one if any, and whether this
    layer ``announces`` the refusal (sends ``quota_denied``: not when another throttle of
    the same DRF dispatch already did); the concurrency leases it ``held`` for the
    request, which the layer releases when the response is done (docs/concurrency.md)."""

    outcomes: tuple[Outcome, ...]
    refusing: Outcome | None
    announces: bool
    held: tuple[releasing.Held, ...] = ()


def _holding(
    decision: Decision, fresh: Sequence[Outcome], prepared: Prepared, cost: int
) -> Decision:
    """``decision`` with the leases its fresh outcomes acquired and the ``count_when``
    charges they made (none when refused), on the counters ``prepared`` charged."""
    if not fresh or decision.refusing is not None:
        return decision
    leases = releasing.held(fresh, prepared, cost)
    if not leases:
        return decision
    return Decision(decision.outcomes, None, decision.announces, leases)


class _Step:
    """The bookkeeping around one layer's evaluation: what is reused, what is pending."""

    __slots__ = ("decided", "dispatch", "lease", "ledger", "missing", "pending")

    def __init__(
        self,
        request: Any,
        group: Sequence[Policy],
        lease: Lease | None,
        throttle: object,
        unknown: Sequence[str],
        cause: str | None,
    ) -> None:
        ledger = self.ledger = ledger_of(request)
        self.dispatch: Dispatch | None = None
        if throttle is not None:
            self.dispatch, lease = ledger.throttle_lease(request, throttle)
        self.lease = lease
        decided = self.decided = ledger.live()
        self.missing: list[Outcome] = []
        self.pending: Sequence[Policy] = group
        if unknown:
            self.missing = [
                decided.get(name) or limiter.policy_unknown(name, cause=cause) for name in unknown
            ]
            if any(outcome.decision == FAILED_CLOSED for outcome in self.missing):
                self.pending = ()
                return
        if decided:
            self.pending = [policy for policy in group if policy.id not in decided]

    def finish(self, group: Sequence[Policy], fresh: Sequence[Outcome]) -> Decision:
        new = [*self.missing, *fresh]
        found = new
        if len(self.pending) < len(group):
            # Some were reused: the group's outcomes in group order, reused or fresh.
            decided = self.decided
            by_policy = {outcome.policy: outcome for outcome in fresh}
            found = self.missing + [
                decided[policy.id] if policy.id in decided else by_policy[policy.id]
                for policy in group
                if policy.id in decided or policy.id in by_policy
            ]
        # ``decided`` may be the memo itself: read it before recording into it.
        self.ledger.record(new, self.lease)
        refusing = refusal(found)
        announces = refusing is not None
        if announces and self.dispatch is not None:
            announces = not self.dispatch.denied_sent
            self.dispatch.denied_sent = True
        return Decision(tuple(found), refusing, announces)


def _plan(subject: Subject, group: Sequence[Policy]) -> str | None:
    """The request's plan when a policy of ``group`` has plans (the resolver is called
    only then), else None."""
    for policy in group:
        if policy.plans:
            return subject.plan()
    return None


def decide(
    request: Any,
    group: Sequence[Policy],
    subject: Subject | None = None,
    cost: Cost = 1,
    *,
    lease: Lease | None = None,
    throttle: object = None,
    unknown: Sequence[str] = (),
    cause: str | None = None,
    clock: Clock | None = None,
) -> Decision:
    """Decide ``group`` for ``request`` as one layer: reuse what is decided, evaluate the
    rest together (one backend call), record the new outcomes.

    ``subject`` gives each policy's subject (needed when ``group`` is not empty);
    ``cost`` is charged, a callable being called with ``request`` only when something is
    evaluated. The new outcomes are held by ``lease``, or, for a DRF ``throttle`` (then
    ``request`` is DRF's ``Request``), by a lease of that throttle in the current DRF
    dispatch. Each of the ``unknown`` ids (named, not defined) gets the
    ``policy_unknown`` outcome of its failure mode (``cause`` completes its log line);
    when one fails closed, nothing is evaluated. ``clock`` is as for
    :func:`~django_quota.limiter.evaluate_policies`.
    """
    step = _Step(request, group, lease, throttle, unknown, cause)
    exempt_step(request, step, subject)
    fresh: list[Outcome] = []
    if step.pending:
        assert subject is not None
        charge = cost(request) if callable(cost) else cost
        plan = _plan(subject, step.pending)
        current = limiter.get_limiter()
        prepared = current.prepare(step.pending, subject.for_policy, charge, clock=clock, plan=plan)
        fresh = current.run(prepared)
        return _holding(step.finish(group, fresh), fresh, prepared, charge)
    return step.finish(group, fresh)


async def adecide(
    request: Any,
    group: Sequence[Policy],
    subject: Subject | None = None,
    cost: Cost = 1,
    *,
    lease: Lease | None = None,
    unknown: Sequence[str] = (),
    cause: str | None = None,
    clock: Clock | None = None,
) -> Decision:
    """Async twin of :func:`decide`: the subject's database sources are read in a worker
    thread first, and an async ``cost`` callable is awaited."""
    step = _Step(request, group, lease, None, unknown, cause)
    await aexempt_step(request, step, subject)
    fresh: list[Outcome] = []
    if step.pending:
        assert subject is not None
        await subject.aload(step.pending)
        charge: Any = cost
        if callable(cost):
            charge = cost(request)
            if iscoroutinefunction(cost):
                charge = await charge
        plan = _plan(subject, step.pending)
        current = limiter.get_limiter()
        prepared = current.prepare(step.pending, subject.for_policy, charge, clock=clock, plan=plan)
        fresh = await current.arun(prepared)
        return _holding(step.finish(group, fresh), fresh, prepared, charge)
    return step.finish(group, fresh)
