"""System checks: one test per id, each with its valid counterpart (docs/settings.md).

E007 (a policy id in both settings and the database) belongs to the database registry and
is tested with it.
"""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.checks import Error, Warning, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_quota.checks import MIDDLEWARE_PATH, check_settings

HMAC_KEY = "tests-hmac-key-0123456789"
REDIS_URL = "redis://127.0.0.1:6379/0"
POLICY = {"windows": "10/s"}
DJANGO_REDIS = {
    "BACKEND": "django_redis.cache.RedisCache",
    "LOCATION": "redis://127.0.0.1:6379/1",
}
LOCMEM = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}


def quota_ids() -> list[str]:
    """Ids of django-quota's messages from the full check run."""
    return [m.id for m in run_checks() if m.id and m.id.startswith("django_quota.")]


@pytest.fixture
def production(settings: Any) -> Any:
    """A clean production-like configuration: Redis, a dedicated HMAC key, DEBUG off."""
    settings.DEBUG = False
    settings.QUOTA = {"REDIS_URL": REDIS_URL, "HMAC_KEY": HMAC_KEY}
    return settings


def configure(settings: Any, **values: Any) -> None:
    settings.QUOTA = {"REDIS_URL": REDIS_URL, "HMAC_KEY": HMAC_KEY, **values}


# -- a clean configuration ---------------------------------------------------------------


def test_production_configuration_reports_nothing(production: Any) -> None:
    assert quota_ids() == []


def test_test_settings_report_nothing(settings: Any) -> None:
    settings.DEBUG = True
    assert quota_ids() == []


def test_check_command_passes_on_a_clean_configuration(production: Any) -> None:
    out = StringIO()
    call_command("check", stdout=out)
    assert "django_quota" not in out.getvalue()


def test_check_command_fails_naming_the_id_key_and_hint(production: Any) -> None:
    production.QUOTA = {**production.QUOTA, "TIMEOUTS": 1}
    with pytest.raises(SystemCheckError) as info:
        call_command("check")
    text = str(info.value)
    assert "django_quota.E002" in text
    assert "QUOTA['TIMEOUTS']: unknown setting" in text
    assert "HINT: known settings:" in text


def test_checks_are_errors_and_warnings_of_the_right_level(production: Any) -> None:
    production.DEBUG = False
    production.QUOTA = {"TIMEOUT": -1}
    messages = {m.id: m for m in check_settings()}
    assert isinstance(messages["django_quota.E003"], Error)
    assert isinstance(messages["django_quota.W001"], Warning)
    assert isinstance(messages["django_quota.W002"], Warning)


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [[], "redis://localhost", 5])
def test_e001_quota_not_a_dict(production: Any, value: object) -> None:
    production.QUOTA = value
    assert quota_ids() == ["django_quota.E001"]


def test_e002_unknown_setting(production: Any) -> None:
    configure(production, REDIS="redis://localhost")
    assert quota_ids() == ["django_quota.E002"]
    configure(production, REDIS_URL="redis://localhost")
    assert quota_ids() == []


def test_e003_invalid_value(production: Any) -> None:
    configure(production, HEADERS="draft-11")
    assert quota_ids() == ["django_quota.E003"]
    configure(production, HEADERS="legacy")
    assert quota_ids() == []


def test_e003_message_names_the_key(production: Any) -> None:
    configure(production, MAX_INFLIGHT=0)
    (message,) = check_settings()
    assert message.msg.startswith("QUOTA['MAX_INFLIGHT']: ")


def test_e004_invalid_policy(production: Any) -> None:
    configure(production, POLICIES={"orders": {"windows": {"burst": "100/h", "sustained": "1/s"}}})
    assert quota_ids() == ["django_quota.E004"]
    (message,) = check_settings()
    assert message.msg.startswith("QUOTA['POLICIES']['orders']['windows']: ")
    configure(production, POLICIES={"orders": {"windows": {"burst": "1/s", "sustained": "100/h"}}})
    assert quota_ids() == []


