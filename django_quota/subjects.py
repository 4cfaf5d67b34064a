"""Who a request is: the raw subject of each policy's selector, read from the request
(session user, API key, client IP behind trusted proxies, route, tenant) at most once
(``docs/subjects.md``)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest
from django.utils.module_loading import import_string

from django_quota import conf
from django_quota.core.identity import INVALID_VALUE, IdentityError, client_ip
from django_quota.core.policy import AUTO, Policy
from django_quota.routes import route_value

logger = logging.getLogger("django_quota")

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
    view's ``throttle_scope``), is the ``route`` dimension instead of the URL's.
    """

    def __init__(
        self,
        request: Any,
        *,
        drf_auth: object = None,
        default_proxy_count: int | None = None,
        route: object = None,
    ) -> None:
        self.request = request
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
            return route_value(request)
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

    async def aload(self, group: Iterable[Policy]) -> None:
        """Read, in a worker thread, the sources ``group`` needs that may query the
        database (the session user, ``API_KEY_RESOLVER``, ``TENANT_RESOLVER``,
        ``PLAN_RESOLVER`` when a policy of ``group`` has plans), so that
        :meth:`for_policy` never blocks, or raises ``SynchronousOnlyOperation``, inside an
        event loop."""
        group = tuple(group)
        selectors = {dimension for policy in group for dimension in policy.selector}
        read = sync_to_async(self._value)
        user = await read("user") if selectors & {"user", AUTO} else None
        resolver = self.settings.api_key_resolver is not None
        if (AUTO in selectors and user is None) or ("api_key" in selectors and resolver):
            await read("verified_api_key", _selecting(group, AUTO, "api_key"))
        if "tenant" in selectors:
            await read("tenant", _selecting(group, "tenant"))
        if self.settings.plan_resolver is not None and any(policy.plans for policy in group):
            await sync_to_async(self.plan)()

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
            if dimension == AUTO:
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
    """A subject already read (a drop-in throttle's own identity): the same values for
    every policy, nothing to load."""

    __slots__ = ("values",)

    def __init__(self, values: Mapping[str, object]) -> None:
        self.values = values

    def for_policy(self, policy: Policy) -> Mapping[str, object]:
        """The given values."""
        return self.values

    async def aload(self, group: Iterable[Policy]) -> None:
        """Nothing to read."""

    def plan(self) -> str | None:
        """No plan: a drop-in throttle's policies have none."""
        return None
