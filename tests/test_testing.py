"""Test isolation for projects that use django-quota (docs/testing.md):
``django_quota.testing.reset()`` on the memory backend, the local fallback and a real
Redis (only keys under ``KEY_PREFIX``), and the pytest plugin the package registers."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

import django_quota
from django_quota import limiter
from django_quota.testing import reset
from tests.conftest import require_redis_server
from tests.test_middleware import OwnRedis, dead_redis_url

POLICY = {"algorithm": "fixed_window", "windows": "2/m", "selector": ["user"]}
CLOCK = "tests.test_throttling.frozen_clock"
ALICE = {"user": "alice"}


def exhaust(policy_id: str = "p", subject: dict[str, str] = ALICE) -> None:
    decisions = [django_quota.evaluate(policy_id, subject).decision for _ in range(3)]
    assert decisions == ["allowed", "allowed", "denied"]


# -- memory ----------------------------------------------------------------------------------
def test_reset_forgets_every_memory_counter(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"p": POLICY, "q": {**POLICY, "windows": "5/h"}})
    exhaust()
    django_quota.evaluate("q", {"user": "bob"})
    assert django_quota.peek("q", {"user": "bob"}).remaining == 4
    reset()
    assert django_quota.peek("p", ALICE).remaining == 2
    assert django_quota.peek("q", {"user": "bob"}).remaining == 5
    assert django_quota.evaluate("p", ALICE).decision == "allowed"


def test_reset_on_an_unused_memory_backend_is_harmless(quota: Any) -> None:
    quota(POLICIES={"p": POLICY})
    reset()
    assert django_quota.peek("p", ALICE).remaining == 2


def test_plugin_reset_reads_no_settings_before_anything_did(quota: Any) -> None:
    from django_quota import conf
    from django_quota.testing import reset_memory

    quota(POLICIES={"p": POLICY})  # setting_changed: nothing cached
    reset_memory()
    # Caching here would hide a later `del settings.QUOTA`, which sends no setting_changed.
    assert conf.cached_settings() is None
    exhaust()
    reset_memory()
    assert django_quota.peek("p", ALICE).remaining == 2


# -- the local fallback ----------------------------------------------------------------------
def test_reset_forgets_the_local_fallback_even_when_redis_is_down(quota: Any) -> None:
    quota(
        CLOCK=CLOCK,
        REDIS_URL=dead_redis_url(),
        LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 100},
        POLICIES={"p": POLICY},
    )
    exhaust()
    assert django_quota.evaluate("p", ALICE).backend_mode == "fallback"
    import redis

    with pytest.raises(redis.ConnectionError):
        reset()  # the fallback is cleared first; the unreachable Redis is then an error
    outcome = django_quota.evaluate("p", ALICE)
    assert (outcome.decision, outcome.backend_mode, outcome.remaining) == (
        "allowed",
        "fallback",
        1,
    )


# -- Redis -----------------------------------------------------------------------------------
@pytest.mark.redis
def test_reset_deletes_only_keys_under_the_key_prefix(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    # Glob characters in the prefix: an unescaped MATCH would also hit "q1:…".
    prefix = "q[1]*?\\"
    quota(CLOCK=CLOCK, REDIS_URL=redis_url, KEY_PREFIX=prefix, POLICIES={"p": POLICY})
    others = {
        "q1:app": b"1",
        "quota:app": b"2",
        prefix: b"3",
        f"{prefix}x:app": b"4",
        "session:abc": b"5",
        f"x{prefix}:app": b"6",
    }
    for key, value in others.items():
        redis_client.set(key, value)
    exhaust()
    for user in range(1200):  # more than one SCAN page and one delete batch
        django_quota.evaluate("p", {"user": str(user)})
    ours = [k for k in redis_client.scan_iter() if k.startswith(prefix.encode() + b":")]
    assert len(ours) >= 1201
    reset()
    assert {key.decode(): redis_client.get(key) for key in redis_client.scan_iter()} == others
    assert django_quota.peek("p", ALICE).remaining == 2


@pytest.mark.redis
def test_reset_leaves_other_databases_alone(quota: Any, redis_url: str) -> None:
    import redis

    other_db = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/1")
    other_db.set("quota:{x}:1:p:abc", b"another app's key under the same name")
    try:
        quota(CLOCK=CLOCK, REDIS_URL=redis_url, POLICIES={"p": POLICY})
        exhaust()
        reset()
        assert other_db.get("quota:{x}:1:p:abc") == b"another app's key under the same name"
        assert django_quota.peek("p", ALICE).remaining == 2
    finally:
        other_db.flushdb()
        other_db.close()


@pytest.mark.redis
def test_reset_clears_redis_and_the_fallback_together(quota: Any) -> None:
    require_redis_server()
    server = OwnRedis()
    server.start()
    try:
        quota(
            CLOCK=CLOCK,
            REDIS_URL=server.url,
            LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 100},
            POLICIES={"p": POLICY},
        )
        exhaust()  # in Redis
        fallback = limiter.get_fallback()
        assert fallback is not None
        reset()
        assert django_quota.peek("p", ALICE).remaining == 2
        assert limiter.get_fallback() is fallback  # cleared, not replaced
    finally:
        server.stop()


# -- the pytest plugin -----------------------------------------------------------------------
PROJECT_SETTINGS = """
    SECRET_KEY = "plugin-test"
    INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_quota"]
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    USE_TZ = True
    QUOTA = {
        "HMAC_KEY": "plugin-test-hmac-key-0123",
        "POLICY_SOURCES": ["settings"],
        "POLICIES": {"p": {"algorithm": "fixed_window", "windows": "2/h", "selector": ["user"]}},
        %s
    }
"""
TWO_TESTS = """
    import django_quota

    def test_first_uses_up_the_budget():
        decisions = [django_quota.evaluate("p", {"user": "1"}).decision for _ in range(3)]
        assert decisions == ["allowed", "allowed", "denied"]

    def test_second_starts_with_the_whole_budget():
        assert django_quota.peek("p", {"user": "1"}).remaining == 2
"""


@pytest.fixture(autouse=True)
def _own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest-django exported this suite's settings module; the projects below have theirs.
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)


def project(pytester: pytest.Pytester, quota_extra: str = "") -> None:
    pytester.makepyfile(
        project_settings=textwrap.dedent(PROJECT_SETTINGS) % quota_extra,
        test_project=textwrap.dedent(TWO_TESTS),
    )
    pytester.makeini(
        "[pytest]\npythonpath = .\nDJANGO_SETTINGS_MODULE = project_settings\n"
    )


def test_plugin_resets_the_memory_backend_between_tests(pytester: pytest.Pytester) -> None:
    project(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_without_the_plugin_counters_leak_into_the_next_test(
    pytester: pytest.Pytester,
) -> None:
    project(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:django_quota")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_second_starts_with_the_whole_budget*"])


def test_plugin_leaves_a_redis_backend_alone(pytester: pytest.Pytester) -> None:
    # A Redis nobody listens on: were the plugin to touch it, setup would fail.
    project(pytester, f'"REDIS_URL": "{dead_redis_url()}", "FAILURE_MODE": "open",')
    pytester.makepyfile(
        test_project=textwrap.dedent(
            """
            def test_one():
                pass

            def test_two():
                pass
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_plugin_is_harmless_without_django_settings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:django")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")  # pytest-django, no settings
    result.assert_outcomes(passed=1)
