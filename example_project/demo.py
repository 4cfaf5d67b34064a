"""Run the example project under gunicorn, load it over TCP and check every quota decision.

``python -m example_project.demo`` (or ``scripts/demo``):

1. migrates the SQLite database and seeds a few items;
2. starts ``gunicorn example_project.wsgi`` on a free port of 127.0.0.1: one worker with the
   memory backend (``REDIS_URL`` unset; its counters live in one process), or ``--workers``
   (default 3) with Redis, under a fresh ``QUOTA["KEY_PREFIX"]`` so that no two runs share
   a counter and nothing else in Redis is touched;
3. runs concurrent HTTP clients for ``--seconds``, each bound to its own loopback source
   address (127.0.0.2, 127.0.0.3, ...), so that each is a distinct ``ip`` subject;
4. replays what each client sent through the fixed-window arithmetic of the contract and
   compares, request by request, what the server decided with what it had to decide.

Why the expected counts are exact: fixed windows are aligned to the Unix epoch and the
server and the clients read the same clock. A client never sends a request while a
boundary of one of its policy's windows is nearer than ``--guard-ms``, so a request's
[send, receive] interval normally lies inside one window of every period, and wherever in
that interval the server read its clock, it counted the request in the windows the client
computes from the send time. If an interval straddles a boundary anyway (a slow response),
the request is *ambiguous*: the replay then follows each possible window assignment that
yields the status actually observed (one of them is what the server did, if it is right),
and the client passes when one such path explains every response. A request the server
must have decided differently in every path is a mismatch.

Exit status: 0 when every client matches; 1 on a mismatch, a 5xx, any status other than
the endpoint's success status or 429, a malformed 429, or a transport error; 2 when the
demo could not be set up.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import math
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
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
GUNICORN_LOG = REPO_DIR / "var" / "demo-gunicorn.log"

CONNECT_TIMEOUT = 2.0
READ_TIMEOUT = 5.0
STARTUP_TIMEOUT = 45.0
STOP_TIMEOUT = 15.0
COMMAND_TIMEOUT = 120.0

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_SETUP = 2

_RATE_RE = re.compile(
    r"^\s*(?P<limit>\d+)\s*/\s*(?P<mult>\d*)\s*(?P<unit>s|sec|m|min|h|hour|d|day)\s*$"
)
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
    id: str
    windows: tuple[Window, ...]
    selector: tuple[str, ...]
    routes: tuple[str, ...]
    methods: tuple[str, ...]

    @property
    def periods_ms(self) -> tuple[int, ...]:
        return tuple(sorted({w.period_ms for w in self.windows}))

    def describe(self) -> str:
        windows = ", ".join(w.describe() for w in self.windows)
        methods = ",".join(self.methods) or "all methods"
        return (
            f"{self.id}: fixed_window [{windows}] selector={list(self.selector)} "
            f"routes={list(self.routes)} ({methods})"
        )


def parse_rate(rate: str) -> tuple[int, int]:
    """Return (limit, period in ms) of a rate such as ``"5/s"`` or ``"12/3s"``."""
    match = _RATE_RE.match(rate)
    if match is None:
        raise SetupError(f"cannot parse rate {rate!r}")
    mult = int(match["mult"] or 1)
    return int(match["limit"]), mult * _UNIT_MS[match["unit"][0]]


def load_policies(quota: Mapping[str, Any]) -> dict[str, Policy]:
    """Read the fixed-window policies from the example project's ``QUOTA`` setting."""
    policies: dict[str, Policy] = {}
    for policy_id, spec in quota.get("POLICIES", {}).items():
        if spec.get("algorithm") != "fixed_window":
            raise SetupError(f"policy {policy_id}: the demo can only check fixed_window")
        raw_windows = spec["windows"]
        if isinstance(raw_windows, str):
            raw_windows = {"default": raw_windows}
        windows = tuple(Window(name, *parse_rate(rate)) for name, rate in raw_windows.items())
        policies[policy_id] = Policy(
            id=policy_id,
            windows=windows,
            selector=tuple(spec.get("selector", ["auto"])),
            routes=tuple(spec.get("routes") or ()),
            methods=tuple(spec.get("methods") or ()),
        )
    return policies


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
SEARCH_TERMS = ("mug", "tea", "coffee", "cup", "grinder", "")


@dataclass(frozen=True, slots=True)
class ClientSpec:
    name: str
    policy: str
    actions: tuple[Action, ...]
    interval: float
    """Mean pause between two requests, in seconds."""
    polite: bool = False
    """Wait for Retry-After after a 429 instead of retrying at once."""


