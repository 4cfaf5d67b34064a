"""The pytest plugin of the django-ratelimit lane (``scripts/ratelimit-tests``), loaded
with ``-p django_quota_ratelimit_lane``: on the Redis run
(``DJANGO_QUOTA_RATELIMIT_LANE_REDIS_URL`` set) an autouse fixture calls
``django_quota.testing.reset()`` before each test. The memory backend is reset by the
package's own pytest plugin."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

REDIS_URL_VARIABLE = "DJANGO_QUOTA_RATELIMIT_LANE_REDIS_URL"


class _ResetRedis:
    @pytest.fixture(autouse=True)
    def _django_quota_reset_redis(self) -> Iterator[None]:
        from django_quota import limiter
        from django_quota.testing import reset

        mode = limiter.get_limiter().backend_mode
        if mode != "redis":  # the default cache must have put the counters on Redis
            pytest.fail(f"the Redis run decides on the {mode} backend")
        reset()
        yield


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(REDIS_URL_VARIABLE):
        config.pluginmanager.register(_ResetRedis(), "django_quota_ratelimit_lane_redis")
