"""DRF throttles backed by django-quota (``docs/drf.md``).

``QuotaThrottle`` applies named policies (the view's ``quota_policies``, or the policy
named by its ``throttle_scope``) as one layer. ``AnonRateThrottle``, ``UserRateThrottle``
and ``ScopedRateThrottle`` (on the base ``SimpleRateThrottle``) replace DRF's classes of
the same names: a project switches by changing its import lines. Each throttle is one
layer (one backend call), charges on its own, and reuses the outcome of a policy that an
earlier layer already decided for the request.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.translation import gettext_lazy as _
from rest_framework.exceptions import APIException
from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle

from django_quota import conf, policies, subjects
from django_quota.core.errors import ConfigurationError
from django_quota.core.identity import IdentityError
from django_quota.core.outcome import DENIED_DECISION, FAILED_CLOSED, Outcome
from django_quota.core.policy import Policy, Selector, generated_policy_id
from django_quota.core.rates import Grammar, bounds_problem, parse_rate
from django_quota.ledger import Cost, Decision, after_dispatch, decide
from django_quota.messages import Codes
from django_quota.policies import Generated
from django_quota.signals import quota_denied
from django_quota.subjects import PLAIN, GivenSubject, Readable, Reading

__all__ = [
    "AnonRateThrottle",
    "QuotaThrottle",
    "QuotaUnavailable",
    "ScopedRateThrottle",
    "SimpleRateThrottle",
    "UserRateThrottle",
    "drf_num_proxies",
    "parse_drf_rate",
]

#: ``wait()`` never returns less: DRF drops ``Retry-After`` when ``wait()`` is 0.
MIN_WAIT = 0.001

Subject = dict[str, object]


def named_policy_ids(view: Any, default: Sequence[str] | str | None = None) -> list[str]:
    """The policy ids a ``QuotaThrottle`` applies to ``view`` (a view or view class): its
    ``quota_policies``, else the throttle's ``default``, else its ``throttle_scope``."""
    names = getattr(view, "quota_policies", None)
    if names is None:
        names = default
    if names is None:
        scope = getattr(view, "throttle_scope", None)
        names = [scope] if scope else []
    return [names] if isinstance(names, str) else list(names)


class QuotaUnavailable(APIException):
    """The rate limiter could not decide and a policy fails closed: 503.

    ``wait`` is ``FAILURE_RETRY_AFTER``; DRF's exception handler turns it into
    ``Retry-After``, as it does for ``Throttled``. ``outcome`` is the failed outcome.
    """

    status_code = 503
    default_detail = _("The rate limiter is unavailable; retry later.")
    default_code = "quota_unavailable"

    def __init__(
        self,
        wait: int | None = None,
        detail: Any = None,
        code: str | None = None,
        *,
        outcome: Outcome | None = None,
    ) -> None:
        super().__init__(detail, code)
        self.wait = wait
        self.outcome = outcome


def parse_drf_rate(rate: object) -> tuple[int, int]:
    """Parse a drop-in's rate into ``(num_requests, duration_seconds)``.

    Accepts django-quota's rate grammar (``"10/minute"``, ``"100/5m"``, any case: see
    :func:`django_quota.core.rates.parse_rate`) and whatever DRF's own
    ``SimpleRateThrottle.parse_rate`` reads, with DRF's meaning: a count as ``int()``
    reads it, ``/``, and a period of which only the first letter (``s``, ``m``, ``h`` or
    ``d``) counts, so ``"5/mon"`` is 5 per minute; newer DRF's multiplier with a hyphen
    (``"1/2-sec"``) too. Raises ``ImproperlyConfigured`` for anything else and for rates
    outside the bounds (a count of 1 to 10**9, a period of 1 s to 366 d).
    """
    if isinstance(rate, str):
        return _parse_drf_rate_text(rate)
    return _parse_drf_rate(rate)


@functools.lru_cache(maxsize=256)
def _parse_drf_rate_text(rate: str) -> tuple[int, int]:
    """:func:`_parse_drf_rate` remembered: DRF makes a throttle, which reads its rate, for
    every request. A rate that does not parse raises and is not remembered."""
    return _parse_drf_rate(rate)


