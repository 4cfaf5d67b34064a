"""``RatelimitMiddleware``: ``Ratelimited`` answered by ``RATELIMIT_VIEW``
(``docs/django-ratelimit.md``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.deprecation import MiddlewareMixin
from django.utils.module_loading import import_string

from django_quota.ratelimit.exceptions import Ratelimited

__all__ = ["RatelimitMiddleware"]


class RatelimitMiddleware(MiddlewareMixin):
    """Turn :class:`Ratelimited` into the response of ``RATELIMIT_VIEW`` (the dotted path
    of a view ``(request, exception)``), sync or async; any other exception passes.

    Raises ``ImproperlyConfigured`` when a request is limited and ``RATELIMIT_VIEW`` is
    not set.
    """

    def process_exception(self, request: Any, exception: Exception) -> Any:
        if not isinstance(exception, Ratelimited):
            return None
        path = getattr(settings, "RATELIMIT_VIEW", None)
        if not path:
            raise ImproperlyConfigured(
                "RatelimitMiddleware needs RATELIMIT_VIEW, the dotted path of a view "
                "(request, exception), e.g. 'django_quota.ratelimit.views.too_many_requests'"
            )
        return import_string(path)(request, exception)
