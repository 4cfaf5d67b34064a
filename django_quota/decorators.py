"""``@quota``: rate-limit one view (function or class-based, sync or async) as one layer
(``docs/drf.md``)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.utils.module_loading import import_string

from django_quota import conf, http, policies, releasing
from django_quota.core.errors import ConfigurationError
from django_quota.core.outcome import Outcome
from django_quota.core.policy import (
    SLIDING_WINDOW,
    Policy,
    Selector,
    generated_policy_id,
    parse_policy,
)
from django_quota.ledger import Cost, Lease, adecide, decide, outcomes
from django_quota.policies import Generated
from django_quota.subjects import PLAIN

__all__ = ["quota"]

_DEFAULT_SELECTOR: tuple[str, ...] = (Selector.AUTO,)

ViewT = TypeVar("ViewT", bound=Callable[..., Any])


def _check_cost(cost: object) -> None:
    if callable(cost):
        return
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise TypeError(f"cost must be an int or a callable(request) -> int, not {cost!r}")
    if cost < 0:
        raise ValueError(f"cost must be >= 0, not {cost}")


# -- is QuotaMiddleware installed? ---------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _installed(middleware: tuple[str, ...]) -> bool:
    from django_quota.middleware import QuotaMiddleware

    for path in middleware:
        if path == "django_quota.middleware.QuotaMiddleware":
            return True
        try:
            found = import_string(path)
        except ImportError:
            continue
        if isinstance(found, type) and issubclass(found, QuotaMiddleware):
            return True
    return False


def middleware_installed() -> bool:
    """Whether ``settings.MIDDLEWARE`` has ``QuotaMiddleware`` (or a subclass): then it
    writes the rate-limit headers and the decorator only records outcomes."""
    return _installed(tuple(getattr(django_settings, "MIDDLEWARE", None) or ()))


# -- the policy of one decorated view ------------------------------------------------------
class _Limit:
    """What one ``@quota`` applies: a named policy, or a policy generated from ``rate``
    (re-resolved whenever settings change, so that a configured policy with the same id
    wins)."""

    def __init__(self, policy_id: str | None, generated: Policy | None, cost: Cost) -> None:
        self.policy_id = policy_id
        self.generated = generated
        self.cost = cost

    def policy(self) -> Policy:
        if self.generated is None:
            assert self.policy_id is not None
            return policies.get_policy(self.policy_id)
        generated = self.generated
        return policies.generated((generated.id, generated.revision), lambda: generated)


def _group(limit: _Limit) -> tuple[list[Policy], list[str]] | None:
    """The view's policy, or its id when no source defines it (its failure mode then
    applies with reason ``policy_unknown``, never a 500: ``docs/failures.md``); None when
    ``ENABLED`` is off."""
    if not conf.get_settings().enabled:
        return None
    try:
        return [limit.policy()], []
    except policies.UnknownPolicy:
        assert limit.policy_id is not None
        return [], [limit.policy_id]


def _check(
    request: Any, limit: _Limit, lease: Lease
) -> tuple[Outcome | None, bool, tuple[releasing.Held, ...]]:
    """Decide the view's policy: ``(refusing outcome, whether the layer ran, the
    concurrency leases it holds)``."""
    found = _group(limit)
    if found is None:
        return None, False, ()
    group, unknown = found
    decision = decide(request, group, PLAIN, limit.cost, lease=lease, unknown=unknown)
    return decision.refusing, True, decision.held


async def _acheck(
    request: Any, limit: _Limit, lease: Lease
) -> tuple[Outcome | None, bool, tuple[releasing.Held, ...]]:
    """Async twin of :func:`_check`."""
    found = _group(limit)
    if found is None:
        return None, False, ()
    group, unknown = found
    decision = await adecide(request, group, PLAIN, limit.cost, lease=lease, unknown=unknown)
    return decision.refusing, True, decision.held


def _respond(request: Any, limit: _Limit, sender: object, view: Callable[[], Any]) -> Any:
    """The view's response, or the refusal's; with the layer's headers when it ran."""
    lease = Lease()
    held: tuple[releasing.Held, ...] = ()
    try:
        refusing, ran, held = _check(request, limit, lease)
        if refusing is not None:
            response = http.problem_response(request, refusing, sender)
        else:
            response = view()
    except BaseException:
        releasing.release(held)  # the view raised: its leases go now
        raise
    finally:
        lease.end()
    response = releasing.release_after(response, held)
    return _finish(request, response) if ran else response


async def _arespond(
    request: Any, limit: _Limit, sender: object, view: Callable[[], Awaitable[Any]]
) -> Any:
    """Async twin of :func:`_respond`."""
    lease = Lease()
    held: tuple[releasing.Held, ...] = ()
    try:
        refusing, ran, held = await _acheck(request, limit, lease)
        if refusing is not None:
            response = await sync_to_async(http.problem_response)(request, refusing, sender)
        else:
            response = await view()
    except BaseException:
        await releasing.arelease(held)  # the view raised: its leases go now
        raise
    finally:
        lease.end()
    response = await releasing.arelease_after(response, held)
    return _finish(request, response) if ran else response


