"""One request's ledger, and the one step every layer takes against it.

Every layer (the middleware, ``@quota``, the DRF throttles, the django-ratelimit drop-in)
hands the request to :func:`decide` (or :func:`adecide`) with its policies and how it
reads its subject (a :class:`~django_quota.subjects.Reading`, or a drop-in's own
identity, a :class:`~django_quota.subjects.GivenSubject`). The step reads the request
once: its :class:`RequestLedger` (``request._quota``), whose outcomes are reused (one
charge per policy per request); its subject, exemptions and plan; then it drives the
engine with plain values (one backend call for the rest), records the new outcomes and
returns a :class:`Decision`, with what the evaluation holds until the response is done
(``releasing.Held``: counters and evaluation ids, never the request). The layer keeps
only what is its own: the response or the exception of a refusal, and when its work is
over.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asgiref.sync import iscoroutinefunction, sync_to_async

from django_quota import limiter, metrics, releasing
from django_quota.core.log import logger
from django_quota.core.outcome import (
    DENIED_DECISION,
    EXEMPT,
    FAILED_CLOSED,
    SKIPPED,
    Outcome,
    bare_outcome,
)
from django_quota.core.policy import Policy
from django_quota.engine import Clock, Limiter
from django_quota.engine.prepared import Prepared
from django_quota.engine.short_path import ShortCall
from django_quota.subjects import PLAIN, Readable, Subject

#: The one attribute django-quota sets on a request.
LEDGER_ATTR = "_quota"

#: A layer's cost: an ``int >= 0``, or ``callable(request)`` returning one.
Cost = int | Callable[[Any], Any]


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
    """One DRF dispatch of the request: its throttles' leases, whether one of them sent
    ``quota_denied`` (DRF asks every throttle; the signal goes once), what its throttles
    ``held`` (concurrency leases, ``count_when`` charges: released when the dispatch is
    done, :func:`after_dispatch`) and the latest earlier dispatch that held something
    when this one replaced it, if any (``outer``: a view that dispatches the same
    ``HttpRequest`` again, once or more, inside its own dispatch)."""

    __slots__ = ("denied_sent", "held", "leases", "outer", "request")

    def __init__(self, request: Any, outer: Dispatch | None = None) -> None:
        try:
            self.request: Callable[[], Any] = weakref.ref(request)
        except TypeError:  # not weak-referenceable (a test's stand-in request)
            self.request = lambda: request
        self.leases: list[tuple[object, Lease]] = []
        self.denied_sent = False
        self.held: list[releasing.Held] = []
        self.outer = outer

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
    does not resolve, or None before the first look) and the current DRF ``dispatch``;
    ``login_refusal``, the outcome that refused the request's login attempt
    (:mod:`django_quota.auth`), and ``login_charged``, whether the login backend charged
    its failed attempt already (the ``user_login_failed`` receiver must not).
    """

    __slots__ = (
        "dispatch",
        "leases",
        "login_charged",
        "login_refusal",
        "memo",
        "outcomes",
        "route",
    )

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.memo: dict[str, Outcome] = {}
        self.leases: dict[str, Lease] = {}
        self.route: object = None
        self.dispatch: Dispatch | None = None
        self.login_refusal: Outcome | None = None
        self.login_charged = False

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
            outer = None
            if current is not None:
                current.end()
                # The replaced dispatch, or (holding nothing) the one it replaced: a
                # dispatch that still holds stays reachable (dispatch_of).
                outer = current if current.held else current.outer
            current = self.dispatch = Dispatch(request, outer)
        return current, current.lease(throttle)

    def dispatch_of(self, request: Any) -> Dispatch | None:
        """The dispatch of DRF's ``request`` (the current one, or one it replaced)."""
        found = self.dispatch
        while found is not None and found.request() is not request:
            found = found.outer
        return found


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


