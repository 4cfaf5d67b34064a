"""The one place where redis-py's exceptions become the failure reasons of
``docs/failures.md`` (:func:`classify`), and how a failure to get a connection (nothing
written) is told from one after the write (:class:`ConnectFailed`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import exceptions as redis_exceptions

from django_quota.core.errors import BackendError, Blame, Label
from django_quota.core.outcome import (
    BACKEND_ERROR,
    BACKEND_TIMEOUT,
    BACKEND_UNAVAILABLE,
    INDETERMINATE,
)

#: What redis-py raises when a connection fails (the built-in TimeoutError is an OSError).
CONNECT_ERRORS = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, OSError)
#: Replies that say the server refuses this client, whatever it sends: never the fallback.
_REFUSALS = (
    redis_exceptions.AuthenticationError,
    redis_exceptions.AuthorizationError,
    redis_exceptions.NoPermissionError,
    redis_exceptions.ResponseError,
)


def is_maxclients(exc: BaseException) -> bool:
    """Whether ``exc`` is a server at ``maxclients`` refusing a new connection: it
    accepted the connection, answered with that error and closed it, reading nothing
    (redis-py raises it as a ``ConnectionError`` with the server's text)."""
    return isinstance(exc, redis_exceptions.ConnectionError) and (
        "max number of clients reached" in str(exc)
    )


class ConnectFailed(redis_exceptions.ConnectionError):
    """Raised by our pools when no connection could be had: nothing was written.

    ``timed_out`` tells a connect timeout from a refusal (or a full pool);
    ``maxclients`` a server at ``maxclients`` refusing the new connection.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.timed_out = isinstance(cause, redis_exceptions.TimeoutError | TimeoutError)
        self.maxclients = is_maxclients(cause)


def is_connect_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised while a connection was being had, means nothing was
    written (so it becomes :class:`ConnectFailed`). Authentication and permission replies
    of the handshake are not: the server answered, and refused this client."""
    return isinstance(exc, CONNECT_ERRORS) and not isinstance(exc, _REFUSALS)


def mark_connect_failure(exc: BaseException) -> None:
    """Raise :class:`ConnectFailed` from ``exc`` when ``exc``, raised while a connection
    was being had, means nothing was written (:func:`is_connect_failure`); else return,
    for the caller to raise ``exc`` as it is."""
    if is_connect_failure(exc) and not isinstance(exc, ConnectFailed):
        raise ConnectFailed(exc) from exc


def classify(exc: BaseException) -> BackendError:
    """Map a redis-py exception to its failure reason (``docs/failures.md``).

    A failure to get a connection (refused, unreachable, pool exhausted) is
    ``backend_unavailable``, a connect timeout ``backend_timeout``: nothing was written.
    A ``LOADING`` reply is ``backend_unavailable`` (the command did not run). A timeout or
    a lost connection once a connection was had is ``indeterminate``: the command may
    have run. ``WRONGPASS``, ``NOAUTH``, ``NOPERM``, ``OOM`` and every other error reply
    (``BUSY``, ``READONLY``…) are ``backend_error``: the server answered, so the local
    fallback never takes over from a misconfigured one.

    A server at ``maxclients`` refusing a new connection is ``backend_unavailable``
    labelled :attr:`~django_quota.core.errors.Label.MAXCLIENTS`: it refused before reading
    anything, so nothing ran, and it counts toward the node's breaker only when none of
    the node's connections answered lately (``docs/failures.md``, "The circuit breaker").
    """
    if isinstance(exc, BackendError):
        return exc
    if exc.maxclients if isinstance(exc, ConnectFailed) else is_maxclients(exc):
        return BackendError(
            BACKEND_UNAVAILABLE,
            f"{type(exc).__name__}: {exc}",
            label=Label.MAXCLIENTS,
            blame=Blame.UNLESS_ANSWERING,
        )
    if isinstance(exc, ConnectFailed):
        reason = BACKEND_TIMEOUT if exc.timed_out else BACKEND_UNAVAILABLE
    elif isinstance(exc, redis_exceptions.BusyLoadingError):
        reason = BACKEND_UNAVAILABLE
    elif isinstance(exc, _REFUSALS):
        reason = BACKEND_ERROR
    elif isinstance(exc, CONNECT_ERRORS):  # the built-in TimeoutError is an OSError
        reason = INDETERMINATE
    else:
        reason = BACKEND_ERROR
    return BackendError(reason, f"{type(exc).__name__}: {exc}")


def cut_short(command: Sequence[Any]) -> BackendError:
    """``DEADLINE`` ended the wait for ``command``'s reply before ``TIMEOUT`` had passed:
    ``indeterminate`` (it was written and may have run), but no evidence against the node,
    which had less than ``TIMEOUT`` to answer (docs/settings.md, "Time budgets")."""
    return BackendError(
        INDETERMINATE,
        f"DEADLINE ended the wait for the reply to {command[0]}, before TIMEOUT",
        blame=Blame.SELF,
    )


def deadline_spent(command: Sequence[Any]) -> BackendError:
    """``DEADLINE`` ran out before ``command`` could be written: ``backend_timeout``
    (nothing ran), never counted by the node's breaker (docs/failures.md)."""
    return BackendError(
        BACKEND_TIMEOUT, f"DEADLINE spent before {command[0]} was written", blame=Blame.SELF
    )
