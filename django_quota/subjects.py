"""What a request says, each source read at most once: who it is, as the raw subject of
each policy's selector (session user, API key, client IP behind trusted proxies, route,
tenant: ``docs/subjects.md``), its plan (``docs/plans.md``), and the policies it is
exempt from (a policy's ``exempt`` networks, ``QUOTA["EXEMPT_WHEN"]``:
``docs/policies.md#exemptions``). A layer says how it reads (:class:`Reading`); its step
(:func:`django_quota.ledger.decide`) does the reading."""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from django.http import HttpRequest
from django.utils.module_loading import import_string

from django_quota import conf
from django_quota.core.identity import INVALID_VALUE, IdentityError, client_ip
from django_quota.core.log import logger
from django_quota.core.policy import Policy, Selector
from django_quota.core.process import PROCESS
from django_quota.routes import Kept, route_value

#: A raw value the core always reports as ``selector_identity_invalid`` (a control char).
_INVALID = "\x00invalid"


def request_ip(request: HttpRequest, *, default_proxy_count: int | None = None) -> str:
    """The normalised client IP (raises ``IdentityError`` when invalid or missing).

    ``default_proxy_count`` counts the trusted hops when neither ``TRUSTED_PROXIES`` nor
    ``PROXY_COUNT`` is set: the drop-in DRF throttles pass DRF's ``NUM_PROXIES``, so they
    pick the ``X-Forwarded-For`` entry DRF's ``get_ident()`` picks (docs/drf.md).
    """
    settings = conf.get_settings()
    headers = request.META.get("HTTP_X_FORWARDED_FOR")
    proxy_count = settings.proxy_count
    if proxy_count is None and not settings.trusted_proxies:
        proxy_count = default_proxy_count
    return client_ip(
        request.META.get("REMOTE_ADDR"),
        headers,
        trusted_proxies=settings.trusted_proxies,
        proxy_count=proxy_count,
        ipv6_prefix=settings.ipv6_prefix,
    )


def ip_value(request: HttpRequest, *, default_proxy_count: int | None = None) -> object:
    """The ``ip`` dimension's raw value: :func:`request_ip`, None when the client IP is
    missing, or a value the core reports as ``selector_identity_invalid``."""
    try:
        return request_ip(request, default_proxy_count=default_proxy_count)
    except IdentityError as exc:
        return None if exc.reason == "selector_identity_missing" else _INVALID


def identity_value(value: object) -> object:
    """A value read from a request (a resolver's answer, DRF's ``request.auth``) as the
    core takes it, so that a request never raises ``TypeError``: ``str``, ``int``,
    ``uuid.UUID`` and ``None`` as they are, UTF-8 bytes as their text; anything else
    (other bytes, ``bool``, an object) is an invalid identity."""
    if value is None or isinstance(value, str | uuid.UUID):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return INVALID_VALUE
    return INVALID_VALUE


def client_address(
    request: Any, *, default_proxy_count: int | None = None
) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
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


def _asks(path: str, request: Any) -> bool:
    """What ``EXEMPT_WHEN`` says of ``request``. A predicate that fails (it raises, or
    cannot be imported) exempts nothing: the request is limited as if it were not set,
    and the exception is logged on the ``django_quota`` logger with its traceback, each
    time (docs/policies.md#exemptions). A broken predicate must neither answer 500 nor
    lift the limits."""
    try:
        predicate = PROCESS.exempt_when.get(path)
        if predicate is None:
            predicate = PROCESS.exempt_when[path] = import_string(path)
        return bool(predicate(request))
    except Exception:
        logger.exception("EXEMPT_WHEN %s raised: the request is not exempt", path)
        return False


def exempt_from(
    request: Any,
    group: Sequence[Policy],
    settings: conf.QuotaSettings,
    default_proxy_count: int | None = None,
) -> list[Policy]:
    """The policies of ``group`` that ``request`` skips (docs/policies.md#exemptions): all
    of them when ``EXEMPT_WHEN(request)`` is true, else those whose ``exempt`` networks
    hold the client address (:func:`client_address`). Empty, at the cost of one look at
    each policy, when nothing is exempt."""
    when = settings.exempt_when
    if when is None and not any(policy.exempt for policy in group):
        return []
    if when is not None and _asks(when, request):
        return list(group)
    address = client_address(request, default_proxy_count=default_proxy_count)
    if address is None:
        return []
    return [policy for policy in group if any(address in net for net in policy.exempt)]


def _call(path: str | None, request: Any) -> object:
    if path is None:
        return None
    return import_string(path)(request)


def _resolved(setting: str, path: str | None, request: Any, policy: Policy | None) -> object:
    """What the resolver of ``setting`` (``API_KEY_RESOLVER``, ``TENANT_RESOLVER``) gives
    for ``request``. One that raises gives an invalid identity (``selector_identity_invalid``
    in every policy that selects it: refused, never skipped by ``on_missing``, never
    replaced by another dimension), logged with its traceback and the ``policy`` that
    needed it (docs/settings.md#when-a-projects-callable-fails)."""
    try:
        return _call(path, request)
    except Exception:
        logger.exception(
            "%s %s raised (policy %s): the request's identity is invalid "
            "(selector_identity_invalid)",
            setting,
            path,
            "-" if policy is None else policy.id,
        )
        return INVALID_VALUE


