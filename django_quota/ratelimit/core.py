"""django-ratelimit's ``is_ratelimited`` and ``get_usage`` on django-quota's engine
(``docs/django-ratelimit.md``).

A call resolves what django-ratelimit resolves (the group, the rate, the key's value),
then asks the engine once: ``group`` is the generated policy ``ratelimit:<group>`` (a
fixed window of the rate: django-ratelimit's period is a fixed window), and the key's
value (:mod:`django_quota.ratelimit.keys`), framed with the group and the methods, is the
identity, which the engine pseudonymises with its HMAC before it reaches Redis.
``increment=True`` charges the counter through :func:`django_quota.ledger.decide` (the
outcome is recorded on ``request._quota``, so headers and metrics follow);
``increment=False`` peeks.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import InvalidCacheBackendError
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_quota import conf, limiter, policies
from django_quota.core.log import logger
from django_quota.core.outcome import (
    EXEMPT,
    FAILED_CLOSED,
    FAILED_OPEN,
    SKIPPED,
    Outcome,
    bare_outcome,
)
from django_quota.core.policy import (
    FIXED_WINDOW,
    Policy,
    generated_policy_id,
)
from django_quota.core.rates import Grammar, bounds_problem
from django_quota.engine.prepared import Prepared
from django_quota.ledger import Lease, adecide, decide, ledger_of
from django_quota.policies import Generated
from django_quota.ratelimit import ALL, UNSAFE, keys

# django-ratelimit's ``core`` module holds its keys; projects and django-ratelimit's own
# tests import them from here (docs/django-ratelimit.md), so they stay importable.
from django_quota.ratelimit.keys import _ACCESSOR_KEYS as _ACCESSOR_KEYS
from django_quota.ratelimit.keys import _SIMPLE_KEYS as _SIMPLE_KEYS
from django_quota.ratelimit.keys import _get_ip as _get_ip
from django_quota.ratelimit.keys import callable_name
from django_quota.ratelimit.keys import get_header as get_header
from django_quota.ratelimit.keys import user_or_ip as user_or_ip
from django_quota.signals import quota_denied
from django_quota.subjects import PLAIN, GivenSubject, Readable, Subject

__all__ = ["aget_usage", "ais_ratelimited", "get_usage", "is_ratelimited"]


# django-ratelimit's grammar: a count, "/", an optional multiplier, an optional unit
# (seconds when absent), matched at the start of the string only.
_RATE_RE = re.compile(r"([0-9]+)/([0-9]*)([smhd])?")

Usage = dict[str, Any]


# -- rates ---------------------------------------------------------------------------------
def _split_rate(rate: str | tuple[int, int]) -> tuple[int, int]:
    """``(count, seconds)`` of a rate as django-ratelimit reads it: ``"100/h"``,
    ``"10/5m"``, ``"5/10"`` (seconds), or a ``(count, seconds)`` tuple as it is.

    Raises ``ImproperlyConfigured`` for anything else, a tuple included that is not two
    integers (django-ratelimit documents ``(count, seconds)`` as "a tuple of integers";
    given another, it fails with a bare ``TypeError`` or ``ValueError`` deeper down).
    """
    if isinstance(rate, tuple):
        if len(rate) == 2 and all(type(part) is int for part in rate):
            return rate
        raise ImproperlyConfigured(
            f"Invalid ratelimit rate {rate!r}: a tuple rate is (count, seconds), two "
            "integers such as (100, 3600); or use a string such as '100/h'"
        )
    match = _RATE_RE.match(rate) if isinstance(rate, str) else None
    if match is None:
        raise ImproperlyConfigured(
            f"Invalid ratelimit rate {rate!r}: expected '<count>/<period>' such as '100/h', "
            "'10/5m' or '5/10' (seconds), or a (count, seconds) tuple of integers"
        )
    count, multiplier, unit = match.groups()
    seconds = Grammar.UNIT_MS[unit or "s"] // 1000 * (int(multiplier) if multiplier else 1)
    return int(count), seconds


# -- methods and groups --------------------------------------------------------------------
def _method_match(request: Any, method: Any = ALL) -> bool:
    if method == ALL:
        return True
    if not isinstance(method, list | tuple):
        method = [method]
    return request.method in [name.upper() for name in method]


def _methods_text(method: Any) -> str:
    """The methods part of the identity: ``""`` for all, else the sorted names (so
    ``["GET", "POST"]`` and ``["POST", "GET"]`` share a counter, ``"GET"`` and
    ``"POST"`` do not)."""
    if method is None or method == ALL:
        return ""
    names = method if isinstance(method, list | tuple) else [method]
    return ",".join(sorted(str(name).upper() for name in names))


def _group_of(fn: Any) -> str:
    """The default group: the view's dotted name (``module.[Class.]qualname``)."""
    if isinstance(fn, functools.partial):
        fn = fn.func
    parts = []
    if hasattr(fn, "__module__"):
        parts.append(fn.__module__)
    if hasattr(fn, "__self__"):
        parts.append(fn.__self__.__class__.__name__)
    parts.append(fn.__qualname__)
    return ".".join(parts)


