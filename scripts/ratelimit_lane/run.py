"""The django-ratelimit lane: django-ratelimit's own ``tests.py`` against
``django_quota.ratelimit``.

1. ``pip download --no-binary :all: --no-deps django-ratelimit==4.1.0`` into a temporary
   directory; nothing of django-ratelimit's is ever copied into this repository.
2. Extract it there, keep only ``django_ratelimit/__init__.py`` (its constants) and
   ``django_ratelimit/tests.py``, and rewrite only the import lines of the latter
   (``from django_ratelimit.<module> import`` -> ``from django_quota.ratelimit.<module>
   import``). Its dotted paths (``"django_ratelimit.tests.mykey"``) name its own module.
3. Run it under ``django_quota_ratelimit_lane_settings`` (beside this file, no
   ``QUOTA``) with the plugin ``django_quota_ratelimit_lane``: once on the memory
   backend, once on a throwaway redis-server (``--save '' --appendonly no`` on a free
   loopback port, always stopped) that the default cache, hence the counters, live on,
   with ``django_quota.testing.reset()`` before each test.
4. Print each run's summary and failing tests, and exit non-zero when a run's failing
   set differs from ``expected-failures.txt`` or a step fails (a missing network or pip
   failure included: nothing is skipped).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected-failures.txt"
VERSION = "4.1.0"
PACKAGE = Path("django_ratelimit")
TEST_FILE = PACKAGE / "tests.py"
KEPT = ("__init__.py", "tests.py")
SETTINGS = "django_quota_ratelimit_lane_settings"
REDIS_URL_VARIABLE = "DJANGO_QUOTA_RATELIMIT_LANE_REDIS_URL"
# An import line of one of django-ratelimit's modules (a parenthesised import goes on over
# more lines; only its first line names the module).
IMPORT_RE = re.compile(r"^from django_ratelimit\.(\w+) import ", re.MULTILINE)
EXPECTED_MODULES = {"core", "decorators", "exceptions"}
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


def download(into: Path) -> Path:
    """django-ratelimit's sdist in ``into`` (pip's errors are the lane's errors)."""
    command = [
        sys.executable, "-m", "pip", "download", "--quiet",
        "--no-binary", ":all:", "--no-deps", f"django-ratelimit=={VERSION}",
        "-d", str(into),
    ]  # fmt: skip
    try:
        subprocess.run(command, check=True, timeout=DOWNLOAD_TIMEOUT)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise LaneError(f"pip download of django-ratelimit=={VERSION} failed: {exc}") from exc
    archives = sorted(into.glob("django*ratelimit-*.tar.gz"))
    if len(archives) != 1:
        raise LaneError(f"expected one source distribution in {into}, found {archives}")
    return archives[0]


def extract(archive: Path, into: Path) -> Path:
    """The directory holding django-ratelimit's ``__init__.py`` and ``tests.py`` only."""
    unpacked = into / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    roots = [path for path in unpacked.iterdir() if path.is_dir()]
    if len(roots) != 1 or not (roots[0] / TEST_FILE).is_file():
        raise LaneError(f"{archive.name} has no {TEST_FILE}")
    source = into / "source"
    (source / PACKAGE).mkdir(parents=True)
    for name in KEPT:
        shutil.copy(roots[0] / PACKAGE / name, source / PACKAGE / name)
    return source


def rewrite_imports(text: str) -> str:
    """Point the import lines of django-ratelimit's tests at ``django_quota.ratelimit``."""
    modules = set(IMPORT_RE.findall(text))
    if modules != EXPECTED_MODULES:
        raise LaneError(
            f"{TEST_FILE} imports {sorted(modules)} of django_ratelimit, expected "
            f"{sorted(EXPECTED_MODULES)}"
        )
    return IMPORT_RE.sub(r"from django_quota.ratelimit.\1 import ", text)


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


def run_tests(source: Path, name: str, redis_url: str | None, report: Path) -> RunResult:
    dropped = ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", REDIS_URL_VARIABLE)
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env["PYTHONPATH"] = str(HERE)
    env["DJANGO_SETTINGS_MODULE"] = SETTINGS
    if redis_url is not None:
        env[REDIS_URL_VARIABLE] = redis_url
    command = [
        sys.executable, "-m", "pytest", str(TEST_FILE),
        "-p", "django_quota_ratelimit_lane", "-p", "no:cacheprovider",
        "-q", "--tb=line", f"--junitxml={report}",
    ]  # fmt: skip
    print(f"== django-ratelimit lane ({name}): {' '.join(command[2:])}", flush=True)
    try:
        completed = subprocess.run(command, cwd=source, env=env, timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise LaneError(f"the {name} run took over {RUN_TIMEOUT} s") from exc
    if completed.returncode not in (0, 1):  # 1: some tests failed; anything else: broken
        raise LaneError(f"the {name} run exited {completed.returncode}")
    return parse_report(name, report)


def parse_report(name: str, report: Path) -> RunResult:
    result = RunResult(name)
    for case in ElementTree.parse(report).iter("testcase"):
        owner = case.get("classname", "").removeprefix("django_ratelimit.tests")
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


def expected_failures(run: str) -> dict[str, str]:
    """Test id -> reason, of the tests ``expected-failures.txt`` expects to fail in ``run``."""
    expected: dict[str, str] = {}
    for number, line in enumerate(EXPECTED.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        entry, _, reason = line.partition(" -- ")
        parts = entry.split()
        if len(parts) != 2 or parts[0] not in (*RUNS, "*") or not reason.strip():
            raise LaneError(f"{EXPECTED.name}:{number}: expected '<run> <test id> -- <reason>'")
        if parts[0] in (run, "*"):
            expected[parts[1]] = reason.strip()
    return expected


def compare(result: RunResult) -> list[str]:
    """Lines describing how ``result`` differs from the expected failures (none: pinned)."""
    expected = expected_failures(result.name)
    problems = [
        f"{result.name}: {test} fails but is not in {EXPECTED.name}"
        for test in sorted(set(result.failed) - set(expected))
    ]
    problems += [
        f"{result.name}: {test} passes (or did not run) but {EXPECTED.name} expects it to "
        f"fail ({expected[test]}): remove it from the list"
        for test in sorted(set(expected) - set(result.failed))
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="django-quota-ratelimit-lane-") as tmp:
        work = Path(tmp)
        (work / "download").mkdir()
        source = extract(download(work / "download"), work)
        test_file = source / TEST_FILE
        test_file.write_text(rewrite_imports(test_file.read_text()))
        print(f"== django-ratelimit lane: django-ratelimit {VERSION} tests.py, django_quota")
        results = []
        for run in args.runs:
            report = work / f"{run}.xml"
            if run == "redis":
                with redis_server() as url:
                    results.append(run_tests(source, run, url, report))
            else:
                results.append(run_tests(source, run, None, report))
    problems: list[str] = []
    print("== django-ratelimit lane summary")
    for result in results:
        print(f"{result.name}: {result.summary}")
        reasons = expected_failures(result.name)
        for test in sorted(result.failed):
            why = f" (expected: {reasons[test]})" if test in reasons else " (NOT expected)"
            print(f"  failed: {test}{why}")
        problems += compare(result)
    for problem in problems:
        print(f"django-ratelimit lane: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LaneError as exc:
        print(f"django-ratelimit lane: {exc}", file=sys.stderr)
        sys.exit(2)