def _finish(request: Any, response: HttpResponse) -> HttpResponse:
    # With the middleware installed it writes the headers of every layer on the way out;
    # headers written here first would win over its own (existing headers win).
    if not middleware_installed():
        http.apply_headers(response, outcomes(request))
    return response


def _wrap_function(view: Callable[..., Any], limit: _Limit, sender: object) -> Callable[..., Any]:
    if iscoroutinefunction(view):

        @functools.wraps(view)
        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return await _arespond(request, limit, sender, lambda: view(request, *args, **kwargs))

        async_wrapper.quota_policy_id = limit.policy_id  # type: ignore[attr-defined]
        return async_wrapper

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return _respond(request, limit, sender, lambda: view(request, *args, **kwargs))

    wrapper.quota_policy_id = limit.policy_id  # type: ignore[attr-defined]
    return wrapper


def _wrap_class(view: type, limit: _Limit) -> type:
    dispatch: Callable[..., Any] = view.dispatch  # type: ignore[attr-defined]
    if getattr(view, "view_is_async", False):
        # Django's View.dispatch of an async view returns the handler's coroutine.
        @functools.wraps(dispatch)
        async def async_dispatch(self: Any, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            async def handle() -> Any:
                result = dispatch(self, request, *args, **kwargs)
                return await result if isinstance(result, Awaitable) else result

            return await _arespond(request, limit, view, handle)

        async_dispatch.quota_policy_id = limit.policy_id  # type: ignore[attr-defined]
        view.dispatch = async_dispatch  # type: ignore[attr-defined]
        return view

    @functools.wraps(dispatch)
    def sync_dispatch(self: Any, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return _respond(request, limit, view, lambda: dispatch(self, request, *args, **kwargs))

    sync_dispatch.quota_policy_id = limit.policy_id  # type: ignore[attr-defined]
    view.dispatch = sync_dispatch  # type: ignore[attr-defined]
    return view


def _declare(
    name: str, rate: str | Mapping[str, str], selector: str | Sequence[str], algorithm: str | None
) -> Policy:
    """The policy ``@quota(rate=...)`` generates for the view ``name``, declared now (no
    settings read) and registered on the first request: decorating runs at import, when
    reading settings or database policies is not allowed."""
    try:
        generated = parse_policy(
            generated_policy_id("view", name),
            {"algorithm": algorithm or SLIDING_WINDOW, "windows": rate, "selector": selector},
            source=Generated.DECORATOR,
            key=f"@quota(...) on {name}",
        )
    except ConfigurationError as exc:
        raise ImproperlyConfigured(str(exc)) from exc
    policies.declare(generated)
    return generated


def quota(
    policy: str | None = None,
    *,
    rate: str | Mapping[str, str] | None = None,
    selector: str | Sequence[str] = _DEFAULT_SELECTOR,
    algorithm: str | None = None,
    cost: Cost = 1,
) -> Callable[[ViewT], ViewT]:
    """Rate-limit a view by ``policy`` (an id), or by ``rate`` (a rate string such as
    ``"10/m"`` or a windows dict such as ``{"burst": "5/s", "sustained": "100/h"}``).

    With ``rate``, ``selector`` (default ``["auto"]``) and ``algorithm`` (default
    ``sliding_window``) complete the generated policy, whose id is
    ``view:<module>.<qualname>``. ``cost`` is an ``int >= 0`` or ``callable(request) ->
    int`` (an async view may pass an async callable). Decorating a class-based view
    wraps its ``dispatch``; the decorated view is one layer. A refused request gets the
    429 (or 503) problem response and never reaches the view.

    Raises ``TypeError`` unless exactly one of ``policy`` and ``rate`` is given, or when
    ``selector`` or ``algorithm`` come with ``policy``; ``ImproperlyConfigured`` for an
    invalid ``rate``, ``selector`` or ``algorithm`` (when decorating).
    """
    if callable(policy):
        raise TypeError("use @quota(...) with arguments, e.g. @quota(rate='10/m')")
    if (policy is None) == (rate is None):
        raise TypeError("quota() takes exactly one of policy and rate")
    if policy is not None:
        if not isinstance(policy, str):
            raise TypeError(f"policy must be a policy id, not {policy!r}")
        normalized = (selector,) if isinstance(selector, str) else tuple(selector)
        if normalized != _DEFAULT_SELECTOR or algorithm is not None:
            raise TypeError("selector and algorithm apply only with rate; the policy has its own")
    _check_cost(cost)

    def decorator(view: ViewT) -> ViewT:
        name = f"{view.__module__}.{view.__qualname__}"
        generated = None if rate is None else _declare(name, rate, selector, algorithm)
        limit = _Limit(policy, generated, cost)
        if isinstance(view, type):
            return _wrap_class(view, limit)  # type: ignore[return-value]
        return _wrap_function(view, limit, view)  # type: ignore[return-value]

    return decorator
