"""The README's main job, end to end: the example project under gunicorn and real HTTP
traffic, once on the memory default and once on a throwaway redis-server with two
workers, against every HTTP surface (middleware with enforced and shadow policies, the
DRF drop-in throttles, QuotaThrottle, @quota with a cost). The driver exits non-zero on
any admitted count that differs from the fixed-window arithmetic, on a 5xx, on an
unexpected status, on wrong headers or bodies, and on server counters that contradict
the replay."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SURFACES = ("middleware", "shadow", "DRF drop-in", "QuotaThrottle", "@quota")
#: The widest line the demo may print by default (a terminal of 100 columns).
WIDTH = 100


def _demo(tmp_path: Path, redis_url: str | None, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "REDIS_URL"}
    env["EXAMPLE_DB_PATH"] = str(tmp_path / "example.sqlite3")
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    return subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--seconds", "3", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )


def _table(stdout: str) -> list[dict[str, str]]:
    """The per-client table, one dict per row, cut along the dashes under the header."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("client "))
    header, dashes = lines[start], lines[start + 1]
    spans, col = [], 0
    for dash in dashes.split("  "):
        spans.append((col, col + len(dash)))
        col += len(dash) + 2
    names = [header[a:b].strip() for a, b in spans]
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append({name: line[a:b].strip() for name, (a, b) in zip(names, spans, strict=True)})
    return rows


def _tables(stdout: str) -> list[tuple[int, list[str]]]:
    """Every table printed: (index of its header line, its column names)."""
    lines = stdout.splitlines()
    found = []
    for index, dashes in enumerate(lines[1:], start=1):
        if not dashes.strip() or set(dashes.strip()) - {"-", " "}:
            continue
        header = lines[index - 1]
        indent = len(dashes) - len(dashes.lstrip())
        spans, col = [], indent
        for dash in dashes.strip().split("  "):
            spans.append((col, col + len(dash)))
            col += len(dash) + 2
        found.append((index - 1, [header[a:b].strip() for a, b in spans]))
    return found


def _legend_after(lines: list[str], start: int) -> dict[str, str]:
    """The first "Columns:" block after line ``start``: column name -> description."""
    begin = next(i for i in range(start, len(lines)) if lines[i].strip() == "Columns:")
    indent = len(lines[begin]) - len(lines[begin].lstrip()) + 2
    entries: dict[str, str] = {}
    name = ""
    for line in lines[begin + 1:]:
        if not line.strip():
            break
        entry = re.match(rf"^ {{{indent}}}(\S[^:]*?): (.+)$", line)
        if entry:
            name = entry[1]
            entries[name] = entry[2]
        else:
            entries[name] += " " + line.strip()
    return entries


def _check_layout(stdout: str) -> None:
    """Every line fits in WIDTH columns and a legend under each table names its columns."""
    too_wide = [line for line in stdout.splitlines() if len(line) > WIDTH]
    assert not too_wide, too_wide
    tables = _tables(stdout)
    # Clients, their policies, and the server counters (absent only when a worker did not
    # answer /api/quota-stats/, which the output then says).
    assert len(tables) == (3 if "Server counters: NOT CHECKED" not in stdout else 2), tables
    lines = stdout.splitlines()
    for start, names in tables:
        legend = _legend_after(lines, start)
        assert [name for name in names if name not in legend] == [], (names, legend)
        assert all(len(legend[name]) > 10 for name in names), legend
    # The drop-in client asked by two throttles is explained where the numbers are.
    assert "me-anon" in " ".join(_legend_after(lines, tables[1][0]).values())


def _without_samples(stdout: str) -> str:
    """The output less the --verbose block of sample headers and bodies (its lines are
    the servers' own, unwrapped), which must be there."""
    lines = stdout.splitlines()
    start = lines.index("Headers and bodies, per surface (the first of each kind):")
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    assert end - start > 10  # a 2xx and a 429 of each surface
    assert any("RateLimit-Policy: " in line for line in lines[start:end])
    return "\n".join(lines[:start] + lines[end:])


def _check_surfaces(stdout: str) -> None:
    rows = _table(stdout)
    assert {row["surface"] for row in rows} == set(SURFACES)
    assert all(row["result"] == "OK" for row in rows)
    refused: dict[str, int] = {}
    for row in rows:
        assert row["admitted"] == row["expected"] == row["2xx"]
        refused[row["surface"]] = refused.get(row["surface"], 0) + int(row["429"])
    assert refused.pop("shadow") == 0  # a shadow policy never refuses
    assert all(refused.values()), refused  # every enforced surface met its limits


def test_demo_on_the_memory_backend_admits_exactly_the_expected_counts(tmp_path: Path) -> None:
    result = _demo(tmp_path, None)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "memory" in result.stdout
    assert "All decisions match the fixed-window arithmetic: OK" in result.stdout
    _check_surfaces(result.stdout)
    _check_layout(result.stdout)
    assert "Headers and bodies" not in result.stdout  # only with --verbose
    # One worker: its counters are the server's; they agree with the replay.
    assert "Server counters: /api/quota-stats/ of every worker (1 pid(s)" in result.stdout


def test_demo_on_redis_with_two_workers_admits_exactly_the_expected_counts(
    tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    result = _demo(tmp_path, redis_url, "--workers", "2", "--verbose")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 gunicorn sync worker(s)" in result.stdout
    assert "All decisions match the fixed-window arithmetic: OK" in result.stdout
    _check_surfaces(result.stdout)
    _check_layout(_without_samples(result.stdout))
    assert redis_client.dbsize() > 0  # the counters really lived in this Redis


def test_the_demo_installs_its_own_extras_without_the_test_and_docs_tools() -> None:
    """``scripts/demo`` bootstraps only the extras the example needs (a 93 MB .venv on
    first run, against 571 MB with the test and docs tools): pytest, mypy, selenium,
    matplotlib and mkdocs come with ``scripts/test`` and ``scripts/docs``."""
    import tomllib

    (line,) = [
        line for line in (ROOT / "scripts" / "demo").read_text().splitlines()
        if line.startswith("scripts/bootstrap")
    ]
    extras = line.split()[1].split(",")
    assert extras == ["example", "prometheus", "hiredis"]
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = " ".join(
        requirement for extra in extras for requirement in declared["optional-dependencies"][extra]
    )
    for tool in ("pytest", "mypy", "selenium", "matplotlib", "mkdocs", "ruff"):
        assert tool not in needed


def test_a_first_bootstrap_prints_nothing_and_keeps_pips_output_in_its_log(tmp_path: Path) -> None:
    """A newcomer's first ``scripts/demo`` creates the .venv: pip's output (its progress,
    setuptools' editable-install warning) goes to ``.venv/.install.log``, and the run
    prints only the demo's own lines. A clean copy of the source tree, a new venv, the
    demo's extras (pip's cache makes it quick after the first time)."""
    import shutil

    from tests.test_packaging import NOT_SOURCE

    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["scripts/bootstrap", "example,prometheus,hiredis"],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout, result.stderr) == ("", "")
    log = (source / ".venv" / ".install.log").read_text()
    assert "Successfully installed" in log and "django-quota" in log
    assert (source / ".venv" / ".django-quota-installed-example-prometheus-hiredis").exists()
    checked = subprocess.run(
        [str(source / ".venv" / "bin" / "python"), "-c", "import django_quota, django, redis"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
