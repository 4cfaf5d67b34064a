"""Observability (docs/operations.md): the Prometheus families, each outcome counted under its own
labels, backend health and latency, no identity in any label or log line, the
``django_quota.views.metrics`` view, and its multiprocess mode (gunicorn workers).

prometheus_client's default registry lives as long as the test process, so every test
reads the difference a scenario makes, on policy ids no other test uses."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import django_quota
from django_quota import limiter, metrics, policies
from tests import test_limiter

ROOT = Path(__file__).resolve().parent.parent
CLOCK = "tests.test_middleware.frozen_clock"
#: The fixture parametrised over memory, fakeredis and a real redis-server.
configure = test_limiter.configure
OUTCOMES = "django_quota_outcomes_total"
HEALTH = "django_quota_backend_health_total"
LATENCY = "django_quota_backend_latency_seconds"
#: Raw identities that must never appear in a label or a log line.
USER, API_KEY, CLIENT_IP = "user-5f1c9e", "key-SECRET-8d2b41", "203.0.113.77"
SUBJECT = {"user": USER, "api_key": API_KEY, "ip": CLIENT_IP}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def outcome_count(policy: str, decision: str, reason: str, dimensions: str, mode: str) -> float:
    return sample(OUTCOMES, policy=policy, decision=decision, reason=reason,
                  selector_dimensions=dimensions, backend_mode=mode)


@pytest.fixture
def quota_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.DEBUG, logger="django_quota"):
        yield caplog


def assert_no_identity(text: str) -> None:
    for raw in (USER, API_KEY, CLIENT_IP):
        assert raw not in text


# -- outcomes -----------------------------------------------------------------------------------
def test_memory_outcomes_are_counted_under_their_own_labels(
    quota: Any, quota_logs: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, POLICIES={
        "m-enforced": {"windows": "1/m", "selector": ["user", "ip"]},
        "m-shadow": {"windows": "1/m", "selector": ["api_key"], "enforcement": "shadow"},
    })
    ok_before = sample(HEALTH, backend_mode="memory", reason="ok")
    latency_before = sample(f"{LATENCY}_count", backend_mode="memory")
    for _ in range(2):
        django_quota.evaluate("m-enforced", SUBJECT)
        django_quota.evaluate("m-shadow", SUBJECT)
    django_quota.peek("m-enforced", SUBJECT)  # peeks are not decisions
    assert outcome_count("m-enforced", "allowed", "", "user+ip", "memory") == 1
    assert outcome_count(
        "m-enforced", "denied", "default_quota_exhausted", "user+ip", "memory"
    ) == 1
    assert outcome_count("m-shadow", "allowed", "", "api_key", "memory") == 1
    assert outcome_count(
        "m-shadow", "shadow_denied", "default_quota_exhausted", "api_key", "memory"
    ) == 1
    # no health count (no node to be healthy or not) and no latency histogram (no I/O)
    # for the memory backend (docs/metrics.md)
    assert sample(HEALTH, backend_mode="memory", reason="ok") == ok_before == 0
    assert sample(f"{LATENCY}_count", backend_mode="memory") == latency_before == 0
    assert sample(f"{LATENCY}_bucket", backend_mode="memory", le="+Inf") == 0
    assert metrics.outcome_counts()[("m-enforced", "denied", "default_quota_exhausted")] == 1
    assert_no_identity(quota_logs.text)


def test_a_policy_id_back_with_another_selector_is_counted_under_that_selector(
    quota: Any,
) -> None:
    # An admin edit (or another settings generation) can give one policy id a new
    # selector: its outcomes must go to the new selector's series, not the first one's.
    quota(CLOCK=CLOCK, POLICIES={"m-reselected": {"windows": "5/m", "selector": ["user"]}})
    django_quota.evaluate("m-reselected", SUBJECT)
    by_user = outcome_count("m-reselected", "allowed", "", "user", "memory")
    quota(CLOCK=CLOCK, POLICIES={"m-reselected": {"windows": "5/m", "selector": ["ip"]}})
    django_quota.evaluate("m-reselected", SUBJECT)
    assert outcome_count("m-reselected", "allowed", "", "ip", "memory") == 1
    assert outcome_count("m-reselected", "allowed", "", "user", "memory") == by_user == 1


def test_denials_log_one_info_line_per_series_and_interval_with_a_count(
    quota: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A scraper at 10x its limit must not write a line per refusal: one INFO line per
    # (policy, decision, reason) per interval, counting what it stands for; DEBUG has all.
    quota(CLOCK=CLOCK, POLICIES={"m-flood": {"windows": "1/m", "selector": ["ip"]}})
    wall = [1_000.0]
    monkeypatch.setattr(metrics.time, "time", lambda: wall[0])
    with caplog.at_level(logging.INFO, logger="django_quota"):
        for _ in range(101):  # 1 allowed, 100 denied
            django_quota.evaluate("m-flood", SUBJECT)
        wall[0] += metrics.LOG_INTERVAL
        django_quota.evaluate("m-flood", SUBJECT)
    lines = [r.getMessage() for r in caplog.records if r.name == "django_quota"]
    assert [r.levelno for r in caplog.records if r.name == "django_quota"] == [logging.INFO] * 2
    assert lines == [
        "quota denied: policy=m-flood reason=default_quota_exhausted backend_mode=memory"
        " count=1",
        "quota denied: policy=m-flood reason=default_quota_exhausted backend_mode=memory"
        " count=100",
    ]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="django_quota"):
        for _ in range(3):
            django_quota.evaluate("m-flood", SUBJECT)
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 3


def test_failures_and_fallback_are_never_folded_together(
    quota: Any, quota_logs: pytest.LogCaptureFixture
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    policies = {
        "f-open": {"windows": "5/m", "selector": ["ip"], "failure_mode": "open"},
        "f-closed": {"windows": "5/m", "selector": ["ip"], "failure_mode": "closed"},
    }
    unavailable_before = sample(HEALTH, backend_mode="redis", reason="backend_unavailable")
    quota(REDIS_URL=dead, POLICIES=policies)
    assert django_quota.evaluate("f-open", SUBJECT).decision == "failed_open"
    assert django_quota.evaluate("f-closed", SUBJECT).decision == "failed_closed"
    quota(REDIS_URL=dead, POLICIES={"f-fallback": {"windows": "1/m", "selector": ["ip"]}},
          LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 100})
    decisions = [django_quota.evaluate("f-fallback", SUBJECT).decision for _ in range(2)]
    assert decisions == ["allowed", "denied"]

    assert outcome_count("f-open", "failed_open", "backend_unavailable", "ip", "redis") == 1
    assert outcome_count("f-closed", "failed_closed", "backend_unavailable", "ip", "redis") == 1
    assert outcome_count("f-fallback", "allowed", "", "ip", "fallback") == 1
    assert outcome_count(
        "f-fallback", "denied", "default_quota_exhausted", "ip", "fallback"
    ) == 1
    assert sample(HEALTH, backend_mode="redis", reason="backend_unavailable") - (
        unavailable_before
    ) == 4
    assert_no_identity(quota_logs.text)
    failures = [r.getMessage() for r in quota_logs.records if "backend failure" in r.getMessage()]
    assert "quota backend failure: reason=backend_unavailable policies=f-closed" in failures


def test_redis_outcomes_and_health(quota: Any, redis_url: str) -> None:
    quota(CLOCK=CLOCK, REDIS_URL=redis_url,
          POLICIES={"r-api": {"windows": "1/m", "selector": ["api_key"]}})
    ok_before = sample(HEALTH, backend_mode="redis", reason="ok")
    latency_before = sample(f"{LATENCY}_count", backend_mode="redis")
    for _ in range(2):
        django_quota.evaluate("r-api", SUBJECT)
    assert outcome_count("r-api", "allowed", "", "api_key", "redis") == 1
    assert outcome_count("r-api", "denied", "default_quota_exhausted", "api_key", "redis") == 1
    assert sample(HEALTH, backend_mode="redis", reason="ok") - ok_before == 2
    assert sample(f"{LATENCY}_count", backend_mode="redis") - latency_before == 2
    assert sample(f"{LATENCY}_sum", backend_mode="redis") > 0


def test_identity_errors_are_counted_without_the_identity(
    quota: Any, quota_logs: pytest.LogCaptureFixture
) -> None:
    quota(POLICIES={"i-keys": {"windows": "5/m", "selector": ["api_key"]}})
    django_quota.evaluate("i-keys", {"ip": CLIENT_IP})
    django_quota.evaluate("i-keys", {"api_key": f"{API_KEY}\x00"})
    assert outcome_count("i-keys", "denied", "selector_identity_missing", "api_key", "memory") == 1
    assert outcome_count("i-keys", "denied", "selector_identity_invalid", "api_key", "memory") == 1
    assert_no_identity(quota_logs.text)


# -- the view ----------------------------------------------------------------------------------
def scrape(client: Client) -> dict[str, Any]:
    response = client.get("/metrics/quota")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    text = response.content.decode()
    assert_no_identity(text)
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_a_policy_refused_by_its_group_is_not_counted_as_admitting(configure: Any) -> None:
    """The issue's case: 5 requests, 3 got through. The loose policy's own windows
    allowed all 5, but the tight one refused the last 2, so the group charged nothing:
    counted as 3 ``allowed`` and 2 ``allowed`` with ``reason="group_denied"``. The
    outcomes themselves stay ``allowed`` with no reason."""
    backend = configure.kind
    tight, loose = f"gd-tight-{backend}", f"gd-loose-{backend}"
    configure(CLOCK=CLOCK, POLICIES={
        tight: {"algorithm": "fixed_window", "windows": "3/m", "selector": ["ip"]},
        loose: {"algorithm": "fixed_window", "windows": "10/m", "selector": ["ip"]},
    })
    mode = "memory" if backend == "memory" else "redis"
    group = [policies.get_policy(tight), policies.get_policy(loose)]
    subject = {"ip": CLIENT_IP}
    found = [limiter.evaluate_policies(group, subject) for _ in range(5)]
    assert [[o.decision for o in outcomes] for outcomes in found] == (
        [["allowed", "allowed"]] * 3 + [["denied", "allowed"]] * 2
    )
    assert [outcomes[1].reason for outcomes in found] == [None] * 5
    # On Redis the second refusal is the denial cache's (docs/failures.md), counted apart.
    cached = 1 if mode == "redis" else 0
    assert [outcomes[0].backend_mode for outcomes in found] == [mode] * 4 + [
        "cache" if cached else mode
    ]
    assert outcome_count(loose, "allowed", "", "ip", mode) == 3
    assert outcome_count(loose, "allowed", "group_denied", "ip", mode) == 2 - cached
    assert outcome_count(loose, "allowed", "group_denied", "ip", "cache") == cached
    assert outcome_count(tight, "allowed", "", "ip", mode) == 3
    assert outcome_count(tight, "denied", "default_quota_exhausted", "ip", mode) == 2 - cached
    assert outcome_count(tight, "denied", "default_quota_exhausted", "ip", "cache") == cached
    assert django_quota.peek(loose, subject).remaining == 7
    counts = metrics.outcome_counts()
    assert (counts[(loose, "allowed", "")], counts[(loose, "allowed", "group_denied")]) == (3, 2)


def test_the_view_exposes_every_family_through_http(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICIES={
        "v-api": {"windows": "1/m", "selector": ["ip"], "routes": ["/api"]},
    })
    client = Client(REMOTE_ADDR=CLIENT_IP)
    assert [client.get("/api/items/").status_code for _ in range(2)] == [200, 429]
    families = scrape(client)
    assert {"django_quota_outcomes", "django_quota_backend_health",
            "django_quota_backend_latency_seconds"} <= set(families)
    outcomes = {
        (s.labels["policy"], s.labels["decision"], s.labels["reason"]): s.value
        for s in families["django_quota_outcomes"].samples
        if s.name == OUTCOMES
    }
    assert outcomes[("v-api", "allowed", "")] == 1
    assert outcomes[("v-api", "denied", "default_quota_exhausted")] == 1
    assert families["django_quota_backend_latency_seconds"].type == "histogram"


def test_the_view_answers_404_without_prometheus_client(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    response = client.get("/metrics/quota")
    assert (response.status_code, response.content) == (
        404, b"prometheus_client is not installed\n"
    )


# -- the collector -------------------------------------------------------------------------------
def _samples(registry: Any) -> set[tuple[str, tuple[tuple[str, str], ...], float | None]]:
    """Every sample of ``registry``'s families: name, labels, value (None for the
    ``_created`` timestamps, which differ by when each side first counted)."""
    return {
        (s.name, tuple(sorted(s.labels.items())), None if s.name.endswith("_created") else s.value)
        for family in registry.collect()
        for s in family.samples
    }


def test_the_collector_exposes_what_prometheus_client_s_own_metrics_would(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types
    from functools import partial

    import prometheus_client
    from prometheus_client import CollectorRegistry

    theirs = CollectorRegistry()
    shim = types.SimpleNamespace(**vars(prometheus_client))
    for name in ("Counter", "Gauge", "Histogram"):
        setattr(shim, name, partial(getattr(prometheus_client, name), registry=theirs))
    monkeypatch.setattr(metrics, "prometheus_client", shim)
    monkeypatch.setattr(metrics, "MULTIPROCESS", True)  # count both ways at once
    for name in ("families", "outcome_children", "backend_children", "outcomes",
                 "health", "latency", "evicted"):
        monkeypatch.setattr(metrics._counts, name, {})
    quota(POLICIES={
        "col-a": {"windows": "2/m", "selector": ["user"]},
        "col-b": {"windows": "9/m", "selector": ["user", "ip"], "enforcement": "shadow"},
    })
    group = [policies.get_policy("col-a"), policies.get_policy("col-b")]
    for _ in range(3):  # the third is denied
        limiter.evaluate_policies(group, {"user": "u1", "ip": "203.0.113.5"})
    # latencies on and around the bucket bounds, and above the last one
    for seconds in (0.0, 0.0005, 0.0006, 0.001, 0.3, 1.0, 2.5):
        metrics.record_backend("redis", "ok", seconds)
    metrics.record_backend("redis", "backend_timeout", 0.25)
    metrics.record_evicted("127.0.0.1:7000", 12)  # a reading of a cluster primary
    ours = CollectorRegistry()
    ours.register(metrics.Collector())
    expected = _samples(theirs)
    assert len(expected) > 25
    assert _samples(ours) == expected
    # the memory backend decided the groups: neither a health count nor a latency
    assert not any(name.startswith(("django_quota_backend_health",
                                    "django_quota_backend_latency")) and
                   ("backend_mode", "memory") in labels for name, labels, _ in expected)
    assert ("django_quota_backend_health_total",
            (("backend_mode", "redis"), ("reason", "backend_timeout")), 1.0) in expected
    assert ("django_quota_backend_latency_seconds_bucket",
            (("backend_mode", "redis"), ("le", "0.001")), 4.0) in expected
    counts = metrics.outcome_counts()  # the status page's, from the same counts
    assert counts[("col-a", "denied", "default_quota_exhausted")] == 1
    assert counts[("col-b", "allowed", "group_denied")] == 1


def test_the_created_samples_follow_prometheus_client_s_switch(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import prometheus_client
    from prometheus_client import CollectorRegistry

    quota(POLICIES={"col-created": {"windows": "5/m", "selector": ["user"]}})
    django_quota.evaluate("col-created", {"user": "u1"})
    ours = CollectorRegistry()
    ours.register(metrics.Collector())
    assert any(name.endswith("_created") for name, _, _ in _samples(ours))
    # prometheus_client's switch (PROMETHEUS_DISABLE_CREATED_SERIES at its import, or
    # disable_created_metrics() since), restored after the test
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", True)
    if hasattr(prometheus_client, "disable_created_metrics"):
        prometheus_client.disable_created_metrics()
    else:  # versions before the function: only the environment variable sets it
        prometheus_client.metrics._use_created = False
    names = {name for name, _, _ in _samples(ours)}
    assert names and not any(name.endswith("_created") for name in names)


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_name_already_registered_is_a_warning_not_a_failed_import() -> None:
    code = textwrap.dedent("""
        import prometheus_client
        prometheus_client.Counter("django_quota_backend_health_total", "someone else's", ["a"])
        import django_quota.metrics
        print("imported")
    """)
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    done = _python(code, {**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "imported\n"
    assert "django_quota metrics are not exported" in done.stderr
    assert "django_quota_backend_health" in done.stderr


# -- multiprocess mode -------------------------------------------------------------------------
WORKER = textwrap.dedent("""
    import sys
    import django
    from django.conf import settings
    django.setup()
    settings.QUOTA = {
        "HMAC_KEY": "tests-hmac-key-0123456789",
        "POLICY_SOURCES": ["settings"],
        "POLICIES": {"mp-api": {"windows": "100/m", "selector": ["ip"]}},
    }
    import django_quota
    from django_quota import metrics
    for _ in range(int(sys.argv[1])):
        django_quota.evaluate("mp-api", {"ip": "203.0.113.77"})
        metrics.record_backend("redis", "ok", 0.002)  # a Redis call's counts, as recorded