def _frame(group: str, methods: str, value: str) -> str:
    """One text from the three parts of a counter's identity, unambiguous (lengths)."""
    return f"{len(group)}:{group}{len(methods)}:{methods}{value}"


# -- the policy ----------------------------------------------------------------------------
def _policy(group: str, limit: int, period: int, per_request: bool = False) -> Policy:
    """The generated policy of ``group`` at ``limit`` per ``period`` seconds (a fixed
    window), failing open when ``RATELIMIT_FAIL_OPEN``; a policy configured with the id
    ``ratelimit:<group>`` wins. Cached until settings change.

    ``per_request``: the rate is chosen per request (a callable or dotted ``rate``), so
    the limit is a plan's (``docs/plans.md``): the revision leaves it out, and every limit
    of one period shares the group's counter (``docs/django-ratelimit.md``)."""
    fail_open = _fail_open()
    policy_id = generated_policy_id(Generated.RATELIMIT, group)

    def build() -> Policy:
        problem = bounds_problem(limit, period * 1000)
        if problem is not None:
            raise ImproperlyConfigured(f"Invalid ratelimit rate {limit}/{period}s: {problem}")
        return policies.one_window(
            policy_id, FIXED_WINDOW, limit, period, (Generated.RATELIMIT_KEY,), Generated.RATELIMIT,
            failure_mode="open" if fail_open else "closed", per_request=per_request,
        )

    key = (Generated.RATELIMIT, policy_id, limit, period, fail_open, per_request)
    return policies.generated(key, build)


@dataclass(frozen=True, slots=True)
class _Limit:
    """What one call decides: the policy (None for a rate of 0, refused without a
    counter), how its subject is read, and the rate as django-ratelimit reports it;
    ``failed``: the group whose rate callable raised (then nothing else is set)."""

    policy: Policy | None
    reading: Readable
    limit: int
    period: int
    failed: str | None = None


class _RateFailed(Exception):
    """A project's rate callable raised (logged)."""


def _fail_open() -> bool:
    return bool(getattr(settings, "RATELIMIT_FAIL_OPEN", False))


def _rate_of(request: Any, group: str, rate: Any) -> tuple[Any, bool]:
    """``(rate, whether it was chosen for this request)``: a callable ``rate`` (or its
    dotted path) called with ``(group, request)``; raises :class:`_RateFailed`, logged,
    when it raises."""
    if not callable(rate) and not (isinstance(rate, str) and "." in rate):
        return rate, False
    function = rate if callable(rate) else import_string(rate)
    try:
        return function(group, request), True
    except Exception:
        logger.exception(
            "ratelimit rate %s of group %r raised: the group's failure mode (%s) applies "
            "with reason policy_unknown",
            callable_name(rate),
            group,
            "open" if _fail_open() else "closed",
        )
        raise _RateFailed from None


def _check_cache_alias() -> None:
    alias = getattr(settings, "RATELIMIT_USE_CACHE", None)
    if alias is not None and alias not in (getattr(settings, "CACHES", None) or {}):
        raise InvalidCacheBackendError(
            f"RATELIMIT_USE_CACHE names {alias!r}, which is not a cache of CACHES"
        )


def _resolve(
    request: Any, group: str | None, fn: Any, key: Any, rate: Any, method: Any
) -> _Limit | None:
    """What to decide, or None when nothing limits this request (disabled, another
    method, no rate). Raises ``ImproperlyConfigured`` as django-ratelimit does."""
    if group is None and fn is None:
        raise ImproperlyConfigured("get_usage must be called with either `group` or `fn`")
    if not getattr(settings, "RATELIMIT_ENABLE", True) or not conf.get_settings().enabled:
        return None
    if not _method_match(request, method):
        return None
    if group is None:
        group = _group_of(fn)
    try:
        rate, per_request = _rate_of(request, group, rate)
    except _RateFailed:
        return _Limit(None, PLAIN, 0, 0, failed=group)
    if rate is None:
        return None
    limit, period = _split_rate(rate)
    if period <= 0:
        raise ImproperlyConfigured("Ratelimit period must be greater than 0")
    if not key:
        raise ImproperlyConfigured("Ratelimit key must be specified")
    _check_cache_alias()
    value = keys.identity_value(request, group, key)
    if limit <= 0:
        return _Limit(None, PLAIN, 0, period)
    policy = _policy(group, limit, period, per_request)
    if policy.source != Generated.RATELIMIT:
        # A policy configured under ratelimit:<group> replaces the rate, with its selector.
        return _Limit(policy, PLAIN, limit, period)
    if isinstance(value, str):
        value = _frame(group, _methods_text(method), value)
    return _Limit(policy, GivenSubject({Generated.RATELIMIT_KEY: value}), limit, period)


