"""The layer rule (STYLE.md): ``django_quota.core`` is pure Python, and import-linter's
contracts in ``pyproject.toml`` hold."""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import django_quota.core

ROOT = Path(__file__).resolve().parent.parent
CORE_MODULES = sorted(
    f"django_quota.core.{info.name}" for info in pkgutil.iter_modules(django_quota.core.__path__)
)
BLOCKED = ("django", "redis", "rest_framework")


def test_core_has_the_modules_the_style_guide_lists() -> None:
    assert {
        "django_quota.core.rates",
        "django_quota.core.policy",
        "django_quota.core.errors",
    } <= set(CORE_MODULES)


def test_core_imports_with_django_and_redis_blocked() -> None:
    # A module set to None in sys.modules raises ImportError on import, submodules included.
    code = textwrap.dedent(
        f"""
        import importlib, sys
        for name in {BLOCKED!r}:
            sys.modules[name] = None
        for module in {CORE_MODULES!r}:
            importlib.import_module(module)
        leaked = sorted(
            name for name, module in sys.modules.items()
            if module is not None and name.split(".")[0] in {BLOCKED!r}
        )
        assert not leaked, leaked
        outside = sorted(
            name for name in sys.modules
            if name.startswith("django_quota.") and not name.startswith("django_quota.core")
        )
        assert not outside, outside
        print("ok", len({CORE_MODULES!r}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ok {len(CORE_MODULES)}"


def test_blocking_really_blocks_django() -> None:
    code = "import sys; sys.modules['django'] = None; import django.conf"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr


def test_import_linter_contracts_are_kept() -> None:
    executable = Path(sys.executable).with_name("lint-imports")
    command = str(executable) if executable.exists() else shutil.which("lint-imports")
    assert command is not None, "import-linter is not installed (extra 'test')"
    result = subprocess.run(
        [command, "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
