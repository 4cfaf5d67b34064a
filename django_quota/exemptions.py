"""Exemptions (``docs/policies.md#exemptions``): a policy's ``exempt`` networks and
``QUOTA["EXEMPT_WHEN"]``. Every edge (the middleware, ``@quota``, the DRF throttles, the
django-ratelimit drop-in) asks :func:`exempted` (or :func:`aexempted`) which of the
policies it is about to evaluate the request skips: those get the outcome ``skipped``
with reason ``exempt``, counted in the metrics, and are never sent to the backend.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Sequence
from typing import Any

from asgiref.sync import sync_to_async
from django.utils.module_loading import import_string

from django_quota import conf, limiter, metrics
from django_quota.core.identity import IdentityError, client_ip
from django_quota.core.outcome import EXEMPT, SKIPPED, Outcome, bare_outcome
from django_quota.core.policy import Policy

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

logger = logging.getLogger("django_quota")

#: ``EXEMPT_WHEN`` imported, by dotted path; forgotten when the settings change.
_callables: dict[str, Callable[[Any], Any]] = {}
conf.on_change(_callables.clear)


def _exempt_when(path: str) -> Callable[[Any], Any]:
    found = _callables.get(path)
    if found is None:
        found = _callables[path] = import_string(path)
    return found


def _asks(path: str, request: Any) -> bool:
    """What ``EXEMPT_WHEN`` says of ``request``. A predicate that fails (it raises, or
    cannot be imported) exempts nothing: the request is limited as if it were not set,
    and the exception is logged on the ``django_quota`` logger with its traceback, each
    time (docs/policies.md#exemptions). A broken predicate must neither answer 500 nor
    lift the limits."""
    try:
        return bool(_exempt_when(path)(request))
    except Exception:
        logger.exception("EXEMPT_WHEN %s raised: the request is not exempt", path)
        return False


def client_address(request: Any, *, default_proxy_count: int | None = None) -> Address | None:
    """The client's whole address, as the ``ip`` dimension derives it (``REMOTE_ADDR``,
    then ``X-Forwarded-For`` behind ``TRUSTED_PROXIES`` or ``PROXY_COUNT`` only), but
    never grouped into its ``IPV6_PREFIX`` network; None when it is missing or invalid
    (such a client is never exempt by network)."""
    settings = conf.get_settings()
    proxy_count = settings.proxy_count
    if proxy_count is None and not settings.trusted_proxies:
        proxy_count = default_proxy_count
    try:
        text = client_ip(
            request.META.get("REMOTE_ADDR"),
            request.META.get("HTTP_X_FORWARDED_FOR"),
            trusted_proxies=settings.trusted_proxies,
            proxy_count=proxy_count,
            ipv6_prefix=128,
        )
    except IdentityError:
        return None
    return ipaddress.ip_address(text)


def _skipped(
    group: Sequence[Policy], skipped: Sequence[Policy], record: bool = True
) -> dict[str, Outcome]:
    mode = limiter.get_limiter().backend_mode
    found = {
        policy.id: bare_outcome(policy, SKIPPED, EXEMPT, backend_mode=mode) for policy in skipped
    }
    if record:  # a peek is never counted
        metrics.record_outcomes(group, found.values())
    return found


def _by_network(request: Any, group: Sequence[Policy], subject: object) -> list[Policy]:
    hops = getattr(subject, "default_proxy_count", None)
    address = client_address(request, default_proxy_count=hops)
    if address is None:
        return []
    return [policy for policy in group if any(address in net for net in policy.exempt)]


def exempted(
    request: Any, group: Sequence[Policy], subject: object = None, *, record: bool = True
) -> dict[str, Outcome]:
    """The ``skipped``/``exempt`` outcomes, by policy id, of the policies of ``group`` the
    request skips: all of them when ``EXEMPT_WHEN(request)`` is true, else those whose
    ``exempt`` networks hold the client address (``subject``, a
    :class:`~django_quota.subjects.RequestSubject`, may carry DRF's ``NUM_PROXIES``).
    Empty, at the cost of one look at each policy, when nothing is exempt. ``record``
    False (a peek) leaves the metrics alone."""
    when = conf.get_settings().exempt_when
    if when is None and not any(policy.exempt for policy in group):
        return {}
    if when is not None and _asks(when, request):
        return _skipped(group, group, record)
    skipped = _by_network(request, group, subject)
    return _skipped(group, skipped, record) if skipped else {}


async def aexempted(
    request: Any, group: Sequence[Policy], subject: object = None, *, record: bool = True
) -> dict[str, Outcome]:
    """Async twin of :func:`exempted`: ``EXEMPT_WHEN`` runs in a worker thread (it may
    read ``request.user`` or query the database)."""
    when = conf.get_settings().exempt_when
    if when is None and not any(policy.exempt for policy in group):
        return {}
    if when is not None and await sync_to_async(_asks)(when, request):
        return _skipped(group, group, record)
    skipped = _by_network(request, group, subject)
    return _skipped(group, skipped, record) if skipped else {}


def is_exempt(request: Any) -> bool:
    """True when ``EXEMPT_WHEN`` is set and says so for ``request`` (False when it
    raises: :func:`_asks`)."""
    when = conf.get_settings().exempt_when
    return when is not None and _asks(when, request)


def exempt_step(request: Any, step: Any, subject: object) -> None:
    """Take the policies ``request`` is exempt from out of ``step.pending`` (a layer's
    :class:`~django_quota.ledger._Step`); their ``skipped`` outcomes join the step's early
    outcomes (``step.missing``), which the step records with the layer's others."""
    if step.pending:
        _apply(step, exempted(request, step.pending, subject))


async def aexempt_step(request: Any, step: Any, subject: object) -> None:
    """Async twin of :func:`exempt_step`."""
    if step.pending:
        _apply(step, await aexempted(request, step.pending, subject))


def _apply(step: Any, skipped: dict[str, Outcome]) -> None:
    if skipped:
        step.pending = [policy for policy in step.pending if policy.id not in skipped]
        step.missing = [*step.missing, *skipped.values()]
