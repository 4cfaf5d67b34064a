"""``--instructions``: the server's CPU instructions per decision, counted by callgrind.

Timings move with the machine's load; instruction counts do not (the same binary, inputs
and environment give the same count). This mode runs the redis-server under
``valgrind --tool=callgrind``, collecting only inside ``processCommand`` (every command a
client sends: its lookup, ACL check and execution, scripts included; not the reading and
writing of sockets), and prints, for every decision row that talks to Redis, the
instructions per decision and the ratio to limits' row of the same algorithm (the rows
the Redis CPU goals compare). Needs ``valgrind`` and ``callgrind_control`` on ``PATH``
(Debian: ``apt-get install valgrind``) and a redis-server whose ``processCommand`` symbol
is visible (Debian's exports it).

``scripts/bench --instructions [--decisions N] [--only TEXT]``: each row gets
``2 x --subjects`` untimed decisions, then the counters are zeroed and ``N`` decisions
counted (default 1,000; ``--decisions`` sets it).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import contenders as c
from benchmarks import measure
from benchmarks.contenders import BULK, Contender
from benchmarks.python_instructions import total_instructions
from benchmarks.redis_server import RedisServer

COLLECTED = "processCommand"
#: Decisions counted per row unless ``--decisions`` says otherwise.
DEFAULT_DECISIONS = 1000
#: valgrind starts redis-server about 50 times slower than it runs natively.
START_TIMEOUT = 60.0
#: django-quota row -> the limits row its ratio is taken to (the Redis CPU goals').
PEERS = {
    c.DQ_FIXED: c.LIMITS_FIXED,
    c.DQ_SLIDING: c.LIMITS_SLIDING,
    c.DQ_TOKEN: c.LIMITS_FIXED,
    c.DQ_SLIDING_LOG: c.LIMITS_MOVING,
}


@dataclass(frozen=True)
class Counted:
    """One row: instructions per decision and Redis commands per decision."""

    name: str
    key: str
    instructions: float
    commands: float


def peers_installed() -> bool:
    """Whether limits (the bench extra) is installed."""
    return importlib.util.find_spec("limits") is not None


def missing_tools() -> list[str]:
    """The tools this mode needs that are not on ``PATH``."""
    return [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]


def _control(option: str, pid: str) -> None:
    """``callgrind_control -z`` (zero the counters) or ``-d`` (dump them) for ``pid``."""
    subprocess.run(
        ["callgrind_control", option, pid],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _commands(info: dict[str, dict[str, int]]) -> int:
    return sum(int(stats.get("calls", 0)) for stats in info.values())


def count_rows(
    make_contenders: Callable[[str], list[Contender]],
    decisions: int,
    subjects: int,
    binary: str = "redis-server",
) -> list[Counted]:
    """Start redis-server under callgrind, count every row ``make_contenders(url)`` gives
    (after ``django_settings.configure(url, ...)``), stop it."""
    from benchmarks import django_settings

    workdir = Path(tempfile.mkdtemp(prefix="django-quota-callgrind-"))
    output = workdir / "callgrind.out"
    prefix = (
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={output}",
        f"--toggle-collect={COLLECTED}",
        "--collect-atstart=no",
    )
    counted: list[Counted] = []
    try:
        with RedisServer(binary, prefix=prefix, start_timeout=START_TIMEOUT) as server:
            assert server.process is not None
            pid = str(server.process.pid)
            print(f"redis-server {server.version} under callgrind (pid {pid})", file=sys.stderr)
            django_settings.configure(server.url, 100)
            contenders = make_contenders(server.url)
            admin = server.client()
            pool = measure.subjects(subjects, block=10)
            for contender in contenders:
                admin.flushall()  # peers' keys may collide (limits' strategies share names)
                with contender.context():
                    decide = contender.decide(BULK)
                    for index in range(2 * len(pool)):
                        decide(pool[index % len(pool)])
                    for stale in workdir.glob("callgrind.out*"):
                        stale.unlink()
                    # The INFO calls stay outside the counted span; the first one is
                    # itself in the second one's figures.
                    before = _commands(admin.info("commandstats"))
                    _control("-z", pid)
                    for index in range(decisions):
                        decide(pool[index % len(pool)])
                    _control("-d", pid)
                    commands = _commands(admin.info("commandstats")) - before - 1
                    dumps = sorted(workdir.glob("callgrind.out.*"))
                    if not dumps:
                        raise RuntimeError("callgrind wrote no dump")
                    total = sum(total_instructions(path.read_text()) for path in dumps)
                counted.append(
                    Counted(contender.name, contender.key, total / decisions, commands / decisions)
                )
                print(f"  {contender.name}: {total / decisions:,.0f}", file=sys.stderr)
            admin.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return counted


def table(counted: Sequence[Counted]) -> str:
    """The report: one line per row, with its ratio to limits' row where it has one."""
    by_key = {row.key: row for row in counted}
    lines = [
        "| row | server instructions per decision | Redis commands per decision | ratio |",
        "|---|---:|---:|---|",
    ]
    for row in counted:
        ratio = ""
        peer = by_key.get(PEERS.get(row.key, ""))
        if peer is not None and peer.instructions:
            ratio = f"{row.instructions / peer.instructions:.2f}x {peer.name}"
        lines.append(
            f"| {row.name} | {row.instructions:,.0f} | {row.commands:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def selected(contenders: Sequence[Contender], only: str) -> list[Contender]:
    """The sync decision rows that talk to Redis (no whole requests: their scripts are
    the decision rows'), whose name contains ``only``."""
    return [
        contender
        for contender in contenders
        if contender.uses_redis
        and contender.make is not None
        and contender.base is None
        and not contender.key.startswith("request/")
        and only in contender.name
    ]


def run(args: argparse.Namespace) -> int:
    """The ``--instructions`` mode of ``python -m benchmarks``: 0, or 2 when a tool is
    missing."""
    missing = missing_tools()
    if missing:
        print(
            f"--instructions needs {' and '.join(missing)} (Debian: apt-get install valgrind)",
            file=sys.stderr,
        )
        return 2
    from benchmarks.contenders import all_contenders

    notes: list[str] = []
    versions: dict[str, str] = {}

    def make_contenders(url: str) -> list[Contender]:
        return selected(all_contenders(url, 100, notes, versions), args.only)

    counted = count_rows(make_contenders, args.decisions, args.subjects)
    print(
        f"server instructions per decision (callgrind, collected in {COLLECTED}; "
        f"{args.decisions} decisions per row, {args.subjects} subjects)"
    )
    print(table(counted))
    python_counts: dict[str, float] = {}
    if args.only.lower() in ("", "memory"):
        from benchmarks import python_instructions

        print("", "Python instructions per decision of the memory rows (callgrind, the "
              "whole process; the difference of two runs):", sep="\n")
        for row in python_instructions.ROWS:
            if row == python_instructions.LIMITS_MEMORY and not peers_installed():
                print(f"- {row}: limits is not installed (pip install -e '.[bench]')")
                continue
            python_counts[row] = python_instructions.per_decision(row)
            print(f"- {row}: {python_counts[row]:,.0f}")
    lease_lines: list[str] = []
    if args.only.lower() in ("", "concurrency"):
        from benchmarks import leases

        lease_lines = leases.goal_lines(*leases.lease_bytes())
    print("", "goals (printed, never asserted):", sep="\n")
    for line in [*instruction_goals(counted, python_counts), *lease_lines]:
        print(f"- {line}")
    for note in notes:
        print(f"- {note}")
    return 0


#: Server instructions per decision (issue 24, "One call").
SERVER_GOALS = {c.DQ_FIXED: 62_000, c.DQ_SLIDING: 67_000}
#: A concurrency policy's acquire and release together, at most this times a fixed
#: window's decision (issue 26).
CONCURRENCY_GOAL = 2.0
#: The memory backend's Python instructions per decision, at most this times limits'.
MEMORY_GOAL = 2.0
#: A calendar month's server instructions, at most this times the epoch-aligned fixed
#: window's (issue 26).
CALENDAR_GOAL = 1.05


def instruction_goals(counted: Sequence[Counted], python_counts: dict[str, float]) -> list[str]:
    """One line per instruction goal: the figure, the target, PASS or MISS."""
    by_key = {row.key: row for row in counted}
    lines = []
    for key, limit in SERVER_GOALS.items():
        row = by_key.get(key)
        if row is None:
            lines.append(f"{key}: not measured (target <= {limit:,})")
            continue
        verdict = "PASS" if row.instructions <= limit else "MISS"
        lines.append(f"{row.name}: {row.instructions:,.0f} server instructions per decision "
                     f"(target <= {limit:,}): {verdict}")
    leases, fixed = by_key.get(c.DQ_CONCURRENCY), by_key.get(c.DQ_FIXED)
    if leases is None or fixed is None or not fixed.instructions:
        lines.append(f"{c.DQ_CONCURRENCY} / {c.DQ_FIXED}: not measured "
                     f"(target <= {CONCURRENCY_GOAL:.2f}x)")
    else:
        ratio = leases.instructions / fixed.instructions
        verdict = "PASS" if round(ratio, 2) <= CONCURRENCY_GOAL else "MISS"
        lines.append(f"{leases.name} / {fixed.name} server instructions: {ratio:.2f}x "
                     f"({leases.instructions:,.0f} / {fixed.instructions:,.0f}; target <= "
                     f"{CONCURRENCY_GOAL:.2f}x): {verdict}")
    from benchmarks import python_instructions as p

    ours, theirs = python_counts.get(p.DQ_MEMORY), python_counts.get(p.LIMITS_MEMORY)
    if ours is None or not theirs:
        lines.append(f"{p.DQ_MEMORY} / {p.LIMITS_MEMORY}: not measured "
                     f"(target <= {MEMORY_GOAL:.2f}x)")
    else:
        ratio = ours / theirs
        verdict = "PASS" if round(ratio, 2) <= MEMORY_GOAL else "MISS"
        lines.append(f"{p.DQ_MEMORY} / {p.LIMITS_MEMORY} Python instructions: {ratio:.2f}x "
                     f"({ours:,.0f} / {theirs:,.0f}; target <= {MEMORY_GOAL:.2f}x): {verdict}")
    calendar, fixed = by_key.get(c.DQ_CALENDAR), by_key.get(c.DQ_FIXED)
    if calendar is None or fixed is None or not fixed.instructions:
        lines.append(f"{c.DQ_CALENDAR} / {c.DQ_FIXED}: not measured "
                     f"(target <= {CALENDAR_GOAL:.2f}x)")
    else:
        ratio = calendar.instructions / fixed.instructions
        verdict = "PASS" if round(ratio, 2) <= CALENDAR_GOAL else "MISS"
        lines.append(f"{calendar.name} / {fixed.name} server instructions: {ratio:.3f}x "
                     f"({calendar.instructions:,.0f} / {fixed.instructions:,.0f}; "
                     f"target <= {CALENDAR_GOAL:.2f}x): {verdict}")
    return lines
