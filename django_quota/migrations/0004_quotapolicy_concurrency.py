"""Offer ``concurrency`` (at most N units in flight, docs/concurrency.md) in the admin."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_quota", "0003_alter_quotapolicy_algorithm"),
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
                    ("concurrency", "concurrency"),
                ],
                default="fixed_window",
                max_length=16,
            ),
        ),
    ]
