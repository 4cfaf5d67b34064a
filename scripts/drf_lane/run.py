"""The DRF lane: DRF's own ``tests/test_throttling.py`` against ``django_quota.throttling``.

1. ``pip download --no-binary :all: --no-deps djangorestframework==<installed version>``
   into a temporary directory (DRF's source distribution ships ``tests/``); nothing of
   DRF's is ever copied into this repository.
2. Extract it there and rewrite only the import line of ``tests/test_throttling.py``
   (``from rest_framework.throttling import (`` -> ``from django_quota.throttling
   import (``).
3. Run it with DRF's own ``tests/conftest.py`` plus the plugin
   ``django_quota_drf_lane`` (beside this file: ``django_quota`` joins
   ``INSTALLED_APPS``): once on the memory backend, once on a throwaway redis-server
   (``--save '' --appendonly no`` on a free loopback port, always stopped) with
   ``django_quota.testing.reset()`` before each test.
4. Print each run's summary and failing tests, and exit non-zero when a run's failing
   set differs from ``expected-failures.txt`` or a step fails (a missing network or pip
   failure included: nothing is skipped).
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: peer_lane

import peer_lane
from peer_lane import LaneError, RunResult

__all__ = ["LaneError", "RunResult", "compare", "expected_failures", "main"]

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected-failures.txt"
DRF_IMPORT = "from rest_framework.throttling import ("
OUR_IMPORT = "from django_quota.throttling import ("
TEST_FILE = Path("tests") / "test_throttling.py"


def rewrite_import(source: Path) -> None:
    """Point the throttle import of DRF's test module at ``django_quota.throttling``."""
    path = source / TEST_FILE
    text = path.read_text()
    if text.count(DRF_IMPORT) != 1:
        raise LaneError(f"{TEST_FILE} does not have exactly one {DRF_IMPORT!r} line")
    path.write_text(text.replace(DRF_IMPORT, OUR_IMPORT))


def prepare(archive: Path, work: Path) -> Path:
    """DRF's source tree, extracted under ``work``, its throttle import rewritten."""
    (work / "source").mkdir()
    source = peer_lane.unpack(archive, work / "source", TEST_FILE)
    rewrite_import(source)
    return source


LANE = peer_lane.Lane(
    title="DRF lane",
    here=HERE,
    project="djangorestframework",
    # The installed DRF's own tests: the version CI installs is the one tested.
    version=importlib.metadata.version("djangorestframework"),
    prepare=prepare,
    test_file=TEST_FILE,
    classname_prefix="tests.test_throttling",
    plugin="django_quota_drf_lane",
    redis_url_variable="DJANGO_QUOTA_DRF_LANE_REDIS_URL",
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
