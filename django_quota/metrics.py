"""Observability: Prometheus metrics (with the ``prometheus`` extra) and the in-process
counts the admin status page shows. Labels are low-cardinality by construction: policy
ids, decisions, reasons, selector dimension names and backend modes, never an identity.

Families (docs/operations.md):

- ``django_quota_outcomes_total{policy,decision,reason,selector_dimensions,backend_mode}``:
  ``reason`` is the outcome's, or ``group_denied`` for an allowed outcome whose group
  another policy refused (it charged nothing)
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
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol

from django_quota.core.outcome import (
    ALLOWED,
    DENIED_DECISION,
    FAILED_CLOSED,
    FAILED_OPEN,
    SHADOW_DENIED,
    Outcome,
)
from django_quota.core.policy import Policy

logger = logging.getLogger("django_quota")

OK = "ok"
#: The ``reason`` label of an allowed outcome whose group another policy refused.
GROUP_DENIED = "group_denied"
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
#: prometheus_client children by (policy, decision, reason, selector, backend_mode):
#: labels() is resolved once per combination, not once per decision.
_outcome_children: dict[tuple[str, str, str, str, str], Any] = {}
_backend_children: dict[tuple[str, str], tuple[Any, Any]] = {}
_LOGGED = frozenset({DENIED_DECISION, SHADOW_DENIED, FAILED_CLOSED, FAILED_OPEN})


class Evaluated(Protocol):
    """Anything that names the policy it evaluated (the limiter's compiled policies)."""

    @property
    def policy(self) -> Policy: ...
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


def record_outcomes(
    evaluated: Sequence[Evaluated | Policy],
    outcomes: Iterable[Outcome],
    group_denied: Collection[str] = (),
) -> None:
    """Count decided outcomes (never peeks) of one evaluation; log denials, shadow
    denials and failures (never an identity). ``evaluated`` holds the group's policies
    (or objects naming them), in any order. An allowed outcome of a policy in
    ``group_denied`` (its windows allowed, another policy of its group refused, nothing
    charged) is counted with reason :data:`GROUP_DENIED`, not as admitting."""
    family = _family("outcomes")
    for outcome in outcomes:
        reason = outcome.reason or ""
        decision = outcome.decision
        if group_denied and outcome.policy in group_denied and decision == ALLOWED:
            reason = GROUP_DENIED
        with _counts_lock:
            _counts[(outcome.policy, decision, reason)] += 1
        if family is not None:
            # The selector is part of the key: a policy id may come back with another
            # selector (an edited admin policy, another settings generation).
            selector = _selector_label(evaluated, outcome.policy)
            key = (outcome.policy, decision, reason, selector, outcome.backend_mode)
            child = _outcome_children.get(key)
            if child is None:
                child = family.labels(
                    outcome.policy, decision, reason, selector, outcome.backend_mode
                )
                _outcome_children[key] = child
            child.inc()
        if decision in _LOGGED and logger.isEnabledFor(logging.INFO):
            logger.info(
                "quota %s: policy=%s reason=%s backend_mode=%s",
                decision,
                outcome.policy,
                reason,
                outcome.backend_mode,
            )


def _selector_label(evaluated: Sequence[Evaluated | Policy], policy_id: str) -> str:
    for item in evaluated:
        policy = item if isinstance(item, Policy) else item.policy
        if policy.id == policy_id:
            return "+".join(policy.selector)
    return ""


def record_backend(backend_mode: str, reason: str, seconds: float) -> None:
    """Count one evaluation's backend result (``reason`` ``ok`` or a failure reason) and
    its latency (seconds, the whole evaluation with its retry)."""
    children = _backend_children.get((backend_mode, reason))
    if children is None:
        health = _family("health")
        if health is None:
            return
        children = (health.labels(backend_mode, reason), _family("latency").labels(backend_mode))
        _backend_children[(backend_mode, reason)] = children
    children[0].inc()
    children[1].observe(seconds)


def outcome_counts() -> dict[tuple[str, str, str], int]:
    """(policy, decision, reason) -> count since this process started."""
    with _counts_lock:
        return dict(_counts)