def _needs_thread(key: Any, rate: Any) -> bool:
    """Whether resolving may run the project's code or read ``request.user``."""
    if callable(rate) or (isinstance(rate, str) and "." in rate):
        return True
    return keys.needs_thread(key)


# -- outcome to usage ----------------------------------------------------------------------
def _usage(found: _Limit, outcome: Outcome | None) -> Usage | None:
    """django-ratelimit's usage dict from an outcome. ``count`` is the requests counted in
    the window, plus one when this one is limited (so ``should_limit`` is ``count >
    limit``, as there); a failure is django-ratelimit's: None when failing open, a
    refusal with ``count`` and ``limit`` 0 and ``time_left`` -1 when failing closed."""
    if outcome is None:  # a rate of 0
        return {"count": 1, "limit": 0, "should_limit": True, "time_left": found.period}
    if outcome.decision == FAILED_OPEN:
        return None
    if outcome.decision == FAILED_CLOSED:
        return {"count": 0, "limit": 0, "should_limit": True, "time_left": -1}
    limited = not outcome.allowed
    limit = found.limit if outcome.limit is None else outcome.limit
    used = 0 if outcome.remaining is None else limit - outcome.remaining
    reset_after = outcome.reset_after
    return {
        "count": used + (1 if limited else 0),
        "limit": limit,
        "should_limit": limited,
        "time_left": found.period if reset_after is None else math.ceil(reset_after),
    }


def _announce(request: Any, sender: object, refusing: Outcome | None, announces: bool) -> None:
    if refusing is not None and announces:
        quota_denied.send(sender=sender, request=request, outcome=refusing)


def _read(policy: Policy, subject: Subject, load: bool = False) -> Outcome | None:
    """Read the request for a peek of ``policy``: its ``skipped`` outcome when the
    request is exempt (not counted in the metrics: a peek never is), else None, the
    subject's database sources read first with ``load`` (an async call, in a thread)."""
    if subject.exempt([policy]):
        mode = limiter.get_limiter().backend_mode
        return bare_outcome(policy, SKIPPED, EXEMPT, backend_mode=mode)
    if load:
        subject.load([policy])
    return None


def _rate_failure(request: Any, group: str, increment: bool, sender: object) -> Outcome:
    """The outcome of a call whose rate callable raised: the group's failure mode
    (``RATELIMIT_FAIL_OPEN``) with reason ``policy_unknown``, as a DRF rate that cannot
    be used (docs/failures.md); recorded on the request, and a refusal announced, when it
    counts."""
    policy_id = generated_policy_id(Generated.RATELIMIT, group)
    mode = "open" if _fail_open() else "closed"
    outcome = limiter.policy_unknown(policy_id, mode, cause="has a rate callable that raised")
    if increment:
        lease = Lease()
        ledger_of(request).record([outcome], lease)
        lease.end()
    _announce(request, sender, outcome, increment and outcome.decision == FAILED_CLOSED)
    return outcome


def _peek(policy: Policy, subject: Subject) -> Prepared:
    """The evaluation a peek of ``policy`` runs (nothing charged)."""
    return limiter.get_limiter().prepare([policy], subject.for_policy, 1, peek=True)


def _decide(request: Any, found: _Limit, increment: bool, sender: object) -> Outcome | None:
    """The outcome of a resolved call: its rate's failure, its charge (``increment``)
    or a peek; None for a rate of 0."""
    policy = found.policy
    if found.failed is not None:
        return _rate_failure(request, found.failed, increment, sender)
    if policy is None:
        return None
    if increment:
        lease = Lease()
        decision = decide(request, [policy], found.reading, 1, lease=lease)
        # The outcome stays on request._quota (headers, ``outcomes()``), but a later call,
        # even for the same group on the same request, is charged on its own, as in
        # django-ratelimit.
        lease.end()
        _announce(request, sender, decision.refusing, decision.announces)
        return decision.outcomes[0]
    subject = found.reading.subject(request)
    skipped = _read(policy, subject)
    if skipped is not None:
        return skipped
    return limiter.get_limiter().run(_peek(policy, subject))[0]


