"""URLs of the example shop API (mounted under ``/api/``)."""

from __future__ import annotations

from django.urls import path

from example_project.shop import views

app_name = "shop"

urlpatterns = [
    path("items/", views.ItemListCreateView.as_view(), name="items"),
    path("search/", views.SearchView.as_view(), name="search"),
    path("catalog/", views.catalog, name="catalog"),
    path("me/", views.MeView.as_view(), name="me"),
    path("orders/", views.OrderListView.as_view(), name="orders"),
    path("export/", views.export, name="export"),
    path("quota-stats/", views.quota_stats, name="quota-stats"),
]
