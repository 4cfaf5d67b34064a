"""``QuotaPolicy`` and ``QuotaWindow`` (docs/policies.md, operations.md): defaults equal to the
settings
defaults, ``clean()`` through the settings validator, the integer revision and the fresh
counters it gives a changed policy, on the memory backend and on a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError

import django_quota
from django_quota.core.errors import ConfigurationError
from django_quota.core.policy import parse_policy
from django_quota.models import QuotaPolicy, QuotaWindow, revision_batch

pytestmark = pytest.mark.django_db

#: 20.4 s into a minute, 860.4 s into an hour: no window rolls over during a test.
CLOCK = "tests.test_middleware.frozen_clock"
IP = {"ip": "203.0.113.9"}


def make_policy(name: str = "orders", windows: tuple[tuple[str, int, int], ...] = (
    ("default", 3, 3600),
), **fields: Any) -> QuotaPolicy:
    """A saved policy with its windows, created as one edit (revision 1)."""
    with revision_batch():
        policy = QuotaPolicy.objects.create(name=name, **fields)
        for window_name, limit, period in windows:
            QuotaWindow.objects.create(policy=policy, name=window_name, limit=limit, period=period)
    policy.refresh_from_db()
    return policy


def revision_of(policy: QuotaPolicy) -> int:
    return QuotaPolicy.objects.get(pk=policy.pk).revision


# -- defaults -----------------------------------------------------------------------------------
def test_defaults_equal_the_documented_defaults() -> None:
    policy = QuotaPolicy(name="orders")
    assert policy.enabled is True
    assert policy.selector == ["auto"]
    assert policy.routes == []
    assert policy.methods == []
    assert policy.enforcement == "enforce"
    assert policy.on_missing == "deny"
    assert policy.failure_mode is None
    assert policy.max_cost is None
    assert policy.revision == 1
    assert QuotaPolicy(name="other").selector is not policy.selector  # no shared default


def test_default_row_means_what_a_default_settings_policy_means() -> None:
    policy = make_policy()
    from_settings = parse_policy("orders", {"windows": "3/h"})
    from_row = policy.to_policy()
    for field in ("algorithm", "windows", "selector", "routes", "methods", "enforcement",
                  "failure_mode", "on_missing", "max_cost", "enabled"):
        assert getattr(from_row, field) == getattr(from_settings, field), field
    assert from_row.source == "database"
    assert from_row.revision == "1"


# -- clean() ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "Orders"),
        ("name", "-orders"),
        ("name", "orders\n"),
        ("name", "a" * 65),
        ("selector", ["nobody"]),
        ("selector", []),
        ("selector", ["ip", "ip"]),
        ("selector", ["auto", "user"]),
        ("selector", {"ip": True}),
        ("routes", "/api"),
        ("routes", [""]),
        ("methods", ["get"]),
        ("methods", ["G3T"]),
        ("methods", "GET"),
        ("algorithm", "leaky_bucket"),
        ("enforcement", "warn"),
        ("failure_mode", "maybe"),
        ("on_missing", "ignore"),
    ],
)
def test_clean_rejects_what_the_settings_validator_rejects(field: str, value: Any) -> None:
    raw = {"windows": "3/h"} if field == "name" else {"windows": "3/h", field: value}
    with pytest.raises(ConfigurationError):
        parse_policy(value if field == "name" else "orders", raw)
    policy = QuotaPolicy(**{"name": "orders", field: value})
    with pytest.raises(ValidationError) as caught:
        policy.clean()
    assert field in caught.value.message_dict  # the error names the field


def test_clean_accepts_a_valid_policy_and_checks_stored_windows() -> None:
    policy = QuotaPolicy(name="orders.v2:eu-1", selector=["user", "route"], methods=["GET"],
                         routes=["/api"], enforcement="shadow", failure_mode="open")
    policy.clean()
    policy.save()
    QuotaWindow.objects.create(policy=policy, name="burst", limit=10, period=60)
    QuotaWindow.objects.create(policy=policy, name="sustained", limit=100, period=60)
    with pytest.raises(ValidationError, match="'burst' window's period must be shorter"):
        policy.clean()


def test_clean_rejects_a_capacity_outside_a_token_bucket() -> None:
    policy = make_policy(algorithm="token_bucket")
    QuotaWindow.objects.filter(policy=policy).update(capacity=10)
    policy.clean()
    policy.algorithm = "fixed_window"
    with pytest.raises(ValidationError, match="capacity applies to token_bucket only"):
        policy.clean()


# -- revision -----------------------------------------------------------------------------------
def test_a_new_policy_draws_the_next_revision() -> None:
    # The first policy of a fresh database is at revision 1; revisions are database-wide.
    assert make_policy(windows=(("burst", 2, 60), ("sustained", 100, 3600))).revision == 1
    # Created window by window, without a batch: invalid until its first window, so that
    # window does not bump; the second is a change of meaning and does.
    policy = QuotaPolicy.objects.create(name="stepwise")
    assert policy.revision == 2
    QuotaWindow.objects.create(policy=policy, name="burst", limit=2, period=60)
    assert revision_of(policy) == 2
    QuotaWindow.objects.create(policy=policy, name="sustained", limit=100, period=3600)
    assert revision_of(policy) == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [("algorithm", "sliding_window"), ("algorithm", "sliding_log"), ("algorithm", "token_bucket"),
     ("selector", ["user"]), ("selector", ["route", "ip"])],
)
def test_revision_bumps_when_the_policy_meaning_changes(field: str, value: Any) -> None:
    policy = make_policy()
    setattr(policy, field, value)
    policy.save()
    assert policy.revision == 2
    assert revision_of(policy) == 2


def test_selector_order_is_not_a_change_of_meaning() -> None:
    policy = make_policy(selector=["ip", "route"])
    policy.selector = ["route", "ip"]
    policy.save()
    assert revision_of(policy) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enforcement", "shadow"),
        ("failure_mode", "open"),
        ("routes", ["/api"]),
        ("methods", ["POST"]),
        ("on_missing", "skip"),
        ("max_cost", 5),
        ("enabled", False),
        ("position", 7),
    ],
)
def test_revision_stays_when_only_the_application_changes(field: str, value: Any) -> None:
    policy = make_policy()
    setattr(policy, field, value)
    policy.save()
    assert revision_of(policy) == 1


@pytest.mark.parametrize(
    ("field", "value"), [("name", "hourly"), ("limit", 4), ("period", 7200)]
)
def test_revision_bumps_when_a_window_is_saved_with_a_new_meaning(field: str, value: Any) -> None:
    policy = make_policy()
    window = policy.windows.get()
    setattr(window, field, value)
    window.save()
    assert revision_of(policy) == 2
    window.save()  # saved again unchanged: no bump
    assert revision_of(policy) == 2


def test_revision_bumps_when_a_token_bucket_capacity_changes() -> None:
    policy = make_policy(algorithm="token_bucket")
    window = policy.windows.get()
    window.capacity = 3  # the same as the limit: the same bucket
    window.save()
    assert revision_of(policy) == 1
    window.capacity = 10
    window.save()
    assert revision_of(policy) == 2


def test_revision_bumps_when_a_window_is_added_or_deleted() -> None:
    policy = make_policy(windows=(("burst", 2, 60),))
    QuotaWindow.objects.create(policy=policy, name="sustained", limit=100, period=3600)
    assert revision_of(policy) == 2
    policy.windows.get(name="sustained").delete()
    assert revision_of(policy) == 3


def test_revision_bumps_on_a_queryset_delete_of_windows() -> None:
    policy = make_policy(windows=(("burst", 2, 60), ("sustained", 100, 3600)))
    QuotaWindow.objects.filter(policy=policy, name="burst").delete()
    assert revision_of(policy) == 2
    policy.windows.all().delete()  # window-less: invalid, applied by nobody meanwhile
    assert revision_of(policy) == 2
    QuotaWindow.objects.create(policy=policy, name="sustained", limit=100, period=3600)
    assert revision_of(policy) == 2  # valid again, with the meaning it had: same counters
    policy.windows.all().delete()
    QuotaWindow.objects.create(policy=policy, name="default", limit=1, period=60)
    assert revision_of(policy) == 3  # valid again with another meaning: fresh counters


def test_an_invalid_application_field_is_no_change_of_meaning() -> None:
    policy = make_policy()
    policy.methods = ["get"]  # saved past clean(): the registry skips the row meanwhile
    policy.save()
    policy.methods = ["GET"]
    policy.save()
    assert revision_of(policy) == 1


def test_a_batch_bumps_once_for_several_window_edits() -> None:
    policy = make_policy(windows=(("burst", 2, 60), ("sustained", 100, 3600)))
    with revision_batch():
        policy.algorithm = "sliding_window"
        policy.save()
        for window in policy.windows.all():
            window.limit += 1
            window.save()
        assert revision_of(policy) == 1  # decided when the batch ends
    assert revision_of(policy) == 2


def test_deleting_a_policy_deletes_its_windows() -> None:
    policy = make_policy(windows=(("burst", 2, 60), ("sustained", 100, 3600)))
    QuotaPolicy.objects.filter(pk=policy.pk).delete()
    assert not QuotaWindow.objects.exists()


# -- counters and revisions -------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, quota: Any) -> str:
    """Database policies on the memory backend or on the session's redis-server."""
    extra: dict[str, Any] = {}
    if request.param == "redis":
        extra["REDIS_URL"] = request.getfixturevalue("redis_url")
    quota(CLOCK=CLOCK, POLICY_SOURCES=["settings", "database"], **extra)
    return str(request.param)


