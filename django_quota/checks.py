"""System checks (``manage.py check``): every configuration mistake has an id, names the
key and says how to fix it. Built from the same validation the runtime uses
(:func:`django_quota.conf.parse_settings`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Warning, register

from django_quota.conf import E_CACHE_ALIAS, E_DUPLICATE_POLICY, QuotaSettings, parse_settings

W_MEMORY_IN_PRODUCTION = "django_quota.W001"
W_HMAC_KEY_UNSET = "django_quota.W002"
W_DRF_NUM_PROXIES = "django_quota.W003"
W_MIDDLEWARE_DENIES_ANONYMOUS = "django_quota.W004"
W_CLIENT_CLOCK = "django_quota.W005"
W_MIDDLEWARE_MISSING = "django_quota.W006"
E_UNKNOWN_VIEW_POLICY = "django_quota.E009"
#: Also the id in ``django_quota.throttling``'s log line for such a rate.
E_DRF_RATE = "django_quota.E010"

MIDDLEWARE_PATH = "django_quota.middleware.QuotaMiddleware"
DJANGO_REDIS_BACKENDS = ("django_redis.cache.RedisCache",)


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``settings.QUOTA`` and warn about risky combinations."""
    parsed, problems = parse_settings(
        getattr(django_settings, "QUOTA", {}), secret_key=django_settings.SECRET_KEY
    )
    messages: list[CheckMessage] = [
        Error(f"{problem.key}: {problem.message}", hint=problem.hint, id=problem.id)
        for problem in problems
    ]
    if parsed is None:
        return messages
    messages += _cache_alias(parsed)
    messages += _warnings(parsed)
    messages += _database_conflicts(parsed)
    messages += _view_policies()
    return messages


def _walk(patterns: Any, prefix: str = "") -> Any:
    """(route, callback) of every URL pattern, included ones too."""
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if hasattr(pattern, "url_patterns"):
            yield from _walk(pattern.url_patterns, route)
        else:
            yield route, pattern.callback


def _named_policies(callback: Any) -> list[str]:
    """Policy ids a view names: ``@quota("id")`` and a ``QuotaThrottle``'s
    ``quota_policies`` or ``throttle_scope`` (the drop-ins build their own)."""
    names = []
    named = getattr(callback, "quota_policy_id", None)
    view_class = getattr(callback, "view_class", None) or getattr(callback, "cls", None)
    if view_class is not None:
        named = named or getattr(getattr(view_class, "dispatch", None), "quota_policy_id", None)
    if named:
        names.append(named)
    drf_view = getattr(callback, "cls", None)
    if drf_view is not None:
        try:
            from django_quota.throttling import (
                QuotaThrottle,
                SimpleRateThrottle,
                named_policy_ids,
            )
        except ImportError:  # DRF not installed
            return names
        for throttle in getattr(drf_view, "throttle_classes", ()):
            if not isinstance(throttle, type) or not issubclass(throttle, QuotaThrottle):
                continue
            if issubclass(throttle, SimpleRateThrottle):
                continue
            names.extend(named_policy_ids(drf_view, throttle.quota_policies))
    return names


def _view_policies() -> list[CheckMessage]:
    """E009: a view names a policy id that no source defines (every request to it would
    fail). Skipped quietly when the URLconf or the policies cannot be loaded."""
    try:
        from django.urls import get_resolver

        from django_quota import policies

        known = set(policies.get_registry().policies)
        patterns = list(_walk(get_resolver().url_patterns))
    except Exception:  # URLconf or database not ready: other checks report it
        return []
    messages: list[CheckMessage] = []
    for route, callback in patterns:
        for name in _named_policies(callback):
            if name not in known and policies.known_policy(name) is None:
                messages.append(
                    Error(
                        f"the view at {route!r} names policy {name!r}, which is not defined",
                        hint="add it to QUOTA['POLICIES'] or the admin, or fix the name",
                        id=E_UNKNOWN_VIEW_POLICY,
                    )
                )
    return messages


def _database_conflicts(parsed: QuotaSettings) -> list[CheckMessage]:
    """E007: a policy id both in settings and in the database (skipped quietly when the
    database is not reachable or not migrated yet)."""
    if "database" not in parsed.policy_sources or not parsed.policies:
        return []
    from django_quota.models import QuotaPolicy

    try:
        names = set(
            QuotaPolicy.objects.filter(name__in=list(parsed.policies)).values_list(
                "name", flat=True
            )
        )
    except Exception:  # not migrated, unreachable, or access not allowed: skip quietly
        return []
    return [
        Error(
            f"QUOTA['POLICIES'][{name!r}] is also a database policy; the database row is "
            "ignored",
            hint="rename or delete one of them (admin: Quota policies)",
            id=E_DUPLICATE_POLICY,
        )
        for name in sorted(names)
    ]


