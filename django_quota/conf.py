"""The settings façade: ``settings.QUOTA`` parsed into a typed, frozen object, lazily,
never at import, and dropped whenever a relevant setting changes (``override_settings``
and pytest-django's ``settings`` fixture take effect at once)."""

from __future__ import annotations

import ipaddress
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

from django_quota.core.errors import ConfigurationError
from django_quota.core.identity import IPNetwork, derive_hmac_key
from django_quota.core.policy import ALGORITHMS, FAILURE_MODES, Policy, parse_policy
from django_quota.messages import (
    E_BACKEND,
    E_DOTTED_PATH,
    E_INVALID_POLICY,
    E_INVALID_VALUE,
    E_NOT_A_DICT,
    E_UNKNOWN_KEY,
)

DEFAULTS: dict[str, Any] = {
    "ENABLED": True,
    "REDIS_URL": None,
    "CACHE_ALIAS": None,
    "CLUSTER": False,
    "SENTINEL": None,
    "BACKEND": None,
    "KEY_PREFIX": "quota",
    "CLOCK": "redis",
    "MAX_CLOCK_REGRESSION": 1.0,
    "TIMEOUT": 0.1,
    "DEADLINE": 0.25,
    "MAX_INFLIGHT": 64,
    "FAILURE_MODE": "closed",
    "FAILURE_RETRY_AFTER": 1,
    "LOCAL_FALLBACK": {"ENABLED": False, "MAX_ENTRIES": 10000},
    "MEMORY_MAX_ENTRIES": 4096,
    "DEDUP_TTL": 5.0,
    "CLEANUP_GRACE": 1.0,
    "HMAC_KEY": None,
    "HMAC_KEY_VERSION": 1,
    "TRUSTED_PROXIES": [],
    "PROXY_COUNT": None,
    "IPV6_PREFIX": 64,
    "API_KEY_HEADER": "X-Api-Key",
    "API_KEY_RESOLVER": None,
    "TENANT_RESOLVER": None,
    "HEADERS": "ietf",
    "DENIED_VIEW": None,
    "EXEMPT_PATHS": [],
    "POLICIES": {},
    "POLICY_SOURCES": ["settings", "database"],
    "POLICY_CACHE_TTL": 5.0,
    "DRF_ALGORITHM": "sliding_log",  # the drop-ins decide as DRF's history log does
}
HEADER_STYLES = ("ietf", "legacy", "both", "none")
BACKENDS = ("redis", "memory")
POLICY_SOURCE_NAMES = ("settings", "database")
CLOCKS = ("redis", "client")
#: The largest number of seconds a setting takes (about 31.7 years): times travel to the
#: Redis scripts as milliseconds below 2**48.
MAX_SECONDS = 1e9
#: The largest FAILURE_RETRY_AFTER, one day: it is both the 503's Retry-After and the
#: breaker's cool-down, during which no call reaches Redis, so a larger value is far more
#: likely a mistake (milliseconds, say) than a wish.
MAX_FAILURE_RETRY_AFTER = 86400
#: Settings whose change drops every cached configuration, connection and counter.
WATCHED_SETTINGS = frozenset({"QUOTA", "SECRET_KEY", "REST_FRAMEWORK", "CACHES", "DEBUG"})


@dataclass(frozen=True, slots=True)
class SettingsProblem:
    """One invalid setting: the check id, the key as written, what is wrong, the fix."""

    id: str
    key: str
    message: str
    hint: str | None = None


@dataclass(frozen=True, slots=True)
class QuotaSettings:
    """``settings.QUOTA`` validated; times in float seconds unless named ``_ms``."""

    enabled: bool
    redis_url: str | None
    cache_alias: str | None
    cluster: bool
    sentinel: Mapping[str, Any] | None
    backend: str
    key_prefix: str
    clock: str
    max_clock_regression: float
    timeout: float
    deadline: float
    max_inflight: int
    failure_mode: str
    failure_retry_after: int
    local_fallback_enabled: bool
    local_fallback_max_entries: int
    memory_max_entries: int
    dedup_ttl: float
    cleanup_grace: float
    hmac_key: bytes
    hmac_key_configured: bool
    hmac_key_version: int
    trusted_proxies: tuple[IPNetwork, ...]
    proxy_count: int | None
    ipv6_prefix: int
    api_key_header: str
    api_key_resolver: str | None
    tenant_resolver: str | None
    headers: str
    denied_view: str | None
    exempt_paths: tuple[str, ...]
    policies: Mapping[str, Policy]
    policy_sources: tuple[str, ...]
    policy_cache_ttl: float
    drf_algorithm: str
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def api_key_meta_name(self) -> str:
        """The ``request.META`` name of ``API_KEY_HEADER`` (``HTTP_X_API_KEY``)."""
        return "HTTP_" + self.api_key_header.upper().replace("-", "_")

    def failure_mode_of(self, policy: Policy) -> str:
        """The policy's failure mode, or the default ``FAILURE_MODE``."""
        return policy.failure_mode or self.failure_mode


