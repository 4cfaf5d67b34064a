"""The real-browser harness the browser tests share: headless Chromium (Debian's
``chromium`` and ``chromium-driver``) driven by Selenium against a live server, Django's
``StaticLiveServerTestCase`` pattern (static files served, so the admin's JavaScript
runs). A missing browser or Selenium skips a test locally and fails it in CI
(``CI=true``)."""

from __future__ import annotations

import shutil
import tempfile
import unittest
from typing import Any

from django.contrib.staticfiles.testing import StaticLiveServerTestCase

from tests.conftest import IN_CI

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)


def unavailable(message: str) -> None:
    """Skip (locally) or fail (in CI) for a missing browser."""
    if IN_CI:
        raise AssertionError(f"{message}; in CI a missing browser is a failure")
    raise unittest.SkipTest(message)


def browser_paths() -> tuple[str, str]:
    """Paths of the Chromium binary and its driver (skip locally, fail in CI, if absent)."""
    binary = next(
        (found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))),
        None,
    )
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        unavailable("chromium / chromedriver not found (apt-get install chromium chromium-driver)")
    assert binary is not None and driver is not None
    return binary, driver


class BrowserTestCase(StaticLiveServerTestCase):
    """A live server and one headless Chromium per class, with a fresh profile; the page
    helpers the tests use."""

    driver: Any
    profile: tempfile.TemporaryDirectory[str]

    @classmethod
    def setUpClass(cls) -> None:
        try:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service
        except ImportError:
            unavailable("selenium is not installed (pip install -e '.[test]')")
        binary, driver = browser_paths()
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

    def open(self, path: str) -> None:
        self.driver.get(f"{self.live_server_url}{path}")

    def field(self, name: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.NAME, name)

    def fill(self, name: str, value: str) -> None:
        element = self.field(name)
        element.clear()
        element.send_keys(value)

    def text(self) -> str:
        from selenium.webdriver.common.by import By

        return str(self.driver.find_element(By.TAG_NAME, "body").text)

    def submit(self, element: Any) -> None:
        """Click (or submit) ``element`` and wait until the next page replaced this one:
        reading the page right after a click may find the old page's body, which goes
        stale under the reader as the new page arrives."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions
        from selenium.webdriver.support.ui import WebDriverWait

        body = self.driver.find_element(By.TAG_NAME, "body")
        if element.tag_name == "input" and element.get_attribute("type") != "submit":
            element.submit()
        else:
            element.click()
        WebDriverWait(self.driver, 10).until(expected_conditions.staleness_of(body))
