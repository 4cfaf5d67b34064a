"""System checks: one test per id, each with its valid counterpart (contract section 2).

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
