"""Admin of the example shop."""

from __future__ import annotations

from django.contrib import admin

from example_project.shop.models import Item


@admin.register(Item)
class ItemAdmin(admin.ModelAdmin):  # type: ignore[type-arg]  # not subscriptable at runtime
    list_display = ["name", "price", "created_at"]
    search_fields = ["name"]
