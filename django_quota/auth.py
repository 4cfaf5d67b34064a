"""Login protection (``docs/login.md``): :class:`QuotaLoginBackend` and the
``user_login_failed`` receiver that charges ``QUOTA["LOGIN_POLICIES"]``.

- Listed first in ``AUTHENTICATION_BACKENDS``, the backend charges the login policies for
  the attempt (the submitted username and the client IP) before any other backend checks
  a password, so that concurrent attempts never check more passwords than the policies
  allow; when one is exhausted it raises ``PermissionDenied``, which makes Django's
  ``authenticate()`` stop, and records the refusal for the request. Admitted, it asks the
  backends after it itself: a user found refunds the charge (a successful login costs
  nothing); none found keeps it, and ``PermissionDenied`` makes Django send
  ``user_login_failed`` without asking those backends a second time.
- ``QuotaMiddleware`` turns a response to a request whose login was refused into the 429
  (or 503) problem response with ``Retry-After``, whatever the login view answered
  (Django's ``LoginView``, the admin login, DRF's ``obtain_auth_token``).
- Each ``user_login_failed`` signal charges each login policy once, except for the
  attempts the backend refused (they checked no password) or charged already. A
  successful login charges nothing.
"""

from __future__ import annotations

import inspect
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from django.contrib.auth import get_backends, get_user_model
from django.contrib.auth.backends import BaseBackend
from django.contrib.auth.signals import user_login_failed
from django.core.exceptions import PermissionDenied
from django.dispatch import receiver
from django.views.decorators.debug import sensitive_variables

from django_quota import conf, limiter, policies
from django_quota.core.identity import IdentityError
from django_quota.core.log import logger
from django_quota.core.outcome import ALLOWED, DENIED_DECISION, FAILED_CLOSED, Outcome
from django_quota.core.policy import Policy
from django_quota.core.process import PROCESS
from django_quota.ledger import django_request, ledger_if_any, ledger_of
from django_quota.subjects import ip_value

BACKEND_PATH = "django_quota.auth.QuotaLoginBackend"
#: The dimensions a login policy's selector may use (docs/login.md).
LOGIN_DIMENSIONS = frozenset({"user", "ip"})

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
    found = None if request is None else ledger_if_any(request)
    return None if found is None else found.login_refusal


class QuotaLoginBackend(BaseBackend):
    """Refuse a login attempt before any password is checked when a login policy is
    exhausted for it, and refund a successful one. Checks no password itself: list it
    first in ``AUTHENTICATION_BACKENDS``, before the backends that check passwords,
    which it asks in their order for the attempts its policies admit."""

    @sensitive_variables("credentials")
    def authenticate(self, request: Any, **credentials: Any) -> Any:
        """Charge the login policies for the attempt, then ask the backends after this
        one. Raise ``PermissionDenied`` when a login policy refuses the attempt
        (exhausted, or failing closed: nothing charged, no password checked) and when no
        backend accepts the credentials (the charge stays; Django then sends
        ``user_login_failed``); return the user one of them found, the charge refunded.
        Without login policies for the attempt, return None (Django asks the next
        backends itself)."""
        group = login_policies()
        if not group:
            return None
        group, subjects = _subjects(request, credentials, group)
        if not group:
            return None
        found = limiter.evaluate_policies(group, lambda policy: subjects[policy.id], 1)
        refusing = _refusing(found)
        if refusing is not None:
            if request is not None:
                ledger_of(request).login_refusal = refusing
            else:
                PROCESS.login_attempt.set((refusing, PROCESS.login_attempt.get()[1]))
            raise PermissionDenied("too many failed login attempts")
        user = _authenticate_after(request, credentials)
        if user is not None:
            _refund(group, subjects, found)
            return user
        if request is not None:
            ledger_of(request).login_charged = True
        else:
            PROCESS.login_attempt.set((PROCESS.login_attempt.get()[0], True))
        raise PermissionDenied("invalid credentials")

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


@sensitive_variables("credentials")
def _authenticate_after(request: Any, credentials: Mapping[str, Any]) -> Any:
    """The user the backends after :class:`QuotaLoginBackend` find for ``credentials``,
    asked as ``django.contrib.auth.authenticate()`` asks them (a backend whose
    ``authenticate`` cannot take them is skipped; ``PermissionDenied`` stops); None when
    none does. The user's ``backend`` is the one that found it, as Django sets it."""
    for backend in get_backends():
        if isinstance(backend, QuotaLoginBackend):
            continue
        try:
            inspect.signature(backend.authenticate).bind(request, **credentials)
        except TypeError:
            continue
        try:
            user = backend.authenticate(request, **credentials)
        except PermissionDenied:
            return None
        if user is not None:
            return user
    return None


def _refund(
    group: Sequence[Policy], subjects: Mapping[str, Mapping[str, object]], found: Sequence[Outcome]
) -> None:
    """Refund what the attempt charged (a successful login costs nothing); a failure is
    logged, never raised: the login goes on."""
    by_id = {policy.id: policy for policy in group}
    for outcome in found:
        policy = by_id.get(outcome.policy)
        if policy is None or outcome.decision != ALLOWED:
            continue
        try:
            limiter.refund_charge(
                limiter.refund_request(policy, subjects[policy.id], outcome.evaluation_id)
            )
        except Exception as exc:  # the login succeeded: never fail it
            logger.warning(
                "quota refund of a successful login failed, the charge stays: policy=%s "
                "error=%s",
                policy.id,
                type(exc).__name__,
            )


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
    if request is not None:
        found = ledger_if_any(request)
        if found is not None and found.login_refusal is not None:
            return
        if found is not None and found.login_charged:
            found.login_charged = False
            return
    else:
        refused, charged = PROCESS.login_attempt.get()
        if refused is not None:
            PROCESS.login_attempt.set((None, charged))
            return
        if charged:
            PROCESS.login_attempt.set((None, False))
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
