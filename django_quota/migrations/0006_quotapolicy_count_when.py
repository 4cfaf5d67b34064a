"""A database policy's ``count_when``: the responses that keep their charge
(docs/refunds.md)."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_quota", "0005_quotaplanlimit_exempt"),
    ]

    operations = [
        migrations.AddField(
            model_name="quotapolicy",
            name="count_when",
            field=models.JSONField(
                blank=True,
                default=None,
                help_text=(
                    'The responses that keep their charge: ["2xx"], [401, 403, 429]; others '
                    "are refunded. Empty: every request counts."
                ),
                null=True,
            ),
        ),
    ]