def test_e004_policy_out_of_bounds_names_the_policy(production: Any) -> None:
    configure(production, POLICIES={"yearly": {"windows": "142419/366d"}})
    (message,) = check_settings()
    assert message.id == "django_quota.E004"
    assert "['yearly']" in message.msg


def test_e005_redis_backend_without_a_server(production: Any) -> None:
    production.QUOTA = {"BACKEND": "redis", "HMAC_KEY": HMAC_KEY}
    assert quota_ids() == ["django_quota.E005"]
    production.QUOTA = {"BACKEND": "redis", "REDIS_URL": REDIS_URL, "HMAC_KEY": HMAC_KEY}
    assert quota_ids() == []


def test_e005_cluster_without_a_url(production: Any) -> None:
    production.DEBUG = True
    production.QUOTA = {"CLUSTER": True, "HMAC_KEY": HMAC_KEY}
    assert quota_ids() == ["django_quota.E005"]
    production.QUOTA = {"CLUSTER": True, "HMAC_KEY": HMAC_KEY, "REDIS_URL": REDIS_URL}
    assert quota_ids() == []


def test_e006_cache_alias_to_a_missing_cache(production: Any) -> None:
    production.CACHES = {"default": LOCMEM}
    production.QUOTA = {"CACHE_ALIAS": "quota", "HMAC_KEY": HMAC_KEY}
    assert quota_ids() == ["django_quota.E006"]
    (message,) = check_settings()
    assert "'quota'" in message.msg and message.msg.startswith("QUOTA['CACHE_ALIAS']")


def test_e006_cache_alias_to_a_cache_that_is_not_django_redis(production: Any) -> None:
    production.CACHES = {"default": LOCMEM, "quota": LOCMEM}
    production.QUOTA = {"CACHE_ALIAS": "quota", "HMAC_KEY": HMAC_KEY}
    assert quota_ids() == ["django_quota.E006"]
    (message,) = check_settings()
    assert "LocMemCache" in message.msg


def test_e006_not_reported_for_a_django_redis_cache(production: Any) -> None:
    production.CACHES = {"default": LOCMEM, "quota": DJANGO_REDIS}
    production.QUOTA = {"CACHE_ALIAS": "quota", "HMAC_KEY": HMAC_KEY}
    # Only our check: Django's cache checks would import django_redis, an optional extra.
    assert check_settings() == []


def test_w008_redis_url_beside_cache_alias_is_ignored(production: Any) -> None:
    production.CACHES = {"default": LOCMEM, "quota": DJANGO_REDIS}
    production.QUOTA = {"CACHE_ALIAS": "quota", "REDIS_URL": REDIS_URL, "HMAC_KEY": HMAC_KEY}
    (message,) = check_settings()
    assert isinstance(message, Warning)
    assert message.id == "django_quota.W008"
    assert message.msg == (
        "QUOTA['REDIS_URL'] is ignored because QUOTA['CACHE_ALIAS'] is set: the counters "
        "live in the Redis database of CACHES['quota'], not at REDIS_URL"
    )
    assert message.hint is not None and "QUOTA['REDIS_URL']" in message.hint


def test_w008_not_reported_for_cache_alias_alone(production: Any) -> None:
    production.CACHES = {"default": LOCMEM, "quota": DJANGO_REDIS}
    production.QUOTA = {"CACHE_ALIAS": "quota", "REDIS_URL": None, "HMAC_KEY": HMAC_KEY}
    assert check_settings() == []


@pytest.mark.parametrize("name", ["API_KEY_RESOLVER", "TENANT_RESOLVER", "DENIED_VIEW", "CLOCK"])
def test_e008_bad_dotted_path(production: Any, name: str) -> None:
    configure(production, **{name: "tests.test_checks.no_such_callable"})
    assert "django_quota.E008" in quota_ids()


