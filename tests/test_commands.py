"""``manage.py quota preload | policies | inspect | reset | check`` (docs/operations.md): exact
outputs, ``--json`` shapes, read-only inspection (nothing consumed, nothing written), the
confirmation of ``reset``, and failures as one-line ``CommandError`` s (exit status 1 in a
real process)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

import django_quota
from django_quota import policies
from django_quota.models import QuotaPolicy, QuotaWindow, revision_batch
from django_quota.scripts import all_scripts
from tests.output import without_unread_redis_py_warning


@pytest.fixture(autouse=True)
def _no_declared_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decorated views of other test modules declare their policies process-wide; the
    exact listings below are about settings and database policies."""
    monkeypatch.setattr(policies._state, "declared", {})


ROOT = Path(__file__).resolve().parent.parent
#: 20.4 s into a minute (1_700_000_040 is a multiple of 60), 860.4 s into an hour.
CLOCK = "tests.test_middleware.frozen_clock"
HMAC_KEY = "tests-hmac-key-0123456789"
ORDERS = {
    "algorithm": "fixed_window",
    "windows": {"burst": "10/s", "sustained": "1000/h"},
    "selector": ["user"],
    "routes": ["/api"],
}
API = {"windows": {"burst": "3/m", "sustained": "10/h"}, "selector": ["ip"], "routes": ["/api"]}
LOGIN = {
    "algorithm": "token_bucket",
    "windows": "5/m",
    "capacity": 10,
    "selector": ["ip"],
    "enforcement": "shadow",
    "failure_mode": "open",
}
IP = "203.0.113.9"


def quota_command(*args: str) -> str:
    out = io.StringIO()
    call_command("quota", *args, stdout=out, no_color=True)
    return out.getvalue()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def snapshot(client: Any) -> dict[str, Any]:
    """Everything Redis holds: each key with its type, value and memory usage."""
    state: dict[str, Any] = {"dbsize": client.dbsize()}
    for key in sorted(client.keys("*")):
        kind = client.type(key).decode()
        value = client.hgetall(key) if kind == "hash" else client.dump(key)
        state[key.decode()] = (kind, value, client.memory_usage(key))
    return state


# -- policies ---------------------------------------------------------------------------------
def test_policies_lists_the_effective_policies(quota: Any) -> None:
    quota(POLICIES={"orders": ORDERS, "login": LOGIN})
    revisions = {p: django_quota.policies.get_policy(p).revision for p in ("orders", "login")}
    assert quota_command("policies") == textwrap.dedent(f"""\
        policy  source    revision  algorithm     windows                      plans  selector  routes  enforcement  failure_mode  enabled
        orders  settings  {revisions["orders"]}  fixed_window  burst=10/s,sustained=1000/h  -      user      /api    enforce      closed        True
        login   settings  {revisions["login"]}  token_bucket  default=5/m(capacity=10)     -      ip        -       shadow       open          True
        """)  # noqa: E501


def test_policies_lists_each_plans_windows(quota: Any) -> None:
    planned = {
        **ORDERS,
        "plans": {
            "free": {"burst": "10/s", "sustained": "1000/h"},
            "pro": {"burst": "50/s", "sustained": "20000/h"},
        },
    }
    quota(POLICIES={"orders": planned})
    table = quota_command("policies").splitlines()
    assert table[0].split()[4:6] == ["windows", "plans"]
    assert table[1].split()[4:6] == [
        "burst=10/s,sustained=1000/h",
        "free:burst=10/s,sustained=1000/h;pro:burst=50/s,sustained=20000/h",
    ]
    (listed,) = json.loads(quota_command("policies", "--json"))
    assert listed["plans"] == [
        {"plan": "free", "windows": [
            {"window": "burst", "limit": 10, "period": 1.0, "capacity": None},
            {"window": "sustained", "limit": 1000, "period": 3600.0, "capacity": None},
        ]},
        {"plan": "pro", "windows": [
            {"window": "burst", "limit": 50, "period": 1.0, "capacity": None},
            {"window": "sustained", "limit": 20000, "period": 3600.0, "capacity": None},
        ]},
    ]


