"""Views of the example shop API, one for each way django-quota limits a request.

- ``ItemListCreateView`` and ``SearchView`` know nothing of rate limits: ``QuotaMiddleware``
  applies the ``api-items`` and ``api-search`` policies of ``settings.QUOTA`` by route.
- ``catalog`` (plain Django) is under ``api-catalog``, a *shadow* middleware policy: it
  is decided and counted but never refuses. The view reports the decisions made for its
  request, so that what the policy would have done is visible.
- ``MeView`` uses django-quota's drop-in ``AnonRateThrottle`` and ``UserRateThrottle``
  (rates in ``REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]``).
- ``OrderListView`` uses ``QuotaThrottle`` with the ``orders`` policy (burst + sustained).
- ``export`` (plain Django) is limited by ``@quota``, each request costing its ``?size=``.
- ``quota_stats`` reports this worker's decision counts (a debugging aid, see settings).
"""

from __future__ import annotations

import hashlib
import os

from django.conf import settings
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, JsonResponse
from django.views.decorators.http import require_GET
from rest_framework import generics
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

import django_quota
from django_quota import metrics
from django_quota.decorators import quota
from django_quota.throttling import AnonRateThrottle, QuotaThrottle, UserRateThrottle
from example_project.shop.limits import EXPORT_MAX_SIZE, EXPORT_PAGE_SIZE, EXPORT_RATE
from example_project.shop.models import Item
from example_project.shop.serializers import ItemSerializer, SearchQuerySerializer

SEARCH_LIMIT = 20
# Rounds of SHA-256 that stand in for a costly ranking step (well under a millisecond).
SEARCH_WORK_ROUNDS = 2000


class ItemListCreateView(generics.ListCreateAPIView[Item]):
    """List items (newest first, paginated) or create one from ``{"name", "price"}``."""

    queryset = Item.objects.all()
    serializer_class = ItemSerializer


def _rank(name: str, query: str) -> str:
    digest = f"{query}\x00{name}".encode()
    for _ in range(SEARCH_WORK_ROUNDS // SEARCH_LIMIT):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()


class SearchView(APIView):
    """Find up to 20 items whose name contains ``?q=`` (case-insensitive)."""

    def get(self, request: Request) -> Response:
        params = SearchQuerySerializer(data=request.query_params)
        params.is_valid(raise_exception=True)
        query: str = params.validated_data["q"]
        matches: QuerySet[Item] = Item.objects.all()
        if query:
            matches = matches.filter(name__icontains=query)
        items = list(matches[:SEARCH_LIMIT])
        items.sort(key=lambda item: _rank(item.name, query))
        return Response(
            {
                "q": query,
                "count": len(items),
                "results": ItemSerializer(items, many=True).data,
            }
        )


@require_GET
def catalog(request: HttpRequest) -> JsonResponse:
    """The names of the newest 20 items, and the quota decisions made for this request.

    ``api-catalog`` is a shadow policy: the middleware decides it (``allowed`` or
    ``shadow_denied``) and lets every request through, without rate-limit headers.
    ``django_quota.outcomes(request)`` lists the outcomes recorded on the request; only
    policy ids, decisions and reasons are shown, never an identity.
    """
    names = list(Item.objects.values_list("name", flat=True)[:20])
    decisions = [
        {"policy": outcome.policy, "decision": outcome.decision, "reason": outcome.reason}
        for outcome in django_quota.outcomes(request)
    ]
    return JsonResponse({"count": len(names), "names": names, "quota": decisions})


class MeView(APIView):
    """Who the caller is: a DRF token's user, or anonymous.

    django-quota's drop-in throttles, used exactly like DRF's own: ``AnonRateThrottle``
    limits anonymous callers per IP (``drf:anon``, 3/second); ``UserRateThrottle`` limits
    each user (``drf:user``, 8 per 4 s), and anonymous callers per IP. As in DRF, every
    throttle is asked, so a request one throttle refuses still counts for the others.
    """

    throttle_classes = [AnonRateThrottle, UserRateThrottle]

    def get(self, request: Request) -> Response:
        user = request.user
        authenticated = bool(user and user.is_authenticated)
        return Response(
            {
                "authenticated": authenticated,
                "username": user.get_username() if authenticated else None,
            }
        )


class OrderListView(APIView):
    """The caller's orders (authenticated users only; the shop keeps none yet).

    ``QuotaThrottle`` applies the policies the view names in ``quota_policies``, here
    ``orders`` from ``settings.QUOTA`` (3 a second and 7 per 3 s, per DRF user), decided
    together in one backend call. Permissions run before throttles, so anonymous callers
    get 401 without being counted.
    """

    permission_classes = [IsAuthenticated]
    throttle_classes = [QuotaThrottle]
    quota_policies = ["orders"]

    def get(self, request: Request) -> Response:
        return Response({"username": request.user.get_username(), "orders": []})


def _export_size(request: HttpRequest) -> int | None:
    try:
        size = int(request.GET.get("size", "1"))
    except ValueError:
        return None
    return size if 1 <= size <= EXPORT_MAX_SIZE else None


def export_cost(request: HttpRequest) -> int:
    """The cost of an export: its ``?size=`` in pages (1 when invalid: the view answers 400)."""
    return _export_size(request) or 1


@require_GET  # outermost: other methods get 405 without being charged
@quota(rate=EXPORT_RATE, selector=("ip",), algorithm="fixed_window", cost=export_cost)
def export(request: HttpRequest) -> JsonResponse:
    """Export ``?size=`` pages (1 to 3) of items as JSON: a plain Django view limited by
    ``@quota`` to 6 pages a second and 15 per 3 s per client IP (``EXPORT_RATE``), each
    request charged its size in both windows. The policy is generated with the id
    ``view:example_project.shop.views.export``."""
    size = _export_size(request)
    if size is None:
        return JsonResponse({"detail": f"size must be 1 to {EXPORT_MAX_SIZE}"}, status=400)
    items = Item.objects.all()[: size * EXPORT_PAGE_SIZE]
    return JsonResponse(
        {
            "size": size,
            "items": [{"id": item.pk, "name": item.name, "price": item.price} for item in items],
        }
    )


@require_GET
def quota_stats(request: HttpRequest) -> JsonResponse:
    """This worker's decision counts since it started: ``django_quota.metrics.outcome_counts()``
    as ``{"pid", "outcomes": [{"policy", "decision", "reason", "count"}]}``.

    Served only with ``DEBUG`` or ``EXAMPLE_QUOTA_STATS`` (404 otherwise) and listed in
    ``QUOTA["EXEMPT_PATHS"]``. Each gunicorn worker counts its own decisions: a client
    adds up the answers of every worker pid.
    """
    if not getattr(settings, "EXAMPLE_QUOTA_STATS", False):
        raise Http404("quota stats are off")
    counts = metrics.outcome_counts()
    return JsonResponse(
        {
            "pid": os.getpid(),
            "outcomes": [
                {"policy": policy, "decision": decision, "reason": reason, "count": count}
                for (policy, decision, reason), count in sorted(counts.items())
            ],
        }
    )
