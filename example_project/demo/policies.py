"""The policies the example project enforces, as the demo replays them, and which of them
the middleware applies to a request."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from example_project.demo import SetupError

_RATE_RE = re.compile(
    r"^\s*(?P<limit>\d+)\s*/\s*(?P<mult>\d*)\s*(?P<unit>s|sec|m|min|h|hour|d|day)\s*$"
)
# DRF's syntax: a count, "/", then a period of which only the first letter counts
# ("3/second"), optionally preceded by a multiplier and a hyphen ("8/4s", "1/2-sec").
_DRF_RATE_RE = re.compile(r"^(?P<limit>\d+)/(?:(?P<mult>\d+)-?)?(?P<unit>[smhd])")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


@dataclass(frozen=True, slots=True)
class Window:
    name: str
    limit: int
    period_ms: int

    def start(self, now_ms: int) -> int:
        return now_ms - now_ms % self.period_ms

    def describe(self) -> str:
        seconds = self.period_ms / 1000
        return f"{self.name} {self.limit}/{seconds:g}s"


@dataclass(frozen=True, slots=True)
class Policy:
    """A fixed-window policy as the demo replays it."""

    id: str
    windows: tuple[Window, ...]
    selector: tuple[str, ...]
    origin: str
    """Where it is configured."""
    routes: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    shadow: bool = False

    @property
    def periods_ms(self) -> tuple[int, ...]:
        return tuple(sorted({w.period_ms for w in self.windows}))

    def item_names(self) -> list[str]:
        """The structured-field item names of its windows in the rate-limit headers."""
        if len(self.windows) == 1 and self.windows[0].name == "default":
            return [self.id]
        return [f"{self.id}.{w.name}" for w in self.windows]

    def policy_header_items(self) -> list[str]:
        """Its items of ``RateLimit-Policy`` (draft -10: ``"name";q=limit;w=seconds``)."""
        return [
            f'"{name}";q={w.limit};w={round(w.period_ms / 1000)}'
            for name, w in zip(self.item_names(), self.windows, strict=True)
        ]

    def describe(self) -> str:
        windows = ", ".join(w.describe() for w in self.windows)
        where = ""
        if self.routes:
            methods = ",".join(self.methods) or "all methods"
            where = f" routes={list(self.routes)} ({methods})"
        shadow = " SHADOW" if self.shadow else ""
        return (
            f"{self.id}:{shadow} fixed_window [{windows}] selector={list(self.selector)}"
            f"{where}; from {self.origin}"
        )


def parse_rate(rate: str) -> tuple[int, int]:
    """Return (limit, period in ms) of a settings rate such as ``"5/s"`` or ``"12/3s"``."""
    match = _RATE_RE.match(rate)
    if match is None:
        raise SetupError(f"cannot parse rate {rate!r}")
    mult = int(match["mult"] or 1)
    return int(match["limit"]), mult * _UNIT_MS[match["unit"][0]]


def parse_drf_rate(rate: str) -> tuple[int, int]:
    """Return (limit, period in ms) of a DRF throttle rate such as ``"3/second"``."""
    match = _DRF_RATE_RE.match(rate.strip()) if isinstance(rate, str) else None
    if match is None:
        raise SetupError(f"cannot parse DRF throttle rate {rate!r}")
    mult = int(match["mult"] or 1)
    return int(match["limit"]), mult * _UNIT_MS[match["unit"]]


def _windows(raw: str | Mapping[str, str], parse: Any = parse_rate) -> tuple[Window, ...]:
    items = {"default": raw} if isinstance(raw, str) else dict(raw)
    return tuple(Window(name, *parse(rate)) for name, rate in items.items())


def load_policies(settings_module: Any, limits_module: Any) -> dict[str, Policy]:
    """Every policy the example project enforces, read from the very modules it loads:
    ``QUOTA["POLICIES"]``, the DRF drop-ins' ``DEFAULT_THROTTLE_RATES`` and the rate of
    the ``@quota`` view (``shop/limits.py``)."""
    quota: Mapping[str, Any] = getattr(settings_module, "QUOTA", {})
    policies = _configured_policies(quota)
    _add_drf_policies(policies, quota, settings_module)
    export_id = limits_module.EXPORT_POLICY_ID
    policies.setdefault(
        export_id,
        Policy(
            id=export_id,
            windows=_windows(limits_module.EXPORT_RATE),
            selector=("ip",),
            origin="@quota(rate=EXPORT_RATE, cost=?size) in shop/views.py",
        ),
    )
    return policies


def _configured_policies(quota: Mapping[str, Any]) -> dict[str, Policy]:
    """Read ``QUOTA["POLICIES"]``, every one of which must be a fixed window."""
    policies: dict[str, Policy] = {}
    for policy_id, spec in quota.get("POLICIES", {}).items():
        if spec.get("algorithm") != "fixed_window":
            raise SetupError(f"policy {policy_id}: the demo can only check fixed_window")
        policies[policy_id] = Policy(
            id=policy_id,
            windows=_windows(spec["windows"]),
            selector=tuple(spec.get("selector", ["auto"])),
            origin="QUOTA['POLICIES']",
            routes=tuple(spec.get("routes") or ()),
            methods=tuple(spec.get("methods") or ()),
            shadow=spec.get("enforcement", "enforce") == "shadow",
        )
    return policies


def _add_drf_policies(
    policies: dict[str, Policy], quota: Mapping[str, Any], settings_module: Any
) -> None:
    """Add the ``drf:<scope>`` policies the drop-in throttles generate."""
    # The drop-in throttles generate drf:<scope> with QUOTA["DRF_ALGORITHM"]; only fixed
    # windows can be replayed exactly (see the comment in settings.py).
    if quota.get("DRF_ALGORITHM") != "fixed_window":
        raise SetupError("the demo needs QUOTA['DRF_ALGORITHM'] = 'fixed_window'")
    rates = getattr(settings_module, "REST_FRAMEWORK", {}).get("DEFAULT_THROTTLE_RATES", {})
    for scope, selector in (("anon", ("ip",)), ("user", ("auto",))):
        policy_id = f"drf:{scope}"
        if policy_id in policies:
            continue  # a configured policy with the generated id replaces it
        if not rates.get(scope):
            raise SetupError(f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] lacks {scope!r}")
        policies[policy_id] = Policy(
            id=policy_id,
            windows=_windows(rates[scope], parse_drf_rate),
            selector=selector,
            origin=f"DEFAULT_THROTTLE_RATES[{scope!r}]",
        )


def path_matches(prefix: str, path: str) -> bool:
    """Whole-segment prefix match, as the middleware's ``routes`` entries match."""
    base = prefix.rstrip("/")
    return prefix == "/" or path == base or path.startswith(base + "/")


def route_matches(route: str, path: str) -> bool:
    if route == "*":
        return True
    if not route.startswith("/"):
        raise SetupError(f"the demo matches path routes only, not {route!r}")
    return path_matches(route, path)


def middleware_policies(policies: Mapping[str, Policy], method: str, path: str) -> set[str]:
    """The ids of the policies ``QuotaMiddleware`` applies to ``method path``."""
    return {
        p.id
        for p in policies.values()
        if p.routes
        and (not p.methods or method in p.methods)
        and any(route_matches(route, path) for route in p.routes)
    }
