"""The load: each client's thread, sending from its own loopback address, never close
before a window boundary, and recording what it sent and what came back."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from example_project.demo import SetupError
from example_project.demo.policies import Policy
from example_project.demo.scenario import (
    CATALOG,
    CREATE,
    EXPORT,
    SEARCH,
    SEARCH_TERMS,
    Action,
    ClientSpec,
)

CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 5.0


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


@dataclass(frozen=True, slots=True)
class Schedule:
    """Where every client sends, from when until when, and how it draws its jitter."""

    base_url: str
    guard_ms: int
    seed: int
    start_at: float
    end_at: float
    """Epoch seconds."""

    @classmethod
    def starting_soon(cls, base_url: str, seconds: float, guard_ms: int, seed: int) -> Schedule:
        """Start in 0.2 s, time enough for every thread to be waiting, and last ``seconds``."""
        start_at = time.time() + 0.2
        return cls(base_url, guard_ms, seed, start_at, start_at + seconds)


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


def drive(
    clients: Sequence[Client],
    known: Mapping[str, Policy],
    schedule: Schedule,
    stop: threading.Event,
) -> None:
    """Run every client in a thread of its own until the schedule ends; raise SetupError
    if one is still running well after that."""
    threads: list[threading.Thread] = []
    for index, client in enumerate(clients):
        periods = sorted({p for pid in client.spec.policy_ids for p in known[pid].periods_ms})
        thread = threading.Thread(
            target=run_client,
            name=client.spec.name,
            args=(client, schedule, periods, schedule.seed + index, stop),
            daemon=True,
        )
        threads.append(thread)
        thread.start()
    join_deadline = schedule.end_at + CONNECT_TIMEOUT + READ_TIMEOUT + 5
    for thread in threads:
        thread.join(max(0.0, join_deadline - time.time()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        stop.set()
        raise SetupError(f"clients still running after their deadline: {hung}")


def run_client(
    client: Client,
    schedule: Schedule,
    periods_ms: Sequence[int],
    seed: int,
    stop: threading.Event,
) -> None:
    """Send the client's requests until the schedule ends, recording each in its samples."""
    rng = random.Random(seed)
    session = make_session(client.source_ip)
    if client.token is not None:
        session.headers["Authorization"] = f"Token {client.token}"
    end_at = schedule.end_at
    try:
        stop.wait(max(0.0, schedule.start_at - time.time()))
        turn = 0
        while not stop.is_set():
            wait_clear_of_boundaries(periods_ms, schedule.guard_ms, stop)
            if stop.is_set() or time.time() >= end_at:
                break
            action = client.spec.actions[turn % len(client.spec.actions)]
            cost = rng.choice(client.spec.sizes) if client.spec.sizes else 1
            sample = send(session, schedule.base_url, action, client.spec.name, turn, cost, rng)
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
    """Send one request of ``action`` and record it."""
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
