"""docs/operations.md, "Alerts": every metric name and label matcher the example rules use
exists in what django-quota exports. Decisions are made on the memory backend, against a
Redis nobody listens on (failing closed), and with the local fallback, then the samples
of prometheus_client's registry are compared with the page."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import django_quota
from tests.test_middleware import dead_redis_url

prometheus_client = pytest.importorskip("prometheus_client")

PAGE = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
POLICY = {"algorithm": "fixed_window", "windows": "1/h", "selector": ["user"]}


def alerts_section() -> str:
    text = PAGE.read_text()
    start = text.index("### Alerts")
    return text[start : text.index("\n### ", start + 1)]


def selectors(section: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """``(metric name, [(label, operator, value), ...])`` of every series selector."""
    found = []
    for name, _, body in re.findall(r"(django_quota_\w+)(\{([^}]*)\})?", section):
        matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body)
        found.append((name, matchers))
    return found


def exported_samples() -> dict[str, list[dict[str, str]]]:
    samples: dict[str, list[dict[str, str]]] = {}
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("django_quota_"):
                samples.setdefault(sample.name, []).append(dict(sample.labels))
    return samples


def test_the_alert_rules_use_real_families_labels_and_values(quota: Any) -> None:
    quota(POLICIES={"orders": POLICY})
    assert django_quota.evaluate("orders", {"user": "ada"}).decision == "allowed"
    assert django_quota.evaluate("orders", {"user": "ada"}).decision == "denied"
    quota(REDIS_URL=dead_redis_url(), POLICIES={"orders": POLICY})
    assert django_quota.evaluate("orders", {"user": "ada"}).decision == "failed_closed"
    quota(
        REDIS_URL=dead_redis_url(),
        LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 100},
        POLICIES={"orders": POLICY},
    )
    assert django_quota.evaluate("orders", {"user": "ada"}).backend_mode == "fallback"

    used = selectors(alerts_section())
    names = {name for name, _ in used}
    assert {
        "django_quota_backend_health_total",
        "django_quota_outcomes_total",
        "django_quota_backend_latency_seconds_bucket",
    } <= names
    samples = exported_samples()
    for name, matchers in used:
        assert name in samples, name
        for label, operator, value in matchers:
            assert all(label in labels for labels in samples[name]), (name, label)
            if operator == "=":
                assert any(labels[label] == value for labels in samples[name]), (name, label, value)
            if operator == "!=":
                assert any(labels[label] != value for labels in samples[name]), (name, label, value)


def test_while_the_breaker_is_open_only_outcomes_keep_counting(quota: Any) -> None:
    # The page: an evaluation the open breaker refuses makes no backend call, so the
    # health counter stops at the calls that failed (the probe aside), while the outcomes
    # counter keeps growing with backend_unavailable for as long as requests arrive.
    from django_quota import engine, limiter

    quota(REDIS_URL=dead_redis_url(), FAILURE_MODE="open", POLICIES={"orders": POLICY})

    def sample(name: str, labels: dict[str, str]) -> float:
        return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0

    health = (
        "django_quota_backend_health_total",
        {"backend_mode": "redis", "reason": "backend_unavailable"},
    )
    refused = (
        "django_quota_outcomes_total",
        {
            "backend_mode": "redis",
            "decision": "failed_open",
            "policy": "orders",
            "reason": "backend_unavailable",
            "selector_dimensions": "user",
        },
    )
    health_before, refused_before = sample(*health), sample(*refused)
    states = []
    for _ in range(engine.Sizes.BREAKER_THRESHOLD + 3):
        outcome = django_quota.evaluate("orders", {"user": "ada"})
        assert (outcome.decision, outcome.reason) == ("failed_open", "backend_unavailable")
        states.append(limiter.get_breaker().state)
    assert states[-3:] == ["open"] * 3
    assert sample(*health) - health_before == engine.Sizes.BREAKER_THRESHOLD
    assert sample(*refused) - refused_before == engine.Sizes.BREAKER_THRESHOLD + 3
