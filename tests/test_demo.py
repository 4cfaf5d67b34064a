"""The README's main job, end to end: the example project under gunicorn and real HTTP
traffic, once on the memory default and once on a throwaway redis-server with two
workers. The driver exits non-zero on any admitted count that differs from the
fixed-window arithmetic, on a 5xx or on an unexpected status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _demo(tmp_path: Path, redis_url: str | None, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "REDIS_URL"}
    env["EXAMPLE_DB_PATH"] = str(tmp_path / "example.sqlite3")
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    return subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--seconds", "3", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )


def test_demo_on_the_memory_backend_admits_exactly_the_expected_counts(tmp_path: Path) -> None:
    result = _demo(tmp_path, None)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "memory" in result.stdout
    assert "All decisions match the fixed-window arithmetic: OK" in result.stdout


def test_demo_on_redis_with_two_workers_admits_exactly_the_expected_counts(
    tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    result = _demo(tmp_path, redis_url, "--workers", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 gunicorn sync worker(s)" in result.stdout
    assert "All decisions match the fixed-window arithmetic: OK" in result.stdout
    assert redis_client.dbsize() > 0  # the counters really lived in this Redis
