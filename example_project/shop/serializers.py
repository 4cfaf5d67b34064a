"""Serializers of the example shop API."""

from __future__ import annotations

from rest_framework import serializers

from example_project.shop.models import Item


class ItemSerializer(serializers.ModelSerializer[Item]):
    class Meta:
        model = Item
        fields = ["id", "name", "price", "created_at"]
        read_only_fields = ["id", "created_at"]


class SearchQuerySerializer(serializers.Serializer[dict[str, str]]):
    q = serializers.CharField(max_length=100, allow_blank=True, default="", trim_whitespace=True)
