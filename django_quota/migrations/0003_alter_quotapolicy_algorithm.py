"""Offer ``sliding_log`` (the exact sliding log, DRF's semantics) in the admin."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_quota", "0002_revisionsequence"),
    ]

    operations = [
        migrations.AlterField(
            model_name="quotapolicy",
            name="algorithm",
            field=models.CharField(
                choices=[
                    ("fixed_window", "fixed window"),
                    ("sliding_window", "sliding window"),
                    ("sliding_log", "sliding log"),
                    ("token_bucket", "token bucket"),
                ],
                default="fixed_window",
                max_length=16,
            ),
        ),
    ]
