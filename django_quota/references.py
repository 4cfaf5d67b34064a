"""Where the URLconf names policies: views decorated with ``@quota("id")`` or
``@quota(rate=...)``, and DRF views whose ``QuotaThrottle`` names policies through
``quota_policies`` or ``throttle_scope``.

The system checks (E009, E012) and the admin's delete confirmation read the same walk.
DRF's drop-in throttles build their own ``drf:<scope>`` policies and name none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from django_quota.core.policy import generated_policy_id


class Kind:
    """How a place names a policy (:attr:`Reference.kind`)."""

    DECORATOR: Final = "decorator"
    THROTTLE_LIST: Final = "quota_policies"
    THROTTLE_SCOPE: Final = "throttle_scope"


@dataclass(frozen=True, slots=True)
class Reference:
    """One place that names a policy: the URL ``route`` (as written in the URLconf), the
    dotted ``view``, how it names the policy (``kind``) and the ``policy`` id."""

    route: str
    view: str
    kind: str
    policy: str

    def describe(self) -> str:
        """``"api/items/ (app.views.items): @quota('api')"`` and the like."""
        how = {
            Kind.DECORATOR: f"@quota({self.policy!r})",
            Kind.THROTTLE_LIST: "QuotaThrottle, quota_policies",
            Kind.THROTTLE_SCOPE: "QuotaThrottle, throttle_scope",
        }[self.kind]
        return f"{self.route} ({self.view}): {how}"


@dataclass(frozen=True, slots=True)
class GeneratedView:
    """A view decorated with ``@quota(rate=...)``: its route, the dotted name its policy
    id was generated from, and that id."""

    route: str
    name: str
    policy: str


def url_patterns() -> Iterator[tuple[str, Callable[..., Any]]]:
    """(route, callback) of every URL pattern of the root URLconf, included ones too.
    Raises whatever importing the URLconf raises."""
    from django.urls import get_resolver

    yield from _walk(get_resolver().url_patterns)


def _walk(patterns: Any, prefix: str = "") -> Iterator[tuple[str, Callable[..., Any]]]:
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if hasattr(pattern, "url_patterns"):
            yield from _walk(pattern.url_patterns, route)
        else:
            yield route, pattern.callback


def _dotted(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _view_class(callback: Any) -> type | None:
    found = getattr(callback, "view_class", None) or getattr(callback, "cls", None)
    return found if isinstance(found, type) else None


def _decorated(callback: Any) -> tuple[Any, str | None] | None:
    """``(decorated view, named policy id or None for @quota(rate=...))`` when ``callback``
    is a view decorated with ``@quota``; None otherwise.

    A decorated class keeps the wrapper on the class whose ``dispatch`` was wrapped: that
    class names the generated policy, even when a subclass is routed.
    """
    view_class = _view_class(callback)
    if view_class is None:
        if hasattr(callback, "quota_policy_id"):
            return callback, callback.quota_policy_id
        return None
    # as_view() copies dispatch's attributes onto the callback: read the class instead.
    dispatch = getattr(view_class, "dispatch", None)
    if not hasattr(dispatch, "quota_policy_id"):
        return None
    owner = next(
        (klass for klass in view_class.__mro__ if klass.__dict__.get("dispatch") is dispatch),
        view_class,
    )
    return owner, dispatch.quota_policy_id  # type: ignore[union-attr]


def _throttle_references(route: str, callback: Any) -> list[Reference]:
    drf_view = getattr(callback, "cls", None)
    if drf_view is None:
        return []
    try:
        from django_quota.throttling import QuotaThrottle, SimpleRateThrottle, named_policy_ids
    except ImportError:  # DRF not installed
        return []
    found: list[Reference] = []
    for throttle in getattr(drf_view, "throttle_classes", ()):
        if not isinstance(throttle, type) or not issubclass(throttle, QuotaThrottle):
            continue
        if issubclass(throttle, SimpleRateThrottle):
            continue
        kind = Kind.THROTTLE_LIST
        if getattr(drf_view, "quota_policies", None) is None and throttle.quota_policies is None:
            kind = Kind.THROTTLE_SCOPE
        for name in named_policy_ids(drf_view, throttle.quota_policies):
            found.append(Reference(route, _dotted(drf_view), kind, name))
    return found


def policy_references() -> list[Reference]:
    """Every place in the URLconf that names a policy id, in URLconf order."""
    found: list[Reference] = []
    for route, callback in url_patterns():
        decorated = _decorated(callback)
        if decorated is not None and decorated[1] is not None:
            found.append(Reference(route, _dotted(decorated[0]), Kind.DECORATOR, decorated[1]))
        found.extend(_throttle_references(route, callback))
    return _unique(found)


def references_to(policy_ids: set[str]) -> list[Reference]:
    """The references that name one of ``policy_ids``; ``[]`` when the URLconf cannot be
    loaded (the system checks report that)."""
    try:
        return [ref for ref in policy_references() if ref.policy in policy_ids]
    except Exception:  # a broken URLconf must not break the admin page that lists these
        return []


def generated_views() -> list[GeneratedView]:
    """Views decorated with ``@quota(rate=...)`` in the URLconf, with the id of the policy
    generated for each (``view:<module>.<qualname>``)."""
    found: list[GeneratedView] = []
    for route, callback in url_patterns():
        decorated = _decorated(callback)
        if decorated is not None and decorated[1] is None:
            name = _dotted(decorated[0])
            found.append(GeneratedView(route, name, generated_policy_id("view", name)))
    return _unique(found)


def _unique(items: list[Any]) -> list[Any]:
    """``items`` without repeats (a view routed twice is one reference), order kept."""
    return list(dict.fromkeys(items))
