"""Views of the example shop API.

None of them knows about rate limits: ``QuotaMiddleware`` applies the ``api-items`` and
``api-search`` policies from ``settings.QUOTA`` before a view runs.
"""

from __future__ import annotations

import hashlib

from django.db.models import QuerySet
from rest_framework import generics
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

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
