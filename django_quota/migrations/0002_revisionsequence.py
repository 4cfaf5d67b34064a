"""The database-wide revision sequence: a re-created policy never reuses a revision."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models
from django.db.models import Max


def start_after_existing(apps: Any, schema_editor: Any) -> None:
    """Start the sequence at the highest revision a policy has, so no revision drawn from
    now on equals one in use. (Revisions of policies deleted before this migration are
    unknown: their counters expire by their TTL.)"""
    database = schema_editor.connection.alias
    policy = apps.get_model("django_quota", "QuotaPolicy")
    sequence = apps.get_model("django_quota", "RevisionSequence")
    top = policy.objects.using(database).aggregate(top=Max("revision"))["top"] or 0
    sequence.objects.using(database).update_or_create(pk=1, defaults={"last": top})


class Migration(migrations.Migration):

    dependencies = [
        ("django_quota", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="RevisionSequence",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("last", models.PositiveBigIntegerField(default=0)),
            ],
        ),
        migrations.RunPython(start_after_existing, migrations.RunPython.noop),
    ]