def test_a_changed_window_starts_fresh_counters(backend: str) -> None:
    policy = make_policy(windows=(("default", 3, 3600),), selector=["ip"])
    assert [django_quota.evaluate("orders", IP).remaining for _ in range(2)] == [2, 1]
    window = policy.windows.get()
    window.limit = 5
    window.save()
    outcome = django_quota.evaluate("orders", IP)
    assert (outcome.decision, outcome.limit, outcome.remaining) == ("allowed", 5, 4)
    assert django_quota.peek("orders", IP).remaining == 4


def test_counter_keys_carry_the_integer_revision(quota: Any, redis_url: str,
                                                  redis_client: Any) -> None:
    quota(CLOCK=CLOCK, REDIS_URL=redis_url, POLICY_SOURCES=["settings", "database"])
    policy = make_policy(selector=["ip"])
    django_quota.evaluate("orders", IP)
    policy.algorithm = "sliding_window"
    policy.save()
    django_quota.evaluate("orders", IP)
    keys = sorted(key.decode() for key in redis_client.keys("quota:*"))
    counters = [key for key in keys if ":e:" not in key]
    assert [key.rsplit(":", 1)[1] for key in counters] == ["1", "2"]
    assert all(":orders:" in key for key in counters)
    assert not any("203.0.113.9" in key for key in keys)


