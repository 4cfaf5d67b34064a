"""``quota check`` tries what every algorithm in use needs, and ``docs/operations.md``
gives the exact ACL the scripts need (generated from the scripts: this file checks the
page holds the generated line). On a real redis-server: an ACL user with exactly those
rules decides every algorithm; one without a command a sliding log needs fails the check
with that command named."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

import django_quota
from django_quota import operations

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "acl-password-0123456"
ALGORITHMS = ("fixed_window", "sliding_window", "token_bucket", "sliding_log")
POLICIES = {
    f"acl-{algorithm}": {"algorithm": algorithm, "windows": "5/m", "selector": ["ip"]}
    for algorithm in ALGORITHMS
}


def documented_acl() -> str:
    """The ``ACL SETUSER`` line of ``docs/operations.md``."""
    page = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    (line,) = re.findall(r"^ *(ACL SETUSER .*)$", page, flags=re.MULTILINE)
    return str(line)


@pytest.fixture
def scripted_user(redis_url: str, redis_client: Any) -> Iterator[Any]:
    """``scripted_user(*rules)``: the user ``quota`` with the documented rules (its
    password ``PASSWORD``), less ``rules``; returns its URL. Deleted afterwards."""

    def make(*rules: str) -> str:
        documented = documented_acl().split()[3:]  # after ACL SETUSER quota
        documented = [rule if rule != ">PASSWORD" else f">{PASSWORD}" for rule in documented]
        redis_client.execute_command("ACL", "SETUSER", "quota", "reset", *documented, *rules)
        parts = urlsplit(redis_url)
        return f"redis://quota:{PASSWORD}@{parts.hostname}:{parts.port}/0"

    yield make
    redis_client.execute_command("ACL", "DELUSER", "quota")


def check(quota: Any, url: str, policies: dict[str, Any]) -> tuple[str, str | None]:
    quota(REDIS_URL=url, POLICIES=policies)
    out = io.StringIO()
    try:
        call_command("quota", "check", stdout=out, no_color=True)
    except CommandError as exc:
        return out.getvalue(), str(exc)
    return out.getvalue(), None


def test_the_documented_acl_is_the_one_generated_from_the_scripts() -> None:
    assert documented_acl() == operations.acl_setuser("quota", "PASSWORD", "quota")


def test_the_generated_acl_names_every_command_the_scripts_call() -> None:
    rules = operations.acl_setuser("quota", "PASSWORD", "quota").split()
    for command in ("+time", "+get", "+set", "+pexpire", "+lpush", "+ltrim", "+lrange"):
        assert command in rules
    assert "~quota:*" in rules and "+evalsha" in rules and "+script|load" in rules


def test_a_user_with_exactly_the_documented_acl_decides_every_algorithm(
    quota: Any, scripted_user: Any, redis_client: Any
) -> None:
    out, error = check(quota, scripted_user(), POLICIES)
    assert error is None, error
    (evaluation,) = [line for line in out.splitlines() if line.startswith("evaluation:")]
    assert evaluation.startswith("evaluation: ok - ")
    for algorithm in ALGORITHMS:
        assert algorithm in evaluation
    for policy_id in POLICIES:
        for _ in range(5):
            assert django_quota.evaluate(policy_id, {"ip": "192.0.2.1"}).decision == "allowed"
        assert django_quota.evaluate(policy_id, {"ip": "192.0.2.1"}).decision == "denied"
        assert django_quota.reset(policy_id, {"ip": "192.0.2.1"}) == 1
    assert all(key.startswith(b"quota:") for key in redis_client.keys("*"))


@pytest.mark.parametrize("command", ["pexpire", "lpush", "lrange", "lindex", "llen", "ltrim"])
def test_a_user_without_a_command_of_the_sliding_log_fails_the_check_naming_it(
    quota: Any, scripted_user: Any, redis_client: Any, command: str
) -> None:
    policies = {"acl-sliding_log": POLICIES["acl-sliding_log"]}
    _, error = check(quota, scripted_user(f"-{command}"), policies)
    assert error is not None
    assert error.startswith("evaluation: ")
    assert f"the user may not run {command.upper()}" in error
    assert "sliding_log" in error
