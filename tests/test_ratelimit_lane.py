"""The django-ratelimit lane's bookkeeping (``scripts/ratelimit_lane/run.py``): only the
import lines are rewritten, and a run's failing set must equal ``expected-failures.txt``
in both directions. The lane itself runs in CI through ``scripts/ratelimit-tests``;
these tests need no network."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

RUN_PY = Path(__file__).resolve().parent.parent / "scripts" / "ratelimit_lane" / "run.py"

TESTS_PY = """from functools import partial

from django_ratelimit.decorators import ratelimit
from django_ratelimit.exceptions import Ratelimited
from django_ratelimit.core import (get_usage, is_ratelimited,
                                   _split_rate, _get_ip)


def test_path():
    assert ratelimit(key='django_ratelimit.tests.mykey')
"""


@pytest.fixture
def lane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("ratelimit_lane_run", RUN_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look the module up
    spec.loader.exec_module(module)
    expected = tmp_path / "expected-failures.txt"
    expected.write_text(
        "# comment\n* A::test_both -- fails everywhere\nredis B::test_redis_only -- only on Redis\n"
    )
    monkeypatch.setattr(module, "EXPECTED", expected)
    return module


def test_only_the_import_lines_are_rewritten(lane: ModuleType) -> None:
    rewritten = lane.rewrite_imports(TESTS_PY)
    assert rewritten == TESTS_PY.replace("from django_ratelimit.", "from django_quota.ratelimit.")
    assert "key='django_ratelimit.tests.mykey'" in rewritten


def test_an_import_of_another_module_is_a_lane_error(lane: ModuleType) -> None:
    with pytest.raises(
        lane.LaneError, match=r"imports \['core', 'decorators', 'exceptions', 'x'\]"
    ):
        lane.rewrite_imports(TESTS_PY + "from django_ratelimit.x import y\n")


def test_the_pinned_failures_pass_the_lane(lane: ModuleType) -> None:
    memory = lane.RunResult("memory", passed=["B::test_redis_only"], failed=["A::test_both"])
    redis = lane.RunResult("redis", failed=["A::test_both", "B::test_redis_only"])
    assert lane.compare(memory) == []
    assert lane.compare(redis) == []


def test_a_new_failure_or_a_pinned_test_that_passes_fails_the_lane(lane: ModuleType) -> None:
    result = lane.RunResult("redis", passed=["A::test_both"], failed=["C::test_new"])
    assert lane.compare(result) == [
        "redis: C::test_new fails but is not in expected-failures.txt",
        "redis: A::test_both passes (or did not run) but expected-failures.txt expects it "
        "to fail (fails everywhere): remove it from the list",
        "redis: B::test_redis_only passes (or did not run) but expected-failures.txt expects "
        "it to fail (only on Redis): remove it from the list",
    ]


def test_the_repository_list_pins_four_cache_tests_each_with_a_reason(lane: ModuleType) -> None:
    lane.EXPECTED = RUN_PY.parent / "expected-failures.txt"
    memory = lane.expected_failures("memory")
    assert memory == lane.expected_failures("redis")
    assert sorted(memory) == [
        "CacheFailTests::test_cache_timeout",
        "CacheFailTests::test_fail_open_setting",
        "CacheFailTests::test_is_ratelimited_cache_connection_error_with_increment",
        "CacheFailTests::test_limit_on_cache_connection_error",
    ]
    assert all("memory backend" in reason for reason in memory.values())
