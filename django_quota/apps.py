"""App configuration: wiring only (checks, signal receivers, settings listeners), no I/O."""

from __future__ import annotations

from django.apps import AppConfig, apps
from django.core.signals import setting_changed
from django.db.models.signals import post_delete, post_migrate, post_save


class DjangoQuotaConfig(AppConfig):
    """django-quota's ``AppConfig``."""

    name = "django_quota"
    verbose_name = "Quota"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks as django_checks

        from django_quota import checks, conf, limiter, policies
        from django_quota.core.process import PROCESS
        from django_quota.models import QuotaPlanLimit, QuotaPolicy, QuotaWindow, window_changed

        django_checks.register(checks.check_settings)
        django_checks.register(checks.check_drf_rates)
        django_checks.register(checks.check_eviction)

        setting_changed.connect(conf.reset_on_setting_change, dispatch_uid="quota-settings-changed")
        # What is built from settings: the registry with the generated policies, the
        # limiter with its backends, the EXEMPT_WHEN predicates imported.
        conf.on_change(policies.settings_changed)
        conf.on_change(limiter.settings_changed)
        conf.on_change(PROCESS.settings_changed)

        post_save.connect(window_changed, sender=QuotaWindow, dispatch_uid="quota-window-save")
        post_delete.connect(window_changed, sender=QuotaWindow, dispatch_uid="quota-window-delete")
        post_save.connect(window_changed, sender=QuotaPlanLimit, dispatch_uid="quota-plan-save")
        post_delete.connect(window_changed, sender=QuotaPlanLimit, dispatch_uid="quota-plan-delete")
        # A registry built before the tables existed holds no database policy.
        post_migrate.connect(policies.database_changed, dispatch_uid="quota-registry-migrate")
        if apps.is_installed("django.contrib.auth"):
            # Connects the user_login_failed receiver of LOGIN_POLICIES (docs/login.md).
            from django_quota import auth  # noqa: F401

        for model in (QuotaPolicy, QuotaWindow, QuotaPlanLimit):
            for signal in (post_save, post_delete):
                signal.connect(
                    policies.database_changed,
                    sender=model,
                    dispatch_uid=f"quota-registry-{model.__name__}-{id(signal)}",
                )
