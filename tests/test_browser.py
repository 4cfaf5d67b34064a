"""The operator's surface in a real browser: headless Chromium driven by Selenium against a
live server (``tests/browser.py``; static files served, so the admin's JavaScript adds
inline rows).

A staff user logs in, adds a policy with two inline windows, the test requests the API
over HTTP until it is refused, then opens the status page and saves a screenshot to
``test-artifacts/status-page.png``. A missing browser skips the test locally and fails it
in CI (``CI=true``)."""

from __future__ import annotations

import os
from pathlib import Path

from django.contrib.auth import get_user_model
from django.test import override_settings

from django_quota.models import QuotaPolicy
from tests import browser

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "test-artifacts" / "status-page.png"
QUOTA = {
    "HMAC_KEY": "tests-hmac-key-0123456789",
    "POLICY_SOURCES": ["settings", "database"],
    "CLOCK": "tests.test_middleware.frozen_clock",  # no window rolls over mid-test
    "POLICIES": {"login": {"windows": "5/m", "selector": ["ip"]}},
}
PASSWORD = "correct horse battery staple"


@override_settings(QUOTA=QUOTA, STATIC_URL="/static/", DEBUG=True)
class OperatorSurfaceInABrowser(browser.BrowserTestCase):
    """Admin, middleware and status page end to end, as an operator sees them."""

    def setUp(self) -> None:
        get_user_model().objects.create_superuser("operator", "ops@example.com", PASSWORD)

    # -- helpers -------------------------------------------------------------------------
    def log_in(self) -> None:
        self.open("/admin/login/?next=/admin/")
        self.fill("username", "operator")
        self.fill("password", PASSWORD)
        self.submit(self.field("password"))
        self.assertIn("Site administration", self.driver.title)

    def add_policy(self) -> None:
        from selenium.webdriver.common.by import By

        self.open("/admin/django_quota/quotapolicy/add/")
        self.fill("name", "shop-api")
        self.fill("selector", '["ip"]')
        self.fill("routes", '["/api"]')
        self.fill("windows-0-name", "burst")
        self.fill("windows-0-limit", "2")
        self.fill("windows-0-period", "60")
        # The second row exists only once the admin's inlines.js (a static file) ran.
        self.driver.find_element(By.CSS_SELECTOR, ".add-row a").click()
        self.fill("windows-1-name", "sustained")
        self.fill("windows-1-limit", "100")
        self.fill("windows-1-period", "3600")
        self.submit(self.driver.find_element(By.NAME, "_save"))
        self.assertIn("was added successfully", self.text())

    def screenshot(self, path: Path) -> None:
        """The whole page, not only the first screenful."""
        height = self.driver.execute_script(
            "return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)"
        )
        self.driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1280, "height": int(height), "deviceScaleFactor": 1, "mobile": False},
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        self.assertTrue(self.driver.save_screenshot(str(path)))

    # -- the test ------------------------------------------------------------------------
    def test_add_a_policy_see_it_refuse_and_read_the_status_page(self) -> None:
        import requests
        from selenium.webdriver.common.by import By

        self.log_in()
        self.add_policy()
        policy = QuotaPolicy.objects.get(name="shop-api")
        self.assertEqual(
            [(w.name, w.limit, w.period) for w in policy.windows.all()],
            [("burst", 2, 60), ("sustained", 100, 3600)],
        )
        self.assertEqual(policy.revision, 1)
        changelist = self.text()
        self.assertIn("burst: 2/m, sustained: 100/h", changelist)

        with requests.Session() as http:
            responses = [http.get(f"{self.live_server_url}/api/items/") for _ in range(3)]
        self.assertEqual([r.status_code for r in responses], [200, 200, 429])
        self.assertEqual(
            responses[0].headers["RateLimit-Policy"],
            '"shop-api.burst";q=2;w=60, "shop-api.sustained";q=100;w=3600',
        )
        refused = responses[2]
        self.assertEqual(refused.headers["Content-Type"], "application/problem+json")
        self.assertEqual(refused.json()["reason"], "burst_quota_exhausted")
        self.assertEqual(refused.headers["Retry-After"], "40")

        self.open("/admin/django_quota/quotapolicy/status/")
        self.assertEqual(self.driver.title, "Quota status | Django site admin")
        rows = [
            [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
            for row in self.driver.find_elements(By.CSS_SELECTOR, "#quota-policies tbody tr")
        ]
        self.assertEqual(
            [row[:2] for row in rows], [["login", "settings"], ["shop-api", "database"]]
        )
        self.assertEqual(rows[1][2:], [
            "1", "fixed_window", "burst: 2/m, sustained: 100/h", "-", "ip", "/api", "enforce",
            "closed (default)", "yes",
        ])
        self.assertEqual(self.driver.find_element(By.ID, "quota-breaker").text, "closed")
        self.assertEqual(self.driver.find_element(By.ID, "quota-backend").text, "memory")
        counts = self.driver.find_element(By.ID, "quota-counts").text
        self.assertIn("shop-api denied burst_quota_exhausted 1", counts)
        # Styled by the admin's CSS (served by the live server), not bare HTML.
        header = self.driver.find_element(By.ID, "header")
        self.assertNotEqual(header.value_of_css_property("background-color"), "rgba(0, 0, 0, 0)")
        self.screenshot(SCREENSHOT)
        self.assertGreater(os.path.getsize(SCREENSHOT), 10_000)

    def log_in_as(self, username: str) -> None:
        self.open("/admin/login/?next=/admin/")
        self.fill("username", username)
        self.fill("password", PASSWORD)
        self.submit(self.field("password"))

    def test_a_view_only_operator_reads_policies_and_status_but_changes_nothing(self) -> None:
        from django.contrib.auth.models import Permission
        from selenium.webdriver.common.by import By

        policy = QuotaPolicy.objects.create(name="shop-api", selector=["ip"], routes=["/api"])
        policy.windows.create(name="burst", limit=2, period=60)
        users = get_user_model().objects
        viewer = users.create_user("viewer", "viewer@example.com", PASSWORD, is_staff=True)
        viewer.user_permissions.add(
            *Permission.objects.filter(codename__in=["view_quotapolicy", "view_quotawindow"])
        )
        users.create_user("stranger", "stranger@example.com", PASSWORD, is_staff=True)

        self.log_in_as("viewer")
        self.open("/admin/django_quota/quotapolicy/")
        self.assertIn("shop-api", self.text())
        # No action can run: "Disable selected policies" and "Reset counters" need change.
        self.assertEqual(self.driver.find_elements(By.NAME, "action"), [])
        self.open(f"/admin/django_quota/quotapolicy/{policy.pk}/change/")
        self.assertEqual(self.driver.find_elements(By.NAME, "_save"), [])
        self.open("/admin/django_quota/quotapolicy/status/")
        self.assertEqual(self.driver.title, "Quota status | Django site admin")
        self.assertEqual(self.driver.find_element(By.ID, "quota-breaker").text, "closed")

        self.driver.delete_all_cookies()
        self.log_in_as("stranger")
        self.open("/admin/django_quota/quotapolicy/status/")
        self.assertIn("403", self.text())
        self.assertEqual(self.driver.find_elements(By.ID, "quota-breaker"), [])
        policy.refresh_from_db()
        self.assertTrue(policy.enabled)
