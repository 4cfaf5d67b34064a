"""``evaluate()`` on the memory backend decides the common call without a group, a
request or a reply (``Limiter.shortcut``, docs/architecture.md): held here to
the same outcomes and outcome counts as ``prepare`` and ``run`` over random sequences of
every algorithm and cost, and it leaves every other call to them."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from django_quota import conf, metrics
from django_quota.backends.memory import MemoryBackend
from django_quota.core.outcome import BACKEND_UNAVAILABLE, Outcome
from django_quota.core.policy import Policy
from django_quota.engine import Limiter
from tests.differential import prepared_costs

POLICIES = {
    "fixed": {"algorithm": "fixed_window", "windows": "4/m", "selector": ["ip"]},
    "sliding": {"algorithm": "sliding_window", "windows": "4/m", "selector": ["ip"]},
    "bucket": {"algorithm": "token_bucket", "windows": "4/m", "capacity": 6, "selector": ["ip"]},
    "shadow": {"windows": "2/m", "selector": ["ip"], "enforcement": "shadow"},
    "capped": {"windows": "9/m", "selector": ["ip"], "max_cost": 2},
    # Not the common call: left to prepare and run.
    "log": {"algorithm": "sliding_log", "windows": "3/s", "selector": ["ip"]},
    "two": {"windows": {"burst": "2/s", "sustained": "5/m"}, "selector": ["ip"]},
    "lease": {"algorithm": "concurrency", "windows": "2/m", "selector": ["ip"]},
    "user": {"windows": "3/s", "selector": ["user"]},
}
SHORT = {"fixed", "sliding", "bucket", "shadow", "capped"}
#: A calendar window: its boundaries follow this machine's clock, not the test's.
CALENDAR = {"month": {"windows": "6/month", "selector": ["ip"]}}


class Clock:
    """The memory backends' wall clock (ms), moved by the test."""

    def __init__(self) -> None:
        self.now = 1_764_806_400_000

    def __call__(self) -> int:
        return self.now


def _limiter(clock: Clock, max_entries: int = 10**6, **values: Any) -> Limiter:
    parsed, problems = conf.parse_settings(
        {
            "HMAC_KEY": "tests-hmac-key-0123456789",
            "BACKEND": "memory",
            "POLICIES": {**POLICIES, **CALENDAR},
            **values,
        },
        secret_key="tests",
    )
    assert problems == [] and parsed is not None
    return Limiter(parsed, MemoryBackend(max_entries, clock_ms=clock))


def _counts() -> dict[Any, float]:
    return {key: counted[0] for key, counted in metrics._counts.outcomes.items()}


def _delta(before: dict[Any, float]) -> dict[Any, float]:
    return {
        key: count - before.get(key, 0)
        for key, count in _counts().items()
        if count != before.get(key, 0)
    }


def _same(outcome: Outcome) -> Outcome:
    """``outcome`` with whether it has an evaluation id for its id (a random one is
    given to the groups whose charge the edges undo by it)."""
    return dataclasses.replace(outcome, evaluation_id=str(bool(outcome.evaluation_id)))


def _general(engine: Limiter, policy: Policy, subject: Any, cost: Any) -> Outcome:
    return engine.run(engine.prepare([policy], subject, cost))[0]


def _as_evaluate(engine: Limiter, policy: Policy, subject: Any, cost: Any) -> tuple[Outcome, bool]:
    """What ``evaluate()`` does on the memory backend, and whether it took the short path."""
    found = engine.shortcut(policy, subject, cost, None, None)
    if found is not None:
        return found, True
    return _general(engine, policy, subject, cost), False


@pytest.mark.parametrize("seed", range(6))
def test_the_short_path_gives_the_outcomes_and_counts_of_prepare_and_run(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    short, general = _limiter(clock), _limiter(clock)
    subjects = [{"ip": "203.0.113.1"}, {"ip": "203.0.113.2"}, {"ip": "not an ip"}, {}]
    taken = set()
    for _ in range(600):
        clock.now += 40_000 if rng.random() < 0.01 else rng.choice([0, 0, 1, 5, 30, 120, 999])
        policy_id = rng.choice(sorted(POLICIES))
        subject = rng.choice(subjects)
        cost = rng.choice([0, 1, 1, 1, 2, 3, 7])
        before = _counts()
        got, took_short = _as_evaluate(short, short.settings.policies[policy_id], subject, cost)
        counted = _delta(before)
        before = _counts()
        want = _general(general, general.settings.policies[policy_id], subject, cost)
        assert (_same(got), counted) == (_same(want), _delta(before)), (policy_id, subject, cost)
        if took_short:
            assert policy_id in SHORT and cost > 0 and got.decision != "skipped"
            taken.add(got.decision)
    assert taken == {"allowed", "denied", "shadow_denied"}


def test_a_full_backend_is_left_to_run_which_fails_it_and_says_why() -> None:
    clock = Clock()
    engine = _limiter(clock, max_entries=1)
    policy = engine.settings.policies["fixed"]
    assert _as_evaluate(engine, policy, {"ip": "203.0.113.1"}, 1)[0].decision == "allowed"
    outcome, took_short = _as_evaluate(engine, policy, {"ip": "203.0.113.2"}, 1)
    assert not took_short
    assert (outcome.decision, outcome.reason) == ("failed_closed", BACKEND_UNAVAILABLE)
    assert [error.reason for error in engine.recent_errors] == [BACKEND_UNAVAILABLE]


def test_a_client_clock_an_evaluation_id_or_a_plan_takes_prepare_and_run() -> None:
    clock = Clock()
    client = _limiter(clock, CLOCK="client")
    subject = {"ip": "203.0.113.1"}
    fixed = client.settings.policies["fixed"]
    assert client.shortcut(fixed, subject, 1, None, None) is None
    engine = _limiter(clock)
    fixed = engine.settings.policies["fixed"]
    assert engine.shortcut(fixed, subject, 1, "order-1", None) is None
    assert engine.shortcut(fixed, subject, 1, None, "gold") is None
    assert engine.shortcut(fixed, subject, True, None, None) is None
    month = engine.settings.policies["month"]
    assert engine.shortcut(month, subject, 1, None, None) is None
    assert engine.shortcut(fixed, subject, 1, None, None) is not None


def test_evaluate_and_aevaluate_take_it_on_the_memory_backend(
    quota: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    import django_quota

    quota(BACKEND="memory", POLICIES={"p": {"windows": "2/h", "selector": ["ip"]}})
    prepared = prepared_costs(monkeypatch)
    first = django_quota.evaluate("p", {"ip": "203.0.113.1"})
    second = asyncio.run(django_quota.aevaluate("p", {"ip": "203.0.113.1"}))
    assert prepared == []
    third = django_quota.evaluate("p", {"ip": "203.0.113.1"}, cost=0)  # a peek
    fourth = django_quota.evaluate("p", {"ip": "203.0.113.1"}, evaluation_id="order-1")
    assert prepared == [0, 1]
    assert [o.remaining for o in (first, second, third, fourth)] == [1, 0, 0, 0]
    assert fourth.decision == "denied" and first.backend_mode == "memory"
