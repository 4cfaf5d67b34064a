"""The in-flight bound of one node (``django_quota.core.admission.Slots``): its fast path
takes the lock the waiting path's condition shares, so a release still wakes a waiter."""

from __future__ import annotations

import threading
import time

from django_quota.core.admission import Slots


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
