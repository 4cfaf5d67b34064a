"""Create the example shop's API users and their DRF tokens (idempotent)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from rest_framework.authtoken.models import Token

DEFAULT_USERS = ("alice", "bob", "carol", "dave")


class Command(BaseCommand):
    help = (
        "Create API users (no password: they authenticate with DRF tokens) unless they "
        "exist; with --json print {username: token} on stdout."
    )
    requires_system_checks: list[str] = []  # migrate, run just before, has checked

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("usernames", nargs="*", default=list(DEFAULT_USERS))
        parser.add_argument(
            "--json", action="store_true", help="print the tokens as one JSON object"
        )

    def handle(self, *args: Any, usernames: list[str], **options: Any) -> None:
        user_model = get_user_model()
        tokens: dict[str, str] = {}
        created = 0
        for username in usernames:
            user, was_created = user_model.objects.get_or_create(username=username)
            if was_created:
                user.set_unusable_password()
                user.save(update_fields=["password"])
            created += was_created
            token, _ = Token.objects.get_or_create(user=user)
            tokens[username] = token.key
        if options["json"]:
            self.stdout.write(json.dumps(tokens, sort_keys=True))
        else:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Seeded {created} new user(s): {', '.join(usernames)} (DRF tokens)."
                )
            )
