"""Policy definitions: validation of the dict form (settings, admin, decorators) and the
revision that isolates counters when a policy's meaning changes (``docs/policies.md``)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from django_quota.core.algorithms import ALGORITHMS as ALGORITHMS
from django_quota.core.algorithms import CONCURRENCY as CONCURRENCY
from django_quota.core.algorithms import FIXED_WINDOW as FIXED_WINDOW
from django_quota.core.algorithms import MAX_CONCURRENCY as MAX_CONCURRENCY
from django_quota.core.algorithms import SLIDING_LOG as SLIDING_LOG
from django_quota.core.algorithms import SLIDING_WINDOW as SLIDING_WINDOW
from django_quota.core.algorithms import TOKEN_BUCKET as TOKEN_BUCKET
from django_quota.core.algorithms import Window as Window
from django_quota.core.algorithms import counted_calendar as counted_calendar
from django_quota.core.algorithms import written_rate as written_rate
from django_quota.core.errors import ConfigurationError
from django_quota.core.rates import (
    Bounds,
    Grammar,
    Rate,
    check_rate_bounds,
    format_period,
    parse_rate,
)
from django_quota.core.statuses import parse_count_when
from django_quota.core.zones import parse_timezone

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Enforcement:
    """A policy's ``enforcement``: enforced, or evaluated and never refusing."""

    ENFORCE: Final = "enforce"
    SHADOW: Final = "shadow"
    VALUES: Final = (ENFORCE, SHADOW)


class Selector:
    """A policy's ``selector``: the dimensions that frame its identity (``docs/subjects.md``)."""

    #: Dimensions in the stable order in which an identity frames them.
    DIMENSIONS: Final = ("route", "tenant", "user", "api_key", "ip")
    #: Dimensions only the library's own layers use (the DRF drop-ins' ``get_cache_key()``,
    #: the django-ratelimit drop-in's ``key``).
    INTERNAL: Final = ("drf_cache_key", "ratelimit_key")
    AUTO: Final = "auto"
    VALUES: Final = (*DIMENSIONS, AUTO)
    FRAMING_ORDER: Final = (*DIMENSIONS, *INTERNAL)


class Form:
    """The rest of the dict form's vocabulary: its keys, choices, names and defaults."""

    KEYS: Final = frozenset(
        {
            "algorithm",
            "windows",
            "selector",
            "routes",
            "exempt",
            "methods",
            "enforcement",
            "failure_mode",
            "on_missing",
            "max_cost",
            "capacity",
            "enabled",
            "plans",
            "timezone",
            "count_when",
        }
    )
    FAILURE_MODES: Final = ("open", "closed")
    ON_MISSING: Final = ("deny", "skip")
    # \Z, not $: "$" also matches before a trailing newline, which would let "orders\n" pass.
    POLICY_ID_RE: Final = re.compile(r"^[a-z0-9][a-z0-9_.:-]{0,63}\Z")
    WINDOW_NAME_RE: Final = re.compile(r"^[a-z][a-z0-9_]{0,31}\Z")
    #: A plan's name (``docs/plans.md``): what ``PLAN_RESOLVER`` returns.
    PLAN_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}\Z")
    DEFAULT_WINDOW: Final = "default"
    #: The timezone of a policy without ``timezone`` when no other default is given.
    DEFAULT_TIMEZONE: Final = "UTC"




