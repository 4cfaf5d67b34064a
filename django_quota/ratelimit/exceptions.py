"""``Ratelimited``: what a blocking ``@ratelimit`` raises (``docs/django-ratelimit.md``)."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied

from django_quota.core.outcome import Outcome

__all__ = ["Ratelimited"]


class Ratelimited(PermissionDenied):
    """A request was refused by ``@ratelimit(block=True)``: Django answers 403, or
    ``RATELIMIT_VIEW`` with :class:`~django_quota.ratelimit.middleware.RatelimitMiddleware`.

    ``outcome`` is the refusing :class:`~django_quota.core.outcome.Outcome` (None when no
    evaluation refused: a rate of 0), so that a ``RATELIMIT_VIEW`` can answer 429 with
    ``Retry-After`` (:func:`django_quota.ratelimit.views.too_many_requests`).
    """

    outcome: Outcome | None = None
