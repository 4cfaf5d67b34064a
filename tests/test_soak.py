"""A bounded soak (docs/failures.md): eight threads evaluate a few subjects with minute-long
fixed windows (sync API, middleware, async API) while faults cycle underneath: server
stop and start, CLIENT PAUSE, proxy latency above TIMEOUT, refused connections, dropped
replies, SCRIPT FLUSH. No exception escapes, every reason is in the
vocabulary of docs/failures.md, and no window ever admits more than its limit by Redis's
decision: checked from the outcomes the callers saw and from the evaluations Redis recorded.

``QUOTA_SOAK_SECONDS`` (default 20, at most 45) bounds the run, split between a phase
with LOCAL_FALLBACK and one without. Counts land in the terminal summary and
``test-artifacts/soak.json``."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
from django.test import Client

import django_quota
import django_quota.policies
from django_quota import limiter
from django_quota.core.outcome import DECISIONS, Outcome, is_known_reason
from django_quota.core.protocol import counter_key
from tests.faults import Proxy, RedisProcess, Report, proxy_to, read_ledger, redis_process

pytestmark = pytest.mark.redis

SECONDS = min(float(os.environ.get("QUOTA_SOAK_SECONDS", "20")), 45.0)
LIMIT = 150
PERIOD_MS = 60_000
SUBJECTS = [f"192.0.2.{n}" for n in range(1, 5)]
POLICIES: dict[str, dict[str, Any]] = {
    # The middleware applies "soak-closed" to /api; the API evaluates both.
    "soak-closed": {"windows": f"{LIMIT}/m", "routes": ["/api"], "failure_mode": "closed"},
    "soak-open": {"windows": f"{LIMIT}/m", "failure_mode": "open"},
}
#: Calls per worker at most, whatever the clock says.
MAX_CALLS = 100_000

REPORT = Report("soak", "django-quota soak: outcomes under cycling faults")


@pytest.fixture(scope="module", autouse=True)
def report(request: pytest.FixtureRequest) -> Iterator[Report]:
    REPORT.install(request.config)
    yield REPORT
    REPORT.save()


Seen = tuple[Outcome, str, float]  # outcome, subject ip, wall clock when it returned


class Workers:
    """Eight load threads sharing one record of what they saw."""

    def __init__(self, until: float) -> None:
        self.until = until
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        self.statuses: Counter[int] = Counter()
        self.errors: list[BaseException] = []

    def keep(self, outcome: Outcome, ip: str) -> None:
        with self.lock:
            self.seen.append((outcome, ip, time.time()))

    def running(self, calls: int) -> bool:
        return calls < MAX_CALLS and time.monotonic() < self.until

    def guarded(self, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # the soak fails on any exception that escapes
                with self.lock:
                    self.errors.append(exc)

        return run

    def api(self, index: int) -> None:
        calls = 0
        while self.running(calls):
            ip = SUBJECTS[(index + calls) % len(SUBJECTS)]
            policy = "soak-closed" if calls % 2 else "soak-open"
            self.keep(django_quota.evaluate(policy, {"ip": ip}), ip)
            calls += 1

    def http(self, index: int) -> None:
        clients = {ip: Client(REMOTE_ADDR=ip) for ip in SUBJECTS}
        calls = 0
        while self.running(calls):
            ip = SUBJECTS[(index + calls) % len(SUBJECTS)]
            response = clients[ip].get("/api/items/")
            with self.lock:
                self.statuses[response.status_code] += 1
            for outcome in django_quota.outcomes(response.wsgi_request):
                self.keep(outcome, ip)
            calls += 1

    def async_api(self) -> None:
        async def loop() -> None:
            calls = 0
            while self.running(calls):
                ip = SUBJECTS[calls % len(SUBJECTS)]
                self.keep(await django_quota.aevaluate("soak-closed", {"ip": ip}), ip)
                calls += 1

        asyncio.run(loop())


def cycle_faults(server: RedisProcess, proxy: Proxy, until: float) -> Counter[str]:
    """Inject one fault after another until ``until``; return how often each ran."""
    admin = server.client()
    injected: Counter[str] = Counter()

    def rest(seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, until - time.monotonic())))

    def for_a_while(fault: Callable[[], None], seconds: float = 0.5) -> Callable[[], None]:
        def step() -> None:
            fault()
            rest(seconds)
            proxy.forward()

        return step

    def pause() -> None:
        admin.client_pause(300, all=True)
        admin.ping()  # answered once the pause is over

    def restart() -> None:
        server.stop(save=True)  # the data survive: the limit holds across the restart
        rest(0.4)
        server.start()

    steps: list[tuple[str, Callable[[], object]]] = [
        ("latency 0.15 s", for_a_while(lambda: proxy.latency(0.15))),
        ("refuse", for_a_while(proxy.refuse)),
        ("drop_reply x5", for_a_while(lambda: proxy.drop_reply(5))),
        ("SCRIPT FLUSH", admin.script_flush),
        ("CLIENT PAUSE 300 ms", pause),
        ("stop + start", restart),
    ]
    try:
        while time.monotonic() < until:
            for name, step in steps:
                rest(0.7)  # healthy between faults
                if time.monotonic() >= until:
                    break
                step()
                injected[name] += 1
    finally:
        proxy.forward()
        admin.close()
    return injected


@pytest.fixture
def faults() -> Iterator[tuple[RedisProcess, Proxy]]:
    with redis_process() as server, proxy_to(server) as proxy:
        yield server, proxy


@pytest.mark.parametrize("fallback", [True, False], ids=["fallback", "no-fallback"])
def test_soak_under_cycling_faults_never_raises_nor_over_admits(
    quota: Any, faults: tuple[RedisProcess, Proxy], fallback: bool
) -> None:
    server, proxy = faults
    quota(
        REDIS_URL=proxy.url,
        FAILURE_RETRY_AFTER=1,
        DEDUP_TTL=120.0,  # every retry's ledger lookup stays exact during the soak
        # A refusal is answered again locally for at most 50 ms: with the default 5 s, the
        # eight exhausted groups would reach Redis a few times a phase, and a busy machine
        # could see no fault at all (CI did, once: no decision fell back).
        DENIAL_CACHE={"MAX_TTL": 0.05},
        LOCAL_FALLBACK={"ENABLED": fallback},
        POLICIES={
            pid: {"algorithm": "fixed_window", "selector": ["ip"], **d}
            for pid, d in POLICIES.items()
        },
    )
    started = time.monotonic()
    seconds = max(SECONDS / 2, 5.0)
    workers = Workers(started + seconds)
    targets: list[Callable[[], None]] = [partial(workers.api, i) for i in range(5)]
    targets += [partial(workers.http, i) for i in range(2)]
    targets.append(workers.async_api)
    threads = [threading.Thread(target=workers.guarded(target)) for target in targets]
    for thread in threads:
        thread.start()
    injected = cycle_faults(server, proxy, started + seconds)
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert not workers.errors, workers.errors[:3]

    decisions: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    admitted: Counter[tuple[str, str, int]] = Counter()
    decided_locally = 0
    modes: Counter[str | None] = Counter()
    for outcome, ip, returned_at in workers.seen:
        assert outcome.decision in DECISIONS, outcome
        assert is_known_reason(outcome.reason), outcome
        decisions[outcome.decision] += 1
        reasons[str(outcome.reason)] += 1
        decided_locally += outcome.backend_mode == "fallback"
        modes[outcome.backend_mode] += 1
        if outcome.decision == "allowed" and outcome.backend_mode == "redis":
            assert outcome.reset_after is not None
            window_end = round((returned_at + outcome.reset_after) * 1000 / PERIOD_MS)
            admitted[(outcome.policy, ip, window_end)] += 1
    assert set(workers.statuses) <= {200, 429, 503}, workers.statuses
    assert max(admitted.values()) <= LIMIT, admitted.most_common(3)

    # What Redis itself holds: never more than the limit charged in a window, and never
    # fewer charges than the admissions callers saw in that window (a retry finds its
    # charge in the counter's evaluation-id ledger: it never charges twice, and a charge
    # is never lost).
    with server.client() as admin:
        ledger = read_ledger(admin, PERIOD_MS)
    assert ledger.counts and max(ledger.counts.values()) <= LIMIT, ledger.counts
    seen_by_counter: Counter[tuple[str, int]] = Counter()
    for (policy_id, ip, window_end), count in admitted.items():
        policy = django_quota.policies.get_policy(policy_id)
        key = counter_key("quota", policy, limiter.get_limiter().identity(policy, {"ip": ip}))
        seen_by_counter[(key, window_end * PERIOD_MS - PERIOD_MS)] += count
    compared = 0
    for key, count in ledger.counts.items():
        seen = seen_by_counter[(key, ledger.starts[key])]
        assert seen <= count, (key, seen, count)
        compared += seen > 0
    assert compared, "no counter was compared with what its callers saw"

    assert decisions["allowed"] and decisions["denied"], decisions
    assert reasons["indeterminate"], "dropped and late replies must show as indeterminate"
    if fallback:
        assert decided_locally and not reasons["backend_unavailable"] + reasons["backend_timeout"]
    else:
        assert reasons["backend_unavailable"] and not decided_locally
    counts: dict[str, float] = {
        "seconds": round(time.monotonic() - started, 1),
        "evaluations": len(workers.seen),
        "allowed": decisions["allowed"],
        "denied": decisions["denied"],
        "failed_open": decisions["failed_open"],
        "failed_closed": decisions["failed_closed"],
        **{f"backend_mode {mode}": count for mode, count in modes.items()},
        "counters compared with their callers": compared,
        "max admitted in one window (redis)": max(ledger.counts.values()),
        **{f"reason {reason}": count for reason, count in reasons.items()},
        **{f"http {status}": count for status, count in workers.statuses.items()},
        **{f"fault {name}": count for name, count in injected.items()},
    }
    phase = "fallback on" if fallback else "fallback off"
    REPORT.counts.update({f"{phase}: {name}": count for name, count in counts.items()})
