"""System checks (``manage.py check``): every configuration mistake has an id, names the
key and says how to fix it. Built from the same validation the runtime uses
(:func:`django_quota.conf.parse_settings`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Warning, register
from django.utils.module_loading import import_string

from django_quota.conf import E_CACHE_ALIAS, E_DUPLICATE_POLICY, QuotaSettings, parse_settings
from django_quota.core.policy import AUTO, Policy, generated_policy_id

W_MEMORY_IN_PRODUCTION = "django_quota.W001"
W_HMAC_KEY_UNSET = "django_quota.W002"
W_DRF_NUM_PROXIES = "django_quota.W003"
W_MIDDLEWARE_DENIES_ANONYMOUS = "django_quota.W004"
W_CLIENT_CLOCK = "django_quota.W005"
W_MIDDLEWARE_MISSING = "django_quota.W006"
W_RESOLVER_BEFORE_AUTHENTICATION = "django_quota.W007"
W_REDIS_URL_IGNORED = "django_quota.W008"
E_UNKNOWN_VIEW_POLICY = "django_quota.E009"
E_MIDDLEWARE_BEFORE_AUTHENTICATION = "django_quota.E010"
E_DUPLICATE_HEADER_ITEM = "django_quota.E011"
E_FOLDED_GENERATED_ID = "django_quota.E012"
#: Also the id in ``django_quota.throttling``'s log line for such a rate.
E_DRF_RATE = "django_quota.E013"

MIDDLEWARE_PATH = "django_quota.middleware.QuotaMiddleware"
AUTHENTICATION_MIDDLEWARE_PATH = "django.contrib.auth.middleware.AuthenticationMiddleware"
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
    effective = _effective_policies(parsed)
    messages += _middleware_order(parsed, effective)
    messages += _header_items(effective)
    messages += _folded_generated_ids()
    return messages


def _effective_policies(parsed: QuotaSettings) -> list[Policy]:
    """Settings and database policies as the registry merges them, and the policies
    ``@quota(rate=...)`` declared; the settings policies alone when the registry cannot be
    built (the database not migrated yet, say)."""
    from django_quota import policies

    try:
        found = dict(policies.get_registry().policies)
    except Exception:  # reported by the registry itself
        found = dict(parsed.policies)
    for policy in policies.declared():
        found.setdefault(policy.id, policy)
    return list(found.values())


def _is_subclass_entry(entry: str, base_path: str) -> bool:
    """True when the MIDDLEWARE ``entry`` is ``base_path`` or a subclass of it."""
    if entry == base_path:
        return True
    try:
        found, base = import_string(entry), import_string(base_path)
    except ImportError:  # Django's own checks report a middleware that cannot be imported
        return False
    return isinstance(found, type) and isinstance(base, type) and issubclass(found, base)


def _index(middleware: list[str], base_path: str) -> int | None:
    return next(
        (at for at, entry in enumerate(middleware) if _is_subclass_entry(entry, base_path)),
        None,
    )


def _user_effect(policy: Policy) -> str:
    if AUTO in policy.selector:
        return "logged-in users are counted per IP address"
    if policy.on_missing == "skip":
        return "logged-in users are never limited"
    return "every request is refused as selector_identity_missing"


def _middleware_order(parsed: QuotaSettings, effective: Iterable[Policy]) -> list[CheckMessage]:
    """E010 and W007: ``QuotaMiddleware`` placed before ``AuthenticationMiddleware``
    applies its policies before ``request.user`` exists."""
    middleware = [str(entry) for entry in getattr(django_settings, "MIDDLEWARE", None) or []]
    quota_at = _index(middleware, MIDDLEWARE_PATH)
    auth_at = _index(middleware, AUTHENTICATION_MIDDLEWARE_PATH)
    if quota_at is None or auth_at is None or quota_at > auth_at:
        return []
    before = (
        "QuotaMiddleware comes before AuthenticationMiddleware in MIDDLEWARE, so "
    )
    hint = f"move {MIDDLEWARE_PATH!r} after {AUTHENTICATION_MIDDLEWARE_PATH!r} in MIDDLEWARE"
    resolvers = {"api_key": ("API_KEY_RESOLVER", parsed.api_key_resolver),
                 "tenant": ("TENANT_RESOLVER", parsed.tenant_resolver)}
    messages: list[CheckMessage] = []
    for policy in effective:
        if not (policy.routes and policy.enabled):
            continue  # not applied by the middleware
        named = f"{_policy_key(policy)} (selector {', '.join(policy.selector)})"
        if {"user", AUTO} & set(policy.selector):
            messages.append(
                Error(
                    f"{before}request.user is not set when it applies {named}: "
                    f"{_user_effect(policy)}",
                    hint=hint,
                    id=E_MIDDLEWARE_BEFORE_AUTHENTICATION,
                )
            )
            continue
        for dimension in policy.selector:
            setting, resolver = resolvers.get(dimension, ("", None))
            if resolver is not None:
                messages.append(
                    Warning(
                        f"{before}QUOTA[{setting!r}] runs before request.user is set for "
                        f"{named}: a resolver that reads request.user finds no user",
                        hint=hint,
                        id=W_RESOLVER_BEFORE_AUTHENTICATION,
                    )
                )
    return messages


def _policy_key(policy: Policy) -> str:
    if policy.source == "settings":
        return f"QUOTA['POLICIES'][{policy.id!r}]"
    return f"policy {policy.id!r} ({policy.source})"


def _header_items(effective: Iterable[Policy]) -> list[CheckMessage]:
    """E011: two windows whose rate-limit header items have one name (policy ``p.burst``
    beside policy ``p`` with a window ``burst``): a client could not tell them apart."""
    from django_quota.http import item_name

    owners: dict[str, list[tuple[str, str]]] = {}
    for policy in effective:
        for window in policy.windows:
            name = item_name(policy.id, window.name, len(policy.windows))
            owners.setdefault(name, []).append((policy.id, window.name))
    return [
        Error(
            f"the rate-limit header item \"{name}\" would name both "
            + " and ".join(f"policy {pid!r} (window {window!r})" for pid, window in found),
            hint="rename one of the policies or windows",
            id=E_DUPLICATE_HEADER_ITEM,
        )
        for name, found in owners.items()
        if len(found) > 1
    ]


def _folded_generated_ids() -> list[CheckMessage]:
    """E012: distinct views or DRF scopes whose generated ids fold together (lower-casing,
    replaced characters) and would silently share one counter."""
    messages: list[CheckMessage] = []
    try:
        from django_quota import references

        generated = references.generated_views()
    except Exception:  # URLconf not ready: other checks report it
        generated = []
    views: dict[str, dict[str, str]] = {}
    for view in generated:
        views.setdefault(view.policy, {}).setdefault(view.name, view.route)
    for policy_id, names in views.items():
        if len(names) > 1:
            listed = " and ".join(
                f"{name} (at {route!r})" for name, route in sorted(names.items())
            )
            messages.append(
                Error(
                    f"the views {listed} generate the same policy id {policy_id!r} and would "
                    "share its counters",
                    hint="rename one of them, or give one @quota(policy=...) with a policy of "
                    "its own",
                    id=E_FOLDED_GENERATED_ID,
                )
            )
    rest_framework = getattr(django_settings, "REST_FRAMEWORK", {}) or {}
    rates = rest_framework.get("DEFAULT_THROTTLE_RATES") or {}
    scopes: dict[str, list[str]] = {}
    for scope in rates if isinstance(rates, dict) else ():
        scopes.setdefault(generated_policy_id("drf", str(scope)), []).append(str(scope))
    for policy_id, found in scopes.items():
        if len(found) > 1:
            listed = " and ".join(repr(scope) for scope in sorted(found))
            messages.append(
                Error(
                    f"the DRF throttle scopes {listed} in "
                    "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] generate the same policy id "
                    f"{policy_id!r} and would share its counters",
                    hint="rename one of the scopes",
                    id=E_FOLDED_GENERATED_ID,
                )
            )
    return messages


def _view_policies() -> list[CheckMessage]:
    """E009: a view names a policy id that no source defines (every request to it would
    fail). Skipped quietly when the URLconf or the policies cannot be loaded."""
    try:
        from django_quota import policies, references

        known = set(policies.get_registry().policies)
        named = references.policy_references()
    except Exception:  # URLconf or database not ready: other checks report it
        return []
    return [
        Error(
            f"the view at {reference.route!r} names policy {reference.policy!r}, which is "
            "not defined",
            hint="add it to QUOTA['POLICIES'] or the admin, or fix the name",
            id=E_UNKNOWN_VIEW_POLICY,
        )
        for reference in named
        if reference.policy not in known and policies.known_policy(reference.policy) is None
    ]


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
    """E006 (the alias names no django-redis cache) and W008 (REDIS_URL beside it, which
    the backend never reads: the cache's URL wins)."""
    alias = parsed.cache_alias
    if alias is None:
        return []
    messages: list[CheckMessage] = []
    if parsed.redis_url is not None:
        messages.append(
            Warning(
                "QUOTA['REDIS_URL'] is ignored because QUOTA['CACHE_ALIAS'] is set: the "
                f"counters live in the Redis database of CACHES[{alias!r}], not at REDIS_URL",
                hint="remove QUOTA['REDIS_URL'], or remove QUOTA['CACHE_ALIAS'] to keep the "
                "counters at REDIS_URL (a database that cache.clear() does not flush)",
                id=W_REDIS_URL_IGNORED,
            )
        )
    return messages + _cache_alias_target(alias)


def _cache_alias_target(alias: str) -> list[CheckMessage]:
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
    """E013: a ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]`` entry the drop-in throttles
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
