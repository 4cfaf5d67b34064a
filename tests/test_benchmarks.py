"""The benchmark package works: its goals block follows the figures it is given, --only
keeps a whole-request row's base, and a tiny run prints every row and every goal. No
timing is asserted anywhere: the figures are whatever the machine gives."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import (
    chart,
    engine,
    goals,
    instructions,
    python_instructions,
    redis_instructions,
    run,
    saved,
    whole_request,
)
from benchmarks import contenders as c
from benchmarks.measure import Exactness, Footprint
from benchmarks.report import Row
from tests.conftest import IN_CI, require_redis_server

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

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
    found = _verdicts([_row(c.DQ_FIXED, 105.4), _row(c.LIMITS_FIXED, 100.0)])
    assert found[f"p50: {_label(c.DQ_FIXED)} / {_label(c.LIMITS_FIXED)}"] == ("1.05x", goals.PASS)
    found = _verdicts([_row(c.DQ_FIXED, 105.6), _row(c.LIMITS_FIXED, 100.0)])
    assert found[f"p50: {_label(c.DQ_FIXED)} / {_label(c.LIMITS_FIXED)}"] == ("1.06x", goals.MISS)


def _engine_figures(*, dq_at_64: float, calls: float, connections: float) -> engine.EngineFigures:
    def at(throughput: float, cpu: float, p50: float) -> dict[str, dict[str, float]]:
        return {
            str(tasks): {"throughput": throughput, "cpu_us": cpu, "p50_us": p50}
            for tasks in engine.TASKS
        }

    figures = engine.EngineFigures(
        hammer={
            engine.DQ: {"denied_p50_us": 4.0, "calls_per_request": calls},
            engine.LIMITS: {"denied_p50_us": 50.0, "calls_per_request": 1.0},
        },
        concurrency={engine.DQ: at(3000.0, 20.0, 104.0), engine.LIMITS: at(2000.0, 20.0, 100.0)},
        burst={
            engine.DQ: {
                "allowed": 100.0, "denied": 900.0, "failed": 0.0, "connections": connections,
                "seconds": 0.2, "limit": 100.0,
            }
        },
    )
    figures.concurrency[engine.DQ]["64"]["throughput"] = dq_at_64
    return figures


def test_engine_goals_follow_the_figures_they_are_given():
    passing = {
        goal.goal: (goal.measured, goal.verdict)
        for goal in goals.engine_goals(_engine_figures(dq_at_64=4000.0, calls=0.1, connections=4.0))
    }
    assert passing == {
        "async p50 @1 task: django-quota / limits.aio": ("1.04x", goals.PASS),
        "async dec/s @16 tasks: django-quota / limits.aio": ("1.50x", goals.PASS),
        "async dec/s @64 tasks: django-quota / limits.aio": ("2.00x", goals.PASS),
        "Redis CPU/dec @64 tasks: django-quota / limits.aio": ("1.00x", goals.PASS),
        "repeated denial p50: django-quota / limits": ("0.08x", goals.PASS),
        "Redis calls per request at 10x the limit: django-quota": ("0.100", goals.PASS),
        "cold burst of 1000: every one decided, allowed = limit, <= 8 connections": (
            "0 failed, 100 of 100, 4 connections", goals.PASS
        ),
    }
    missing = {
        goal.goal: goal.verdict
        for goal in goals.engine_goals(_engine_figures(dq_at_64=3000.0, calls=0.2, connections=9.0))
    }
    assert missing["async dec/s @64 tasks: django-quota / limits.aio"] == goals.MISS
    assert missing["Redis calls per request at 10x the limit: django-quota"] == goals.MISS
    assert missing[
        "cold burst of 1000: every one decided, allowed = limit, <= 8 connections"
    ] == goals.MISS
    unmeasured = {goal.verdict for goal in goals.engine_goals(None)}
    assert unmeasured == {goals.NOT_MEASURED}


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


def test_the_ratelimit_drop_in_goal_divides_by_django_ratelimits_added_cost():
    found = _verdicts(
        [
            _row(whole_request.PLAIN_BASE, 100.0),
            _row(whole_request.PLAIN_RATELIMIT, 650.0, base=whole_request.PLAIN_BASE),
            _row(whole_request.PLAIN_QUOTA_RATELIMIT, 300.0, base=whole_request.PLAIN_BASE),
        ]
    )
    label = "django_quota.ratelimit @ratelimit added µs / django-ratelimit @ratelimit added µs"
    assert found[label] == ("0.36x (200 / 550 µs)", goals.PASS)


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


# -- the chart and the saved results ---------------------------------------------------


def _named(
    key: str,
    implementation: str,
    algorithm: str,
    median_us: float,
    reference: str,
    base: str | None = None,
) -> Row:
    """A row as a run reports it, with the names and references the chart groups by."""
    return Row(
        key=key,
        reference=reference,
        implementation=implementation,
        algorithm=algorithm,
        median_us=median_us,
        p99_us=median_us * 2,
        throughput_1=1e6 / median_us,
        throughput_n=1.5e6 / median_us,
        commands=5.0,
        server_cpu_us=20.0,
        # Most called first, as the run orders it: not alphabetical.
        command_breakdown={"pexpire": 2.0, "hset": 1.0, "evalsha": 1.0},
        sent=1.0,
        base=base,
    )


def _run_rows() -> list[Row]:
    """A small hand-made run: two django-quota rows with peers, and whole requests."""
    dq_fixed = _named(c.DQ_FIXED, c.DQ, "fixed_window", 272.0, c.DQ_FIXED)
    dq_fixed.footprints = {
        1: Footprint(1, 152, {"counters": (1, 152)}),
        100: Footprint(1, 232, {"counters": (1, 232)}),
    }
    dq_fixed.exactness = Exactness(admitted=100, limit=100, attempts=400)
    drf_plain = "request: DRF APIView"
    return [
        dq_fixed,
        _named(c.DQ_SLIDING, c.DQ, "sliding_window", 290.0, c.DQ_SLIDING),
        _named(c.LIMITS_FIXED, "limits FixedWindow", "fixed_window", 200.0, c.DQ_FIXED),
        _named(
            c.LIMITS_SLIDING, "limits SlidingWindowCounter", "sliding_window", 400.0, c.DQ_SLIDING
        ),
        _named("drf/AnonRateThrottle", "DRF AnonRateThrottle", "sliding log", 544.0, c.DQ_FIXED),
        _named(whole_request.DRF_BASE, drf_plain, "no throttle (base)", 219.0, ""),
        _named(
            whole_request.DRF_THROTTLED,
            f"{drf_plain} + DRF AnonRateThrottle",
            "sliding log",
            1264.0,
            whole_request.DRF_QUOTA,
            base=whole_request.DRF_BASE,
        ),
        _named(
            whole_request.DRF_QUOTA,
            f"{drf_plain} + django-quota AnonRateThrottle",
            "sliding_log (drop-in default)",
            811.0,
            whole_request.DRF_QUOTA,
            base=whole_request.DRF_BASE,
        ),
    ]


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk (no image library)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND"
    return width, height


def test_chart_groups_each_django_quota_row_with_the_peers_compared_to_it():
    rows = _run_rows()
    groups = chart.decision_groups(rows)
    assert [[row.key for row in group] for group in groups] == [
        [c.DQ_FIXED, c.LIMITS_FIXED, "drf/AnonRateThrottle"],
        [c.DQ_SLIDING, c.LIMITS_SLIDING],
    ]
    notes = [bar.note for bar in chart.decision_bars(groups[0])]
    assert notes == [
        "272 µs",
        "200 µs   django-quota / this: 1.36x",
        "544 µs   django-quota / this: 0.50x",
    ]
    # A peer whose django-quota row was left out stands alone, without a ratio.
    alone = chart.decision_groups(rows[2:3])
    assert [[row.key for row in group] for group in alone] == [[c.LIMITS_FIXED]]
    assert [bar.note for bar in chart.decision_bars(alone[0])] == ["200 µs"]


def test_chart_puts_whole_requests_beside_their_base_with_the_added_cost():
    rows = _run_rows()
    (group,) = chart.request_groups(rows)
    assert [row.key for row in group] == [
        whole_request.DRF_BASE,
        whole_request.DRF_THROTTLED,
        whole_request.DRF_QUOTA,
    ]
    bars = chart.request_bars(group, rows)
    assert [bar.note for bar in bars] == [
        "219 µs",
        "1,264 µs   +1,045 µs, 1.00x DRF's added",
        "811 µs   +592 µs, 0.57x DRF's added",
    ]
    assert [bar.colour for bar in bars] == [chart.BASES, chart.PEERS, chart.OURS]
    assert bars[2].label.startswith("DRF APIView + django-quota")  # "request: " dropped


def test_chart_is_a_png_with_a_panel_for_whole_requests(tmp_path: Path):
    rows = _run_rows()
    both = tmp_path / "both.png"
    chart.plot(rows, both, subtitle="a hand-made run")
    decisions_only = tmp_path / "img" / "decisions.png"  # a missing folder is made
    chart.plot([row for row in rows if not row.key.startswith("request/")], decisions_only)
    width, height = _png_size(both)
    assert width == 1100  # 11 in at 100 dpi
    narrow, short = _png_size(decisions_only)
    assert narrow == 1100
    assert short < height  # the second panel adds its rows' height
    with pytest.raises(ValueError, match="no rows"):
        chart.plot([], tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_saved_run_round_trips_through_json(tmp_path: Path):
    original = saved.SavedRun(
        rows=_run_rows(),
        header=["python 3.11.7", "redis-server 7.0.15"],
        notes=["django-ratelimit is not installed: skipped"],
        settings={name: index + 1 for index, name in enumerate(saved.SETTINGS)},
        cores=2,
        seconds=12.5,
        engine=_engine_figures(dq_at_64=4000.0, calls=0.1, connections=4.0),
    )
    path = tmp_path / "run.json"
    saved.write(path, original)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == saved.FORMAT
    assert data["rows"][0]["footprints"]["100"]["bytes"] == 232
    back = saved.read(path)
    assert back == original
    # The report prints the breakdown in the saved order (== on dicts ignores order).
    assert [list(row.command_breakdown) for row in back.rows] == [
        ["pexpire", "hset", "evalsha"] for _ in original.rows
    ]
    assert back.rows[0].footprints[1].by_kind == {"counters": (1, 152)}
    assert back.rows[0].exactness == Exactness(admitted=100, limit=100, attempts=400)
    assert back.report() == original.report()
    assert "cold burst of 1000, django-quota (worst round): 100 allowed" in back.report()
    saved.write(tmp_path / "again.json", back)
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()


def test_a_file_that_is_not_a_saved_run_is_refused(tmp_path: Path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}), encoding="utf-8")
    with pytest.raises(ValueError, match="not a saved benchmark run"):
        saved.read(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="not JSON"):
        saved.read(path)


def test_from_json_reprints_and_plots_a_saved_run_without_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    settings = {"decisions": 300, "rounds": 1, "threads": 8, "subjects": 256}
    settings |= {"limit": 100, "attempts": 50, "monitor_sample": 20}
    path = tmp_path / "run.json"
    saved.write(path, saved.SavedRun(_run_rows(), ["python 3.11.7"], [], settings, 2, 15.0))
    png = tmp_path / "bench.png"
    assert run.main(["--from-json", str(path), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert "django-quota benchmark: 300 decisions per row and loop, 1 interleaved round," in out
    assert "| limits FixedWindow" in out
    assert f"chart drawn to {png}" in err
    assert "redis-server" not in err  # nothing was started
    assert _png_size(png)[0] == 1100


# -- --instructions ----------------------------------------------------------------------
def test_callgrind_totals_are_read_from_the_totals_line_else_the_summary():
    dump = "version: 1\ncmd: redis-server\nsummary: 1200\ntotals: 1234\n"
    assert instructions.total_instructions(dump) == 1234
    assert instructions.total_instructions("summary: 99\n") == 99
    with pytest.raises(ValueError, match="no totals"):
        instructions.total_instructions("events: Ir\n")


def test_instruction_table_takes_each_ratio_to_limits_row_of_the_same_algorithm():
    counted = [
        instructions.Counted("django-quota fixed_window", c.DQ_FIXED, 88_000.0, 4.0),
        instructions.Counted("django-quota token_bucket", c.DQ_TOKEN, 110_000.0, 4.0),
        instructions.Counted("django-quota sliding_window", c.DQ_SLIDING, 90_000.0, 4.0),
        instructions.Counted("limits FixedWindow", c.LIMITS_FIXED, 22_000.0, 2.0),
    ]
    lines = instructions.table(counted).splitlines()
    assert lines[2] == "| django-quota fixed_window | 88,000 | 4.00 | 4.00x limits FixedWindow |"
    assert lines[3] == "| django-quota token_bucket | 110,000 | 4.00 | 5.00x limits FixedWindow |"
    assert lines[4] == "| django-quota sliding_window | 90,000 | 4.00 |  |"  # its peer not counted
    assert lines[5] == "| limits FixedWindow | 22,000 | 2.00 |  |"


def test_instruction_goals_follow_the_counts_they_are_given():
    counted = [
        instructions.Counted("django-quota fixed_window", c.DQ_FIXED, 61_000.0, 4.0),
        instructions.Counted("django-quota sliding_window", c.DQ_SLIDING, 68_000.0, 4.0),
        instructions.Counted("django-quota calendar", c.DQ_CALENDAR, 63_000.0, 4.0),
        instructions.Counted(
            "django-quota concurrency, acquire + release", c.DQ_CONCURRENCY, 120_000.0, 9.0
        ),
    ]
    python_counts = {
        python_instructions.DQ_MEMORY: 60_000.0, python_instructions.LIMITS_MEMORY: 28_000.0
    }
    assert instructions.instruction_goals(counted, python_counts) == [
        "django-quota fixed_window: 61,000 server instructions per decision "
        "(target <= 62,000): PASS",
        "django-quota sliding_window: 68,000 server instructions per decision "
        "(target <= 67,000): MISS",
        "django-quota concurrency, acquire + release / django-quota fixed_window server "
        "instructions: 1.97x (120,000 / 61,000; target <= 2.00x): PASS",
        "django-quota (memory) / limits (memory) Python instructions: 2.14x "
        "(60,000 / 28,000; target <= 2.00x): MISS",
        "django-quota calendar / django-quota fixed_window server instructions: 1.033x "
        "(63,000 / 61,000; target <= 1.05x): PASS",
    ]
    assert instructions.instruction_goals([], {})[2] == (
        "django-quota/concurrency / django-quota/fixed_window: not measured (target <= 2.00x)"
    )
    assert instructions.instruction_goals([], {})[3] == (
        "django-quota (memory) / limits (memory): not measured (target <= 2.00x)"
    )


def test_the_python_instruction_counts_run_a_memory_row_to_the_end():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.python_instructions", python_instructions.DQ_MEMORY,
         "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("row", redis_instructions.ROWS)
def test_the_redis_instruction_counts_run_a_row_to_the_end(row: str, redis_url: str):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.redis_instructions", row, "64", redis_url],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    import redis

    with redis.Redis.from_url(redis_url) as client:  # the warm-up and the 64 decisions
        assert client.dbsize() == redis_instructions.SUBJECTS


def test_instructions_count_only_sync_decision_rows_on_redis():
    rows = [
        *c.django_quota_contenders("redis://127.0.0.1:1/0", 100),
        *whole_request.contenders([]),
    ]
    kept = {contender.key for contender in instructions.selected(rows, "")}
    assert c.DQ_FIXED in kept and c.DQ_TWO_POLICIES in kept
    assert c.DQ_ASYNC_FIXED not in kept  # the same script as fixed_window, awaited
    assert c.DQ_MEMORY_FIXED not in kept  # no Redis
    assert not any(key.startswith("request/") for key in kept)
    assert {contender.key for contender in instructions.selected(rows, "sliding")} == {
        c.DQ_SLIDING, c.DQ_SLIDING_LOG, c.DQ_TWO_WINDOWS, c.DQ_TWO_POLICIES,
    }


def test_instructions_without_valgrind_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setattr(instructions.shutil, "which", lambda tool: None)
    assert run.main(["--instructions"]) == 2
    assert capsys.readouterr().err == (
        "--instructions needs valgrind and callgrind_control "
        "(Debian: apt-get install valgrind)\n"
    )


def test_instructions_refuse_the_saving_and_charting_options():
    with pytest.raises(SystemExit):
        run.parse_args(["--instructions", "--json", "x.json"])
    assert run.parse_args(["--instructions"]).decisions == instructions.DEFAULT_DECISIONS
    assert run.parse_args([]).decisions == run.DEFAULT_DECISIONS


def test_a_tiny_instruction_count_prints_a_figure_per_row():
    require_redis_server()
    if instructions.missing_tools():
        message = "valgrind not found (install Debian's valgrind)"
        if IN_CI:
            pytest.fail(message + "; in CI --instructions must run")
        pytest.skip(message)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--instructions", "--decisions", "20",
         "--subjects", "4", "--only", "fixed_window"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and "---" not in line]
    names = [line.split(" | ")[0].lstrip("| ") for line in rows[1:]]
    # The peers are rows only where the bench extra is installed (scripts/bench does it;
    # CI's test run does not), and a note says so otherwise.
    peers = importlib.util.find_spec("limits") is not None
    expected = ["django-quota fixed_window"]
    if peers:
        expected.append("limits FixedWindow fixed_window")
    if importlib.util.find_spec("django_ratelimit") is not None:
        expected.append("django-ratelimit fixed_window (cache add + incr)")
    assert names == expected
    figures = [int(line.split(" | ")[1].replace(",", "")) for line in rows[1:]]
    assert all(figure > 1_000 for figure in figures)  # a decision runs at least a command
    if peers:
        assert rows[1].endswith("x limits FixedWindow fixed_window |")
    else:
        assert rows[1].endswith(" | 4.00 |  |")  # no peer row: no ratio
        assert "- limits is not installed (pip install -e '.[bench]'): rows skipped" in lines