class _Parser:
    """Validates ``settings.QUOTA`` key by key, collecting every problem."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.problems: list[SettingsProblem] = []

    def problem(self, check_id: str, key: str, message: str, hint: str | None = None) -> None:
        self.problems.append(SettingsProblem(check_id, key, message, hint))

    def get(self, name: str) -> Any:
        return self.raw.get(name, DEFAULTS[name])

    def key(self, name: str) -> str:
        return f"QUOTA[{name!r}]"

    def boolean(self, name: str) -> bool:
        value = self.get(name)
        if not isinstance(value, bool):
            self.problem(E_INVALID_VALUE, self.key(name), f"expected True or False, not {value!r}")
            return bool(DEFAULTS[name])
        return value

    def number(self, name: str, *, minimum: float, allow_zero: bool = False) -> float:
        value = self.get(name)
        bad = isinstance(value, bool) or not isinstance(value, int | float)
        # NaN compares false with everything, so it would pass the bound checks below.
        if not bad and (
            not math.isfinite(value)
            or value < minimum
            or value > MAX_SECONDS
            or (value == 0 and not allow_zero)
        ):
            bad = True
        if bad:
            self.problem(
                E_INVALID_VALUE,
                self.key(name),
                f"expected a number of seconds >= {minimum:g} and <= {MAX_SECONDS:g}, "
                f"not {value!r}",
            )
            return float(DEFAULTS[name])
        return float(value)

    def integer(self, name: str, *, minimum: int, maximum: int | None = None) -> int:
        value = self.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            bounds = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            self.problem(
                E_INVALID_VALUE, self.key(name), f"expected an integer {bounds}, not {value!r}"
            )
            return int(DEFAULTS[name])
        return value

    def optional_string(self, name: str) -> str | None:
        value = self.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            self.problem(
                E_INVALID_VALUE, self.key(name), f"expected a string or None, not {value!r}"
            )
            return None
        return value

    def choice(self, name: str, choices: Sequence[str]) -> str:
        value = self.get(name)
        if value not in choices:
            self.problem(
                E_INVALID_VALUE, self.key(name), f"{value!r} is not one of {', '.join(choices)}"
            )
            return str(DEFAULTS[name])
        return str(value)

    def string_list(self, name: str) -> tuple[str, ...]:
        value = self.get(name)
        if (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not all(isinstance(item, str) and item for item in value)
        ):
            self.problem(
                E_INVALID_VALUE, self.key(name), f"expected a list of strings, not {value!r}"
            )
            return tuple(DEFAULTS[name])
        return tuple(value)


def _is_address(address: object) -> bool:
    """True for a ``(host, port)`` pair, as ``redis.sentinel.Sentinel`` takes them."""
    return (
        isinstance(address, Sequence)
        and not isinstance(address, str)
        and len(address) == 2
        and isinstance(address[0], str)
        and isinstance(address[1], int)
        and not isinstance(address[1], bool)
    )


def _parse_dotted_path(parser: _Parser, name: str) -> str | None:
    value = parser.optional_string(name)
    if value is None:
        return None
    from django.utils.module_loading import import_string

    try:
        target = import_string(value)
    except ImportError as exc:
        parser.problem(E_DOTTED_PATH, parser.key(name), f"cannot import {value!r}: {exc}")
        return None
    if not callable(target):
        parser.problem(E_DOTTED_PATH, parser.key(name), f"{value!r} is not callable")
        return None
    return value


_URL_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\Z")


def _parse_redis_url(parser: _Parser) -> str | None:
    """``REDIS_URL``, its problem reported without its value: a URL may carry the Redis
    password, and the message reaches ``manage.py check``, logs and error reports."""
    value = parser.get("REDIS_URL")
    key = parser.key("REDIS_URL")
    expected = "expected a redis://, rediss:// or unix:// URL"
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        found = type(value).__name__
        parser.problem(E_INVALID_VALUE, key, f"{expected} (a str) or None, not a {found}")
        return None
    if not value.startswith(("redis://", "rediss://", "unix://")):
        scheme, separator, _ = value.partition("://")
        if separator and _URL_SCHEME_RE.match(scheme):
            found = f"a URL with scheme {scheme!r}"
        else:
            found = "text without a scheme (the value is not shown: it may hold a password)"
        parser.problem(E_INVALID_VALUE, key, f"{expected}, not {found}")
    return value


def parse_settings(
    raw: object, *, secret_key: str | bytes = "", with_policies: bool = True
) -> tuple[QuotaSettings | None, list[SettingsProblem]]:
    """Validate ``raw`` (the ``QUOTA`` dict) and return the settings and every problem.

    The settings object is None only when ``raw`` is not a dict; otherwise invalid keys
    fall back to their defaults so that one mistake does not hide the next.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        problem = SettingsProblem(
            E_NOT_A_DICT, "QUOTA", f"settings.QUOTA must be a dict, not {type(raw).__name__}"
        )
        return None, [problem]
    parser = _Parser(raw)
    for name in sorted(set(raw) - set(DEFAULTS), key=str):
        parser.problem(
            E_UNKNOWN_KEY,
            f"QUOTA[{name!r}]",
            "unknown setting",
            f"known settings: {', '.join(sorted(DEFAULTS))}",
        )

    enabled = parser.boolean("ENABLED")
    redis_url = _parse_redis_url(parser)
    cache_alias = parser.optional_string("CACHE_ALIAS")
    cluster = parser.boolean("CLUSTER")
    sentinel = parser.get("SENTINEL")
    if sentinel is not None:
        addresses = sentinel.get("SENTINELS") if isinstance(sentinel, Mapping) else None
        valid = (
            isinstance(sentinel, Mapping)
            and isinstance(sentinel.get("SERVICE"), str)
            and bool(sentinel["SERVICE"])
            and isinstance(addresses, Sequence)
            and not isinstance(addresses, str)
            and len(addresses) > 0
            and all(_is_address(address) for address in addresses)
        )
        if not valid:
            parser.problem(
                E_INVALID_VALUE,
                parser.key("SENTINEL"),
                "expected {'SENTINELS': [(host, port), ...], 'SERVICE': 'mymaster'}",
            )
            sentinel = None
    backend_value = parser.get("BACKEND")
    implied_backend = "redis" if (redis_url or cache_alias or sentinel) else "memory"
    if backend_value is None:
        backend = implied_backend
    elif backend_value in BACKENDS:
        backend = backend_value
    else:
        parser.problem(
            E_INVALID_VALUE,
            parser.key("BACKEND"),
            f"{backend_value!r} is not one of {', '.join(BACKENDS)} (or None)",
        )
        backend = implied_backend
    if backend == "redis" and not (redis_url or cache_alias or sentinel):
        parser.problem(
            E_BACKEND,
            parser.key("BACKEND"),
            "the redis backend needs REDIS_URL, CACHE_ALIAS or SENTINEL",
        )
    if cluster and sentinel:
        parser.problem(E_BACKEND, parser.key("CLUSTER"), "CLUSTER and SENTINEL exclude each other")
    if cluster and not (redis_url or cache_alias):
        parser.problem(E_BACKEND, parser.key("CLUSTER"), "CLUSTER needs REDIS_URL or CACHE_ALIAS")

    key_prefix = parser.get("KEY_PREFIX")
    if (
        not isinstance(key_prefix, str)
        or not key_prefix
        or any(char in key_prefix for char in "{} \t\r\n")
    ):
        parser.problem(
            E_INVALID_VALUE,
            parser.key("KEY_PREFIX"),
            f"expected a non-empty string without braces or spaces, not {key_prefix!r}",
        )
        key_prefix = DEFAULTS["KEY_PREFIX"]

    clock = parser.get("CLOCK")
    if clock not in CLOCKS:
        clock = _parse_dotted_path(parser, "CLOCK") or "redis"

    failure_mode = parser.choice("FAILURE_MODE", FAILURE_MODES)
    failure_retry_after = parser.integer(
        "FAILURE_RETRY_AFTER", minimum=1, maximum=MAX_FAILURE_RETRY_AFTER
    )
    fallback = parser.get("LOCAL_FALLBACK")
    fallback_enabled, fallback_entries = False, 10000
    if not isinstance(fallback, Mapping) or set(fallback) - {"ENABLED", "MAX_ENTRIES"}:
        parser.problem(
            E_INVALID_VALUE,
            parser.key("LOCAL_FALLBACK"),
            "expected {'ENABLED': bool, 'MAX_ENTRIES': int}",
        )
    else:
        fallback_enabled = fallback.get("ENABLED", False)
        fallback_entries = fallback.get("MAX_ENTRIES", 10000)
        if not isinstance(fallback_enabled, bool):
            parser.problem(
                E_INVALID_VALUE, "QUOTA['LOCAL_FALLBACK']['ENABLED']", "expected True or False"
            )
            fallback_enabled = False
        if isinstance(fallback_entries, bool) or not isinstance(fallback_entries, int) or (
            fallback_entries < 1
        ):
            parser.problem(
                E_INVALID_VALUE,
                "QUOTA['LOCAL_FALLBACK']['MAX_ENTRIES']",
                "expected a positive integer",
            )
            fallback_entries = 10000

    hmac_key_raw = parser.get("HMAC_KEY")
    if hmac_key_raw is not None and (
        not isinstance(hmac_key_raw, str | bytes) or len(hmac_key_raw) < 16
    ):
        parser.problem(
            E_INVALID_VALUE,
            parser.key("HMAC_KEY"),
            "expected a secret string or bytes of at least 16 characters",
            "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'",
        )
        hmac_key_raw = None

    trusted_raw = parser.string_list("TRUSTED_PROXIES")
    trusted: list[IPNetwork] = []
    for entry in trusted_raw:
        try:
            trusted.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            parser.problem(
                E_INVALID_VALUE, parser.key("TRUSTED_PROXIES"), f"{entry!r} is not a CIDR"
            )
    proxy_count = parser.get("PROXY_COUNT")
    if proxy_count is not None and (
        isinstance(proxy_count, bool) or not isinstance(proxy_count, int) or proxy_count < 0
    ):
        # Not parser.integer(): its fallback, the default None, is not an integer.
        parser.problem(
            E_INVALID_VALUE,
            parser.key("PROXY_COUNT"),
            f"expected None or an integer >= 0, not {proxy_count!r}",
        )
        proxy_count = None

    api_key_header = parser.get("API_KEY_HEADER")
    if (
        not isinstance(api_key_header, str)
        or not api_key_header.isascii()
        or not api_key_header.replace("-", "").isalnum()
    ):
        parser.problem(
            E_INVALID_VALUE,
            parser.key("API_KEY_HEADER"),
            f"expected an HTTP header name like 'X-Api-Key', not {api_key_header!r}",
        )
        api_key_header = DEFAULTS["API_KEY_HEADER"]

    exempt_paths = parser.string_list("EXEMPT_PATHS")
    for path in exempt_paths:
        if not path.startswith("/"):
            parser.problem(
                E_INVALID_VALUE, parser.key("EXEMPT_PATHS"), f"{path!r} must start with '/'"
            )

    policy_sources = parser.string_list("POLICY_SOURCES")
    for source in policy_sources:
        if source not in POLICY_SOURCE_NAMES:
            parser.problem(
                E_INVALID_VALUE,
                parser.key("POLICY_SOURCES"),
                f"{source!r} is not one of {', '.join(POLICY_SOURCE_NAMES)}",
            )

    policies: dict[str, Policy] = {}
    raw_policies = parser.get("POLICIES")
    if not isinstance(raw_policies, Mapping):
        parser.problem(E_INVALID_VALUE, parser.key("POLICIES"), "expected a dict of id -> policy")
    elif with_policies:
        for policy_id, definition in raw_policies.items():
            try:
                policies[policy_id] = parse_policy(policy_id, definition, source="settings")
            except ConfigurationError as exc:
                parser.problem(E_INVALID_POLICY, exc.key, exc.message, exc.hint)

    result = QuotaSettings(
        enabled=enabled,
        redis_url=redis_url,
        cache_alias=cache_alias,
        cluster=cluster,
        sentinel=sentinel,
        backend=backend,
        key_prefix=key_prefix,
        clock=clock,
        max_clock_regression=parser.number("MAX_CLOCK_REGRESSION", minimum=0, allow_zero=True),
        timeout=parser.number("TIMEOUT", minimum=0.001),
        deadline=parser.number("DEADLINE", minimum=0.001),
        max_inflight=parser.integer("MAX_INFLIGHT", minimum=1),
        failure_mode=failure_mode,
        failure_retry_after=failure_retry_after,
        local_fallback_enabled=fallback_enabled,
        local_fallback_max_entries=fallback_entries,
        memory_max_entries=parser.integer("MEMORY_MAX_ENTRIES", minimum=1),
        dedup_ttl=parser.number("DEDUP_TTL", minimum=0.001),
        cleanup_grace=parser.number("CLEANUP_GRACE", minimum=0, allow_zero=True),
        hmac_key=derive_hmac_key(hmac_key_raw, secret_key),
        hmac_key_configured=hmac_key_raw is not None,
        hmac_key_version=parser.integer("HMAC_KEY_VERSION", minimum=1),
        trusted_proxies=tuple(trusted),
        proxy_count=proxy_count,
        ipv6_prefix=parser.integer("IPV6_PREFIX", minimum=1, maximum=128),
        api_key_header=api_key_header,
        api_key_resolver=_parse_dotted_path(parser, "API_KEY_RESOLVER"),
        tenant_resolver=_parse_dotted_path(parser, "TENANT_RESOLVER"),
        headers=parser.choice("HEADERS", HEADER_STYLES),
        denied_view=_parse_dotted_path(parser, "DENIED_VIEW"),
        exempt_paths=exempt_paths,
        policies=policies,
        policy_sources=policy_sources,
        policy_cache_ttl=parser.number("POLICY_CACHE_TTL", minimum=0, allow_zero=True),
        drf_algorithm=parser.choice("DRF_ALGORITHM", ALGORITHMS),
        raw=raw,
    )
    if result.deadline < result.timeout:
        parser.problem(
            E_INVALID_VALUE,
            parser.key("DEADLINE"),
            f"DEADLINE ({result.deadline:g} s) must be at least TIMEOUT ({result.timeout:g} s)",
        )
    return result, parser.problems


