"""The plain Django view of the whole-request rows (no DRF): the same small JSON body
the DRF views render."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

BODY = b'{"ok":true}'


def plain(request: HttpRequest) -> HttpResponse:
    """Answer 200 with a fixed JSON body."""
    return HttpResponse(BODY, content_type="application/json")