def test_policies_json_shape(quota: Any) -> None:
    quota(POLICIES={"orders": ORDERS, "login": LOGIN}, FAILURE_MODE="open")
    listed = json.loads(quota_command("policies", "--json"))
    assert listed == [
        {
            "policy": "orders",
            "source": "settings",
            "revision": django_quota.policies.get_policy("orders").revision,
            "algorithm": "fixed_window",
            "windows": [
                {"window": "burst", "limit": 10, "period": 1.0, "capacity": None},
                {"window": "sustained", "limit": 1000, "period": 3600.0, "capacity": None},
            ],
            "plans": [],
            "selector": ["user"],
            "routes": ["/api"],
            "enforcement": "enforce",
            "failure_mode": "open",  # QUOTA["FAILURE_MODE"] applied
            "enabled": True,
        },
        {
            "policy": "login",
            "source": "settings",
            "revision": django_quota.policies.get_policy("login").revision,
            "algorithm": "token_bucket",
            "windows": [{"window": "default", "limit": 5, "period": 60.0, "capacity": 10}],
            "plans": [],
            "selector": ["ip"],
            "routes": [],
            "enforcement": "shadow",
            "failure_mode": "open",
            "enabled": True,
        },
    ]


@pytest.mark.django_db
def test_policies_lists_database_policies_and_conflicts(quota: Any) -> None:
    quota(POLICY_SOURCES=["settings", "database"], POLICIES={"orders": ORDERS})
    for name in ("orders", "reports"):
        with revision_batch():
            policy = QuotaPolicy.objects.create(name=name, selector=["ip"], enabled=False)
            QuotaWindow.objects.create(policy=policy, name="default", limit=5, period=60)
    out, err = io.StringIO(), io.StringIO()
    call_command("quota", "policies", "--json", stdout=out, stderr=err)
    listed = {row["policy"]: row for row in json.loads(out.getvalue())}
    assert (listed["orders"]["source"], listed["reports"]["source"]) == ("settings", "database")
    reports = QuotaPolicy.objects.get(name="reports")
    assert reports.revision == 2  # drawn after the row named orders
    assert (listed["reports"]["revision"], listed["reports"]["enabled"]) == ("2", False)
    assert err.getvalue() == "ignored database rows (same id in settings): orders\n"


# -- inspect ----------------------------------------------------------------------------------
@pytest.fixture
def on_redis(quota: Any, redis_url: str) -> dict[str, Any]:
    return quota(CLOCK=CLOCK, REDIS_URL=redis_url, POLICIES={"api": API, "login": LOGIN})


def test_inspect_json_is_the_documented_shape(on_redis: Any) -> None:
    for _ in range(2):
        Client(REMOTE_ADDR=IP).get("/api/items/")
    found = json.loads(quota_command("inspect", "api", "--ip", IP, "--json"))
    assert set(found) == {"policy", "revision", "source", "identity", "windows"}
    assert (found["policy"], found["source"]) == ("api", "settings")
    assert found["revision"] == django_quota.policies.get_policy("api").revision
    assert found["identity"].startswith("id=v1.")
    windows = found["windows"]
    assert [set(w) for w in windows] == [
        {"window", "limit", "count", "remaining", "reset_after", "ttl_ms"}
    ] * 2
    ttls = [w.pop("ttl_ms") for w in windows]
    assert windows == [
        {"window": "burst", "limit": 3, "count": 2, "remaining": 1, "reset_after": 39.6},
        {"window": "sustained", "limit": 10, "count": 2, "remaining": 8, "reset_after": 2739.6},
    ]
    # One hash holds both windows: its TTL is the longest window's end plus CLEANUP_GRACE.
    assert ttls[0] == ttls[1]
    assert 2739.6 * 1000 < ttls[0] <= 2740.6 * 1000


def test_inspect_normalises_and_pseudonymises_like_the_middleware(
    on_redis: Any, redis_client: Any
) -> None:
    assert Client(REMOTE_ADDR=IP).get("/api/items/").status_code == 200
    mapped = json.loads(quota_command("inspect", "api", "--ip", f"::ffff:{IP}", "--json"))
    plain = json.loads(quota_command("inspect", "api", "--ip", IP, "--json"))
    assert mapped["identity"] == plain["identity"]
    assert [w["count"] for w in mapped["windows"]] == [1, 1]  # the middleware's counter
    pseudonym = plain["identity"].removeprefix("id=")
    keys = [key.decode() for key in redis_client.keys("*")]
    assert any(f"{{{pseudonym}}}" in key for key in keys)
    assert not any(IP in key for key in keys)
    text = quota_command("inspect", "api", "--ip", IP)
    assert IP not in text and pseudonym in text


