"""Admin-managed policies (docs/operations.md): ``QuotaPolicy`` with its ``QuotaWindow`` rows
and its plans' ``QuotaPlanLimit`` rows (docs/plans.md).

A policy's ``revision`` is an integer drawn again whenever what its counters mean changes
(algorithm, selector, or a window's name, limit, period or capacity; for a policy with
plans, not the limits: docs/plans.md), through the admin, an ORM ``save()`` or a saved or
deleted window or plan row; counter keys include it, so a changed policy starts fresh
counters. Revisions come from one database-wide sequence
(:class:`RevisionSequence`), so a policy deleted and created again under the same name
never meets its predecessor's counters, whatever its algorithm. Validation is
:func:`django_quota.core.policy.parse_policy`, the one the settings and the system checks
use.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models, router, transaction
from django.db.models import F, Max

from django_quota.core.errors import ConfigurationError
from django_quota.core.policy import (
    ALGORITHMS,
    Enforcement,
    Form,
    Policy,
    canonical_definition,
    canonical_plans_definition,
    parse_policy,
)
from django_quota.core.process import PROCESS
from django_quota.core.rates import format_rate


def _choices(values: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(value, value.replace("_", " ")) for value in values]


def _default_selector() -> list[str]:
    return ["auto"]


@contextmanager
def revision_batch() -> Iterator[None]:
    """Save policies and their windows as one edit: each policy touched inside the block
    gets at most one revision bump, decided when the block ends.

    The admin saves a policy and its inline windows this way, so that a new policy with
    two windows starts at revision 1 and an edit of two windows bumps once. Nothing is
    re-digested when the block raises (the surrounding transaction rolls back).
    """
    if PROCESS.revision_batch.get() is not None:  # nested: the outer block decides
        yield
        return
    touched: set[int] = set()
    token = PROCESS.revision_batch.set(touched)
    try:
        yield
    finally:
        PROCESS.revision_batch.reset(token)
    for pk in sorted(touched):
        policy = QuotaPolicy.objects.filter(pk=pk).first()
        if policy is not None:
            policy.refresh_revision()


class RevisionSequence(models.Model):
    """The sequence every database policy's revision is drawn from: one row holding the
    last value drawn. Deleting a policy leaves it alone, so a revision is never drawn
    twice (``revision_batch`` and ``save()`` draw through :func:`next_revision`)."""

    last = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"last revision {self.last}"


def next_revision(using: str) -> int:
    """Draw the next revision from :class:`RevisionSequence` on database ``using``.

    The increment is one ``UPDATE``, so concurrent draws (other processes) serialise on
    the row and never see the same value. When the row is missing (a flushed database),
    it is created at the highest revision any policy still has.
    """
    sequence = RevisionSequence.objects.using(using)
    with transaction.atomic(using=using):
        if not sequence.filter(pk=1).update(last=F("last") + 1):
            floor = QuotaPolicy.objects.using(using).aggregate(top=Max("revision"))["top"]
            sequence.get_or_create(pk=1, defaults={"last": floor or 0})
            sequence.filter(pk=1).update(last=F("last") + 1)
        drawn: int = sequence.values_list("last", flat=True).get(pk=1)
    return drawn


class QuotaPolicy(models.Model):
    """One policy; its id is ``name``. Defaults equal the settings defaults."""

    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(Form.POLICY_ID_RE.pattern)],
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
    exempt = models.JSONField(
        default=list,
        blank=True,
        help_text=(
            'Client networks that skip this policy (CIDR): ["192.0.2.0/24", "2001:db8::/48"].'
        ),
    )
    count_when = models.JSONField(
        null=True,
        blank=True,
        default=None,
        help_text=(
            'The responses that keep their charge: ["2xx"], [401, 403, 429]; others are '
            "refunded. Empty: every request counts."
        ),
    )
    enforcement = models.CharField(
        max_length=8, choices=_choices(Enforcement.VALUES), default="enforce"
    )
    failure_mode = models.CharField(
        max_length=8,
        choices=_choices(Form.FAILURE_MODES),
        null=True,
        blank=True,
        help_text='Empty: QUOTA["FAILURE_MODE"].',
    )
    on_missing = models.CharField(max_length=8, choices=_choices(Form.ON_MISSING), default="deny")
    max_cost = models.PositiveIntegerField(null=True, blank=True)
    enabled = models.BooleanField(default=True)
    revision = models.PositiveIntegerField(default=1, editable=False)
    definition_digest = models.CharField(max_length=64, blank=True, default="", editable=False)

    windows: Any  # reverse relation to QuotaWindow
    plan_limits: Any  # reverse relation to QuotaPlanLimit

    class Meta:
        ordering = ("position", "name")
        verbose_name = "quota policy"
        verbose_name_plural = "quota policies"

    def __str__(self) -> str:
        return self.name

    def definition(
        self,
        windows: list[QuotaWindow] | None = None,
        plan_limits: list[QuotaPlanLimit] | None = None,
    ) -> dict[str, Any]:
        """The policy as the dict form :func:`parse_policy` reads (``plans`` built from
        ``plan_limits`` with the periods of ``windows``: :func:`plans_definition`)."""
        rows = windows if windows is not None else list(self.windows.all()) if self.pk else []
        if plan_limits is None:
            plan_limits = list(self.plan_limits.all()) if self.pk else []
        data: dict[str, Any] = {
            "algorithm": self.algorithm,
            "windows": {row.name: f"{row.limit}/{row.period}s" for row in rows},
            "selector": self.selector,
            "routes": self.routes,
            "methods": self.methods,
            "exempt": self.exempt,
            "count_when": self.count_when,
            "enforcement": self.enforcement,
            "failure_mode": self.failure_mode or None,
            "on_missing": self.on_missing,
            "max_cost": self.max_cost,
            "enabled": self.enabled,
        }
        capacities = {row.name: row.capacity for row in rows if row.capacity is not None}
        if capacities:
            data["capacity"] = capacities
        if plan_limits:
            data["plans"] = plans_definition(rows, plan_limits)
        return data

    def to_policy(
        self,
        windows: list[QuotaWindow] | None = None,
        plan_limits: list[QuotaPlanLimit] | None = None,
    ) -> Policy:
        """The validated :class:`Policy` (``ConfigurationError`` when invalid)."""
        key = f"QuotaPolicy {self.name!r}"
        try:
            definition = self.definition(windows, plan_limits)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{key}{exc.key}", exc.message) from None
        policy = parse_policy(self.name, definition, source="database", key=key)
        return Policy(
            **{
                **{field: getattr(policy, field) for field in policy.__dataclass_fields__},
                "revision": str(self.revision),
            }
        )

    def _digest(self) -> str:
        """SHA-256 of the canonical definition; ``""`` while the policy is invalid (no
        window yet, or a plan given one of its two windows so far). An invalid policy is
        never applied, so its state changes no revision: the stored digest stays the last
        valid one, and the policy bumps only when it is valid again with another meaning
        (a plan added row by row through the ORM keeps the counters, as in the admin)."""
        rows = list(self.windows.all()) if self.pk else []
        try:
            definition = self.definition(rows)
        except ConfigurationError:
            return ""
        # Only what a counter means: an invalid `methods`, say, is no change of meaning.
        # The definition keys the revision covers (docs/policies.md); of ``plans``, only
        # that there are some (docs/plans.md).
        covered = ("algorithm", "selector", "windows", "capacity", "plans")
        meaning = {key: definition[key] for key in covered if key in definition}
        try:
            policy = parse_policy("policy", meaning, source="database")
        except ConfigurationError:
            return ""
        # With plans, the limits are chosen per request on one counter: they are no part
        # of its meaning (docs/plans.md), as for a settings policy's revision.
        canonical = canonical_plans_definition if policy.plans else canonical_definition
        text = canonical(policy.algorithm, policy.selector, policy.windows)
        return hashlib.sha256(text.encode()).hexdigest()

    #: Set by the admin, whose inline formsets validate the windows and plans being
    #: submitted (the stored ones may be about to change, e.g. a capacity cleared with the
    #: algorithm).
    windows_validated_elsewhere = False

    def clean(self) -> None:
        """Validate with the settings validator: the fields, and the stored windows with
        them (unless ``windows_validated_elsewhere``). Errors name the field."""
        data = self.definition([], [])
        data["windows"] = "1/s"  # the fields alone first: their errors name a field
        self._validate(data)
        if self.pk and not self.windows_validated_elsewhere:
            rows = list(self.windows.all())
            if rows:
                try:
                    definition = self.definition(rows)
                except ConfigurationError as exc:
                    raise ValidationError(exc.message) from exc
                self._validate(definition)

    def _validate(self, data: dict[str, Any]) -> None:
        try:
            parse_policy(self.name, data, source="database", key="policy")
        except ConfigurationError as exc:
            match = re.match(r"policy\['([a-z_]+)'\]", exc.key)
            if exc.key == "policy":
                raise ValidationError({"name": exc.message}) from exc
            # The policy fields a validation error can be attached to.
            fields = {
                "algorithm", "selector", "routes", "methods", "exempt", "count_when",
                "enforcement", "failure_mode", "on_missing", "max_cost", "enabled",
            }
            if match and match.group(1) in fields:
                raise ValidationError({match.group(1): exc.message}) from exc
            raise ValidationError(exc.message) from exc

    def _database(self, using: str | None = None) -> str:
        return using or self._state.db or router.db_for_write(type(self), instance=self)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save, drawing a new ``revision`` for a new row and when the counters' meaning
        changed (inside :func:`revision_batch`, once when the batch ends)."""
        using = self._database(kwargs.get("using"))
        touched = PROCESS.revision_batch.get()
        with transaction.atomic(using=using):
            if self._state.adding:
                self.revision = next_revision(using)
            if touched is not None:
                super().save(*args, **kwargs)
                touched.add(self.pk)
                return
            digest = self._digest()
            if digest:  # else invalid: the last valid digest stays (_digest)
                if self.pk and self.definition_digest and digest != self.definition_digest:
                    self.revision = next_revision(using)
                self.definition_digest = digest
            super().save(*args, **kwargs)

    def refresh_revision(self) -> None:
        """Re-digest after a window changed; draw a new revision and save when the meaning
        changed."""
        digest = self._digest()
        if digest and digest != self.definition_digest:
            using = self._database()
            with transaction.atomic(using=using):
                if self.definition_digest:
                    self.revision = next_revision(using)
                self.definition_digest = digest
                super().save(update_fields=["revision", "definition_digest"])


