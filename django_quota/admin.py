"""The Django admin for quota policies: windows and plans inline, revision read-only, actions to
enable, disable and reset counters for a subject (change permission), a status page
(view permission), and a delete confirmation that lists the views naming the policy."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote_plus

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import router, transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from django_quota import conf, limiter, metrics, operations, policies, references
from django_quota.backends import connection_url
from django_quota.core.breaker import CLOSED, HALF_OPEN, OPEN
from django_quota.core.errors import BackendError, ConfigurationError
from django_quota.core.policy import ALGORITHMS, Selector, Window, parse_policy, written_rate
from django_quota.models import (
    QuotaPlanLimit,
    QuotaPolicy,
    QuotaWindow,
    revision_batch,
)


class QuotaPolicyForm(forms.ModelForm):  # type: ignore[type-arg]
    """The policy's own fields; its windows are validated by the inline formset."""

    class Meta:
        model = QuotaPolicy
        fields = "__all__"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instance.windows_validated_elsewhere = True

    def clean_name(self) -> str:
        """Refuse an id a settings policy has: settings win, so the row would be ignored
        (and ``manage.py check`` would fail with E007)."""
        name: str = self.cleaned_data["name"]
        settings = conf.get_settings()
        if "settings" in settings.policy_sources and name in settings.policies:
            raise ValidationError(
                f"QUOTA['POLICIES'] already defines a policy {name!r}, which would win over "
                "this row; choose another name"
            )
        return name


class _Siblings:
    """The inline formsets of one request's policy form, so that the plans formset can
    validate its rows against the windows being submitted with it."""

    def __init__(self) -> None:
        self.windows: QuotaWindowFormSet | None = None


class QuotaWindowFormSet(forms.BaseInlineFormSet):  # type: ignore[type-arg]
    """Validates the windows together with their policy (burst shorter than sustained,
    bounds, capacity) through the same validator as the settings."""

    siblings: _Siblings | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.siblings is not None:
            self.siblings.windows = self

    def submitted(self) -> list[QuotaWindow]:
        """The windows the policy will have (rows marked for deletion left out)."""
        return [
            QuotaWindow(
                name=data["name"],
                limit=data["limit"],
                period=data["period"],
                capacity=data.get("capacity"),
            )
            for data in _kept_rows(self)
        ]

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        rows = self.submitted()
        if not rows:
            raise ValidationError("A policy needs at least one window.")
        policy: QuotaPolicy = self.instance
        # Only what concerns the windows: the policy form reports its own fields' errors,
        # the plans formset the plans' (with these windows).
        definition = policy.definition(rows, [])
        data = {"windows": definition["windows"], "capacity": definition.get("capacity")}
        if policy.algorithm in ALGORITHMS:
            data["algorithm"] = policy.algorithm
        try:
            parse_policy("policy", data, source="database", key="policy")
        except ConfigurationError as exc:
            raise ValidationError(exc.message) from exc


def _kept_rows(formset: forms.BaseFormSet) -> list[dict[str, Any]]:  # type: ignore[type-arg]
    """The cleaned data of a formset's valid rows that stay (not marked for deletion)."""
    kept = []
    for form in formset.forms:
        data = getattr(form, "cleaned_data", None)
        if data and not data.get("DELETE"):
            kept.append(data)
    return kept


class QuotaPlanFormSet(forms.BaseInlineFormSet):  # type: ignore[type-arg]
    """Validates the plans (one row per plan and window: docs/plans.md) with the windows
    submitted beside them, through the same validator as ``QUOTA["POLICIES"]``: every
    plan gives a limit to each window of the policy, and to nothing else."""

    siblings: _Siblings | None = None

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        windows = self.siblings.windows if self.siblings is not None else None
        if windows is None or not windows.is_valid():
            return  # the windows' own errors come first; plans need valid windows
        rows = [
            QuotaPlanLimit(plan=data["plan"], window=data["window"], limit=data["limit"])
            for data in _kept_rows(self)
        ]
        if not rows:
            return
        window_rows = windows.submitted()
        policy: QuotaPolicy = self.instance
        try:
            definition = policy.definition(window_rows, rows)
            data = {key: definition.get(key) for key in ("windows", "capacity", "plans")}
            if policy.algorithm in ALGORITHMS:
                data["algorithm"] = policy.algorithm
            parse_policy("policy", data, source="database", key="policy")
        except ConfigurationError as exc:
            # The plan the error key names: policy['plans']['pro']... (group 1: 'pro').
            plan = re.search(r"\['plans'\]\[('[^']*')\]", exc.key)
            if plan is None or f"plan {plan.group(1)}" in exc.message:
                raise ValidationError(exc.message) from exc
            raise ValidationError(f"plan {plan.group(1)}: {exc.message}") from exc


