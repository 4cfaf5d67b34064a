"""Shared fixtures: throwaway redis-server processes (pytest-redis) on free ports, and
helpers to point django-quota at them, at fakeredis or at the memory backend."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from pytest_redis import factories

pytest_plugins = ["pytester"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_redis_server() -> None:
    """Skip locally, fail in CI, when no redis-server binary exists."""
    if shutil.which("redis-server") is None:
        message = "redis-server binary not found (install Debian's redis-server)"
        if IN_CI:
            pytest.fail(message + "; in CI a missing Redis is a failure")
        pytest.skip(message)


_redis_proc = factories.redis_proc(port=None, save="")


@pytest.fixture(scope="session")
def redis_server(request: pytest.FixtureRequest) -> Any:
    """A redis-server started for this test session on a free loopback port."""
    require_redis_server()
    return request.getfixturevalue("_redis_proc")


@pytest.fixture
def redis_url(redis_server: Any) -> Iterator[str]:
    """URL of the session's redis-server, flushed before and after each test."""
    import redis

    url = f"redis://{redis_server.host}:{redis_server.port}/0"
    with redis.Redis.from_url(url) as client:
        client.flushall()
    yield url
    # A new client: a test may have killed every connection but its own (CLIENT KILL),
    # and redis-py 8.0 does not reconnect a pooled one the server closed.
    with redis.Redis.from_url(url) as client:
        client.flushall()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[Any]:
    """A plain redis-py client on the test server (for reading keys back)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def quota(settings: Any) -> Any:
    """Set ``settings.QUOTA`` for one test: ``quota(POLICIES={...}, REDIS_URL=...)``."""

    def apply(**values: Any) -> dict[str, Any]:
        # Database policies are opted into by the tests that use the database.
        merged = {
            "HMAC_KEY": "tests-hmac-key-0123456789",
            "POLICY_SOURCES": ["settings"],
            **values,
        }
        settings.QUOTA = merged
        return merged

    return apply


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print how many differential sequences each engine ran (all must have matched)."""
    from tests.differential import SEQUENCES

    if not SEQUENCES:
        return
    terminalreporter.section("differential sequences (zero mismatches, else a test failed)")
    for (label, engine), count in sorted(SEQUENCES.items()):
        terminalreporter.write_line(f"{label:16} {engine:10} {count}")