def test_an_admin_sliding_log_policy_is_the_exact_log(backend: str) -> None:
    policy = make_policy(windows=(("default", 2, 60),), selector=["ip"], algorithm="sliding_log")
    policy.full_clean()
    assert [django_quota.evaluate("orders", IP).decision for _ in range(3)] == [
        "allowed",
        "allowed",
        "denied",
    ]
    outcome = django_quota.peek("orders", IP)
    assert (outcome.certainty, outcome.retry_after, outcome.reset_after) == ("exact", 60.0, 60.0)


def test_unchanged_meaning_keeps_the_counters(backend: str) -> None:
    policy = make_policy(selector=["ip"])
    django_quota.evaluate("orders", IP)
    policy.enforcement = "shadow"
    policy.routes = ["/api"]
    policy.save()
    assert django_quota.peek("orders", IP).remaining == 2


# -- a deleted and re-created policy --------------------------------------------------------
def exhaust(policy_id: str, count: int) -> None:
    decisions = [django_quota.evaluate(policy_id, IP).decision for _ in range(count + 1)]
    assert decisions == ["allowed"] * count + ["denied"]


def test_a_recreated_policy_starts_fresh_counters(backend: str) -> None:
    old = make_policy(windows=(("default", 5, 3600),), selector=["ip"])
    exhaust("orders", 5)
    old.delete()
    new = make_policy(windows=(("default", 100, 3600),), selector=["ip"])
    outcome = django_quota.evaluate("orders", IP)
    assert (outcome.decision, outcome.limit, outcome.remaining) == ("allowed", 100, 99)
    assert new.revision > old.revision


