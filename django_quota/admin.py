"""The Django admin for quota policies: windows inline, revision read-only, actions to
enable, disable and reset counters for a subject, and a staff-only status page."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from django_quota import conf, limiter, metrics, policies
from django_quota.core.breaker import CLOSED
from django_quota.core.errors import BackendError, ConfigurationError
from django_quota.core.policy import DIMENSIONS, parse_policy
from django_quota.models import QuotaPolicy, QuotaWindow


class QuotaWindowFormSet(forms.BaseInlineFormSet):  # type: ignore[type-arg]
    """Validates the windows together with their policy (burst shorter than sustained,
    bounds, capacity) through the same validator as the settings."""

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        rows = []
        for form in self.forms:
            data = getattr(form, "cleaned_data", None)
            if not data or data.get("DELETE"):
                continue
            rows.append(
                QuotaWindow(
                    name=data["name"],
                    limit=data["limit"],
                    period=data["period"],
                    capacity=data.get("capacity"),
                )
            )
        if not rows:
            raise ValidationError("A policy needs at least one window.")
        policy: QuotaPolicy = self.instance
        try:
            parse_policy(policy.name, policy.definition(rows), source="database", key="policy")
        except ConfigurationError as exc:
            raise ValidationError(exc.message) from exc


class QuotaWindowInline(admin.TabularInline):  # type: ignore[type-arg]
    model = QuotaWindow
    formset = QuotaWindowFormSet
    extra = 1
    fields = ("name", "limit", "period", "capacity")


class ResetCountersForm(forms.Form):
    """The subject whose counters to reset (raw values, normalised as the middleware does)."""

    user = forms.CharField(required=False)
    api_key = forms.CharField(required=False, label="API key")
    ip = forms.CharField(required=False, label="IP")
    route = forms.CharField(required=False)
    tenant = forms.CharField(required=False)

    def subject(self) -> dict[str, str]:
        return {name: value for name, value in self.cleaned_data.items() if value}


@admin.register(QuotaPolicy)
class QuotaPolicyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "name",
        "position",
        "algorithm",
        "windows_summary",
        "selector",
        "enforcement",
        "failure_mode",
        "enabled",
        "revision",
    )
    list_filter = ("algorithm", "enforcement", "enabled")
    search_fields = ("name",)
    readonly_fields = ("revision",)
    inlines = (QuotaWindowInline,)
    actions = ("enable_policies", "disable_policies", "reset_counters")
    fields = (
        "name",
        "position",
        "algorithm",
        "selector",
        "routes",
        "methods",
        "enforcement",
        "failure_mode",
        "on_missing",
        "max_cost",
        "enabled",
        "revision",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[QuotaPolicy]:
        return super().get_queryset(request).prefetch_related("windows")

    @admin.display(description="windows")
    def windows_summary(self, obj: QuotaPolicy) -> str:
        return ", ".join(str(window) for window in obj.windows.all())

    @admin.action(description="Enable selected policies")
    def enable_policies(self, request: HttpRequest, queryset: QuerySet[QuotaPolicy]) -> None:
        for policy in queryset:
            policy.enabled = True
            policy.save()
        self.message_user(request, f"Enabled {len(queryset)} policies.", messages.SUCCESS)

    @admin.action(description="Disable selected policies")
    def disable_policies(self, request: HttpRequest, queryset: QuerySet[QuotaPolicy]) -> None:
        for policy in queryset:
            policy.enabled = False
            policy.save()
        self.message_user(request, f"Disabled {len(queryset)} policies.", messages.SUCCESS)

    @admin.action(description="Reset counters for a subject…")
    def reset_counters(
        self, request: HttpRequest, queryset: QuerySet[QuotaPolicy]
    ) -> HttpResponse | None:
        form = ResetCountersForm(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            subject = form.subject()
            for row in queryset:
                try:
                    cleared = limiter.reset(row.name, subject)
                except (ValueError, BackendError, policies.UnknownPolicy) as exc:
                    self.message_user(request, f"{row.name}: {exc}", messages.ERROR)
                else:
                    self.message_user(
                        request, f"{row.name}: {cleared} window(s) reset.", messages.SUCCESS
                    )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Reset counters",
            "form": form,
            "queryset": queryset,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "opts": self.model._meta,
            "dimensions": DIMENSIONS,
        }
        return TemplateResponse(request, "django_quota/admin/reset_counters.html", context)

    def get_urls(self) -> list[URLPattern]:
        status = path(
            "status/",
            self.admin_site.admin_view(self.status_view),
            name="django_quota_status",
        )
        return [status, *super().get_urls()]

    def status_view(self, request: HttpRequest) -> HttpResponse:
        """Staff-only: policies with source and revision, backend and mode, breaker state,
        recent backend errors, outcome counts since this process started."""
        settings = conf.get_settings()
        registry = policies.get_registry()
        breaker = limiter.get_breaker()
        backend = limiter.get_backend()
        counts = sorted(metrics.outcome_counts().items())
        context = {
            **self.admin_site.each_context(request),
            "title": "Quota status",
            "opts": self.model._meta,
            "policies": sorted(registry.policies.values(), key=lambda p: (p.source, p.id)),
            "conflicts": registry.conflicts,
            "database_ok": registry.database_ok,
            "backend": settings.backend,
            "backend_mode": backend.mode,
            "redis_url": _redacted(settings.redis_url),
            "fallback": settings.local_fallback_enabled,
            "breaker_state": breaker.state,
            "degraded": breaker.state != CLOSED,
            "recent_errors": list(reversed(breaker.recent_errors)),
            "counts": [
                {"policy": key[0], "decision": key[1], "reason": key[2], "count": value}
                for key, value in counts
            ],
            "started_at": metrics.started_at,
        }
        return TemplateResponse(request, "django_quota/admin/status.html", context)


def _redacted(url: str | None) -> str | None:
    """The URL without its password."""
    if not url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if user else f"{scheme}://***@{host}"