def _plan_of(path: str | None, request: Any) -> str | None:
    """What ``PLAN_RESOLVER`` names for ``request``: a plan name, or None (no resolver,
    no plan). A resolver that raises, or returns anything but a string or None, gives None
    (the policies' own windows) with an error logged: a plan lookup never fails the
    request (``docs/plans.md``)."""
    try:
        plan = _call(path, request)
    except Exception:
        logger.exception("PLAN_RESOLVER %s raised: the policies' own windows apply", path)
        return None
    if plan is None or isinstance(plan, str):
        return plan
    logger.error(
        "PLAN_RESOLVER %s returned a %s, not a plan name or None: the policies' own "
        "windows apply",
        path,
        type(plan).__name__,
    )
    return None


class RequestSubject:
    """The raw subject of a request, per selector, reading each source at most once.

    ``request.user`` is read only when a selector has ``user`` or ``auto`` (reading it
    adds ``Vary: Cookie``). For ``auto`` an API key counts only when ``API_KEY_RESOLVER``
    verified it; an explicit ``api_key`` dimension takes the resolver's key, else DRF's
    ``request.auth`` (``drf_auth``: its ``pk`` or the string itself), else the raw
    ``API_KEY_HEADER``. Invalid values are passed on so that the core reports
    ``selector_identity_invalid``; nothing absent or invalid is replaced by another source.
    ``default_proxy_count`` is passed to :func:`request_ip`; ``route``, when given (a DRF
    view's ``throttle_scope``), is the ``route`` dimension instead of the URL's, which is
    resolved at most once and kept in ``kept`` (the request's ledger).
    """

    def __init__(
        self,
        request: Any,
        drf_auth: object = None,
        default_proxy_count: int | None = None,
        route: object = None,
        kept: Kept | None = None,
    ) -> None:
        self.request, self.kept = request, kept
        self.drf_auth = drf_auth
        self.default_proxy_count = default_proxy_count
        self.settings = conf.get_settings()
        self._values: dict[str, object] = {"route": route} if route else {}

    def _value(self, name: str, policy: Policy | None = None) -> object:
        """The value of dimension ``name``, read at most once (``policy``: the one that
        needs it, named in the log line of a resolver that fails)."""
        if name not in self._values:
            self._values[name] = identity_value(self._read(name, policy))
        return self._values[name]

    def _read(self, name: str, policy: Policy | None) -> object:
        request = self.request
        if name == "user":
            user = getattr(request, "user", None)
            if user is not None and getattr(user, "is_authenticated", False):
                # A pk of None would otherwise become one shared identity, "None".
                pk = getattr(user, "pk", None)
                return None if pk is None else str(pk)
            return None
        if name == "verified_api_key":
            return _resolved("API_KEY_RESOLVER", self.settings.api_key_resolver, request, policy)
        if name == "api_key":
            if self.settings.api_key_resolver is not None:
                return self._value("verified_api_key", policy)
            if self.drf_auth is not None:
                return self._drf_key(self.drf_auth)
            return self._header_text(request.META.get(self.settings.api_key_meta_name))
        if name == "ip":
            return ip_value(request, default_proxy_count=self.default_proxy_count)
        if name == "route":
            return route_value(request, self.kept)
        if name == "tenant":
            return _resolved("TENANT_RESOLVER", self.settings.tenant_resolver, request, policy)
        raise KeyError(name)

    @staticmethod
    def _drf_key(auth: object) -> object:
        """The key of DRF's ``request.auth``: its ``pk``, or the string itself.

        Anything else (a claims dict, a token object without ``pk``) gives no key rather
        than its ``str()``, which may differ on every request and mint fresh budgets.
        """
        if isinstance(auth, str | bytes):
            return auth
        return getattr(auth, "pk", None)

    @staticmethod
    def _header_text(value: str | None) -> str | None:
        """A header as the client sent it. WSGI and ASGI decode header bytes as latin-1,
        so UTF-8 text is re-decoded: ``quota inspect --api-key`` and the Python API then
        name the same key, and a non-ASCII key is not mistaken for C1 control bytes.
        Bytes that are not UTF-8 are an invalid identity (they would otherwise alias the
        UTF-8 key spelling the same latin-1 characters)."""
        if value is None:
            return None
        try:
            return value.encode("latin-1").decode("utf-8")
        except UnicodeError:
            return _INVALID

    def exempt(self, group: Sequence[Policy]) -> list[Policy]:
        """The policies of ``group`` the request skips: :func:`exempt_from`, counting
        ``default_proxy_count`` hops as the ``ip`` dimension does."""
        return exempt_from(self.request, group, self.settings, self.default_proxy_count)

    def load(self, group: Iterable[Policy]) -> None:
        """Read now the sources ``group`` needs that may query the database (the session
        user, ``API_KEY_RESOLVER``, ``TENANT_RESOLVER``, ``PLAN_RESOLVER`` when a policy
        of ``group`` has plans): an async layer calls this in a worker thread
        (:meth:`Reading.blocks`), so that :meth:`for_policy` never blocks, or raises
        ``SynchronousOnlyOperation``, inside an event loop."""
        group = tuple(group)
        selectors = {dimension for policy in group for dimension in policy.selector}
        user = self._value("user") if selectors & {"user", Selector.AUTO} else None
        resolver = self.settings.api_key_resolver is not None
        if (Selector.AUTO in selectors and user is None) or ("api_key" in selectors and resolver):
            self._value("verified_api_key", _selecting(group, Selector.AUTO, "api_key"))
        if "tenant" in selectors:
            self._value("tenant", _selecting(group, "tenant"))
        if self.settings.plan_resolver is not None and any(policy.plans for policy in group):
            self.plan()

    def plan(self) -> str | None:
        """The request's plan (``PLAN_RESOLVER``), read at most once."""
        if "\0plan" not in self._values:
            self._values["\0plan"] = _plan_of(self.settings.plan_resolver, self.request)
        plan = self._values["\0plan"]
        return plan if isinstance(plan, str) else None

    def for_policy(self, policy: Policy) -> dict[str, object]:
        """The subject dict the core needs for ``policy``'s selector."""
        subject: dict[str, object] = {}
        for dimension in policy.selector:
            if dimension == Selector.AUTO:
                user = self._value("user")
                if user is not None:
                    subject["user"] = user
                    continue
                verified = self._value("verified_api_key", policy)
                if verified not in (None, ""):
                    subject["api_key"] = verified
                    continue
                subject["ip"] = self._value("ip")
            else:
                subject[dimension] = self._value(dimension, policy)
        return subject


