"""Refunds, model against script (docs/refunds.md): random sequences of charges of
several costs, refunds (of what the ledger recorded, or capped; some twice, some of ids
the bounded ledger dropped, some measured by an edge)
and clock steps give identical numbers on the memory model, fakeredis and a real
redis-server, for every algorithm."""

from __future__ import annotations

import random
from typing import Any

import fakeredis
import pytest

import django_quota
from django_quota import limiter, policies
from django_quota.backends.redis import RedisBackend
from tests import clock

START = 1_764_000_000.0
SUBJECT = {"ip": "198.51.100.77"}
POLICIES = {
    "fixed_window": {"algorithm": "fixed_window", "windows": {"a": "7/10s", "b": "20/m"}},
    "sliding_window": {"algorithm": "sliding_window", "windows": "7/10s"},
    "sliding_log": {"algorithm": "sliding_log", "windows": {"a": "7/10s", "b": "20/m"}},
    "token_bucket": {"algorithm": "token_bucket", "windows": "7/10s", "capacity": 9},
    "calendar": {"algorithm": "fixed_window", "windows": "30/d"},
}


def run(seed: int, policy: str) -> list[Any]:
    """The numbers of a random sequence on the configured backend."""
    rng = random.Random(seed)
    clock.set_to(START)
    django_quota.reset(policy, SUBJECT)
    seen: list[Any] = []
    charged: list[tuple[str, int]] = []
    for step in range(120):
        action = rng.random()
        if action < 0.5:
            cost = rng.choice((1, 1, 1, 2, 3, 5))
            evaluation_id = f"e{step}"
            outcome = django_quota.evaluate(policy, SUBJECT, cost, evaluation_id=evaluation_id)
            seen.append(("evaluate", outcome.decision, outcome.remaining, outcome.windows))
            if outcome.decision == "allowed":
                charged.append((evaluation_id, cost))
        elif action < 0.8 and charged:
            evaluation_id, cost = rng.choice(charged)
            if rng.random() < 0.2:  # an edge's measured refund
                request = limiter.refund_request(
                    policies.get_policy(policy), SUBJECT, evaluation_id, cost,
                    since_ms=rng.randrange(0, 3000),
                )
                seen.append(("measured", limiter.refund_charge(request)))
            elif rng.random() < 0.3:  # at most some units: a partial refund, or all
                cap = rng.choice((1, 2, 6))
                refunded = django_quota.refund(policy, SUBJECT, evaluation_id, cost=cap)
                seen.append(("capped", refunded))
            else:  # what the ledger says it charged
                seen.append(("refund", django_quota.refund(policy, SUBJECT, evaluation_id)))
        else:
            clock.set_to(clock.current + rng.choice((0.001, 0.25, 1, 3, 9.999, 10, 31)))
        peeked = django_quota.peek(policy, SUBJECT)
        seen.append(("peek", peeked.remaining, peeked.reset_after, peeked.windows))
    return seen


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_model_and_the_script_refund_alike(
    quota: Any, monkeypatch: pytest.MonkeyPatch, redis_url: str, policy: str, seed: int
) -> None:
    definitions = {name: {**p, "selector": ["ip"]} for name, p in POLICIES.items()}
    common = {"CLOCK": "tests.clock.now", "POLICIES": definitions}
    quota(BACKEND="memory", **common)
    model = run(seed, policy)
    quota(REDIS_URL=redis_url, TIMEOUT=2.0, DEADLINE=5.0, **common)
    assert run(seed, policy) == model
    server = fakeredis.FakeServer()
    original = limiter.backend_from_settings

    def build(settings: Any) -> Any:
        if settings.backend == "redis":
            return RedisBackend(
                url=None, timeout=1.0, max_inflight=8,
                client_factory=lambda asynchronous: (
                    fakeredis.FakeAsyncRedis(server=server) if asynchronous
                    else fakeredis.FakeRedis(server=server)
                ),
            )
        return original(settings)

    monkeypatch.setattr(limiter, "backend_from_settings", build)
    quota(REDIS_URL="redis://fakeredis.invalid:6379/0", **common)
    assert run(seed, policy) == model
    assert any(step[0] in ("refund", "measured") and step[1] for step in model)