class _PolicyPartInline(admin.TabularInline):  # type: ignore[type-arg]
    """Rows that are part of their policy (windows, plan limits): the policy's own
    permissions govern them (docs/admin.md#permissions), so that ``change_quotapolicy``
    edits a policy with its windows and plans, and no permission on the row models is
    needed. On the add page (``obj`` None) the ``add`` permission does."""

    def _may(self, request: HttpRequest, action: str) -> bool:
        opts = self.parent_model._meta
        return bool(
            request.user.has_perm(f"{opts.app_label}.{get_permission_codename(action, opts)}")
        )

    def _may_edit(self, request: HttpRequest, obj: Any) -> bool:
        return self._may(request, "add" if obj is None else "change")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._may(request, "view") or self._may_edit(request, obj)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._may_edit(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._may_edit(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._may_edit(request, obj)


class QuotaWindowInline(_PolicyPartInline):
    model = QuotaWindow
    formset = QuotaWindowFormSet
    extra = 1
    fields = ("name", "limit", "period", "capacity")


class QuotaPlanInline(_PolicyPartInline):
    """A plan is the rows of one plan name: one limit for each of the policy's windows
    (docs/plans.md)."""

    model = QuotaPlanLimit
    formset = QuotaPlanFormSet
    extra = 1
    fields = ("plan", "window", "limit")
    verbose_name = "plan limit"
    verbose_name_plural = "plans (a limit per plan and window)"


class ResetCountersForm(forms.Form):
    """The subject whose counters to reset (raw values, normalised as the middleware does)."""

    user = forms.CharField(required=False)
    api_key = forms.CharField(required=False, label="API key")
    ip = forms.CharField(required=False, label="IP")
    route = forms.CharField(required=False)
    tenant = forms.CharField(required=False)

    def subject(self) -> dict[str, str]:
        return {name: value for name, value in self.cleaned_data.items() if value}


def _written(algorithm: str, limit: int, period_s: int) -> str:
    """A database window's rate as ``quota policies`` writes it (``core.policy.written_rate``)."""
    return written_rate(algorithm, Window("", limit, period_s * 1000, limit))


@admin.register(QuotaPolicy)
class QuotaPolicyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "name",
        "position",
        "algorithm",
        "windows_summary",
        "plans_summary",
        "selector",
        "enforcement",
        "failure_mode",
        "enabled",
        "revision",
    )
    list_filter = ("algorithm", "enforcement", "enabled")
    search_fields = ("name",)
    readonly_fields = ("revision",)
    form = QuotaPolicyForm
    inlines = (QuotaWindowInline, QuotaPlanInline)
    actions = ("enable_policies", "disable_policies", "reset_counters")
    change_list_template = "django_quota/admin/change_list.html"
    fields = (
        "name",
        "position",
        "algorithm",
        "selector",
        "routes",
        "methods",
        "exempt",
        "count_when",
        "enforcement",
        "failure_mode",
        "on_missing",
        "max_cost",
        "enabled",
        "revision",
    )

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """Save the policy and its inline windows as one edit: one revision bump at most
        (a new policy starts at revision 1 whatever number of windows it comes with)."""
        with transaction.atomic(using=router.db_for_write(self.model)), revision_batch():
            return super().changeform_view(request, object_id, form_url, extra_context)

    def get_formsets_with_inlines(self, request: HttpRequest, obj: Any = None) -> Any:
        """The inline formsets, sharing one :class:`_Siblings` per form: the plans are
        validated against the windows submitted with them."""
        siblings = _Siblings()
        for formset, inline in super().get_formsets_with_inlines(request, obj):
            yield type(formset.__name__, (formset,), {"siblings": siblings}), inline

    def get_queryset(self, request: HttpRequest) -> QuerySet[QuotaPolicy]:
        return super().get_queryset(request).prefetch_related("windows", "plan_limits")

    @admin.display(description="windows")
    def windows_summary(self, obj: QuotaPolicy) -> str:
        """``burst: 2/m, daily: 3/day (UTC)``: each window's rate as ``quota policies``
        writes it (a database day of a fixed window is the day in UTC)."""
        return ", ".join(
            f"{row.name}: {_written(obj.algorithm, row.limit, row.period)}"
            for row in obj.windows.all()
        )

    @admin.display(description="plans")
    def plans_summary(self, obj: QuotaPolicy) -> str:
        """``free (daily 100/day (UTC)), pro (daily 10000/day (UTC))``: each plan's
        windows' rates."""
        periods = {window.name: window.period for window in obj.windows.all()}
        plans: dict[str, list[str]] = {}
        for row in obj.plan_limits.all():
            period = periods.get(row.window)
            rate = "?" if period is None else _written(obj.algorithm, row.limit, period)
            plans.setdefault(row.plan, []).append(f"{row.window} {rate}")
        return ", ".join(f"{plan} ({', '.join(rates)})" for plan, rates in plans.items()) or "-"

    def _require_change_permission(self, request: HttpRequest) -> None:
        # The admin offers these actions only to holders of the change permission; this
        # guards a direct call (a custom view or a subclass reusing the method) as well.
        if not self.has_change_permission(request):
            raise PermissionDenied

    def _set_enabled(
        self, request: HttpRequest, queryset: QuerySet[QuotaPolicy], enabled: bool
    ) -> None:
        self._require_change_permission(request)
        for policy in queryset:
            policy.enabled = enabled
            policy.save()
        done = "Enabled" if enabled else "Disabled"
        self.message_user(request, f"{done} {len(queryset)} policies.", messages.SUCCESS)

    @admin.action(description="Enable selected policies", permissions=("change",))
    def enable_policies(self, request: HttpRequest, queryset: QuerySet[QuotaPolicy]) -> None:
        self._set_enabled(request, queryset, True)

    @admin.action(description="Disable selected policies", permissions=("change",))
    def disable_policies(self, request: HttpRequest, queryset: QuerySet[QuotaPolicy]) -> None:
        self._set_enabled(request, queryset, False)

    @admin.action(description="Reset counters for a subject…", permissions=("change",))
    def reset_counters(
        self, request: HttpRequest, queryset: QuerySet[QuotaPolicy]
    ) -> HttpResponse | None:
        self._require_change_permission(request)
        form = ResetCountersForm(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            subject = form.subject()
            for row in queryset:
                try:
                    cleared = limiter.reset(row.name, subject)
                except (ValueError, BackendError, policies.UnknownPolicy) as exc:
                    # Messages start with a word: the admin capitalises the first letter,
                    # and policy ids are lower-case.
                    self.message_user(
                        request, f"Could not reset {row.name}: {exc}", messages.ERROR
                    )
                else:
                    self.message_user(
                        request, f"Reset {row.name}: {cleared} window(s) had state.",
                        messages.SUCCESS,
                    )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Reset counters",
            "form": form,
            "queryset": queryset,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "opts": self.model._meta,
            "dimensions": Selector.DIMENSIONS,
        }
        return TemplateResponse(request, "django_quota/admin/reset_counters.html", context)

    def get_urls(self) -> list[URLPattern]:
        status = path(
            "status/",
            self.admin_site.admin_view(self.status_view),
            name="django_quota_status",
        )
        return [status, *super().get_urls()]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return super().changelist_view(
            request, {"quota_status_url": "admin:django_quota_status", **(extra_context or {})}
        )

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Django's confirmation, plus the views, throttles and decorators that name the
        policy (they would name an undefined policy once it is deleted)."""
        response = super().delete_view(request, object_id, extra_context)
        policy = self.get_object(request, object_id)
        if policy is not None:
            _add_references(response, {policy.name})
        return response

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions: dict[str, Any] = super().get_actions(request)
        if "delete_selected" in actions:
            function, name, description = actions["delete_selected"]
            actions["delete_selected"] = (_listing_references(function), name, description)
        return actions

    def status_view(self, request: HttpRequest) -> HttpResponse:
        """Staff with the view permission: policies with source and revision, backend and
        mode, breaker state, recent backend errors, outcome counts since this process
        started. Other staff get 403."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        settings = conf.get_settings()
        registry = policies.get_registry()
        current = limiter.get_limiter()
        # One breaker per backend node (each primary of a cluster): the worst one is the
        # state shown, and each node is listed.
        nodes = {name: guard.breaker.state for name, guard in sorted(current.guards().items())}
        best_first = (CLOSED, HALF_OPEN, OPEN)
        worst = max(nodes.values(), key=best_first.index, default=CLOSED)
        backend = current.backend
        counts = sorted(metrics.outcome_counts().items())
        eviction, eviction_error = _eviction() if settings.backend == "redis" else ([], None)
        context = {
            **self.admin_site.each_context(request),
            "title": "Quota status",
            "opts": self.model._meta,
            # In registry order: the order in which the middleware applies them.
            "policies": [
                {
                    "policy": policy,
                    "failure_mode": settings.failure_mode_of(policy),
                    "inherited": policy.failure_mode is None,
                }
                for policy in registry.policies.values()
            ],
            "conflicts": registry.conflicts,
            "database_ok": registry.database_ok,
            "backend": settings.backend,
            "backend_mode": backend.mode,
            "redis_url": _redacted(connection_url(settings)),
            "redis_cache_alias": settings.cache_alias,
            "fallback": settings.local_fallback_enabled,
            "breaker_state": worst,
            "breaker_nodes": nodes,
            "degraded": worst != CLOSED,
            "recent_errors": [
                {
                    "at": _utc(error.at),
                    "reason": error.reason,
                    "detail": error.detail,
                    "label": error.label,
                }
                for error in reversed(current.recent_errors)
            ],
            "counts": [
                {"policy": key[0], "decision": key[1], "reason": key[2], "count": value}
                for key, value in counts
            ],
            "started_at": metrics.started_at,
            "eviction": eviction,
            "eviction_error": eviction_error,
        }
        return TemplateResponse(request, "django_quota/admin/status.html", context)


def _eviction() -> tuple[list[dict[str, object]], str | None]:
    """Each Redis primary's eviction rows for the status page, or the failure that kept
    them from being read."""
    try:
        readings = operations.eviction()
    except BackendError as exc:
        return [], f"{exc.reason}: {exc}"
    return [
        {
            "node": reading.node,
            "policy": reading.policy,
            "maxmemory": reading.maxmemory,
            "evicting": reading.evicting,
            "evicted_keys": reading.evicted_keys,
            "evicted_since": reading.evicted_since_first_read,
            "first_read": _utc(reading.first_read),
        }
        for reading in readings
    ], None


def _utc(epoch_seconds: float) -> str:
    """An error's time as the status page shows it: UTC, to the millisecond."""
    return f"{datetime.fromtimestamp(epoch_seconds, UTC):%Y-%m-%d %H:%M:%S.%f}"[:-3] + " UTC"


def _add_references(response: HttpResponse, names: set[str]) -> None:
    """Put ``quota_references`` in a delete confirmation's context (the answer to a
    confirmed delete is a redirect and needs none)."""
    if isinstance(response, TemplateResponse) and response.context_data is not None:
        response.context_data["quota_references"] = [
            reference.describe() for reference in references.references_to(names)
        ]


def _listing_references(action: Callable[..., Any]) -> Callable[..., Any]:
    """Django's ``delete_selected`` action, its confirmation listing the references."""

    def delete_selected(
        model_admin: admin.ModelAdmin,  # type: ignore[type-arg]
        request: HttpRequest,
        queryset: QuerySet[QuotaPolicy],
    ) -> HttpResponse | None:
        response: HttpResponse | None = action(model_admin, request, queryset)
        if response is not None:
            _add_references(response, set(queryset.values_list("name", flat=True)))
        return response

    delete_selected.allowed_permissions = getattr(  # type: ignore[attr-defined]
        action, "allowed_permissions", ("delete",)
    )
    return delete_selected


def _redacted(url: str | None) -> str | None:
    """The URL without its password, in the userinfo or in a ``password=`` query item.

    Not ``urlsplit`` alone: a password holding ``#``, ``/`` or ``?`` (written raw, as
    people do) ends the authority early there, and the rest of the password would be
    shown as a fragment, a path or a query. The userinfo is everything before the *last*
    ``@``: a stray ``@`` later in the URL hides too much, never too little. The query runs
    to the end of the URL (a ``#`` in a ``password=`` value stays inside the value).
    """
    if not url:
        return url
    scheme, separator, rest = url.partition("://")
    if not separator:
        return "***"  # not a URL this can take apart: show none of it
    userinfo, at, location = rest.rpartition("@")
    if at:
        user, has_password, _ = userinfo.partition(":")
        if not has_password:  # redis://user@host names a user, no password
            location = f"{userinfo}@{location}"
        else:
            location = f"{user}:***@{location}" if user else f"***@{location}"
    address, question, query = location.partition("?")
    if not question:
        return f"{scheme}://{address}"
    items = [
        f"{name}=***" if unquote_plus(name).lower() == "password" else item
        for item in query.split("&")
        for name in (item.partition("=")[0],)
    ]
    return f"{scheme}://{address}?{'&'.join(items)}"
