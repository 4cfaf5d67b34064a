"""The Python process's own instructions per decision of the memory rows, counted by
callgrind: the memory backends do no I/O, so their cost is all in the process.

``python -m benchmarks.python_instructions ROW DECISIONS`` makes ``DECISIONS`` decisions
of ``ROW`` (after a warm-up over every subject); :func:`per_decision` runs it twice under
``valgrind --tool=callgrind``, with two decision counts, and divides the difference of
the totals by the difference of the counts, so that the interpreter's start, imports and
warm-up cancel out (both runs with ``PYTHONHASHSEED=0``: string hashes, hence dict and
set probing, are then the same from run to run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import django_settings as bench_settings

DQ_MEMORY = "django-quota (memory)"
LIMITS_MEMORY = "limits (memory)"
ROWS = (DQ_MEMORY, LIMITS_MEMORY)
#: The two decision counts whose difference is counted.
FEWER, MORE = 200, 1200
SUBJECTS = 256


def _decide(row: str) -> Callable[[str], object]:
    if row == DQ_MEMORY:
        bench_settings.configure("redis://127.0.0.1:1/0", 100)  # never connected to
        from django.test import override_settings

        override_settings(
            QUOTA=bench_settings.quota_settings("redis://127.0.0.1:1/0", 100, backend="memory")
        ).enable()
        from django_quota import evaluate

        policy = bench_settings.bulk_id("fixed_window")
        return lambda subject: evaluate(policy, {"ip": subject})
    import limits
    from limits.storage import MemoryStorage
    from limits.strategies import FixedWindowRateLimiter

    limiter = FixedWindowRateLimiter(MemoryStorage())
    item = limits.parse(f"{bench_settings.BULK_LIMIT}/hour")
    return lambda subject: limiter.hit(item, "bench", subject)


def main(argv: Sequence[str]) -> int:
    row, decisions = argv[0], int(argv[1])
    decide = _decide(row)
    subjects = [f"127.40.{i // 250}.{i % 250 + 1}" for i in range(SUBJECTS)]
    for index in range(2 * SUBJECTS):
        decide(subjects[index % SUBJECTS])
    for index in range(decisions):
        decide(subjects[index % SUBJECTS])
    return 0


def total_instructions(text: str) -> int:
    """The instruction total of a callgrind output file (its ``totals:`` line, else its
    ``summary:`` line). Raises ``ValueError`` when it has neither."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        for label in ("totals:", "summary:"):
            if line.startswith(label):
                found[label] = int(line.split()[1])
    for label in ("totals:", "summary:"):
        if label in found:
            return found[label]
    raise ValueError("no totals or summary line in the callgrind output")


def _counted(row: str, decisions: int) -> int:
    with tempfile.TemporaryDirectory(prefix="django-quota-pycallgrind-") as workdir:
        output = Path(workdir) / "callgrind.out"
        subprocess.run(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={output}",
                sys.executable, "-m", "benchmarks.python_instructions", row, str(decisions),
            ],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600,
            # The same hash seed in both runs: dict and set work then repeats exactly.
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        return total_instructions(output.read_text())


def per_decision(row: str) -> float:
    """The Python process's instructions per decision of ``row``."""
    return (_counted(row, MORE) - _counted(row, FEWER)) / (MORE - FEWER)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
