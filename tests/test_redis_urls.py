"""A Redis URL that redis-py cannot build a client from is a check error naming its key,
without its password; one that still fails when the backend is built (a cache's
``LOCATION`` under ``CACHE_ALIAS``) is ``backend_error`` under the failure mode, the same
sync and async, and never an HTTP 500 (docs/settings.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from django.core import checks
from django.test import Client

import django_quota

BAD_URLS = [
    "redis://127.0.0.1:99999/0",
    "redis://127.0.0.1:notaport/0",
    "redis://u:s3cret@[::1/0",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_url_redis_py_cannot_parse_is_a_check_error_without_its_password(
    quota: Any, url: str
) -> None:
    quota(REDIS_URL=url)
    errors = [e for e in checks.run_checks() if e.id == "django_quota.E003"]
    assert len(errors) == 1
    assert errors[0].msg.startswith("QUOTA['REDIS_URL']: not a URL redis-py can connect to: ")
    assert "s3cret" not in errors[0].msg and "s3cret" not in (errors[0].hint or "")


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
