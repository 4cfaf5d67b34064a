"""A Redis URL that redis-py cannot build a client from is a check error naming its key,
without its password; one that still fails when the backend is built (a cache's
``LOCATION`` under ``CACHE_ALIAS``) is ``backend_error`` under the failure mode, the same
sync and async, and never an HTTP 500 (docs/settings.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.test import Client

import django_quota

BAD_URLS = [
    "redis://127.0.0.1:99999/0",
    "redis://127.0.0.1:notaport/0",
    "redis://u:s3cret@[::1/0",
    # An unescaped '#' ends the netloc: redis-py reads "s3" of the password as a port.
    "redis://app:s3#cret@127.0.0.1:6379/0",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_url_redis_py_cannot_parse_is_a_check_error_without_its_password(
    quota: Any, url: str
) -> None:
    quota(REDIS_URL=url)
    errors = [e for e in checks.run_checks() if e.id == "django_quota.E003"]
    assert len(errors) == 1
    assert errors[0].msg.startswith("QUOTA['REDIS_URL']: not a URL redis-py can connect to: ")
    shown = f"{errors[0].msg} {errors[0].hint}"
    assert "s3" not in shown and "notaport" not in shown and "99999" not in shown
    with pytest.raises(ImproperlyConfigured) as raised:  # the first use says the same
        django_quota.evaluate("p", {"ip": "192.0.2.1"})
    assert "s3" not in str(raised.value)


@pytest.fixture
def broken_cache(settings: Any) -> None:
    pytest.importorskip("django_redis")
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "quota": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://u:s3cret@127.0.0.1:99999/0",
        },
    }


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_a_url_failing_when_the_backend_is_built_is_backend_error_sync_and_async(
    quota: Any, broken_cache: None, mode: str
) -> None:
    quota(CACHE_ALIAS="quota", FAILURE_MODE=mode, POLICIES={"p": {"windows": "5/m"}})
    sync = django_quota.evaluate("p", {"ip": "192.0.2.1"})
    in_loop = asyncio.run(django_quota.aevaluate("p", {"ip": "192.0.2.1"}))
    expected = ("failed_closed" if mode == "closed" else "failed_open", "backend_error")
    assert (sync.decision, sync.reason) == expected
    assert (in_loop.decision, in_loop.reason) == expected
    details = [error.detail for error in django_quota.limiter.recent_errors()]
    assert details and all("port is not a number" in d for d in details)
    assert not any("s3cret" in d or "99999" in d for d in details)


@pytest.mark.urls("tests.urls")
@pytest.mark.parametrize("mode", ["closed", "open"])
def test_a_url_failing_at_runtime_never_answers_500(
    quota: Any, broken_cache: None, settings: Any, mode: str
) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django_quota.middleware.QuotaMiddleware"]
    quota(
        CACHE_ALIAS="quota",
        FAILURE_MODE=mode,
        POLICIES={"p": {"windows": "5/m", "selector": ["ip"], "routes": ["*"]}},
    )
    status = Client().get("/no-such-page/").status_code
    assert status == (503 if mode == "closed" else 404)
