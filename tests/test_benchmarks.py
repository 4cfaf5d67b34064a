"""The benchmark package works: its goals block follows the figures it is given, --only
keeps a whole-request row's base, and a tiny run prints every row and every goal. No
timing is asserted anywhere: the figures are whatever the machine gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import contenders as c
from benchmarks import goals, run, whole_request
from benchmarks.measure import Footprint
from benchmarks.report import Row
from tests.conftest import require_redis_server

ROOT = Path(__file__).resolve().parent.parent
ALGORITHM = "(synthetic)"


def _row(
    key: str,
    median_us: float,
    *,
    cpu: float | None = None,
    base: str | None = None,
    footprints: dict[int, Footprint] | None = None,
) -> Row:
    return Row(
        key=key,
        reference=key,
        implementation=key,
        algorithm=ALGORITHM,
        median_us=median_us,
        p99_us=median_us,
        throughput_1=1.0,
        throughput_n=1.0,
        commands=None,
        server_cpu_us=cpu,
        command_breakdown={},
        sent=None,
        footprints=footprints or {},
        base=base,
    )


def _verdicts(rows: list[Row]) -> dict[str, tuple[str, str]]:
    return {goal.goal: (goal.measured, goal.verdict) for goal in goals.evaluate(rows)}


def _label(key: str) -> str:
    """How the goals name a measured row built by ``_row``."""
    return f"{key} {ALGORITHM}"


def test_ratio_goal_passes_on_the_printed_figure_and_misses_above_it():
    found = _verdicts(
        [
            _row(c.DQ_FIXED, 100.4, cpu=10.0),
            _row(c.LIMITS_FIXED, 100.0, cpu=7.0),
        ]
    )
    pair = f"{_label(c.DQ_FIXED)} / {_label(c.LIMITS_FIXED)}"
    assert found[f"p50: {pair}"] == ("1.00x", goals.PASS)
    assert found[f"Redis CPU/dec: {pair}"] == ("1.43x", goals.MISS)


def test_goal_of_a_row_left_out_is_not_measured():
    found = _verdicts([_row(c.DQ_FIXED, 100.0)])
    assert found[f"p50: {c.DQ_SLIDING} / {c.LIMITS_SLIDING}"] == ("not measured", "-")
    assert found[f"p50: {_label(c.DQ_FIXED)} / {c.LIMITS_FIXED}"] == ("not measured", "-")


def test_memory_goals_need_few_bytes_and_no_new_keys_per_decision():
    lean = {1: Footprint(1, 136), 100: Footprint(1, 136)}
    growing = {1: Footprint(2, 400), 100: Footprint(101, 26_536)}
    found = _verdicts(
        [
            _row(c.DQ_FIXED, 1.0, footprints=lean),
            _row(c.DQ_SLIDING, 1.0, footprints=growing),
        ]
    )
    assert found[f"bytes/subject @1 and @100: {_label(c.DQ_FIXED)}"][1] == goals.PASS
    assert found[f"keys/subject @100 == @1: {_label(c.DQ_FIXED)}"] == ("1 -> 1", goals.PASS)
    assert found[f"bytes/subject @1 and @100: {_label(c.DQ_SLIDING)}"][1] == goals.MISS
    assert found[f"keys/subject @100 == @1: {_label(c.DQ_SLIDING)}"] == ("2 -> 101", goals.MISS)


def test_added_cost_goals_divide_by_drf_throttles_added_cost():
    found = _verdicts(
        [
            _row(whole_request.DRF_BASE, 200.0),
            _row(whole_request.DRF_THROTTLED, 600.0, base=whole_request.DRF_BASE),
            _row(whole_request.DRF_QUOTA, 360.0, base=whole_request.DRF_BASE),
            _row(whole_request.PLAIN_BASE, 100.0),
            _row(whole_request.PLAIN_MIDDLEWARE, 400.0, base=whole_request.PLAIN_BASE),
        ]
    )
    drop_in = "drop-in AnonRateThrottle added µs / DRF AnonRateThrottle added µs"
    middleware = "QuotaMiddleware added µs / DRF AnonRateThrottle added µs"
    assert found[drop_in] == ("0.40x (160 / 400 µs)", goals.PASS)
    assert found[middleware] == ("0.75x (300 / 400 µs)", goals.MISS)


def test_only_keeps_the_base_of_a_selected_whole_request_row():
    def maker(kind: str) -> c.Decide:
        return lambda subject: True

    rows = [
        c.Contender("request: base", "", "request/base", "", maker),
        c.Contender("request: throttled", "", "request/t", "", maker, base="request/base"),
        c.Contender("limits", "", "limits/x", "", maker),
    ]
    assert [row.key for row in run.select(rows, "THROTTLED")] == ["request/base", "request/t"]
    assert [row.key for row in run.select(rows, "")] == ["request/base", "request/t", "limits/x"]


@pytest.mark.redis
def test_tiny_run_prints_every_row_and_every_goal():
    require_redis_server()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--decisions",
            "20",
            "--rounds",
            "1",
            "--threads",
            "2",
            "--subjects",
            "8",
            "--attempts",
            "3",
            "--limit",
            "4",
            "--monitor-sample",
            "4",
            "--max-seconds",
            "120",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for name in (
        "django-quota (async)",
        "django-quota (memory)",
        "request: DRF APIView",
        "request: plain view + django-quota QuotaMiddleware",
        "keys/subject @1, @100",
    ):
        assert name in out
    block = out[out.index("goals (this run's figures") :].splitlines()
    lines = [line for line in block if line.startswith("| ") and "verdict" not in line]
    assert len(lines) == len(goals.evaluate([]))
    # A goal whose peer is not installed is "-"; ours are always measured.
    middleware = next(line for line in lines if line.startswith("| QuotaMiddleware"))
    assert middleware.rstrip(" |").endswith((goals.PASS, goals.MISS))
