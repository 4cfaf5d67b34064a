"""The DRF views of the whole-request rows: one ``APIView`` three times, differing only
in ``throttle_classes``. Authentication and permissions are off (no session, no user
lookup) so that the throttle is the only difference; DRF gives every request an
``AnonymousUser``, which both ``AnonRateThrottle`` classes throttle by client IP."""

from __future__ import annotations

from typing import Any

from rest_framework import throttling as drf_throttling
from rest_framework.permissions import AllowAny
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_quota import throttling as quota_throttling


class Unthrottled(APIView):
    """The base: a DRF view without throttles."""

    authentication_classes: Any = []
    permission_classes: Any = [AllowAny]
    renderer_classes: Any = [JSONRenderer]
    throttle_classes: Any = []

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class DRFAnonThrottled(Unthrottled):
    """DRF's own ``AnonRateThrottle`` (``DEFAULT_THROTTLE_RATES["anon"]``, the cache)."""

    throttle_classes: Any = [drf_throttling.AnonRateThrottle]


class QuotaAnonThrottled(Unthrottled):
    """django-quota's drop-in ``AnonRateThrottle``: the same import, another module."""

    throttle_classes: Any = [quota_throttling.AnonRateThrottle]
