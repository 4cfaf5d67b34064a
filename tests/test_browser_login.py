"""Login protection in a real browser (docs/login.md): headless Chromium against a live
server signs in through the admin login and Django's ``LoginView``. Five wrong passwords
at 5/15m, then the sixth attempt and the right password are both refused with the 429
problem document, and the browser is not signed in. A missing browser skips the test
locally and fails it in CI, as every test of tests/browser.py's harness."""

from __future__ import annotations

import json

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.views import LoginView
from django.http import HttpResponse
from django.test import override_settings
from django.urls import path

from tests import browser

PASSWORD = "correct horse battery staple"
QUOTA = {
    "HMAC_KEY": "tests-hmac-key-0123456789",
    "POLICY_SOURCES": ["settings"],
    "CLOCK": "tests.test_middleware.frozen_clock",  # no window rolls over mid-test
    "LOGIN_POLICIES": ["login-user"],
    "POLICIES": {"login-user": {"windows": "5/15m", "selector": ["user"]}},
}

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/login/", LoginView.as_view(template_name="admin/login.html")),
    path("home/", lambda request: HttpResponse("home")),
]


@override_settings(
    QUOTA=QUOTA,
    ROOT_URLCONF=__name__,
    STATIC_URL="/static/",
    DEBUG=True,
    LOGIN_REDIRECT_URL="/home/",
    AUTHENTICATION_BACKENDS=[
        "django_quota.auth.QuotaLoginBackend",
        "django.contrib.auth.backends.ModelBackend",
    ],
    PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
)
class LoginProtectionInABrowser(browser.BrowserTestCase):
    """The admin login and ``LoginView`` refuse an exhausted username with 429."""

    def setUp(self) -> None:
        users = get_user_model().objects
        users.create_superuser("operator", "ops@example.com", PASSWORD)
        users.create_user("carol", "carol@example.com", PASSWORD)
        self.driver.delete_all_cookies()

    # -- helpers -------------------------------------------------------------------------
    def attempt(self, url: str, username: str, password: str) -> str:
        """Fill the login form at ``url`` and submit it; the next page's text."""
        self.open(url)
        self.fill("username", username)
        self.fill("password", password)
        self.submit(self.field("password"))
        return self.text()

    def assert_refused(self, page: str) -> None:
        problem = json.loads(page)
        self.assertEqual(
            (problem["status"], problem["title"], problem["policy"]),
            (429, "Quota exceeded", "login-user"),
        )

    def check(self, url: str, username: str) -> None:
        for _ in range(5):
            # The form's own error: "Please enter a (the) correct username and password".
            self.assertIn("correct username and password", self.attempt(url, username, "wrong"))
        self.assert_refused(self.attempt(url, username, "wrong"))
        self.assert_refused(self.attempt(url, username, PASSWORD))
        cookies = {cookie["name"] for cookie in self.driver.get_cookies()}
        self.assertNotIn("sessionid", cookies)

    # -- the tests -----------------------------------------------------------------------
    def test_the_admin_login_refuses_an_exhausted_username(self) -> None:
        self.check("/admin/login/?next=/admin/", "operator")

    def test_loginview_refuses_an_exhausted_username(self) -> None:
        self.check("/accounts/login/", "carol")
        # Another account still signs in from the same browser.
        self.attempt("/accounts/login/", "operator", PASSWORD)
        self.assertEqual(self.text(), "home")
