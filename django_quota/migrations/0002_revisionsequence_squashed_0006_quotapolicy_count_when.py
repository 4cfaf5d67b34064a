"""0002 to 0006 squashed (docs/operations.md#migrations): the revision sequence, the
``sliding_log`` and ``concurrency`` algorithms, a policy's plans and ``exempt`` networks,
and its ``count_when``. ``replaces`` names the five files it stands for, so that a
database that applied them takes this one as applied."""

from __future__ import annotations

from typing import Any

import django.core.validators
import django.db.models.deletion
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

    replaces = [
        ('django_quota', '0002_revisionsequence'),
        ('django_quota', '0003_alter_quotapolicy_algorithm'),
        ('django_quota', '0004_quotapolicy_concurrency'),
        ('django_quota', '0005_quotaplanlimit_exempt'),
        ('django_quota', '0006_quotapolicy_count_when'),
    ]

    dependencies = [
        ('django_quota', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='RevisionSequence',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('last', models.PositiveBigIntegerField(default=0)),
            ],
        ),
        migrations.RunPython(start_after_existing, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='quotapolicy',
            name='algorithm',
            field=models.CharField(choices=[('fixed_window', 'fixed window'), ('sliding_window', 'sliding window'), ('sliding_log', 'sliding log'), ('token_bucket', 'token bucket'), ('concurrency', 'concurrency')], default='fixed_window', max_length=16),
        ),
        migrations.AddField(
            model_name='quotapolicy',
            name='exempt',
            field=models.JSONField(blank=True, default=list, help_text='Client networks that skip this policy (CIDR): ["192.0.2.0/24", "2001:db8::/48"].'),
        ),
        migrations.CreateModel(
            name='QuotaPlanLimit',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('plan', models.CharField(help_text='What PLAN_RESOLVER returns: [A-Za-z0-9][A-Za-z0-9_.:-]{0,63}, e.g. pro.', max_length=64, validators=[django.core.validators.RegexValidator('^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}\\Z')])),
                ('window', models.CharField(help_text="The name of one of the policy's windows; the plan keeps its period.", max_length=32, validators=[django.core.validators.RegexValidator('^[a-z][a-z0-9_]{0,31}\\Z')])),
                ('limit', models.PositiveIntegerField(help_text="Units per the window's period, in this plan.", validators=[django.core.validators.MinValueValidator(1)])),
                ('policy', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='plan_limits', to='django_quota.quotapolicy')),
            ],
            options={
                'verbose_name': 'plan limit',
                'ordering': ('plan', 'id'),
                'constraints': [models.UniqueConstraint(fields=('policy', 'plan', 'window'), name='django_quota_plan_window')],
            },
        ),
        migrations.AddField(
            model_name='quotapolicy',
            name='count_when',
            field=models.JSONField(blank=True, default=None, help_text='The responses that keep their charge: ["2xx"], [401, 403, 429]; others are refunded. Empty: every request counts.', null=True),
        ),
    ]
