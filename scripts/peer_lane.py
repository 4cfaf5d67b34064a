"""What the peer lanes share (``scripts/drf_lane``, ``scripts/ratelimit_lane``): a peer's
own tests, from its source distribution downloaded at test time (never copied into this
repository), run against django-quota's drop-in once on the memory backend and once on a
throwaway redis-server, each run's failing set held to the lane's
``expected-failures.txt``.

A lane is a :class:`Lane`: where its files are, what to download, how to make the
downloaded source into the tests to run (:attr:`Lane.prepare`: extract, rewrite the
import lines), and how it runs them. :func:`main` does the rest: download, prepare, run,
compare, print; it exits non-zero when a run's failing set differs from the pinned one
or a step fails (a missing network or pip failure included: nothing is skipped).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

RUNS = ("memory", "redis")
DOWNLOAD_TIMEOUT = 300  # seconds
RUN_TIMEOUT = 600  # seconds per pytest run


class LaneError(Exception):
    """A step of the lane failed (not a test: the lane itself)."""


@dataclass
class RunResult:
    name: str
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        text = f"{len(self.passed)} passed, {len(self.failed)} failed"
        return text + (f", {len(self.skipped)} skipped" if self.skipped else "")


@dataclass(frozen=True)
class Lane:
    """One peer lane.

    ``title`` names it in its output (``DRF lane``); ``here`` is its folder (its
    ``expected-failures.txt``, pytest plugin and settings module); ``project`` and
    ``version`` the sdist to download; ``prepare(archive, work)`` extracts it under
    ``work`` and rewrites the test module's import lines, returning the directory the
    tests run from; ``test_file`` the test module there; ``classname_prefix`` what a test
    id drops of its junit class name; ``plugin`` the pytest plugin beside the lane;
    ``settings`` the ``DJANGO_SETTINGS_MODULE`` (None: the peer's own conftest sets it);
    ``redis_url_variable`` the variable giving the plugin the Redis run's URL.
    """

    title: str
    here: Path
    project: str
    version: str
    prepare: Callable[[Path, Path], Path]
    test_file: Path
    classname_prefix: str
    plugin: str
    redis_url_variable: str
    settings: str | None = None

    @property
    def expected(self) -> Path:
        return self.here / "expected-failures.txt"


def download(lane: Lane, into: Path) -> Path:
    """The lane's sdist in ``into`` (pip's errors are the lane's errors)."""
    requirement = f"{lane.project}=={lane.version}"
    command = [
        sys.executable, "-m", "pip", "download", "--quiet",
        "--no-binary", ":all:", "--no-deps", requirement, "-d", str(into),
    ]  # fmt: skip
    try:
        subprocess.run(command, check=True, timeout=DOWNLOAD_TIMEOUT)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise LaneError(f"pip download of {requirement} failed: {exc}") from exc
    # An sdist's name spells a hyphen of the project's name as "-" or, newer, "_".
    archives = sorted(into.glob(lane.project.replace("-", "[-_]") + "-*.tar.gz"))
    if len(archives) != 1:
        raise LaneError(f"expected one source distribution in {into}, found {archives}")
    return archives[0]


def unpack(archive: Path, into: Path, test_file: Path) -> Path:
    """Extract ``archive`` into ``into``: its one top directory, which must hold
    ``test_file``."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    roots = [path for path in into.iterdir() if path.is_dir()]
    if len(roots) != 1 or not (roots[0] / test_file).is_file():
        raise LaneError(f"{archive.name} has no {test_file}")
    return roots[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; its URL. Always stopped."""
    import redis

    port = free_port()
    command = [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    try:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise LaneError("redis-server not found (install Debian's redis-server)") from exc
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise LaneError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
            finally:
                client.close()
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_tests(
    lane: Lane, source: Path, name: str, redis_url: str | None, report: Path
) -> RunResult:
    dropped = ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", lane.redis_url_variable)
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env["PYTHONPATH"] = str(lane.here)
    if lane.settings is not None:
        env["DJANGO_SETTINGS_MODULE"] = lane.settings
    if redis_url is not None:
        env[lane.redis_url_variable] = redis_url
    command = [
        sys.executable, "-m", "pytest", str(lane.test_file),
        "-p", lane.plugin, "-p", "no:cacheprovider",
        "-q", "--tb=line", f"--junitxml={report}",
    ]  # fmt: skip
    print(f"== {lane.title} ({name}): {' '.join(command[2:])}", flush=True)
    try:
        completed = subprocess.run(command, cwd=source, env=env, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise LaneError(f"the {name} run took over {RUN_TIMEOUT} s") from exc
    if completed.returncode not in (0, 1):  # 1: some tests failed; anything else: broken
        raise LaneError(f"the {name} run exited {completed.returncode}")
    return parse_report(lane, name, report)


def parse_report(lane: Lane, name: str, report: Path) -> RunResult:
    result = RunResult(name)
    for case in ElementTree.parse(report).iter("testcase"):
        owner = case.get("classname", "").removeprefix(lane.classname_prefix)
        test_id = f"{owner.lstrip('.')}::{case.get('name')}".lstrip(":")
        if case.find("failure") is not None or case.find("error") is not None:
            result.failed.append(test_id)
        elif case.find("skipped") is not None:
            result.skipped.append(test_id)
        else:
            result.passed.append(test_id)
    if not result.passed and not result.failed:
        raise LaneError(f"the {name} run ran no test")
    return result


def expected_failures(lane: Lane, run: str, pinned: Path | None = None) -> dict[str, str]:
    """Test id -> reason, of the tests the lane's ``expected-failures.txt`` (or
    ``pinned``) expects to fail in ``run``."""
    pinned = pinned or lane.expected
    expected: dict[str, str] = {}
    for number, line in enumerate(pinned.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        entry, _, reason = line.partition(" -- ")
        parts = entry.split()
        if len(parts) != 2 or parts[0] not in (*RUNS, "*") or not reason.strip():
            raise LaneError(f"{pinned.name}:{number}: expected '<run> <test id> -- <reason>'")
        if parts[0] in (run, "*"):
            expected[parts[1]] = reason.strip()
    return expected


def compare(lane: Lane, result: RunResult, pinned: Path | None = None) -> list[str]:
    """Lines describing how ``result`` differs from the expected failures (none: pinned)."""
    expected = expected_failures(lane, result.name, pinned)
    name = (pinned or lane.expected).name
    problems = [
        f"{result.name}: {test} fails but is not in {name}"
        for test in sorted(set(result.failed) - set(expected))
    ]
    problems += [
        f"{result.name}: {test} passes (or did not run) but {name} expects it to "
        f"fail ({expected[test]}): remove it from the list"
        for test in sorted(set(expected) - set(result.failed))
    ]
    return problems


def main(lane: Lane, description: str, argv: list[str] | None = None) -> int:
    """Download, prepare, run each of ``--runs``, print, compare: 0 when every run's
    failing set is the pinned one."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    args = parser.parse_args(argv)
    prefix = "django-quota-" + lane.title.lower().replace(" ", "-") + "-"
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        (work / "download").mkdir()
        source = lane.prepare(download(lane, work / "download"), work)
        print(f"== {lane.title}: {lane.project} {lane.version}, {lane.test_file}, django_quota")
        results = []
        for run in args.runs:
            report = work / f"{run}.xml"
            if run == "redis":
                with redis_server() as url:
                    results.append(run_tests(lane, source, run, url, report))
            else:
                results.append(run_tests(lane, source, run, None, report))
    problems: list[str] = []
    print(f"== {lane.title} summary")
    for result in results:
        print(f"{result.name}: {result.summary}")
        reasons = expected_failures(lane, result.name)
        for test in sorted(result.failed):
            why = f" (expected: {reasons[test]})" if test in reasons else " (NOT expected)"
            print(f"  failed: {test}{why}")
        problems += compare(lane, result)
    for problem in problems:
        print(f"{lane.title}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def cli(lane: Lane, description: str) -> None:
    """Run :func:`main` as a script: exit 2 when a step of the lane itself fails."""
    try:
        sys.exit(main(lane, description))
    except LaneError as exc:
        print(f"{lane.title}: {exc}", file=sys.stderr)
        sys.exit(2)