@pytest.mark.parametrize("name", ["API_KEY_RESOLVER", "TENANT_RESOLVER", "DENIED_VIEW"])
def test_e008_not_reported_for_an_importable_callable(production: Any, name: str) -> None:
    configure(production, **{name: "tests.urls.ok"})
    assert quota_ids() == []


# -- warnings ----------------------------------------------------------------------------


def test_w001_memory_backend_without_debug(production: Any) -> None:
    production.QUOTA = {"HMAC_KEY": HMAC_KEY}
    assert quota_ids() == ["django_quota.W001"]


def test_w001_not_reported_with_debug(production: Any) -> None:
    production.DEBUG = True
    production.QUOTA = {"HMAC_KEY": HMAC_KEY}
    assert quota_ids() == []


def test_w002_hmac_key_unset_without_debug(production: Any) -> None:
    production.QUOTA = {"REDIS_URL": REDIS_URL}
    assert quota_ids() == ["django_quota.W002"]


def test_w002_not_reported_with_debug(production: Any) -> None:
    production.DEBUG = True
    production.QUOTA = {"REDIS_URL": REDIS_URL}
    assert quota_ids() == []


def test_w003_drf_num_proxies_without_trusted_proxies(production: Any) -> None:
    production.REST_FRAMEWORK = {"NUM_PROXIES": 1}
    assert quota_ids() == ["django_quota.W003"]


@pytest.mark.parametrize("values", [{"PROXY_COUNT": 1}, {"TRUSTED_PROXIES": ["10.0.0.0/8"]}])
def test_w003_not_reported_when_proxies_are_configured(
    production: Any, values: dict[str, Any]
) -> None:
    production.REST_FRAMEWORK = {"NUM_PROXIES": 1}
    configure(production, **values)
    assert quota_ids() == []


def test_w003_not_reported_when_num_proxies_is_none(production: Any) -> None:
    production.REST_FRAMEWORK = {"NUM_PROXIES": None}
    assert quota_ids() == []


@pytest.mark.parametrize("dimension", ["user", "api_key", "tenant"])
def test_w004_middleware_policy_denying_a_missing_dimension(
    production: Any, dimension: str
) -> None:
    configure(
        production,
        POLICIES={"api": {"windows": "10/s", "routes": ["/api"], "selector": [dimension]}},
    )
    assert quota_ids() == ["django_quota.W004"]


@pytest.mark.parametrize(
    "change",
    [
        {"on_missing": "skip"},
        {"selector": ["auto"]},
        {"selector": ["ip"]},
        {"routes": None},
        {"routes": []},
    ],
)
def test_w004_not_reported_for_safe_policies(production: Any, change: dict[str, Any]) -> None:
    policy = {"windows": "10/s", "routes": ["/api"], "selector": ["user"], **change}
    configure(production, POLICIES={"api": policy})
    assert quota_ids() == []


@pytest.mark.parametrize("clock", ["client", "time.time"])
def test_w005_client_clock(production: Any, clock: str) -> None:
    configure(production, CLOCK=clock)
    assert quota_ids() == ["django_quota.W005"]


def test_w005_not_reported_for_the_redis_clock(production: Any) -> None:
    configure(production, CLOCK="redis")
    assert quota_ids() == []


def test_w006_routed_policies_without_the_middleware(production: Any) -> None:
    production.MIDDLEWARE = [m for m in production.MIDDLEWARE if m != MIDDLEWARE_PATH]
    configure(production, POLICIES={"api": {"windows": "10/s", "routes": ["*"]}})
    assert quota_ids() == ["django_quota.W006"]


def test_w006_not_reported_with_the_middleware(production: Any) -> None:
    assert MIDDLEWARE_PATH in production.MIDDLEWARE
    configure(production, POLICIES={"api": {"windows": "10/s", "routes": ["*"]}})
    assert quota_ids() == []


def test_w006_not_reported_without_routed_policies(production: Any) -> None:
    production.MIDDLEWARE = [m for m in production.MIDDLEWARE if m != MIDDLEWARE_PATH]
    configure(production, POLICIES={"api": {"windows": "10/s"}})
    assert quota_ids() == []


