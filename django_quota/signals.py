"""Signals. ``quota_denied(sender, request, outcome)`` is sent once per refused request
by the HTTP layers (middleware, decorator, DRF throttles) for the outcome that refused it."""

from __future__ import annotations

from django.dispatch import Signal

quota_denied = Signal()
