"""The valid counterpart of ``tests.folding_urls``: one decorated view per folded id."""

from __future__ import annotations

from django.urls import path

from tests.folding_urls import Undecorated, report, summary

urlpatterns = [
    path("report/", report),
    path("undecorated/", Undecorated.as_view()),
    path("summary/", summary),
]
