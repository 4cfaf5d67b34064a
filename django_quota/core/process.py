"""What this process keeps between calls outside the limiter, the registry and the
settings cache: caches of things imported or walked once, the Redis backends alive, and
the context-local flags. One instance, :data:`PROCESS`; :meth:`Process.clear` forgets
its caches (the settings listener, and tests, call it)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from django_quota.core.outcome import Outcome


class Process:
    """The process's state outside the limiter, the registry and the settings cache."""

    __slots__ = (
        "backends",
        "checking",
        "exempt_when",
        "handshakes",
        "login_attempt",
        "mounted",
        "revision_batch",
    )

    def __init__(self) -> None:
        # -- caches ----------------------------------------------------------------------
        #: ``EXEMPT_WHEN`` imported, by dotted path (``subjects``); follows the settings.
        self.exempt_when: dict[str, Callable[[Any], Any]] = {}
        #: Whether a URLconf (its resolver) mounts the usage view anywhere (``usage``).
        self.mounted: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        #: The connection classes ``backends.handshake.one_write_handshake`` made, by
        #: redis-py's class.
        self.handshakes: dict[type[Any], type[Any]] = {}
        # -- what is alive ---------------------------------------------------------------
        #: Every Redis backend of the process: reset in a forked child
        #: (``backends.clients``).
        self.backends: weakref.WeakSet[Any] = weakref.WeakSet()
        # -- context-local flags: each context's own value ends with it; never cleared ---
        #: True while the system checks read the registry (``policies.checking``).
        self.checking: ContextVar[bool] = ContextVar("django_quota_checking", default=False)
        #: Primary keys of the policies touched inside ``models.revision_batch`` (None: no
        #: batch).
        self.revision_batch: ContextVar[set[int] | None] = ContextVar(
            "django_quota_revision_batch", default=None
        )
        #: An attempt made without a request (``authenticate(request=None)``): its
        #: refusal, and whether the login backend charged it already, as a request's
        #: ledger holds them for its own (``auth``).
        self.login_attempt: ContextVar[tuple[Outcome | None, bool]] = ContextVar(
            "django_quota_login_attempt", default=(None, False)
        )

    def settings_changed(self) -> None:
        """Forget what follows the settings (connected in ``AppConfig.ready()``)."""
        self.exempt_when.clear()

    def clear(self) -> None:
        """Forget every cache (the backends alive and the context flags stay)."""
        self.exempt_when.clear()
        self.mounted.clear()
        self.handshakes.clear()


PROCESS = Process()
