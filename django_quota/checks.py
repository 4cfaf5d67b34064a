"""System checks (``manage.py check``): every configuration mistake has an id, names the
key and says how to fix it. Built from the same validation the runtime uses
(:func:`django_quota.conf.parse_settings`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Warning
from django.utils.module_loading import import_string

from django_quota import conf
from django_quota.conf import QuotaSettings, parse_settings
from django_quota.core.policy import Policy, Selector, generated_policy_id
from django_quota.messages import Checks, Message

MIDDLEWARE_PATH = "django_quota.middleware.QuotaMiddleware"


def _error(message: Message, **values: object) -> Error:
    text, hint = message.render(**values)
    return Error(text, hint=hint, id=message.id)


def _warning(message: Message, **values: object) -> Warning:
    text, hint = message.render(**values)
    return Warning(text, hint=hint, id=message.id)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate ``settings.QUOTA`` and warn about risky combinations."""
    from django_quota import policies

    with policies.checking():  # quiet before the first migrate, which runs the checks
        return _check_settings()


def _check_settings() -> list[CheckMessage]:
    parsed, problems = parse_settings(conf.quota_setting(), secret_key=django_settings.SECRET_KEY)
    reported: list[CheckMessage] = [
        Error(f"{problem.key}: {problem.message}", hint=problem.hint, id=problem.id)
        for problem in problems
    ]
    if parsed is None:
        return reported
    reported += _cache_alias(parsed)
    reported += _warnings(parsed)
    reported += _database_conflicts(parsed)
    reported += _view_policies()
    effective = _effective_policies(parsed)
    reported += _middleware_order(parsed, effective)
    reported += _header_items(effective)
    reported += _folded_generated_ids()
    reported += _login_protection(parsed, effective)
    return reported


def _login_protection(parsed: QuotaSettings, effective: Iterable[Policy]) -> list[CheckMessage]:
    """E014 and E009 for ``LOGIN_POLICIES`` (docs/login.md): the backend first in
    ``AUTHENTICATION_BACKENDS``, the middleware installed, each id defined, each selector
    of ``user`` and ``ip`` only."""
    if not parsed.login_policies:
        return []
    from django_quota.auth import BACKEND_PATH, LOGIN_DIMENSIONS

    found: list[CheckMessage] = []
    backends = [str(entry) for entry in getattr(django_settings, "AUTHENTICATION_BACKENDS", [])]
    at = _index(backends, BACKEND_PATH)
    if at != 0:
        where = Checks.LOGIN_BACKEND_MISSING if at is None else Checks.LOGIN_BACKEND_LATE
        found.append(_error(Checks.LOGIN_BACKEND_NOT_FIRST, backend=BACKEND_PATH, where=where))
    middleware = [str(entry) for entry in getattr(django_settings, "MIDDLEWARE", None) or []]
    if _index(middleware, MIDDLEWARE_PATH) is None:
        found.append(_error(Checks.LOGIN_MIDDLEWARE_MISSING, middleware=MIDDLEWARE_PATH))
    by_id = {policy.id: policy for policy in effective}
    for policy_id in parsed.login_policies:
        policy = by_id.get(policy_id)
        if policy is None:
            found.append(_error(Checks.LOGIN_POLICY_UNKNOWN, policy=policy_id))
        elif not set(policy.selector) <= LOGIN_DIMENSIONS:
            selector = list(policy.selector)
            found.append(_error(Checks.LOGIN_SELECTOR, policy=policy_id, selector=selector))
    return found


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
    if Selector.AUTO in policy.selector:
        return Checks.USER_COUNTED_PER_IP
    if policy.on_missing == "skip":
        return Checks.USER_NEVER_LIMITED
    return Checks.USER_ALWAYS_REFUSED


def _middleware_order(parsed: QuotaSettings, effective: Iterable[Policy]) -> list[CheckMessage]:
    """E010 and W007: ``QuotaMiddleware`` placed before ``AuthenticationMiddleware``
    applies its policies before ``request.user`` exists."""
    middleware = [str(entry) for entry in getattr(django_settings, "MIDDLEWARE", None) or []]
    authentication = "django.contrib.auth.middleware.AuthenticationMiddleware"
    quota_at = _index(middleware, MIDDLEWARE_PATH)
    auth_at = _index(middleware, authentication)
    if quota_at is None or auth_at is None or quota_at > auth_at:
        return []
    places = {"middleware": MIDDLEWARE_PATH, "authentication": authentication}
    resolvers = {
        "api_key": ("API_KEY_RESOLVER", parsed.api_key_resolver),
        "tenant": ("TENANT_RESOLVER", parsed.tenant_resolver),
    }
    found: list[CheckMessage] = []
    for policy in effective:
        if not (policy.routes and policy.enabled):
            continue  # not applied by the middleware
        named = Checks.NAMED_POLICY.format(
            policy=_policy_key(policy), selector=", ".join(policy.selector)
        )
        if {"user", Selector.AUTO} & set(policy.selector):
            found.append(
                _error(
                    Checks.MIDDLEWARE_BEFORE_AUTHENTICATION,
                    named=named,
                    effect=_user_effect(policy),
                    **places,
                )
            )
            continue
        for dimension in policy.selector:
            setting, resolver = resolvers.get(dimension, ("", None))
            if resolver is not None:
                found.append(
                    _warning(
                        Checks.RESOLVER_BEFORE_AUTHENTICATION,
                        setting=setting,
                        named=named,
                        **places,
                    )
                )
    return found


