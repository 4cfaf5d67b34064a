"""The in-flight bound of one node (``django_quota.core.admission.Slots``): its fast path
takes the lock the waiting path's condition shares, so a release still wakes a waiter.
And one call through a node's guard: its slot given back however it ends, its breaker
told only of a backend's failures."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import cast

import pytest

from django_quota import conf
from django_quota.backends import Backend
from django_quota.core.admission import Refused, Slots
from django_quota.core.errors import BackendError
from django_quota.core.outcome import BACKEND_MODE_REDIS, BACKEND_UNAVAILABLE
from django_quota.engine import Limiter, Sizes


def test_a_full_node_refuses_after_the_timeout_and_admits_again_after_a_release() -> None:
    slots = Slots(2)
    assert slots.acquire(0.0) and slots.acquire(0.0)
    assert slots.in_use == 2
    started = time.monotonic()
    assert slots.acquire(0.05) is False
    assert time.monotonic() - started >= 0.05
    assert slots.try_acquire() is False
    slots.release()
    assert slots.in_use == 1
    assert slots.try_acquire() is True
    assert slots.in_use == 2


def test_a_release_wakes_a_thread_waiting_for_a_slot() -> None:
    slots = Slots(1)
    assert slots.acquire(0.0)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(10.0)))
    waiter.start()
    deadline = time.monotonic() + 5.0
    while slots._waiting == 0 and time.monotonic() < deadline:  # the waiter is inside wait
        time.sleep(0.001)
    assert slots._waiting == 1
    started = time.monotonic()
    slots.release()
    waiter.join(5.0)
    assert got == [True]
    assert time.monotonic() - started < 5.0  # woken by the release, not by its timeout
    assert slots.in_use == 1 and slots._waiting == 0


# -- one call through a node's guard (Limiter.execute / aexecute) ----------------------------
class _Node:
    """A backend of one node that answers every call with ``reply``, or raises it."""

    mode = BACKEND_MODE_REDIS

    def __init__(self, reply: object) -> None:
        self.reply = reply

    def node_of(self, call: object) -> str:
        return "default"

    def run(self, call: object, deadline: float | None = None) -> object:
        if isinstance(self.reply, BaseException):
            raise self.reply
        return self.reply

    async def arun(self, call: object, deadline: float | None = None) -> object:
        return self.run(call, deadline)


def _limiter(reply: object) -> Limiter:
    parsed, problems = conf.parse_settings(
        {"REDIS_URL": "redis://admission.invalid:6379/0", "HMAC_KEY": "tests-hmac-key-0123456789",
         "MAX_INFLIGHT": 1},
        secret_key="tests",
        with_policies=False,
    )
    assert problems == [] and parsed is not None
    return Limiter(parsed, cast(Backend, _Node(reply)))


def test_an_answered_call_gives_its_slot_back_and_returns_the_reply() -> None:
    limiter = _limiter(b"reply")
    assert limiter.execute(("EVALSHA",), time.monotonic()) == b"reply"
    assert asyncio.run(limiter.aexecute(("EVALSHA",), time.monotonic())) == b"reply"
    guard = limiter.guard()
    assert guard.slots.in_use == 0 and guard.breaker.state == "closed"


def test_node_failures_give_their_slots_back_and_open_the_breaker() -> None:
    limiter = _limiter(BackendError(BACKEND_UNAVAILABLE, "connection refused"))
    for _ in range(Sizes.BREAKER_THRESHOLD):
        with pytest.raises(BackendError, match="connection refused"):
            limiter.execute(("EVALSHA",), time.monotonic())
        assert limiter.guard().slots.in_use == 0
    assert limiter.guard().breaker.state == "open"
    with pytest.raises(Refused, match="circuit breaker open"):
        asyncio.run(limiter.aexecute(("EVALSHA",), time.monotonic()))
    assert limiter.guard().slots.in_use == 0


def test_a_call_raising_no_backend_error_gives_back_its_slot_and_tells_breaker_nothing() -> None:
    limiter = _limiter(RuntimeError("a bug"))
    for _ in range(Sizes.BREAKER_THRESHOLD + 1):
        with pytest.raises(RuntimeError, match="a bug"):
            limiter.execute(("EVALSHA",), time.monotonic())
    guard = limiter.guard()
    assert guard.slots.in_use == 0 and guard.breaker.state == "closed"
    assert list(limiter.recent_errors) == []


def test_a_cancelled_async_call_gives_its_slot_back() -> None:
    limiter = _limiter(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(limiter.aexecute(("EVALSHA",), time.monotonic()))
    assert limiter.guard().slots.in_use == 0
