"""``settings.QUOTA``: defaults, one problem per mistake, and a cache that follows
``override_settings`` and the ``settings`` fixture (docs/settings.md)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_quota import conf
from django_quota.conf import (
    DEFAULTS,
    QuotaSettings,
    SettingsProblem,
    get_settings,
    parse_settings,
)
from django_quota.core.policy import Policy

SECRET = "tests-secret-key-not-for-production"
HMAC_KEY = "tests-hmac-key-0123456789"
POLICY = {"windows": {"burst": "10/s", "sustained": "1000/h"}, "selector": ["user"]}


def resolve_tenant(request: object) -> str | None:
    """A valid dotted-path target for the resolver settings."""
    return None


NOT_CALLABLE = 42


def derived_key(secret: str) -> bytes:
    return hmac.new(secret.encode(), b"django_quota.identity.v1", hashlib.sha256).digest()


def parse(**values: Any) -> tuple[QuotaSettings, list[SettingsProblem]]:
    parsed, problems = parse_settings(values, secret_key=SECRET)
    assert parsed is not None
    return parsed, problems


def valid(**values: Any) -> QuotaSettings:
    parsed, problems = parse(**values)
    assert problems == []
    return parsed


def only_problem(**values: Any) -> SettingsProblem:
    _, problems = parse(**values)
    assert len(problems) == 1, problems
    return problems[0]


# -- defaults ----------------------------------------------------------------------------


def test_defaults_table_is_the_documented_table() -> None:
    assert DEFAULTS == {
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
        "REDIS_PUBLIC_PATH": False,
        "FAILURE_MODE": "closed",
        "FAILURE_RETRY_AFTER": 1,
        "LOCAL_FALLBACK": {"ENABLED": False, "MAX_ENTRIES": 10000},
        "DENIAL_CACHE": {"ENABLED": True, "MAX_ENTRIES": 4096, "MAX_TTL": 5.0},
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
        "PLAN_RESOLVER": None,
        "HEADERS": "ietf",
        "DENIED_VIEW": None,
        "EXEMPT_PATHS": [],
        "TIMEZONE": "UTC",
        "POLICIES": {},
        "POLICY_SOURCES": ["settings", "database"],
        "POLICY_CACHE_TTL": 5.0,
        "DRF_ALGORITHM": "sliding_log",
        "EXEMPT_WHEN": None,
        "LOGIN_POLICIES": [],
    }


@pytest.mark.parametrize("raw", [{}, None])
def test_empty_or_absent_quota_parses_to_every_default(raw: object) -> None:
    parsed, problems = parse_settings(raw, secret_key=SECRET)
    assert problems == []
    assert parsed is not None
    assert parsed.enabled is True
    assert parsed.redis_url is None
    assert parsed.cache_alias is None
    assert parsed.cluster is False
    assert parsed.sentinel is None
    assert parsed.backend == "memory"
    assert parsed.key_prefix == "quota"
    assert parsed.clock == "redis"
    assert parsed.max_clock_regression == 1.0
    assert parsed.timeout == 0.1
    assert parsed.deadline == 0.25
    assert parsed.max_inflight == 64
    assert parsed.failure_mode == "closed"
    assert parsed.failure_retry_after == 1
    assert parsed.local_fallback_enabled is False
    assert parsed.local_fallback_max_entries == 10000
    assert parsed.memory_max_entries == 4096
    assert parsed.dedup_ttl == 5.0
    assert parsed.cleanup_grace == 1.0
    assert parsed.hmac_key == derived_key(SECRET)
    assert parsed.hmac_key_configured is False
    assert parsed.hmac_key_version == 1
    assert parsed.trusted_proxies == ()
    assert parsed.proxy_count is None
    assert parsed.ipv6_prefix == 64
    assert parsed.api_key_header == "X-Api-Key"
    assert parsed.api_key_meta_name == "HTTP_X_API_KEY"
    assert parsed.api_key_resolver is None
    assert parsed.tenant_resolver is None
    assert parsed.headers == "ietf"
    assert parsed.denied_view is None
    assert parsed.exempt_paths == ()
    assert parsed.policies == {}
    assert parsed.policy_sources == ("settings", "database")
    assert parsed.policy_cache_ttl == 5.0
    assert parsed.drf_algorithm == "sliding_log"


def test_get_settings_without_quota_setting_gives_defaults(settings: Any) -> None:
    del settings.QUOTA
    parsed = get_settings()
    assert parsed.backend == "memory"
    assert parsed.policies == {}
    assert parsed.hmac_key == derived_key(SECRET)


def test_settings_object_is_frozen() -> None:
    parsed = valid()
    with pytest.raises(AttributeError):
        parsed.enabled = False  # type: ignore[misc]


def test_configured_values_are_read() -> None:
    parsed = valid(
        ENABLED=False,
        REDIS_URL="rediss://cache.internal:6380/2",
        KEY_PREFIX="staging",
        CLOCK="client",
        MAX_CLOCK_REGRESSION=0,
        TIMEOUT=1,
        DEADLINE=2.5,
        MAX_INFLIGHT=8,
        FAILURE_MODE="open",
        FAILURE_RETRY_AFTER=30,
        LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 50},
        MEMORY_MAX_ENTRIES=10,
        DEDUP_TTL=0.5,
        CLEANUP_GRACE=0,
        HMAC_KEY=HMAC_KEY,
        HMAC_KEY_VERSION=3,
        TRUSTED_PROXIES=["10.0.0.0/8", "2001:db8::/32", "192.0.2.7"],
        PROXY_COUNT=0,
        IPV6_PREFIX=128,
        API_KEY_HEADER="Authorization-Key",
        API_KEY_RESOLVER="tests.test_settings.resolve_tenant",
        TENANT_RESOLVER="tests.test_settings.resolve_tenant",
        HEADERS="both",
        DENIED_VIEW="tests.urls.ok",
        EXEMPT_PATHS=["/health", "/static"],
        POLICIES={"orders": POLICY},
        POLICY_SOURCES=["database"],
        POLICY_CACHE_TTL=0,
        DRF_ALGORITHM="token_bucket",
    )
    assert parsed.enabled is False
    assert parsed.redis_url == "rediss://cache.internal:6380/2"
    assert parsed.backend == "redis"
    assert parsed.key_prefix == "staging"
    assert parsed.clock == "client"
    assert parsed.max_clock_regression == 0.0
    assert parsed.timeout == 1.0
    assert isinstance(parsed.timeout, float)
    assert parsed.deadline == 2.5
    assert parsed.max_inflight == 8
    assert parsed.failure_mode == "open"
    assert parsed.failure_retry_after == 30
    assert parsed.local_fallback_enabled is True
    assert parsed.local_fallback_max_entries == 50
    assert parsed.memory_max_entries == 10
    assert parsed.dedup_ttl == 0.5
    assert parsed.cleanup_grace == 0.0
    assert parsed.hmac_key == HMAC_KEY.encode()
    assert parsed.hmac_key_configured is True
    assert parsed.hmac_key_version == 3
    assert parsed.trusted_proxies == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("2001:db8::/32"),
        ipaddress.ip_network("192.0.2.7/32"),
    )
    assert parsed.proxy_count == 0
    assert parsed.ipv6_prefix == 128
    assert parsed.api_key_header == "Authorization-Key"
    assert parsed.api_key_meta_name == "HTTP_AUTHORIZATION_KEY"
    assert parsed.api_key_resolver == "tests.test_settings.resolve_tenant"
    assert parsed.tenant_resolver == "tests.test_settings.resolve_tenant"
    assert parsed.headers == "both"
    assert parsed.denied_view == "tests.urls.ok"
    assert parsed.exempt_paths == ("/health", "/static")
    assert list(parsed.policies) == ["orders"]
    assert isinstance(parsed.policies["orders"], Policy)
    assert parsed.policies["orders"].source == "settings"
    assert parsed.policy_sources == ("database",)
    assert parsed.policy_cache_ttl == 0.0
    assert parsed.drf_algorithm == "token_bucket"


def test_hmac_key_may_be_bytes() -> None:
    assert valid(HMAC_KEY=b"0123456789abcdef").hmac_key == b"0123456789abcdef"


def test_local_fallback_keys_are_each_optional() -> None:
    parsed = valid(LOCAL_FALLBACK={"ENABLED": True})
    assert (parsed.local_fallback_enabled, parsed.local_fallback_max_entries) == (True, 10000)


def test_clock_may_be_a_dotted_path_to_a_callable() -> None:
    assert valid(CLOCK="time.time").clock == "time.time"


def test_policies_keep_declaration_order() -> None:
    parsed = valid(POLICIES={"b": POLICY, "a": POLICY, "c": POLICY})
    assert list(parsed.policies) == ["b", "a", "c"]


def test_policies_can_be_left_unparsed() -> None:
    parsed, problems = parse_settings(
        {"POLICIES": {"Bad": {}}}, secret_key=SECRET, with_policies=False
    )
    assert problems == []
    assert parsed is not None and parsed.policies == {}


def test_failure_mode_of_falls_back_to_the_default() -> None:
    parsed = valid(
        FAILURE_MODE="open",
        POLICIES={"a": POLICY, "b": {**POLICY, "failure_mode": "closed"}},
    )
    assert parsed.failure_mode_of(parsed.policies["a"]) == "open"
    assert parsed.failure_mode_of(parsed.policies["b"]) == "closed"


def test_raw_settings_are_kept() -> None:
    raw = {"KEY_PREFIX": "x"}
    parsed, _ = parse_settings(raw, secret_key=SECRET)
    assert parsed is not None and parsed.raw == raw


# -- backend resolution ------------------------------------------------------------------


def test_backend_is_memory_without_a_redis_url() -> None:
    assert valid().backend == "memory"


@pytest.mark.parametrize(
    "values",
    [
        {"REDIS_URL": "redis://127.0.0.1:6379/0"},
        {"REDIS_URL": "rediss://example.com:6380/0"},
        {"REDIS_URL": "unix:///run/redis.sock"},
        {"CACHE_ALIAS": "quota"},
        {"SENTINEL": {"SENTINELS": [("10.0.0.1", 26379)], "SERVICE": "mymaster"}},
    ],
)
def test_backend_is_redis_when_a_server_is_configured(values: dict[str, Any]) -> None:
    assert valid(**values).backend == "redis"


def test_explicit_memory_backend_wins_over_a_redis_url() -> None:
    assert valid(BACKEND="memory", REDIS_URL="redis://localhost/0").backend == "memory"


def test_explicit_redis_backend_with_url_is_accepted() -> None:
    assert valid(BACKEND="redis", REDIS_URL="redis://localhost/0").backend == "redis"


def test_invalid_backend_falls_back_to_the_implied_one() -> None:
    parsed, problems = parse(BACKEND="mongo", REDIS_URL="redis://localhost/0")
    assert [(p.id, p.key) for p in problems] == [("django_quota.E003", "QUOTA['BACKEND']")]
    assert parsed.backend == "redis"
    parsed, _ = parse(BACKEND="mongo")
    assert parsed.backend == "memory"


# -- E001 / E002 -------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [[], "redis://localhost", 1, ("ENABLED", True)])
def test_quota_that_is_not_a_dict_is_e001(raw: object) -> None:
    parsed, problems = parse_settings(raw, secret_key=SECRET)
    assert parsed is None
    assert [(p.id, p.key) for p in problems] == [("django_quota.E001", "QUOTA")]
    assert "must be a dict" in problems[0].message


def test_unknown_setting_is_e002_naming_it() -> None:
    problem = only_problem(REDIS="redis://localhost/0")
    assert (problem.id, problem.key) == ("django_quota.E002", "QUOTA['REDIS']")
    assert problem.hint is not None and "REDIS_URL" in problem.hint


def test_every_unknown_setting_is_reported() -> None:
    _, problems = parse(TIMEOUTS=1, enabled=True)
    assert [(p.id, p.key) for p in problems] == [
        ("django_quota.E002", "QUOTA['TIMEOUTS']"),
        ("django_quota.E002", "QUOTA['enabled']"),
    ]


# -- E003, one family at a time ----------------------------------------------------------


@pytest.mark.parametrize("name", ["ENABLED", "CLUSTER"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_boolean_setting_that_is_not_a_bool_is_e003(name: str, value: object) -> None:
    parsed, problems = parse(**{name: value})
    assert [(p.id, p.key) for p in problems] == [("django_quota.E003", f"QUOTA[{name!r}]")]
    assert getattr(parsed, name.lower()) is DEFAULTS[name]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TIMEOUT", 0),
        ("TIMEOUT", -1),
        ("TIMEOUT", "0.1"),
        ("TIMEOUT", True),
        ("TIMEOUT", float("nan")),
        ("TIMEOUT", float("inf")),
        ("DEADLINE", 0),
        ("DEADLINE", None),
        ("DEDUP_TTL", 0),
        ("DEDUP_TTL", float("nan")),
        ("MAX_CLOCK_REGRESSION", -0.5),
        ("MAX_CLOCK_REGRESSION", float("nan")),
        ("CLEANUP_GRACE", -1),
        ("DEDUP_TTL", 2e9),  # above MAX_SECONDS: the scripts take ms below 2**48
        ("MAX_CLOCK_REGRESSION", 1e10),
        ("POLICY_CACHE_TTL", -1),
        ("POLICY_CACHE_TTL", "5"),
    ],
)
def test_number_of_seconds_out_of_range_is_e003(name: str, value: object) -> None:
    parsed, problems = parse(**{name: value})
    assert [(p.id, p.key) for p in problems] == [("django_quota.E003", f"QUOTA[{name!r}]")]
    assert getattr(parsed, name.lower()) == DEFAULTS[name]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MAX_INFLIGHT", 0),
        ("MAX_INFLIGHT", 1.5),
        ("MAX_INFLIGHT", True),
        ("FAILURE_RETRY_AFTER", 0),
        ("FAILURE_RETRY_AFTER", 0.5),
        ("FAILURE_RETRY_AFTER", 86401),
        ("MEMORY_MAX_ENTRIES", 0),
        ("HMAC_KEY_VERSION", 0),
        ("HMAC_KEY_VERSION", "1"),
        ("IPV6_PREFIX", 0),
        ("IPV6_PREFIX", 129),
        ("PROXY_COUNT", -1),
        ("PROXY_COUNT", "1"),
    ],
)
def test_integer_setting_out_of_range_is_e003(name: str, value: object) -> None:
    parsed, problems = parse(**{name: value})
    assert [(p.id, p.key) for p in problems] == [("django_quota.E003", f"QUOTA[{name!r}]")]
    assert getattr(parsed, name.lower()) == DEFAULTS[name]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FAILURE_MODE", "fail"),
        ("FAILURE_MODE", None),
        ("HEADERS", "IETF"),
        ("HEADERS", None),
        ("DRF_ALGORITHM", "leaky_bucket"),
        ("BACKEND", "Redis"),
    ],
)
def test_choice_setting_outside_its_choices_is_e003(name: str, value: object) -> None:
    problem = only_problem(**{name: value})
    assert (problem.id, problem.key) == ("django_quota.E003", f"QUOTA[{name!r}]")
    assert repr(value) in problem.message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("REDIS_URL", "http://localhost:6379"),
        ("REDIS_URL", "localhost:6379"),
        ("REDIS_URL", ""),
        ("REDIS_URL", 6379),
        ("CACHE_ALIAS", ""),
        ("CACHE_ALIAS", ["default"]),
        ("KEY_PREFIX", ""),
        ("KEY_PREFIX", "quota {x}"),
        ("KEY_PREFIX", "a b"),
        ("KEY_PREFIX", None),
        ("API_KEY_HEADER", "X_Api_Key"),
        ("API_KEY_HEADER", "X-Api-Key:"),
        ("API_KEY_HEADER", ""),
        ("API_KEY_HEADER", "X-Ключ"),
        ("CLOCK", 5),
        ("HMAC_KEY", "short"),
        ("HMAC_KEY", 1234567890123456789),
    ],
)
def test_string_setting_with_an_invalid_value_is_e003(name: str, value: object) -> None:
    problem = only_problem(**{name: value})
    assert (problem.id, problem.key) == ("django_quota.E003", f"QUOTA[{name!r}]")


def test_hmac_key_too_short_has_a_hint_and_falls_back_to_the_derived_key() -> None:
    parsed, problems = parse(HMAC_KEY="short")
    assert problems[0].hint is not None and "secrets" in problems[0].hint
    assert parsed.hmac_key == derived_key(SECRET)
    assert parsed.hmac_key_configured is False


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TRUSTED_PROXIES", "10.0.0.0/8"),
        ("TRUSTED_PROXIES", ["10.0.0.0/33"]),
        ("TRUSTED_PROXIES", ["not-an-ip"]),
        ("TRUSTED_PROXIES", [10]),
        ("EXEMPT_PATHS", "/health"),
        ("EXEMPT_PATHS", ["health"]),
        ("EXEMPT_PATHS", [""]),
        ("POLICY_SOURCES", ["settings", "ldap"]),
        ("POLICY_SOURCES", "settings"),
    ],
)
def test_list_setting_with_an_invalid_entry_is_e003(name: str, value: object) -> None:
    problem = only_problem(**{name: value})
    assert (problem.id, problem.key) == ("django_quota.E003", f"QUOTA[{name!r}]")


@pytest.mark.parametrize(
    ("value", "key"),
    [
        (True, "QUOTA['LOCAL_FALLBACK']"),
        ({"ENABLED": True, "SIZE": 5}, "QUOTA['LOCAL_FALLBACK']"),
        ({"ENABLED": "yes"}, "QUOTA['LOCAL_FALLBACK']['ENABLED']"),
        ({"MAX_ENTRIES": 0}, "QUOTA['LOCAL_FALLBACK']['MAX_ENTRIES']"),
        ({"MAX_ENTRIES": True}, "QUOTA['LOCAL_FALLBACK']['MAX_ENTRIES']"),
    ],
)
def test_invalid_local_fallback_is_e003_naming_the_sub_key(value: object, key: str) -> None:
    parsed, problems = parse(LOCAL_FALLBACK=value)
    assert [(p.id, p.key) for p in problems] == [("django_quota.E003", key)]
    assert parsed.local_fallback_max_entries >= 1


@pytest.mark.parametrize(
    "value",
    [
        "sentinel:26379",
        {"SENTINELS": [("h", 26379)]},
        {"SERVICE": "mymaster"},
        {"SENTINELS": [], "SERVICE": "mymaster"},
        {"SENTINELS": "h:26379", "SERVICE": "mymaster"},
        {"SENTINELS": [("h", "26379")], "SERVICE": "mymaster"},
        {"SENTINELS": [("h",)], "SERVICE": "mymaster"},
        {"SENTINELS": [("h", 26379)], "SERVICE": ""},
    ],
)
def test_invalid_sentinel_is_e003(value: object) -> None:
    parsed, problems = parse(SENTINEL=value)
    assert [(p.id, p.key) for p in problems] == [("django_quota.E003", "QUOTA['SENTINEL']")]
    assert parsed.sentinel is None
    assert parsed.backend == "memory"


def test_sentinel_accepts_lists_as_addresses() -> None:
    sentinel = {"SENTINELS": [["10.0.0.1", 26379], ("10.0.0.2", 26379)], "SERVICE": "m"}
    assert valid(SENTINEL=sentinel).sentinel == sentinel


@pytest.mark.parametrize("value", [[], "orders", None])
def test_policies_that_are_not_a_dict_are_e003(value: object) -> None:
    problem = only_problem(POLICIES=value)
    assert (problem.id, problem.key) == ("django_quota.E003", "QUOTA['POLICIES']")


def test_deadline_shorter_than_timeout_is_e003_on_deadline() -> None:
    problem = only_problem(TIMEOUT=0.5, DEADLINE=0.25)
    assert (problem.id, problem.key) == ("django_quota.E003", "QUOTA['DEADLINE']")
    assert "TIMEOUT" in problem.message


def test_deadline_equal_to_timeout_is_accepted() -> None:
    parsed = valid(TIMEOUT=0.5, DEADLINE=0.5)
    assert (parsed.timeout, parsed.deadline) == (0.5, 0.5)


def test_every_problem_is_reported_not_only_the_first() -> None:
    _, problems = parse(ENABLED="no", TIMEOUT=-1, HEADERS="x", BOGUS=1)
    assert sorted((p.id, p.key) for p in problems) == [
        ("django_quota.E002", "QUOTA['BOGUS']"),
        ("django_quota.E003", "QUOTA['ENABLED']"),
        ("django_quota.E003", "QUOTA['HEADERS']"),
        ("django_quota.E003", "QUOTA['TIMEOUT']"),
    ]


# -- E004 --------------------------------------------------------------------------------


def test_invalid_policy_is_e004_naming_the_window_key() -> None:
    problem = only_problem(POLICIES={"orders": {"windows": {"burst": "10/x"}}})
    assert problem.id == "django_quota.E004"
    assert problem.key == "QUOTA['POLICIES']['orders']['windows']['burst']"


def test_invalid_policy_id_is_e004() -> None:
    problem = only_problem(POLICIES={"Orders": POLICY})
    assert (problem.id, problem.key) == ("django_quota.E004", "QUOTA['POLICIES']['Orders']")


def test_policy_out_of_bounds_is_e004_naming_the_policy() -> None:
    problem = only_problem(POLICIES={"yearly": {"windows": "1000000000/366d"}})
    assert problem.id == "django_quota.E004"
    assert problem.key.startswith("QUOTA['POLICIES']['yearly']")


def test_rate_with_a_huge_count_is_e004_not_a_crash() -> None:
    problem = only_problem(POLICIES={"a": {"windows": "9" * 5000 + "/s"}})
    assert (problem.id, problem.key) == ("django_quota.E004", "QUOTA['POLICIES']['a']['windows']")


def test_each_invalid_policy_is_reported_and_valid_ones_kept() -> None:
    parsed, problems = parse(
        POLICIES={"ok": POLICY, "bad1": {"windows": {}}, "bad2": {**POLICY, "algorithm": "x"}}
    )
    assert [(p.id, p.key) for p in problems] == [
        ("django_quota.E004", "QUOTA['POLICIES']['bad1']['windows']"),
        ("django_quota.E004", "QUOTA['POLICIES']['bad2']['algorithm']"),
    ]
    assert list(parsed.policies) == ["ok"]


# -- E005 --------------------------------------------------------------------------------


def test_redis_backend_without_a_server_is_e005() -> None:
    problem = only_problem(BACKEND="redis")
    assert (problem.id, problem.key) == ("django_quota.E005", "QUOTA['BACKEND']")


def test_cluster_with_sentinel_is_e005() -> None:
    sentinel = {"SENTINELS": [("h", 26379)], "SERVICE": "m"}
    _, problems = parse(CLUSTER=True, SENTINEL=sentinel, REDIS_URL="redis://h/0")
    assert [(p.id, p.key) for p in problems] == [("django_quota.E005", "QUOTA['CLUSTER']")]


def test_cluster_without_a_url_is_e005() -> None:
    problem = only_problem(CLUSTER=True)
    assert (problem.id, problem.key) == ("django_quota.E005", "QUOTA['CLUSTER']")


def test_cluster_with_a_url_is_accepted() -> None:
    parsed = valid(CLUSTER=True, REDIS_URL="redis://node-1:7000/0")
    assert (parsed.cluster, parsed.backend) == (True, "redis")


# -- E008 --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["API_KEY_RESOLVER", "TENANT_RESOLVER", "PLAN_RESOLVER", "DENIED_VIEW", "CLOCK"]
)
@pytest.mark.parametrize(
    "path",
    [
        "tests.test_settings.missing",
        "tests.no_such_module.resolve",
        "nodots",
        "tests.test_settings.NOT_CALLABLE",
    ],
)
def test_bad_dotted_path_is_e008(name: str, path: str) -> None:
    parsed, problems = parse(**{name: path})
    assert [(p.id, p.key) for p in problems] == [("django_quota.E008", f"QUOTA[{name!r}]")]
    assert repr(path) in problems[0].message
    assert getattr(parsed, name.lower()) == ("redis" if name == "CLOCK" else None)


@pytest.mark.parametrize(
    "name", ["API_KEY_RESOLVER", "TENANT_RESOLVER", "PLAN_RESOLVER", "DENIED_VIEW"]
)
def test_dotted_path_to_a_callable_is_kept(name: str) -> None:
    path = "tests.test_settings.resolve_tenant"
    assert getattr(valid(**{name: path}), name.lower()) == path


@pytest.mark.parametrize(
    "name", ["API_KEY_RESOLVER", "TENANT_RESOLVER", "PLAN_RESOLVER", "DENIED_VIEW"]
)
def test_dotted_path_that_is_not_a_string_is_e003(name: str) -> None:
    problem = only_problem(**{name: resolve_tenant})
    assert (problem.id, problem.key) == ("django_quota.E003", f"QUOTA[{name!r}]")


# -- get_settings(): cached, dropped on setting_changed ----------------------------------


def test_get_settings_is_cached(quota: Any) -> None:
    quota(POLICIES={"orders": POLICY})
    assert get_settings() is get_settings()


def test_changing_quota_takes_effect_at_once(quota: Any) -> None:
    quota(POLICIES={"orders": POLICY})
    first = get_settings()
    assert list(first.policies) == ["orders"]
    quota(POLICIES={"orders": {**POLICY, "windows": "5/m"}, "search": {"windows": "1/s"}})
    second = get_settings()
    assert list(second.policies) == ["orders", "search"]
    assert second.policies["orders"].windows[0].limit == 5
    assert second.policies["orders"].revision != first.policies["orders"].revision


def test_override_settings_takes_effect_and_is_undone(settings: Any) -> None:
    settings.QUOTA = {"HMAC_KEY": HMAC_KEY, "KEY_PREFIX": "outer"}
    assert get_settings().key_prefix == "outer"
    with override_settings(QUOTA={"HMAC_KEY": HMAC_KEY, "KEY_PREFIX": "inner"}):
        assert get_settings().key_prefix == "inner"
    assert get_settings().key_prefix == "outer"


def test_changing_secret_key_changes_the_derived_hmac_key(settings: Any) -> None:
    settings.QUOTA = {}
    settings.SECRET_KEY = "first-secret"
    first = get_settings().hmac_key
    assert first == derived_key("first-secret")
    settings.SECRET_KEY = "second-secret"
    second = get_settings().hmac_key
    assert second == derived_key("second-secret")
    assert first != second


def test_changing_secret_key_keeps_a_configured_hmac_key(settings: Any) -> None:
    settings.QUOTA = {"HMAC_KEY": HMAC_KEY}
    settings.SECRET_KEY = "first-secret"
    assert get_settings().hmac_key == HMAC_KEY.encode()
    settings.SECRET_KEY = "second-secret"
    assert get_settings().hmac_key == HMAC_KEY.encode()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("REST_FRAMEWORK", {"NUM_PROXIES": 1}),
        ("CACHES", {"default": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}}),
        ("DEBUG", True),
        ("SECRET_KEY", "another"),
    ],
)
def test_changing_a_watched_setting_drops_the_cache(settings: Any, name: str, value: Any) -> None:
    before = get_settings()
    setattr(settings, name, value)
    assert get_settings() is not before


def test_changing_an_unrelated_setting_keeps_the_cache(settings: Any) -> None:
    before = get_settings()
    settings.USE_I18N = not settings.USE_I18N
    assert get_settings() is before


def test_listeners_are_called_when_settings_change(settings: Any) -> None:
    calls: list[str] = []

    def listener() -> None:
        calls.append("cleared")

    conf.on_change(listener)
    try:
        settings.QUOTA = {"HMAC_KEY": HMAC_KEY, "KEY_PREFIX": "changed"}
        assert calls == ["cleared"]
    finally:
        conf._state.listeners.remove(listener)


def test_get_settings_raises_improperly_configured_naming_the_key(quota: Any) -> None:
    quota(POLICIES={"orders": {"windows": {"burst": "10/x"}}})
    with pytest.raises(ImproperlyConfigured) as info:
        get_settings()
    message = str(info.value)
    assert message.startswith("QUOTA['POLICIES']['orders']['windows']['burst']: ")
    assert "django_quota.E004" in message


def test_get_settings_raises_for_quota_that_is_not_a_dict(settings: Any) -> None:
    settings.QUOTA = ["not", "a", "dict"]
    with pytest.raises(ImproperlyConfigured, match=r"^QUOTA: .*django_quota\.E001"):
        get_settings()


def test_get_settings_recovers_once_the_setting_is_fixed(quota: Any) -> None:
    quota(TIMEOUT=-1)
    with pytest.raises(ImproperlyConfigured, match=r"QUOTA\['TIMEOUT'\]"):
        get_settings()
    quota(TIMEOUT=0.2)
    assert get_settings().timeout == 0.2