def _policy_key(policy: Policy) -> str:
    if policy.source == "settings":
        return Checks.SETTINGS_POLICY.format(id=policy.id)
    return Checks.OTHER_POLICY.format(id=policy.id, source=policy.source)


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
        _error(
            Checks.DUPLICATE_HEADER_ITEM,
            name=name,
            owners=" and ".join(
                Checks.HEADER_ITEM_OWNER.format(policy=pid, window=window) for pid, window in found
            ),
        )
        for name, found in owners.items()
        if len(found) > 1
    ]


def _folded_generated_ids() -> list[CheckMessage]:
    """E012: distinct views or DRF scopes whose generated ids fold together (lower-casing,
    replaced characters) and would silently share one counter."""
    reported: list[CheckMessage] = []
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
                Checks.VIEW_AT.format(name=name, route=route)
                for name, route in sorted(names.items())
            )
            reported.append(_error(Checks.FOLDED_VIEW_IDS, listed=listed, policy=policy_id))
    rest_framework = getattr(django_settings, "REST_FRAMEWORK", {}) or {}
    rates = rest_framework.get("DEFAULT_THROTTLE_RATES") or {}
    scopes: dict[str, list[str]] = {}
    for scope in rates if isinstance(rates, dict) else ():
        scopes.setdefault(generated_policy_id("drf", str(scope)), []).append(str(scope))
    for policy_id, found in scopes.items():
        if len(found) > 1:
            listed = " and ".join(repr(scope) for scope in sorted(found))
            reported.append(_error(Checks.FOLDED_SCOPE_IDS, listed=listed, policy=policy_id))
    return reported


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
        _error(Checks.UNKNOWN_VIEW_POLICY, route=reference.route, policy=reference.policy)
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
    return [_error(Checks.DUPLICATE_POLICY, policy=name) for name in sorted(names)]


def _cache_alias(parsed: QuotaSettings) -> list[CheckMessage]:
    """E006 (the alias names no django-redis cache) and W008 (REDIS_URL beside it, which
    the backend never reads: the cache's URL wins)."""
    alias = parsed.cache_alias
    if alias is None:
        return []
    reported: list[CheckMessage] = []
    if parsed.redis_url is not None:
        reported.append(_warning(Checks.REDIS_URL_IGNORED, alias=alias))
    return reported + _cache_alias_target(alias)


def _cache_alias_target(alias: str) -> list[CheckMessage]:
    caches = getattr(django_settings, "CACHES", {})
    if alias not in caches:
        return [_error(Checks.NO_SUCH_CACHE, alias=alias)]
    backend = caches[alias].get("BACKEND")
    if backend not in conf.Choices.DJANGO_REDIS_BACKENDS:
        return [_error(Checks.CACHE_NOT_DJANGO_REDIS, alias=alias, backend=backend)]
    return []


def _warnings(parsed: QuotaSettings) -> list[CheckMessage]:
    reported: list[CheckMessage] = []
    debug = bool(getattr(django_settings, "DEBUG", False))
    if parsed.backend == "memory" and not debug:
        reported.append(_warning(Checks.MEMORY_IN_PRODUCTION))
    hmac_key_given = parsed.raw.get("HMAC_KEY") is not None  # invalid ones are an E003
    if not parsed.hmac_key_configured and not hmac_key_given and not debug:
        reported.append(_warning(Checks.HMAC_KEY_UNSET))
    rest_framework = getattr(django_settings, "REST_FRAMEWORK", {}) or {}
    if (
        rest_framework.get("NUM_PROXIES") is not None
        and not parsed.trusted_proxies
        and parsed.proxy_count is None
    ):
        reported.append(_warning(Checks.DRF_NUM_PROXIES))
    for policy in parsed.policies.values():
        risky = {"user", "api_key", "tenant"} & set(policy.selector)
        if policy.routes and risky and policy.on_missing == "deny":
            reported.append(
                _warning(
                    Checks.MIDDLEWARE_DENIES_ANONYMOUS,
                    policy=policy.id,
                    dimensions=", ".join(sorted(risky)),
                )
            )
    if parsed.clock != "redis":
        reported.append(_warning(Checks.CLIENT_CLOCK, clock=parsed.clock))
    middleware = getattr(django_settings, "MIDDLEWARE", None) or []
    if any(policy.routes for policy in parsed.policies.values()) and (
        MIDDLEWARE_PATH not in middleware
    ):
        reported.append(_warning(Checks.MIDDLEWARE_MISSING, middleware=MIDDLEWARE_PATH))
    return reported


def check_eviction(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W009: a reachable Redis backend that may evict keys (``docs/operations.md``,
    "Eviction"). Quiet for the memory backend, for settings that do not parse (E001-E005
    say why), and for a Redis this process cannot reach or may not ask ``INFO``: this
    check reports eviction only (``quota check`` reports connectivity)."""
    try:
        if conf.get_settings().backend != "redis":
            return []
        from django_quota import operations

        readings = operations.eviction()
    except Exception:  # unreachable, refused, or settings in error: not this check's
        return []
    return [
        _warning(
            Checks.REDIS_EVICTS,
            node=reading.node,
            policy=reading.policy,
            maxmemory=reading.maxmemory,
            evicted=reading.evicted_keys,
        )
        for reading in readings
        if reading.evicting
    ]


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

    from django_quota.core.rates import Grammar

    rates = api_settings.DEFAULT_THROTTLE_RATES
    if not isinstance(rates, Mapping):
        return [_error(Checks.DRF_RATES_NOT_A_DICT, type=type(rates).__name__)]
    reported: list[CheckMessage] = []
    for scope, rate in rates.items():
        if rate is None:
            continue
        try:
            parse_drf_rate(rate)
        except ImproperlyConfigured as exc:
            reported.append(
                _error(Checks.DRF_RATE_UNUSABLE, scope=scope, error=exc, grammar=Grammar.SPELLED)
            )
    return reported