def _selecting(group: Iterable[Policy], *dimensions: str) -> Policy | None:
    """The first policy of ``group`` whose selector has one of ``dimensions``."""
    return next((p for p in group if any(d in p.selector for d in dimensions)), None)


class GivenSubject:
    """A drop-in's own identity, read as its library reads it (``values``: the same for
    every policy). It is the drop-in's reading, and the subject its step reads with it:
    nothing to load, no plan; the request is still asked for exemptions."""

    __slots__ = ("request", "values")

    def __init__(self, values: dict[str, object]) -> None:
        self.values = values
        self.request: Any = None

    def subject(self, request: Any, kept: Kept | None = None) -> GivenSubject:
        """Itself, for ``request``."""
        self.request = request
        return self

    def blocks(self, group: Iterable[Policy]) -> bool:
        """Whether reading the request may block: only ``EXEMPT_WHEN`` may."""
        return conf.get_settings().exempt_when is not None

    def for_policy(self, policy: Policy) -> dict[str, object]:
        """The given values."""
        return self.values

    def exempt(self, group: Sequence[Policy]) -> list[Policy]:
        """The policies of ``group`` the request skips (:func:`exempt_from`)."""
        return exempt_from(self.request, group, conf.get_settings())

    def load(self, group: Iterable[Policy]) -> None:
        """Nothing to read."""

    def plan(self) -> str | None:
        """No plan: a drop-in's policies have none."""
        return None


#: The subject of a request as a layer's step reads it.
Subject = RequestSubject | GivenSubject


class Reading(NamedTuple):
    """How a layer reads its subject from a request: DRF's ``request.auth`` as the
    ``api_key`` dimension's fallback (``drf``), the hops a client IP counts when no proxy
    setting says (``default_proxy_count``, DRF's ``NUM_PROXIES``), and a ``route`` of its
    own (a DRF view's ``throttle_scope``). A drop-in that reads its identity itself hands
    its step a :class:`GivenSubject` instead."""

    drf: bool = False
    default_proxy_count: int | None = None
    route: object = None

    def blocks(self, group: Iterable[Policy]) -> bool:
        """Whether reading a request this way for ``group`` may block: ``EXEMPT_WHEN`` is
        set (it may read ``request.user`` or query the database), or the subject has a
        source to :meth:`~RequestSubject.load` for it. An async layer then reads the
        request in a worker thread."""
        settings = conf.get_settings()
        if settings.exempt_when is not None:
            return True
        for policy in group:
            selector = policy.selector
            if Selector.AUTO in selector or "user" in selector:
                return True
            if "tenant" in selector and settings.tenant_resolver is not None:
                return True
            if "api_key" in selector and settings.api_key_resolver is not None:
                return True
            if policy.plans and settings.plan_resolver is not None:
                return True
        return False

    def subject(self, request: Any, kept: Kept | None = None) -> RequestSubject:
        """The subject of ``request`` read this way (``kept``: where its route is kept)."""
        auth = getattr(request, "auth", None) if self.drf else None
        return RequestSubject(request, auth, self.default_proxy_count, self.route, kept)


#: The reading of the middleware and ``@quota``: every dimension from the request itself.
PLAIN = Reading()
#: What a layer hands its step: how to read the request, or a drop-in's own identity.
Readable = Reading | GivenSubject
