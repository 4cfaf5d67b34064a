"""The measurements: latency and throughput loops, Redis command counts, Redis memory per
subject, and admitted-versus-limit under concurrency. Every loop is bounded by a count."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from benchmarks.contenders import Decide

#: Commands the benchmark itself sends while a count is running (never the contenders').
OWN_COMMANDS = frozenset({"info"})


def subjects(count: int, block: int) -> list[str]:
    """``count`` distinct client addresses (loopback-range strings used as identities only;
    nothing is ever sent to them)."""
    return [f"127.{block}.{i // 250}.{i % 250 + 1}" for i in range(count)]


@dataclass
class Timing:
    """One single-thread loop: per-decision latencies and the loop's wall time."""

    latencies_ns: list[int]
    elapsed_ns: int

    @property
    def throughput(self) -> float:
        return len(self.latencies_ns) / (self.elapsed_ns / 1e9)


def single_thread(decide: Decide, pool: Sequence[str], decisions: int) -> Timing:
    """``decisions`` decisions in a row, round-robin over ``pool``, each one timed."""
    clock = time.perf_counter_ns
    latencies = [0] * decisions
    size = len(pool)
    start = clock()
    for i in range(decisions):
        before = clock()
        decide(pool[i % size])
        latencies[i] = clock() - before
    return Timing(latencies, clock() - start)


def _run_threads(threads: int, target: Callable[[int], None]) -> float:
    """Start ``threads`` workers on a barrier; return the seconds from release to the last
    one's end. A worker's exception is re-raised here."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        barrier.wait()
        try:
            target(index)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for thread in workers:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in workers:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


def multi_thread(decide: Decide, pool: Sequence[str], decisions: int, threads: int) -> float:
    """Throughput (decisions/s) of ``threads`` threads sharing ``decisions`` decisions, each
    cycling through the subjects from its own offset."""
    share = max(1, decisions // threads)
    size = len(pool)

    def target(index: int) -> None:
        offset = index * (size // threads)
        for i in range(share):
            decide(pool[(offset + i) % size])

    elapsed = _run_threads(threads, target)
    return share * threads / elapsed


@dataclass
class Exactness:
    admitted: int
    limit: int
    attempts: int


def exactness(decide: Decide, subject: str, limit: int, threads: int, attempts: int) -> Exactness:
    """``threads`` threads x ``attempts`` decisions on one subject, released together."""
    admitted = [0] * threads

    def target(index: int) -> None:
        count = 0
        for _ in range(attempts):
            if decide(subject):
                count += 1
        admitted[index] = count

    _run_threads(threads, target)
    return Exactness(sum(admitted), limit, threads * attempts)


# -- Redis bookkeeping -------------------------------------------------------------------
def command_calls(admin: redis.Redis) -> Counter[str]:
    """``INFO commandstats`` as command -> calls (the benchmark's own INFO left out).

    Redis counts the commands a Lua script runs (``redis.call``) as well as the
    ``EVALSHA`` that ran it."""
    stats: dict[str, Any] = admin.info("commandstats")
    calls: Counter[str] = Counter()
    for name, values in stats.items():
        command = name.removeprefix("cmdstat_")
        if command not in OWN_COMMANDS:
            calls[command] = int(values["calls"])
    return calls


def server_cpu(admin: redis.Redis) -> float:
    """CPU seconds the redis-server process has used (user + system, ``INFO cpu``)."""
    info: dict[str, Any] = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
    return Counter({name: after[name] - before[name] for name in after}) + Counter()


def client_commands(server_url: str, decide: Decide, pool: Sequence[str], decisions: int) -> float:
    """Commands the client itself sends per decision (Lua's ``redis.call`` left out),
    counted with ``MONITOR`` over a short sample of ``decisions``."""
    marker = f"django-quota-bench-{uuid.uuid4().hex}"
    watcher = redis.Redis.from_url(server_url, socket_timeout=10.0)
    sender = redis.Redis.from_url(server_url, socket_timeout=10.0)
    sent = 0
    try:
        sender.ping()  # connect now: a connection's handshake (HELLO) is not a decision's
        for i in range(min(decisions, len(pool))):  # nor is a reconnect of the contender
            decide(pool[i])
        with watcher.monitor() as monitor:  # type: ignore[no-untyped-call]
            for i in range(decisions):
                decide(pool[i % len(pool)])
            sender.echo(marker)
            for _ in range(100_000):  # bounded: the marker arrives after the sample
                entry = monitor.next_command()
                if marker in entry["command"]:
                    break
                if entry["client_type"] != "lua":
                    sent += 1
            else:
                raise RuntimeError("MONITOR never showed the marker")
    finally:
        watcher.close()
        sender.close()
    return sent / decisions


@dataclass
class Footprint:
    """Redis memory of everything one subject created (the database held nothing else)."""

    keys: int
    bytes: int
    by_kind: dict[str, tuple[int, int]] = field(default_factory=dict)


def footprint(admin: redis.Redis, classify: Callable[[str], str] | None = None) -> Footprint:
    """``MEMORY USAGE ... SAMPLES 0`` (every element counted) summed over all keys."""
    total_keys = 0
    total_bytes = 0
    by_kind: dict[str, tuple[int, int]] = {}
    for raw in admin.scan_iter(count=1000):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        usage = admin.memory_usage(raw, samples=0) or 0
        total_keys += 1
        total_bytes += int(usage)
        if classify is not None:
            kind = classify(key)
            keys, size = by_kind.get(kind, (0, 0))
            by_kind[kind] = (keys + 1, size + int(usage))
    return Footprint(total_keys, total_bytes, by_kind)
