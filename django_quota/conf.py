"""The settings façade: ``settings.QUOTA`` parsed into a typed, frozen object, lazily,
never at import, and dropped whenever a relevant setting changes (``override_settings``
and pytest-django's ``settings`` fixture take effect at once)."""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from django.apps import apps
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

from django_quota.backends import url_problem
from django_quota.core.errors import ConfigurationError
from django_quota.core.identity import derive_hmac_key
from django_quota.core.policy import ALGORITHMS, Form, IPNetwork, Policy, parse_policy
from django_quota.core.zones import host_zone, parse_timezone
from django_quota.fields import (
    Field,
    Invalid,
    Reader,
    SettingsProblem,
    boolean,
    choice,
    dotted_path,
    integer,
    is_int,
    key_of,
    number,
    one_of,
    optional,
    optional_string,
    string_list,
)
from django_quota.messages import Codes, Problems


class Choices:
    """The values a key of ``QUOTA`` takes from a list (``docs/settings.md``)."""

    HEADER_STYLES: Final = ("ietf", "legacy", "both", "none")
    BACKENDS: Final = ("redis", "memory")
    POLICY_SOURCES: Final = ("settings", "database")
    CLOCKS: Final = ("redis", "client")
    #: The cache backends ``CACHE_ALIAS`` accepts (check E006), hence those whose Redis a
    #: project without ``QUOTA`` keeps its django-ratelimit counters in.
    DJANGO_REDIS_BACKENDS: Final = ("django_redis.cache.RedisCache",)


class Bounds:
    """The bounds of numeric keys that no parser's own range states."""

    #: The shortest ``DENIAL_CACHE["MAX_TTL"]``, one millisecond (the backend's resolution).
    MIN_DENIAL_CACHE_TTL: Final = 0.001
    #: The largest FAILURE_RETRY_AFTER, one day: it is both the 503's Retry-After and the
    #: breaker's cool-down, during which no call reaches Redis, so a larger value is far
    #: more likely a mistake (milliseconds, say) than a wish.
    MAX_FAILURE_RETRY_AFTER: Final = 86400




@dataclass(frozen=True, slots=True)
class LocalFallback:
    """``LOCAL_FALLBACK``: whether the per-process fallback decides, and its size."""

    enabled: bool
    max_entries: int


