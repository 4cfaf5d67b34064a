"""The built wheel carries every non-Python file the app needs at run time (the editable
install the other tests use would hide a missing one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "django_quota"
NOT_SOURCE = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "var",
    "test-artifacts",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
)


def test_wheel_contains_templates_scripts_and_migrations(tmp_path: Path) -> None:
    # Build from a clean copy: a stale build/ directory would hide a missing file.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = next(tmp_path.glob("django_quota-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = [
        path.relative_to(ROOT).as_posix()
        for pattern in ("templates/**/*.html", "scripts/*.lua", "migrations/*.py", "py.typed")
        for path in PACKAGE.glob(pattern)
    ]
    assert any(name.endswith(".html") for name in needed)
    assert [name for name in needed if name not in names] == []
    assert "django_quota/management/commands/quota.py" in names
    # The BSD-3-Clause text travels with the wheel (pyproject's license-files).
    licenses = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
    version = wheel.name.split("-")[1]
    assert licenses == [f"django_quota-{version}.dist-info/licenses/LICENSE"]
    license_text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert license_text.startswith("BSD 3-Clause License\n")
    assert "Copyright (c) 2026 The django-quota developers" in license_text
