"""``manage.py quota preload | policies | inspect | reset | check`` (contract 8).

Thin: parse, call the library, write through ``self.stdout``; failures raise
``CommandError`` with a one-line reason (exit status 1).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_quota import conf, limiter, policies
from django_quota.core.errors import BackendError
from django_quota.core.policy import TOKEN_BUCKET, Policy

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
        reset = commands.add_parser("reset", help="delete a subject's counters")
        reset.add_argument("policy")
        reset.add_argument("--yes", "--no-input", action="store_true", dest="yes")
        for subcommand in (inspect, reset):
            for dimension, flag in SUBJECT_OPTIONS:
                subcommand.add_argument(flag, dest=dimension, help=f"the raw {dimension}")
        check = commands.add_parser("check", help="test the backend and its configuration")
        check.add_argument("--json", action="store_true")

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
        loaded = limiter.preload()
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
        columns = ("policy", "source", "revision", "algorithm", "windows", "selector", "routes",
                   "enforcement", "failure_mode", "enabled")
        table = [[_cell(row[column]) for column in columns] for row in rows]
        widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(columns)]
        for line in [list(columns), *table]:
            self.stdout.write(
                "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            )

    def _inspect(self, options: dict[str, Any]) -> None:
        found = limiter.inspect(options["policy"], _subject(options))
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
        subject = _subject(options)
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
        rows = limiter.diagnose()
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


def _subject(options: dict[str, Any]) -> dict[str, str]:
    return {dimension: options[dimension] for dimension, _ in SUBJECT_OPTIONS if options[dimension]}


def _policy_row(policy: Policy, settings: conf.QuotaSettings) -> dict[str, object]:
    return {
        "policy": policy.id,
        "source": policy.source,
        "revision": policy.revision,
        "algorithm": policy.algorithm,
        "windows": [
            {
                "window": w.name,
                "limit": w.limit,
                "period": w.period,
                "capacity": w.capacity if policy.algorithm == TOKEN_BUCKET else None,
            }
            for w in policy.windows
        ],
        "selector": list(policy.selector),
        "routes": list(policy.routes),
        "enforcement": policy.enforcement,
        "failure_mode": settings.failure_mode_of(policy),
        "enabled": policy.enabled,
    }


def _cell(value: object) -> str:
    if isinstance(value, list):
        if value and isinstance(value[0], dict):
            return ",".join(
                f"{w['window']}={w['limit']}/{w['period']:g}s"
                + ("" if w["capacity"] in (None, w["limit"]) else f"(capacity={w['capacity']})")
                for w in value
            )
        return ",".join(str(v) for v in value) or "-"
    return str(value)
