"""The command line: parse the arguments, bound the run's time, and run the demo's steps
in order (set up, serve and load, judge, print)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import secrets
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from example_project.demo import SetupError
from example_project.demo.checks import (
    Verdict,
    client_problems,
    compare_server_counts,
    judge_all,
)
from example_project.demo.policies import Policy, load_policies
from example_project.demo.scenario import CLIENT_SPECS, check_clients
from example_project.demo.servers import (
    COMMAND_TIMEOUT,
    GUNICORN_LOG,
    REPO_DIR,
    STARTUP_TIMEOUT,
    STATS_TIMEOUT,
    Server,
    check_loopback_sources,
    check_redis,
    prepare_database,
    redacted,
)
from example_project.demo.tables import (
    print_clients,
    print_counts_not_checked,
    print_ending,
    print_latency,
    print_policies,
    print_samples,
    print_server_counts,
    print_setup,
    print_shadow,
    say,
)
from example_project.demo.traffic import READ_TIMEOUT, Client, Schedule, drive

DEFAULT_SETTINGS_MODULE = "example_project.settings"
LIMITS_MODULE = "example_project.shop.limits"

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_SETUP = 2


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
        "--verbose",
        action="store_true",
        help="also print a sample of each surface's rate-limit headers and 429 body",
    )
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
    budget = (
        STARTUP_TIMEOUT + 3 * COMMAND_TIMEOUT + args.seconds + READ_TIMEOUT + STATS_TIMEOUT + 60
    )
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
    """Set the project up, serve it and load it, then judge and print what happened."""
    redis_url = os.environ.get("REDIS_URL") or None
    workers = choose_workers(args.workers, redis_url)
    key_prefix = f"demo-{secrets.token_hex(6)}"
    env = server_env(args.settings, redis_url, key_prefix)
    settings_module, known = load_project(args.settings, key_prefix)

    backend = f"redis ({redacted(redis_url)})" if redis_url else "memory (per process)"
    database = settings_module.DATABASES["default"]["NAME"]
    print_setup(backend, workers, key_prefix, database, known)

    if redis_url is not None:
        check_redis(redis_url)
    sources = [f"127.0.0.{i + 2}" for i in range(len(CLIENT_SPECS))]
    check_loopback_sources(sources)
    tokens = prepare_database(env)

    GUNICORN_LOG.parent.mkdir(parents=True, exist_ok=True)
    GUNICORN_LOG.write_bytes(b"")
    server = Server(env, workers, GUNICORN_LOG)
    clients = [
        Client(spec, ip, tokens[spec.user] if spec.user else None)
        for spec, ip in zip(CLIENT_SPECS, sources, strict=True)
    ]
    stats = serve_and_load(server, clients, known, args)
    return report(args, known, clients, server, stats)


def choose_workers(requested: int | None, redis_url: str | None) -> int:
    """Choose the gunicorn workers: exactly 1 on the memory backend, 2 to 32 on Redis."""
    if redis_url is None:
        if requested not in (None, 1):
            raise SetupError(
                "without REDIS_URL the memory backend keeps counters per process: "
                "it runs exactly 1 worker"
            )
        return 1
    workers = 3 if requested is None else requested
    if workers < 2:
        raise SetupError("with REDIS_URL set the demo runs 2 or more workers")
    if workers > 32:
        raise SetupError("--workers is capped at 32")
    return workers


def server_env(settings: str, redis_url: str | None, key_prefix: str) -> dict[str, str]:
    """Build the environment of the project's commands and of gunicorn."""
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    env["DJANGO_SETTINGS_MODULE"] = settings
    env["QUOTA_KEY_PREFIX"] = key_prefix
    env["EXAMPLE_QUOTA_STATS"] = "1"  # serve GET /api/quota-stats/ (see settings.py)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def load_project(settings: str, key_prefix: str) -> tuple[Any, dict[str, Policy]]:
    """Import the project's settings; return them and the policies the server enforces,
    after checking that the clients' declared layers are the ones it applies."""
    # The policies the server enforces, read from the very modules it loads.
    os.environ["QUOTA_KEY_PREFIX"] = key_prefix
    sys.path.insert(0, str(REPO_DIR))
    try:
        settings_module = importlib.import_module(settings)
        limits_module = importlib.import_module(LIMITS_MODULE)
    except ImportError as exc:
        raise SetupError(f"cannot import the example project's settings: {exc}") from exc
    known = load_policies(settings_module, limits_module)
    check_clients(known, limits_module)
    return settings_module, known


def serve_and_load(
    server: Server,
    clients: Sequence[Client],
    known: Mapping[str, Policy],
    args: argparse.Namespace,
) -> dict[int, list[dict[str, Any]]]:
    """Start gunicorn, run the clients against it, collect every worker's counters, and
    stop it whatever happens."""
    stop = threading.Event()
    stats: dict[int, list[dict[str, Any]]] = {}
    try:
        server.start()
        say(
            f"gunicorn serving {server.base_url} with worker pids {sorted(server.pids)} "
            f"(log: {GUNICORN_LOG.relative_to(REPO_DIR)})"
        )
        seed = args.seed if args.seed is not None else secrets.randbits(32)
        schedule = Schedule.starting_soon(server.base_url, args.seconds, args.guard_ms, seed)
        say(
            f"Running {len(clients)} clients for {args.seconds:g} s (guard {args.guard_ms} ms "
            f"before window boundaries, seed {seed}) ..."
        )
        drive(clients, known, schedule, stop)
        stats = server.collect_stats()
    finally:
        stop.set()
        status = server.stop()
        if server.process is not None:
            print(f"gunicorn stopped (exit status {status})")
    return stats


def report(
    args: argparse.Namespace,
    known: Mapping[str, Policy],
    clients: Sequence[Client],
    server: Server,
    stats: Mapping[int, Sequence[Mapping[str, Any]]],
) -> int:
    """Judge every client and the server's counters, print the tables, return the status."""
    print_latency(clients)
    print()
    verdicts = judge_all(known, clients)
    print_clients(clients, verdicts)
    notes = client_problems(clients, verdicts)
    print_policies(clients, verdicts)
    print_shadow(known, clients, verdicts)
    counts_ok, count_notes = check_counts(known, clients, verdicts, stats, server.pids)
    notes.extend(count_notes)
    if args.verbose:
        print_samples(clients)
    else:
        print()
        print("(--verbose adds a sample of each surface's rate-limit headers and 429 body)")
    problems = server.log_problems()
    ok = all(v.ok for v in verdicts.values()) and counts_ok and not problems
    print_ending(problems, notes, ok)
    return EXIT_OK if ok else EXIT_MISMATCH


def check_counts(
    known: Mapping[str, Policy],
    clients: Sequence[Client],
    verdicts: Mapping[str, Verdict],
    stats: Mapping[int, Sequence[Mapping[str, Any]]],
    pids: set[int],
) -> tuple[bool, list[str]]:
    """Compare and print the server's counters, unless a worker did not answer (then the
    check is reported as not done, and does not fail the run)."""
    if not pids <= set(stats):
        print_counts_not_checked(stats, pids)
        return True, []
    rows, notes = compare_server_counts(known, clients, verdicts, stats)
    print_server_counts(stats, rows)
    return all(row.ok for row in rows), notes
