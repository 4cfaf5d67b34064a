"""What the demo sends where: the example's endpoints, the surfaces of django-quota they
exercise, and the clients, each with the layers of policies that decide its requests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from example_project.demo import SetupError
from example_project.demo.policies import Policy, middleware_policies


@dataclass(frozen=True, slots=True)
class Action:
    method: str
    path: str
    success: int

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"


LIST = Action("GET", "/api/items/", 200)
CREATE = Action("POST", "/api/items/", 201)
SEARCH = Action("GET", "/api/search/", 200)
CATALOG = Action("GET", "/api/catalog/", 200)
ME = Action("GET", "/api/me/", 200)
ORDERS = Action("GET", "/api/orders/", 200)
EXPORT = Action("GET", "/api/export/", 200)
SEARCH_TERMS = ("mug", "tea", "coffee", "cup", "grinder", "")
STATS_PATH = "/api/quota-stats/"


@dataclass(frozen=True, slots=True)
class Surface:
    """One way django-quota meets a request, and what its refusals look like."""

    name: str
    refusal: str | None
    """``problem`` (problem+json), ``drf`` (DRF's Throttled body) or None (never refuses)."""
    about: str
    middleware: bool = False
    """Its policies are the middleware's (checked against the routes in settings)."""


MIDDLEWARE = Surface(
    "middleware",
    "problem",
    "QuotaMiddleware applies the QUOTA policies whose routes match; the views know nothing",
    middleware=True,
)
SHADOW = Surface(
    "shadow",
    None,
    "QuotaMiddleware, a policy with enforcement 'shadow': decided and counted, never "
    "refusing, no headers; the view reports the decision in its body",
    middleware=True,
)
DROP_IN = Surface(
    "DRF drop-in",
    "drf",
    "django_quota.throttling.AnonRateThrottle + UserRateThrottle on a DRF view, rates from "
    "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] (DRF asks both throttles on every request)",
)
QUOTA_THROTTLE = Surface(
    "QuotaThrottle",
    "drf",
    "django_quota.throttling.QuotaThrottle on a DRF view with quota_policies = ['orders'] "
    "(burst and sustained windows, per DRF user; Token authentication)",
)
DECORATOR = Surface(
    "@quota",
    "problem",
    "@quota(rate={burst, sustained}, selector=('ip',), algorithm='fixed_window', "
    "cost=?size) on a plain Django view",
)
SURFACES = (MIDDLEWARE, SHADOW, DROP_IN, QUOTA_THROTTLE, DECORATOR)


@dataclass(frozen=True, slots=True)
class ClientSpec:
    name: str
    surface: Surface
    actions: tuple[Action, ...]
    layers: tuple[tuple[str, ...], ...]
    """Policy ids decided for each request, one group per layer, in evaluation order."""
    interval: float
    """Mean pause between two requests, in seconds."""
    polite: bool = False
    """Wait for Retry-After after a 429 instead of retrying at once."""
    user: str | None = None
    """Authenticate as this user with their DRF token."""
    sizes: tuple[int, ...] = ()
    """``?size=`` values (the request's cost) drawn at random."""

    @property
    def policy_ids(self) -> tuple[str, ...]:
        return tuple(pid for layer in self.layers for pid in layer)


EXPORT_POLICY = "view:example_project.shop.views.export"  # checked against shop/limits.py
USERS = ("alice", "bob", "carol", "dave")

CLIENT_SPECS: tuple[ClientSpec, ...] = (
    ClientSpec("items-list-a", MIDDLEWARE, (LIST,), (("api-items",),), 0.05),
    ClientSpec("items-list-b", MIDDLEWARE, (LIST,), (("api-items",),), 0.09),
    ClientSpec("items-create", MIDDLEWARE, (CREATE,), (("api-items",),), 0.07),
    ClientSpec("items-mixed", MIDDLEWARE, (LIST, CREATE), (("api-items",),), 0.06),
    ClientSpec("items-polite", MIDDLEWARE, (LIST,), (("api-items",),), 0.05, polite=True),
    ClientSpec("search-a", MIDDLEWARE, (SEARCH,), (("api-search",),), 0.06),
    ClientSpec("search-b", MIDDLEWARE, (SEARCH,), (("api-search",),), 0.12),
    ClientSpec("search-polite", MIDDLEWARE, (SEARCH,), (("api-search",),), 0.05, polite=True),
    ClientSpec("catalog-a", SHADOW, (CATALOG,), (("api-catalog",),), 0.05),
    ClientSpec("catalog-b", SHADOW, (CATALOG,), (("api-catalog",),), 0.1),
    ClientSpec("me-anon", DROP_IN, (ME,), (("drf:anon",), ("drf:user",)), 0.07),
    ClientSpec("me-alice", DROP_IN, (ME,), (("drf:user",),), 0.08, user="alice"),
    ClientSpec("me-bob", DROP_IN, (ME,), (("drf:user",),), 0.06, polite=True, user="bob"),
    ClientSpec("orders-carol", QUOTA_THROTTLE, (ORDERS,), (("orders",),), 0.07, user="carol"),
    ClientSpec(
        "orders-dave", QUOTA_THROTTLE, (ORDERS,), (("orders",),), 0.06, polite=True, user="dave"
    ),
    ClientSpec("export-a", DECORATOR, (EXPORT,), ((EXPORT_POLICY,),), 0.06, sizes=(1, 2, 3)),
    ClientSpec("export-b", DECORATOR, (EXPORT,), ((EXPORT_POLICY,),), 0.1, sizes=(3,)),
    ClientSpec(
        "export-polite",
        DECORATOR,
        (EXPORT,),
        ((EXPORT_POLICY,),),
        0.06,
        polite=True,
        sizes=(1, 2, 3),
    ),
)


def check_clients(known: Mapping[str, Policy], limits_module: Any) -> None:
    """Refuse to run when a client's declared layers are not what the server applies."""
    if limits_module.EXPORT_POLICY_ID != EXPORT_POLICY:
        raise SetupError(
            f"shop/limits.py names the @quota policy {limits_module.EXPORT_POLICY_ID!r}, "
            f"the demo {EXPORT_POLICY!r}"
        )
    for spec in CLIENT_SPECS:
        missing = [pid for pid in spec.policy_ids if pid not in known]
        if missing:
            raise SetupError(f"{spec.name}: unknown policies {missing}")
        for action in spec.actions:
            applied = middleware_policies(known, action.method, action.path)
            declared = set(spec.layers[0]) if spec.surface.middleware else set()
            if applied != declared or (spec.surface.middleware and len(spec.layers) != 1):
                raise SetupError(
                    f"{spec.name}: the middleware applies {sorted(applied)} to {action.label}, "
                    f"the demo expects {sorted(declared)}"
                )
        shadow = any(known[pid].shadow for pid in spec.policy_ids)
        if shadow != (spec.surface.refusal is None):
            raise SetupError(f"{spec.name}: a shadow surface must have only shadow policies")