class QuotaWindow(models.Model):
    """One window of a :class:`QuotaPolicy`: ``limit`` units per ``period`` seconds."""

    policy = models.ForeignKey(QuotaPolicy, related_name="windows", on_delete=models.CASCADE)
    name = models.CharField(
        max_length=32,
        validators=[RegexValidator(Form.WINDOW_NAME_RE.pattern)],
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
        return f"{self.name}: {format_rate(self.limit, self.period * 1000)}"


class QuotaPlanLimit(models.Model):
    """One window's limit under one plan of a :class:`QuotaPolicy` (docs/plans.md): the
    rows of a plan name give that plan's windows, each with the period (and calendar) of
    the policy's window of that name. A token bucket's capacity under a plan is the
    plan's limit."""

    policy = models.ForeignKey(QuotaPolicy, related_name="plan_limits", on_delete=models.CASCADE)
    plan = models.CharField(
        max_length=64,
        validators=[RegexValidator(Form.PLAN_NAME_RE.pattern)],
        help_text="What PLAN_RESOLVER returns: [A-Za-z0-9][A-Za-z0-9_.:-]{0,63}, e.g. pro.",
    )
    window = models.CharField(
        max_length=32,
        validators=[RegexValidator(Form.WINDOW_NAME_RE.pattern)],
        help_text="The name of one of the policy's windows; the plan keeps its period.",
    )
    limit = models.PositiveIntegerField(
        validators=[MinValueValidator(1)], help_text="Units per the window's period, in this plan."
    )

    class Meta:
        ordering = ("plan", "id")
        verbose_name = "plan limit"
        constraints = [
            models.UniqueConstraint(
                fields=("policy", "plan", "window"), name="django_quota_plan_window"
            )
        ]

    def __str__(self) -> str:
        return f"{self.plan}: {self.window} {self.limit}"


def plans_definition(
    windows: list[QuotaWindow], plan_limits: list[QuotaPlanLimit]
) -> dict[str, dict[str, str]]:
    """``plans`` as :func:`parse_policy` reads it, from plan rows and the policy's windows:
    ``{plan: {window: "<limit>/<period>s"}}``. A row naming no window of the policy is a
    :class:`ConfigurationError` (key ``['plans'][<plan>]``); a plan missing a window is
    left for :func:`parse_policy` to name."""
    periods = {row.name: row.period for row in windows}
    plans: dict[str, dict[str, str]] = {}
    for row in plan_limits:
        if row.window not in periods:
            raise ConfigurationError(
                f"['plans'][{row.plan!r}]",
                f"plan {row.plan!r} gives a limit to window {row.window!r}, which the policy "
                f"does not have (its windows: {', '.join(periods) or 'none'})",
            )
        plans.setdefault(row.plan, {})[row.window] = f"{row.limit}/{periods[row.window]}s"
    return plans


def window_changed(sender: Any, instance: QuotaWindow | QuotaPlanLimit, **kwargs: Any) -> None:
    """``post_save``/``post_delete`` of a window or a plan row (bulk deletes included):
    re-digest the
    policy, bumping its revision when the meaning changed (at the end of a
    :func:`revision_batch`). Connected in ``ready()``."""
    touched = PROCESS.revision_batch.get()
    if touched is not None:
        touched.add(instance.policy_id)
        return
    try:
        policy = QuotaPolicy.objects.get(pk=instance.policy_id)
    except QuotaPolicy.DoesNotExist:  # the policy itself is being deleted
        return
    policy.refresh_revision()
