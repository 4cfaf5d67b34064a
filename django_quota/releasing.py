"""The edges' side of concurrency policies (docs/concurrency.md): what a layer acquired
for a request, released when the response is done.

A layer that decided a concurrency policy for a request it let through holds the lease
until its work is over: the middleware and ``@quota`` after the view returns or raises,
the DRF throttles when DRF's dispatch has finalized its response or let an exception
through; a streaming response's leases when the response is closed (its ``close``, which
every Django handler and the test client call once the content is sent). A release that
fails is logged, never raised: the lease then frees itself after its period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from django_quota import limiter
from django_quota.core.outcome import ALLOWED, BACKEND_MODE_CACHE, Outcome
from django_quota.core.policy import CONCURRENCY, Policy

logger = logging.getLogger("django_quota")


class Held(NamedTuple):
    """A lease a layer acquired: its policy, the subject it was acquired for and the
    evaluation's id (what :func:`~django_quota.limiter.release` takes)."""

    policy: Policy
    subject: Mapping[str, object]
    evaluation_id: str


def held(
    group: Sequence[Policy],
    fresh: Sequence[Outcome],
    subject_for: Callable[[Policy], Mapping[str, object]],
) -> tuple[Held, ...]:
    """The leases the evaluation of ``group`` acquired (its ``fresh`` outcomes, the
    request let through): the allowed outcomes of its concurrency policies."""
    if not any(policy.algorithm == CONCURRENCY for policy in group):
        return ()
    by_id = {policy.id: policy for policy in group}
    found = []
    for outcome in fresh:
        policy = by_id.get(outcome.policy)
        if (
            policy is not None
            and policy.algorithm == CONCURRENCY
            and outcome.decision == ALLOWED
            and outcome.backend_mode != BACKEND_MODE_CACHE
        ):
            found.append(Held(policy, subject_for(policy), outcome.evaluation_id))
    return tuple(found)


def release(leases: Sequence[Held]) -> None:
    """Release ``leases`` now; a failure is logged (the lease frees itself after its
    period), never raised."""
    for lease in leases:
        try:
            limiter.release_leases(
                limiter.lease_request(lease.policy, lease.subject, lease.evaluation_id)
            )
        except Exception as exc:  # a release never fails a response
            _failed(lease, exc)


async def arelease(leases: Sequence[Held]) -> None:
    """Async twin of :func:`release`."""
    for lease in leases:
        try:
            await limiter.arelease_leases(
                limiter.lease_request(lease.policy, lease.subject, lease.evaluation_id)
            )
        except Exception as exc:  # a release never fails a response
            _failed(lease, exc)


def _failed(lease: Held, exc: Exception) -> None:
    logger.warning(
        "quota release failed, the lease frees itself after its period: policy=%s error=%s",
        lease.policy.id,
        type(exc).__name__,
    )


def on_close(response: Any, leases: Sequence[Held]) -> None:
    """Release ``leases`` when ``response`` is closed (its ``close`` wrapped, once)."""
    close = response.close

    def closing() -> None:
        try:
            close()
        finally:
            release(leases)

    response.close = closing


def release_after(response: Any, leases: Sequence[Held]) -> Any:
    """``response`` once the view is done with ``leases``: released now, or when a
    streaming response is closed."""
    if leases:
        if getattr(response, "streaming", False):
            on_close(response, leases)
        else:
            release(leases)
    return response


async def arelease_after(response: Any, leases: Sequence[Held]) -> Any:
    """Async twin of :func:`release_after` (a streaming response's close is sync code,
    run by Django's handler in a thread)."""
    if leases:
        if getattr(response, "streaming", False):
            on_close(response, leases)
        else:
            await arelease(leases)
    return response


def after_dispatch(view: Any, leases: Sequence[Held]) -> None:
    """Release ``leases`` when DRF's dispatch of ``view`` (an ``APIView`` instance, one
    per request) is done: once ``finalize_response`` has the response (the handler
    returned, or an exception became a response; a streaming response's when it is
    closed), or when ``handle_exception`` lets an exception through. Both are public
    ``APIView`` methods, wrapped on this instance only. A view without them (a throttle
    called by hand) keeps its leases until they expire."""
    finalize = getattr(view, "finalize_response", None)
    handle_exception = getattr(view, "handle_exception", None)
    if finalize is None or handle_exception is None:
        return

    def finalize_response(request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        return release_after(finalize(request, response, *args, **kwargs), leases)

    def handling(exc: Exception) -> Any:
        try:
            return handle_exception(exc)
        except BaseException:
            release(leases)
            raise

    view.finalize_response = finalize_response
    view.handle_exception = handling
