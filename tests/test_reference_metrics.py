"""What ``docs/metrics.md`` says of the circuit breaker: while it is open no backend call
is made, so neither the health counter nor the latency histogram moves, and the
outcomes carry ``backend_unavailable``."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

import django_quota
from django_quota import limiter
from tests.test_middleware import dead_redis_url


def test_an_open_breaker_moves_neither_health_nor_latency(quota: Any) -> None:
    """Five refused connections open the breaker (``FAILURE_RETRY_AFTER`` 60 s keeps it
    open); the next three evaluations call no node."""
    quota(REDIS_URL=dead_redis_url(), FAILURE_RETRY_AFTER=60,
          POLICIES={"ref-breaker": {"windows": "5/m", "selector": ["ip"]}})

    def health() -> float:
        labels = {"backend_mode": "redis", "reason": "backend_unavailable"}
        return REGISTRY.get_sample_value("django_quota_backend_health_total", labels) or 0.0

    def latency() -> float:
        labels = {"backend_mode": "redis"}
        name = "django_quota_backend_latency_seconds_count"
        return REGISTRY.get_sample_value(name, labels) or 0.0

    def refused() -> float:
        labels = {"policy": "ref-breaker", "decision": "failed_closed",
                  "reason": "backend_unavailable", "selector_dimensions": "ip",
                  "backend_mode": "redis"}
        return REGISTRY.get_sample_value("django_quota_outcomes_total", labels) or 0.0

    health_before, latency_before, refused_before = health(), latency(), refused()
    for _ in range(limiter.BREAKER_THRESHOLD):
        django_quota.evaluate("ref-breaker", {"ip": "203.0.113.9"})
    assert limiter.get_breaker().state == "open"
    assert health() - health_before == limiter.BREAKER_THRESHOLD
    assert latency() - latency_before == limiter.BREAKER_THRESHOLD

    for _ in range(3):
        found = django_quota.evaluate("ref-breaker", {"ip": "203.0.113.9"})
        assert (found.decision, found.reason) == ("failed_closed", "backend_unavailable")
    assert health() - health_before == limiter.BREAKER_THRESHOLD
    assert latency() - latency_before == limiter.BREAKER_THRESHOLD
    assert refused() - refused_before == limiter.BREAKER_THRESHOLD + 3
    # The status page's recent errors still show the limiter's refusals.
    details = [error.detail for error in limiter.recent_errors()]
    assert details[-3:] == ["circuit breaker open for default"] * 3