@dataclass(frozen=True, slots=True)
class DenialCacheSettings:
    """``DENIAL_CACHE``: whether refusals Redis gave are answered again by this process
    (``docs/failures.md``), how many are kept and for how long at most (seconds)."""

    enabled: bool
    max_entries: int
    max_ttl: float


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
    redis_public_path: bool
    failure_mode: str
    failure_retry_after: int
    local_fallback: LocalFallback
    denial_cache: DenialCacheSettings
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
    plan_resolver: str | None
    headers: str
    denied_view: str | None
    exempt_paths: tuple[str, ...]
    timezone: str
    policies: Mapping[str, Policy]
    policy_sources: tuple[str, ...]
    policy_cache_ttl: float
    drf_algorithm: str
    exempt_when: str | None
    login_policies: tuple[str, ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def local_fallback_enabled(self) -> bool:
        """``LOCAL_FALLBACK["ENABLED"]``."""
        return self.local_fallback.enabled

    @property
    def local_fallback_max_entries(self) -> int:
        """``LOCAL_FALLBACK["MAX_ENTRIES"]``."""
        return self.local_fallback.max_entries

    @property
    def api_key_meta_name(self) -> str:
        """The ``request.META`` name of ``API_KEY_HEADER`` (``HTTP_X_API_KEY``)."""
        return "HTTP_" + self.api_key_header.upper().replace("-", "_")

    def failure_mode_of(self, policy: Policy) -> str:
        """The policy's failure mode, or the default ``FAILURE_MODE``."""
        return policy.failure_mode or self.failure_mode


# -- the parsers of one key each -----------------------------------------------------------
def _redis_url(value: Any, reader: Reader) -> str | None:
    """``REDIS_URL``, its problem reported without its value: a URL may carry the Redis
    password, and the message reaches ``manage.py check``, logs and error reports."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise Invalid(Problems.EXPECTED_REDIS_URL, type=type(value).__name__)
    if not value.startswith(("redis://", "rediss://", "unix://")):
        scheme, separator, _ = value.partition("://")
        if separator and re.match(r"[A-Za-z][A-Za-z0-9+.-]*\Z", scheme):
            found = Problems.FOUND_URL_SCHEME.format(scheme=scheme)
        else:
            found = Problems.FOUND_NO_SCHEME
        reader.report(Problems.EXPECTED_REDIS_SCHEME, found=found)
    else:
        problem = url_problem(value)
        if problem is not None:
            reader.report(Problems.UNUSABLE_REDIS_URL, problem=problem)
    return value


def _is_address(address: object) -> bool:
    """True for a ``(host, port)`` pair, as ``redis.sentinel.Sentinel`` takes them."""
    return (
        isinstance(address, Sequence)
        and not isinstance(address, str)
        and len(address) == 2
        and isinstance(address[0], str)
        and is_int(address[1])
    )


def _sentinel(value: Any, reader: Reader) -> Mapping[str, Any]:
    addresses = value.get("SENTINELS") if isinstance(value, Mapping) else None
    if not (
        isinstance(value, Mapping)
        and isinstance(value.get("SERVICE"), str)
        and bool(value["SERVICE"])
        and isinstance(addresses, Sequence)
        and not isinstance(addresses, str)
        and len(addresses) > 0
        and all(_is_address(address) for address in addresses)
    ):
        raise Invalid(Problems.EXPECTED_SENTINEL)
    return value


def _key_prefix(value: Any, reader: Reader) -> str:
    if not isinstance(value, str) or not value or any(char in value for char in "{} \t\r\n"):
        raise Invalid(Problems.EXPECTED_KEY_PREFIX, value=value)
    return value


def _clock(value: Any, reader: Reader) -> str:
    """One of :attr:`Choices.CLOCKS`, or the dotted path of a callable; None is the default."""
    if value in Choices.CLOCKS:
        return str(value)
    return dotted_path(value, reader) or str(reader.default)


def _local_fallback(value: Any, reader: Reader) -> LocalFallback:
    """``{"ENABLED": bool, "MAX_ENTRIES": int}``; a missing or invalid entry takes the
    default's."""
    if not isinstance(value, Mapping) or set(value) - set(reader.default):
        raise Invalid(Problems.EXPECTED_LOCAL_FALLBACK)
    enabled = value.get("ENABLED", reader.default["ENABLED"])
    entries = value.get("MAX_ENTRIES", reader.default["MAX_ENTRIES"])
    if not isinstance(enabled, bool):
        reader.report(Problems.EXPECTED_TRUE_OR_FALSE, f"{reader.key}['ENABLED']")
        enabled = reader.default["ENABLED"]
    if not is_int(entries) or entries < 1:
        reader.report(Problems.EXPECTED_POSITIVE_INTEGER, f"{reader.key}['MAX_ENTRIES']")
        entries = reader.default["MAX_ENTRIES"]
    return LocalFallback(enabled, entries)


def _denial_cache(value: Any, reader: Reader) -> DenialCacheSettings:
    """``{"ENABLED": bool, "MAX_ENTRIES": int, "MAX_TTL": seconds}``; a missing or invalid
    entry takes the default's."""
    default = reader.default
    if not isinstance(value, Mapping) or set(value) - set(default):
        raise Invalid(Problems.EXPECTED_DENIAL_CACHE)
    enabled = value.get("ENABLED", default["ENABLED"])
    entries = value.get("MAX_ENTRIES", default["MAX_ENTRIES"])
    max_ttl = value.get("MAX_TTL", default["MAX_TTL"])
    if not isinstance(enabled, bool):
        reader.report(Problems.EXPECTED_TRUE_OR_FALSE, f"{reader.key}['ENABLED']")
        enabled = default["ENABLED"]
    if not is_int(entries) or entries < 1:
        reader.report(Problems.EXPECTED_POSITIVE_INTEGER, f"{reader.key}['MAX_ENTRIES']")
        entries = default["MAX_ENTRIES"]
    try:
        max_ttl = number(Bounds.MIN_DENIAL_CACHE_TTL)(max_ttl, reader)
    except Invalid as invalid:
        reader.report(invalid.message, f"{reader.key}['MAX_TTL']", **invalid.values)
        max_ttl = float(default["MAX_TTL"])
    return DenialCacheSettings(enabled, entries, max_ttl)


def _secret(value: Any, reader: Reader) -> str | bytes:
    if not isinstance(value, str | bytes) or len(value) < 16:
        raise Invalid(Problems.EXPECTED_HMAC_KEY)
    return value


def _network(entry: str, reader: Reader) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        reader.report(Problems.NOT_A_CIDR, value=entry)
        return None


def _header_name(value: Any, reader: Reader) -> str:
    if not isinstance(value, str) or not value.isascii() or not value.replace("-", "").isalnum():
        raise Invalid(Problems.EXPECTED_HEADER_NAME, value=value)
    return value


def _path(entry: str, reader: Reader) -> str:
    if not entry.startswith("/"):
        reader.report(Problems.PATH_WITHOUT_SLASH, value=entry)
    return entry


def _timezone(value: Any, reader: Reader) -> str:
    """``TIMEZONE``: an IANA name, the timezone of the policies without ``timezone``
    (their calendar windows, docs/policies.md); read before ``POLICIES``."""
    try:
        reader.timezone = parse_timezone(value, "QUOTA['TIMEZONE']")
    except ConfigurationError:
        if isinstance(value, str) and host_zone(value):
            raise Invalid(Problems.HOST_TIMEZONE, value=value) from None
        raise Invalid(Problems.UNKNOWN_TIMEZONE, value=value) from None
    return reader.timezone


def _policies(value: Any, reader: Reader) -> dict[str, Policy]:
    """The policies by id, each invalid one reported under its own key (E004); none when
    ``parse_settings`` was asked ``with_policies=False``."""
    if not isinstance(value, Mapping):
        raise Invalid(Problems.EXPECTED_POLICY_DICT)
    found: dict[str, Policy] = {}
    if not reader.with_policies:
        return found
    for policy_id, definition in value.items():
        try:
            found[policy_id] = parse_policy(
                policy_id, definition, source="settings", default_timezone=reader.timezone
            )
        except ConfigurationError as exc:
            reader.problems.append(
                SettingsProblem(Codes.E_INVALID_POLICY, exc.key, exc.message, exc.hint)
            )
    return found


#: Every key of ``settings.QUOTA``, in the order of docs/settings.md.
FIELDS = (
    Field("ENABLED", True, boolean),
    Field("REDIS_URL", None, _redis_url),
    Field("CACHE_ALIAS", None, optional_string),
    Field("CLUSTER", False, boolean),
    Field("SENTINEL", None, optional(_sentinel)),
    # None: "redis" when a server is configured, else "memory" (see _backend)
    Field("BACKEND", None, optional(choice(Choices.BACKENDS), Problems.NOT_A_CHOICE_OR_NONE)),
    Field("KEY_PREFIX", "quota", _key_prefix),
    Field("CLOCK", "redis", _clock),
    Field("MAX_CLOCK_REGRESSION", 1.0, number(0, allow_zero=True)),
    Field("TIMEOUT", 0.1, number(0.001)),
    Field("DEADLINE", 0.25, number(0.001)),
    Field("MAX_INFLIGHT", 64, integer(1)),
    Field("REDIS_PUBLIC_PATH", False, boolean),
    Field("FAILURE_MODE", "closed", choice(Form.FAILURE_MODES)),
    Field("FAILURE_RETRY_AFTER", 1, integer(1, Bounds.MAX_FAILURE_RETRY_AFTER)),
    Field("LOCAL_FALLBACK", {"ENABLED": False, "MAX_ENTRIES": 10000}, _local_fallback),
    Field("DENIAL_CACHE", {"ENABLED": True, "MAX_ENTRIES": 4096, "MAX_TTL": 5.0}, _denial_cache),
    Field("MEMORY_MAX_ENTRIES", 4096, integer(1)),
    Field("DEDUP_TTL", 5.0, number(0.001)),
    Field("CLEANUP_GRACE", 1.0, number(0, allow_zero=True)),
    Field("HMAC_KEY", None, optional(_secret)),  # derived with SECRET_KEY (_hmac_key)
    Field("HMAC_KEY_VERSION", 1, integer(1)),
    Field("TRUSTED_PROXIES", [], string_list(_network)),
    Field("PROXY_COUNT", None, optional(integer(0), Problems.EXPECTED_PROXY_COUNT)),
    Field("IPV6_PREFIX", 64, integer(1, 128)),
    Field("API_KEY_HEADER", "X-Api-Key", _header_name),
    Field("API_KEY_RESOLVER", None, dotted_path),
    Field("TENANT_RESOLVER", None, dotted_path),
    Field("PLAN_RESOLVER", None, dotted_path),
    Field("HEADERS", "ietf", choice(Choices.HEADER_STYLES)),
    Field("DENIED_VIEW", None, dotted_path),
    Field("EXEMPT_PATHS", [], string_list(_path)),
    Field("TIMEZONE", "UTC", _timezone),
    Field("POLICIES", {}, _policies),
    Field("POLICY_SOURCES", ["settings", "database"], string_list(one_of(Choices.POLICY_SOURCES))),
    Field("POLICY_CACHE_TTL", 5.0, number(0, allow_zero=True)),
    # the drop-ins decide as DRF's history log does
    Field("DRF_ALGORITHM", "sliding_log", choice(ALGORITHMS)),
    Field("EXEMPT_WHEN", None, dotted_path),  # callable(request) -> bool (docs/policies.md)
    Field("LOGIN_POLICIES", [], string_list()),  # policy ids (docs/login.md)
)
DEFAULTS: Mapping[str, Any] = MappingProxyType({field.key: field.default for field in FIELDS})


# -- the rules across keys -----------------------------------------------------------------
def _hmac_key(values: dict[str, Any], reader: Reader) -> None:
    """The HMAC key derived from ``HMAC_KEY``, or from ``SECRET_KEY`` when it is unset."""
    given = values["hmac_key"]
    values["hmac_key"] = derive_hmac_key(given, reader.secret_key)
    values["hmac_key_configured"] = given is not None


def _backend(values: dict[str, Any], reader: Reader) -> None:
    """``BACKEND`` implied by the server settings when None, and what contradicts it."""
    server = values["redis_url"] or values["cache_alias"] or values["sentinel"]
    if values["backend"] is None:
        values["backend"] = "redis" if server else "memory"
    if values["backend"] == "redis" and not server:
        reader.report(Problems.REDIS_WITHOUT_SERVER, key_of("BACKEND"))
    if values["cluster"] and values["sentinel"]:
        reader.report(Problems.CLUSTER_WITH_SENTINEL, key_of("CLUSTER"))
    if values["cluster"] and not (values["redis_url"] or values["cache_alias"]):
        reader.report(Problems.CLUSTER_WITHOUT_URL, key_of("CLUSTER"))


def _deadline(values: dict[str, Any], reader: Reader) -> None:
    """``DEADLINE`` bounds the whole call, so it is at least one attempt's ``TIMEOUT``."""
    if values["deadline"] < values["timeout"]:
        reader.report(
            Problems.DEADLINE_BELOW_TIMEOUT,
            key_of("DEADLINE"),
            deadline=values["deadline"],
            timeout=values["timeout"],
        )


#: Run in order once every key is read, on the values by attribute name.
RULES: tuple[Callable[[dict[str, Any], Reader], None], ...] = (_hmac_key, _backend, _deadline)


def parse_settings(
    raw: object, *, secret_key: str | bytes = "", with_policies: bool = True
) -> tuple[QuotaSettings | None, list[SettingsProblem]]:
    """Validate ``raw`` (the ``QUOTA`` dict) and return the settings and every problem.

    The settings object is None only when ``raw`` is not a dict; otherwise invalid keys
    fall back to their defaults so that one mistake does not hide the next.
    """
    reader = Reader(secret_key=secret_key, with_policies=with_policies)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        reader.report(Problems.NOT_A_DICT, type=type(raw).__name__)
        return None, reader.problems
    known = ", ".join(sorted(DEFAULTS))
    for name in sorted(set(raw) - set(DEFAULTS), key=str):
        reader.report(Problems.UNKNOWN_KEY, key_of(name), known=known)
    values = {
        field.attribute: reader.read(field, raw.get(field.key, field.default)) for field in FIELDS
    }
    for rule in RULES:
        rule(values, reader)
    return QuotaSettings(**values, raw=raw), reader.problems


def quota_setting() -> object:
    """``settings.QUOTA``; when it is not set at all, ``{"CACHE_ALIAS": alias}`` if
    django-ratelimit's ``RATELIMIT_USE_CACHE`` (default ``"default"``) names a django-redis
    cache, else ``{}`` (the memory backend). So a project that moves from
    django-ratelimit keeps its counters in the same Redis (``docs/django-ratelimit.md``).
    """
    unset = object()
    raw = getattr(django_settings, "QUOTA", unset)
    if raw is not unset:
        return raw
    alias = getattr(django_settings, "RATELIMIT_USE_CACHE", "default")
    caches = getattr(django_settings, "CACHES", None) or {}
    cache = caches.get(alias) if isinstance(alias, str) else None
    if isinstance(cache, Mapping) and cache.get("BACKEND") in Choices.DJANGO_REDIS_BACKENDS:
        return {"CACHE_ALIAS": alias}
    return {}


class _SettingsCache:
    """The settings this process parsed, and the listeners to tell when they are dropped.

    One instance, ``_state``: :func:`get_settings` reads ``settings`` without the lock
    (a plain attribute load on every decision); parsing and dropping take it.
    """

    __slots__ = ("listeners", "lock", "settings")

    def __init__(self) -> None:
        self.settings: QuotaSettings | None = None
        self.lock = threading.Lock()
        self.listeners: list[Callable[[], None]] = []

    def load(self) -> QuotaSettings:
        """Parse ``settings.QUOTA`` unless another thread just did, and keep the result."""
        with self.lock:
            if self.settings is None:
                if apps.ready and not apps.is_installed("django_quota"):
                    raise ImproperlyConfigured(Problems.APP_NOT_INSTALLED)
                parsed, problems = parse_settings(
                    quota_setting(), secret_key=django_settings.SECRET_KEY
                )
                if problems or parsed is None:
                    first = problems[0]
                    raise ImproperlyConfigured(
                        f"{first.key}: {first.message} ({first.id}; run manage.py check for all)"
                    )
                self.settings = parsed
            return self.settings

    def drop(self) -> None:
        """Forget the parsed settings, then tell every listener."""
        with self.lock:
            self.settings = None
        for listener in list(self.listeners):
            listener()


_state = _SettingsCache()


def get_settings() -> QuotaSettings:
    """The current validated settings (cached until a watched setting changes).

    Raises :class:`~django.core.exceptions.ImproperlyConfigured` when ``QUOTA`` is invalid;
    ``manage.py check`` lists every problem with its id.
    """
    current = _state.settings
    if current is not None:
        return current
    return _state.load()


def cached_settings() -> QuotaSettings | None:
    """The settings :func:`get_settings` cached, or None when nothing read them since the
    last change (then nothing built from them, counters included, exists either)."""
    return _state.settings


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever cached settings are dropped (backends, registries);
    once, however often it is given."""
    if listener not in _state.listeners:
        _state.listeners.append(listener)


def clear() -> None:
    """Drop the cached settings and everything built from them."""
    _state.drop()


def reset_on_setting_change(*, setting: str, **kwargs: Any) -> None:
    """Receive Django's ``setting_changed``: :func:`clear` when a watched setting changed
    (one whose change drops every cached configuration, connection and counter)."""
    watched = {"QUOTA", "SECRET_KEY", "REST_FRAMEWORK", "CACHES", "DEBUG", "RATELIMIT_USE_CACHE"}
    if setting in watched:
        clear()