@dataclass(frozen=True, slots=True)
class Policy:
    """A validated policy. Build it with :func:`parse_policy`, or directly in library code.

    ``selector`` is in framing order (:attr:`Selector.FRAMING_ORDER`), so ``["ip", "user"]`` and
    ``["user", "ip"]`` are the same policy. ``revision`` isolates counters: it changes
    exactly when the algorithm, the selector or a window's name, limit, period or
    capacity changes.
    """

    id: str
    algorithm: str
    windows: tuple[Window, ...]
    selector: tuple[str, ...] = (Selector.AUTO,)
    routes: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    enforcement: str = Enforcement.ENFORCE
    failure_mode: str | None = None
    on_missing: str = "deny"
    max_cost: int | None = None
    #: Client networks that skip the policy (decision ``skipped``, reason ``exempt``).
    exempt: tuple[IPNetwork, ...] = ()
    enabled: bool = True
    revision: str = ""
    source: str = "settings"
    extra: Mapping[str, object] = field(default_factory=dict, compare=False, hash=False)
    timezone: str = Form.DEFAULT_TIMEZONE
    #: ``(plan name, windows)`` pairs (``docs/plans.md``): each plan's windows have the
    #: names and periods of :attr:`windows`, in that order; only limits and capacities
    #: differ, so every plan shares the policy's counter.
    plans: tuple[tuple[str, tuple[Window, ...]], ...] = ()
    #: The HTTP statuses (ints) and classes (``"2xx"``) of the responses that keep their
    #: charge (``docs/refunds.md``); None: every request counts.
    count_when: tuple[int | str, ...] | None = None

    def counts(self, status: int) -> bool:
        """Whether a response of ``status`` keeps this policy's charge (``count_when``)."""
        when = self.count_when
        return when is None or status in when or f"{status // 100}xx" in when

    def plan_windows(self, plan: str | None) -> tuple[Window, ...] | None:
        """The windows of ``plan``; None when the policy has no such plan (its own
        :attr:`windows` then apply)."""
        for name, windows in self.plans:
            if name == plan:
                return windows
        return None

    @property
    def written_windows(self) -> tuple[tuple[Window, str], ...]:
        """Each window with its rate as a person reads it (:func:`written_rate`)."""
        return tuple((window, written_rate(self.algorithm, window)) for window in self.windows)

    @property
    def written_plans(self) -> tuple[tuple[str, tuple[tuple[Window, str], ...]], ...]:
        """Each plan with its windows as :attr:`written_windows` gives them."""
        return tuple(
            (name, tuple((window, written_rate(self.algorithm, window)) for window in windows))
            for name, windows in self.plans
        )

    @property
    def shadow(self) -> bool:
        """True when the policy is evaluated but never refuses."""
        return self.enforcement == Enforcement.SHADOW

    @property
    def certainty(self) -> str:
        """``"approximate"`` for the sliding window counter, ``"exact"`` otherwise."""
        return "approximate" if self.algorithm == SLIDING_WINDOW else "exact"


def canonical_definition(algorithm: str, selector: Sequence[str], windows: Sequence[Window]) -> str:
    """The canonical JSON form of what a counter means (documented in docs/policies.md).

    Sorted keys, no whitespace, periods in milliseconds, windows in declaration order,
    ``capacity`` the effective bucket size for token buckets and ``null`` otherwise. A
    calendar window adds ``calendar`` and ``timezone``; no other window has them, so
    every policy without a calendar window keeps its revision (a one-day window in UTC
    is none: it is the epoch-aligned day).
    """
    return _canonical_json(
        {
            "algorithm": algorithm,
            "selector": list(selector),
            "windows": [_canonical_window(algorithm, window) for window in windows],
        }
    )


def _canonical_json(definition: Mapping[str, object]) -> str:
    """Sorted keys, no whitespace: the text a revision hashes."""
    return json.dumps(definition, sort_keys=True, separators=(",", ":"))


def _revision(definition: str) -> str:
    """First 8 hex characters of SHA-256 of ``definition``."""
    return hashlib.sha256(definition.encode()).hexdigest()[:8]


def _canonical_window(algorithm: str, window: Window) -> dict[str, object]:
    """One window of :func:`canonical_definition`."""
    canonical: dict[str, object] = {
        "name": window.name,
        "limit": window.limit,
        "period_ms": window.period_ms,
        "capacity": window.capacity if algorithm == TOKEN_BUCKET else None,
    }
    if window.calendar:
        canonical["calendar"] = window.calendar
        canonical["timezone"] = window.timezone
    return canonical


