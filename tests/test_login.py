"""Login protection (docs/login.md): ``QuotaLoginBackend`` first in
``AUTHENTICATION_BACKENDS`` and ``QUOTA["LOGIN_POLICIES"]``. Failed logins charge; an
exhausted username or address is refused, with 429 and ``Retry-After``, before any
password is checked (the next backend's calls are counted), by Django's ``LoginView``,
the admin login and DRF's ``obtain_auth_token``; a success charges and resets nothing."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import authenticate
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.views import LoginView
from django.core.checks import run_checks
from django.http import HttpResponse
from django.test import Client
from django.urls import path
from rest_framework.authtoken.views import obtain_auth_token

import django_quota
from django_quota import metrics
from django_quota.auth import BACKEND_PATH
from tests.test_middleware import CLOCK, FROZEN_NOW

pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

urlpatterns = [
    path("login/", LoginView.as_view(template_name="admin/login.html")),
    path("admin/", admin.site.urls),
    path("api-token-auth/", obtain_auth_token),
    path("home/", lambda request: HttpResponse("home")),
    path("whoami/", lambda request: HttpResponse(request.user.get_username() or "anonymous")),
]

IP = "203.0.113.60"
PASSWORD = "correct horse battery staple"
USER_POLICY = {"algorithm": "fixed_window", "windows": "5/15m", "selector": ["user"]}
IP_POLICY = {"algorithm": "fixed_window", "windows": "8/15m", "selector": ["ip"]}


class CountingBackend(ModelBackend):
    """Django's password check, counting its calls."""

    calls = 0

    def authenticate(
        self, request: Any, username: Any = None, password: Any = None, **kw: Any
    ) -> Any:
        type(self).calls += 1
        return super().authenticate(request, username=username, password=password, **kw)


@pytest.fixture(autouse=True)
def fast_hashes(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def protected(quota: Any, settings: Any, django_user_model: Any) -> Any:
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "tests.test_login.CountingBackend"]
    quota(
        CLOCK=CLOCK,
        LOGIN_POLICIES=["login-user", "login-ip"],
        POLICIES={"login-user": USER_POLICY, "login-ip": IP_POLICY},
    )
    CountingBackend.calls = 0
    return django_user_model.objects.create_user(
        "fiona", password=PASSWORD, is_staff=True, is_superuser=True
    )


def post(client: Client, url: str, username: str, password: str) -> Any:
    return client.post(url, {"username": username, "password": password}, REMOTE_ADDR=IP)


def refused(response: Any) -> bool:
    if response.status_code != 429:
        return False
    body = json.loads(response.content)
    assert body["policy"] == "login-user"
    assert body["reason"] == "default_quota_exhausted"
    # Until the 15-minute window of the frozen clock ends (39.6 s), rounded up.
    assert response["Retry-After"] == str(math.ceil(900 - FROZEN_NOW % 900)) == "40"
    return True


@pytest.mark.parametrize("url", ["/login/", "/admin/login/"])
def test_six_failures_then_the_right_password_is_still_429(protected: Any, url: str) -> None:
    client = Client()
    answers = [post(client, url, "fiona", "wrong") for _ in range(6)]
    assert [r.status_code for r in answers[:5]] == [200] * 5  # the form's error
    assert refused(answers[5])
    assert CountingBackend.calls == 5
    right = post(client, url, "fiona", PASSWORD)
    assert refused(right)
    assert CountingBackend.calls == 5  # no password was checked while refused
    assert "_auth_user_id" not in client.session
    # The refusals charged nothing more: 5 of 5 used.
    assert django_quota.peek("login-user", {"user": "fiona"}).remaining == 0
    assert django_quota.peek("login-ip", {"ip": IP}).remaining == 3


def test_attempts_without_a_request_are_charged_once_each(protected: Any) -> None:
    """``authenticate(request=None)``: the backend charges each failed attempt and the
    ``user_login_failed`` receiver charges it no second time; a refused attempt charges
    nothing and checks no password."""
    for remaining in (4, 3, 2, 1, 0):
        assert authenticate(None, username="fiona", password="wrong") is None
        assert django_quota.peek("login-user", {"user": "fiona"}).remaining == remaining
    assert authenticate(None, username="fiona", password=PASSWORD) is None  # refused
    assert CountingBackend.calls == 5
    assert django_quota.peek("login-user", {"user": "fiona"}).remaining == 0


