"""Django settings for the benchmark: ``settings.configure(...)`` then ``django.setup()``.

django-quota gets one policy per measured shape, twice: a *bulk* variant whose limits are
never reached (latency and throughput of admitted decisions) and an *exact* variant with
the small limit of the exactness column. Django's built-in ``RedisCache`` (used by DRF's
throttles and django-ratelimit) points at the same server.

The whole-request rows (:mod:`benchmarks.whole_request`) resolve ``benchmarks.urls``.
``MIDDLEWARE`` is empty here: Django reads it once, when a handler is built, and the
middleware row builds its own handler with ``QuotaMiddleware`` (under
``override_settings``), so no other row pays for a middleware it does not measure.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import django
from django.conf import settings

#: The rate every implementation gets for latency, throughput, commands and memory:
#: high enough that no benchmark decision is ever a denial.
BULK_LIMIT = 1_000_000
BULK_BURST = 100_000
HMAC_KEY = "django-quota-benchmark-hmac-key"
#: The hammering client's policy (``benchmarks.engine``): one subject asks 10x its limit.
HAMMER_POLICY = "hammer"
HAMMER_LIMIT = 50

ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "sliding_log")
TWO_WINDOWS = "two_windows"
#: A calendar month in a customer's timezone (docs/paid-api.md): a fixed window whose
#: calls carry the month's boundaries.
CALENDAR_MONTH = "calendar_month"
CALENDAR_TIMEZONE = "Europe/Berlin"

#: The concurrency policy (docs/concurrency.md): its largest N, and leases of a minute.
CONCURRENCY = "concurrency"
CONCURRENCY_BULK = 65_535

#: The whole-request rows' paths (``benchmarks.urls``) and the middleware's policy.
PLAIN_PATH = "/plain/"
DRF_PATH = "/drf/"
DRF_THROTTLED_PATH = "/drf/drf-anon/"
DRF_QUOTA_PATH = "/drf/quota-anon/"
RATELIMIT_PATH = "/ratelimit/django-ratelimit/"
QUOTA_RATELIMIT_PATH = "/ratelimit/quota/"
#: The rate of both ``@ratelimit`` rows (benchmarks.views).
RATELIMIT_RATE = "100/m"
MIDDLEWARE_POLICY = "request_plain"
#: The algorithm of the middleware's policy: the drop-in throttles' default
#: (``DRF_ALGORITHM``), so that both edges of django-quota decide the same way.
MIDDLEWARE_ALGORITHM = "sliding_window"
HOST = "testserver"


def bulk_id(name: str) -> str:
    return name


def exact_id(name: str) -> str:
    return f"{name}.exact"


def quota_policies(limit: int) -> dict[str, dict[str, Any]]:
    """The policies: per algorithm and for the burst + sustained pair, bulk and exact."""
    policies: dict[str, dict[str, Any]] = {}
    for algorithm in ALGORITHMS:
        policies[bulk_id(algorithm)] = {
            "algorithm": algorithm,
            "windows": f"{BULK_LIMIT}/h",
            "selector": ["ip"],
        }
        # A day-long window: no refill (token bucket: L/86400 tokens a second) and no
        # window boundary (fixed, sliding) during the second the exactness column takes.
        policies[exact_id(algorithm)] = {
            "algorithm": algorithm,
            "windows": f"{limit}/d",
            "selector": ["ip"],
        }
    policies[bulk_id(TWO_WINDOWS)] = {
        "algorithm": "sliding_window",
        "windows": {"burst": f"{BULK_BURST}/s", "sustained": f"{BULK_LIMIT}/h"},
        "selector": ["ip"],
    }
    policies[exact_id(TWO_WINDOWS)] = {
        "algorithm": "sliding_window",
        "windows": {"burst": f"{limit}/h", "sustained": f"{2 * limit}/d"},
        "selector": ["ip"],
    }
    calendar_limits = ((bulk_id(CALENDAR_MONTH), BULK_LIMIT), (exact_id(CALENDAR_MONTH), limit))
    for name, limit_of in calendar_limits:
        policies[name] = {
            "algorithm": "fixed_window",
            "windows": f"{limit_of}/month",
            "timezone": CALENDAR_TIMEZONE,
            "selector": ["ip"],
        }

    policies[bulk_id(CONCURRENCY)] = {
        "algorithm": CONCURRENCY,
        "windows": f"{CONCURRENCY_BULK}/m",
        "selector": ["ip"],
    }
    policies[exact_id(CONCURRENCY)] = {
        "algorithm": CONCURRENCY,
        "windows": f"{min(limit, CONCURRENCY_BULK)}/m",
        "selector": ["ip"],
    }
    policies[HAMMER_POLICY] = {
        "algorithm": "fixed_window",
        "windows": f"{HAMMER_LIMIT}/h",
        "selector": ["ip"],
    }
    # Only the middleware row's handler has QuotaMiddleware; only /plain/ matches.
    policies[MIDDLEWARE_POLICY] = {
        "algorithm": MIDDLEWARE_ALGORITHM,
        "windows": f"{BULK_LIMIT}/h",
        "selector": ["ip"],
        "routes": [PLAIN_PATH.rstrip("/")],
    }
    return policies


def quota_settings(redis_url: str, limit: int, *, backend: str = "redis") -> dict[str, Any]:
    return {
        "BACKEND": backend,
        "REDIS_URL": redis_url,
        "HMAC_KEY": HMAC_KEY,
        "KEY_PREFIX": "quota",
        "TIMEOUT": 1.0,
        "DEADLINE": 2.0,
        "MEMORY_MAX_ENTRIES": 100_000,
        "POLICY_SOURCES": ["settings"],
        "POLICIES": quota_policies(limit),
    }


def configure(redis_url: str, limit: int) -> None:
    """Configure Django once for the whole run."""
    installed_apps = ["django.contrib.contenttypes", "django.contrib.auth"]
    if importlib.util.find_spec("rest_framework") is not None:
        installed_apps.append("rest_framework")
    installed_apps.append("django_quota")
    settings.configure(
        DEBUG=False,
        SECRET_KEY="django-quota-benchmark-secret-key",
        USE_TZ=True,
        ALLOWED_HOSTS=[HOST],
        ROOT_URLCONF="benchmarks.urls",
        MIDDLEWARE=[],
        INSTALLED_APPS=installed_apps,
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        CACHES={
            "default": {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": redis_url,
            }
        },
        REST_FRAMEWORK={"DEFAULT_THROTTLE_RATES": {"anon": f"{BULK_LIMIT}/hour"}},
        RATELIMIT_USE_CACHE="default",
        QUOTA=quota_settings(redis_url, limit),
    )
    django.setup()