def test_inspect_reads_without_consuming_or_writing(on_redis: Any, redis_client: Any) -> None:
    django_quota.evaluate("api", {"ip": IP})
    django_quota.evaluate("login", {"ip": IP})
    before = snapshot(redis_client)
    ttl_before = {key: redis_client.pttl(key) for key in redis_client.keys("*")}
    for _ in range(3):
        quota_command("inspect", "api", "--ip", IP)
        quota_command("inspect", "api", "--ip", IP, "--json")
        quota_command("inspect", "login", "--ip", IP, "--json")
        quota_command("inspect", "api", "--ip", "198.51.100.7", "--json")  # unseen subject
    assert snapshot(redis_client) == before
    for key, ttl in ttl_before.items():
        assert 0 < redis_client.pttl(key) <= ttl  # no expiry pushed back
    assert django_quota.peek("api", {"ip": IP}).remaining == 2


def test_inspect_of_an_unseen_subject(on_redis: Any) -> None:
    found = json.loads(quota_command("inspect", "api", "--ip", IP, "--json"))
    assert [(w["count"], w["remaining"], w["ttl_ms"]) for w in found["windows"]] == [
        (0, 3, -2), (0, 10, -2)
    ]
    assert quota_command("inspect", "api", "--ip", IP).splitlines()[1:] == [
        "  burst: count 0 of 3, remaining 3, reset in 39.6 s, no state",
        "  sustained: count 0 of 10, remaining 10, reset in 2739.6 s, no state",
    ]


def test_inspect_shows_tokens_for_a_token_bucket(on_redis: Any) -> None:
    for _ in range(3):
        django_quota.evaluate("login", {"ip": IP})
    found = json.loads(quota_command("inspect", "login", "--ip", IP, "--json"))
    window = found["windows"][0]
    assert (window["limit"], window["count"], window["remaining"]) == (10, 7, 7)
    assert window["reset_after"] == 36.0  # 3 tokens at 5 per minute
    lines = quota_command("inspect", "login", "--ip", IP).splitlines()
    assert lines[0] == (
        f"policy login (source settings, revision {found['revision']}, token_bucket); "
        f"identity {found['identity']}"
    )
    assert lines[1].startswith("  default: tokens 7 of 10, remaining 7, reset in 36.0 s, ttl ")


def test_inspect_of_a_disabled_policy_still_reads_its_counters(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "enabled": False}})
    found = json.loads(quota_command("inspect", "api", "--ip", IP, "--json"))
    assert [w["remaining"] for w in found["windows"]] == [3, 10]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("inspect", "nope", "--ip", IP), "no policy named 'nope'"),
        (("inspect", "api", "--user", "42"),
         "cannot inspect 'api': selector_identity_missing (ip)"),
        (("inspect", "api", "--ip", "not-an-ip"),
         "cannot inspect 'api': selector_identity_invalid (ip)"),
        (("reset", "api", "--yes"), "cannot reset 'api': selector_identity_missing (ip)"),
        (("reset", "nope", "--yes", "--ip", IP), "no policy named 'nope'"),
    ],
)
@pytest.mark.django_db  # --user is looked up in the user table
def test_bad_arguments_fail_with_one_line(quota: Any, args: tuple[str, ...], message: str) -> None:
    quota(POLICIES={"api": API})
    with pytest.raises(CommandError) as caught:
        quota_command(*args)
    assert str(caught.value) == message


