"""Models of the example shop."""

from __future__ import annotations

from typing import ClassVar

from django.db import models


class Item(models.Model):
    """Something for sale, priced in whole cents."""

    name = models.CharField(max_length=100)
    price = models.PositiveIntegerField(help_text="Price in cents.")
    created_at = models.DateTimeField(auto_now_add=True)

    # Declared, so type checkers see it even when their settings do not install this app.
    objects: ClassVar[models.Manager[Item]] = models.Manager()

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.price})"
