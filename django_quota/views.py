"""Optional views: the Prometheus exposition of django-quota's metrics.

``path("metrics/quota", django_quota.views.metrics)`` exposes the process's registry, or,
with ``PROMETHEUS_MULTIPROC_DIR`` set (gunicorn with several workers), every worker's
samples through prometheus_client's multiprocess collector. Protect the URL as you would
any internal endpoint. Projects using django-prometheus need nothing: the families are
registered in prometheus_client's default registry.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from django_quota.metrics import MULTIPROCESS


def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition (404 when prometheus_client is not installed)."""
    try:
        import prometheus_client
        from prometheus_client import multiprocess
    except ImportError:
        return HttpResponse("prometheus_client is not installed\n", status=404)
    if MULTIPROCESS:
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry = prometheus_client.REGISTRY
    return HttpResponse(
        prometheus_client.generate_latest(registry),
        content_type=prometheus_client.CONTENT_TYPE_LATEST,
    )
