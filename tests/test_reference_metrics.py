"""``docs/metrics.md`` against ``django_quota.metrics``: the page's family table is what
the module exposes (names, types, label names, read from a registry after a real
evaluation and an eviction reading, through its collector and through its
multiprocess-mode metrics), its label-value table names the code's vocabulary, and its
bucket list is the histogram's.
Also what the page says of the circuit breaker: while it is open no backend call is
made, so neither the health counter nor the latency histogram moves, and the outcomes
carry ``backend_unavailable``."""

from __future__ import annotations

import re
import types
from functools import partial
from typing import Any

import prometheus_client
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

import django_quota
from django_quota import engine, limiter, metrics
from django_quota.core import outcome
from tests.doc_tables import page, table
from tests.test_middleware import dead_redis_url

PAGE = "metrics.md"
_CODE = re.compile(r"`([^`]*)`")
_METRIC_CLASSES = ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum")


def codes(cell: str) -> list[str]:
    """The code spans of a cell, ``""`` read as the empty string (a cell that is one code
    span comes without its backticks from :func:`tests.doc_tables.tables`)."""
    spans = _CODE.findall(cell) if "`" in cell else [cell]
    return ["" if code == '""' else code for code in spans]


@pytest.fixture(params=["collector", "multiprocess"])
def registered(
    request: pytest.FixtureRequest, quota: Any, monkeypatch: pytest.MonkeyPatch
) -> dict[str, tuple[str, set[str]]]:
    """Exposition name -> (type, label names) of every family the module exposes once
    one evaluation ran, in a registry of its own (the default one is shared by the whole
    test process): through the module's collector (one process), or through the
    prometheus_client metrics it creates in multiprocess mode."""
    registry = CollectorRegistry()
    if request.param == "collector":
        registry.register(metrics.Collector())
    else:
        shim = types.SimpleNamespace(**vars(prometheus_client))
        for name in _METRIC_CLASSES:
            setattr(shim, name, partial(getattr(prometheus_client, name), registry=registry))
        monkeypatch.setattr(metrics, "prometheus_client", shim)
        monkeypatch.setattr(metrics, "MULTIPROCESS", True)
        monkeypatch.setattr(metrics._counts, "families", {})
        monkeypatch.setattr(metrics._counts, "outcome_children", {})
        monkeypatch.setattr(metrics._counts, "backend_children", {})
    monkeypatch.setattr(metrics._counts, "evicted", {})
    quota(POLICIES={"ref-metrics": {"windows": "5/m", "selector": ["user", "ip"]}})
    django_quota.evaluate("ref-metrics", {"user": "7", "ip": "203.0.113.9"})
    metrics.record_evicted("default", 0)  # what a Redis backend's first reading records
    metrics.record_backend("redis", "ok", 0.001)  # and its call (the memory backend's has
    # no latency histogram)
    found: dict[str, tuple[str, set[str]]] = {}
    for family in registry.collect():
        exposed = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels} - {"le"}
        found[exposed] = (family.type, labels)
    return found


def test_the_family_table_is_what_the_module_registers(
    registered: dict[str, tuple[str, set[str]]],
) -> None:
    families = table(page(PAGE), "Families")
    documented = {
        name: (kind, set(codes(labels)))
        for name, kind, labels in zip(
            families.column("family"), families.column("type"), families.column("labels"),
            strict=True,
        )
    }
    assert documented == registered
    assert set(registered) == {
        "django_quota_outcomes_total",
        "django_quota_backend_health_total",
        "django_quota_backend_latency_seconds",
        "django_quota_backend_evicted_keys",
    }


def test_every_label_has_its_values_described(
    registered: dict[str, tuple[str, set[str]]],
) -> None:
    values = table(page(PAGE), "Label values")
    described = set(zip(values.column("family"), values.column("label"), strict=True))
    assert described == {(name, label) for name, (_, labels) in registered.items()
                         for label in labels}


def test_the_enumerated_label_values_are_the_code_vocabulary() -> None:
    values = table(page(PAGE), "Label values")
    listed = {
        (family, label): set(codes(cell))
        for family, label, cell in zip(
            values.column("family"), values.column("label"), values.column("values"),
            strict=True,
        )
    }
    outcomes, health = "django_quota_outcomes_total", "django_quota_backend_health_total"
    latency = "django_quota_backend_latency_seconds"
    modes = {outcome.BACKEND_MODE_REDIS, outcome.BACKEND_MODE_MEMORY}
    assert listed[(outcomes, "decision")] == set(outcome.DECISIONS)
    assert listed[(outcomes, "reason")] == {
        "", "<window>" + outcome.QUOTA_EXHAUSTED_SUFFIX, *outcome.FIXED_REASONS,
        metrics.GROUP_DENIED,
    }
    assert listed[(outcomes, "backend_mode")] == modes | {
        outcome.BACKEND_MODE_FALLBACK,
        outcome.BACKEND_MODE_CACHE,
    }
    assert listed[(health, "reason")] == {metrics.OK, *outcome.FAILURE_REASONS}
    assert listed[(health, "backend_mode")] == {outcome.BACKEND_MODE_REDIS}  # no node in memory
    assert listed[(latency, "backend_mode")] == {outcome.BACKEND_MODE_REDIS}  # no I/O, no latency


def test_the_bucket_list_is_the_histogram_s() -> None:
    line = next(
        line for line in page(PAGE).splitlines() if line.startswith("Buckets (upper bounds")
    )
    assert [float(bound) for bound in codes(line)] == list(metrics.Families.LATENCY_BUCKETS)


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
    for _ in range(engine.Sizes.BREAKER_THRESHOLD):
        django_quota.evaluate("ref-breaker", {"ip": "203.0.113.9"})
    assert limiter.get_breaker().state == "open"
    assert health() - health_before == engine.Sizes.BREAKER_THRESHOLD
    assert latency() - latency_before == engine.Sizes.BREAKER_THRESHOLD

    for _ in range(3):
        found = django_quota.evaluate("ref-breaker", {"ip": "203.0.113.9"})
        assert (found.decision, found.reason) == ("failed_closed", "backend_unavailable")
    assert health() - health_before == engine.Sizes.BREAKER_THRESHOLD
    assert latency() - latency_before == engine.Sizes.BREAKER_THRESHOLD
    assert refused() - refused_before == engine.Sizes.BREAKER_THRESHOLD + 3
    # The status page's recent errors still show the limiter's refusals.
    details = [error.detail for error in limiter.recent_errors()]
    assert details[-3:] == ["circuit breaker open for default"] * 3
