"""Observability: Prometheus metrics (with the ``prometheus`` extra) and the in-process
counts the admin status page shows. Labels are low-cardinality by construction: policy
ids, decisions, reasons, selector dimension names and backend modes, never an identity.

Families (contract 9):

- ``django_quota_outcomes_total{policy,decision,reason,selector_dimensions,backend_mode}``
- ``django_quota_backend_health_total{backend_mode,reason}``: ``reason`` is ``ok`` or a
  failure reason (``backend_timeout``, ``backend_unavailable``, ``backend_error``,
  ``indeterminate``, ``clock_unsafe``)
- ``django_quota_backend_latency_seconds{backend_mode}`` (histogram)

Under gunicorn with several workers set ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's
multiprocess mode) and expose :func:`django_quota.views.metrics`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from django_quota.core.outcome import (
    DENIED_DECISION,
    FAILED_CLOSED,
    FAILED_OPEN,
    SHADOW_DENIED,
    Outcome,
)
from django_quota.core.policy import Policy

logger = logging.getLogger("django_quota")

OK = "ok"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

prometheus_client: Any
try:  # the optional extra
    import prometheus_client
except ImportError:  # pragma: no cover - exercised only without the extra
    prometheus_client = None

_families: dict[str, Any] = {}
_families_lock = threading.Lock()
_counts: Counter[tuple[str, str, str]] = Counter()
_counts_lock = threading.Lock()
started_at = time.time()


def _family(name: str) -> Any:
    """The prometheus_client metric ``name``, created once per process."""
    if prometheus_client is None:
        return None
    family = _families.get(name)
    if family is None:
        with _families_lock:
            family = _families.get(name)
            if family is None:
                family = _create(name)
                _families[name] = family
    return family


def _create(name: str) -> Any:
    assert prometheus_client is not None
    if name == "outcomes":
        return prometheus_client.Counter(
            "django_quota_outcomes_total",
            "Rate-limit decisions by policy, decision, reason, selector and backend mode.",
            ["policy", "decision", "reason", "selector_dimensions", "backend_mode"],
        )
    if name == "health":
        return prometheus_client.Counter(
            "django_quota_backend_health_total",
            "Backend calls by backend mode and result (ok or a failure reason).",
            ["backend_mode", "reason"],
        )
    return prometheus_client.Histogram(
        "django_quota_backend_latency_seconds",
        "Time of one backend call (one EVALSHA on Redis), in seconds.",
        ["backend_mode"],
        buckets=LATENCY_BUCKETS,
    )


def record_outcomes(policies: Iterable[Policy], outcomes: Iterable[Outcome]) -> None:
    """Count decided outcomes (never peeks); log denials, shadow denials and failures
    (never an identity)."""
    selectors = {policy.id: "+".join(policy.selector) for policy in policies}
    family = _family("outcomes")
    for outcome in outcomes:
        reason = outcome.reason or ""
        with _counts_lock:
            _counts[(outcome.policy, outcome.decision, reason)] += 1
        if family is not None:
            family.labels(
                outcome.policy,
                outcome.decision,
                reason,
                selectors.get(outcome.policy, ""),
                outcome.backend_mode,
            ).inc()
        if outcome.decision in (DENIED_DECISION, SHADOW_DENIED, FAILED_CLOSED, FAILED_OPEN):
            logger.info(
                "quota %s: policy=%s reason=%s backend_mode=%s",
                outcome.decision,
                outcome.policy,
                reason,
                outcome.backend_mode,
            )


def record_backend(backend_mode: str, reason: str, seconds: float) -> None:
    """Count one backend call (``reason`` ``ok`` or a failure reason) and its latency."""
    health = _family("health")
    if health is not None:
        health.labels(backend_mode, reason).inc()
        _family("latency").labels(backend_mode).observe(seconds)


def outcome_counts() -> dict[tuple[str, str, str], int]:
    """(policy, decision, reason) -> count since this process started."""
    with _counts_lock:
        return dict(_counts)
