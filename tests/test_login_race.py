"""Login protection under concurrency (docs/login.md): the backend charges the attempt
before any password is checked, so 20 simultaneous wrong-password attempts against a
fresh username at 2/15m check at most 2 passwords, and the rest answer 429; a success
is refunded, so it costs nothing. Against a real Redis."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.contrib.auth import authenticate
from django.test import Client

import django_quota
from django_quota.auth import BACKEND_PATH
from tests.test_login import PASSWORD, CountingBackend
from tests.test_middleware import CLOCK

pytestmark = [pytest.mark.urls("tests.test_login"), pytest.mark.django_db(transaction=True)]

IP = "203.0.113.61"


class SlowCountingBackend(CountingBackend):
    """A password check that takes a while (as a real hasher does), counted."""

    lock = threading.Lock()

    def authenticate(
        self, request: Any, username: Any = None, password: Any = None, **kw: Any
    ) -> Any:
        with self.lock:
            type(self).calls += 1
        time.sleep(0.05)  # widens the window in which concurrent attempts overlap
        return super(CountingBackend, self).authenticate(
            request, username=username, password=password, **kw
        )


@pytest.fixture
def protected(quota: Any, settings: Any, django_user_model: Any, redis_url: str) -> Any:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "tests.test_login_race.SlowCountingBackend"]
    quota(
        REDIS_URL=redis_url,
        TIMEOUT=2.0,  # roomy: the test pins how many passwords are checked, not latency
        DEADLINE=5.0,
        CLOCK=CLOCK,
        LOGIN_POLICIES=["login-user"],
        POLICIES={"login-user": {"windows": "2/15m", "selector": ["user"]}},
    )
    SlowCountingBackend.calls = 0
    user = django_user_model.objects.create_user("fiona", password=PASSWORD)
    yield user
    django_quota.reset("login-user", {"user": "fresh"})
    django_quota.reset("login-user", {"user": "fiona"})


def test_twenty_parallel_attempts_check_at_most_the_limits_passwords(protected: Any) -> None:
    codes: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(20)

    def attempt() -> None:
        client = Client()
        start.wait()
        response = client.post(
            "/login/", {"username": "fresh", "password": "wrong"}, REMOTE_ADDR=IP
        )
        with lock:
            codes.append(response.status_code)

    threads = [threading.Thread(target=attempt) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert SlowCountingBackend.calls <= 2
    assert codes.count(429) == 20 - SlowCountingBackend.calls >= 18
    assert codes.count(200) == SlowCountingBackend.calls  # the form, "wrong password"
    assert django_quota.peek("login-user", {"user": "fresh"}).remaining == 0


def test_a_successful_login_costs_nothing(protected: Any) -> None:
    assert authenticate(username="fiona", password="wrong") is None
    before = django_quota.peek("login-user", {"user": "fiona"})
    assert before.remaining == 1
    for _ in range(2):
        assert authenticate(username="fiona", password=PASSWORD) == protected
        response = Client().post(
            "/login/", {"username": "fiona", "password": PASSWORD}, REMOTE_ADDR=IP
        )
        assert response.status_code == 302
    after = django_quota.peek("login-user", {"user": "fiona"})
    assert (after.remaining, after.reset_after) == (before.remaining, before.reset_after)
    assert SlowCountingBackend.calls == 5  # the password was checked once per attempt
