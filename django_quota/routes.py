"""Which routes a request takes: the middleware's ``routes`` and ``methods`` matching, and
the ``route`` dimension (``docs/http.md``).

A path is resolved at most once per request: Django's ``request.resolver_match`` once it
is set (inside the view), else resolved here and kept where the caller keeps it (the
request's ledger, ``request._quota``)."""

from __future__ import annotations

from typing import Protocol

from django.http import HttpRequest
from django.urls import Resolver404, ResolverMatch, resolve

from django_quota.core.policy import Policy

#: The kept route of a path that does not resolve (None: not looked up yet).
_UNRESOLVED = object()


class Kept(Protocol):
    """Where a request's resolved route is kept (a ``RequestLedger``)."""

    route: object


def resolver_match(request: HttpRequest, kept: Kept | None = None) -> ResolverMatch | None:
    """``request.resolver_match``, or the path resolved once (honouring ``request.urlconf``)
    and kept in ``kept``."""
    match = getattr(request, "resolver_match", None)
    if match is not None:
        return match  # type: ignore[no-any-return]
    cached = None if kept is None else kept.route
    if cached is None:
        try:
            cached = resolve(request.path_info, urlconf=getattr(request, "urlconf", None))
        except Resolver404:
            cached = _UNRESOLVED
        if kept is not None:
            kept.route = cached
    return cached if isinstance(cached, ResolverMatch) else None


def path_matches(prefix: str, path: str) -> bool:
    """Whole-segment prefix match: ``/api`` matches ``/api`` and ``/api/x``, not ``/apiary``."""
    if prefix == "/":
        return True
    base = prefix.rstrip("/")
    return path == base or path.startswith(base + "/")


def route_matches(route: str, request: HttpRequest, kept: Kept | None = None) -> bool:
    """Whether one ``routes`` entry (``*``, ``/prefix``, ``ns:*`` or a view name) applies."""
    if route == "*":
        return True
    if route.startswith("/"):
        return path_matches(route, request.path_info)
    match = resolver_match(request, kept)
    if match is None:
        return False
    if route.endswith(":*"):
        namespace = route[:-2]
        return match.namespace == namespace or match.namespace.startswith(namespace + ":")
    return match.view_name == route


def policy_applies(policy: Policy, request: HttpRequest, kept: Kept | None = None) -> bool:
    """Whether the middleware applies ``policy`` to ``request`` (routes and methods)."""
    if policy.methods and request.method not in policy.methods:
        return False
    return any(route_matches(route, request, kept) for route in policy.routes)


def route_value(request: HttpRequest, kept: Kept | None = None) -> str:
    """The ``route`` dimension: view name, else the route pattern, else ``-``."""
    match = resolver_match(request, kept)
    if match is None:
        return "-"
    if match.url_name is None:
        # Django's view_name of an unnamed URL is the view's dotted path, not a route name.
        return match.route or "-"
    return match.view_name or "-"
