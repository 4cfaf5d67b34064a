"""Run the example project under gunicorn, load every HTTP surface over TCP and check
every quota decision.

``python -m example_project.demo`` (or ``scripts/demo``):

1. migrates the SQLite database, seeds a few items and the API users (DRF tokens);
2. starts ``gunicorn example_project.wsgi`` on a free port of 127.0.0.1: one worker with the
   memory backend (``REDIS_URL`` unset; its counters live in one process), or ``--workers``
   (default 3) with Redis, under a fresh ``QUOTA["KEY_PREFIX"]`` so that no two runs share
   a counter and nothing else in Redis is touched;
3. runs concurrent HTTP clients for ``--seconds``, each bound to its own loopback source
   address (127.0.0.2, 127.0.0.3, ...), so that each is a distinct ``ip`` subject, against
   every surface django-quota has: ``QuotaMiddleware`` (enforced and shadow policies), the
   DRF drop-in ``AnonRateThrottle``/``UserRateThrottle``, ``QuotaThrottle`` and ``@quota``
   (with a cost that depends on the request);
4. replays what each client sent through the fixed-window arithmetic (docs/arithmetic.md)
   and compares, request by request, what the server decided with what it had to decide;
5. asks every worker for its decision counts (``GET /api/quota-stats/``) and compares their
   sum, policy by policy, with the replay.

What it prints fits in 100 columns: a table per client, one of each client's source address
and policies, one of the server's counters, each with a legend of its columns under it.
``--verbose`` adds one sample per surface of the rate-limit headers and of a 429 body (the
server's own lines, as long as they are).

Why the expected counts are exact: fixed windows are aligned to the Unix epoch and the
server and the clients read the same clock. A client never sends a request while a
boundary of one of its policies' windows is nearer than ``--guard-ms``, so a request's
[send, receive] interval normally lies inside one window of every period, and wherever in
that interval the server read its clock, it counted the request in the windows the client
computes from the send time. If an interval straddles a boundary anyway (a slow response),
the request is *ambiguous*: the replay then follows each possible window assignment that
yields the status actually observed (one of them is what the server did, if it is right),
and the client passes when one such path explains every response. A request the server
must have decided differently in every path is a mismatch.

What a request costs, and what it is charged to:

- a layer is one backend call deciding a group of policies together: the middleware's
  matching policies, one DRF throttle, one ``@quota``. A group's windows are charged only
  if each of its enforced policies admits the request (``count + cost <= limit`` in every
  window); a shadow policy is then charged if it admits too, and it never refuses;
- DRF asks every throttle of a view even after one refused (its loop), so each throttle
  charges on its own: an anonymous caller of ``/api/me/`` is counted by ``drf:user`` on
  requests that ``drf:anon`` refuses;
- ``@quota`` on ``/api/export/`` charges ``?size=`` (1 to 3) to both windows.

Exit status: 0 when every client matches; 1 on a mismatch, a 5xx, any status other than
the endpoint's success status or 429, a malformed 429, wrong rate-limit headers, a 429 on
the shadow policy's route, server counts that contradict the replay, or a transport
error; 2 when the demo could not be set up.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import itertools
import json
import math
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
from requests.adapters import HTTPAdapter

REPO_DIR = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DEFAULT_SETTINGS_MODULE = "example_project.settings"
LIMITS_MODULE = "example_project.shop.limits"
GUNICORN_LOG = REPO_DIR / "var" / "demo-gunicorn.log"

CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 5.0
STARTUP_TIMEOUT = 45.0
STOP_TIMEOUT = 15.0
COMMAND_TIMEOUT = 120.0
STATS_TIMEOUT = 15.0
#: Columns of the default output: every line it prints fits in this many.
WIDTH = 100

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_SETUP = 2

QUOTA_EXCEEDED_TYPE = "https://iana.org/assignments/http-problem-types#quota-exceeded"
DRF_THROTTLED_PREFIX = "Request was throttled"
ALLOWED = "allowed"
DENIED = "denied"
SHADOW_DENIED = "shadow_denied"

_RATE_RE = re.compile(
    r"^\s*(?P<limit>\d+)\s*/\s*(?P<mult>\d*)\s*(?P<unit>s|sec|m|min|h|hour|d|day)\s*$"
)
# DRF's syntax: a count, "/", then a period of which only the first letter counts
# ("3/second"), optionally preceded by a multiplier and a hyphen ("8/4s", "1/2-sec").
_DRF_RATE_RE = re.compile(r"^(?P<limit>\d+)/(?:(?P<mult>\d+)-?)?(?P<unit>[smhd])")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class SetupError(Exception):
    """The demo could not be set up (reported with exit status 2)."""


# --------------------------------------------------------------------------- policies


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


# --------------------------------------------------------------------------- clients


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


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it; times are epoch milliseconds."""

    action: Action
    send_ms: int
    """Clock read before sending, floored."""
    recv_ms: int
    """Clock read after the whole response arrived, rounded up."""
    status: int
    """HTTP status, or 0 for a transport error."""
    retry_after: str | None
    content_type: str
    error: str | None = None
    ratelimit: str | None = None
    ratelimit_policy: str | None = None
    cost: int = 1
    body: str = ""
    """The start of the body (429s and the shadow route's answers)."""
    decisions: tuple[tuple[str, str], ...] | None = None
    """(policy, decision) the view reported for this request (the shadow route), if any."""


@dataclass(slots=True)
class Client:
    spec: ClientSpec
    source_ip: str
    token: str | None = None
    samples: list[Sample] = field(default_factory=list)
    crashed: str | None = None


class SourceAddressAdapter(HTTPAdapter):
    """Open every connection from one local address (so the server sees that REMOTE_ADDR)."""

    def __init__(self, source_ip: str, **kwargs: Any) -> None:
        self._source_address = (source_ip, 0)
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["source_address"] = self._source_address
        super().init_poolmanager(*args, **kwargs)