def _cache_alias(parsed: QuotaSettings) -> list[CheckMessage]:
    alias = parsed.cache_alias
    if alias is None:
        return []
    caches = getattr(django_settings, "CACHES", {})
    if alias not in caches:
        return [
            Error(
                f"QUOTA['CACHE_ALIAS']: no cache named {alias!r} in CACHES",
                hint=f"define CACHES[{alias!r}] with django-redis, or set REDIS_URL instead",
                id=E_CACHE_ALIAS,
            )
        ]
    backend = caches[alias].get("BACKEND")
    if backend not in DJANGO_REDIS_BACKENDS:
        return [
            Error(
                f"QUOTA['CACHE_ALIAS']: cache {alias!r} uses {backend!r}, not django-redis",
                hint="use django_redis.cache.RedisCache for that cache, or set REDIS_URL",
                id=E_CACHE_ALIAS,
            )
        ]
    return []


def _warnings(parsed: QuotaSettings) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    debug = bool(getattr(django_settings, "DEBUG", False))
    if parsed.backend == "memory" and not debug:
        messages.append(
            Warning(
                "QUOTA['BACKEND']: the memory backend keeps counters per process; with several "
                "processes each admits the full limit",
                hint="set QUOTA['REDIS_URL'] (or CACHE_ALIAS / SENTINEL) in production",
                id=W_MEMORY_IN_PRODUCTION,
            )
        )
    hmac_key_given = parsed.raw.get("HMAC_KEY") is not None  # invalid ones are an E003
    if not parsed.hmac_key_configured and not hmac_key_given and not debug:
        messages.append(
            Warning(
                "QUOTA['HMAC_KEY'] is unset: pseudonyms derive from SECRET_KEY, so rotating "
                "SECRET_KEY resets every counter",
                hint="set QUOTA['HMAC_KEY'] to a dedicated secret",
                id=W_HMAC_KEY_UNSET,
            )
        )
    rest_framework = getattr(django_settings, "REST_FRAMEWORK", {}) or {}
    if (
        rest_framework.get("NUM_PROXIES") is not None
        and not parsed.trusted_proxies
        and parsed.proxy_count is None
    ):
        messages.append(
            Warning(
                "REST_FRAMEWORK['NUM_PROXIES'] is set but QUOTA['TRUSTED_PROXIES'] and "
                "QUOTA['PROXY_COUNT'] are not: the drop-in DRF throttles follow NUM_PROXIES, "
                "but the middleware, @quota and QuotaThrottle key on REMOTE_ADDR, the "
                "proxy's address",
                hint="set QUOTA['PROXY_COUNT'] to the same number, or list TRUSTED_PROXIES, "
                "so that every layer sees the same client",
                id=W_DRF_NUM_PROXIES,
            )
        )
    for policy in parsed.policies.values():
        risky = {"user", "api_key", "tenant"} & set(policy.selector)
        if policy.routes and risky and policy.on_missing == "deny":
            messages.append(
                Warning(
                    f"QUOTA['POLICIES'][{policy.id!r}]: a middleware policy selecting "
                    f"{', '.join(sorted(risky))} with on_missing 'deny' refuses every request "
                    "without that dimension (anonymous users, DRF-authenticated clients)",
                    hint="use selector ['auto'], on_missing 'skip', or a QuotaThrottle",
                    id=W_MIDDLEWARE_DENIES_ANONYMOUS,
                )
            )
    if parsed.clock != "redis":
        messages.append(
            Warning(
                f"QUOTA['CLOCK'] is {parsed.clock!r}: counters follow this process's clock, "
                "bounded by MAX_CLOCK_REGRESSION; skewed clocks across hosts shift windows",
                hint="keep the default 'redis' clock unless tests inject time",
                id=W_CLIENT_CLOCK,
            )
        )
    middleware = getattr(django_settings, "MIDDLEWARE", None) or []
    if any(policy.routes for policy in parsed.policies.values()) and (
        MIDDLEWARE_PATH not in middleware
    ):
        messages.append(
            Warning(
                "policies have routes but QuotaMiddleware is not in MIDDLEWARE: they apply "
                "only through throttles and decorators",
                hint=f"add {MIDDLEWARE_PATH!r} after AuthenticationMiddleware",
                id=W_MIDDLEWARE_MISSING,
            )
        )
    return messages


@register()
def check_drf_rates(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E010: a ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]`` entry the drop-in throttles
    cannot use (DRF could not parse it, or it is outside the bounds): every request
    through a drop-in of that scope would get the failure mode. Quiet without DRF."""
    try:
        from rest_framework.settings import api_settings

        from django_quota.throttling import parse_drf_rate
    except ImportError:  # DRF is an optional extra
        return []
    from django.core.exceptions import ImproperlyConfigured

    from django_quota.core.rates import GRAMMAR

    key = "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']"
    rates = api_settings.DEFAULT_THROTTLE_RATES
    if not isinstance(rates, Mapping):
        return [
            Error(
                f"{key} must be a dict of scope -> rate, not {type(rates).__name__}",
                hint="e.g. {'anon': '100/day', 'user': '1000/day'}",
                id=E_DRF_RATE,
            )
        ]
    messages: list[CheckMessage] = []
    for scope, rate in rates.items():
        if rate is None:
            continue
        try:
            parse_drf_rate(rate)
        except ImproperlyConfigured as exc:
            messages.append(
                Error(
                    f"{key}[{scope!r}]: {exc}",
                    hint=f"write {GRAMMAR}, or None for no limit",
                    id=E_DRF_RATE,
                )
            )
    return messages
