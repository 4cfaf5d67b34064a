"""The usage view (``docs/usage.md``): the caller's state under every enabled, enforced
policy whose selector resolves for the request, peeked (nothing charged, nothing
written), as JSON. Exposed as :func:`django_quota.views.usage`.

The view is never limited itself: the middleware skips a request whose URL resolves to
it (:func:`is_usage_request`), DRF's ``api_view`` copies its empty ``throttle_classes``,
and it is not decorated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, URLResolver, get_resolver
from django.views.decorators.http import require_safe

from django_quota import conf, limiter, policies
from django_quota.core.identity import IdentityError
from django_quota.core.outcome import FAILED_CLOSED, FAILED_OPEN, Outcome
from django_quota.core.policy import Policy
from django_quota.core.process import PROCESS
from django_quota.routes import Kept, resolver_match
from django_quota.subjects import RequestSubject


def _state(outcome: Outcome) -> dict[str, object]:
    return {
        "policy": outcome.policy,
        "window": outcome.window,
        "limit": outcome.limit,
        "remaining": outcome.remaining,
        "reset_after": outcome.reset_after,
        "windows": [
            {
                "name": window.name,
                "limit": window.limit,
                "period": window.period,
                "remaining": window.remaining,
                "reset_after": window.reset_after,
                "retry_after": window.retry_after,
            }
            for window in outcome.windows
        ],
    }


def _login_username(request: Any) -> str | None:
    """The signed-in caller's username as a login policy counts it (the submitted
    username, normalised: docs/login.md), or None for an anonymous caller."""
    user = getattr(request, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    # Imported here: django_quota.auth needs django.contrib.auth installed, the view not.
    from django_quota.auth import submitted_username

    return submitted_username({"username": user.get_username()})


def _resolving(
    group: Sequence[Policy], subject: RequestSubject, request: Any = None
) -> tuple[list[Policy], dict[str, Mapping[str, object]]]:
    """The policies whose selector gives the request a valid identity, and their subjects.
    A login policy's ``user`` is the caller's username, as its failed logins are counted,
    not the user's primary key (docs/usage.md)."""
    current = limiter.get_limiter()
    login = set(conf.get_settings().login_policies)
    found: list[Policy] = []
    subjects: dict[str, Mapping[str, object]] = {}
    for policy in group:
        values = subject.for_policy(policy)
        if policy.id in login and "user" in values:
            values = {**values, "user": _login_username(request)}
        try:
            current.identity(policy, values)
        except (IdentityError, TypeError):
            continue
        found.append(policy)
        subjects[policy.id] = values
    return found, subjects


def peek_request(request: Any) -> list[Outcome]:
    """Peek, as one group (one backend call), every enabled and enforced policy whose
    selector resolves for ``request`` and that the request is not exempt from, in
    registry order. ``request`` may be DRF's ``Request`` (then ``user`` and ``api_key``
    are DRF's)."""
    registry = policies.get_registry()
    candidates = [p for p in registry.policies.values() if p.enabled and not p.shadow]
    subject = RequestSubject(request, drf_auth=getattr(request, "auth", None))
    group, subjects = _resolving(candidates, subject, request)
    if not group:
        return []
    exempt = {policy.id for policy in subject.exempt(group)}
    if exempt:
        group = [policy for policy in group if policy.id not in exempt]
    if not group:
        return []
    # The caller's plan sets the limits of the policies with plans (docs/plans.md).
    plan = subject.plan() if any(policy.plans for policy in group) else None
    current = limiter.get_limiter()
    prepared = current.prepare(
        group, lambda policy: subjects[policy.id], 1, peek=True, plan=plan
    )
    return current.run(prepared)


@require_safe
def usage(request: HttpRequest) -> HttpResponse:
    """``{"policies": [{"policy", "window", "limit", "remaining", "reset_after",
    "windows"}]}`` for the caller, times in seconds, nothing charged; 503 (with
    ``Retry-After``) when the backend cannot answer. ``Cache-Control: no-store``."""
    found = peek_request(request)
    failed = next((o for o in found if o.decision in (FAILED_OPEN, FAILED_CLOSED)), None)
    if failed is not None:
        retry_after = conf.get_settings().failure_retry_after
        body = {
            "type": "about:blank",
            "title": "Service Unavailable",
            "status": 503,
            "detail": "The rate limiter could not read the usage.",
            "reason": failed.reason,
            "policy": failed.policy,
        }
        response = HttpResponse(
            json.dumps(body), status=503, content_type="application/problem+json"
        )
        response["Retry-After"] = str(retry_after)
    else:
        response = JsonResponse({"policies": [_state(outcome) for outcome in found]})
    response["Cache-Control"] = "no-store"
    return response


# DRF's ``api_view`` copies these: ``api_view(["GET"])(usage)`` is never throttled and
# keeps DRF's own authentication (docs/usage.md).
usage.throttle_classes = []  # type: ignore[attr-defined]
usage.quota_usage_view = True  # type: ignore[attr-defined]


# -- the middleware's side ------------------------------------------------------------------
def is_usage_view(callback: object) -> bool:
    """True for :func:`usage`, and for DRF's ``api_view`` wrapping of it (a class that
    keeps the function's module and name)."""
    if getattr(callback, "quota_usage_view", False):
        return True
    cls = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    return (
        cls is not None
        and getattr(cls, "__module__", None) == __name__
        and getattr(cls, "__name__", None) == usage.__name__
    )


def _mounts(patterns: Sequence[URLPattern | URLResolver]) -> bool:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            if _mounts(pattern.url_patterns):
                return True
        elif is_usage_view(pattern.callback):
            return True
    return False


def is_usage_request(request: HttpRequest, kept: Kept | None = None) -> bool:
    """True when ``request`` is for the usage view. Costs one URL resolution (kept in
    ``kept``, the request's ledger) only when the URLconf mounts the view somewhere; a
    URLconf is walked once."""
    resolver = get_resolver(getattr(request, "urlconf", None))
    mounted = PROCESS.mounted.get(resolver)
    if mounted is None:
        mounted = PROCESS.mounted[resolver] = _mounts(resolver.url_patterns)
    if not mounted:
        return False
    match = resolver_match(request, kept)
    return match is not None and is_usage_view(match.func)


__all__ = ["is_usage_request", "peek_request", "usage"]
