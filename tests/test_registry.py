"""The policy registry (docs/policies.md, operations.md): settings and database policies merged in
``POLICY_SOURCES`` order, conflicts (settings win, a log line and check E007), invalid
rows skipped, the last good registry kept through a database failure, edits reaching the
registry at once in the saving process and within ``POLICY_CACHE_TTL`` elsewhere, no query
per request, and the async path.

Time is injected: ``django_quota.policies.time`` is replaced by a namespace whose
``monotonic`` the test moves; nothing sleeps."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import SynchronousOnlyOperation
from django.db import DatabaseError
from django.test import AsyncClient, Client

import django_quota
from django_quota import policies
from django_quota.checks import check_settings
from django_quota.messages import Codes
from django_quota.models import QuotaPolicy, QuotaWindow, revision_batch

pytestmark = pytest.mark.django_db

CLOCK = "tests.test_middleware.frozen_clock"
SOURCES = ["settings", "database"]
IP = {"ip": "203.0.113.9"}
SETTINGS_POLICY = {"windows": "100/h", "selector": ["ip"]}


class FakeMonotonic:
    """``time.monotonic`` for the registry, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeMonotonic:
    fake = FakeMonotonic()
    monkeypatch.setattr(policies, "time", SimpleNamespace(monotonic=fake))
    return fake


def db_policy(name: str, limit: int = 2, period: int = 3600, **fields: Any) -> QuotaPolicy:
    fields.setdefault("selector", ["ip"])
    with revision_batch():
        policy = QuotaPolicy.objects.create(name=name, **fields)
        QuotaWindow.objects.create(policy=policy, name="default", limit=limit, period=period)
    policy.refresh_from_db()
    return policy


def quota_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "django_quota" and record.levelno >= logging.ERROR
    ]


# -- merge order --------------------------------------------------------------------------------
def test_settings_then_database_policies_by_position_and_name(quota: Any) -> None:
    quota(POLICY_SOURCES=SOURCES, POLICIES={"zeta": SETTINGS_POLICY, "alpha": SETTINGS_POLICY})
    db_policy("db-b", position=0, routes=["/api"])
    db_policy("db-a", position=1, routes=["/api"])
    db_policy("db-c", position=0)
    registry = policies.get_registry()
    assert list(registry.policies) == ["zeta", "alpha", "db-b", "db-c", "db-a"]
    assert [p.source for p in registry.policies.values()] == ["settings"] * 2 + ["database"] * 3
    assert [p.id for p in registry.middleware] == ["db-b", "db-a"]
    assert registry.policies["db-a"].revision == "2"  # the second row created
    assert registry.database_ok
    assert registry.conflicts == ()


def test_sources_are_read_in_the_configured_order(quota: Any) -> None:
    quota(POLICY_SOURCES=["database", "settings"], POLICIES={"from-settings": SETTINGS_POLICY})
    db_policy("from-db")
    assert list(policies.get_registry().policies) == ["from-db", "from-settings"]


@pytest.mark.parametrize("sources", [["settings"], ["database"]])
def test_a_source_left_out_is_not_read(quota: Any, sources: list[str]) -> None:
    quota(POLICY_SOURCES=sources, POLICIES={"from-settings": SETTINGS_POLICY})
    db_policy("from-database")
    assert list(policies.get_registry().policies) == [f"from-{sources[0]}"]


def test_disabled_database_policy_is_known_but_not_applied(quota: Any) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES)
    db_policy("api", limit=1, routes=["/api"], enabled=False)
    registry = policies.get_registry()
    assert "api" in registry.policies
    assert registry.middleware == ()
    assert [Client().get("/api/items/").status_code for _ in range(2)] == [200, 200]


