"""The pytest plugin of the DRF lane (``scripts/drf-tests``), loaded into a run of DRF's
own ``tests/test_throttling.py`` with ``-p django_quota_drf_lane``.

DRF's ``tests/conftest.py`` configures settings and calls ``django.setup()`` in its
``pytest_configure``; this plugin's runs first and wraps ``django.setup`` once, so that
``django_quota`` joins ``INSTALLED_APPS`` after DRF configured them and before the app
registry is populated. Nothing else changes on the memory backend (the package's own
pytest plugin resets it before each test). With ``DJANGO_QUOTA_DRF_LANE_REDIS_URL`` set,
``QUOTA`` points at that Redis and an autouse fixture calls
``django_quota.testing.reset()`` before each test.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

REDIS_URL_VARIABLE = "DJANGO_QUOTA_DRF_LANE_REDIS_URL"


def _joining_django_quota(setup: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        import django
        from django.conf import settings

        django.setup = setup  # once: later calls are Django's own
        if "django_quota" not in settings.INSTALLED_APPS:
            settings.INSTALLED_APPS = (*settings.INSTALLED_APPS, "django_quota")
        redis_url = os.environ.get(REDIS_URL_VARIABLE)
        if redis_url:
            settings.QUOTA = {"REDIS_URL": redis_url}
        return setup(*args, **kwargs)

    return wrapped


class _ResetRedis:
    @pytest.fixture(autouse=True)
    def _django_quota_reset_redis(self) -> Iterator[None]:
        from django_quota.testing import reset

        reset()
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    import django

    django.setup = _joining_django_quota(django.setup)
    if os.environ.get(REDIS_URL_VARIABLE):
        config.pluginmanager.register(_ResetRedis(), "django_quota_drf_lane_redis")