def test_force_login_with_the_backend_first_signs_the_user_in(protected: Any) -> None:
    """The test client's ``force_login`` (and ``login()`` without a backend) records the
    first backend, ``QuotaLoginBackend``, in the session: its ``get_user`` must still
    find the user (it asks the backends after it), or every such session is anonymous."""
    client = Client()
    client.force_login(protected)
    assert client.get("/whoami/").content == b"fiona"


def test_quota_reset_by_username_unlocks(protected: Any) -> None:
    from io import StringIO

    from django.core.management import call_command

    client = Client()
    for _ in range(6):
        post(client, "/login/", "fiona", "wrong")
    assert refused(post(client, "/login/", "fiona", PASSWORD))
    err = StringIO()
    call_command("quota", "reset", "login-user", "--user", "fiona", "--yes", stderr=err)
    assert "--user is a username" in err.getvalue()
    assert post(client, "/login/", "fiona", PASSWORD).status_code == 302


def test_drf_obtain_auth_token_answers_429(protected: Any) -> None:
    client = Client()
    answers = [post(client, "/api-token-auth/", "fiona", "wrong") for _ in range(6)]
    assert [r.status_code for r in answers[:5]] == [400] * 5
    assert refused(answers[5])
    assert refused(post(client, "/api-token-auth/", "fiona", PASSWORD))
    assert CountingBackend.calls == 5


def test_a_success_charges_and_resets_nothing(protected: Any) -> None:
    client = Client()
    for _ in range(3):
        post(client, "/login/", "fiona", "wrong")
    response = post(client, "/login/", "fiona", PASSWORD)
    assert response.status_code == 302
    assert client.session["_auth_user_id"] == str(protected.pk)
    assert django_quota.peek("login-user", {"user": "fiona"}).remaining == 2
    assert django_quota.peek("login-ip", {"ip": IP}).remaining == 5


def test_the_address_policy_counts_every_username(protected: Any) -> None:
    client = Client()
    names = [f"guess{n}" for n in range(9)]
    answers = [post(client, "/login/", name, "wrong") for name in names]
    assert [r.status_code for r in answers] == [200] * 8 + [429]
    assert json.loads(answers[-1].content)["policy"] == "login-ip"
    # Another address may still sign in.
    other = Client().post(
        "/login/", {"username": "fiona", "password": PASSWORD}, REMOTE_ADDR="198.51.100.1"
    )
    assert other.status_code == 302


def test_usernames_are_normalised_as_the_user_model_does(protected: Any) -> None:
    client = Client()
    for _ in range(5):
        post(client, "/login/", "\ufb01ona", "wrong")  # "ﬁona": NFKC gives "fiona"
    assert refused(post(client, "/login/", "fiona", PASSWORD))


@pytest.mark.parametrize("variant", ["Fiona", "FIONA", " fiona ", "\uff26iona"])
def test_a_username_in_another_case_shares_the_counter(protected: Any, variant: str) -> None:
    """A login that ignores case (an e-mail address, a case-insensitive user model) must
    not give an attacker five more attempts per spelling: the count is case-folded."""
    client = Client()
    for _ in range(3):
        post(client, "/login/", "fiona", "wrong")
    for _ in range(2):
        post(client, "/login/", variant, "wrong")
    assert django_quota.peek("login-user", {"user": "fiona"}).remaining == 0
    assert refused(post(client, "/login/", "fiona", PASSWORD))
    assert refused(post(client, "/login/", variant.upper(), "wrong"))
    assert CountingBackend.calls == 5


def test_submitted_usernames_are_case_folded_and_stripped() -> None:
    from django_quota.auth import submitted_username

    assert submitted_username({"username": "Fiona@Example.COM"}) == "fiona@example.com"
    assert submitted_username({"username": "STRASSE"}) == submitted_username(
        {"username": "stra\u00dfe"}
    )
    assert submitted_username({"username": "   "}) is None


def test_without_a_request_the_username_policy_still_applies(protected: Any) -> None:
    for _ in range(5):
        assert authenticate(username="fiona", password="wrong") is None
    assert CountingBackend.calls == 5
    assert authenticate(username="fiona", password=PASSWORD) is None
    assert CountingBackend.calls == 5
    assert django_quota.peek("login-user", {"user": "fiona"}).remaining == 0


def test_refusals_and_failures_are_counted(protected: Any) -> None:
    before = dict(metrics.outcome_counts())
    client = Client()
    for _ in range(7):
        post(client, "/login/", "fiona", "wrong")
    after = metrics.outcome_counts()

    def delta(key: tuple[str, str, str]) -> int:
        return after.get(key, 0) - before.get(key, 0)

    assert delta(("login-user", "allowed", "")) == 5
    assert delta(("login-user", "denied", "default_quota_exhausted")) == 2


