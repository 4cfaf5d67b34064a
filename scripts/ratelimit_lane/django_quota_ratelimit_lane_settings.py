"""The settings module of the django-ratelimit lane (``scripts/ratelimit-tests``).

No ``QUOTA`` setting, as in a project that has just changed its imports: the counters
live where ``RATELIMIT_USE_CACHE`` says (``docs/django-ratelimit.md``). The memory run's
default cache is a local-memory cache (hence the memory backend); the Redis run's
(``DJANGO_QUOTA_RATELIMIT_LANE_REDIS_URL`` set) is a django-redis cache on the lane's
throwaway redis-server, so the counters live there. The other aliases are the ones
django-ratelimit's tests name.
"""

from __future__ import annotations

import os
from typing import Any

SECRET_KEY = "django-quota-ratelimit-lane-not-for-production"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_quota"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_REDIS_URL = os.environ.get("DJANGO_QUOTA_RATELIMIT_LANE_REDIS_URL")
_DEFAULT: dict[str, Any] = (
    {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": _REDIS_URL}
    if _REDIS_URL
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
)
CACHES: dict[str, dict[str, Any]] = {
    "default": _DEFAULT,
    # A memcached cache nothing listens to: django-quota's counters never live there.
    "connection-errors": {
        "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
        "LOCATION": "test-connection-errors",
    },
    # A django-redis cache whose host does not resolve: the backend fails.
    "connection-errors-redis": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://test-connection-errors",
        "OPTIONS": {"IGNORE_EXCEPTIONS": True},
    },
    "instant-expiration": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"},
}