def ledger_if_any(request: Any) -> RequestLedger | None:
    """The ledger of ``request`` (or of the ``HttpRequest`` DRF's ``Request`` wraps), None
    when no layer made one."""
    found: RequestLedger | None = getattr(django_request(request), LEDGER_ATTR, None)
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
    the same DRF dispatch already did); the concurrency leases and ``count_when`` charges
    it ``held`` for the request, which the layer releases when the response is done
    (docs/concurrency.md, docs/refunds.md)."""

    outcomes: tuple[Outcome, ...]
    refusing: Outcome | None
    announces: bool
    held: tuple[releasing.Held, ...] = ()


class _Step:
    """One layer's step on one request: what is reused, what is pending, and the plan the
    pending policies are evaluated with."""

    __slots__ = (
        "decided",
        "dispatch",
        "exempt",
        "group",
        "lease",
        "ledger",
        "missing",
        "pending",
        "plan",
    )

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
        self.group = group
        self.dispatch: Dispatch | None = None
        if throttle is not None:
            self.dispatch, lease = ledger.throttle_lease(request, throttle)
        self.lease = lease
        decided = self.decided = ledger.live()
        self.missing: list[Outcome] = []
        self.pending: Sequence[Policy] = group
        self.exempt: tuple[Sequence[Policy], Sequence[Policy]] | None = None
        self.plan: str | None = None
        if unknown:
            self.missing = [
                decided.get(name) or limiter.policy_unknown(name, cause=cause) for name in unknown
            ]
            if any(outcome.decision == FAILED_CLOSED for outcome in self.missing):
                self.pending = ()
                return
        if decided:
            self.pending = [policy for policy in group if policy.id not in decided]

    def read(self, request: Any, reading: Readable, load: bool = False) -> Subject | None:
        """Read ``request`` for the pending policies, as ``reading`` says: its subject;
        the policies it is exempt from (left out of the pending ones: :meth:`finish`
        records their ``skipped`` outcomes); its plan when a policy left has plans (the
        resolver is asked only then); with ``load``, the subject's sources that may query
        the database too (an async layer runs this in a worker thread when
        ``reading.blocks``). The subject, or None when nothing is left to evaluate."""
        subject = reading.subject(request, self.ledger)
        pending = self.pending
        exempt = subject.exempt(pending)
        if exempt:
            skipped = {policy.id for policy in exempt}
            self.pending = [policy for policy in pending if policy.id not in skipped]
            self.exempt = (exempt, pending)
        if not self.pending:
            return None
        for policy in self.pending:
            if policy.plans:
                self.plan = subject.plan()
                break
        if load:
            subject.load(self.pending)
        return subject

    def finish(
        self, fresh: Sequence[Outcome] = (), prepared: Prepared | None = None, cost: int = 1
    ) -> Decision:
        """Record the new outcomes (the early ones, the ``skipped`` ones of the policies
        the subject is exempt from, counted in the metrics, and the ``fresh`` ones); the
        layer's decision, with what ``prepared`` holds."""
        group = self.group
        if self.exempt is not None:
            exempt, read = self.exempt
            mode = limiter.get_limiter().backend_mode
            found = [bare_outcome(policy, SKIPPED, EXEMPT, backend_mode=mode) for policy in exempt]
            metrics.record_outcomes(read, found)
            self.missing = [*self.missing, *found]
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
        held: tuple[releasing.Held, ...] = ()
        if refusing is None and fresh and prepared is not None:
            held = releasing.held(fresh, prepared, cost)
            if held and self.dispatch is not None:
                self.dispatch.held.extend(held)
        return Decision(tuple(found), refusing, announces, held)


