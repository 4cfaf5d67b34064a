"""The engine's measurements (``docs/benchmarks.md``, "The engine"): what a busy server
meets, django-quota beside ``limits`` in the same run, interleaved round by round.

- a hammering client: one subject at ``HAMMER_FACTOR`` times its limit, sync; the
  median µs of a denied decision and the Redis calls per request;
- async throughput at each of ``TASKS`` concurrent tasks in one event loop, with the
  Redis CPU per decision, and the p50 at one task;
- a cold burst: ``BURST`` concurrent async decisions on one subject, from a process
  whose backend has no connection yet; what was decided and how many connections the
  server received.

Every loop is bounded by a count; the figures are kept as plain numbers
(:class:`EngineFigures`), saved with ``--json`` and read back by ``--from-json``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from benchmarks import django_settings as bench_settings
from benchmarks import measure

DQ = "django-quota"
LIMITS = "limits"
IMPLEMENTATIONS = (DQ, LIMITS)
#: The hammered policy's limit per hour, and how many times it is asked per round.
HAMMER_LIMIT = bench_settings.HAMMER_LIMIT
HAMMER_FACTOR = 10
#: Concurrent tasks of the async throughput loops.
TASKS = (1, 16, 64, 256)
#: Concurrent decisions of the cold burst.
BURST = 1000

#: A decision: True admitted, False denied; a failure raises.
Hit = Callable[[str], bool]
AHit = Callable[[str], Awaitable[bool]]


class Failed(RuntimeError):
    """A decision that was neither admitted nor denied (django-quota ``failed_*``)."""


@dataclass
class EngineFigures:
    """The engine's figures of one run, by implementation (:data:`DQ`, :data:`LIMITS`).

    ``hammer``: ``denied_p50_us``, ``calls_per_request``. ``concurrency``: by number of
    tasks (as text, for JSON), ``throughput`` (decisions/s), ``cpu_us`` (Redis CPU per
    decision), ``p50_us``. ``burst``: ``allowed``, ``denied``, ``failed``,
    ``connections``, ``seconds``, ``limit``.
    """

    hammer: dict[str, dict[str, float]] = field(default_factory=dict)
    concurrency: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    burst: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"hammer": self.hammer, "concurrency": self.concurrency, "burst": self.burst}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineFigures:
        def floats(values: Mapping[str, Any]) -> dict[str, float]:
            return {str(name): float(value) for name, value in values.items()}

        return cls(
            hammer={str(k): floats(v) for k, v in data.get("hammer", {}).items()},
            concurrency={
                str(impl): {str(tasks): floats(v) for tasks, v in by_tasks.items()}
                for impl, by_tasks in data.get("concurrency", {}).items()
            },
            burst={str(k): floats(v) for k, v in data.get("burst", {}).items()},
        )


# -- the contenders' decisions ---------------------------------------------------------------
def _verdict(outcome: Any) -> bool:
    if outcome.decision.startswith("failed"):
        raise Failed(f"{outcome.policy}: {outcome.decision} ({outcome.reason})")
    return bool(outcome.decision == "allowed")


def dq_hit(policy_id: str) -> Hit:
    from django_quota import evaluate

    return lambda subject: _verdict(evaluate(policy_id, {"ip": subject}))


def dq_ahit(policy_id: str) -> AHit:
    """Made inside the event loop that awaits it."""
    from django_quota import aevaluate

    async def hit(subject: str) -> bool:
        return _verdict(await aevaluate(policy_id, {"ip": subject}))

    return hit


def limits_hit(redis_url: str, rate: str) -> Hit:
    import limits
    from limits.storage import storage_from_string
    from limits.strategies import FixedWindowRateLimiter

    limiter = FixedWindowRateLimiter(storage_from_string(redis_url))
    item = limits.parse(rate)
    return lambda subject: bool(limiter.hit(item, "engine", subject))


def limits_ahit(redis_url: str, rate: str) -> AHit:
    """Made inside the event loop that awaits it: a new storage (its pool is the loop's)."""
    import limits
    from limits.aio.storage import Storage
    from limits.aio.strategies import FixedWindowRateLimiter
    from limits.storage import storage_from_string

    # redis-py's asyncio pool refuses a connection past its bound (MaxConnectionsError):
    # room for every task of the largest row, as a service at that concurrency sets.
    storage = storage_from_string(
        f"async+{redis_url}", implementation="redispy", max_connections=2 * max(TASKS)
    )
    if not isinstance(storage, Storage):
        raise TypeError("limits gave no async storage")
    limiter = FixedWindowRateLimiter(storage)
    item = limits.parse(rate)

    async def hit(subject: str) -> bool:
        return bool(await limiter.hit(item, "engine", subject))

    return hit


# -- the measurements -----------------------------------------------------------------------
@dataclass
class _Samples:
    """What the rounds of one measurement collect, before medians are taken."""

    latencies_ns: list[int] = field(default_factory=list)
    throughputs: list[float] = field(default_factory=list)
    calls: int = 0
    cpu: float = 0.0
    decisions: int = 0


def round_trips(admin: redis.Redis) -> int:
    """Script calls the server has run (``EVALSHA`` and ``EVAL``): each one a round trip
    of a client. Both libraries decide with one script call and send nothing else here;
    the commands a script runs itself are not round trips."""
    calls = measure.command_calls(admin)
    return calls["evalsha"] + calls["eval"]


def hammer(hit: Hit, subject: str, admin: redis.Redis, samples: _Samples) -> None:
    """``HAMMER_FACTOR x HAMMER_LIMIT`` decisions on ``subject`` in a row: the latency of
    each denied one, and the Redis round trips of all (:func:`round_trips`)."""
    clock = time.perf_counter_ns
    before = round_trips(admin)
    for _ in range(HAMMER_FACTOR * HAMMER_LIMIT):
        started = clock()
        admitted = hit(subject)
        took = clock() - started
        if not admitted:
            samples.latencies_ns.append(took)
    samples.calls += round_trips(admin) - before
    samples.decisions += HAMMER_FACTOR * HAMMER_LIMIT


def concurrent(
    make: Callable[[], AHit], pool: list[str], decisions: int, tasks: int, admin: redis.Redis,
    samples: _Samples,
) -> None:
    """``tasks`` tasks in one event loop sharing ``decisions`` decisions over ``pool``:
    throughput, Redis CPU over the timed part, and each decision's latency at one task."""
    share = max(1, decisions // tasks)
    size = len(pool)

    async def body() -> None:
        hit = make()
        await asyncio.gather(*(hit(pool[i % size]) for i in range(tasks)))  # connections made
        clock = time.perf_counter_ns

        async def task(index: int) -> None:
            offset = index * (size // tasks)
            for i in range(share):
                if tasks == 1:
                    started = clock()
                    await hit(pool[(offset + i) % size])
                    samples.latencies_ns.append(clock() - started)
                else:
                    await hit(pool[(offset + i) % size])

        cpu = measure.server_cpu(admin)
        started = time.perf_counter()
        await asyncio.gather(*(task(index) for index in range(tasks)))
        elapsed = time.perf_counter() - started
        samples.cpu += measure.server_cpu(admin) - cpu
        samples.throughputs.append(share * tasks / elapsed)
        samples.decisions += share * tasks

    asyncio.run(body())


def connections_received(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_connections_received"])


def cold_burst(make: Callable[[], AHit], subject: str, admin: redis.Redis) -> dict[str, float]:
    """:data:`BURST` concurrent decisions on ``subject`` in a new event loop, from a
    backend with no connection yet (``make`` builds it): the verdicts, the failures, the
    connections the server received, the wall time."""

    async def body() -> list[bool | BaseException]:
        hit = make()
        return list(
            await asyncio.gather(*(hit(subject) for _ in range(BURST)), return_exceptions=True)
        )

    before = connections_received(admin)
    started = time.perf_counter()
    verdicts = asyncio.run(body())
    seconds = time.perf_counter() - started
    # The INFO client keeps its one connection: every new one is the burst's.
    connections = connections_received(admin) - before
    return {
        "allowed": float(sum(verdict is True for verdict in verdicts)),
        "denied": float(sum(verdict is False for verdict in verdicts)),
        "failed": float(sum(isinstance(verdict, BaseException) for verdict in verdicts)),
        "connections": float(connections),
        "seconds": seconds,
    }


# -- the run ---------------------------------------------------------------------------------
def _fresh_quota(redis_url: str, limit: int, prefix: str) -> Any:
    """``override_settings`` giving django-quota a new limiter (no connection yet), a new
    key prefix (fresh counters) and the library's own ``TIMEOUT`` and ``DEADLINE``: what
    an ASGI worker that starts under traffic has."""
    from django.test import override_settings

    quota = bench_settings.quota_settings(redis_url, limit)
    quota["KEY_PREFIX"] = prefix
    del quota["TIMEOUT"], quota["DEADLINE"]
    return override_settings(QUOTA=quota)


def _p50_us(latencies_ns: list[int]) -> float:
    return statistics.median(latencies_ns) / 1000 if latencies_ns else 0.0


def run(
    redis_url: str, admin: redis.Redis, limit: int, decisions: int, rounds: int
) -> EngineFigures:
    """Every engine measurement, ``rounds`` interleaved rounds (django-quota then limits
    within each), medians over the rounds."""
    hammers = {impl: _Samples() for impl in IMPLEMENTATIONS}
    by_tasks = {impl: {tasks: _Samples() for tasks in TASKS} for impl in IMPLEMENTATIONS}
    bursts: dict[str, list[dict[str, float]]] = {impl: [] for impl in IMPLEMENTATIONS}
    pool = measure.subjects(256, block=20)
    hammer_rate = f"{HAMMER_LIMIT}/hour"
    exact_rate = f"{limit}/day"
    limits_hammer = limits_hit(redis_url, hammer_rate)
    for round_number in range(rounds):
        admin.flushall()
        subject = f"127.30.{round_number}.1"
        hammer(dq_hit(bench_settings.HAMMER_POLICY), subject, admin, hammers[DQ])
        hammer(limits_hammer, subject, admin, hammers[LIMITS])
        for tasks in TASKS:
            concurrent(
                lambda: dq_ahit(bench_settings.bulk_id("fixed_window")),
                pool, decisions, tasks, admin, by_tasks[DQ][tasks],
            )
            concurrent(
                lambda: limits_ahit(redis_url, f"{bench_settings.BULK_LIMIT}/hour"),
                pool, decisions, tasks, admin, by_tasks[LIMITS][tasks],
            )
        burst_subject = f"127.31.{round_number}.1"
        with _fresh_quota(redis_url, limit, f"burst{round_number}"):
            result = cold_burst(lambda: dq_ahit(bench_settings.exact_id("fixed_window")),
                                burst_subject, admin)
        bursts[DQ].append({**result, "limit": float(limit)})
        result = cold_burst(lambda: limits_ahit(redis_url, exact_rate), burst_subject, admin)
        bursts[LIMITS].append({**result, "limit": float(limit)})
    figures = EngineFigures()
    for impl in IMPLEMENTATIONS:
        samples = hammers[impl]
        figures.hammer[impl] = {
            "denied_p50_us": _p50_us(samples.latencies_ns),
            "calls_per_request": samples.calls / samples.decisions,
        }
        figures.concurrency[impl] = {
            str(tasks): {
                "throughput": statistics.median(found.throughputs),
                "cpu_us": found.cpu / found.decisions * 1e6,
                "p50_us": _p50_us(found.latencies_ns),
            }
            for tasks, found in by_tasks[impl].items()
        }
        # The worst round of the burst: a goal holds only if it held every time.
        figures.burst[impl] = max(
            bursts[impl], key=lambda found: (found["failed"], found["connections"])
        )
    return figures


def table(figures: EngineFigures) -> list[str]:
    """The engine's lines of the report."""
    out = ["", "the engine (docs/benchmarks.md, \"The engine\"):", ""]
    for impl in IMPLEMENTATIONS:
        found = figures.hammer.get(impl)
        if found:
            out.append(
                f"- hammering client, {impl}: denied decision {found['denied_p50_us']:.1f} µs "
                f"p50, {found['calls_per_request']:.3f} Redis calls per request "
                f"({HAMMER_FACTOR}x a limit of {HAMMER_LIMIT})"
            )
    for tasks in TASKS:
        cells = []
        for impl in IMPLEMENTATIONS:
            found = figures.concurrency.get(impl, {}).get(str(tasks))
            if found:
                cells.append(
                    f"{impl} {found['throughput']:,.0f} dec/s, Redis CPU "
                    f"{found['cpu_us']:.1f} µs/dec"
                    + (f", p50 {found['p50_us']:.0f} µs" if tasks == 1 else "")
                )
        if cells:
            out.append(f"- async, {tasks} task{'s' if tasks > 1 else ''}: " + "; ".join(cells))
    for impl in IMPLEMENTATIONS:
        found = figures.burst.get(impl)
        if found:
            out.append(
                f"- cold burst of {BURST}, {impl} (worst round): {found['allowed']:.0f} allowed "
                f"(limit {found['limit']:.0f}), {found['denied']:.0f} denied, "
                f"{found['failed']:.0f} failed, {found['connections']:.0f} connections, "
                f"{found['seconds']:.2f} s"
            )
    return out
