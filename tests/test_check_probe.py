"""``quota check`` runs the real scripts (``docs/operations.md``): a peek and a charge of a
probe counter with ``evaluate.lua``, then ``reset.lua``, and the probe removed, so that it
exits non-zero whenever evaluations cannot work. On a real redis-server: ACL users
without ``SET``, ``TIME`` or ``EVALSHA``, a full Redis (``maxmemory`` with
``noeviction``), a wrong password."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.test_commands import HMAC_KEY, run_manage

pytestmark = pytest.mark.redis

CHECKS = ["connectivity", "latency", "scripts", "evaluation", "clock offset", "maxmemory-policy"]
PASSWORD = "probe-password-0123"


def check(quota: Any, url: str) -> tuple[list[str], str | None]:
    """``quota check`` on ``url``: its lines, and the CommandError's message (if any)."""
    quota(REDIS_URL=url)
    out = io.StringIO()
    try:
        call_command("quota", "check", stdout=out, no_color=True)
    except CommandError as exc:
        return out.getvalue().splitlines(), str(exc)
    return out.getvalue().splitlines(), None


def row(lines: list[str], name: str) -> str:
    (found,) = [line for line in lines if line.startswith(f"{name}: ")]
    return found


@pytest.fixture
def acl_user(redis_url: str, redis_client: Any) -> Iterator[Any]:
    """``acl_user(name, *rules)``: an ACL user with ``PASSWORD``, every key and every
    command but those the rules take away; returns its URL. Deleted afterwards."""
    created: list[str] = []

    def make(name: str, *rules: str) -> str:
        redis_client.execute_command(
            "ACL", "SETUSER", name, "reset", "on", f">{PASSWORD}", "~*", "&*", "+@all", *rules
        )
        created.append(name)
        parts = urlsplit(redis_url)
        return f"redis://{name}:{PASSWORD}@{parts.hostname}:{parts.port}/0"

    yield make
    for name in created:
        redis_client.execute_command("ACL", "DELUSER", name)


def test_a_healthy_redis_runs_the_probe_and_leaves_no_key(
    quota: Any, redis_url: str, redis_client: Any
) -> None:
    lines, error = check(quota, redis_url)
    assert error is None
    assert [line.split(":", 1)[0] for line in lines] == CHECKS
    # No policy of the test settings uses another algorithm; DRF is installed: its drop-ins'
    # DRF_ALGORITHM, the sliding log, is probed too.
    assert row(lines, "evaluation") == (
        "evaluation: ok - evaluate.lua peeked and charged a probe counter of each algorithm "
        "in use (fixed_window, sliding_log (3 charges, the list trimmed)), reset.lua reset "
        "them, and they were removed"
    )
    assert redis_client.keys("*") == []


def test_an_acl_user_without_set_fails_the_check(
    quota: Any, acl_user: Any, redis_client: Any
) -> None:
    lines, error = check(quota, acl_user("quota-no-set", "-set"))
    assert error is not None
    assert error.startswith("evaluation: charge 1 failed for fixed_window (backend_error): ")
    assert "The user executing the script can't run this command" in error
    assert error.endswith("(the user may not run SET)")
    assert row(lines, "evaluation").startswith("evaluation: error - charge 1 failed")
    assert row(lines, "connectivity") == "connectivity: ok - PING answered"
    assert redis_client.keys("*") == []


def test_an_acl_user_without_time_fails_the_check(quota: Any, acl_user: Any) -> None:
    lines, error = check(quota, acl_user("quota-no-time", "-time"))
    assert error is not None
    assert error.startswith("evaluation: peek failed for fixed_window (backend_error): ")
    assert error.endswith("(the user may not run TIME)")
    assert row(lines, "clock offset").startswith("clock offset: warning - TIME failed")


def test_an_acl_user_without_evalsha_fails_the_check(quota: Any, acl_user: Any) -> None:
    lines, error = check(quota, acl_user("quota-no-evalsha", "-evalsha"))
    assert row(lines, "scripts").startswith("scripts: ok - ")  # SCRIPT LOAD is allowed
    assert error == (
        "evaluation: peek failed for fixed_window (backend_error): NoPermissionError: this user "
        "has no permissions to run the 'evalsha' command"
    )


def test_a_wrong_password_fails_the_check(quota: Any, acl_user: Any) -> None:
    url = acl_user("quota-wrongpass").replace(PASSWORD, "not-the-password")
    lines, error = check(quota, url)
    assert error is not None and error.startswith("connectivity: ")
    assert "WRONGPASS" in error or "invalid username-password" in error
    assert lines == [f"connectivity: error - {error.removeprefix('connectivity: ')}"]


@pytest.fixture
def full_redis(redis_client: Any) -> Iterator[None]:
    """The server over its ``maxmemory`` with ``noeviction``: every write is refused."""
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", "1")
    try:
        yield
    finally:
        redis_client.config_set("maxmemory", "0")


def test_a_full_redis_fails_the_check(
    quota: Any, redis_url: str, redis_client: Any, full_redis: None
) -> None:
    lines, error = check(quota, redis_url)
    assert error is not None and error.startswith(
        "evaluation: charge 1 failed for fixed_window (backend_error): OutOfMemoryError: "
        "command not allowed when used memory > 'maxmemory'"
    )
    assert "the user may not run" not in error  # a full Redis is no ACL refusal
    assert row(lines, "maxmemory-policy") == "maxmemory-policy: ok - noeviction (maxmemory 1)"


def test_a_full_redis_exits_non_zero_from_manage_py(
    tmp_path: Path, redis_url: str, full_redis: None
) -> None:
    setting = {"HMAC_KEY": HMAC_KEY, "POLICY_SOURCES": ["settings"], "REDIS_URL": redis_url}
    result = run_manage(tmp_path, setting, "check", "--json")
    assert result.returncode == 1
    assert result.stderr.startswith("CommandError: evaluation: ")
    rows = {item["check"]: item["status"] for item in json.loads(result.stdout)}
    assert rows["evaluation"] == "error"
