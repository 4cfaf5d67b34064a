"""Before ``migrate``: the database policies cannot be read yet. A fresh ``migrate`` logs
nothing of django-quota's (its system checks run before the tables exist, and must not
tell it to run itself); a command that uses the policies before ``migrate`` logs one
warning saying to run it, never an ERROR "no such table"; once migrated, database
policies are read (docs/operations.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {"api": {"windows": "5/m", "selector": ["ip"], "routes": ["/api"]}}
SETTINGS = """\
from tests.settings import *  # noqa: F403

QUOTA = {{"HMAC_KEY": "tests-hmac-key-0123456789", "POLICIES": {policies!r}}}
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {database!r}}}}}
"""
LOGGING = """\
LOGGING = {{
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {{"levels": {{"format": "%(levelname)s %(name)s %(message)s"}}}},
    "handlers": {{"stderr": {{"class": "logging.StreamHandler", "formatter": "levels"}}}},
    "loggers": {{"django_quota": {{"handlers": ["stderr"], "level": "DEBUG",
                                 "propagate": False}}}},
}}
"""


def manage(tmp_path: Path, *args: str, logging_setting: bool = True) -> Any:
    """``python -m django …`` on a fresh sqlite file in ``tmp_path`` (database policies
    on: the default ``POLICY_SOURCES``), django_quota's log lines on stderr with levels
    (Django's default logging without ``logging_setting``)."""
    database = str(tmp_path / "fresh.sqlite3")
    settings = SETTINGS + (LOGGING if logging_setting else "")
    (tmp_path / "fresh_settings.py").write_text(
        settings.format(policies=POLICIES, database=database)
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "fresh_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )


def quota_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " django_quota " in line]


def test_a_fresh_migrate_logs_nothing_of_django_quota(tmp_path: Path) -> None:
    migrated = manage(tmp_path, "migrate", "-v0")
    assert migrated.returncode == 0, migrated.stderr
    assert "no such table" not in migrated.stderr
    logged = [line for line in quota_lines(migrated.stderr) if not line.startswith("DEBUG")]
    assert logged == []


def test_a_fresh_migrate_prints_only_djangos_lines_under_default_logging(
    tmp_path: Path,
) -> None:
    """The README's quickstart: no LOGGING setting, so a django_quota WARNING would reach
    stderr through Python's last-resort handler, bare, between Django's lines."""
    migrated = manage(tmp_path, "migrate", "-v0", logging_setting=False)
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stderr == ""
    assert migrated.stdout == ""


def test_a_command_before_migrate_warns_once_and_logs_no_error(tmp_path: Path) -> None:
    listed = manage(tmp_path, "quota", "policies")
    assert listed.returncode == 0, listed.stderr
    assert "no such table" not in listed.stderr
    assert not [line for line in listed.stderr.splitlines() if line.startswith("ERROR")]
    assert quota_lines(listed.stderr) == [
        "WARNING django_quota the quota policy tables do not exist yet: run `manage.py "
        "migrate`; until then only settings policies apply"
    ]


def test_after_migrate_nothing_is_logged(tmp_path: Path) -> None:
    assert manage(tmp_path, "migrate", "-v0").returncode == 0
    listed = manage(tmp_path, "quota", "policies")
    assert listed.returncode == 0, listed.stderr
    assert quota_lines(listed.stderr) == []
    assert manage(tmp_path, "check").returncode == 0