def test_all_six_warnings_together_each_carry_a_hint(production: Any) -> None:
    production.MIDDLEWARE = []
    production.REST_FRAMEWORK = {"NUM_PROXIES": 2}
    production.QUOTA = {
        "CLOCK": "client",
        "POLICIES": {"api": {"windows": "1/s", "routes": ["*"], "selector": ["user"]}},
    }
    messages = check_settings()
    assert sorted(m.id for m in messages if m.id) == [
        "django_quota.W001",
        "django_quota.W002",
        "django_quota.W003",
        "django_quota.W004",
        "django_quota.W005",
        "django_quota.W006",
    ]
    assert all(m.hint for m in messages)


# -- middleware order, header item names, folded ids --------------------------------------
AUTH_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
SESSION_MIDDLEWARE = "django.contrib.sessions.middleware.SessionMiddleware"


def quota_before_auth(settings: Any) -> None:
    settings.MIDDLEWARE = [SESSION_MIDDLEWARE, MIDDLEWARE_PATH, AUTH_MIDDLEWARE]


def messages_with(check_id: str) -> list[Any]:
    return [m for m in run_checks() if m.id == check_id]


@pytest.mark.parametrize(
    ("selector", "on_missing", "effect"),
    [
        (["user"], "skip", "logged-in users are never limited"),
        (["user"], "deny", "every request is refused as selector_identity_missing"),
        (["auto"], "deny", "logged-in users are counted per IP address"),
        (["route", "user"], "skip", "logged-in users are never limited"),
    ],
)
def test_e010_middleware_before_authentication_with_a_user_policy(
    production: Any, selector: list[str], on_missing: str, effect: str
) -> None:
    quota_before_auth(production)
    configure(production, POLICIES={"pages": {"windows": "5/m", "selector": selector,
                                              "routes": ["/"], "on_missing": on_missing}})
    (message,) = messages_with("django_quota.E010")
    assert isinstance(message, Error)
    assert message.msg == (
        "QuotaMiddleware comes before AuthenticationMiddleware in MIDDLEWARE, so "
        f"request.user is not set when it applies QUOTA['POLICIES']['pages'] (selector "
        f"{', '.join(selector)}): {effect}"
    )
    assert message.hint == (
        f"move {MIDDLEWARE_PATH!r} after {AUTH_MIDDLEWARE!r} in MIDDLEWARE"
    )


def test_e010_not_reported_in_the_right_order_or_for_address_policies(production: Any) -> None:
    user_policy = {"windows": "5/m", "selector": ["user"], "routes": ["/"], "on_missing": "skip"}
    configure(production, POLICIES={"pages": user_policy})
    production.MIDDLEWARE = [SESSION_MIDDLEWARE, AUTH_MIDDLEWARE, MIDDLEWARE_PATH]
    assert messages_with("django_quota.E010") == []
    quota_before_auth(production)
    configure(production, POLICIES={
        "pages": {"windows": "5/m", "selector": ["ip"], "routes": ["/"]},
        "unrouted": {"windows": "5/m", "selector": ["user"]},  # throttles only
        "off": {**user_policy, "enabled": False},
    })
    assert messages_with("django_quota.E010") == []


def test_e010_sees_a_subclass_of_authentication_middleware(production: Any) -> None:
    production.MIDDLEWARE = [SESSION_MIDDLEWARE, MIDDLEWARE_PATH,
                             "tests.test_checks.CustomAuthenticationMiddleware"]
    configure(production, POLICIES={"pages": {"windows": "5/m", "selector": ["auto"],
                                              "routes": ["/"]}})
    assert len(messages_with("django_quota.E010")) == 1