CLIENT_SPECS: tuple[ClientSpec, ...] = (
    ClientSpec("items-list-a", "api-items", (LIST,), 0.05),
    ClientSpec("items-list-b", "api-items", (LIST,), 0.09),
    ClientSpec("items-create", "api-items", (CREATE,), 0.07),
    ClientSpec("items-mixed", "api-items", (LIST, CREATE), 0.06),
    ClientSpec("items-polite", "api-items", (LIST,), 0.05, polite=True),
    ClientSpec("search-a", "api-search", (SEARCH,), 0.06),
    ClientSpec("search-b", "api-search", (SEARCH,), 0.12),
    ClientSpec("search-polite", "api-search", (SEARCH,), 0.05, polite=True),
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


@dataclass(slots=True)
class Client:
    spec: ClientSpec
    source_ip: str
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
    try:
        stop.wait(max(0.0, start_at - time.time()))
        turn = 0
        while not stop.is_set():
            wait_clear_of_boundaries(periods_ms, guard_ms, stop)
            if stop.is_set() or time.time() >= end_at:
                break
            action = client.spec.actions[turn % len(client.spec.actions)]
            sample = send(session, base_url, action, client.spec.name, turn, rng)
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
    rng: random.Random,
) -> Sample:
    kwargs: dict[str, Any] = {"timeout": (CONNECT_TIMEOUT, READ_TIMEOUT)}
    if action is CREATE:
        kwargs["json"] = {"name": f"{client_name} #{turn}", "price": rng.randint(100, 9999)}
    elif action is SEARCH:
        kwargs["params"] = {"q": rng.choice(SEARCH_TERMS)}
    send_ms = now_floor_ms()
    try:
        response = session.request(action.method, base_url + action.path, **kwargs)
    except requests.RequestException as exc:
        return Sample(action, send_ms, now_ceil_ms(), 0, None, "", f"{type(exc).__name__}")
    recv_ms = now_ceil_ms()
    headers = response.headers
    return Sample(
        action=action,
        send_ms=send_ms,
        recv_ms=recv_ms,
        status=response.status_code,
        retry_after=headers.get("Retry-After"),
        content_type=headers.get("Content-Type", ""),
        ratelimit=headers.get("RateLimit"),
        ratelimit_policy=headers.get("RateLimit-Policy"),
    )


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    starts: tuple[int, ...]
    before: tuple[int, ...]
    """Each window's count for ``starts`` before this request."""
    counts: tuple[int, ...]
    """Each window's count after this request (unchanged when denied)."""
    retry_after_ms: int | None