""")
SCRAPER = textwrap.dedent("""
    import django
    django.setup()
    from django.test import Client
    print(Client().get("/metrics/quota").content.decode())
""")


@pytest.mark.parametrize(
    "variable",
    ["PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"],  # the second is deprecated
)
def test_multiprocess_mode_aggregates_every_worker(tmp_path: Path, variable: str) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"},
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT),
        variable: str(directory),
    }

    def python(code: str, *args: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        return done.stdout

    python(WORKER, "2")
    python(WORKER, "3")
    assert len(list(directory.glob("counter_*.db"))) == 2  # one file per worker process
    text = python(SCRAPER)
    assert_no_identity(text)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    allowed = [
        s.value for s in families["django_quota_outcomes"].samples
        if s.name == OUTCOMES and s.labels["policy"] == "mp-api"
    ]
    assert allowed == [5.0]
    health = {
        tuple(s.labels.values()): s.value for s in families["django_quota_backend_health"].samples
    }
    assert health == {("redis", "ok"): 5.0}  # and none of the memory backend, in any worker
    latency = {
        (s.name, tuple(s.labels.values())): s.value
        for s in families["django_quota_backend_latency_seconds"].samples
    }
    assert latency[("django_quota_backend_latency_seconds_count", ("redis",))] == 5.0
    assert latency[("django_quota_backend_latency_seconds_bucket", ("redis", "0.0025"))] == 5.0
    assert not any("memory" in labels for _, labels in latency)
