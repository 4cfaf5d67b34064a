"""``CACHE_ALIAS`` (docs/settings.md): the counters live in the django-redis cache's own
Redis database, so ``cache.clear()`` resets them, and a ``REDIS_URL`` beside the alias
is not where they go. On the suite's redis-server; skipped without django-redis (the
``django-redis`` extra)."""

from __future__ import annotations

from typing import Any

import pytest

import django_quota

pytest.importorskip("django_redis")
pytestmark = pytest.mark.redis

IP = "203.0.113.9"


def decisions(count: int) -> list[str]:
    return [django_quota.evaluate("p", {"ip": IP}).decision for _ in range(count)]


def test_counters_share_the_cache_database_and_cache_clear_resets_them(
    quota: Any, settings: Any, redis_url: str
) -> None:
    import redis
    from django.core.cache import caches

    assert redis_url.endswith("/0")
    cache_url = redis_url[: -len("/0")] + "/1"
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "quota": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": cache_url},
    }
    # REDIS_URL names database 0; the cache's database 1 wins (check W008). The denial
    # cache is off: a refusal it remembers outlives a FLUSHDB for up to MAX_TTL
    # (docs/settings.md), which is not what this test is about.
    quota(
        CACHE_ALIAS="quota",
        REDIS_URL=redis_url,
        POLICIES={"p": {"windows": "2/h", "selector": ["ip"]}},
        DENIAL_CACHE={"ENABLED": False},
    )
    assert decisions(3) == ["allowed", "allowed", "denied"]
    database_0 = redis.Redis.from_url(redis_url)
    database_1 = redis.Redis.from_url(cache_url)
    try:
        assert database_0.keys("quota:*") == []
        assert len(database_1.keys("quota:*")) == 1
        caches["quota"].set("page", "cached")
        caches["quota"].clear()
        assert database_1.keys("*") == []
        assert decisions(3) == ["allowed", "allowed", "denied"]
    finally:
        database_0.close()
        database_1.close()