# -- conflicts -------------------------------------------------------------------------------
def test_an_id_in_both_sources_is_taken_from_settings(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(POLICY_SOURCES=SOURCES, POLICIES={"orders": SETTINGS_POLICY})
    db_policy("orders", limit=1, routes=["/api"])
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        registry = policies.get_registry()
    orders = registry.policies["orders"]
    assert (orders.source, orders.windows[0].limit) == ("settings", 100)
    assert registry.conflicts == ("orders",)
    assert registry.middleware == ()  # the routed database row is ignored
    assert quota_errors(caplog) == [
        "quota policy 'orders' is defined in settings and in the database; the database row "
        "is ignored (django_quota.E007)"
    ]
    errors = [message for message in check_settings() if message.id == Codes.E_DUPLICATE_POLICY]
    assert [message.msg for message in errors] == [
        "QUOTA['POLICIES']['orders'] is also a database policy; the database row is ignored"
    ]


def test_a_conflict_is_logged_once_not_at_every_rebuild(
    quota: Any, clock: FakeMonotonic, caplog: pytest.LogCaptureFixture
) -> None:
    quota(POLICY_SOURCES=SOURCES, POLICIES={"orders": SETTINGS_POLICY})
    db_policy("orders")
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        for _ in range(3):
            policies.get_registry()
            clock.now += 10
    assert len(quota_errors(caplog)) == 1


def test_e007_needs_the_database_source(quota: Any) -> None:
    quota(POLICY_SOURCES=["settings"], POLICIES={"orders": SETTINGS_POLICY})
    db_policy("orders")
    assert Codes.E_DUPLICATE_POLICY not in [message.id for message in check_settings()]


# -- invalid rows and database failures -------------------------------------------------------
def test_invalid_rows_are_skipped_and_logged_never_raised(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES)
    QuotaPolicy.objects.create(name="no-windows", routes=["/api"])
    broken = db_policy("bad-selector", routes=["/api"])
    QuotaPolicy.objects.filter(pk=broken.pk).update(selector=["nobody"])  # past clean()
    inverted = db_policy("inverted", routes=["/api"])
    QuotaWindow.objects.filter(policy=inverted).update(name="burst")
    QuotaWindow.objects.create(policy=inverted, name="sustained", limit=5, period=1)
    db_policy("good", limit=1, routes=["/api"])
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        statuses = [Client().get("/api/items/").status_code for _ in range(2)]
    assert statuses == [200, 429]  # "good" applies; the others never raise
    assert list(policies.get_registry().policies) == ["good"]
    logged = quota_errors(caplog)
    assert len(logged) == 3
    assert logged[0].startswith("quota policy 'bad-selector' in the database is invalid, skipped")
    assert "unknown dimension 'nobody'" in logged[0]
    assert "'burst' window's period must be shorter" in logged[1]
    assert "a policy needs at least one window" in logged[2]


def test_a_row_with_a_bad_count_when_is_skipped_and_logged(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES)
    broken = db_policy("bad-count-when", routes=["/api"])
    QuotaPolicy.objects.filter(pk=broken.pk).update(count_when=["2xy"])  # past clean()
    db_policy("good", limit=1, routes=["/api"], count_when=["2xx"])
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        assert [Client().get("/api/items/").status_code for _ in range(2)] == [200, 429]
    assert list(policies.get_registry().policies) == ["good"]
    assert policies.get_registry().policies["good"].count_when == ("2xx",)
    (logged,) = quota_errors(caplog)
    assert logged.startswith("quota policy 'bad-count-when' in the database is invalid")
    assert "'2xy' is not an HTTP status" in logged


def test_database_failure_keeps_the_last_good_registry(
    quota: Any, clock: FakeMonotonic, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES, POLICIES={"from-settings": SETTINGS_POLICY})
    db_policy("api", limit=1, routes=["/api"])
    good = policies.get_registry()

    def unavailable() -> list[Any]:
        raise DatabaseError("connection to server was lost")

    monkeypatch.setattr(policies, "load_database_policies", unavailable)
    clock.now += 5.0  # POLICY_CACHE_TTL
    with caplog.at_level(logging.ERROR, logger="django_quota"):
        degraded = policies.get_registry()
        statuses = [Client().get("/api/items/").status_code for _ in range(2)]
    assert degraded is not good
    assert not degraded.database_ok
    assert list(degraded.policies) == list(good.policies) == ["from-settings", "api"]
    assert degraded.policies["api"] == good.policies["api"]
    assert statuses == [200, 429]
    assert quota_errors(caplog) == [
        "quota policies could not be read from the database: connection to server was lost"
    ]


def test_database_failure_on_the_first_load_serves_settings_policies(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota(POLICY_SOURCES=SOURCES, POLICIES={"from-settings": SETTINGS_POLICY})

    def unavailable() -> list[Any]:
        raise DatabaseError("no such table: django_quota_quotapolicy")

    monkeypatch.setattr(policies, "load_database_policies", unavailable)
    registry = policies.get_registry()
    assert list(registry.policies) == ["from-settings"]
    assert not registry.database_ok


# -- propagation --------------------------------------------------------------------------------
def test_a_save_in_this_process_reaches_the_registry_at_once(
    quota: Any, clock: FakeMonotonic
) -> None:
    quota(POLICY_SOURCES=SOURCES)
    policy = db_policy("api")
    assert policies.get_registry().policies["api"].windows[0].limit == 2
    window = policy.windows.get()
    window.limit = 7
    window.save()
    current = policies.get_registry().policies["api"]  # the clock has not moved
    assert (current.windows[0].limit, current.revision) == (7, "2")
    policy.enabled = False
    policy.save()
    assert not policies.get_registry().policies["api"].enabled
    QuotaPolicy.objects.filter(pk=policy.pk).delete()
    assert "api" not in policies.get_registry().policies


def test_an_edit_elsewhere_arrives_within_the_cache_ttl(
    quota: Any, clock: FakeMonotonic, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota(POLICY_SOURCES=SOURCES, POLICY_CACHE_TTL=5.0)
    policy = db_policy("api")
    assert policies.get_registry().policies["api"].revision == "1"
    with monkeypatch.context() as another_process:  # its saves do not clear our cache
        another_process.setattr(policies, "clear", lambda: None)
        window = policy.windows.get()
        window.limit = 7
        window.save()
    assert revision_of("api") == 2
    clock.now += 4.999
    assert policies.get_registry().policies["api"].revision == "1"
    clock.now += 0.001
    assert policies.get_registry().policies["api"].revision == "2"


def revision_of(name: str) -> int:
    return QuotaPolicy.objects.get(name=name).revision


def test_requests_make_no_query_while_the_registry_is_fresh(
    quota: Any, clock: FakeMonotonic, django_assert_num_queries: Any
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES)
    db_policy("api", limit=3, routes=["/api"])
    client = Client()
    assert client.get("/api/items/").status_code == 200  # warms the registry
    with django_assert_num_queries(0):
        assert [client.get("/api/items/").status_code for _ in range(3)] == [200, 200, 429]
    clock.now += 5.0
    with django_assert_num_queries(3):  # one rebuild: policies, their windows, their plans
        client.get("/api/items/")
    with django_assert_num_queries(0):
        client.get("/api/items/")


def test_evaluate_makes_no_query_while_the_registry_is_fresh(
    quota: Any, clock: FakeMonotonic, django_assert_num_queries: Any
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES)
    db_policy("api")
    django_quota.evaluate("api", IP)
    with django_assert_num_queries(0):
        assert django_quota.evaluate("api", IP).remaining == 0
        assert django_quota.peek("api", IP).decision == "denied"


# -- async ------------------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_async_requests_read_database_policies_outside_the_event_loop(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES, POLICY_CACHE_TTL=0)
    db_policy("api", limit=2, routes=["/api"])

    async def scenario() -> list[int]:
        client = AsyncClient()
        return [(await client.get("/api/async/")).status_code for _ in range(3)]

    with caplog.at_level(logging.WARNING, logger="django_quota"):
        assert async_to_sync(scenario)() == [200, 200, 429]
    assert quota_errors(caplog) == []


@pytest.mark.django_db(transaction=True)
def test_async_api_refreshes_the_registry_without_synchronous_only_errors(
    quota: Any, caplog: pytest.LogCaptureFixture
) -> None:
    quota(CLOCK=CLOCK, POLICY_SOURCES=SOURCES, POLICY_CACHE_TTL=0)
    db_policy("api", limit=2)

    async def scenario() -> list[str]:
        first = await django_quota.aevaluate("api", IP)
        second = await django_quota.aevaluate("api", IP)
        third = await django_quota.aevaluate("api", IP)
        peeked = await django_quota.apeek("api", IP)
        cleared = await django_quota.areset("api", IP)
        return [first.decision, second.decision, third.decision, peeked.decision, str(cleared)]

    with caplog.at_level(logging.WARNING, logger="django_quota"):
        assert async_to_sync(scenario)() == ["allowed", "allowed", "denied", "denied", "1"]
    assert quota_errors(caplog) == []  # no "could not be read from the database"


@pytest.mark.django_db(transaction=True)
def test_get_registry_inside_an_event_loop_queries_in_a_worker_thread(quota: Any) -> None:
    quota(POLICY_SOURCES=SOURCES, POLICY_CACHE_TTL=0)
    db_policy("api")

    async def scenario() -> Any:
        # An async view reaching get_policy() directly (no aget_registry first).
        return policies.get_policy("api")

    assert async_to_sync(scenario)().source == "database"


def test_loading_database_policies_in_the_event_loop_is_refused_by_django(quota: Any) -> None:
    quota(POLICY_SOURCES=SOURCES)

    async def scenario() -> Any:
        return policies.load_database_policies()

    with pytest.raises(SynchronousOnlyOperation):  # why get_registry must not do it there
        async_to_sync(scenario)()


# -- before and after migrate ---------------------------------------------------------------
TOLD_TO_MIGRATE = (
    "the quota policy tables do not exist yet: run `manage.py migrate`; until then only "
    "settings policies apply"
)


@pytest.fixture
def no_tables(quota: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the first ``migrate``: a settings policy ``zeta``, the database policies'
    read failing on the missing table, and nothing told yet in this process."""
    from django.db.utils import OperationalError

    def no_table() -> list[Any]:
        raise OperationalError("no such table: django_quota_quotapolicy")

    quota(POLICY_SOURCES=SOURCES, POLICIES={"zeta": SETTINGS_POLICY})
    monkeypatch.setattr(policies, "load_database_policies", no_table)
    monkeypatch.setattr(policies, "_tables_missing", lambda: True)
    monkeypatch.setattr(policies._state, "told_to_migrate", False)


def test_missing_tables_are_a_warning_to_migrate_not_an_error(
    no_tables: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The subprocess test (tests/test_before_migrate.py) runs a real fresh migrate; here
    the same path in-process, twice, for the once-per-process bound."""
    with caplog.at_level(logging.WARNING, logger="django_quota"):
        for _ in range(2):
            policies.clear()
            registry = policies.get_registry()
    assert list(registry.policies) == ["zeta"]
    assert registry.database_ok is False
    assert quota_errors(caplog) == []
    assert [r.getMessage() for r in caplog.records if r.name == "django_quota"] == [
        TOLD_TO_MIGRATE
    ]


def test_the_checks_say_nothing_before_migrate_and_the_first_use_still_does(
    no_tables: None, caplog: pytest.LogCaptureFixture
) -> None:
    """``migrate`` runs the system checks before it creates the tables: they must not tell
    it to run itself, nor keep the registry they built, so that the first real use warns."""
    policies.clear()
    with caplog.at_level(logging.WARNING, logger="django_quota"):
        assert [message.id for message in check_settings()] == ["django_quota.W001"]  # memory
        with policies.checking():
            assert list(policies.get_registry().policies) == ["zeta"]
        assert policies._state.registry is None
        assert [r.getMessage() for r in caplog.records if r.name == "django_quota"] == []
        assert list(policies.get_registry().policies) == ["zeta"]
    assert [r.getMessage() for r in caplog.records if r.name == "django_quota"] == [
        TOLD_TO_MIGRATE
    ]


def test_the_checks_still_log_a_database_that_cannot_be_read(
    quota: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable() -> list[Any]:
        raise DatabaseError("connection refused")

    quota(POLICY_SOURCES=SOURCES, POLICIES={"zeta": SETTINGS_POLICY})
    monkeypatch.setattr(policies, "load_database_policies", unreadable)
    monkeypatch.setattr(policies, "_tables_missing", lambda: False)
    policies.clear()
    with caplog.at_level(logging.WARNING, logger="django_quota"), policies.checking():
        assert list(policies.get_registry().policies) == ["zeta"]
    assert quota_errors(caplog) == [
        "quota policies could not be read from the database: connection refused"
    ]


@pytest.mark.django_db
def test_migrate_drops_the_registry(quota: Any) -> None:
    from django.apps import apps
    from django.db.models.signals import post_migrate

    quota(POLICY_SOURCES=SOURCES)
    policies.get_registry()
    assert policies._state.registry is not None
    config = apps.get_app_config("django_quota")
    post_migrate.send(sender=config, app_config=config, verbosity=0, interactive=False,
                      using="default", apps=apps, plan=[])
    assert policies._state.registry is None