def _parse_drf_rate(rate: object) -> tuple[int, int]:
    try:
        parsed = parse_rate(rate)
    except ConfigurationError as exc:
        reading = _drf_reading(rate)
        if reading is None:
            raise ImproperlyConfigured(f"Invalid throttle rate {rate!r}: {exc.message}.") from exc
        num_requests, duration = reading
        problem = bounds_problem(num_requests, duration * 1000)
        if problem is not None:
            raise ImproperlyConfigured(f"Invalid throttle rate {rate!r}: {problem}.") from exc
        return num_requests, duration
    if parsed.calendar in Grammar.CALENDAR_ONLY:
        # DRF reads "N/month" as N per minute, django-quota as a calendar month: refused
        # rather than either meaning chosen silently (docs/drf.md).
        raise ImproperlyConfigured(
            f"Invalid throttle rate {rate!r}: a {parsed.calendar} is a calendar window, "
            "which the drop-in throttles do not count (DRF reads 'N/month' as N per "
            "minute); use QuotaThrottle with a fixed_window policy, or a period in days."
        )
    return parsed.limit, parsed.period_ms // 1000


def _drf_reading(rate: object) -> tuple[int, int] | None:
    """``(count, seconds)`` as DRF reads ``rate``, or None where DRF raises."""
    if not isinstance(rate, str) or rate.count("/") != 1:
        return None
    count, period = rate.split("/")
    # DRF reads the count with int() and only the first character of the period ("5/mon"
    # is 5 per minute); newer DRF lets a multiplier precede it, with a hyphen ("1/2-sec").
    match = re.match(r"(?:(?P<multiplier>[0-9]+)-?)?(?P<unit>[smhd])", period)
    if match is None:
        return None
    try:
        num_requests = int(count)
    except ValueError:  # also int()'s limit on digits: far outside the bounds anyway
        return None
    multiplier = int(match["multiplier"]) if match["multiplier"] else 1
    return num_requests, multiplier * Grammar.UNIT_MS[match["unit"]] // 1000


def _django_request(request: Any) -> Any:
    """The ``HttpRequest`` under a DRF ``Request`` (where the middleware looks)."""
    return getattr(request, "_request", request)


def _authenticated_user(request: Any) -> Any:
    user = getattr(request, "user", None)
    return user if user and user.is_authenticated else None


def drf_num_proxies() -> int | None:
    """DRF's ``REST_FRAMEWORK["NUM_PROXIES"]`` when it is a hop count (an int >= 0).

    The drop-ins count that many trusted hops when neither ``TRUSTED_PROXIES`` nor
    ``PROXY_COUNT`` is set: ``REMOTE_ADDR`` is the first, as in DRF, so they key on the
    ``X-Forwarded-For`` entry DRF's ``get_ident()`` picks. Any other value (DRF's
    default None, or one DRF itself could not use) counts no hop.
    """
    value = api_settings.NUM_PROXIES
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _ip_value(request: Any) -> object:
    return subjects.ip_value(_django_request(request), default_proxy_count=drf_num_proxies())


# -- generated policies --------------------------------------------------------------------
def _rate_policy(
    policy_id: str, num_requests: int, duration: int, selector: tuple[str, ...]
) -> Policy:
    """The generated policy of a drop-in throttle (a configured one with its id wins),
    cached by :func:`django_quota.policies.generated` until settings change."""
    algorithm = conf.get_settings().drf_algorithm

    def build() -> Policy:
        return policies.one_window(
            policy_id, algorithm, num_requests, duration, selector, Generated.DRF
        )

    return policies.generated((policy_id, num_requests, duration, algorithm, selector), build)


def scope_policy(scope: str) -> Policy | None:
    """The policy the drop-in throttles use for ``scope`` (``drf:<scope>``), built from
    ``DEFAULT_THROTTLE_RATES`` as they build it (``anon``: selector ``ip``; any other
    scope: ``auto``, i.e. user when authenticated, else ip), so that operators can name
    it. None when the scope has no rate. A throttle overriding ``get_cache_key`` frames
    its own identities and cannot be rebuilt here."""
    rate = api_settings.DEFAULT_THROTTLE_RATES.get(scope)
    if not isinstance(rate, str):
        return None
    num_requests, duration = parse_drf_rate(rate)
    selector = ("ip",) if scope == AnonRateThrottle.scope else (Selector.AUTO,)
    return _rate_policy(generated_policy_id(Generated.DRF, scope), num_requests, duration, selector)