def test_inspect_on_a_dead_backend_fails_with_one_line(quota: Any) -> None:
    quota(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", POLICIES={"api": API})
    with pytest.raises(CommandError) as caught:
        quota_command("inspect", "api", "--ip", IP)
    assert str(caught.value).startswith("backend failure (backend_unavailable): ")
    assert "\n" not in str(caught.value)


# -- reset ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--yes", "--no-input"])
def test_reset_with_a_flag_skips_the_confirmation(on_redis: Any, flag: str,
                                                   redis_client: Any) -> None:
    django_quota.evaluate("api", {"ip": IP})
    django_quota.evaluate("api", {"ip": "198.51.100.7"})
    assert quota_command("reset", "api", flag, "--ip", f"::ffff:{IP}") == (
        "reset api: 2 window(s) had state\n"
    )
    assert django_quota.peek("api", {"ip": IP}).remaining == 3
    assert django_quota.peek("api", {"ip": "198.51.100.7"}).remaining == 2
    assert quota_command("reset", "api", flag, "--ip", IP) == "reset api: 0 window(s) had state\n"


def test_reset_refuses_without_confirmation_when_stdin_is_not_a_tty(
    on_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    django_quota.evaluate("api", {"ip": IP})
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    with pytest.raises(CommandError) as caught:
        quota_command("reset", "api", "--ip", IP)
    assert str(caught.value) == "refusing to reset without confirmation; pass --yes"
    assert django_quota.peek("api", {"ip": IP}).remaining == 2


@pytest.mark.parametrize(("answer", "reset"), [("y", True), ("yes", True), ("n", False),
                                               ("", False)])
def test_reset_asks_on_a_tty(
    on_redis: Any, monkeypatch: pytest.MonkeyPatch, answer: str, reset: bool
) -> None:
    django_quota.evaluate("api", {"ip": IP})
    prompts: list[str] = []
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: prompts.append(prompt) or answer)
    if reset:
        assert quota_command("reset", "api", "--ip", IP) == "reset api: 2 window(s) had state\n"
    else:
        with pytest.raises(CommandError, match=r"^reset cancelled$"):
            quota_command("reset", "api", "--ip", IP)
    assert prompts == ["Delete the counters of api for the given ip? [y/N] "]
    assert django_quota.peek("api", {"ip": IP}).remaining == (3 if reset else 2)


# -- preload ----------------------------------------------------------------------------------
def test_preload_loads_every_script_and_prints_its_sha1(on_redis: Any, redis_client: Any) -> None:
    redis_client.script_flush()
    scripts = all_scripts()
    assert quota_command("preload") == "".join(f"{s.name} {s.sha1}\n" for s in scripts)
    assert redis_client.script_exists(*(s.sha1 for s in scripts)) == [True] * len(scripts)
    assert json.loads(quota_command("preload", "--json")) == [
        {"script": s.name, "sha1": s.sha1} for s in scripts
    ]


def test_preload_on_the_memory_backend_has_nothing_to_load(quota: Any) -> None:
    quota()
    assert quota_command("preload") == "memory backend: no scripts to load\n"


def test_preload_on_a_dead_backend_fails_with_one_line(quota: Any) -> None:
    quota(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(CommandError) as caught:
        quota_command("preload")
    assert str(caught.value).startswith("backend failure (backend_unavailable): ")
    assert "\n" not in str(caught.value)


# -- check ------------------------------------------------------------------------------------
def test_check_on_a_live_redis_is_all_ok(on_redis: Any) -> None:
    lines = quota_command("check").splitlines()
    assert [line.split(":", 1)[0] for line in lines] == [
        "connectivity", "latency", "scripts", "evaluation", "clock offset", "maxmemory-policy"
    ]
    assert all(": ok - " in line for line in lines), lines
    assert lines[0] == "connectivity: ok - PING answered"
    scripts = all_scripts()
    assert lines[2] == "scripts: ok - " + ", ".join(f"{s.name} {s.sha1}" for s in scripts)
    assert lines[5] == "maxmemory-policy: ok - noeviction (maxmemory 0)"
    rows = json.loads(quota_command("check", "--json"))
    assert [(row["check"], row["status"]) for row in rows] == [
        (line.split(":", 1)[0], "ok") for line in lines
    ]


def test_check_on_a_dead_port_fails_with_one_line(quota: Any) -> None:
    port = free_port()
    quota(REDIS_URL=f"redis://127.0.0.1:{port}/0")
    out = io.StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("quota", "check", stdout=out, no_color=True)
    message = str(caught.value)
    assert message.startswith("connectivity: ")
    assert str(port) in message and "\n" not in message
    assert out.getvalue() == f"connectivity: error - {message.removeprefix('connectivity: ')}\n"


def test_check_warns_about_an_evicting_maxmemory_policy(on_redis: Any, redis_client: Any) -> None:
    redis_client.config_set("maxmemory", "100mb")
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        lines = quota_command("check").splitlines()
    finally:
        redis_client.config_set("maxmemory-policy", "noeviction")
        redis_client.config_set("maxmemory", "0")
    assert lines[-1] == (
        "maxmemory-policy: warning - allkeys-lru with maxmemory 104857600 can evict live "
        "counters, which resets limits; use noeviction for the rate-limit database"
    )
    assert all(": ok - " in line for line in lines[:-1])


def test_check_on_the_memory_backend(quota: Any) -> None:
    quota()
    assert quota_command("check") == (
        "backend: ok - memory: process-local, 0 of 4096 counters in use\n"
    )


# -- a real process ---------------------------------------------------------------------------
def run_manage(tmp_path: Path, quota_setting: dict[str, Any], *args: str,
               command: str = "quota") -> Any:
    """``python -m django quota …`` with the test settings plus ``QUOTA`` and a database
    file in ``tmp_path``, stdin closed; its stderr without the warning of a redis-py the
    fence was not read against (``tests/output.py``)."""
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}
    (tmp_path / "command_settings.py").write_text(
        "from tests.settings import *  # noqa: F403\n"
        f"QUOTA = {quota_setting!r}\n"
        f"DATABASES = {{'default': {database!r}}}\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "command_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "django", command, *args],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    result.stderr = without_unread_redis_py_warning(result.stderr)
    return result


def test_failures_exit_with_status_one_and_one_line(tmp_path: Path) -> None:
    dead = {"HMAC_KEY": HMAC_KEY, "POLICY_SOURCES": ["settings"], "POLICIES": {"api": API},
            "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    unknown = run_manage(tmp_path, dead, "inspect", "nope", "--ip", IP)
    assert (unknown.returncode, unknown.stdout) == (1, "")
    assert unknown.stderr == "CommandError: no policy named 'nope'\n"
    refused = run_manage(tmp_path, dead, "reset", "api", "--ip", IP)
    assert refused.returncode == 1
    assert refused.stderr == (
        "CommandError: refusing to reset without confirmation; pass --yes\n"
    )
    check = run_manage(tmp_path, dead, "check")
    assert check.returncode == 1
    assert check.stderr.startswith("CommandError: connectivity: ")
    assert check.stderr.count("\n") == 1


def test_a_read_command_exits_zero(tmp_path: Path) -> None:
    listed = run_manage(
        tmp_path, {"HMAC_KEY": HMAC_KEY, "POLICY_SOURCES": ["settings"], "POLICIES": {"api": API}},
        "policies", "--json",
    )
    assert (listed.returncode, listed.stderr) == (0, "")
    assert [row["policy"] for row in json.loads(listed.stdout)] == ["api"]


def test_commands_run_while_a_system_check_fails(tmp_path: Path) -> None:
    """E007 is an error of ``manage.py check``; ``quota policies`` must still show it."""
    setting = {"HMAC_KEY": HMAC_KEY, "POLICY_SOURCES": ["settings", "database"],
               "POLICIES": {"api": API}}
    assert run_manage(tmp_path, setting, "-v0", command="migrate").returncode == 0
    code = (
        "import django; django.setup()\n"
        "from django_quota.models import QuotaPolicy, QuotaWindow\n"
        "policy = QuotaPolicy.objects.create(name='api')\n"
        "QuotaWindow.objects.create(policy=policy, name='default', limit=1, period=60)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "command_settings",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
    assert "django_quota.E007" in run_manage(tmp_path, setting, command="check").stderr
    listed = run_manage(tmp_path, setting, "policies", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [(row["policy"], row["source"]) for row in json.loads(listed.stdout)] == [
        ("api", "settings")
    ]
    assert listed.stderr.splitlines()[-1] == "ignored database rows (same id in settings): api"


# -- --user: primary key or USERNAME_FIELD --------------------------------------------------
USER_POLICY = {"windows": "5/h", "selector": ["user"]}


@pytest.fixture
def user_policy(quota: Any, django_user_model: Any) -> Any:
    quota(CLOCK=CLOCK, POLICIES={"per-user": USER_POLICY})
    return django_user_model


def command_with_stderr(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("quota", *args, stdout=out, stderr=err, no_color=True)
    return out.getvalue(), err.getvalue()


@pytest.mark.django_db
def test_inspect_and_reset_take_a_username(user_policy: Any) -> None:
    admin = user_policy.objects.create_user("admin", password="pw")
    for _ in range(2):
        django_quota.evaluate("per-user", {"user": str(admin.pk)})
    out, err = command_with_stderr("inspect", "per-user", "--user", "admin", "--json")
    assert json.loads(out)["windows"][0]["count"] == 2
    assert err == "--user matched a user by username (USERNAME_FIELD 'username')\n"
    out, err = command_with_stderr("reset", "per-user", "--user", "admin", "--yes")
    assert out == "reset per-user: 1 window(s) had state\n"
    assert django_quota.peek("per-user", {"user": str(admin.pk)}).remaining == 5


@pytest.mark.django_db
def test_inspect_and_reset_take_a_primary_key(user_policy: Any) -> None:
    member = user_policy.objects.create_user("member", password="pw")
    django_quota.evaluate("per-user", {"user": str(member.pk)})
    out, err = command_with_stderr("inspect", "per-user", "--user", str(member.pk), "--json")
    assert json.loads(out)["windows"][0]["count"] == 1
    assert err == "--user matched a user by primary key\n"
    out, err = command_with_stderr("reset", "per-user", "--user", str(member.pk), "--yes")
    assert out == "reset per-user: 1 window(s) had state\n"


@pytest.mark.django_db
def test_a_user_that_no_longer_exists_is_taken_as_a_primary_key(user_policy: Any) -> None:
    django_quota.evaluate("per-user", {"user": "4242"})
    out, err = command_with_stderr("reset", "per-user", "--user", "4242", "--yes")
    assert out == "reset per-user: 1 window(s) had state\n"
    assert err == "--user matched no user; it is used as a primary key as given\n"


@pytest.mark.django_db
def test_a_value_naming_two_users_is_refused(user_policy: Any) -> None:
    first = user_policy.objects.create_user("first", password="pw")
    user_policy.objects.create_user(str(first.pk), password="pw")  # a username like a pk
    django_quota.evaluate("per-user", {"user": str(first.pk)})
    with pytest.raises(CommandError) as caught:
        command_with_stderr("reset", "per-user", "--user", str(first.pk), "--yes")
    assert str(caught.value) == (
        "--user matches one user's primary key and another user's username; name the user "
        "by the other one"
    )
    assert django_quota.peek("per-user", {"user": str(first.pk)}).remaining == 4


# -- Django's common options after the subcommand -----------------------------------------
def run_without_settings_env(tmp_path: Path, *args: str) -> Any:
    """``python -m django quota …`` with no DJANGO_SETTINGS_MODULE: only ``--settings``
    names them."""
    run_manage(tmp_path, {"HMAC_KEY": HMAC_KEY, "POLICY_SOURCES": ["settings"],
                          "POLICIES": {"api": API}}, "policies")  # writes command_settings
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-m", "django", "quota", *args],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("policies", "--json", "--settings", "command_settings"),
        ("policies", "--settings=command_settings", "--json", "-v", "0", "--no-color"),
        ("--settings", "command_settings", "policies", "--json"),
    ],
)
def test_common_options_work_after_the_subcommand(tmp_path: Path, args: tuple[str, ...]) -> None:
    listed = run_without_settings_env(tmp_path, *args)
    assert (listed.returncode, listed.stderr) == (0, "")
    assert [row["policy"] for row in json.loads(listed.stdout)] == ["api"]


@pytest.mark.parametrize("where", ["after", "before"])
def test_traceback_works_on_either_side_of_the_subcommand(tmp_path: Path, where: str) -> None:
    inspect = ["inspect", "nope", "--ip", IP]
    args = [*inspect, "--traceback"] if where == "after" else ["--traceback", *inspect]
    failed = run_without_settings_env(tmp_path, "--settings", "command_settings", *args)
    assert failed.returncode == 1
    assert "Traceback (most recent call last)" in failed.stderr
    assert failed.stderr.rstrip().endswith("CommandError: no policy named 'nope'")
    plain = run_without_settings_env(tmp_path, *inspect, "--settings", "command_settings")
    assert plain.stderr == "CommandError: no policy named 'nope'\n"


def test_inspect_with_a_plan_shows_that_plans_limits(quota: Any) -> None:
    """A policy with plans keeps one counter (docs/plans.md): ``--plan`` reads it under
    the customer's plan; without it, under the policy's own windows."""
    plans = {"pro": {"burst": "30/m", "sustained": "100/h"}}
    quota(CLOCK=CLOCK, POLICIES={"api": {**API, "plans": plans}})
    for _ in range(2):
        django_quota.evaluate("api", {"ip": IP}, plan="pro")
    found = json.loads(quota_command("inspect", "api", "--ip", IP, "--plan", "pro", "--json"))
    assert [(w["limit"], w["count"], w["remaining"]) for w in found["windows"]] == [
        (30, 2, 28), (100, 2, 98)
    ]
    found = json.loads(quota_command("inspect", "api", "--ip", IP, "--json"))
    assert [(w["limit"], w["count"], w["remaining"]) for w in found["windows"]] == [
        (3, 2, 1), (10, 2, 8)
    ]
