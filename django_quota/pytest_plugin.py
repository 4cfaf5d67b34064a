"""The pytest plugin django-quota registers (entry point ``pytest11``: ``django_quota``).

Before each test it forgets the memory backend's counters (and this process's local
fallback), so counters never leak from one test into the next. It never calls Redis:
projects on Redis call :func:`django_quota.testing.reset` from a fixture (docs/testing.md).
Disable it with ``-p no:django_quota``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _django_quota_reset_memory() -> Iterator[None]:
    """Reset the memory backend before the test; nothing when Django is not configured."""
    from django.conf import settings

    if settings.configured:
        from django.apps import apps

        if apps.ready:
            from django_quota.testing import reset_memory

            reset_memory()
    yield
