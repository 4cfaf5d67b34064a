"""The exception hierarchy: one base, so callers can catch everything django-quota raises."""

from __future__ import annotations

from typing import Final


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


class Blame:
    """How a failure bears on its node's circuit breaker (``docs/failures.md``, "The
    circuit breaker")."""

    #: The node is unreachable or did not answer within ``TIMEOUT``: counts.
    NODE: Final = "node"
    #: The node answered (an error reply, ``CLUSTERDOWN``, ``TRYAGAIN``): never counts.
    NONE: Final = "none"
    #: The node refused a new connection while it is up (``maxclients``): counts only when
    #: none of its connections answered lately.
    UNLESS_ANSWERING: Final = "unless_answering"
    #: The process's own budget ran out (``DEADLINE`` spent before a command could be
    #: written): never counts, proves nothing either way.
    SELF: Final = "self"


class Label:
    """Labels of failures that have a name of their own beside their reason (recent
    errors, logs): a server at ``maxclients`` refusing a new connection, a cluster
    refusing with ``CLUSTERDOWN`` or ``TRYAGAIN``."""

    MAXCLIENTS: Final = "maxclients"
    CLUSTERDOWN: Final = "clusterdown"
    TRYAGAIN: Final = "tryagain"


class BackendError(QuotaError):
    """A backend could not decide; ``reason`` is one of the failure reasons of
    ``docs/failures.md``.

    ``label`` names a failure that has a name of its own beside its reason
    (:class:`Label`), for the recent errors and the logs; ``blame`` says how it bears on
    the node's circuit breaker (:class:`Blame`; None: by its reason). Raised by backends
    only; the limiter turns it into a failed outcome, so it never reaches a view.
    """

    def __init__(
        self,
        reason: str,
        message: str = "",
        *,
        label: str | None = None,
        blame: str | None = None,
    ) -> None:
        super().__init__(message or reason)
        self.reason = reason
        self.label = label
        self.blame = blame
