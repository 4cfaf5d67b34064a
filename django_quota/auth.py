"""Login protection (``docs/login.md``): :class:`QuotaLoginBackend` and the
``user_login_failed`` receiver that charges ``QUOTA["LOGIN_POLICIES"]``.

- Listed first in ``AUTHENTICATION_BACKENDS``, the backend peeks the login policies for
  the attempt (the submitted username and the client IP) before any other backend checks
  a password; when one is exhausted it raises ``PermissionDenied``, which makes Django's
  ``authenticate()`` stop, and records the refusal for the request.
- ``QuotaMiddleware`` turns a response to a request whose login was refused into the 429
  (or 503) problem response with ``Retry-After``, whatever the login view answered
  (Django's ``LoginView``, the admin login, DRF's ``obtain_auth_token``).
- Each ``user_login_failed`` signal charges each login policy once, except for the
  attempts the backend refused (they checked no password). A successful login charges
  nothing.
"""

from __future__ import annotations

import contextvars
import logging
import unicodedata
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from django.contrib.auth import get_backends, get_user_model
from django.contrib.auth.backends import BaseBackend
from django.contrib.auth.signals import user_login_failed
from django.core.exceptions import PermissionDenied
from django.dispatch import receiver

from django_quota import conf, limiter, metrics, policies
from django_quota.core.identity import IdentityError
from django_quota.core.outcome import DENIED_DECISION, FAILED_CLOSED, Outcome
from django_quota.core.policy import Policy
from django_quota.ledger import django_request
from django_quota.subjects import ip_value

logger = logging.getLogger("django_quota")

BACKEND_PATH = "django_quota.auth.QuotaLoginBackend"
#: The dimensions a login policy's selector may use (docs/login.md).
LOGIN_DIMENSIONS = frozenset({"user", "ip"})

#: The refusal of a request's login attempt, by Django's ``HttpRequest``.
_refusals: weakref.WeakKeyDictionary[Any, Outcome] = weakref.WeakKeyDictionary()
#: The refusal of an attempt made without a request (``authenticate(request=None)``).
_refused_here: contextvars.ContextVar[Outcome | None] = contextvars.ContextVar(
    "django_quota_login_refused", default=None
)


def submitted_username(credentials: Mapping[str, Any]) -> str | None:
    """The username of an attempt as login policies count it (docs/login.md): as
    ``ModelBackend`` reads it (``username``, else the user model's ``USERNAME_FIELD``),
    normalised as the user model normalises that field (``normalize_username``: Unicode
    NFKC), then without surrounding whitespace and case-folded (NFKC again after the
    folding), so that ``Alice``, ``ALICE`` and `` alice`` share one counter: a login
    that ignores case (an e-mail address, a case-insensitive user model or collation)
    cannot be given more attempts by varying it. None when absent, blank or not text."""
    model = get_user_model()
    value = credentials.get("username")
    if value is None:
        value = credentials.get(model.USERNAME_FIELD)
    if not isinstance(value, str) or not value:
        return None
    normalize = getattr(model, "normalize_username", None)
    if normalize is not None:
        value = normalize(value)
    folded = unicodedata.normalize("NFKC", value.strip().casefold())
    return folded or None


def login_policies() -> list[Policy]:
    """The enabled policies ``QUOTA["LOGIN_POLICIES"]`` names (an undefined id is
    reported by check E009 and skipped here, with an error logged once per process)."""
    settings = conf.get_settings()
    if not settings.enabled or not settings.login_policies:
        return []
    known = policies.get_registry().policies
    found = []
    for policy_id in settings.login_policies:
        policy = known.get(policy_id)
        if policy is None:
            limiter.policy_unknown(policy_id, "open", cause="is in LOGIN_POLICIES but not defined")
        elif policy.enabled:
            found.append(policy)
    return found


def _subjects(
    request: Any, credentials: Mapping[str, Any], group: Sequence[Policy]
) -> tuple[list[Policy], dict[str, dict[str, object]]]:
    """The policies whose selector resolves for this attempt, and their subjects: ``user``
    is the submitted username, ``ip`` the client IP (missing without a request)."""
    values: dict[str, object] = {"user": submitted_username(credentials)}
    values["ip"] = None if request is None else ip_value(django_request(request))
    current = limiter.get_limiter()
    found: list[Policy] = []
    subjects: dict[str, dict[str, object]] = {}
    for policy in group:
        subject = {dimension: values.get(dimension) for dimension in policy.selector}
        try:
            current.identity(policy, subject)
        except (IdentityError, TypeError):
            continue  # a login policy never refuses an attempt it cannot identify
        found.append(policy)
        subjects[policy.id] = subject
    return found, subjects


def refusal(request: Any) -> Outcome | None:
    """The outcome that refused ``request``'s login attempt, if the backend refused one."""
    if request is None or not _refusals:
        return None
    return _refusals.get(django_request(request))


class QuotaLoginBackend(BaseBackend):
    """Refuse a login attempt before any password is checked when a login policy is
    exhausted for it. Authenticates nobody itself: list it first in
    ``AUTHENTICATION_BACKENDS``, before the backends that check passwords."""

    def authenticate(self, request: Any, **credentials: Any) -> None:
        """Raise ``PermissionDenied`` when a login policy refuses the attempt (exhausted,
        or failing closed); return None (let the next backend decide) otherwise."""
        group = login_policies()
        if not group:
            return None
        group, subjects = _subjects(request, credentials, group)
        if not group:
            return None
        current = limiter.get_limiter()
        prepared = current.prepare(group, lambda policy: subjects[policy.id], 1, peek=True)
        found = current.run(prepared)
        refusing = _refusing(found)
        if refusing is None:
            return None
        metrics.record_outcomes(group, [refusing])
        if request is not None:
            _refusals[django_request(request)] = refusing
        else:
            _refused_here.set(refusing)
        raise PermissionDenied("too many failed login attempts")

    def get_user(self, user_id: Any) -> Any:
        """The user of a session recorded with this backend, found by the backends after
        it. Django records the first of ``AUTHENTICATION_BACKENDS`` for a login made
        without a backend (the test client's ``force_login``, ``login(request, user)`` for
        a user not from ``authenticate()``); without this, every such session would be
        anonymous (docs/login.md)."""
        for backend in get_backends():
            if isinstance(backend, QuotaLoginBackend):
                continue
            user = backend.get_user(user_id)
            if user is not None:
                return user
        return None


def _refusing(found: Sequence[Outcome]) -> Outcome | None:
    denied = [o for o in found if o.decision == DENIED_DECISION]
    if denied:
        return max(denied, key=lambda o: o.retry_after or 0)
    return next((o for o in found if o.decision == FAILED_CLOSED), None)


@receiver(user_login_failed, dispatch_uid="django_quota.auth.charge_failed_login")
def charge_failed_login(
    sender: object, credentials: Mapping[str, Any], request: Any = None, **kwargs: Any
) -> None:
    """Charge each login policy once for a failed attempt; nothing for an attempt
    :class:`QuotaLoginBackend` refused (no password was checked)."""
    if request is not None and django_request(request) in _refusals:
        return
    if request is None and _refused_here.get() is not None:
        _refused_here.set(None)
        return
    group = login_policies()
    if not group:
        return
    group, subjects = _subjects(request, credentials, group)
    for policy in group:
        limiter.evaluate_policies([policy], subjects[policy.id])


__all__ = [
    "BACKEND_PATH",
    "QuotaLoginBackend",
    "charge_failed_login",
    "refusal",
    "submitted_username",
]
