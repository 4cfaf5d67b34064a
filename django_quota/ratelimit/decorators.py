"""``@ratelimit``: django-ratelimit's decorator on django-quota's engine
(``docs/django-ratelimit.md``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.http import HttpResponseBase
from django.utils.module_loading import import_string

from django_quota import http
from django_quota.core.outcome import Outcome
from django_quota.decorators import middleware_installed
from django_quota.ledger import outcomes
from django_quota.ratelimit import ALL, UNSAFE
from django_quota.ratelimit.core import ausage_and_outcome, usage_and_outcome
from django_quota.ratelimit.exceptions import Ratelimited

__all__ = ["ratelimit"]

ViewT = TypeVar("ViewT", bound=Callable[..., Any])


def _exception(outcome: Outcome | None) -> BaseException:
    """``RATELIMIT_EXCEPTION_CLASS`` (a class or its dotted path; default
    :class:`Ratelimited`), made without arguments as django-ratelimit makes it."""
    found = getattr(settings, "RATELIMIT_EXCEPTION_CLASS", Ratelimited)
    cls = import_string(found) if isinstance(found, str) else found
    exception: BaseException = cls()
    if isinstance(exception, Ratelimited):
        exception.outcome = outcome
    return exception


def _finish(request: Any, response: Any) -> Any:
    """The view's response with the rate-limit headers of the request's outcomes, unless
    ``QuotaMiddleware`` writes them on the way out."""
    if isinstance(response, HttpResponseBase) and not middleware_installed():
        http.apply_headers(response, outcomes(request))  # type: ignore[arg-type]
    return response


def ratelimit(
    group: str | None = None,
    key: Any = None,
    rate: Any = None,
    method: Any = ALL,
    block: bool = True,
) -> Callable[[ViewT], ViewT]:
    """Limit a view (sync or async) as django-ratelimit's ``@ratelimit`` does.

    Each request of a matching ``method`` is counted under ``group`` (default: the
    view's dotted name) and the ``key``'s value, at ``rate`` (arguments as for
    :func:`~django_quota.ratelimit.core.get_usage`). ``request.limited`` becomes True
    when this decorator (or an earlier one) limited the request; with ``block=True`` a
    limited request raises ``RATELIMIT_EXCEPTION_CLASS`` (default :class:`Ratelimited`,
    a 403) and never reaches the view.
    """

    def decorator(fn: ViewT) -> ViewT:
        if iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def _awrapped(request: Any, *args: Any, **kwargs: Any) -> Any:
                old_limited = getattr(request, "limited", False)
                usage, outcome = await ausage_and_outcome(
                    request, group, fn, key, rate, method, increment=True
                )
                limited = usage is not None and bool(usage["should_limit"])
                request.limited = limited or old_limited
                if limited and block:
                    raise _exception(outcome)
                return _finish(request, await fn(request, *args, **kwargs))

            return _awrapped  # type: ignore[return-value]

        @functools.wraps(fn)
        def _wrapped(request: Any, *args: Any, **kwargs: Any) -> Any:
            old_limited = getattr(request, "limited", False)
            usage, outcome = usage_and_outcome(
                request, group, fn, key, rate, method, increment=True
            )
            limited = usage is not None and bool(usage["should_limit"])
            request.limited = limited or old_limited
            if limited and block:
                raise _exception(outcome)
            return _finish(request, fn(request, *args, **kwargs))

        return _wrapped  # type: ignore[return-value]

    return decorator


ratelimit.ALL = ALL  # type: ignore[attr-defined]
ratelimit.UNSAFE = UNSAFE  # type: ignore[attr-defined]
