"""The exception hierarchy: one base, so callers can catch everything django-quota raises."""

from __future__ import annotations


class QuotaError(Exception):
    """Base class of every error raised by django-quota."""


class ConfigurationError(QuotaError, ValueError):
    """A setting or policy definition is invalid.

    ``key`` names the offending setting as a user would write it, e.g.
    ``QUOTA["POLICIES"]["orders"]["windows"]["burst"]``.
    """

    def __init__(self, key: str, message: str, hint: str | None = None) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
        self.hint = hint


class BackendError(QuotaError):
    """A backend could not decide; ``reason`` is one of the failure reasons of
    ``docs/failures.md``.

    Raised by backends only; the limiter turns it into a failed outcome, so it never
    reaches a view.
    """

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason
