"""The edges' side of concurrency policies (docs/concurrency.md) and of ``count_when``
(docs/refunds.md): what a layer acquired or charged for a request, released or refunded
when the response is done.

A ``count_when`` policy is charged before the view, as any other; when the response's
status is not one it lists, the charge is refunded (one refund call per such policy,
only for the responses refunded). A view that raises counts as a 500.

A layer that decided a concurrency policy for a request it let through holds the lease
until its work is over: the middleware and ``@quota`` after the view returns or raises,
the DRF throttles when DRF's dispatch has finalized its response or let an exception
through; a streaming response's leases when the response is closed (its ``close``, which
every Django handler and the test client call once the content is sent). A release that
fails is logged, never raised: the lease then frees itself after its period.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from django_quota import limiter
from django_quota.core.log import logger
from django_quota.core.outcome import ALLOWED, BACKEND_MODE_CACHE, Outcome
from django_quota.core.policy import CONCURRENCY, Policy
from django_quota.core.refunds import RefundRequest
from django_quota.engine.prepared import Compiled, Prepared

#: The status a view that raised counts as (``count_when``).
RAISED = 500
#: The warning logged when ending a hold fails, by whether it was a lease's release.
FAILED = MappingProxyType(
    {
        True: "quota release failed, the lease frees itself after its period: policy=%s error=%s",
        False: "quota refund failed, the charge stays: policy=%s error=%s",
    }
)


class Held(NamedTuple):
    """A lease a layer acquired, or a charge of a ``count_when`` policy: its policy, the
    counter the evaluation charged and the evaluation's id, the policy as compiled for
    that evaluation (its plan's limits, if any) and the cost charged."""

    policy: Policy
    counter: str
    evaluation_id: str
    compiled: Compiled
    cost: int = 1
    #: ``time.monotonic()`` when it was charged.
    charged_at: float = 0.0


def held(fresh: Sequence[Outcome], prepared: Prepared, cost: int = 1) -> tuple[Held, ...]:
    """What the evaluation ``prepared`` (its ``fresh`` outcomes, the request let
    through) holds until the response is done: the allowed outcomes of its concurrency
    policies and of its ``count_when`` policies, with the counters it charged."""
    request = prepared.request
    if request is None:
        return ()
    # ``needs_id`` is true of every policy that holds (and of login policies): one look
    # at each, in a loop (any() over a generator costs more on every request).
    for compiled in prepared.compiled:
        if compiled.needs_id:
            break
    else:
        return ()
    sent: dict[str, tuple[Compiled, str]] = {}
    for position, index in enumerate(prepared.sent):
        compiled = prepared.compiled[index]
        if holds(compiled.policy):
            sent[compiled.policy.id] = (compiled, request.counters[position])
    found = []
    now = time.monotonic()
    for outcome in fresh:
        if (
            outcome.policy in sent
            and outcome.decision == ALLOWED
            and outcome.backend_mode != BACKEND_MODE_CACHE
        ):
            compiled, counter = sent[outcome.policy]
            found.append(
                Held(compiled.policy, counter, outcome.evaluation_id, compiled, cost, now)
            )
    return tuple(found)


def holds(policy: Policy) -> bool:
    """Whether an allowed evaluation of ``policy`` holds something until the response is
    done: a concurrency lease, or a ``count_when`` charge."""
    return policy.algorithm == CONCURRENCY or policy.count_when is not None


def _settlement(lease: Held, status: int) -> Any:
    """What ends ``lease`` after a response of ``status``: a concurrency lease's release;
    a ``count_when`` charge's refund when the status does not count; else None."""
    policy = lease.policy
    if policy.algorithm != CONCURRENCY and policy.counts(status):
        return None
    # The charge's own time, should the bounded ledger have dropped its entry: the ms
    # since it, measured here (docs/refunds.md, "At the edges").
    since = max(0, round((time.monotonic() - lease.charged_at) * 1000))
    return limiter.counter_undo(
        lease.compiled, lease.counter, lease.evaluation_id, lease.cost, since
    )


def _settlements(leases: Sequence[Held], status: int) -> list[tuple[Held, Any]]:
    """What ends ``leases`` after a response of ``status``: each lease's release, and
    the refunds of the charges it does not count joined into one request per evaluation
    (a layer's group is one evaluation: one refund call, one per hash slot on a
    cluster)."""
    found: list[tuple[Held, Any]] = []
    refunds: dict[str, int] = {}
    for lease in leases:
        try:
            settlement = _settlement(lease, status)
        except Exception as exc:  # a release never fails a response
            policy = lease.policy
            logger.warning(FAILED[policy.algorithm == CONCURRENCY], policy.id, type(exc).__name__)
            continue
        if settlement is None:
            continue
        if isinstance(settlement, RefundRequest):
            at = refunds.get(lease.evaluation_id)
            if at is not None:
                first, joined = found[at]
                found[at] = (first, joined.joined(settlement))
                continue
            refunds[lease.evaluation_id] = len(found)
        found.append((lease, settlement))
    return found


def release(leases: Sequence[Held], status: int = RAISED) -> None:
    """Release ``leases`` now, and refund the ``count_when`` charges a response of
    ``status`` does not count; a failure is logged (a lease frees itself after its
    period, a charge stays), never raised."""
    for lease, settlement in _settlements(leases, status):
        try:
            limiter.refund_charge(settlement)
        except Exception as exc:  # a release never fails a response
            policy = lease.policy
            logger.warning(FAILED[policy.algorithm == CONCURRENCY], policy.id, type(exc).__name__)


async def arelease(leases: Sequence[Held], status: int = RAISED) -> None:
    """Async twin of :func:`release`."""
    for lease, settlement in _settlements(leases, status):
        try:
            await limiter.arefund_charge(settlement)
        except Exception as exc:  # a release never fails a response
            policy = lease.policy
            logger.warning(FAILED[policy.algorithm == CONCURRENCY], policy.id, type(exc).__name__)


def on_close(response: Any, leases: Sequence[Held]) -> None:
    """Release ``leases`` when ``response`` is closed (its ``close`` wrapped, once)."""
    close = response.close
    status = _status(response)

    def closing() -> None:
        try:
            close()
        finally:
            release(leases, status)

    response.close = closing


def release_after(response: Any, leases: Sequence[Held]) -> Any:
    """``response`` once the view is done with ``leases``: released now, or when a
    streaming response is closed."""
    if leases:
        if getattr(response, "streaming", False):
            on_close(response, leases)
        else:
            release(leases, _status(response))
    return response


def _status(response: Any) -> int:
    """The response's status (a 500 for an object without one)."""
    status = getattr(response, "status_code", RAISED)
    return status if isinstance(status, int) else RAISED


async def arelease_after(response: Any, leases: Sequence[Held]) -> Any:
    """Async twin of :func:`release_after` (a streaming response's close is sync code,
    run by Django's handler in a thread)."""
    if leases:
        if getattr(response, "streaming", False):
            on_close(response, leases)
        else:
            await arelease(leases, _status(response))
    return response
