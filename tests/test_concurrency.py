"""Exactness under concurrency on a real redis-server (docs/arithmetic.md): 16 threads and 4
processes on one subject admit exactly the limit, for every algorithm, for multi-window
policies and for multi-policy groups, also while scripts are flushed mid-traffic."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_quota import limiter, policies
from django_quota.core.protocol import decode_counter

THREADS = 16
PROCESSES = 4
ATTEMPTS_PER_WORKER = 12  # 192 attempts by threads, 48 by processes
SUBJECT = {"ip": "198.51.100.77", "user": "u-1"}

#: (case, policies, group ids, expected admitted). Windows are hours or days, and no run
#: starts within CASE_BOUND of the hour (_clear_of_the_hour), so no boundary falls inside
#: a run; token buckets refill less than one token.
CASES: list[tuple[str, dict[str, Any], list[str], int]] = []
for _algorithm in ("fixed_window", "sliding_window", "sliding_log", "token_bucket"):
    CASES.append((f"{_algorithm}", {"p": {"algorithm": _algorithm, "windows": "37/h"}}, ["p"], 37))
    CASES.append(
        (
            f"{_algorithm}-windows",
            {"p": {"algorithm": _algorithm, "windows": {"burst": "41/h", "sustained": "29/d"}}},
            ["p"],
            29,
        )
    )
    CASES.append(
        (
            f"{_algorithm}-policies",
            {
                "a": {"algorithm": _algorithm, "windows": "23/h", "selector": ["ip"]},
                "b": {"algorithm": "fixed_window", "windows": "31/h", "selector": ["user"]},
            },
            ["a", "b"],
            23,
        )
    )


def _admit(group_ids: list[str], attempts: int, start: Callable[[], Any] | None = None) -> int:
    group = [policies.get_policy(policy_id) for policy_id in group_ids]
    if start is not None:
        start()
    admitted = 0
    for _ in range(attempts):
        outcomes = limiter.evaluate_policies(group, SUBJECT)
        assert all(o.decision in ("allowed", "denied") for o in outcomes), outcomes
        if all(o.decision == "allowed" for o in outcomes):
            admitted += 1
    return admitted


def _configure(quota: Any, redis_url: str, definitions: dict[str, Any]) -> None:
    # Generous timeouts: two cores run 16 workers here, and a failure would lower the count.
    quota(REDIS_URL=redis_url, TIMEOUT=5.0, DEADLINE=10.0, POLICIES=definitions)
    _clear_of_the_hour()


#: Seconds a case may take, and so how close to the hour it may not start.
CASE_BOUND = 60.0


def _clear_of_the_hour() -> None:
    """Wait until the next hour boundary (every day's too) is more than CASE_BOUND
    seconds away: on the server clock (this host's, for a redis-server on loopback) a
    boundary inside a run would start a fixed window afresh mid-count, and the count
    would pass the limit. At most once an hour, for at most CASE_BOUND + 1 seconds."""
    left = 3600 - time.time() % 3600
    if left <= CASE_BOUND:
        time.sleep(left + 1)


def _counter_values(redis_client: Any, algorithm: str, window_count: int) -> list[int]:
    """The window counts (``c<i>``) of every counter in Redis (sliding-log lists skipped)."""
    counts = []
    for key in redis_client.keys("*"):
        if redis_client.type(key) != b"string":  # sliding_log lists
            continue
        state, _ = decode_counter(redis_client.get(key), algorithm, window_count)
        assert state is not None
        counts += [value for name, value in state.items() if name.startswith("c")]
    return counts


@pytest.mark.parametrize(
    ("case", "definitions", "group_ids", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_sixteen_threads_admit_exactly_the_limit(
    quota: Any,
    redis_url: str,
    case: str,
    definitions: dict[str, Any],
    group_ids: list[str],
    expected: int,
) -> None:
    _configure(quota, redis_url, definitions)
    barrier = threading.Barrier(THREADS)
    results: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        count = _admit(group_ids, ATTEMPTS_PER_WORKER, barrier.wait)
        with lock:
            results.append(count)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == THREADS
    assert sum(results) == expected
    for policy_id in group_ids:
        assert limiter.peek(policy_id, SUBJECT).decision == (
            "denied" if policy_id == group_ids[0] else "allowed"
        )


def _process_worker(group_ids: list[str], barrier: Any, queue: Any) -> None:
    limiter.settings_changed()  # a fresh pool in this process
    queue.put(_admit(group_ids, ATTEMPTS_PER_WORKER, barrier.wait))


@pytest.mark.parametrize(
    ("case", "definitions", "group_ids", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_four_processes_admit_exactly_the_limit(
    quota: Any,
    redis_url: str,
    case: str,
    definitions: dict[str, Any],
    group_ids: list[str],
    expected: int,
) -> None:
    _configure(quota, redis_url, definitions)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(PROCESSES)
    queue = context.Queue()
    limiter.settings_changed()
    workers = [
        context.Process(target=_process_worker, args=(group_ids, barrier, queue))
        for _ in range(PROCESSES)
    ]
    for process in workers:
        process.start()
    counts = [queue.get(timeout=120) for _ in workers]
    for process in workers:
        process.join(timeout=30)
        assert process.exitcode == 0
    # 48 attempts: the limit (23..37) is below, so exactly the limit is admitted
    assert sum(counts) == expected


def test_script_flush_mid_traffic_loses_no_decision(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    _configure(quota, redis_url, {"p": {"algorithm": "sliding_window", "windows": "53/h"}})
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            redis_client.script_flush()
            stop.wait(0.002)

    flushing = threading.Thread(target=flusher)
    flushing.start()
    try:
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(_admit(["p"], 12))) for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        stop.set()
        flushing.join()
    assert sum(results) == 53
    assert sorted(_counter_values(redis_client, "sliding_window", 1)) == [53]