def test_a_policy_recreated_as_a_token_bucket_reads_fresh_tokens(backend: str) -> None:
    old = make_policy(windows=(("default", 5, 3600),), selector=["ip"])
    exhaust("orders", 5)
    old.delete()
    make_policy(windows=(("default", 5, 3600),), selector=["ip"], algorithm="token_bucket")
    assert django_quota.peek("orders", IP).remaining == 5
    outcome = django_quota.evaluate("orders", IP)
    assert (outcome.decision, outcome.limit, outcome.remaining) == ("allowed", 5, 4)


def test_revisions_are_never_reused_across_policies_and_deletes() -> None:
    seen = []
    for _ in range(3):
        policy = make_policy(selector=["ip"])
        seen.append(policy.revision)
        policy.algorithm = "sliding_window"
        policy.save()
        seen.append(revision_of(policy))
        other = make_policy("other", selector=["ip"])
        seen.append(other.revision)
        policy.delete()
        other.delete()
    assert len(set(seen)) == len(seen)
    assert seen == sorted(seen)  # drawn from one increasing sequence


def test_revisions_continue_after_the_sequence_row_is_lost() -> None:
    """A flushed database (TransactionTestCase, ``manage.py flush``) loses the sequence row
    but keeps no policy either; a surviving row's revision is never drawn again."""
    from django_quota.models import RevisionSequence

    kept = make_policy("kept", selector=["ip"])
    for _ in range(3):
        kept.algorithm = "sliding_window" if kept.algorithm == "fixed_window" else "fixed_window"
        kept.save()
    RevisionSequence.objects.all().delete()
    assert make_policy(selector=["ip"]).revision == revision_of(kept) + 1


@pytest.mark.django_db(transaction=True)
def test_the_migration_starts_the_sequence_after_the_existing_revisions() -> None:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from django_quota.models import RevisionSequence

    before = [("django_quota", "0001_initial")]
    after = [("django_quota", "0002_revisionsequence_squashed_0006_quotapolicy_count_when")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old_apps = executor.loader.project_state(before).apps
    old_apps.get_model("django_quota", "QuotaPolicy").objects.create(name="old", revision=7)
    executor = MigrationExecutor(connection)
    executor.migrate(after)
    assert RevisionSequence.objects.get().last == 7
    # The squash is the app's last migration: the tables are whole again.
    assert executor.loader.graph.leaf_nodes("django_quota") == after
    assert make_policy("newer", selector=["ip"]).revision == 8


@pytest.mark.django_db(transaction=True)
def test_a_database_migrated_by_the_replaced_files_takes_the_squash_as_applied() -> None:
    """docs/operations.md#migrations: the squash keeps ``replaces``, so a database whose
    ``django_migrations`` lists 0002 to 0006 (and not the squash) has nothing to apply,
    and ``migrate`` records the squash."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor
    from django.db.migrations.recorder import MigrationRecorder

    squash = ("django_quota", "0002_revisionsequence_squashed_0006_quotapolicy_count_when")
    replaced = [
        ("django_quota", "0002_revisionsequence"),
        ("django_quota", "0003_alter_quotapolicy_algorithm"),
        ("django_quota", "0004_quotapolicy_concurrency"),
        ("django_quota", "0005_quotaplanlimit_exempt"),
        ("django_quota", "0006_quotapolicy_count_when"),
    ]
    recorder = MigrationRecorder(connection)
    recorder.record_unapplied(*squash)
    for app, name in replaced:
        recorder.record_applied(app, name)
    try:
        executor = MigrationExecutor(connection)
        assert squash in executor.loader.applied_migrations
        leaf = executor.loader.graph.leaf_nodes("django_quota")
        assert leaf == [squash]
        assert executor.migration_plan(leaf) == []
        executor.migrate(leaf)
        assert squash in recorder.applied_migrations()
    finally:  # the test database as the other tests expect it: the squash alone
        for app, name in replaced:
            recorder.record_unapplied(app, name)
        recorder.record_applied(*squash)
    assert not set(replaced) & set(recorder.applied_migrations())
