"""The benchmark run: start a private redis-server, measure every row, print the table.

``.venv/bin/python -m benchmarks [--decisions N] [--rounds R] ...`` (``scripts/bench``
installs the peers first). Rows are measured in rounds, interleaved, so that a burst of
noise from a neighbour on a shared machine hits every row alike; throughput is the median
over rounds, latency percentiles pool every round's samples.

``--json FILE`` saves the run's results, ``--plot FILE`` draws its chart (a PNG), and
``--from-json FILE`` prints the report of a saved run, and with ``--plot`` charts it,
without measuring anything.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import signal
import statistics
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import FrameType

import redis

from benchmarks import aio, engine, instructions, measure, report, saved
from benchmarks.contenders import BULK, DQ, EXACT, Contender, Decide, all_contenders
from benchmarks.redis_server import RedisServer

MEMORY_DECISIONS = (1, 100)
DEFAULT_DECISIONS = 3000
DEFAULT_COUNTED = instructions.DEFAULT_DECISIONS
#: Untimed decisions before each timed loop (connections made, scripts loaded).
WARMUP = 200


@dataclass
class RowResult:
    """Everything measured for one row."""

    contender: Contender
    latencies_ns: list[int] = field(default_factory=list)
    throughput_1: list[float] = field(default_factory=list)
    throughput_n: list[float] = field(default_factory=list)
    commands: Counter[str] = field(default_factory=Counter)
    counted_decisions: int = 0
    server_cpu: float = 0.0
    sent_per_decision: float | None = None
    footprints: dict[int, measure.Footprint] = field(default_factory=dict)
    exactness: measure.Exactness | None = None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="django-quota against its peers on a private, loopback redis-server.",
    )
    parser.add_argument(
        "--decisions",
        type=int,
        default=None,
        help="decisions per row, per loop, per round (3000; with --instructions, decisions "
        "counted per row: 1000)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--threads", type=int, default=8, help="threads of the threaded loop")
    parser.add_argument("--subjects", type=int, default=256, help="subjects cycled through")
    parser.add_argument("--limit", type=int, default=100, help="limit L of the exactness test")
    parser.add_argument(
        "--attempts", type=int, default=50, help="exactness: attempts per thread on one subject"
    )
    parser.add_argument(
        "--monitor-sample", type=int, default=20, help="decisions watched with MONITOR"
    )
    parser.add_argument(
        "--only", default="", help="measure only rows whose name contains this text"
    )
    parser.add_argument(
        "--max-seconds", type=int, default=600, help="abort (and stop Redis) after this long"
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also save the run's results to FILE (JSON)"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="also draw the p50 chart into FILE (PNG; needs matplotlib, in the bench extra)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="measure nothing: print the report of a run saved with --json (and chart it "
        "with --plot); the measuring options are then those saved",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="measure nothing else: count the server's instructions per decision with "
        "callgrind (needs valgrind)",
    )
    args = parser.parse_args(argv)
    if args.decisions is None:
        args.decisions = DEFAULT_COUNTED if args.instructions else DEFAULT_DECISIONS
    if args.instructions and (args.json or args.plot or args.from_json):
        parser.error("--instructions prints its own table: no --json, --plot or --from-json")
    if args.from_json is not None and args.json is not None:
        parser.error("--json saves a run that is measured; --from-json measures nothing")
    if args.from_json is not None and not args.from_json.is_file():
        parser.error(f"--from-json: no file {args.from_json}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install -e '.[bench]'")
    for name in ("decisions", "rounds", "threads", "subjects", "limit", "attempts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.monitor_sample < 1:
        parser.error("--monitor-sample must be >= 1")
    return args


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError("benchmark exceeded --max-seconds")


def _classify(contender: Contender) -> report.Classifier | None:
    if DQ not in contender.implementation:
        return None

    def classify(key: str) -> str:
        # A sliding-log list's key has its window's digit right before the hash tag.
        return "sliding-log lists" if key.split("{", 1)[0][-1:].isdigit() else "counters"

    return classify


@contextlib.contextmanager
def _counted(admin: redis.Redis, result: RowResult, decisions: int) -> Iterator[None]:
    """Redis commands and CPU over the block, added to ``result``."""
    before = measure.command_calls(admin)
    cpu_before = measure.server_cpu(admin)
    yield
    cpu_after = measure.server_cpu(admin)
    after = measure.command_calls(admin)
    result.server_cpu += cpu_after - cpu_before
    result.commands.update(measure.delta(before, after))
    result.counted_decisions += decisions


def measure_round(
    admin: redis.Redis, result: RowResult, pool: Sequence[str], args: argparse.Namespace
) -> None:
    contender = result.contender
    warmup = min(WARMUP, args.decisions)
    with contender.context():
        admin.flushall()
        if contender.amake is not None:
            timing = aio.single_loop(
                contender.amake,
                BULK,
                pool,
                args.decisions,
                warmup,
                counted=lambda: _counted(admin, result, args.decisions),
            )
            throughput_n = aio.concurrent(contender.amake, BULK, pool, args.decisions, args.threads)
        else:
            decide = contender.decide(BULK)
            measure.single_thread(decide, pool, warmup)
            with _counted(admin, result, args.decisions):
                timing = measure.single_thread(decide, pool, args.decisions)
            throughput_n = measure.multi_thread(decide, pool, args.decisions, args.threads)
        result.latencies_ns.extend(timing.latencies_ns)
        result.throughput_1.append(timing.throughput)
        result.throughput_n.append(throughput_n)


@contextlib.contextmanager
def _sync_decide(contender: Contender, kind: str) -> Iterator[Decide]:
    if contender.amake is not None:
        with aio.bridged(contender.amake, kind) as decide:
            yield decide
    else:
        yield contender.decide(kind)


def measure_once(
    admin: redis.Redis,
    server_url: str,
    result: RowResult,
    index: int,
    pool: Sequence[str],
    args: argparse.Namespace,
) -> None:
    contender = result.contender
    with contender.context():
        if contender.uses_redis:
            with _sync_decide(contender, BULK) as decide:
                admin.flushall()
                result.sent_per_decision = measure.client_commands(
                    server_url, decide, pool, args.monitor_sample
                )
                admin.flushall()
                subject = f"127.254.{index}.1"
                done = 0
                for target in MEMORY_DECISIONS:
                    for _ in range(target - done):
                        decide(subject)
                    done = target
                    result.footprints[target] = measure.footprint(admin, _classify(contender))
        if not contender.exact:
            return
        admin.flushall()
        subject = f"127.253.{index}.1"
        if contender.amake is not None:
            result.exactness = aio.exactness(
                contender.amake, EXACT, subject, args.limit, args.threads, args.attempts
            )
        else:
            result.exactness = measure.exactness(
                contender.decide(EXACT), subject, args.limit, args.threads, args.attempts
            )


def select(contenders: Sequence[Contender], only: str) -> list[Contender]:
    """The rows whose name contains ``only`` (any case), with the base rows of the
    whole-request rows among them (an added cost needs its base)."""
    if not only:
        return list(contenders)
    chosen = {c.key for c in contenders if only.lower() in c.name.lower()}
    chosen |= {c.base for c in contenders if c.key in chosen and c.base is not None}
    return [c for c in contenders if c.key in chosen]


def wants_engine(only: str) -> bool:
    """Whether the engine's measurements run: always, unless ``--only`` names rows and
    not ``engine``. They need limits (the peer of every engine figure)."""
    found = importlib.util.find_spec("limits") is not None
    return found and only.lower() in ("", "engine")


def _versions(extra: dict[str, str], redis_version: str) -> list[str]:
    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    parts = [
        f"python {platform.python_version()}",
        f"redis-server {redis_version}",
        f"redis-py {installed('redis')}",
        f"hiredis {installed('hiredis')}",
        f"Django {installed('Django')}",
        f"django-quota {installed('django-quota')}",
    ]
    parts += [f"{name} {value}" for name, value in sorted(extra.items())]
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.instructions:
        return instructions.run(args)
    if args.from_json is not None:
        try:
            run = saved.read(args.from_json)
        except ValueError as exc:
            print(f"--from-json: {exc}", file=sys.stderr)
            return 2
    else:
        run = measure_run(args)
        if args.json is not None:
            saved.write(args.json, run)
            print(f"results saved to {args.json}", file=sys.stderr)
    print(run.report())
    if args.plot is not None:
        from benchmarks import chart

        chart.plot(run.rows, args.plot, subtitle=subtitle(run))
        print(f"chart drawn to {args.plot}", file=sys.stderr)
    return 0


def subtitle(run: saved.SavedRun) -> str:
    """The chart's second line: the run's size and the versions measured."""
    settings = run.settings
    rounds = settings.get("rounds", 0)
    size = (
        f"{settings.get('decisions', 0)} decisions per row and loop, {rounds} interleaved "
        f"round{'' if rounds == 1 else 's'}, {run.cores} cores"
    )
    return textwrap.fill("; ".join([size, *run.header]), 140)


def measure_run(args: argparse.Namespace) -> saved.SavedRun:
    """Start redis-server, measure every row selected, stop it: the run's results."""
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(args.max_seconds)
    started = time.monotonic()
    notes: list[str] = []
    versions: dict[str, str] = {}
    figures: engine.EngineFigures | None = None
    try:
        with RedisServer() as server:
            from benchmarks import django_settings

            pid = server.process.pid if server.process else "?"
            print(
                f"redis-server {server.version} on {server.url} (pid {pid}), stopped at the end",
                file=sys.stderr,
            )

            django_settings.configure(server.url, args.limit)
            contenders = all_contenders(server.url, args.limit, notes, versions)
            contenders = select(contenders, args.only)
            results = [RowResult(contender) for contender in contenders]
            pool = measure.subjects(args.subjects, block=10)
            admin = server.client()
            try:
                for round_number in range(args.rounds):
                    print(f"round {round_number + 1}/{args.rounds} ...", file=sys.stderr)
                    for result in results:
                        measure_round(admin, result, pool, args)
                print("commands, memory and exactness ...", file=sys.stderr)
                for index, result in enumerate(results):
                    measure_once(admin, server.url, result, index, pool, args)
                if wants_engine(args.only):
                    print("the engine ...", file=sys.stderr)
                    figures = engine.run(
                        server.url, admin, args.limit, args.decisions, args.rounds
                    )
            finally:
                admin.close()
            header = _versions(versions, server.version)
    finally:
        signal.alarm(0)
    return saved.SavedRun(
        rows=[report_row(result) for result in results],
        header=header,
        notes=notes,
        settings=saved.settings_of(args),
        cores=os.cpu_count() or 0,
        seconds=time.monotonic() - started,
        engine=figures,
    )


def report_row(result: RowResult) -> report.Row:
    contender = result.contender
    latencies = sorted(result.latencies_ns)
    p99_index = min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))
    commands = None
    cpu_us = None
    breakdown: dict[str, float] = {}
    if contender.uses_redis and result.counted_decisions:
        total = sum(result.commands.values())
        commands = total / result.counted_decisions
        cpu_us = result.server_cpu / result.counted_decisions * 1e6
        breakdown = {
            name: calls / result.counted_decisions for name, calls in result.commands.most_common()
        }
    return report.Row(
        key=contender.key,
        reference=contender.reference,
        base=contender.base,
        implementation=contender.implementation,
        algorithm=contender.algorithm,
        median_us=statistics.median(latencies) / 1000,
        p99_us=latencies[p99_index] / 1000,
        throughput_1=statistics.median(result.throughput_1),
        throughput_n=statistics.median(result.throughput_n),
        commands=commands,
        server_cpu_us=cpu_us,
        command_breakdown=breakdown,
        sent=result.sent_per_decision,
        footprints=result.footprints,
        exactness=result.exactness,
    )