def _calendar_windows(
    policy_key: str,
    algorithm: str,
    timezone: str,
    windows: tuple[Window, ...],
    rates: Sequence[Rate],
) -> tuple[Window, ...]:
    """``windows`` with their calendar unit and ``timezone`` where they are calendar
    windows (fixed_window, exactly one day, week, month or year; not a day in UTC);
    :class:`ConfigurationError` for a month or a year in another algorithm."""
    result = []
    for window, rate in zip(windows, rates, strict=True):
        calendar = rate.calendar
        if calendar in Grammar.CALENDAR_ONLY and algorithm != FIXED_WINDOW:
            raise ConfigurationError(
                f"{policy_key}['windows']",
                f"a {calendar} is a calendar window: fixed_window only, not {algorithm}",
            )
        if algorithm != FIXED_WINDOW or (calendar == "day" and timezone == "UTC"):
            calendar = ""
        if calendar:
            window = Window(
                window.name, window.limit, window.period_ms, window.capacity, calendar, timezone
            )
        result.append(window)
    return tuple(result)


def settings_revision(algorithm: str, selector: Sequence[str], windows: Sequence[Window]) -> str:
    """First 8 hex characters of SHA-256 of :func:`canonical_definition`."""
    return _revision(canonical_definition(algorithm, selector, windows))


def canonical_plans_definition(
    algorithm: str, selector: Sequence[str], windows: Sequence[Window]
) -> str:
    """The canonical JSON form of what the counter of a policy with plans means: as
    :func:`canonical_definition` without limits or capacities (a plan changes them per
    request on the same counter: ``docs/plans.md``), and ``"limits": "plans"``, so that it
    never equals a policy's without plans. A calendar window keeps its ``calendar`` and
    ``timezone``."""
    shapes = []
    for window in windows:
        shape = _canonical_window(algorithm, window)
        del shape["limit"], shape["capacity"]
        shapes.append(shape)
    return _canonical_json(
        {"algorithm": algorithm, "limits": "plans", "selector": list(selector), "windows": shapes}
    )


def plans_revision(algorithm: str, selector: Sequence[str], windows: Sequence[Window]) -> str:
    """First 8 hex characters of SHA-256 of :func:`canonical_plans_definition`."""
    return _revision(canonical_plans_definition(algorithm, selector, windows))


def _parse_plans(
    policy_key: str,
    algorithm: str,
    raw_plans: object,
    windows: tuple[Window, ...],
    timezone: str,
) -> tuple[tuple[str, tuple[Window, ...]], ...]:
    """``plans``: ``{plan name: windows}``, each value shaped like ``windows``, with the
    same window names and periods, calendar windows included (``docs/plans.md``); each
    plan's windows in the order of ``windows``."""
    if raw_plans is None:
        return ()
    key = f"{policy_key}['plans']"
    if not isinstance(raw_plans, Mapping) or not raw_plans:
        raise ConfigurationError(
            key, "plans must be a non-empty dict of plan name -> windows ('100/h', or a dict)"
        )
    periods = {window.name: window for window in windows}
    plans = []
    for name, raw in raw_plans.items():
        if not isinstance(name, str) or not Form.PLAN_NAME_RE.match(name):
            raise ConfigurationError(
                key, f"plan name {name!r} must match [A-Za-z0-9][A-Za-z0-9_.:-]{{0,63}}"
            )
        plan_key = f"{key}[{name!r}]"
        if isinstance(raw, str) and set(periods) != {Form.DEFAULT_WINDOW}:
            raise ConfigurationError(
                plan_key, f"name the windows as the policy does: {', '.join(periods)}"
            )
        by_name = {
            window.name: window
            for window in _parse_windows(
                policy_key, algorithm, raw, None, timezone, windows_key=plan_key
            )
        }
        if set(by_name) != set(periods):
            raise ConfigurationError(
                plan_key,
                f"a plan has the policy's windows ({', '.join(periods)}), "
                f"not {', '.join(by_name)}",
            )
        for window_name, window in periods.items():
            planned = by_name[window_name]
            if (planned.period_ms, planned.calendar) != (window.period_ms, window.calendar):
                period = window.calendar or format_period(window.period_ms)
                raise ConfigurationError(
                    plan_key,
                    f"window {window_name!r} must keep the policy's period "
                    f"(/{period}): a plan changes limits only",
                )
        if algorithm == CONCURRENCY:  # a plan's N has the policy's bound (a lease's 2 bytes)
            check_concurrency_windows(plan_key, tuple(by_name.values()))
        plans.append((name, tuple(by_name[window.name] for window in windows)))
    return tuple(plans)


