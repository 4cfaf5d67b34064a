"""django-ratelimit's ``key``: what a key resolves to for one request
(``docs/django-ratelimit.md``).

``"ip"``, ``"user"``, ``"user_or_ip"``, ``"get:<name>"``, ``"post:<name>"``,
``"header:<name>"``, a callable or its dotted path, called with ``(group, request)``. The
value is the identity's raw value as the core takes it; a project's callable that raises
gives an invalid identity, logged, never a 500.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_quota import conf, subjects
from django_quota.core.identity import INVALID_VALUE, IdentityError, client_ip
from django_quota.core.log import logger


class _MissingAddress(ImproperlyConfigured):
    """The request carries no client address where the settings say to read one."""


def callable_name(given: object) -> str:
    """A project's callable as a log line names it: its dotted path."""
    if isinstance(given, str):
        return given
    return f"{getattr(given, '__module__', '?')}.{getattr(given, '__qualname__', given)}"


def _client_address(request: Any) -> str:
    """The client address before masking: ``REMOTE_ADDR``, or, when ``QUOTA`` sets
    ``TRUSTED_PROXIES`` or ``PROXY_COUNT``, the client behind them as django-quota
    resolves it (``docs/subjects.md``)."""
    quota = conf.get_settings()
    if quota.trusted_proxies or quota.proxy_count is not None:
        try:
            return client_ip(
                request.META.get("REMOTE_ADDR"),
                request.META.get("HTTP_X_FORWARDED_FOR"),
                trusted_proxies=quota.trusted_proxies,
                proxy_count=quota.proxy_count,
                ipv6_prefix=128,
            )
        except IdentityError as exc:
            if exc.reason == "selector_identity_missing":
                raise _MissingAddress("the client address is missing") from None
            raise ValueError("the client address does not parse") from None
    address: str = request.META.get("REMOTE_ADDR", "")
    if not address:
        raise _MissingAddress(
            "IP address in REMOTE_ADDR is empty (a reverse proxy connecting over a Unix "
            "socket?): set RATELIMIT_IP_META_KEY, or QUOTA['TRUSTED_PROXIES'] "
            "(docs/django-ratelimit.md)"
        )
    return address


def _get_ip(request: Any) -> str:
    """The client IP as ``key="ip"`` uses it: read as ``RATELIMIT_IP_META_KEY`` says (a
    ``request.META`` key, a callable or its dotted path; unset: :func:`_client_address`),
    then masked to its ``RATELIMIT_IPV4_MASK`` (32) or ``RATELIMIT_IPV6_MASK`` (64)
    network.

    Raises ``ImproperlyConfigured`` when the address is empty or the META key absent,
    ``ValueError`` when it is not an IP address.
    """
    meta_key = getattr(settings, "RATELIMIT_IP_META_KEY", None)
    if not meta_key:
        address: object = _client_address(request)
    elif callable(meta_key) or (isinstance(meta_key, str) and "." in meta_key):
        function = meta_key if callable(meta_key) else import_string(meta_key)
        try:
            address = function(request)
        except Exception:
            logger.exception(
                "RATELIMIT_IP_META_KEY %s raised: the request's identity is invalid "
                "(selector_identity_invalid)",
                callable_name(meta_key),
            )
            raise ValueError("RATELIMIT_IP_META_KEY raised") from None
    elif meta_key in request.META:
        address = request.META[meta_key]
    else:
        raise _MissingAddress(
            f"Could not get IP address from {meta_key!r}: RATELIMIT_IP_META_KEY names no "
            "key of this request's META"
        )
    if not isinstance(address, str):
        raise ValueError(f"an IP address is a str, not {type(address).__name__}")
    if ":" in address:
        mask = getattr(settings, "RATELIMIT_IPV6_MASK", 64)
    else:
        mask = getattr(settings, "RATELIMIT_IPV4_MASK", 32)
    return str(ipaddress.ip_network(f"{address}/{mask}", strict=False).network_address)


def _user_pk(request: Any) -> str:
    return str(getattr(getattr(request, "user", None), "pk", None))


def user_or_ip(request: Any) -> str:
    """``key="user_or_ip"``: the user's pk when authenticated, else :func:`_get_ip`."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return str(user.pk)
    return _get_ip(request)


def get_header(request: Any, header: str) -> str:
    """``key="header:<name>"``: the request header ``name``, ``""`` when absent."""
    value: str = request.META.get("HTTP_" + header.replace("-", "_").upper(), "")
    return value


_SIMPLE_KEYS: Mapping[str, Callable[[Any], str]] = MappingProxyType(
    {"ip": _get_ip, "user": _user_pk, "user_or_ip": user_or_ip}
)
_ACCESSOR_KEYS: Mapping[str, Callable[[Any, str], str]] = MappingProxyType(
    {
        "get": lambda request, name: request.GET.get(name, ""),
        "post": lambda request, name: request.POST.get(name, ""),
        "header": get_header,
    }
)


def _project_key(request: Any, group: str, key: Any, function: Callable[..., Any]) -> object:
    """What the project's ``key`` callable gives; one that raises gives an invalid
    identity, logged (docs/django-ratelimit.md): the request is limited, never a 500."""
    try:
        return function(group, request)
    except Exception:
        logger.exception(
            "ratelimit key %s of group %r raised: the request's identity is invalid "
            "(selector_identity_invalid)",
            callable_name(key),
            group,
        )
        return INVALID_VALUE


def _key_value(request: Any, group: str, key: Any) -> object:
    if callable(key):
        return _project_key(request, group, key, key)
    if key in _SIMPLE_KEYS:
        return _SIMPLE_KEYS[key](request)
    if ":" in key:
        accessor, name = key.split(":", 1)
        if accessor not in _ACCESSOR_KEYS:
            raise ImproperlyConfigured(f"Unknown ratelimit key: {key}")
        return _ACCESSOR_KEYS[accessor](request, name)
    if "." in key:
        return _project_key(request, group, key, import_string(key))
    raise ImproperlyConfigured(f"Could not understand ratelimit key: {key}")


def identity_value(request: Any, group: str, key: Any) -> object:
    """The key's raw value as the core takes it: text, None (missing: an empty
    ``REMOTE_ADDR``, an absent META key) or :data:`INVALID_VALUE` (not an address, not
    text). Configuration errors raise."""
    try:
        value = _key_value(request, group, key)
    except _MissingAddress:
        return None
    except ValueError:
        return INVALID_VALUE
    found = subjects.identity_value(value)
    if found is None or found is INVALID_VALUE or isinstance(found, str):
        return found
    return str(found)


def needs_thread(key: Any) -> bool:
    """Whether resolving ``key`` may run the project's code or read ``request.user``."""
    if callable(key):
        return True
    if not isinstance(key, str):
        return False
    # Keys that neither read ``request.user`` nor call the project's code: an async view
    # resolves the others in a worker thread (the ORM is not allowed on the event loop).
    return key.split(":", 1)[0] not in {"ip", "get", "post", "header"}
