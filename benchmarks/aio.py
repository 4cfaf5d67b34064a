"""The async rows' loops: each runs inside one event loop (one ``asyncio.run`` around the
whole loop), so a timed decision is one ``await`` and nothing else.

The async decide function is made inside that loop (``AsyncMaker``): async Redis clients
belong to the loop that first uses them. Every loop is bounded by a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

from benchmarks.contenders import AsyncMaker, Decide
from benchmarks.measure import Exactness, Timing

Counted = Callable[[], contextlib.AbstractContextManager[None]]


def single_loop(
    amake: AsyncMaker,
    kind: str,
    pool: Sequence[str],
    decisions: int,
    warmup: int,
    counted: Counted = contextlib.nullcontext,
) -> Timing:
    """``warmup`` untimed decisions, then ``decisions`` awaited one at a time, each timed,
    round-robin over ``pool``; ``counted()`` is entered around the timed part only."""

    async def body() -> Timing:
        decide = amake(kind)
        size = len(pool)
        for i in range(warmup):
            await decide(pool[i % size])
        clock = time.perf_counter_ns
        latencies = [0] * decisions
        with counted():
            start = clock()
            for i in range(decisions):
                before = clock()
                await decide(pool[i % size])
                latencies[i] = clock() - before
            elapsed = clock() - start
        return Timing(latencies, elapsed)

    return asyncio.run(body())


def concurrent(
    amake: AsyncMaker, kind: str, pool: Sequence[str], decisions: int, tasks: int
) -> float:
    """Throughput (decisions/s) of ``tasks`` tasks in one event loop sharing ``decisions``
    decisions, each cycling through the subjects from its own offset (the async
    counterpart of :func:`benchmarks.measure.multi_thread`)."""
    share = max(1, decisions // tasks)
    size = len(pool)

    async def body() -> float:
        decide = amake(kind)
        # Untimed: one decision per task, so the pool holds its connections already.
        await asyncio.gather(*(decide(pool[i % size]) for i in range(tasks)))

        async def task(index: int) -> None:
            offset = index * (size // tasks)
            for i in range(share):
                await decide(pool[(offset + i) % size])

        start = time.perf_counter()
        await asyncio.gather(*(task(index) for index in range(tasks)))
        return share * tasks / (time.perf_counter() - start)

    return asyncio.run(body())


def exactness(
    amake: AsyncMaker, kind: str, subject: str, limit: int, tasks: int, attempts: int
) -> Exactness:
    """``tasks`` tasks x ``attempts`` decisions on one subject, started together."""

    async def body() -> Exactness:
        decide = amake(kind)

        async def task() -> int:
            count = 0
            for _ in range(attempts):
                if await decide(subject):
                    count += 1
            return count

        admitted = await asyncio.gather(*(task() for _ in range(tasks)))
        return Exactness(sum(admitted), limit, tasks * attempts)

    return asyncio.run(body())


@contextlib.contextmanager
def bridged(amake: AsyncMaker, kind: str) -> Iterator[Decide]:
    """A sync decide function over one event loop kept open for the block: for the
    untimed measurements (``MONITOR`` counts, memory per subject) that drive a row from
    sync code."""
    with asyncio.Runner() as runner:

        async def make() -> Callable[[str], bool]:
            adecide = amake(kind)
            return lambda subject: runner.run(adecide(subject))

        yield runner.run(make())
