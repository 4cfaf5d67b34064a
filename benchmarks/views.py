"""The plain Django view of the whole-request rows (no DRF): the same small JSON body
the DRF views render."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse

from benchmarks.django_settings import RATELIMIT_RATE
from django_quota.ratelimit.decorators import ratelimit as quota_ratelimit

BODY = b'{"ok":true}'


def plain(request: HttpRequest) -> HttpResponse:
    """Answer 200 with a fixed JSON body."""
    return HttpResponse(BODY, content_type="application/json")


def _limited_or_plain(request: Any) -> HttpResponse:
    if request.limited:
        return HttpResponse(status=429)
    return plain(request)


@quota_ratelimit(key="ip", rate=RATELIMIT_RATE, block=False)
def quota_ratelimited(request: HttpRequest) -> HttpResponse:
    """The plain view under django-quota's ``@ratelimit`` (429 when limited)."""
    return _limited_or_plain(request)


def django_ratelimited() -> Any:
    """The plain view under django-ratelimit's own ``@ratelimit`` (needs it installed)."""
    from django_ratelimit.decorators import ratelimit  # type: ignore[import-untyped]

    @ratelimit(key="ip", rate=RATELIMIT_RATE, block=False)  # type: ignore[untyped-decorator]
    def view(request: HttpRequest) -> HttpResponse:
        return _limited_or_plain(request)

    return view
