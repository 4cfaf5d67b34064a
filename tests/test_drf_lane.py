"""The DRF lane's pinning (``scripts/drf_lane/run.py``): a run's failing set must equal
``expected-failures.txt`` in both directions. The lane itself runs in CI through
``scripts/drf-tests``; these tests pin its bookkeeping without the network."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

RUN_PY = Path(__file__).resolve().parent.parent / "scripts" / "drf_lane" / "run.py"


@pytest.fixture
def lane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("drf_lane_run", RUN_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look the module up
    spec.loader.exec_module(module)
    expected = tmp_path / "expected-failures.txt"
    expected.write_text(
        "# comment\n"
        "* A::test_both -- fails everywhere\n"
        "redis B::test_redis_only -- only on Redis\n"
    )
    monkeypatch.setattr(module, "EXPECTED", expected)
    return module


def test_the_pinned_failures_pass_the_lane(lane: ModuleType) -> None:
    memory = lane.RunResult("memory", passed=["B::test_redis_only"], failed=["A::test_both"])
    redis = lane.RunResult("redis", failed=["A::test_both", "B::test_redis_only"])
    assert lane.compare(memory) == []
    assert lane.compare(redis) == []
    assert memory.summary == "1 passed, 1 failed"


def test_a_new_failure_fails_the_lane(lane: ModuleType) -> None:
    result = lane.RunResult("memory", failed=["A::test_both", "C::test_new"])
    assert lane.compare(result) == [
        "memory: C::test_new fails but is not in expected-failures.txt"
    ]


def test_a_test_that_starts_passing_must_leave_the_list(lane: ModuleType) -> None:
    result = lane.RunResult("redis", passed=["A::test_both"], failed=["B::test_redis_only"])
    assert lane.compare(result) == [
        "redis: A::test_both passes (or did not run) but expected-failures.txt expects it "
        "to fail (fails everywhere): remove it from the list"
    ]


def test_a_malformed_line_is_a_lane_error(lane: ModuleType) -> None:
    lane.EXPECTED.write_text("A::test_both without run or reason\n")
    with pytest.raises(lane.LaneError, match="expected '<run> <test id> -- <reason>'"):
        lane.expected_failures("memory")


def test_the_repository_list_names_only_the_tests_drf_ships(lane: ModuleType) -> None:
    lane.EXPECTED = RUN_PY.parent / "expected-failures.txt"
    memory = lane.expected_failures("memory")
    assert memory == lane.expected_failures("redis")
    assert "SimpleRateThrottleTests::test_wait_returns_correct_waiting_time_without_history" in (
        memory
    )
    assert len(memory) == 1  # every other DRF test passes against the drop-ins