# -- the throttles -------------------------------------------------------------------------
class QuotaThrottle(BaseThrottle):
    """Apply django-quota policies to a DRF view, as one layer.

    The policies are the view's ``quota_policies`` (policy ids), else this class's
    ``quota_policies``, else the policy named by the view's ``throttle_scope``; a view
    with none of them is not throttled. ``user`` is DRF's ``request.user`` (DRF
    authentication has run), ``api_key`` falls back to ``request.auth``, and ``route`` is
    the view's ``throttle_scope`` when it has one.

    Override :meth:`get_quota_cost` for requests that cost more than 1. Set ``timer`` (a
    callable returning epoch seconds, DRF's test seam) to decide on that clock instead
    of ``QUOTA["CLOCK"]``.
    """

    #: Policy ids applied when the view names none.
    quota_policies: Sequence[str] | None = None
    #: DRF's clock seam; left as ``time.time``, the ``CLOCK`` setting decides.
    timer: Callable[[], float] = time.time

    #: The last :meth:`allow_request`'s decision, which :meth:`wait` and ``outcomes`` read.
    _quota_decision: Decision | None = None
    #: Whether client IPs count DRF's ``NUM_PROXIES`` hops (the drop-ins do).
    _follows_num_proxies = False

    def get_quota_cost(self, request: Any, view: Any) -> int:
        """The cost of this request, an ``int >= 0`` (default 1)."""
        return 1

    def get_quota_policies(self, request: Any, view: Any) -> list[Policy]:
        """The policies this throttle applies to ``view`` (ids resolved at call time).

        An id no source defines is left out: :meth:`allow_request` applies the failure
        mode to it with reason ``policy_unknown``. An override may raise
        :class:`~django_quota.policies.UnknownPolicy`, with the same effect.
        """
        return self._named_policies(view)[0]

    def allow_request(self, request: Any, view: Any) -> bool:
        """Decide the view's policies together; False when one refuses.

        Raises :class:`QuotaUnavailable` when the backend failed, or a named policy is
        not defined, and a policy fails closed.
        """
        self._forget()
        if not conf.get_settings().enabled:
            return True
        unknown: list[str] = []
        if type(self).get_quota_policies is QuotaThrottle.get_quota_policies:
            group, unknown = self._named_policies(view)
        else:
            try:
                group = self.get_quota_policies(request, view)
            except policies.UnknownPolicy as exc:
                group, unknown = [], [exc.policy_id]
        if not group and not unknown:
            return True
        return self._decide(request, view, group, self._reading(view), unknown=unknown)

    def wait(self) -> float | None:
        """Seconds until a retry can succeed (at least 0.001) after a quota denial; None
        when waiting cannot help (identity errors, ``cost_exceeds_limit``) or when the
        request was not refused."""
        found = self.outcomes
        denials = [outcome for outcome in found if outcome.decision == DENIED_DECISION]
        if not denials or any(outcome.retry_after is None for outcome in denials):
            return None
        return max(MIN_WAIT, *(outcome.retry_after or 0 for outcome in denials))

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        """The outcomes of the last :meth:`allow_request` (reused ones included)."""
        decision = self._quota_decision
        return () if decision is None else decision.outcomes

    # -- internals -------------------------------------------------------------------------
    def _forget(self) -> None:
        self._quota_decision = None

    def _named_policies(self, view: Any) -> tuple[list[Policy], list[str]]:
        """The policies the view names, and the ids among them no source defines."""
        found: list[Policy] = []
        unknown: list[str] = []
        for name in dict.fromkeys(named_policy_ids(view, self.quota_policies)):
            try:
                found.append(policies.get_policy(name))
            except policies.UnknownPolicy:
                unknown.append(name)
        return found, unknown

    def _clock(self) -> Callable[[], float] | None:
        timer = self.timer
        return None if getattr(timer, "__func__", timer) is time.time else timer

    def _cost(self, view: Any) -> Cost:
        method = self.get_quota_cost
        if getattr(method, "__func__", method) is QuotaThrottle.get_quota_cost:
            return 1  # the default's answer, without a call back up for each request
        # Named as the method, for the log line of a cost that fails (docs/settings.md).
        return functools.wraps(method)(lambda request: method(request, view))

    def _reading(self, view: Any) -> Reading:
        """How this throttle reads its subject: DRF's ``request.auth`` as the API key, the
        view's ``throttle_scope`` as the route, DRF's ``NUM_PROXIES`` for a drop-in."""
        return Reading(
            drf=True,
            default_proxy_count=drf_num_proxies() if self._follows_num_proxies else None,
            route=getattr(view, "throttle_scope", None),
        )

    def _decide(
        self,
        request: Any,
        view: Any,
        group: Sequence[Policy],
        reading: Readable,
        *,
        unknown: Sequence[str] = (),
        cause: str | None = None,
    ) -> bool:
        """Decide ``group`` as this throttle's layer (``unknown``: ids named but not
        defined, ``cause`` completing their log line); True unless an outcome refuses."""
        cost, clock = self._cost(view), self._clock()
        decision = decide(
            request, group, reading, cost, throttle=self, unknown=unknown, cause=cause, clock=clock
        )
        self._quota_decision = decision
        refusing = decision.refusing
        if refusing is None:
            if decision.held:  # concurrency leases: released when DRF's dispatch is done
                after_dispatch(view)
            return True
        if decision.announces:
            quota_denied.send(sender=type(self), request=request, outcome=refusing)
        if refusing.decision == FAILED_CLOSED:
            raise QuotaUnavailable(conf.get_settings().failure_retry_after, outcome=refusing)
        return False


