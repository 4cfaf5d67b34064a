"""docs/testing.md, run: the page's example project is written to a temporary directory
from the page itself and its tests run in a pytest subprocess, on the memory backend and
on a redis-server this suite started, so the guide cannot drift from what works.

Every fenced block whose first line is ``# <path>`` (``# myproject/views.py``,
``# pytest.ini``) is written to that path; a second block naming the same path is
appended. The page leaves out boilerplate a reader already has, which this test adds
first: the base of ``myproject/settings.py`` (apps, middleware, database), the URLconf
and the package ``__init__`` files. The page's ``myproject/settings.py`` block is then
appended to that base.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "testing.md"
PREFIX = "myproject-test-main"

BASE_SETTINGS = """
SECRET_KEY = "guide-example-not-secret"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "rest_framework",
    "django_quota",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django_quota.middleware.QuotaMiddleware",
]
ROOT_URLCONF = "myproject.urls"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
"""
URLS = """
from django.urls import path

from myproject import views

urlpatterns = [
    path("signup/", views.signup),
    path("api/items/", views.ItemList.as_view()),
]
"""


def page_files(text: str) -> dict[str, str]:
    """``{path: content}`` of the page's blocks that name a file on their first line."""
    files: dict[str, str] = {}
    for block in re.findall(r"^```[a-z]*\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL):
        first = block.split("\n", 1)[0]
        named = re.match(r"# ([\w./-]+\.(?:py|ini))\b", first)
        if named is None:
            continue
        files[named.group(1)] = files.get(named.group(1), "") + block
    return files


def page_test_names(files: dict[str, str]) -> list[str]:
    return [
        name
        for path, content in files.items()
        if path.endswith(".py")
        for name in re.findall(r"^\s*def (test_\w+)", content, flags=re.MULTILINE)
    ]


FILES = page_files(PAGE.read_text())
TESTS = page_test_names(FILES)


def write_project(pytester: pytest.Pytester, files: dict[str, str]) -> None:
    skeleton = {
        "myproject/__init__.py": "",
        "myproject/tests/__init__.py": "",
        "myproject/settings.py": textwrap.dedent(BASE_SETTINGS),
        "myproject/urls.py": textwrap.dedent(URLS),
    }
    for path, content in files.items():
        skeleton[path] = skeleton.get(path, "") + content
    for path, content in skeleton.items():
        target = pytester.path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)


def run(pytester: pytest.Pytester) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")


@pytest.fixture(autouse=True)
def _own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest-django exported this suite's settings module; the example has its own.
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    monkeypatch.delenv("TEST_REDIS_URL", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def test_the_page_has_the_files_and_tests_this_test_runs() -> None:
    assert {
        "pytest.ini",
        "conftest.py",
        "myproject/settings.py",
        "myproject/test_settings.py",
        "myproject/testclock.py",
        "myproject/views.py",
    } <= set(FILES)
    assert len(TESTS) == len(set(TESTS)) >= 8


def test_the_page_s_tests_pass_on_the_memory_backend(pytester: pytest.Pytester) -> None:
    write_project(pytester, FILES)
    result = run(pytester)
    result.assert_outcomes(passed=len(TESTS))


@pytest.mark.redis
def test_the_page_s_tests_pass_against_a_real_redis(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, redis_url: str, redis_client: Any
) -> None:
    write_project(pytester, FILES)
    monkeypatch.setenv("TEST_REDIS_URL", redis_url)
    result = run(pytester)
    result.assert_outcomes(passed=len(TESTS))
    # The last test's counters are still there (the fixture resets before a test): the
    # run really counted in this Redis, under the page's test prefix.
    assert list(redis_client.scan_iter(match=f"{PREFIX}:*"))


@pytest.mark.redis
def test_on_redis_the_plugin_alone_does_not_reset(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    # The page's claim: on Redis the conftest.py fixture's reset() is what isolates tests.
    without_reset = dict(FILES)
    without_reset["conftest.py"] = without_reset["conftest.py"].replace(
        "    reset()  # forget every counter", "    pass  # forget every counter"
    )
    assert without_reset["conftest.py"] != FILES["conftest.py"]
    write_project(pytester, without_reset)
    monkeypatch.setenv("TEST_REDIS_URL", redis_url)
    result = run(pytester)
    assert result.parseoutcomes().get("failed", 0) >= 1