def test_nothing_happens_without_login_policies(
    quota: Any, settings: Any, django_user_model: Any
) -> None:
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "tests.test_login.CountingBackend"]
    quota(CLOCK=CLOCK, POLICIES={"login-user": USER_POLICY})
    django_user_model.objects.create_user("fiona", password=PASSWORD)
    client = Client()
    assert [post(client, "/login/", "fiona", "wrong").status_code for _ in range(7)] == [200] * 7
    assert django_quota.peek("login-user", {"user": "fiona"}).remaining == 5


# -- checks ----------------------------------------------------------------------------------
def quota_errors() -> list[tuple[str, str]]:
    return [
        (m.id, m.msg)
        for m in run_checks()
        if m.id and m.id.startswith("django_quota.E")
    ]


def test_e014_the_backend_missing_or_not_first(quota: Any, settings: Any) -> None:
    quota(LOGIN_POLICIES=["login-user"], POLICIES={"login-user": USER_POLICY})
    settings.AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend"]
    ((check, text),) = quota_errors()
    assert check == "django_quota.E014" and "is missing in AUTHENTICATION_BACKENDS" in text
    settings.AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend", BACKEND_PATH]
    ((check, text),) = quota_errors()
    assert check == "django_quota.E014" and "is not first in AUTHENTICATION_BACKENDS" in text
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "django.contrib.auth.backends.ModelBackend"]
    assert quota_errors() == []
    quota(POLICIES={"login-user": USER_POLICY})  # no LOGIN_POLICIES: nothing to protect
    settings.AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend"]
    assert quota_errors() == []


def test_e014_a_login_selector_beyond_user_and_ip(quota: Any, settings: Any) -> None:
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "django.contrib.auth.backends.ModelBackend"]
    quota(
        LOGIN_POLICIES=["login-any"],
        POLICIES={"login-any": {"windows": "5/m", "selector": ["auto"]}},
    )
    ((check, text),) = quota_errors()
    assert check == "django_quota.E014" and "'login-any'" in text


def test_e014_without_the_middleware(quota: Any, settings: Any) -> None:
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "django.contrib.auth.backends.ModelBackend"]
    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if "QuotaMiddleware" not in m]
    quota(LOGIN_POLICIES=["login-user"], POLICIES={"login-user": USER_POLICY})
    ((check, text),) = quota_errors()
    assert check == "django_quota.E014" and "QuotaMiddleware is not in MIDDLEWARE" in text


def test_e009_an_undefined_login_policy(quota: Any, settings: Any) -> None:
    settings.AUTHENTICATION_BACKENDS = [BACKEND_PATH, "django.contrib.auth.backends.ModelBackend"]
    quota(LOGIN_POLICIES=["nowhere"])
    ((check, text),) = quota_errors()
    assert check == "django_quota.E009" and "'nowhere'" in text


@pytest.mark.django_db(transaction=True)
def test_an_async_stack_holding_a_lease_still_answers_429(
    protected: Any, quota: Any, settings: Any
) -> None:
    """Under ASGI, a login refused while the route's concurrency policy holds a lease is
    a 429 too, and the lease is released."""
    import asyncio

    from django.test import AsyncClient

    from django_quota.middleware import QuotaMiddleware

    quota(
        CLOCK=CLOCK,
        LOGIN_POLICIES=["login-user", "login-ip"],
        POLICIES={
            "login-user": USER_POLICY,
            "login-ip": IP_POLICY,
            "inflight": {
                "algorithm": "concurrency",
                "windows": "10/m",
                "selector": ["ip"],
                "routes": ["/login"],
            },
        },
    )
    seen_async: list[bool] = []
    original = QuotaMiddleware.__acall__

    async def spying(self: Any, request: Any) -> Any:
        seen_async.append(True)
        return await original(self, request)

    QuotaMiddleware.__acall__ = spying  # type: ignore[method-assign]
    try:

        async def scenario() -> list[Any]:
            client = AsyncClient()
            form = {"username": "fiona", "password": "wrong"}
            return [await client.post("/login/", form) for _ in range(6)]

        answers = asyncio.run(scenario())
    finally:
        QuotaMiddleware.__acall__ = original  # type: ignore[method-assign]
    assert seen_async, "the middleware ran its async path"
    assert [r.status_code for r in answers] == [200] * 5 + [429]
    assert refused(answers[5])
    assert CountingBackend.calls == 5
    assert django_quota.peek("inflight", {"ip": "127.0.0.1"}).remaining == 10
