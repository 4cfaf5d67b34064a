"""A database policy's plans (docs/plans.md): one row per plan and window, with its limit;
and its ``exempt`` networks (docs/policies.md#exemptions)."""

from __future__ import annotations

import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_quota", "0004_quotapolicy_concurrency"),
    ]

    operations = [
        migrations.AddField(
            model_name="quotapolicy",
            name="exempt",
            field=models.JSONField(
                blank=True,
                default=list,
                help_text=(
                    "Client networks that skip this policy (CIDR): "
                    '["192.0.2.0/24", "2001:db8::/48"].'
                ),
            ),
        ),
        migrations.CreateModel(
            name="QuotaPlanLimit",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "plan",
                    models.CharField(
                        help_text=(
                            "What PLAN_RESOLVER returns: [A-Za-z0-9][A-Za-z0-9_.:-]{0,63}, "
                            "e.g. pro."
                        ),
                        max_length=64,
                        validators=[
                            django.core.validators.RegexValidator(
                                "^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}\\Z"
                            )
                        ],
                    ),
                ),
                (
                    "window",
                    models.CharField(
                        help_text="The name of one of the policy's windows; the plan keeps its period.",
                        max_length=32,
                        validators=[
                            django.core.validators.RegexValidator("^[a-z][a-z0-9_]{0,31}\\Z")
                        ],
                    ),
                ),
                (
                    "limit",
                    models.PositiveIntegerField(
                        help_text="Units per the window's period, in this plan.",
                        validators=[django.core.validators.MinValueValidator(1)],
                    ),
                ),
                (
                    "policy",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="plan_limits",
                        to="django_quota.quotapolicy",
                    ),
                ),
            ],
            options={
                "verbose_name": "plan limit",
                "ordering": ("plan", "id"),
                "constraints": [
                    models.UniqueConstraint(
                        fields=("policy", "plan", "window"), name="django_quota_plan_window"
                    )
                ],
            },
        ),
    ]
