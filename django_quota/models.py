"""Admin-managed policies (contract 8): ``QuotaPolicy`` with its ``QuotaWindow`` rows.

A policy's ``revision`` is an integer bumped whenever what its counters mean changes
(algorithm, selector, or a window's name, limit, period or capacity), through the admin,
an ORM ``save()`` or a saved or deleted window; counter keys include it, so a changed
policy starts fresh counters. Validation is :func:`django_quota.core.policy.parse_policy`,
the one the settings and the system checks use.
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models, transaction

from django_quota.core.errors import ConfigurationError
from django_quota.core.policy import (
    ALGORITHMS,
    ENFORCEMENTS,
    FAILURE_MODES,
    ON_MISSING,
    POLICY_ID_RE,
    WINDOW_NAME_RE,
    Policy,
    canonical_definition,
    parse_policy,
)


def _choices(values: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(value, value.replace("_", " ")) for value in values]


def _default_selector() -> list[str]:
    return ["auto"]


class QuotaPolicy(models.Model):
    """One policy; its id is ``name``. Defaults equal the settings defaults."""

    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(POLICY_ID_RE.pattern)],
        help_text="The policy id: [a-z0-9][a-z0-9_.:-]{0,63}.",
    )
    position = models.IntegerField(default=0, help_text="Database policies apply in this order.")
    algorithm = models.CharField(
        max_length=16, choices=_choices(ALGORITHMS), default="fixed_window"
    )
    selector = models.JSONField(
        default=_default_selector,
        help_text='Dimensions, e.g. ["user"] or ["route", "ip"]; ["auto"] by default.',
    )
    routes = models.JSONField(
        default=list, blank=True, help_text='Middleware routes: ["/api"], ["ns:*"], ["*"]…'
    )
    methods = models.JSONField(default=list, blank=True, help_text='["GET", "POST"]; [] = all.')
    enforcement = models.CharField(max_length=8, choices=_choices(ENFORCEMENTS), default="enforce")
    failure_mode = models.CharField(
        max_length=8,
        choices=_choices(FAILURE_MODES),
        null=True,
        blank=True,
        help_text='Empty: QUOTA["FAILURE_MODE"].',
    )
    on_missing = models.CharField(max_length=8, choices=_choices(ON_MISSING), default="deny")
    max_cost = models.PositiveIntegerField(null=True, blank=True)
    enabled = models.BooleanField(default=True)
    revision = models.PositiveIntegerField(default=1, editable=False)
    definition_digest = models.CharField(max_length=64, blank=True, default="", editable=False)

    windows: Any  # reverse relation to QuotaWindow

    class Meta:
        ordering = ("position", "name")
        verbose_name = "quota policy"
        verbose_name_plural = "quota policies"

    def __str__(self) -> str:
        return self.name

    def definition(self, windows: list[QuotaWindow] | None = None) -> dict[str, Any]:
        """The policy as the dict form :func:`parse_policy` reads."""
        rows = windows if windows is not None else list(self.windows.all()) if self.pk else []
        data: dict[str, Any] = {
            "algorithm": self.algorithm,
            "windows": {row.name: f"{row.limit}/{row.period}s" for row in rows},
            "selector": self.selector,
            "routes": self.routes,
            "methods": self.methods,
            "enforcement": self.enforcement,
            "failure_mode": self.failure_mode or None,
            "on_missing": self.on_missing,
            "max_cost": self.max_cost,
            "enabled": self.enabled,
        }
        capacities = {row.name: row.capacity for row in rows if row.capacity is not None}
        if capacities:
            data["capacity"] = capacities
        return data

    def to_policy(self, windows: list[QuotaWindow] | None = None) -> Policy:
        """The validated :class:`Policy` (``ConfigurationError`` when invalid)."""
        policy = parse_policy(
            self.name, self.definition(windows), source="database", key=f"QuotaPolicy {self.name!r}"
        )
        return Policy(
            **{
                **{field: getattr(policy, field) for field in policy.__dataclass_fields__},
                "revision": str(self.revision),
            }
        )

    def _digest(self) -> str:
        rows = list(self.windows.all()) if self.pk else []
        try:
            policy = parse_policy(self.name, self.definition(rows), source="database")
        except ConfigurationError:
            # Not valid yet (e.g. no window saved so far): digest the raw fields instead.
            raw = repr((self.algorithm, self.selector, [(w.name, w.limit, w.period, w.capacity)
                                                        for w in rows]))
            return hashlib.sha256(raw.encode()).hexdigest()
        text = canonical_definition(policy.algorithm, policy.selector, policy.windows)
        return hashlib.sha256(text.encode()).hexdigest()

    def clean(self) -> None:
        """Validate the fields with the settings validator (windows are checked by the
        admin's inline formset, or here when the policy already has windows)."""
        rows = list(self.windows.all()) if self.pk else []
        data = self.definition(rows)
        if not rows:
            data["windows"] = "1/s"  # fields only; windows come with the inline
        try:
            parse_policy(self.name, data, source="database", key="policy")
        except ConfigurationError as exc:
            raise ValidationError(exc.message) from exc

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save, bumping ``revision`` when the counters' meaning changed."""
        with transaction.atomic():
            digest = self._digest()
            if self.pk and self.definition_digest and digest != self.definition_digest:
                self.revision += 1
            self.definition_digest = digest
            super().save(*args, **kwargs)

    def refresh_revision(self) -> None:
        """Re-digest after a window changed; bump and save when the meaning changed."""
        digest = self._digest()
        if digest != self.definition_digest:
            if self.definition_digest:
                self.revision += 1
            self.definition_digest = digest
            super().save(update_fields=["revision", "definition_digest"])


class QuotaWindow(models.Model):
    """One window of a :class:`QuotaPolicy`: ``limit`` units per ``period`` seconds."""

    policy = models.ForeignKey(QuotaPolicy, related_name="windows", on_delete=models.CASCADE)
    name = models.CharField(
        max_length=32,
        validators=[RegexValidator(WINDOW_NAME_RE.pattern)],
        help_text="[a-z][a-z0-9_]{0,31}, e.g. burst, sustained.",
    )
    limit = models.PositiveIntegerField()
    period = models.PositiveIntegerField(help_text="Seconds.")
    capacity = models.PositiveIntegerField(
        null=True, blank=True, help_text="token_bucket only; empty = the limit."
    )

    class Meta:
        ordering = ("id",)
        constraints = [
            models.UniqueConstraint(fields=("policy", "name"), name="django_quota_window_name")
        ]

    def __str__(self) -> str:
        return f"{self.name}: {self.limit}/{self.period}s"


def window_changed(sender: Any, instance: QuotaWindow, **kwargs: Any) -> None:
    """``post_save``/``post_delete`` of a window (bulk deletes included): re-digest the
    policy, bumping its revision when the meaning changed. Connected in ``ready()``."""
    try:
        policy = QuotaPolicy.objects.get(pk=instance.policy_id)
    except QuotaPolicy.DoesNotExist:  # the policy itself is being deleted
        return
    policy.refresh_revision()
