"""``manage.py quota preload | policies | inspect | reset | check`` (docs/operations.md).

Thin: parse, call the library, write through ``self.stdout``; failures raise
``CommandError`` with a one-line reason (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_quota import conf, limiter, operations, policies
from django_quota.core.errors import BackendError
from django_quota.core.policy import TOKEN_BUCKET, Policy, Window, counted_calendar
from django_quota.core.rates import format_rate

SUBJECT_OPTIONS = (
    ("user", "--user"),
    ("api_key", "--api-key"),
    ("ip", "--ip"),
    ("route", "--route"),
    ("tenant", "--tenant"),
)


class Command(BaseCommand):
    help = "Operate django-quota: preload scripts, list policies, inspect or reset counters."
    # An operator's tool must run while a check fails: `quota policies` is how one looks
    # into an E007 conflict, `quota check` into a broken backend. QUOTA itself is
    # validated in handle().
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        commands = parser.add_subparsers(dest="subcommand", required=True)
        preload = commands.add_parser("preload", help="load every script on Redis")
        preload.add_argument("--json", action="store_true")
        listing = commands.add_parser("policies", help="list the effective policies")
        listing.add_argument("--json", action="store_true")
        inspect = commands.add_parser("inspect", help="show a subject's windows (read-only)")
        inspect.add_argument("policy")
        inspect.add_argument("--json", action="store_true")
        inspect.add_argument(
            "--plan", help="read a policy with plans under this plan's limits (docs/plans.md)"
        )
        reset = commands.add_parser("reset", help="delete a subject's counters")
        reset.add_argument("policy")
        reset.add_argument("--yes", "--no-input", action="store_true", dest="yes")
        for subcommand in (inspect, reset):
            for dimension, flag in SUBJECT_OPTIONS:
                help_text = f"the raw {dimension}"
                if dimension == "user":
                    help_text = "the user's primary key or USERNAME_FIELD value"
                subcommand.add_argument(flag, dest=dimension, help=help_text)
        check = commands.add_parser("check", help="test the backend and its configuration")
        check.add_argument("--json", action="store_true")
        for subcommand in (preload, listing, inspect, reset, check):
            _add_common_options(subcommand)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            conf.get_settings()
        except Exception as exc:
            raise CommandError(f"invalid settings: {exc}") from exc
        handler = getattr(self, f"_{options['subcommand']}")
        if options["subcommand"] in ("policies", "inspect", "reset"):
            self._generated = _load_generated()
        try:
            handler(options)
        except BackendError as exc:
            raise CommandError(f"backend failure ({exc.reason}): {exc}") from exc
        except policies.UnknownPolicy as exc:
            raise CommandError(str(exc)) from exc
        except ValueError as exc:
            raise CommandError(str(exc)) from exc

    # -- subcommands -----------------------------------------------------------------------
    def _preload(self, options: dict[str, Any]) -> None:
        loaded = limiter.get_backend().preload()
        if options["json"]:
            self._json([{"script": name, "sha1": sha} for name, sha in loaded])
            return
        if not loaded:
            self.stdout.write("memory backend: no scripts to load")
        for name, sha in loaded:
            self.stdout.write(f"{name} {sha}")

    def _policies(self, options: dict[str, Any]) -> None:
        settings = conf.get_settings()
        registry = policies.get_registry()
        effective = dict(registry.policies)
        for policy in self._generated:
            effective.setdefault(policy.id, policy)
        rows = [_policy_row(policy, settings) for policy in effective.values()]
        if registry.conflicts:  # on stderr, so that --json output stays JSON
            self.stderr.write(
                "ignored database rows (same id in settings): " + ", ".join(registry.conflicts)
            )
        if options["json"]:
            self._json(rows)
            return
        columns = ("policy", "source", "revision", "algorithm", "windows", "plans", "selector",
                   "routes", "enforcement", "failure_mode", "enabled")
        table = [[_cell(row[column]) for column in columns] for row in rows]
        widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(columns)]
        for line in [list(columns), *table]:
            self.stdout.write(
                "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            )

    def _subject(self, options: dict[str, Any]) -> dict[str, str]:
        """The subject of ``inspect``/``reset``, ``--user`` resolved to a primary key (the
        note on stderr, so that ``--json`` output stays JSON)."""
        subject = _subject(options)
        if "user" in subject and options["policy"] in conf.get_settings().login_policies:
            # A login policy counts the submitted username (docs/login.md).
            from django_quota.auth import submitted_username

            subject["user"] = submitted_username({"username": subject["user"]}) or ""
            self.stderr.write("--user is a username: the policy is in LOGIN_POLICIES")
        elif "user" in subject:
            subject["user"], note = _user_pk(subject["user"])
            self.stderr.write(note)
        return subject

    def _inspect(self, options: dict[str, Any]) -> None:
        found = operations.inspect(
            options["policy"], self._subject(options), plan=options.get("plan")
        )
        if options["json"]:
            self._json(found.as_dict())
            return
        policy = found.policy
        self.stdout.write(
            f"policy {policy.id} (source {policy.source}, revision {policy.revision}, "
            f"{policy.algorithm}); identity {found.identity}"
        )
        counted = "tokens" if policy.algorithm == TOKEN_BUCKET else "count"
        for window in found.windows:
            ttl = "no state" if window["ttl_ms"] == -2 else f"ttl {window['ttl_ms']} ms"
            self.stdout.write(
                f"  {window['window']}: {counted} {window['count']} of {window['limit']}, "
                f"remaining {window['remaining']}, reset in {window['reset_after']} s, {ttl}"
            )

    def _reset(self, options: dict[str, Any]) -> None:
        policy_id = options["policy"]
        subject = self._subject(options)
        if not options["yes"]:
            if not sys.stdin.isatty():
                raise CommandError("refusing to reset without confirmation; pass --yes")
            # Name the dimensions, not their values: terminals and CI logs keep what they show.
            given = ", ".join(subject) or "no subject"
            answer = input(f"Delete the counters of {policy_id} for the given {given}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                raise CommandError("reset cancelled")
        cleared = limiter.reset(policy_id, subject)
        self.stdout.write(f"reset {policy_id}: {cleared} window(s) had state")

    def _check(self, options: dict[str, Any]) -> None:
        rows = operations.diagnose()
        if options["json"]:
            self._json([{"check": c, "status": s, "detail": d} for c, s, d in rows])
        else:
            for check, status, detail in rows:
                style = {"ok": self.style.SUCCESS, "warning": self.style.WARNING}.get(
                    status, self.style.ERROR
                )
                self.stdout.write(f"{check}: {style(status)} - {detail}")
        errors = [f"{check}: {detail}" for check, status, detail in rows if status == "error"]
        if errors:
            raise CommandError(errors[0])

    def _json(self, value: object) -> None:
        self.stdout.write(json.dumps(value, indent=2, sort_keys=True))


def _load_generated() -> list[Policy]:
    """Policies that exist outside settings and the database: ``@quota(rate=...)`` views
    (declared when the URLconf imports their modules) and the DRF drop-ins' ``drf:<scope>``
    policies (built from ``DEFAULT_THROTTLE_RATES`` as the throttles build them)."""
    from django.urls import get_resolver

    get_resolver().url_patterns  # noqa: B018 - importing the views runs their decorators
    found = policies.declared()
    try:
        from rest_framework.settings import api_settings

        from django_quota import throttling
    except ImportError:
        return found
    for scope in api_settings.DEFAULT_THROTTLE_RATES or {}:
        policy = throttling.scope_policy(scope)
        if policy is not None:
            found.append(policy)
    return found


def _add_common_options(parser: CommandParser) -> None:
    """Django's options common to every command, accepted after a subcommand as well
    (``quota check --settings X --traceback``).

    ``SUPPRESS`` leaves an option the subcommand was not given alone, so that one given
    before the subcommand keeps its value (argparse copies a subparser's defaults over
    the parent's)."""
    suppress = argparse.SUPPRESS
    parser.add_argument(
        "-v", "--verbosity", type=int, choices=[0, 1, 2, 3], default=suppress,
        help="verbosity level; 0=minimal output, 1=normal output, 2=verbose output, "
        "3=very verbose output",
    )
    parser.add_argument(
        "--settings", default=suppress,
        help='a settings module in Python package syntax, e.g. "myproject.settings.main"',
    )
    parser.add_argument(
        "--pythonpath", default=suppress,
        help='a directory to add to the Python path, e.g. "/home/projects/myproject"',
    )
    parser.add_argument(
        "--traceback", action="store_true", default=suppress,
        help="raise on CommandError exceptions",
    )
    parser.add_argument(
        "--no-color", action="store_true", default=suppress,
        help="don't colorize the command output",
    )
    parser.add_argument(
        "--force-color", action="store_true", default=suppress,
        help="force colorization of the command output",
    )


def _user_pk(value: str) -> tuple[str, str]:
    """``--user``: the user's primary key, from the primary key or the ``USERNAME_FIELD``
    value, and a note saying which matched (never the value itself: terminals and CI
    logs keep what they show). A value matching no user is taken as a primary key (a
    deleted user's counters can still be reset); one matching two users is refused."""
    try:
        from django.contrib.auth import get_user_model

        user_model = get_user_model()
    except Exception:  # django.contrib.auth not installed: nothing to look up
        return value, "--user is used as a primary key as given (no user model)"
    username_field = user_model.USERNAME_FIELD
    users = user_model._default_manager
    try:
        pk = user_model._meta.pk.to_python(value)
    except (ValidationError, ValueError, TypeError):
        pk = None
    try:
        by_name = users.filter(**{username_field: value}).first()
        by_pk = users.filter(pk=pk).first() if pk is not None else None
    except DatabaseError:  # the counters live in the backend: still usable by pk
        return value, (
            "--user could not be looked up (database error); it is used as a primary key "
            "as given"
        )
    if by_name is not None and by_pk is not None and by_name.pk != by_pk.pk:
        raise CommandError(
            "--user matches one user's primary key and another user's username; name the "
            "user by the other one"
        )
    if by_name is not None:
        return str(by_name.pk), (
            f"--user matched a user by username (USERNAME_FIELD {username_field!r})"
        )
    if by_pk is not None:
        return str(by_pk.pk), "--user matched a user by primary key"
    return value, "--user matched no user; it is used as a primary key as given"


def _subject(options: dict[str, Any]) -> dict[str, str]:
    return {dimension: options[dimension] for dimension, _ in SUBJECT_OPTIONS if options[dimension]}


def _window_rows(policy: Policy, windows: tuple[Window, ...]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for w in windows:
        row: dict[str, object] = {
            "window": w.name,
            "limit": w.limit,
            "period": w.period,
            "capacity": w.capacity if policy.algorithm == TOKEN_BUCKET else None,
        }
        # the calendar unit and timezone it counts in, the UTC day's included
        # (docs/policies.md#calendar-windows)
        calendar, timezone = counted_calendar(policy.algorithm, w)
        if calendar:
            row.update(calendar=calendar, timezone=timezone)
        rows.append(row)
    return rows


def _policy_row(policy: Policy, settings: conf.QuotaSettings) -> dict[str, object]:
    return {
        "policy": policy.id,
        "source": policy.source,
        "revision": policy.revision,
        "algorithm": policy.algorithm,
        "windows": _window_rows(policy, policy.windows),
        # each plan's windows, in the shape of "windows" (docs/plans.md)
        "plans": [
            {"plan": name, "windows": _window_rows(policy, windows)}
            for name, windows in policy.plans
        ],
        "selector": list(policy.selector),
        "routes": list(policy.routes),
        "enforcement": policy.enforcement,
        "failure_mode": settings.failure_mode_of(policy),
        "enabled": policy.enabled,
    }


def _written_rate(window: dict[str, Any]) -> str:
    """A window row's rate: ``5/30d``, a window counted in a calendar unit in words with
    its timezone (``10000/month (Europe/Berlin)``, ``5/day (UTC)``)."""
    if "calendar" in window:
        return f"{window['limit']}/{window['calendar']} ({window['timezone']})"
    return format_rate(window["limit"], round(window["period"] * 1000))


def _cell(value: object) -> str:
    if isinstance(value, list):
        if value and isinstance(value[0], dict) and "plan" in value[0]:
            # plans: free:daily=100/d;pro:daily=10000/d
            return ";".join(f"{plan['plan']}:{_cell(plan['windows'])}" for plan in value)
        if value and isinstance(value[0], dict):
            return ",".join(
                f"{w['window']}={_written_rate(w)}"
                + ("" if w["capacity"] in (None, w["limit"]) else f"(capacity={w['capacity']})")
                for w in value
            )
        return ",".join(str(v) for v in value) or "-"
    return str(value)