def generated_policy_id(prefix: str, name: str) -> str:
    """Build an id like ``view:<name>`` or ``drf:<scope>`` that satisfies the id grammar.

    Lower-cased; characters outside ``[a-z0-9_.:-]`` become ``_``; an id over 64
    characters is cut to 55 plus ``-`` and 8 hex characters of its SHA-256.
    """
    raw = f"{prefix}:{name}".lower()
    cleaned = re.sub(r"[^a-z0-9_.:-]", "_", raw)
    if len(cleaned) > 64:
        cleaned = cleaned[:55] + "-" + hashlib.sha256(cleaned.encode()).hexdigest()[:8]
    return cleaned


def _string_list(value: object, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigurationError(key, f"expected a list of strings, not {value!r}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, str) or not item:
            raise ConfigurationError(key, f"expected a list of non-empty strings, not {value!r}")
    return items


def parse_selector(value: object, key: str, *, allow_internal: bool = False) -> tuple[str, ...]:
    """Validate a selector list and return it in framing order."""
    if value is None:
        return (Selector.AUTO,)
    if isinstance(value, str):
        value = [value]
    dimensions = _string_list(value, key)
    allowed = (*Selector.VALUES, *Selector.INTERNAL) if allow_internal else Selector.VALUES
    if not dimensions:
        raise ConfigurationError(key, "a selector needs at least one dimension")
    for dimension in dimensions:
        if dimension not in allowed:
            raise ConfigurationError(
                key, f"unknown dimension {dimension!r}; use one of {', '.join(Selector.VALUES)}"
            )
    if len(set(dimensions)) != len(dimensions):
        raise ConfigurationError(key, f"dimension repeated in {list(dimensions)!r}")
    if Selector.AUTO in dimensions and {"user", "api_key", "ip"} & set(dimensions):
        raise ConfigurationError(
            key, "'auto' already chooses between user, api_key and ip; do not combine them"
        )
    framing = Selector.FRAMING_ORDER
    order = (*framing[: framing.index("ip") + 1], Selector.AUTO, *Selector.INTERNAL)
    return tuple(sorted(dimensions, key=order.index))


def _parse_windows(
    policy_key: str,
    algorithm: str,
    raw_windows: object,
    raw_capacity: object,
    timezone: str = Form.DEFAULT_TIMEZONE,
    *,
    windows_key: str | None = None,
) -> tuple[Window, ...]:
    key = windows_key or f"{policy_key}['windows']"
    rates: list[tuple[str, Rate]] = []
    if isinstance(raw_windows, str):
        rates.append((Form.DEFAULT_WINDOW, parse_rate(raw_windows, key)))
    elif isinstance(raw_windows, Mapping):
        if not raw_windows:
            raise ConfigurationError(key, "a policy needs at least one window")
        for name, text in raw_windows.items():
            if not isinstance(name, str) or not Form.WINDOW_NAME_RE.match(name):
                raise ConfigurationError(
                    key, f"window name {name!r} must match [a-z][a-z0-9_]{{0,31}}"
                )
            rates.append((name, parse_rate(text, f"{key}[{name!r}]")))
    else:
        raise ConfigurationError(
            key, "windows must be a rate string ('10/s') or a dict of name -> rate"
        )

    capacities: dict[str, int] = {}
    capacity_key = f"{policy_key}['capacity']"
    if raw_capacity is not None:
        if algorithm != TOKEN_BUCKET:
            raise ConfigurationError(capacity_key, "capacity applies to token_bucket only")
        names = [name for name, _ in rates]
        if isinstance(raw_capacity, Mapping):
            for name, value in raw_capacity.items():
                if name not in names:
                    raise ConfigurationError(capacity_key, f"no window named {name!r}")
                capacities[name] = _positive_int(value, f"{capacity_key}[{name!r}]")
        else:
            value = _positive_int(raw_capacity, capacity_key)
            capacities = dict.fromkeys(names, value)

    windows = []
    for name, rate in rates:
        capacity = capacities.get(name, rate.limit)
        if capacity * rate.period_ms > Bounds.MAX_PRODUCT:
            raise ConfigurationError(
                capacity_key, f"capacity x period in milliseconds exceeds 2**52 for {name!r}"
            )
        windows.append(Window(name, rate.limit, rate.period_ms, capacity))
    by_name = {window.name: window for window in windows}
    if (
        "burst" in by_name
        and "sustained" in by_name
        and by_name["burst"].period_ms >= by_name["sustained"].period_ms
    ):
        raise ConfigurationError(
            key, "the 'burst' window's period must be shorter than the 'sustained' one's"
        )
    return _calendar_windows(
        policy_key, algorithm, timezone, tuple(windows), [rate for _, rate in rates]
    )


def _positive_int(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(key, f"expected a positive integer, not {value!r}")
    return value


def _choice(value: object, choices: Sequence[str], key: str) -> str:
    if value not in choices:
        raise ConfigurationError(key, f"{value!r} is not one of {', '.join(choices)}")
    assert isinstance(value, str)
    return value


def _parse_methods(value: object, key: str) -> tuple[str, ...]:
    """HTTP method names, upper-case (raises :class:`ConfigurationError` naming ``key``)."""
    methods = _string_list(value, key)
    for method in methods:
        if method != method.upper() or not (method.isascii() and method.isalpha()):
            raise ConfigurationError(key, f"{method!r} must be upper-case, e.g. GET")
    return methods


def parse_exempt(value: object, key: str) -> tuple[IPNetwork, ...]:
    """A policy's ``exempt`` key: a list of IPv4 or IPv6 networks in CIDR notation (a bare
    address is its one-address network; host bits are dropped, as ``TRUSTED_PROXIES``
    does). Not part of the revision: who is exempt changes no counter's meaning.

    Raises :class:`ConfigurationError` naming the first entry that is not a network.
    """
    networks: list[IPNetwork] = []
    for index, entry in enumerate(_string_list(value, key)):
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ConfigurationError(
                f"{key}[{index}]",
                f"{entry!r} is not an IP network; write it in CIDR notation, e.g. "
                "'10.0.0.0/8' or '2001:db8::/32'",
            ) from None
    return tuple(networks)


def _checked_form(policy_id: object, raw: object, key: str) -> tuple[str, Mapping[str, object]]:
    """``policy_id`` and ``raw`` as a policy's id and definition (``docs/policies.md``,
    "Policy keys"): an id that :attr:`Form.POLICY_ID_RE` matches and a dict of known keys
    only (:attr:`Form.KEYS`). Raises :class:`ConfigurationError` naming ``key``."""
    if not isinstance(policy_id, str) or not Form.POLICY_ID_RE.match(policy_id):
        raise ConfigurationError(key, "a policy id must match [a-z0-9][a-z0-9_.:-]{0,63}")
    if not isinstance(raw, Mapping):
        raise ConfigurationError(key, f"a policy must be a dict, not {type(raw).__name__}")
    unknown = sorted(str(name) for name in set(raw) - Form.KEYS)
    if unknown:
        raise ConfigurationError(
            key, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(Form.KEYS))}"
        )
    return policy_id, raw


def parse_policy(
    policy_id: object,
    raw: object,
    *,
    source: str = "settings",
    default_algorithm: str = FIXED_WINDOW,
    key: str | None = None,
    allow_internal_dimensions: bool = False,
    default_timezone: str = Form.DEFAULT_TIMEZONE,
) -> Policy:
    """Validate one policy dict (``docs/policies.md``) and return the :class:`Policy`.

    ``key`` names the definition in error messages (default
    ``QUOTA['POLICIES'][<id>]``). The revision is the settings revision (8 hex
    characters); database policies replace it with their integer revision.
    ``default_timezone`` is the timezone of a policy without ``timezone``
    (``QUOTA["TIMEZONE"]``).

    Raises :class:`ConfigurationError` naming the first invalid key.
    """
    if key is None:
        key = f"QUOTA['POLICIES'][{policy_id!r}]"
    policy_id, raw = _checked_form(policy_id, raw, key)
    algorithm = _choice(raw.get("algorithm", default_algorithm), ALGORITHMS, f"{key}['algorithm']")
    if "windows" not in raw:
        raise ConfigurationError(f"{key}['windows']", "a policy needs windows")
    timezone = parse_timezone(raw.get("timezone", default_timezone), f"{key}['timezone']")
    windows = _parse_windows(key, algorithm, raw["windows"], raw.get("capacity"), timezone)
    if algorithm == CONCURRENCY:
        check_concurrency_windows(f"{key}['windows']", windows)
    selector = parse_selector(
        raw.get("selector", [Selector.AUTO]),
        f"{key}['selector']",
        allow_internal=allow_internal_dimensions,
    )
    routes = _string_list(raw.get("routes"), f"{key}['routes']")
    methods = _parse_methods(raw.get("methods", []), f"{key}['methods']")
    enforcement = _choice(
        raw.get("enforcement", Enforcement.ENFORCE), Enforcement.VALUES, f"{key}['enforcement']"
    )
    failure_mode = raw.get("failure_mode")
    if failure_mode is not None:
        failure_mode = _choice(failure_mode, Form.FAILURE_MODES, f"{key}['failure_mode']")
    on_missing = _choice(raw.get("on_missing", "deny"), Form.ON_MISSING, f"{key}['on_missing']")
    exempt = parse_exempt(raw.get("exempt"), f"{key}['exempt']")
    count_when = parse_count_when(raw.get("count_when"), f"{key}['count_when']")
    max_cost = raw.get("max_cost")
    if max_cost is not None and (
        isinstance(max_cost, bool) or not isinstance(max_cost, int) or max_cost < 0
    ):
        raise ConfigurationError(f"{key}['max_cost']", "expected a non-negative integer")
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigurationError(f"{key}['enabled']", "expected True or False")
    plans = _parse_plans(key, algorithm, raw.get("plans"), windows, timezone)
    revision = (plans_revision if plans else settings_revision)(algorithm, selector, windows)
    return Policy(
        id=policy_id,
        algorithm=algorithm,
        windows=windows,
        selector=selector,
        routes=routes,
        methods=methods,
        enforcement=enforcement,
        failure_mode=failure_mode,
        on_missing=on_missing,
        max_cost=max_cost,
        exempt=exempt,
        enabled=enabled,
        revision=revision,
        source=source,
        timezone=timezone,
        plans=plans,
        count_when=count_when,
    )


def check_concurrency_windows(key: str, windows: Sequence[Window]) -> None:
    """A concurrency policy has one window, of at most :data:`MAX_CONCURRENCY` units
    (docs/concurrency.md): its period is a lease's lifetime, so a second window would
    mean nothing. Raises :class:`ConfigurationError` naming ``key``."""
    if len(windows) != 1:
        raise ConfigurationError(
            key, "a concurrency policy has one window: 'N/P', N units in flight, leases of P"
        )
    if windows[0].limit > MAX_CONCURRENCY:
        raise ConfigurationError(
            key, f"a concurrency policy allows at most {MAX_CONCURRENCY:,} units in flight"
        )


def window_from_limit(
    name: str, limit: int, period_ms: int, capacity: int | None, key: str
) -> Window:
    """Build a window from separate numbers (the admin's form), with the same bounds."""
    check_rate_bounds(limit, period_ms, key)
    effective = capacity if capacity is not None else limit
    if effective < 1 or effective * period_ms > Bounds.MAX_PRODUCT:
        raise ConfigurationError(key, "capacity must be positive and capacity x period_ms <= 2**52")
    return Window(name, limit, period_ms, effective)