@pytest.mark.parametrize(
    ("dimension", "setting"), [("api_key", "API_KEY_RESOLVER"), ("tenant", "TENANT_RESOLVER")]
)
def test_w007_middleware_before_authentication_with_a_resolver(
    production: Any, dimension: str, setting: str
) -> None:
    quota_before_auth(production)
    configure(production, **{setting: "tests.urls.ok"},
              POLICIES={"keys": {"windows": "5/m", "selector": [dimension, "ip"],
                                 "routes": ["/api"], "on_missing": "skip"}})
    (message,) = messages_with("django_quota.W007")
    assert isinstance(message, Warning)
    assert message.msg == (
        "QuotaMiddleware comes before AuthenticationMiddleware in MIDDLEWARE, so "
        f"QUOTA['{setting}'] runs before request.user is set for QUOTA['POLICIES']['keys'] "
        f"(selector {dimension}, ip): a resolver that reads request.user finds no user"
    )


def test_w007_not_reported_for_the_raw_header(production: Any) -> None:
    quota_before_auth(production)
    configure(production, POLICIES={"keys": {"windows": "5/m", "selector": ["api_key", "ip"],
                                             "routes": ["/api"], "on_missing": "skip"}})
    assert messages_with("django_quota.W007") == []


def test_e011_two_header_items_with_one_name(production: Any) -> None:
    configure(production, POLICIES={
        "p.burst": {"windows": "5/m"},
        "p": {"windows": {"burst": "1/s", "sustained": "100/h"}},
    })
    (message,) = messages_with("django_quota.E011")
    assert message.msg == (
        "the rate-limit header item \"p.burst\" would name both policy 'p.burst' (window "
        "'default') and policy 'p' (window 'burst')"
    )
    assert message.hint == "rename one of the policies or windows"
    configure(production, POLICIES={
        "p-burst": {"windows": "5/m"},
        "p": {"windows": {"burst": "1/s", "sustained": "100/h"}},
    })
    assert messages_with("django_quota.E011") == []


@pytest.mark.django_db
def test_e011_sees_database_policies(production: Any) -> None:
    from django_quota.models import QuotaPolicy, QuotaWindow, revision_batch

    configure(production, POLICY_SOURCES=["settings", "database"],
              POLICIES={"p": {"windows": {"burst": "1/s", "sustained": "100/h"}}})
    with revision_batch():
        row = QuotaPolicy.objects.create(name="p.burst", selector=["ip"])
        QuotaWindow.objects.create(policy=row, name="default", limit=5, period=60)
    assert len(messages_with("django_quota.E011")) == 1


@pytest.mark.urls("tests.folding_urls")
def test_e012_views_whose_generated_ids_fold_together(production: Any) -> None:
    (message,) = messages_with("django_quota.E012")
    assert message.msg == (
        "the views tests.folding_urls.Report (at 'Report/') and tests.folding_urls.report "
        "(at 'report/') generate the same policy id 'view:tests.folding_urls.report' and "
        "would share its counters"
    )
    assert message.hint == (
        "rename one of them, or give one @quota(policy=...) with a policy of its own"
    )


@pytest.mark.urls("tests.folding_apart_urls")
def test_e012_not_reported_for_distinct_views(production: Any) -> None:
    assert messages_with("django_quota.E012") == []


def test_e012_drf_scopes_whose_ids_fold_together(production: Any) -> None:
    production.REST_FRAMEWORK = {
        "DEFAULT_THROTTLE_RATES": {"Uploads": "5/m", "uploads": "10/m", "anon": "100/h"}
    }
    (message,) = messages_with("django_quota.E012")
    assert message.msg == (
        "the DRF throttle scopes 'Uploads' and 'uploads' in "
        "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] generate the same policy id 'drf:uploads' "
        "and would share its counters"
    )
    production.REST_FRAMEWORK = {"DEFAULT_THROTTLE_RATES": {"uploads": "5/m", "anon": "100/h"}}
    assert messages_with("django_quota.E012") == []


from django.contrib.auth.middleware import AuthenticationMiddleware  # noqa: E402


class CustomAuthenticationMiddleware(AuthenticationMiddleware):
    """A project's own authentication middleware (E010 recognises subclasses)."""