def make_session(source_ip: str) -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # never route loopback traffic through a configured proxy
    adapter = SourceAddressAdapter(source_ip, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def now_floor_ms() -> int:
    return time.time_ns() // 1_000_000


def now_ceil_ms() -> int:
    return -(-time.time_ns() // 1_000_000)


def wait_clear_of_boundaries(
    periods_ms: Sequence[int], guard_ms: int, stop: threading.Event
) -> None:
    """Sleep until no window boundary of ``periods_ms`` is within ``guard_ms`` from now."""
    while not stop.is_set():
        now = now_floor_ms()
        next_boundary = min(now - now % p + p for p in periods_ms)
        if next_boundary - now > guard_ms:
            return
        stop.wait((next_boundary + 5 - now) / 1000)


def run_client(
    client: Client,
    base_url: str,
    periods_ms: Sequence[int],
    guard_ms: int,
    start_at: float,
    end_at: float,
    seed: int,
    stop: threading.Event,
) -> None:
    rng = random.Random(seed)
    session = make_session(client.source_ip)
    if client.token is not None:
        session.headers["Authorization"] = f"Token {client.token}"
    try:
        stop.wait(max(0.0, start_at - time.time()))
        turn = 0
        while not stop.is_set():
            wait_clear_of_boundaries(periods_ms, guard_ms, stop)
            if stop.is_set() or time.time() >= end_at:
                break
            action = client.spec.actions[turn % len(client.spec.actions)]
            cost = rng.choice(client.spec.sizes) if client.spec.sizes else 1
            sample = send(session, base_url, action, client.spec.name, turn, cost, rng)
            client.samples.append(sample)
            turn += 1
            pause = rng.uniform(0.5, 1.5) * client.spec.interval
            if client.spec.polite and sample.status == 429 and sample.retry_after:
                with contextlib.suppress(ValueError):
                    pause = max(pause, float(sample.retry_after))
            stop.wait(max(0.0, min(pause, end_at - time.time())))
    except Exception as exc:  # reported in the table: a crashed client fails the run
        client.crashed = f"{type(exc).__name__}: {exc}"
    finally:
        session.close()


def send(
    session: requests.Session,
    base_url: str,
    action: Action,
    client_name: str,
    turn: int,
    cost: int,
    rng: random.Random,
) -> Sample:
    kwargs: dict[str, Any] = {"timeout": (CONNECT_TIMEOUT, READ_TIMEOUT)}
    if action is CREATE:
        kwargs["json"] = {"name": f"{client_name} #{turn}", "price": rng.randint(100, 9999)}
    elif action is SEARCH:
        kwargs["params"] = {"q": rng.choice(SEARCH_TERMS)}
    elif action is EXPORT:
        kwargs["params"] = {"size": cost}
    send_ms = now_floor_ms()
    try:
        response = session.request(action.method, base_url + action.path, **kwargs)
    except requests.RequestException as exc:
        return Sample(
            action, send_ms, now_ceil_ms(), 0, None, "", f"{type(exc).__name__}", cost=cost
        )
    recv_ms = now_ceil_ms()
    headers = response.headers
    body = ""
    decisions = None
    if response.status_code == 429 or action is CATALOG:
        body = response.text[:1500]
    if action is CATALOG and response.status_code == 200:
        decisions = reported_decisions(response)
    return Sample(
        action=action,
        send_ms=send_ms,
        recv_ms=recv_ms,
        status=response.status_code,
        retry_after=headers.get("Retry-After"),
        content_type=headers.get("Content-Type", ""),
        ratelimit=headers.get("RateLimit"),
        ratelimit_policy=headers.get("RateLimit-Policy"),
        cost=cost,
        body=body,
        decisions=decisions,
    )


def reported_decisions(response: requests.Response) -> tuple[tuple[str, str], ...] | None:
    """The ``quota`` list of the catalog's body as (policy, decision) pairs."""
    try:
        found = response.json()["quota"]
        return tuple((str(item["policy"]), str(item["decision"])) for item in found)
    except (ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------- replay

State = tuple[tuple[int, ...], tuple[int, ...]]
"""One policy's counters for one client: each window's start and count."""


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    starts: tuple[int, ...]
    before: tuple[int, ...]
    """Each window's count for ``starts`` before this request."""
    counts: tuple[int, ...]
    """Each window's count after charging this request (only applied when charged)."""
    retry_after_ms: int | None


def decide(windows: Sequence[Window], state: State, now_ms: int, cost: int) -> Decision:
    """Decide one request of ``cost`` at ``now_ms`` on a fixed-window policy
    (docs/arithmetic.md): admitted iff ``count + cost <= limit`` in every window; a
    denial's retry_after is the latest end of a denying window."""
    starts, counts = state
    new_starts = tuple(w.start(now_ms) for w in windows)
    current = tuple(
        count if start == new_start else 0
        for count, start, new_start in zip(counts, starts, new_starts, strict=True)
    )
    denying = [
        (w, start)
        for w, start, count in zip(windows, new_starts, current, strict=True)
        if count + cost > w.limit
    ]
    charged = tuple(c + cost for c in current)
    if denying:
        retry_ms = max(start + w.period_ms - now_ms for w, start in denying)
        return Decision(False, new_starts, current, charged, retry_ms)
    return Decision(True, new_starts, current, charged, None)


@dataclass(frozen=True, slots=True)
class Step:
    """One request through every layer of a client."""

    allowed: bool
    states: tuple[State, ...]
    charged: tuple[int, ...]
    """Per policy: 1 when charged (its outcome was ``allowed``)."""
    decisions: tuple[str, ...]
    """Per policy: ``allowed``, ``denied`` or ``shadow_denied``."""
    retry_after_ms: int | None


@dataclass(frozen=True, slots=True)
class Replay:
    """A client's policies and layers, as indexes into ``policies``."""

    policies: tuple[Policy, ...]
    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, spec: ClientSpec, known: Mapping[str, Policy]) -> Replay:
        ids = list(dict.fromkeys(spec.policy_ids))
        return cls(
            tuple(known[pid] for pid in ids),
            tuple(tuple(ids.index(pid) for pid in layer) for layer in spec.layers),
        )

    @property
    def windows(self) -> list[Window]:
        return [w for p in self.policies for w in p.windows]

    def initial(self) -> tuple[State, ...]:
        return tuple(
            (tuple(-1 for _ in p.windows), tuple(0 for _ in p.windows)) for p in self.policies
        )

    def step(self, states: tuple[State, ...], times: Sequence[int], cost: int) -> Step:
        """Decide the layers in order, the i-th at ``times[i]``. A layer charges its
        group only if each enforced policy admits (a shadow policy of the group then
        only if it admits too; it never refuses). Every layer is asked, as DRF asks every
        throttle (the example has no middleware layer in front of another one)."""
        new = list(states)
        charged = [0] * len(self.policies)
        decisions = [""] * len(self.policies)
        allowed = True
        retry: int | None = None
        for layer, now_ms in zip(self.layers, times, strict=True):
            found = {i: decide(self.policies[i].windows, new[i], now_ms, cost) for i in layer}
            group_ok = all(d.allowed for i, d in found.items() if not self.policies[i].shadow)
            for i, d in found.items():
                charge = group_ok and d.allowed
                new[i] = (d.starts, d.counts if charge else d.before)
                charged[i] = int(charge)
                if d.allowed:
                    decisions[i] = ALLOWED
                elif self.policies[i].shadow:
                    decisions[i] = SHADOW_DENIED
                else:
                    decisions[i] = DENIED
                    retry = max(retry or 0, d.retry_after_ms or 0)
            allowed = allowed and group_ok
        return Step(allowed, tuple(new), tuple(charged), tuple(decisions), retry)


def retry_after_header(retry_ms: int) -> int:
    return max(1, math.ceil(retry_ms / 1000))


def boundaries_within(windows: Sequence[Window], lo_ms: int, hi_ms: int) -> list[int]:
    """Return every window boundary b with lo_ms < b <= hi_ms."""
    found: set[int] = set()
    for w in windows:
        b = w.start(lo_ms) + w.period_ms
        while b <= hi_ms:
            found.add(b)
            b += w.period_ms
    return sorted(found)


@dataclass(frozen=True, slots=True)
class Branch:
    states: tuple[State, ...]
    charged: tuple[int, ...]
    """Per policy: requests charged so far (the server's ``allowed`` outcomes)."""
    refused: tuple[int, ...]
    """Per policy: ``denied`` or ``shadow_denied`` outcomes so far."""
    admitted: int
    mismatches: int


@dataclass(slots=True)
class Verdict:
    sent: int = 0
    successes: int = 0
    denied: int = 0
    first_retry_after: str | None = None
    admitted: int = 0
    expected: int = 0
    ambiguous: int = 0
    decision_mismatches: int = 0
    bad_statuses: dict[str, int] = field(default_factory=dict)
    bad_429s: int = 0
    bad_retry_after: int = 0
    bad_headers: int = 0
    shadow_refusals: int = 0
    shadow_unreported: int = 0
    crashed: str | None = None
    unknown: int = 0
    """Requests whose outcome the client does not know (transport errors, odd statuses)."""
    charged: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per policy: the (fewest, most) ``allowed`` outcomes of the paths that explain
    every response (one number unless requests were ambiguous)."""
    refused: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per policy: likewise for ``denied``/``shadow_denied`` outcomes."""
    reported: dict[str, int] = field(default_factory=dict)
    """Per shadow policy: the ``shadow_denied`` decisions the view reported."""

    @property
    def ok(self) -> bool:
        return not (
            self.decision_mismatches
            or self.bad_statuses
            or self.bad_429s
            or self.bad_retry_after
            or self.bad_headers
            or self.shadow_refusals
            or self.shadow_unreported
            or self.crashed
            or self.admitted != self.expected
        )

    def problems(self) -> list[str]:
        found: list[str] = []
        if self.admitted != self.expected:
            found.append(f"admitted {self.admitted}, expected {self.expected}")
        if self.decision_mismatches:
            found.append(f"{self.decision_mismatches} decision(s) differ from the replay")
        for status, n in sorted(self.bad_statuses.items()):
            found.append(f"{n} response(s) with status {status}")
        if self.bad_429s:
            found.append(f"{self.bad_429s} 429(s) without Retry-After or the surface's body")
        if self.bad_retry_after:
            found.append(f"{self.bad_retry_after} Retry-After value(s) off the fixed window")
        if self.bad_headers:
            found.append(f"{self.bad_headers} response(s) with wrong RateLimit-Policy headers")
        if self.shadow_refusals:
            found.append(f"{self.shadow_refusals} 429(s) on a route only a shadow policy limits")
        if self.shadow_unreported:
            found.append(f"{self.shadow_unreported} response(s) without the shadow decision")
        if self.crashed:
            found.append(f"client crashed: {self.crashed}")
        return found


MAX_BRANCHES = 512


def expected_policy_header(replay: Replay) -> str | None:
    """``RateLimit-Policy`` of every response: the enforced policies' items, in the order
    their layers recorded them (shadow policies never have headers)."""
    items = [item for p in replay.policies if not p.shadow for item in p.policy_header_items()]
    return ", ".join(items) or None


def check_refusal_body(surface: Surface, replay: Replay, sample: Sample) -> bool:
    """Whether a 429 has ``Retry-After`` and the body its surface promises: problem+json
    naming one of the client's enforced policies (never a shadow one), or DRF's
    ``Throttled``."""
    if not sample.retry_after:
        return False
    try:
        body = json.loads(sample.body)
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    if surface.refusal == "problem":
        enforced = {p.id for p in replay.policies if not p.shadow}
        items = {n for p in replay.policies if not p.shadow for n in p.item_names()}
        violated = body.get("violated-policies")
        return (
            "application/problem+json" in sample.content_type
            and body.get("type") == QUOTA_EXCEEDED_TYPE
            and body.get("status") == 429
            and body.get("policy") in enforced
            and isinstance(violated, list)
            and bool(violated)
            and set(violated) <= items
        )
    if surface.refusal == "drf":
        detail = body.get("detail")
        return (
            sample.content_type.startswith("application/json")
            and isinstance(detail, str)
            and detail.startswith(DRF_THROTTLED_PREFIX)
        )
    return False


def judge(known: Mapping[str, Policy], client: Client) -> Verdict:
    """Replay a client's requests through its layers' windows and compare the outcomes."""
    spec = client.spec
    replay = Replay.of(spec, known)
    windows = replay.windows
    shadow_ids = {i: p.id for i, p in enumerate(replay.policies) if p.shadow}
    policy_header = expected_policy_header(replay)
    zeros = tuple(0 for _ in replay.policies)
    verdict = Verdict(sent=len(client.samples), crashed=client.crashed)
    verdict.reported = {pid: 0 for pid in shadow_ids.values()}
    branches = {Branch(replay.initial(), zeros, zeros, 0, 0)}
    for sample in client.samples:
        observed_allowed = sample.status == sample.action.success
        observed_denied = sample.status == 429
        known_status = observed_allowed or observed_denied
        if observed_allowed:
            verdict.successes += 1
        elif observed_denied:
            verdict.denied += 1
            if verdict.first_retry_after is None:
                verdict.first_retry_after = sample.retry_after or "-"
            if spec.surface.refusal is None:
                verdict.shadow_refusals += 1
            elif not check_refusal_body(spec.surface, replay, sample):
                verdict.bad_429s += 1
        else:
            verdict.unknown += 1
            key = str(sample.status) if sample.status else f"error ({sample.error})"
            verdict.bad_statuses[key] = verdict.bad_statuses.get(key, 0) + 1
        if known_status and (
            sample.ratelimit_policy != policy_header
            or (policy_header is None and sample.ratelimit is not None)
        ):
            verdict.bad_headers += 1

        # What the view said the shadow policies decided (the catalog reports it).
        observed: dict[int, str] = {}
        if shadow_ids and observed_allowed:
            reported = dict(sample.decisions or ())
            for i, pid in shadow_ids.items():
                if pid in reported:
                    observed[i] = reported[pid]
                    verdict.reported[pid] += reported[pid] == SHADOW_DENIED
                else:
                    verdict.shadow_unreported += 1

        straddles = any(w.start(sample.send_ms) != w.start(sample.recv_ms) for w in windows)
        verdict.ambiguous += straddles
        if straddles:
            # Each stretch of [send, recv] between two boundaries is one window
            # assignment; the layers decide in order, so their times never decrease.
            times = [sample.send_ms, *boundaries_within(windows, sample.send_ms, sample.recv_ms)]
            plans = list(itertools.combinations_with_replacement(times, len(replay.layers)))
        else:
            plans = [tuple(sample.send_ms for _ in replay.layers)]
        if known_status and not straddles:
            check_retry_after(replay, branches, sample, verdict)

        successors: set[Branch] = set()
        for branch in branches:
            options: list[Branch] = []
            for plan in plans:
                s = replay.step(branch.states, plan, sample.cost)
                miss = int(known_status and s.allowed != observed_allowed)
                miss += sum(s.decisions[i] != decision for i, decision in observed.items())
                options.append(
                    Branch(
                        s.states,
                        tuple(a + b for a, b in zip(branch.charged, s.charged, strict=True)),
                        tuple(
                            a + (d != ALLOWED)
                            for a, d in zip(branch.refused, s.decisions, strict=True)
                        ),
                        branch.admitted + s.allowed,
                        branch.mismatches + miss,
                    )
                )
            if known_status and straddles:
                # The server read its clock somewhere in [send, recv]: keep the
                # assignments that explain what it answered.
                fewest = min(o.mismatches for o in options)
                options = [o for o in options if o.mismatches == fewest]
            if not known_status:
                # A transport error or an odd status: it may not have been decided at all.
                options.append(branch)
            successors.update(options)
        branches = set(sorted(successors, key=lambda b: b.mismatches)[:MAX_BRANCHES])

    fewest = min(b.mismatches for b in branches)
    consistent = [b for b in branches if b.mismatches == fewest]
    best = min(consistent, key=lambda b: abs(b.admitted - verdict.successes))
    verdict.admitted = verdict.successes
    verdict.expected = best.admitted
    verdict.decision_mismatches = fewest
    for i, policy in enumerate(replay.policies):
        charged = [b.charged[i] for b in consistent]
        refused = [b.refused[i] for b in consistent]
        verdict.charged[policy.id] = (min(charged), max(charged))
        verdict.refused[policy.id] = (min(refused), max(refused))
    return verdict


def check_retry_after(
    replay: Replay, branches: set[Branch], sample: Sample, verdict: Verdict
) -> None:
    """Count a 429 whose Retry-After is not ceil(window end - now) for a now in [send,
    recv], the latest end among the denying windows of every layer, on any replay path
    that explains every response so far."""
    if sample.status != 429 or not sample.retry_after:
        return
    try:
        value = int(sample.retry_after)
    except ValueError:
        verdict.bad_retry_after += 1
        return
    layers = len(replay.layers)
    fewest = min(b.mismatches for b in branches)
    for branch in branches:
        if branch.mismatches != fewest:
            continue
        early = replay.step(branch.states, [sample.send_ms] * layers, sample.cost)
        late = replay.step(branch.states, [sample.recv_ms] * layers, sample.cost)
        if early.retry_after_ms is None or late.retry_after_ms is None:
            return  # this path admits it: a decision mismatch if no path refuses it
        lo = retry_after_header(late.retry_after_ms)
        hi = retry_after_header(early.retry_after_ms)
        if lo <= value <= hi:
            return
    verdict.bad_retry_after += 1


# --------------------------------------------------------------------------- server


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_loopback_sources(addresses: Sequence[str]) -> None:
    for address in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, 0))
            except OSError as exc:
                raise SetupError(
                    f"cannot bind a client to {address} ({exc}); the demo needs the whole "
                    "127.0.0.0/8 on the loopback interface, as Linux has it"
                ) from exc