def decide(
    windows: Sequence[Window], starts: Sequence[int], counts: Sequence[int], now_ms: int
) -> Decision:
    """Apply one request of cost 1 at ``now_ms`` to a fixed-window policy (contract 5.1)."""
    new_starts = tuple(w.start(now_ms) for w in windows)
    current = tuple(
        count if start == new_start else 0
        for count, start, new_start in zip(counts, starts, new_starts, strict=True)
    )
    denying = [
        (w, start)
        for w, start, count in zip(windows, new_starts, current, strict=True)
        if count + 1 > w.limit
    ]
    if denying:
        retry_ms = max(start + w.period_ms - now_ms for w, start in denying)
        return Decision(False, new_starts, current, current, retry_ms)
    return Decision(True, new_starts, current, tuple(c + 1 for c in current), None)


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
    starts: tuple[int, ...]
    counts: tuple[int, ...]
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
    crashed: str | None = None

    @property
    def ok(self) -> bool:
        return not (
            self.decision_mismatches
            or self.bad_statuses
            or self.bad_429s
            or self.bad_retry_after
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
            found.append(f"{self.bad_429s} 429(s) without Retry-After or problem+json body")
        if self.bad_retry_after:
            found.append(f"{self.bad_retry_after} Retry-After value(s) off the fixed window")
        if self.crashed:
            found.append(f"client crashed: {self.crashed}")
        return found


MAX_BRANCHES = 512


def judge(policy: Policy, client: Client) -> Verdict:
    """Replay a client's requests through the policy's windows and compare the outcomes."""
    windows = policy.windows
    verdict = Verdict(sent=len(client.samples), crashed=client.crashed)
    branches = {Branch(tuple(-1 for _ in windows), tuple(0 for _ in windows), 0, 0)}
    for sample in client.samples:
        observed_allowed = sample.status == sample.action.success
        observed_denied = sample.status == 429
        known = observed_allowed or observed_denied
        if observed_allowed:
            verdict.successes += 1
        elif observed_denied:
            verdict.denied += 1
            if verdict.first_retry_after is None:
                verdict.first_retry_after = sample.retry_after or "-"
            if not sample.retry_after or "problem+json" not in sample.content_type:
                verdict.bad_429s += 1
        else:
            key = str(sample.status) if sample.status else f"error ({sample.error})"
            verdict.bad_statuses[key] = verdict.bad_statuses.get(key, 0) + 1

        straddles = any(w.start(sample.send_ms) != w.start(sample.recv_ms) for w in windows)
        verdict.ambiguous += straddles
        # Each stretch of [send, recv] between two boundaries is one window assignment.
        times = [sample.send_ms, *boundaries_within(windows, sample.send_ms, sample.recv_ms)]
        if known and not straddles:
            check_retry_after(windows, best_branch(branches), sample, verdict)

        successors: set[Branch] = set()
        for branch in branches:
            options: list[Branch] = []
            for t in times:
                d = decide(windows, branch.starts, branch.counts, t)
                admitted = branch.admitted + d.allowed
                if known:
                    miss = int(d.allowed != observed_allowed)
                    options.append(Branch(d.starts, d.counts, admitted, branch.mismatches + miss))
                else:
                    # A transport error or an odd status: it may or may not have been counted.
                    options.append(Branch(d.starts, d.counts, admitted, branch.mismatches))
                    options.append(Branch(d.starts, d.before, branch.admitted, branch.mismatches))
            if known and straddles:
                # The server read its clock once, somewhere in [send, recv]: keep the
                # assignments that explain the status it returned.
                fewest = min(o.mismatches for o in options)
                options = [o for o in options if o.mismatches == fewest]
            successors.update(options)
        branches = set(sorted(successors, key=lambda b: b.mismatches)[:MAX_BRANCHES])

    best = min(branches, key=lambda b: (b.mismatches, abs(b.admitted - verdict.successes)))
    verdict.admitted = verdict.successes
    verdict.expected = best.admitted
    verdict.decision_mismatches = best.mismatches
    return verdict


def best_branch(branches: set[Branch]) -> Branch:
    return min(branches, key=lambda b: (b.mismatches, b.admitted, b.counts))


def check_retry_after(
    windows: Sequence[Window], branch: Branch, sample: Sample, verdict: Verdict
) -> None:
    """Count a 429 whose Retry-After is not ceil(start + P - now) for a now in [send, recv]."""
    if sample.status != 429 or not sample.retry_after:
        return
    early = decide(windows, branch.starts, branch.counts, sample.send_ms)
    late = decide(windows, branch.starts, branch.counts, sample.recv_ms)
    if early.retry_after_ms is None or late.retry_after_ms is None:
        return  # the replay admits it: already a decision mismatch
    try:
        value = int(sample.retry_after)
    except ValueError:
        value = -1
    lo = retry_after_header(late.retry_after_ms)
    hi = retry_after_header(early.retry_after_ms)
    if not lo <= value <= hi:
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


def run_command(args: Sequence[str], env: Mapping[str, str]) -> str:
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
    return (done.stdout + done.stderr).strip()


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
            print(
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


def print_table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    numeric = {
        i
        for i, h in enumerate(headers)
        if h not in {"client", "policy", "source", "requests", "result"}
    }

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    print(fmt(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))


def report(policies: Mapping[str, Policy], clients: Sequence[Client]) -> tuple[bool, list[str]]:
    rows: list[list[str]] = []
    notes: list[str] = []
    all_ok = True
    for client in clients:
        policy = policies[client.spec.policy]
        verdict = judge(policy, client)
        all_ok = all_ok and verdict.ok
        actions = "+".join(a.label for a in client.spec.actions)
        if client.spec.polite:
            actions += " (waits Retry-After)"
        rows.append(
            [
                client.spec.name,
                policy.id,
                client.source_ip,
                actions,
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
    print_table(
        rows,
        [
            "client",
            "policy",
            "source",
            "requests",
            "sent",
            "2xx",
            "429",
            "1st Retry-After",
            "admitted",
            "expected",
            "ambiguous",
            "result",
        ],
    )
    return all_ok, notes


def print_policy_totals(policies: Mapping[str, Policy], clients: Sequence[Client]) -> None:
    print()
    print("Per policy:")
    for policy in policies.values():
        mine = [c for c in clients if c.spec.policy == policy.id]
        sent = sum(len(c.samples) for c in mine)
        ok = sum(1 for c in mine for s in c.samples if s.status == s.action.success)
        denied = sum(1 for c in mine for s in c.samples if s.status == 429)
        print(f"  {policy.id}: {len(mine)} clients, {sent} sent, {ok} admitted, {denied} denied")
        allowed = next((s for c in mine for s in c.samples if s.ratelimit), None)
        refused = next((s for c in mine for s in c.samples if s.status == 429), None)
        if allowed is not None:
            print(f"    RateLimit-Policy: {allowed.ratelimit_policy}")
            print(f"    RateLimit (a {allowed.status}): {allowed.ratelimit}")
        if refused is not None:
            print(
                f"    a 429: Retry-After: {refused.retry_after}; RateLimit: {refused.ratelimit}; "
                f"Content-Type: {refused.content_type}"
            )


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
    budget = STARTUP_TIMEOUT + 2 * COMMAND_TIMEOUT + args.seconds + READ_TIMEOUT + 60
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
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_DIR), env.get("PYTHONPATH", "")) if p)

    # The policies the server enforces, read from the very settings module it loads.
    os.environ["QUOTA_KEY_PREFIX"] = key_prefix
    sys.path.insert(0, str(REPO_DIR))
    try:
        settings_module = importlib.import_module(args.settings)
    except ImportError as exc:
        raise SetupError(f"cannot import the settings module {args.settings}: {exc}") from exc
    policies = load_policies(getattr(settings_module, "QUOTA", {}))
    missing = {spec.policy for spec in CLIENT_SPECS} - set(policies)
    if missing:
        raise SetupError(f"settings.QUOTA lacks the policies {sorted(missing)}")

    backend = f"redis ({redacted(redis_url)})" if redis_url else "memory (per process)"
    print("django-quota demo")
    print(f"  backend:    {backend}")
    print(f"  workers:    {workers} gunicorn sync worker(s)")
    print(f"  key prefix: {key_prefix}")
    print(f"  database:   {settings_module.DATABASES['default']['NAME']}")
    for policy in policies.values():
        print(f"  policy      {policy.describe()}")

    if redis_url is not None:
        check_redis(redis_url)
    sources = [f"127.0.0.{i + 2}" for i in range(len(CLIENT_SPECS))]
    check_loopback_sources(sources)

    print("Migrating and seeding the database ...")
    run_command(["manage.py", "migrate", "--noinput", "--verbosity", "0"], env)
    print("  " + run_command(["manage.py", "seed_items"], env).replace("\n", "\n  "))

    GUNICORN_LOG.parent.mkdir(parents=True, exist_ok=True)
    GUNICORN_LOG.write_bytes(b"")
    server = Server(env, workers, GUNICORN_LOG)
    stop = threading.Event()
    clients = [Client(spec, ip) for spec, ip in zip(CLIENT_SPECS, sources, strict=True)]
    threads: list[threading.Thread] = []
    try:
        server.start()
        print(
            f"gunicorn serving {server.base_url} with worker pids {sorted(server.pids)} "
            f"(log: {GUNICORN_LOG.relative_to(REPO_DIR)})"
        )
        seed = args.seed if args.seed is not None else secrets.randbits(32)
        start_at = time.time() + 0.2
        end_at = start_at + args.seconds
        print(
            f"Running {len(clients)} clients for {args.seconds:g} s (guard {args.guard_ms} ms "
            f"before window boundaries, seed {seed}) ..."
        )
        for index, client in enumerate(clients):
            thread = threading.Thread(
                target=run_client,
                name=client.spec.name,
                args=(
                    client,
                    server.base_url,
                    policies[client.spec.policy].periods_ms,
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
    finally:
        stop.set()
        status = server.stop()
        if server.process is not None:
            print(f"gunicorn stopped (exit status {status})")

    print()
    all_ok, notes = report(policies, clients)
    print_policy_totals(policies, clients)
    problems = server.log_problems()
    if problems:
        print()
        print(f"gunicorn logged {len(problems)} problem line(s); the first ones:")
        for line in problems[:10]:
            print(f"  {line}")
    print()
    if notes:
        print("Problems:")
        for note in notes:
            print(f"  {note}")
    if all_ok and not problems:
        print("All decisions match the fixed-window arithmetic: OK")
        return EXIT_OK
    print("FAILED")
    return EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