def after_dispatch(view: Any) -> None:
    """Release what the throttles of DRF's dispatch of ``view`` (an ``APIView`` instance,
    one per request) hold, the :class:`Dispatch`'s ``held``, when that dispatch is done:
    once ``finalize_response`` has the response (the handler returned, or an exception
    became a response; a streaming response's when it is closed), or when
    ``handle_exception`` lets an exception through. Both are public ``APIView`` methods,
    wrapped on this instance only; each finds the dispatch in the request's ledger. A
    view without them (a throttle called by hand) keeps its leases until they expire."""
    finalize = getattr(view, "finalize_response", None)
    handle_exception = getattr(view, "handle_exception", None)
    if finalize is None or handle_exception is None:
        return

    def finalize_response(request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        response = finalize(request, response, *args, **kwargs)
        return releasing.release_after(response, _dispatch_held(request))

    def handling(exc: Exception) -> Any:
        try:
            return handle_exception(exc)
        except BaseException:
            releasing.release(_dispatch_held(getattr(view, "request", None)))
            raise

    view.finalize_response = finalize_response
    view.handle_exception = handling


def _dispatch_held(request: Any) -> list[releasing.Held]:
    """What the dispatch of DRF's ``request`` holds, taken (released once)."""
    found = ledger_if_any(request) if request is not None else None
    dispatch = None if found is None else found.dispatch_of(request)
    if dispatch is None:
        return []
    held, dispatch.held = dispatch.held, []
    return held


def _call(
    current: Limiter,
    pending: Sequence[Policy],
    subject: Subject,
    charge: int,
    clock: Clock | None,
    plan: str | None,
) -> ShortCall | Outcome | Prepared:
    """What evaluates ``pending`` for ``subject`` on ``current``: the common call's short
    path when it takes them (docs/architecture.md, "One decision"), its outcome when that
    needs no call, else the prepared group."""
    if len(pending) == 1 and clock is None and not releasing.holds(pending[0]):
        short = current.shortcut(pending[0], subject.for_policy, charge, None, plan)
        if short is not None:
            return short
    return current.prepare(pending, subject.for_policy, charge, clock=clock, plan=plan)


def _callable_name(function: object) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"


def _cost_failed(cost: object, group: Sequence[Policy], problem: str) -> int:
    """The cost of a request whose ``cost`` callable failed: 1, as without one, logged
    (docs/settings.md#when-a-projects-callable-fails): never a 500, never free."""
    ids = ", ".join(policy.id for policy in group)
    if problem == "raised":
        logger.exception(
            "the cost callable %s of policy %s raised: the request costs 1",
            _callable_name(cost),
            ids,
        )
    else:
        logger.error(
            "the cost callable %s of policy %s %s: the request costs 1",
            _callable_name(cost),
            ids,
            problem,
        )
    return 1


def _checked_cost(cost: object, value: object, group: Sequence[Policy]) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    shown = str(value) if type(value) is int else f"a {type(value).__name__}"
    return _cost_failed(cost, group, f"returned {shown}, not an int >= 0")


def _charge(request: Any, cost: Callable[[Any], Any], group: Sequence[Policy]) -> int:
    """What the callable ``cost`` says ``request`` costs."""
    try:
        value = cost(request)
    except Exception:
        return _cost_failed(cost, group, "raised")
    return _checked_cost(cost, value, group)


async def _acharge(request: Any, cost: Callable[[Any], Any], group: Sequence[Policy]) -> int:
    """Async twin of :func:`_charge`: an async ``cost`` callable is awaited."""
    try:
        value = cost(request)
        if iscoroutinefunction(cost):
            value = await value
    except Exception:
        return _cost_failed(cost, group, "raised")
    return _checked_cost(cost, value, group)


def decide(
    request: Any,
    group: Sequence[Policy],
    reading: Readable = PLAIN,
    cost: Cost = 1,
    *,
    lease: Lease | None = None,
    throttle: object = None,
    unknown: Sequence[str] = (),
    cause: str | None = None,
    clock: Clock | None = None,
) -> Decision:
    """Decide ``group`` for ``request`` as one layer: reuse what is decided, read the
    request for the rest (``reading``: how this layer reads its subject), evaluate them
    together (one backend call), record the new outcomes.

    ``cost`` is charged, a callable being called with ``request`` only when something is
    evaluated. The new outcomes are held by ``lease``, or, for a DRF ``throttle`` (then
    ``request`` is DRF's ``Request``), by a lease of that throttle in the current DRF
    dispatch. Each of the ``unknown`` ids (named, not defined) gets the
    ``policy_unknown`` outcome of its failure mode (``cause`` completes its log line);
    when one fails closed, nothing is evaluated. ``clock`` is as for
    :func:`~django_quota.limiter.evaluate_policies`.
    """
    step = _Step(request, group, lease, throttle, unknown, cause)
    subject = step.read(request, reading) if step.pending else None
    fresh: Sequence[Outcome] = ()
    prepared = None
    charge = 1
    if subject is not None:  # else every policy was reused, undefined or exempt
        charge = _charge(request, cost, step.pending) if callable(cost) else cost
        current = limiter.get_limiter()
        call = _call(current, step.pending, subject, charge, clock, step.plan)
        if isinstance(call, Prepared):
            fresh = current.run(call)
            prepared = call
        else:
            fresh = [current.run_short(call) if isinstance(call, ShortCall) else call]
    return step.finish(fresh, prepared, charge)


async def adecide(
    request: Any,
    group: Sequence[Policy],
    reading: Readable = PLAIN,
    cost: Cost = 1,
    *,
    lease: Lease | None = None,
    unknown: Sequence[str] = (),
    cause: str | None = None,
    clock: Clock | None = None,
) -> Decision:
    """Async twin of :func:`decide`: the request is read in a worker thread when that may
    block (``EXEMPT_WHEN``, the subject's database sources), and an async ``cost``
    callable is awaited."""
    step = _Step(request, group, lease, None, unknown, cause)
    subject = None
    if step.pending:
        if reading.blocks(step.pending):
            subject = await sync_to_async(step.read)(request, reading, True)
        else:
            subject = step.read(request, reading)
    fresh: Sequence[Outcome] = ()
    prepared = None
    charge = 1
    if subject is not None:  # else every policy was reused, undefined or exempt
        charge = await _acharge(request, cost, step.pending) if callable(cost) else cost
        current = limiter.get_limiter()
        call = _call(current, step.pending, subject, charge, clock, step.plan)
        if isinstance(call, Prepared):
            fresh = await current.arun(call)
            prepared = call
        else:
            fresh = [await current.arun_short(call) if isinstance(call, ShortCall) else call]
    return step.finish(fresh, prepared, charge)