def check_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise SetupError(f"Redis at {redacted(url)} does not answer: {exc}") from exc
    finally:
        client.close()


def run_command(args: Sequence[str], env: Mapping[str, str], *, stdout_only: bool = False) -> str:
    try:
        done = subprocess.run(
            [PYTHON, *args],
            cwd=REPO_DIR,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"{' '.join(args)} took longer than {COMMAND_TIMEOUT:g} s") from exc
    if done.returncode != 0:
        raise SetupError(
            f"{' '.join(args)} failed with exit status {done.returncode}:\n"
            f"{done.stdout}{done.stderr}".rstrip()
        )
    return (done.stdout if stdout_only else done.stdout + done.stderr).strip()


def gunicorn_supports_no_control_socket() -> bool:
    config = importlib.import_module("gunicorn.config")  # untyped: no stubs for gunicorn
    return "control_socket_disable" in config.Config().settings


class Server:
    """A gunicorn master serving the example project, started and stopped by the demo."""

    def __init__(self, env: Mapping[str, str], workers: int, log_path: Path) -> None:
        self.env = dict(env)
        self.workers = workers
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.base_url = ""
        self.pids: set[int] = set()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):
            port = free_port()
            self._spawn(port)
            if self._wait_ready(port):
                self.base_url = f"http://127.0.0.1:{port}"
                return
            if self.process is not None and self.process.poll() is None:
                break  # running but not answering: retrying another port will not help
            if "Address already in use" not in self.log_tail():
                break
        self.stop()
        raise SetupError(f"gunicorn did not become ready; its log says:\n{self.log_tail()}")

    def _spawn(self, port: int) -> None:
        args = [
            PYTHON,
            "-m",
            "gunicorn",
            "example_project.wsgi:application",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            str(self.workers),
            "--worker-class",
            "sync",
            "--timeout",
            "30",
            "--graceful-timeout",
            "5",
            "--chdir",
            str(REPO_DIR),
            "--error-logfile",
            "-",
            "--log-level",
            "info",
        ]
        if gunicorn_supports_no_control_socket():
            args.append("--no-control-socket")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args,
                cwd=REPO_DIR,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: Ctrl-C reaches only us
            )

    def _wait_ready(self, port: int) -> bool:
        """Wait until every worker has answered ``/healthz`` (each reports its pid)."""
        url = f"http://127.0.0.1:{port}/healthz"
        deadline = time.monotonic() + STARTUP_TIMEOUT
        answered = False
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            pids = self._probe(url, parallel=2 * self.workers)
            answered = answered or bool(pids)
            self.pids |= pids
            if len(self.pids) >= self.workers:
                return True
            time.sleep(0.1)
        if answered:
            say(
                f"warning: only {len(self.pids)} of {self.workers} workers answered before the "
                "start; the others may be slow to warm up"
            )
        return answered

    @staticmethod
    def _probe(url: str, parallel: int) -> set[int]:
        pids: set[int] = set()
        lock = threading.Lock()

        def one() -> None:
            with requests.Session() as session:
                session.trust_env = False
                try:
                    response = session.get(url, timeout=(0.5, 5.0))
                    pid = int(response.json()["pid"])
                except (requests.RequestException, ValueError, KeyError, TypeError):
                    return
            with lock:
                pids.add(pid)

        threads = [threading.Thread(target=one, daemon=True) for _ in range(parallel)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(6.0)
        return pids

    def stop(self) -> int | None:
        """Stop gunicorn gracefully (SIGTERM), then by force; return its exit status."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                # The master and its workers share the process group the demo created.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        return process.returncode

    def collect_stats(self, timeout: float = STATS_TIMEOUT) -> dict[int, list[dict[str, Any]]]:
        """Every worker's decision counts (``GET /api/quota-stats/``), by pid.

        Each sync worker answers one connection at a time, so parallel requests reach
        several workers; it asks until every worker seen at the start has answered (the
        counts no longer change: the clients have stopped) or ``timeout`` passes.
        """
        url = self.base_url + STATS_PATH
        found: dict[int, list[dict[str, Any]]] = {}
        lock = threading.Lock()

        def one() -> None:
            with requests.Session() as session:
                session.trust_env = False
                try:
                    response = session.get(url, timeout=(0.5, 5.0))
                    payload = response.json()
                    pid = int(payload["pid"])
                    outcomes = list(payload["outcomes"])
                except (requests.RequestException, ValueError, KeyError, TypeError):
                    return
            with lock:
                found[pid] = outcomes

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.pids <= set(found):
            threads = [threading.Thread(target=one, daemon=True) for _ in range(2 * self.workers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(6.0)
            if not self.pids <= set(found):
                time.sleep(0.05)
        return found

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_problems(self) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        keys = ("Traceback", "[ERROR]", "[CRITICAL]", "WORKER TIMEOUT")
        return [line for line in text.splitlines() if any(k in line for k in keys)]


# --------------------------------------------------------------------------- report

#: Columns printed flush left (the others are counts, flush right).
TEXT_COLUMNS = {
    "client",
    "surface",
    "policy",
    "policies",
    "allowed",
    "source",
    "decision",
    "result",
}


def say(text: str = "", indent: str = "", hanging: str | None = None) -> None:
    """Print ``text`` wrapped to WIDTH columns: each of its lines starts at ``indent``,
    and what wraps continues at ``hanging`` (two columns further by default)."""
    if not text:
        print(indent.rstrip())
        return
    more = indent + "  " if hanging is None else hanging
    for line in text.splitlines():
        print(
            textwrap.fill(
                line,
                width=WIDTH,
                initial_indent=indent,
                subsequent_indent=more,
                break_on_hyphens=False,
            )
        )


def print_table(rows: Sequence[Sequence[str]], headers: Sequence[str], indent: str = "") -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    numeric = {i for i, h in enumerate(headers) if h not in TEXT_COLUMNS}

    def fmt(cells: Sequence[str]) -> str:
        return (
            indent
            + "  ".join(
                c.rjust(w) if i in numeric else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()
        )

    print(fmt(headers))
    print(indent + "  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))


def print_legend(columns: Sequence[tuple[str, str]], indent: str = "") -> None:
    """What each column of the table above means, one wrapped entry per column."""
    print()
    print(f"{indent}Columns:")
    for name, meaning in columns:
        say(f"{name}: {meaning}", indent + "  ", indent + "    ")


def span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}..{hi}"


CLIENT_COLUMNS = (
    (
        "client",
        "one load generator; each sends from its own loopback address, so each is its own "
        "ip subject (its address and policies are in the next table)",
    ),
    ("surface", "how django-quota meets its requests (the surfaces listed at the start)"),
    ("sent", "requests it sent"),
    ("2xx", "responses with the endpoint's success status (200, or 201 for a create)"),
    (
        "429",
        "refused requests; a shadow row has none, since a shadow policy decides and counts "
        "but never refuses",
    ),
    ("Retry-After", "the Retry-After header of its first 429 (- when it got none)"),
    (
        "admitted",
        "the requests the server admitted, as the client saw them; a request is admitted "
        "only when every layer (middleware, throttle, decorator) admits it, and then it "
        "answers the success status, so this is the 2xx count (any other status is a "
        "problem, listed at the end)",
    ),
    (
        "expected",
        "the requests the replay of the fixed-window arithmetic admits, given the same "
        "requests at the same times",
    ),
    (
        "ambiguous",
        "requests whose [send, receive] interval straddled a window boundary despite the "
        "guard; the replay follows every window assignment that yields the status observed",
    ),
    (
        "result",
        "OK when admitted equals expected and every status, Retry-After, RateLimit-Policy "
        "header and 429 body is right; MISMATCH otherwise, with the reason at the end",
    ),
)


def report(
    known: Mapping[str, Policy], clients: Sequence[Client]
) -> tuple[bool, list[str], dict[str, Verdict]]:
    """Judge every client and print the table of clients, with its legend."""
    rows: list[list[str]] = []
    notes: list[str] = []
    verdicts: dict[str, Verdict] = {}
    all_ok = True
    for client in clients:
        verdict = judge(known, client)
        verdicts[client.spec.name] = verdict
        all_ok = all_ok and verdict.ok
        rows.append(
            [
                client.spec.name,
                client.spec.surface.name,
                str(verdict.sent),
                str(verdict.successes),
                str(verdict.denied),
                verdict.first_retry_after or "-",
                str(verdict.admitted),
                str(verdict.expected),
                str(verdict.ambiguous),
                "OK" if verdict.ok else "MISMATCH",
            ]
        )
        notes.extend(f"{client.spec.name}: {p}" for p in verdict.problems())
    print_table(rows, [name for name, _ in CLIENT_COLUMNS])
    print_legend(CLIENT_COLUMNS)
    return all_ok, notes, verdicts


def layered(spec: ClientSpec, cells: Mapping[str, str]) -> str:
    """One cell per policy of ``spec``: ``+`` within a layer, ``then`` between layers."""
    return " then ".join("+".join(cells[pid] for pid in layer) for layer in spec.layers)


def report_policies(clients: Sequence[Client], verdicts: Mapping[str, Verdict]) -> None:
    """Each client's source address and policies, and what the replay says each policy
    allowed (the counts the server's counters add up)."""
    rows: list[list[str]] = []
    for client in clients:
        charged = verdicts[client.spec.name].charged
        rows.append(
            [
                client.spec.name,
                client.source_ip,
                layered(client.spec, {pid: pid for pid in client.spec.policy_ids}),
                layered(client.spec, {pid: span(*charged[pid]) for pid in client.spec.policy_ids}),
            ]
        )
    print()
    print_table(rows, ["client", "source", "policies", "allowed"])
    several = [c.spec for c in clients if len(c.spec.layers) > 1]
    own_layers = ""
    if several:
        spec = several[0]
        first, later = "+".join(spec.layers[0]), "+".join(spec.layers[-1])
        own_layers = (
            f" Each layer charges on its own, since DRF asks every throttle even after one "
            f"refused: for {spec.name}, {first} counts the requests {later} refused and "
            f"{later} those {first} refused, so either count can exceed its 2xx (the "
            f"requests both admitted)."
        )
    print_legend(
        (
            ("client", "as in the table above"),
            ("source", "the loopback address it sends from: the server's REMOTE_ADDR"),
            (
                "policies",
                "the policies that decide its requests, layer by layer: '+' joins the "
                "policies one layer decides together (charged only if each enforced one "
                "admits), 'then' separates the layers, in the order they decide",
            ),
            (
                "allowed",
                "per policy, in the same order, the requests the replay says it allowed, "
                "that is charged (a range when requests were ambiguous); the server "
                "counters below add these up over the clients. A shadow policy's count is "
                "the requests it admitted, not the 2xx." + own_layers,
            ),
        )
    )


def report_shadow(
    known: Mapping[str, Policy], clients: Sequence[Client], verdicts: Mapping[str, Verdict]
) -> None:
    for policy in known.values():
        if not policy.shadow:
            continue
        mine = [c for c in clients if policy.id in c.spec.policy_ids]
        print()
        say(
            f"Shadow policy {policy.id} ({', '.join(w.describe() for w in policy.windows)} per "
            f"{'+'.join(policy.selector)}, routes {list(policy.routes)}): never refuses"
        )
        for client in mine:
            v = verdicts[client.spec.name]
            lo, hi = v.refused[policy.id]
            say(
                f"{client.spec.name}: {v.sent} sent, {v.successes} answered 2xx, "
                f"{v.denied} refused; the policy would have refused {v.reported[policy.id]} "
                f"(shadow_denied, as the view reported), the replay expects {span(lo, hi)}",
                "  ",
                "    ",
            )


SERVER_COLUMNS = (
    ("policy", "a policy that some client's requests met"),
    (
        "decision",
        "allowed (the requests it charged), or its refusal: denied for an enforced policy, "
        "shadow_denied for a shadow one; any other decision the server reports gets a row "
        "of its own, which fails",
    ),
    ("server", "that decision's count, summed over every worker's /api/quota-stats/"),
    (
        "replay",
        "the count the replay expects, summed over the clients (a range when requests "
        "were ambiguous)",
    ),
    ("result", "OK when the server's count lies within the replay's; MISMATCH otherwise"),
)


def check_server_counts(
    known: Mapping[str, Policy],
    clients: Sequence[Client],
    verdicts: Mapping[str, Verdict],
    stats: Mapping[int, Sequence[Mapping[str, Any]]],
    pids: set[int],
) -> tuple[bool, list[str]]:
    """Compare the workers' decision counts, summed, with the replay, policy by policy:
    ``allowed`` outcomes (charged requests) and refusals (``denied`` for an enforced
    policy, ``shadow_denied`` for a shadow one; no other decision may occur)."""
    print()
    answered = sorted(set(stats))
    if not pids <= set(stats):
        missing = sorted(pids - set(stats))
        say(
            f"Server counters: NOT CHECKED: workers {missing} did not answer {STATS_PATH} "
            f"(answered: {answered})"
        )
        return True, []
    totals: dict[tuple[str, str], int] = {}
    for outcomes in stats.values():
        for item in outcomes:
            key = (str(item["policy"]), str(item["decision"]))
            totals[key] = totals.get(key, 0) + int(item["count"])
    say(
        f"Server counters: {STATS_PATH} of every worker ({len(answered)} pid(s) "
        f"{answered}), summed, against the replay"
    )
    rows: list[list[str]] = []
    notes: list[str] = []
    all_ok = True
    used = [pid for pid in known if any(pid in c.spec.policy_ids for c in clients)]
    for policy_id in used:
        policy = known[policy_id]
        mine = [verdicts[c.spec.name] for c in clients if policy_id in c.spec.policy_ids]
        unknown = sum(v.unknown for v in mine)
        refusal = SHADOW_DENIED if policy.shadow else DENIED
        expected = {
            ALLOWED: (
                sum(v.charged[policy_id][0] for v in mine),
                sum(v.charged[policy_id][1] for v in mine),
            ),
            refusal: (
                sum(v.refused[policy_id][0] for v in mine),
                sum(v.refused[policy_id][1] for v in mine),
            ),
        }
        others = sorted(
            decision
            for (pid, decision) in totals
            if pid == policy_id and decision not in (ALLOWED, refusal)
        )
        wrong: list[str] = []
        for decision in (ALLOWED, refusal, *others):
            lo, hi = expected.get(decision, (0, 0))
            counted = totals.get((policy_id, decision), 0)
            ok = lo <= counted <= hi
            rows.append(
                [policy_id, decision, str(counted), span(lo, hi), "OK" if ok else "MISMATCH"]
            )
            if not ok:
                wrong.append(f"{decision} {counted} where the replay expects {span(lo, hi)}")
        all_ok = all_ok and not wrong
        if wrong:
            notes.append(
                f"server counters of {policy_id}: {'; '.join(wrong)}"
                + (f" ({unknown} request(s) of unknown fate)" if unknown else "")
            )
    print_table(rows, [name for name, _ in SERVER_COLUMNS], indent="  ")
    print_legend(SERVER_COLUMNS, indent="  ")
    return all_ok, notes


def print_latency(clients: Sequence[Client]) -> None:
    """Response times (send to last byte): a slow response may straddle a boundary."""
    times = sorted(s.recv_ms - s.send_ms for c in clients for s in c.samples)
    if not times:
        return

    def pct(q: float) -> int:
        return times[min(len(times) - 1, math.ceil(q * len(times)) - 1)]

    say(
        f"{len(times)} requests; response times: median {pct(0.5)} ms, 99th percentile "
        f"{pct(0.99)} ms, max {times[-1]} ms"
    )


def _json_or_text(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


def print_samples(clients: Sequence[Client]) -> None:
    """One 2xx and one 429 per surface and policy group: headers and body (``--verbose``;
    the headers and bodies are printed whole, however long)."""
    groups: dict[tuple[str, tuple[tuple[str, ...], ...]], list[Client]] = {}
    for client in clients:
        groups.setdefault((client.spec.surface.name, client.spec.layers), []).append(client)
    print()
    print("Headers and bodies, per surface (the first of each kind):")
    for (surface, layers), mine in groups.items():
        samples = [s for c in mine for s in c.samples]
        actions = sorted({s.action.label for s in samples})
        names = ", ".join(c.spec.name for c in mine)
        policies = " then ".join("+".join(layer) for layer in layers)
        print(f"  {surface}: {policies} on {', '.join(actions)} ({names})")
        if mine[0].spec.surface.refusal is None:
            for decision in (ALLOWED, SHADOW_DENIED):
                found = next(
                    (s for s in samples if s.decisions and decision in dict(s.decisions).values()),
                    None,
                )
                if found is None:
                    continue
                verb = "admitted" if decision == ALLOWED else "would refuse"
                print(
                    f"    a {found.status} it {verb}:"
                    f" RateLimit-Policy: {found.ratelimit_policy or '(none)'}; RateLimit: "
                    f"{found.ratelimit or '(none)'}; Retry-After: {found.retry_after or '(none)'}"
                )
                quota = [{"policy": p, "decision": d} for p, d in (found.decisions or ())]
                print(f'      body "quota": {json.dumps(quota)}')
            continue
        allowed = next(
            (s for s in samples if s.status == s.action.success and s.ratelimit_policy), None
        )
        refused = next((s for s in samples if s.status == 429), None)
        if allowed is not None:
            print(f"    a {allowed.status}: RateLimit-Policy: {allowed.ratelimit_policy}")
            print(f"           RateLimit: {allowed.ratelimit}")
        if refused is not None:
            print(f"    a 429: Retry-After: {refused.retry_after}")
            print(f"           RateLimit: {refused.ratelimit}")
            print(f"           Content-Type: {refused.content_type}")
            print(f"           body: {_json_or_text(refused.body)}")


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m example_project.demo",
        description="Load the example project under gunicorn and check every quota decision.",
    )
    parser.add_argument(
        "--seconds", type=float, default=6.0, help="how long the clients send (default 6)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gunicorn workers with Redis (default 3, at least 2); always 1 without REDIS_URL",
    )
    parser.add_argument(
        "--guard-ms",
        type=int,
        default=40,
        help="never send this close before a window boundary (default 40)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the clients' jitter")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print a sample of each surface's rate-limit headers and 429 body",
    )
    parser.add_argument(
        "--settings",
        default=DEFAULT_SETTINGS_MODULE,
        help=f"settings module the server runs with (default {DEFAULT_SETTINGS_MODULE})",
    )
    args = parser.parse_args(argv)
    if not 0.5 <= args.seconds <= 300:
        parser.error("--seconds must be between 0.5 and 300")
    if not 5 <= args.guard_ms <= 500:
        parser.error("--guard-ms must be between 5 and 500")
    return args


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds``; turn SIGTERM into an exit."""

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"the demo did not finish within {seconds:g} s")

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    old_alarm = signal.signal(signal.SIGALRM, on_alarm)
    old_term = signal.signal(signal.SIGTERM, on_term)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGTERM, old_term)


def main(argv: Sequence[str] | None = None) -> int:
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress lines show up while it runs
    args = parse_args(argv)
    budget = (
        STARTUP_TIMEOUT + 3 * COMMAND_TIMEOUT + args.seconds + READ_TIMEOUT + STATS_TIMEOUT + 60
    )
    try:
        with bounded(budget):
            return run(args)
    except SetupError as exc:
        print(f"demo: setup failed: {exc}", file=sys.stderr)
        return EXIT_SETUP
    except TimeoutError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return EXIT_SETUP
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130


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


def seed_users(env: Mapping[str, str]) -> dict[str, str]:
    """Create the API users; return their DRF tokens (never printed)."""
    output = run_command(["manage.py", "seed_users", "--json", *USERS], env, stdout_only=True)
    try:
        tokens = json.loads(output.splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise SetupError(f"seed_users printed no tokens: {output!r}") from exc
    missing = [user for user in USERS if user not in tokens]
    if missing:
        raise SetupError(f"seed_users made no token for {missing}")
    return {str(user): str(token) for user, token in tokens.items()}


def run(args: argparse.Namespace) -> int:
    redis_url = os.environ.get("REDIS_URL") or None
    if redis_url is None:
        if args.workers not in (None, 1):
            raise SetupError(
                "without REDIS_URL the memory backend keeps counters per process: "
                "it runs exactly 1 worker"
            )
        workers = 1
    else:
        workers = 3 if args.workers is None else args.workers
        if workers < 2:
            raise SetupError("with REDIS_URL set the demo runs 2 or more workers")
        if workers > 32:
            raise SetupError("--workers is capped at 32")

    key_prefix = f"demo-{secrets.token_hex(6)}"
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    env["DJANGO_SETTINGS_MODULE"] = args.settings
    env["QUOTA_KEY_PREFIX"] = key_prefix
    env["EXAMPLE_QUOTA_STATS"] = "1"  # serve GET /api/quota-stats/ (see settings.py)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_DIR), env.get("PYTHONPATH", "")) if p)

    # The policies the server enforces, read from the very modules it loads.
    os.environ["QUOTA_KEY_PREFIX"] = key_prefix
    sys.path.insert(0, str(REPO_DIR))
    try:
        settings_module = importlib.import_module(args.settings)
        limits_module = importlib.import_module(LIMITS_MODULE)
    except ImportError as exc:
        raise SetupError(f"cannot import the example project's settings: {exc}") from exc
    known = load_policies(settings_module, limits_module)
    check_clients(known, limits_module)

    backend = f"redis ({redacted(redis_url)})" if redis_url else "memory (per process)"
    print("django-quota demo")
    say(f"  backend:    {backend}", hanging=" " * 14)
    print(f"  workers:    {workers} gunicorn sync worker(s)")
    print(f"  key prefix: {key_prefix}")
    say(f"  database:   {settings_module.DATABASES['default']['NAME']}", hanging=" " * 14)
    for policy in known.values():
        say(f"  policy      {policy.describe()}", hanging=" " * 16)
    print("  surfaces:")
    for surface in SURFACES:
        paths = sorted({a.label for s in CLIENT_SPECS if s.surface is surface for a in s.actions})
        say(f"    {surface.name + ':':<15}{', '.join(paths)}: {surface.about}", hanging=" " * 21)

    if redis_url is not None:
        check_redis(redis_url)
    sources = [f"127.0.0.{i + 2}" for i in range(len(CLIENT_SPECS))]
    check_loopback_sources(sources)

    print("Migrating and seeding the database ...")
    run_command(["manage.py", "migrate", "--noinput", "--verbosity", "0"], env)
    say(run_command(["manage.py", "seed_items"], env), "  ", "    ")
    tokens = seed_users(env)
    say(f"API users {', '.join(USERS)}, each with a DRF token", "  ", "    ")

    GUNICORN_LOG.parent.mkdir(parents=True, exist_ok=True)
    GUNICORN_LOG.write_bytes(b"")
    server = Server(env, workers, GUNICORN_LOG)
    stop = threading.Event()
    clients = [
        Client(spec, ip, tokens[spec.user] if spec.user else None)
        for spec, ip in zip(CLIENT_SPECS, sources, strict=True)
    ]
    threads: list[threading.Thread] = []
    stats: dict[int, list[dict[str, Any]]] = {}
    try:
        server.start()
        say(
            f"gunicorn serving {server.base_url} with worker pids {sorted(server.pids)} "
            f"(log: {GUNICORN_LOG.relative_to(REPO_DIR)})"
        )
        seed = args.seed if args.seed is not None else secrets.randbits(32)
        start_at = time.time() + 0.2
        end_at = start_at + args.seconds
        say(
            f"Running {len(clients)} clients for {args.seconds:g} s (guard {args.guard_ms} ms "
            f"before window boundaries, seed {seed}) ..."
        )
        for index, client in enumerate(clients):
            periods = sorted({p for pid in client.spec.policy_ids for p in known[pid].periods_ms})
            thread = threading.Thread(
                target=run_client,
                name=client.spec.name,
                args=(
                    client,
                    server.base_url,
                    periods,
                    args.guard_ms,
                    start_at,
                    end_at,
                    seed + index,
                    stop,
                ),
                daemon=True,
            )
            threads.append(thread)
            thread.start()
        join_deadline = end_at + CONNECT_TIMEOUT + READ_TIMEOUT + 5
        for thread in threads:
            thread.join(max(0.0, join_deadline - time.time()))
        hung = [t.name for t in threads if t.is_alive()]
        if hung:
            stop.set()
            raise SetupError(f"clients still running after their deadline: {hung}")
        stats = server.collect_stats()
    finally:
        stop.set()
        status = server.stop()
        if server.process is not None:
            print(f"gunicorn stopped (exit status {status})")

    print_latency(clients)
    print()
    all_ok, notes, verdicts = report(known, clients)
    report_policies(clients, verdicts)
    report_shadow(known, clients, verdicts)
    counts_ok, count_notes = check_server_counts(known, clients, verdicts, stats, server.pids)
    notes.extend(count_notes)
    if args.verbose:
        print_samples(clients)
    else:
        print()
        print("(--verbose adds a sample of each surface's rate-limit headers and 429 body)")
    problems = server.log_problems()
    if problems:
        print()
        print(f"gunicorn logged {len(problems)} problem line(s); the first ones:")
        for line in problems[:10]:
            say(line, "  ", "    ")
    print()
    if notes:
        print("Problems:")
        for note in notes:
            say(note, "  ", "    ")
    if all_ok and counts_ok and not problems:
        print("All decisions match the fixed-window arithmetic: OK")
        return EXIT_OK
    print("FAILED")
    return EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
