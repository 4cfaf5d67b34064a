"""The Python process's own instructions per decision against a private redis-server,
counted by callgrind: ``aevaluate`` at 64 concurrent tasks (where the event loop is the
bottleneck, docs/benchmarks.md) and a sync ``evaluate``, both on the bulk
``fixed_window`` policy.

``python -m benchmarks.redis_instructions`` starts one redis-server (not counted) and
runs each row twice under ``valgrind --tool=callgrind`` (:mod:`benchmarks.python_instructions`'
method: two decision counts, the difference of the totals over the difference of the
counts, ``PYTHONHASHSEED=0``), flushing the server before each run so that both start
from the same counters. ``python -m benchmarks.redis_instructions ROW DECISIONS URL`` is
one counted run.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import django_settings as bench_settings
from benchmarks.python_instructions import total_instructions
from benchmarks.redis_server import RedisServer

ASYNC_64 = "aevaluate-64"
SYNC = "evaluate"
ROWS = (ASYNC_64, SYNC)
TASKS = 64
#: The two decision counts whose difference is counted (the docs' 640 and 3,840).
FEWER, MORE = 640, 3840
SUBJECTS = 256


def main(argv: Sequence[str]) -> int:
    row, decisions, url = argv[0], int(argv[1]), argv[2]
    bench_settings.configure(url, 100)
    from django_quota import aevaluate, evaluate

    policy = bench_settings.bulk_id("fixed_window")
    subjects = [f"127.40.{i // 250}.{i % 250 + 1}" for i in range(SUBJECTS)]
    if row == SYNC:
        for index in range(2 * SUBJECTS + decisions):
            evaluate(policy, {"ip": subjects[index % SUBJECTS]})
        return 0

    async def body() -> None:
        async def task(index: int, count: int) -> None:
            for i in range(count):
                await aevaluate(policy, {"ip": subjects[(index * 4 + i) % SUBJECTS]})

        # Warm-up: every subject, the pipeline's connections opened.
        await asyncio.gather(*(task(index, 2 * SUBJECTS // TASKS) for index in range(TASKS)))
        await asyncio.gather(*(task(index, decisions // TASKS) for index in range(TASKS)))

    asyncio.run(body())
    return 0


def _counted(server: RedisServer, row: str, decisions: int) -> int:
    client = server.client()
    client.flushall()
    client.close()
    with tempfile.TemporaryDirectory(prefix="django-quota-rcallgrind-") as workdir:
        output = Path(workdir) / "callgrind.out"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={output}",
                sys.executable,
                "-m",
                "benchmarks.redis_instructions",
                row,
                str(decisions),
                server.url,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=900,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        return total_instructions(output.read_text())


def per_decision(server: RedisServer, row: str) -> float:
    """The Python process's instructions per decision of ``row``."""
    return (_counted(server, row, MORE) - _counted(server, row, FEWER)) / (MORE - FEWER)


def report(rows: Sequence[str] = ROWS) -> None:
    with RedisServer() as server:
        for row in rows:
            print(f"{row}: {per_decision(server, row):,.0f} instructions per decision")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        raise SystemExit(main(sys.argv[1:]))
    report(sys.argv[1:] or ROWS)
