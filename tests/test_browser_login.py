"""Login protection in a real browser (docs/login.md): headless Chromium against a live
server signs in through the admin login and Django's ``LoginView``. Five wrong passwords
at 5/15m, then the sixth attempt and the right password are both refused with the 429
problem document, and the browser is not signed in. A missing browser skips the test
locally and fails it in CI, as in tests/test_browser.py."""

from __future__ import annotations

import json
import tempfile
from typing import Any

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.views import LoginView
from django.contrib.staticfiles.testing import StaticLiveServerTestCase
from django.http import HttpResponse
from django.test import override_settings
from django.urls import path

from tests.test_browser import CHROMIUM_FLAGS, _browser, _unavailable

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
class LoginProtectionInABrowser(StaticLiveServerTestCase):
    """The admin login and ``LoginView`` refuse an exhausted username with 429."""

    driver: Any
    profile: tempfile.TemporaryDirectory[str]

    @classmethod
    def setUpClass(cls) -> None:
        try:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service
        except ImportError:
            _unavailable("selenium is not installed (pip install -e '.[test]')")
        binary, driver = _browser()
        super().setUpClass()
        cls.profile = tempfile.TemporaryDirectory(prefix="quota-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={cls.profile.name}"):
            options.add_argument(flag)
        try:
            cls.driver = webdriver.Chrome(service=Service(executable_path=driver), options=options)
        except BaseException:
            cls.profile.cleanup()
            super().tearDownClass()
            raise
        cls.driver.implicitly_wait(5)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.driver.quit()
        cls.profile.cleanup()
        super().tearDownClass()

    def setUp(self) -> None:
        users = get_user_model().objects
        users.create_superuser("operator", "ops@example.com", PASSWORD)
        users.create_user("carol", "carol@example.com", PASSWORD)
        self.driver.delete_all_cookies()

    # -- helpers -------------------------------------------------------------------------
    def text(self) -> str:
        from selenium.webdriver.common.by import By

        return str(self.driver.find_element(By.TAG_NAME, "body").text)

    def attempt(self, url: str, username: str, password: str) -> str:
        """Fill the login form at ``url`` and submit it; the next page's text."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver.get(f"{self.live_server_url}{url}")
        for name, value in (("username", username), ("password", password)):
            field = self.driver.find_element(By.NAME, name)
            field.clear()
            field.send_keys(value)
        body = self.driver.find_element(By.TAG_NAME, "body")
        self.driver.find_element(By.NAME, "password").submit()
        WebDriverWait(self.driver, 10).until(expected_conditions.staleness_of(body))
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