class _SettingsRates:
    """``THROTTLE_RATES`` read from ``REST_FRAMEWORK`` when accessed, not at import (as
    DRF does), so that ``override_settings`` applies at once. A non-data descriptor: a
    subclass or an instance may assign its own mapping."""

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        return api_settings.DEFAULT_THROTTLE_RATES


class SimpleRateThrottle(QuotaThrottle):
    """DRF's ``SimpleRateThrottle`` on django-quota: subclass it and override
    ``get_cache_key()``; its value is the identity (dimension ``drf_cache_key``), and
    None means not throttled. The policy id is ``drf:<scope>``.
    """

    cache_format = "throttle_%(scope)s_%(ident)s"
    _follows_num_proxies = True
    scope: str | None = None
    rate: str | None = None
    THROTTLE_RATES: Any = _SettingsRates()
    key: str | None = None
    num_requests: int | None = None
    duration: int | None = None

    def __init__(self) -> None:
        if not getattr(self, "rate", None):
            self.rate = self.get_rate()
        self._read_rate()

    def _read_rate(self) -> None:
        """Set ``num_requests`` and ``duration`` from ``rate``; (None, None) when the rate
        cannot be used: :meth:`allow_request` then applies the failure mode (a rate is
        configuration, so it never answers 500; check E013 reports it before deploy)."""
        try:
            self.num_requests, self.duration = self.parse_rate(self.rate)
        except ImproperlyConfigured:
            self.num_requests = self.duration = None

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        """A unique key for the requester, or None to let the request through."""
        raise NotImplementedError(".get_cache_key() must be overridden")

    def get_rate(self) -> str | None:
        """The rate of ``scope`` in ``THROTTLE_RATES`` (``DEFAULT_THROTTLE_RATES``).

        Raises ``ImproperlyConfigured`` when neither ``scope`` nor ``rate`` is set, or
        when ``scope`` has no rate.
        """
        if not getattr(self, "scope", None):
            raise ImproperlyConfigured(
                f"You must set either `.scope` or `.rate` for '{type(self).__name__}' throttle"
            )
        try:
            rate: str | None = self.THROTTLE_RATES[self.scope]
        except KeyError:
            raise ImproperlyConfigured(
                f"No default throttle rate set for '{self.scope}' scope"
            ) from None
        return rate

    def parse_rate(self, rate: str | None) -> tuple[int | None, int | None]:
        """``(num_requests, duration in seconds)``, or ``(None, None)`` for no rate."""
        if rate is None:
            return None, None
        return parse_drf_rate(rate)

    def get_ident(self, request: Any) -> Any:
        """The client IP as django-quota resolves it, or None: ``TRUSTED_PROXIES`` or
        ``PROXY_COUNT`` when set, else DRF's ``NUM_PROXIES`` (the entry DRF picks), then
        normalised (port stripped, IPv6 as its ``IPV6_PREFIX`` network)."""
        hops = drf_num_proxies()
        try:
            return subjects.request_ip(_django_request(request), default_proxy_count=hops)
        except IdentityError:
            return None

    def allow_request(self, request: Any, view: Any) -> bool:
        """Charge one request of ``get_quota_cost()`` to the requester; False when refused."""
        self._forget()
        if self.rate is None or not conf.get_settings().enabled:
            return True
        identified: tuple[tuple[str, ...], Subject] | None
        if self._overrides_cache_key():
            self.key = self.get_cache_key(request, view)
            if self.key is None:
                return True
            key = subjects.identity_value(self.key)
            identified = (Generated.DRF_CACHE_KEY,), {Generated.DRF_CACHE_KEY: key}
        else:
            identified = self._identify(request)
            if identified is None:
                return True
        selector, own = identified
        try:
            num_requests, duration = parse_drf_rate(self.rate)
        except ImproperlyConfigured as exc:
            return self._unusable_rate(request, view, exc)
        policy = _rate_policy(self._policy_id(), num_requests, duration, selector)
        reading: Readable = GivenSubject(own)
        if policy.source != Generated.DRF:
            # A policy configured under the same id replaces ours: it gets its own subject.
            reading = self._reading(view)
        return self._decide(request, view, [policy], reading)

    # -- internals -------------------------------------------------------------------------
    def _unusable_rate(self, request: Any, view: Any, error: ImproperlyConfigured) -> bool:
        """Decide a request whose rate is missing or cannot be parsed as an undefined
        policy is decided: a policy configured under this throttle's id still applies;
        otherwise :func:`django_quota.limiter.policy_unknown` (the failure mode with
        reason ``policy_unknown``, one error line per policy id and process)."""
        policy_id = self._policy_id()
        configured = policies.get_registry().policies.get(policy_id)
        if configured is not None:
            return self._decide(request, view, [configured], self._reading(view))
        cause = (
            f"has no usable DRF throttle rate for scope {self.scope!r} "
            f"({error}; {Codes.E_DRF_RATE})"
        )
        return self._decide(request, view, [], PLAIN, unknown=[policy_id], cause=cause)

    def _policy_id(self) -> str:
        if self.scope:
            return generated_policy_id(Generated.DRF, self.scope)
        cls = type(self)
        return generated_policy_id("drf", f"{cls.__module__}.{cls.__qualname__}")

    def _overrides_cache_key(self) -> bool:
        method = self.get_cache_key
        return getattr(method, "__func__", method) not in _DEFAULT_CACHE_KEYS

    def _identify(self, request: Any) -> tuple[tuple[str, ...], Subject] | None:
        """``(selector, subject)`` of the requester when ``get_cache_key`` is one of the
        drop-ins' own (so client IPs are normalised as everywhere in django-quota), or
        None when the request is not throttled."""
        raise NotImplementedError


