"""Secrets on operator pages: the status page's Redis URL never shows a password, however
it is spelled, and the documented exception-reporter filter keeps ``QUOTA["REDIS_URL"]``
out of Django's DEBUG error page (its technical 500 response, rendered for real)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from django.views.debug import get_default_exception_reporter_filter, technical_500_response

import django_quota
from django_quota.admin import _redacted

DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
STATUS = "/admin/django_quota/quotapolicy/status/"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        ("redis://:pa#ss@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        ("redis://app:pa/ss@127.0.0.1:6379/0", "redis://app:***@127.0.0.1:6379/0"),
        ("redis://:pa?ss@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        ("redis://:p@ss@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        ("redis://app:pa:ss@127.0.0.1:6379/0", "redis://app:***@127.0.0.1:6379/0"),
        ("rediss://app:a#b/c?d@e:f@cache.internal:6380/1",
         "rediss://app:***@cache.internal:6380/1"),
        ("redis://:p%40ss%23@127.0.0.1/0", "redis://***@127.0.0.1/0"),
        ("redis://app@127.0.0.1:6379/0", "redis://app@127.0.0.1:6379/0"),  # a user, no password
        ("redis://127.0.0.1:6379/0?password=se#cret&db=2",
         "redis://127.0.0.1:6379/0?password=***&db=2"),
        ("redis://127.0.0.1/0?db=2&Password=a/b?c", "redis://127.0.0.1/0?db=2&Password=***"),
        ("redis://127.0.0.1/0?%70assword=s3cret", "redis://127.0.0.1/0?%70assword=***"),
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("not a url with pa#ss", "***"),
    ],
)
def test_redaction_never_shows_a_password(url: str, shown: str) -> None:
    assert _redacted(url) == shown


@pytest.mark.django_db
@pytest.mark.parametrize("password", ["p@ss", "pa:ss"])
def test_status_page_hides_passwords_with_url_delimiters(
    admin_client: Client, quota: Any, password: str
) -> None:
    quota(REDIS_URL=f"redis://app:{password}@127.0.0.1:6399/0")
    page = admin_client.get(STATUS).content.decode()
    assert "redis://app:***@127.0.0.1:6399/0" in page
    assert password not in page
    after_delimiter = re.split(r"[#/?@:]", password)[1]
    assert f"{after_delimiter}@127.0.0.1" not in page


UNSHOWN_HINT = (
    "fix the port, host or query options; the value is not shown (it may hold a password)"
)


@pytest.mark.parametrize("password", ["pa#ss", "pa/ss", "pa?ss"])
def test_an_unescaped_delimiter_in_a_password_is_a_check_error_that_shows_none_of_it(
    quota: Any, password: str
) -> None:
    # redis-py cannot connect with such a URL (it reads "pa" as the port): the settings
    # check says so, and neither it nor the first use quotes a piece of the password.
    quota(REDIS_URL=f"redis://app:{password}@127.0.0.1:6399/0")
    said = (
        "QUOTA['REDIS_URL']: not a URL redis-py can connect to: its port is not a number"
        " from 0 to 65535 (a '#', '/', '?' or '@' in the password must be percent-encoded)"
    )
    errors = [e for e in checks.run_checks() if e.id == "django_quota.E003"]
    assert [(e.msg, e.hint) for e in errors] == [(said, UNSHOWN_HINT)]
    with pytest.raises(ImproperlyConfigured) as raised:
        django_quota.evaluate("p", {"ip": "192.0.2.1"})
    assert str(raised.value) == f"{said} (django_quota.E003; run manage.py check for all)"


# -- the DEBUG error page ---------------------------------------------------------------------
PASSWORD = "s3cret-pa#ss"
URL = f"redis://app:{PASSWORD}@cache.internal:6379/0"


def documented_filter() -> str:
    """Import the filter class exactly as docs/operations.md shows it; its dotted path."""
    text = DOCS.read_text()
    block = re.search(r"```python\n(# myproject/reporting\.py\n.*?)```", text, re.S)
    assert block is not None, "the reporter filter example is missing from the docs"
    module = types.ModuleType("myproject_reporting")
    exec(compile(block.group(1), str(DOCS), "exec"), module.__dict__)
    sys.modules["myproject_reporting"] = module
    return "myproject_reporting.QuotaSafeExceptionReporterFilter"


@pytest.fixture(autouse=True)
def _fresh_reporter_filter() -> Any:
    """Django caches the filter instance for the process: each test gets its own."""
    get_default_exception_reporter_filter.cache_clear()
    yield
    get_default_exception_reporter_filter.cache_clear()
    sys.modules.pop("myproject_reporting", None)


def error_page(rf: Any) -> str:
    request = rf.get("/orders/")
    request.META["QUOTA_REDIS_URL"] = URL  # runserver copies the environment into META
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        response = technical_500_response(request, *sys.exc_info())
    return str(response.content.decode())


def test_djangos_error_page_shows_the_redis_password_by_default(rf: Any, settings: Any) -> None:
    settings.DEBUG = True
    settings.QUOTA = {"REDIS_URL": URL, "HMAC_KEY": "tests-hmac-key-0123456789"}
    page = error_page(rf)
    assert PASSWORD in page  # what the documented filter is for
    assert "tests-hmac-key-0123456789" not in page  # Django hides *KEY* already


def test_the_documented_filter_hides_the_redis_url(rf: Any, settings: Any) -> None:
    settings.DEBUG = True
    settings.DEFAULT_EXCEPTION_REPORTER_FILTER = documented_filter()
    settings.QUOTA = {"REDIS_URL": URL, "HMAC_KEY": "tests-hmac-key-0123456789"}
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                                   "LOCATION": URL}}
    page = error_page(rf)
    assert PASSWORD not in page
    assert "cache.internal" not in page
    assert re.search(r"&#x27;REDIS_URL&#x27;: &#x27;\*{20}&#x27;", page)  # listed, value hidden


@pytest.mark.parametrize(
    "url",
    [
        "http://app:s3cret@cache.internal:6379/0",  # a wrong scheme
        "redis:/:s3cret@cache.internal:6379/0",  # a typo: no "://"
        ":s3cret@cache.internal:6379/0",  # no scheme at all
        "app:s3cret@redis://cache.internal:6379/0",  # userinfo before the scheme
        b"redis://:s3cret@cache.internal:6379/0",  # bytes, not a string
    ],
)
def test_an_invalid_redis_url_is_reported_without_its_password(url: object) -> None:
    from django_quota import conf

    _, problems = conf.parse_settings({"REDIS_URL": url})
    [problem] = [p for p in problems if p.key == "QUOTA['REDIS_URL']"]
    assert problem.id == "django_quota.E003"
    assert "s3cret" not in f"{problem.message} {problem.hint}"
    assert "redis://, rediss:// or unix://" in problem.message


def test_improperly_configured_for_a_bad_redis_url_hides_its_password(settings: Any) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from django_quota import conf

    settings.QUOTA = {"REDIS_URL": "http://app:s3cret@cache.internal:6379/0"}
    with pytest.raises(ImproperlyConfigured) as raised:
        conf.get_settings()
    assert "REDIS_URL" in str(raised.value)
    assert "s3cret" not in str(raised.value)
    assert "'http'" in str(raised.value)  # the scheme is named, so the mistake is findable
