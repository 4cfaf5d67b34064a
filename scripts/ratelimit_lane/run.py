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

import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: peer_lane

import peer_lane
from peer_lane import LaneError, RunResult

__all__ = ["LaneError", "RunResult", "compare", "expected_failures", "main", "rewrite_imports"]

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected-failures.txt"
VERSION = "4.1.0"
PACKAGE = Path("django_ratelimit")
TEST_FILE = PACKAGE / "tests.py"
KEPT = ("__init__.py", "tests.py")
# An import line of one of django-ratelimit's modules (a parenthesised import goes on over
# more lines; only its first line names the module).
IMPORT_RE = re.compile(r"^from django_ratelimit\.(\w+) import ", re.MULTILINE)
EXPECTED_MODULES = {"core", "decorators", "exceptions"}


def rewrite_imports(text: str) -> str:
    """Point the import lines of django-ratelimit's tests at ``django_quota.ratelimit``."""
    modules = set(IMPORT_RE.findall(text))
    if modules != EXPECTED_MODULES:
        raise LaneError(
            f"{TEST_FILE} imports {sorted(modules)} of django_ratelimit, expected "
            f"{sorted(EXPECTED_MODULES)}"
        )
    return IMPORT_RE.sub(r"from django_quota.ratelimit.\1 import ", text)


def prepare(archive: Path, work: Path) -> Path:
    """A directory holding django-ratelimit's ``__init__.py`` (its constants) and
    ``tests.py`` only, the latter's import lines rewritten."""
    unpacked = peer_lane.unpack(archive, work / "unpacked", TEST_FILE)
    source = work / "source"
    (source / PACKAGE).mkdir(parents=True)
    for name in KEPT:
        shutil.copy(unpacked / PACKAGE / name, source / PACKAGE / name)
    test_file = source / TEST_FILE
    test_file.write_text(rewrite_imports(test_file.read_text()))
    return source


LANE = peer_lane.Lane(
    title="django-ratelimit lane",
    here=HERE,
    project="django-ratelimit",
    version=VERSION,
    prepare=prepare,
    test_file=TEST_FILE,
    classname_prefix="django_ratelimit.tests",
    plugin="django_quota_ratelimit_lane",
    redis_url_variable="DJANGO_QUOTA_RATELIMIT_LANE_REDIS_URL",
    settings="django_quota_ratelimit_lane_settings",
)


def expected_failures(run: str) -> dict[str, str]:
    """Test id -> reason, of the tests ``expected-failures.txt`` expects to fail in ``run``."""
    return peer_lane.expected_failures(LANE, run, EXPECTED)


def compare(result: RunResult) -> list[str]:
    """Lines describing how ``result`` differs from the expected failures (none: pinned)."""
    return peer_lane.compare(LANE, result, EXPECTED)


def main(argv: list[str] | None = None) -> int:
    return peer_lane.main(LANE, (__doc__ or "").split("\n\n")[0], argv)


if __name__ == "__main__":
    peer_lane.cli(LANE, (__doc__ or "").split("\n\n")[0])