async def _adecide(request: Any, found: _Limit, increment: bool, sender: object) -> Outcome | None:
    """Async twin of :func:`_decide`: the project's code (a signal's receivers, the
    subject's database sources) runs in a worker thread."""
    policy = found.policy
    if found.failed is not None:
        return await sync_to_async(_rate_failure)(request, found.failed, increment, sender)
    if policy is None:
        return None
    if increment:
        lease = Lease()
        decision = await adecide(request, [policy], found.reading, 1, lease=lease)
        lease.end()
        if decision.refusing is not None and decision.announces:
            await sync_to_async(_announce)(request, sender, decision.refusing, True)
        return decision.outcomes[0]
    subject = found.reading.subject(request)
    if found.reading.blocks([policy]):
        skipped = await sync_to_async(_read)(policy, subject, True)
    else:
        skipped = _read(policy, subject)
    if skipped is not None:
        return skipped
    return (await limiter.get_limiter().arun(_peek(policy, subject)))[0]


# -- public API ----------------------------------------------------------------------------
def usage_and_outcome(
    request: Any,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: Any = ALL,
    increment: bool = False,
) -> tuple[Usage | None, Outcome | None]:
    """:func:`get_usage` and the engine's :class:`~django_quota.core.outcome.Outcome`
    (None when nothing was evaluated)."""
    found = _resolve(request, group, fn, key, rate, method)
    if found is None:
        return None, None
    outcome = _decide(request, found, increment, fn)
    return _usage(found, outcome), outcome


async def ausage_and_outcome(
    request: Any,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: Any = ALL,
    increment: bool = False,
) -> tuple[Usage | None, Outcome | None]:
    """Async twin of :func:`usage_and_outcome`: a key or rate that may run the project's
    code or read ``request.user`` is resolved in a worker thread."""
    if _needs_thread(key, rate):
        found = await sync_to_async(_resolve)(request, group, fn, key, rate, method)
    else:
        found = _resolve(request, group, fn, key, rate, method)
    if found is None:
        return None, None
    outcome = await _adecide(request, found, increment, fn)
    return _usage(found, outcome), outcome


def get_usage(
    request: Any,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: Any = ALL,
    increment: bool = False,
) -> Usage | None:
    """django-ratelimit's usage of ``request`` under ``group`` (or the group of the view
    ``fn``): ``{"count", "limit", "should_limit", "time_left"}``, or None when nothing
    limits the request (``RATELIMIT_ENABLE`` off, another ``method``, a rate of None, a
    failure with ``RATELIMIT_FAIL_OPEN``).

    ``key``: ``"ip"``, ``"user"``, ``"user_or_ip"``, ``"get:<name>"``, ``"post:<name>"``,
    ``"header:<name>"``, a callable ``(group, request)`` or its dotted path. ``rate``:
    ``"<count>/<period>"``, a ``(count, seconds)`` tuple, None, or a callable ``(group,
    request)`` (or its dotted path) returning one. ``increment=True`` counts the request
    (one evaluation: admitted only while the window has room); ``increment=False``
    asks whether a request would be limited now, counting nothing.

    Raises ``ImproperlyConfigured`` without ``group`` or ``fn``, without ``key``, for an
    unknown key or a rate that does not parse; ``InvalidCacheBackendError`` when
    ``RATELIMIT_USE_CACHE`` names no cache.
    """
    return usage_and_outcome(request, group, fn, key, rate, method, increment)[0]


async def aget_usage(
    request: Any,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: Any = ALL,
    increment: bool = False,
) -> Usage | None:
    """Async twin of :func:`get_usage`."""
    return (await ausage_and_outcome(request, group, fn, key, rate, method, increment))[0]


def is_ratelimited(
    request: Any,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: Any = ALL,
    increment: bool = False,
) -> bool:
    """Whether ``request`` is limited: :func:`get_usage`'s ``should_limit`` (False when it
    returns None). Raises as :func:`get_usage` does."""
    usage = get_usage(request, group, fn, key, rate, method, increment)
    return False if usage is None else bool(usage["should_limit"])


async def ais_ratelimited(
    request: Any,
    group: str | None = None,
    fn: Any = None,
    key: Any = None,
    rate: Any = None,
    method: Any = ALL,
    increment: bool = False,
) -> bool:
    """Async twin of :func:`is_ratelimited`."""
    usage = await aget_usage(request, group, fn, key, rate, method, increment)
    return False if usage is None else bool(usage["should_limit"])


for _function in (is_ratelimited, ais_ratelimited, get_usage, aget_usage):
    setattr(_function, "ALL", ALL)  # noqa: B010 (mypy: a function has no such attribute)
    setattr(_function, "UNSAFE", UNSAFE)  # noqa: B010
