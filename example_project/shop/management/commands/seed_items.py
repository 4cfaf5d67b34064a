"""Create the example shop's starter items (idempotent)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from example_project.shop.models import Item

SEED_ITEMS: list[tuple[str, int]] = [
    ("Red mug", 900),
    ("Blue mug", 950),
    ("Green teapot", 2400),
    ("Espresso cups (set of 4)", 1800),
    ("Coffee grinder", 4500),
    ("Tea strainer", 450),
    ("Milk frother", 2900),
    ("Travel mug", 1500),
]


class Command(BaseCommand):
    help = "Create the example shop's starter items unless they exist."
    requires_system_checks: list[str] = []  # migrate, run just before, has checked

    def handle(self, *args: Any, **options: Any) -> None:
        created = 0
        for name, price in SEED_ITEMS:
            _, was_created = Item.objects.get_or_create(name=name, defaults={"price": price})
            created += was_created
        total = Item.objects.count()
        self.stdout.write(
            self.style.SUCCESS(f"Seeded {created} new item(s); the shop has {total} item(s).")
        )
