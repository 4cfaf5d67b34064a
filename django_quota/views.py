"""Optional views: the Prometheus exposition of django-quota's metrics, and
:func:`usage`, the caller's quota state (``docs/usage.md``).

``path("metrics/quota", django_quota.views.metrics)`` exposes the process's registry, or,
with ``PROMETHEUS_MULTIPROC_DIR`` set (gunicorn with several workers), every worker's
samples through prometheus_client's multiprocess collector. Protect the URL as you would
any internal endpoint. Projects using django-prometheus need nothing: the families are
registered in prometheus_client's default registry.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from django_quota import conf, operations
from django_quota.metrics import MULTIPROCESS
from django_quota.usage import usage

__all__ = ["metrics", "refresh_eviction", "usage"]


def refresh_eviction() -> None:
    """Read every Redis primary's ``evicted_keys`` for this scrape's
    ``django_quota_backend_evicted_keys``; a primary that cannot be read keeps its last
    reading (the failure is for ``quota check`` and the status page to tell)."""
    try:
        if conf.get_settings().backend == "redis":
            operations.eviction()
    except Exception:  # never fail a scrape: the other families are still worth reading
        return


def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition (404 when prometheus_client is not installed)."""
    try:
        import prometheus_client
        from prometheus_client import multiprocess
    except ImportError:
        return HttpResponse("prometheus_client is not installed\n", status=404)
    refresh_eviction()
    if MULTIPROCESS:
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry = prometheus_client.REGISTRY
    return HttpResponse(
        prometheus_client.generate_latest(registry),
        content_type=prometheus_client.CONTENT_TYPE_LATEST,
    )