_lock = threading.Lock()
_cached: QuotaSettings | None = None
_listeners: list[Callable[[], None]] = []


def get_settings() -> QuotaSettings:
    """The current validated settings (cached until a watched setting changes).

    Raises :class:`~django.core.exceptions.ImproperlyConfigured` when ``QUOTA`` is invalid;
    ``manage.py check`` lists every problem with its id.
    """
    global _cached
    current = _cached
    if current is not None:
        return current
    with _lock:
        if _cached is None:
            parsed, problems = parse_settings(
                getattr(django_settings, "QUOTA", {}), secret_key=django_settings.SECRET_KEY
            )
            if problems or parsed is None:
                first = problems[0]
                raise ImproperlyConfigured(
                    f"{first.key}: {first.message} ({first.id}; run manage.py check for all)"
                )
            _cached = parsed
        return _cached


def cached_settings() -> QuotaSettings | None:
    """The settings :func:`get_settings` cached, or None when nothing read them since the
    last change (then nothing built from them, counters included, exists either)."""
    return _cached


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever cached settings are dropped (backends, registries);
    once, however often it is given."""
    if listener not in _listeners:
        _listeners.append(listener)


def clear() -> None:
    """Drop the cached settings and everything built from them."""
    global _cached
    with _lock:
        _cached = None
    for listener in list(_listeners):
        listener()


def reset_on_setting_change(*, setting: str, **kwargs: Any) -> None:
    """Receive Django's ``setting_changed``: :func:`clear` when a watched setting changed."""
    if setting in WATCHED_SETTINGS:
        clear()