def _user_or_ip(request: Any) -> tuple[tuple[str, ...], Subject]:
    user = _authenticated_user(request)
    if user is not None:
        # A pk of None is a missing identity, never one counter shared as "None".
        return (Selector.AUTO,), {"user": None if user.pk is None else str(user.pk)}
    return (Selector.AUTO,), {"ip": _ip_value(request)}


class AnonRateThrottle(SimpleRateThrottle):
    """Limit unauthenticated requests by client IP (scope ``anon``); authenticated
    requests are not throttled."""

    scope = "anon"

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        """DRF's key: ``throttle_anon_<ip>``, None for an authenticated request."""
        if _authenticated_user(request) is not None:
            return None
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}

    def _identify(self, request: Any) -> tuple[tuple[str, ...], Subject] | None:
        if _authenticated_user(request) is not None:
            return None
        return ("ip",), {"ip": _ip_value(request)}


class _PerUserOrIp(SimpleRateThrottle):
    """Per user when authenticated, else per client IP: DRF's user and scoped throttles."""

    def get_cache_key(self, request: Any, view: Any) -> str | None:
        """DRF's key: ``throttle_<scope>_<pk or ip>``."""
        user = _authenticated_user(request)
        ident = user.pk if user is not None else self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}

    def _identify(self, request: Any) -> tuple[tuple[str, ...], Subject] | None:
        return _user_or_ip(request)


class UserRateThrottle(_PerUserOrIp):
    """Limit requests by user when authenticated, else by client IP (scope ``user``)."""

    scope = "user"


class ScopedRateThrottle(_PerUserOrIp):
    """Limit each view by the rate of its ``throttle_scope``, per user when
    authenticated, else per client IP. Views without a scope are not throttled."""

    scope_attr = "throttle_scope"

    def __init__(self) -> None:
        # The scope, hence the rate, is known only once a view calls.
        pass

    def allow_request(self, request: Any, view: Any) -> bool:
        """Throttle by the view's scope (``THROTTLE_RATES[view.throttle_scope]``)."""
        self._forget()
        self.scope = getattr(view, self.scope_attr, None)
        if not self.scope:
            return True
        try:
            self.rate = self.get_rate()
        except ImproperlyConfigured as exc:  # the scope has no rate: never a 500
            self.rate = None
            return self._unusable_rate(request, view, exc)
        self._read_rate()
        return super().allow_request(request, view)


_DEFAULT_CACHE_KEYS = frozenset(
    {
        AnonRateThrottle.get_cache_key,
        _PerUserOrIp.get_cache_key,
    }
)
