"""App configuration: wiring only (checks, signal receivers), no I/O."""

from __future__ import annotations

from django.apps import AppConfig


class DjangoQuotaConfig(AppConfig):
    """django-quota's ``AppConfig``."""

    name = "django_quota"
    verbose_name = "Quota"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_quota import checks, conf  # noqa: F401 - registers checks and receivers
