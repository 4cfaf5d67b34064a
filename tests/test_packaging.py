"""The built wheel carries every non-Python file the app needs at run time (the editable
install the other tests use would hide a missing one), and works once installed. It is
built with the README's own command, run at the root of a clean copy of the clone, as a
reader runs it."""

from __future__ import annotations

import re
import shlex
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


def readme_command(program: str) -> list[str]:
    """The README's ``python -m pip <program> ...`` command, split into its words."""
    readme = (ROOT / "README.md").read_text()
    [command] = re.findall(rf"`(python -m pip {program} [^`]*)`", readme)
    return shlex.split(command)


def test_the_readme_commands_name_the_root_of_the_clone() -> None:
    """A clone's directory is named whatever git made it: the README's commands name the
    current directory (its root), not ``./django-quota``."""
    wheel = ["python", "-m", "pip", "wheel", "--no-deps", "-w", "dist", "."]
    assert readme_command("wheel") == wheel
    readme = (ROOT / "README.md").read_text()
    assert 'pip install ".[drf,hiredis,prometheus]"' in readme
    assert "./django-quota" not in readme


def _build_wheel(tmp_path: Path) -> Path:
    # Build from a clean copy: a stale build/ directory would hide a missing file.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    _python, *pip_wheel = readme_command("wheel")
    # The test's own additions: the build backend from this environment (no download),
    # and quiet output.
    command = [sys.executable, *pip_wheel, "--no-build-isolation", "-q"]
    result = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return next((source / "dist").glob("django_quota-*.whl"))


def test_wheel_contains_templates_scripts_and_migrations(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
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


#: Run by the venv the wheel is installed in, from a folder without the source tree: the
#: scripts load from the installed package and a decision runs on the memory backend.
_INSTALLED_SMOKE = """
import django
from django.conf import settings

settings.configure(
    SECRET_KEY="packaging-test-secret-key-of-some-length",
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_quota"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    QUOTA={"HMAC_KEY": "packaging-test-hmac-key", "POLICIES": {"p": {"windows": "2/m"}}},
)
django.setup()
import django_quota
from django_quota import scripts

assert "site-packages" in django_quota.__file__, django_quota.__file__
assert all("redis.call" in script.source for script in scripts.all_scripts())
first, second, third = (django_quota.evaluate("p", {"ip": "192.0.2.1"}) for _ in range(3))
print(first.remaining, second.remaining, third.decision)
"""


def test_the_wheel_installs_and_decides(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    smoke = subprocess.run(
        [str(python), "-c", _INSTALLED_SMOKE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    assert smoke.stdout.split() == ["1", "0", "denied"]
