"""A ``RATELIMIT_VIEW`` that answers 429 (``docs/django-ratelimit.md``)."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse, HttpResponseForbidden

from django_quota import http
from django_quota.ratelimit.exceptions import Ratelimited

__all__ = ["too_many_requests"]


def too_many_requests(request: Any, exception: Exception) -> HttpResponse:
    """django-quota's 429 problem response (``Retry-After``, rate-limit headers; 503 when
    the rate limiter could not decide and the policy fails closed) for a request
    ``@ratelimit`` refused; 403 when no evaluation refused it (a rate of 0)."""
    outcome = exception.outcome if isinstance(exception, Ratelimited) else None
    if outcome is None:
        return HttpResponseForbidden()
    # ``@ratelimit`` sent ``quota_denied`` when it refused the request.
    return http.problem_response(request, outcome, too_many_requests, announce=False)
