"""A project that switches its imports but forgets ``"django_quota"`` in INSTALLED_APPS
is told so on first use, by every surface, with the fix named (docs/settings.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: A project without django_quota in INSTALLED_APPS: one view per surface, each asked once.
_PROJECT = textwrap.dedent('''
    import sys

    import django
    from django.conf import settings

    settings.configure(
        SECRET_KEY="app-missing-test-secret-key-long-enough",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "rest_framework"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        MIDDLEWARE=["django_quota.middleware.QuotaMiddleware"] if sys.argv[1] == "mw" else [],
        QUOTA={"HMAC_KEY": "app-missing-hmac-key", "POLICIES": {
            "p": {"windows": "5/m", "selector": ["ip"], "routes": ["/mw"]}}},
        REST_FRAMEWORK={
            "DEFAULT_THROTTLE_RATES": {"anon": "5/m"},
            "UNAUTHENTICATED_USER": None,
            "DEFAULT_AUTHENTICATION_CLASSES": [],
        },
    )
    django.setup()
    from django.core.exceptions import ImproperlyConfigured
    from django.http import HttpResponse
    from django.test import Client
    from django.urls import path
    from rest_framework.response import Response
    from rest_framework.views import APIView

    import django_quota
    from django_quota.decorators import quota
    from django_quota.throttling import AnonRateThrottle


    class DropIn(APIView):
        throttle_classes = [AnonRateThrottle]

        def get(self, request):
            return Response("ok")


    @quota(rate="5/m", selector=["ip"])
    def decorated(request):
        return HttpResponse("ok")


    def plain(request):
        return HttpResponse("ok")


    urlpatterns = [path("drf", DropIn.as_view()), path("view", decorated), path("mw", plain)]
    try:
        if sys.argv[1] == "api":
            django_quota.evaluate("p", {"ip": "192.0.2.1"})
        else:
            paths = {"drf": "/drf", "decorator": "/view", "mw": "/mw"}
            Client(raise_request_exception=True).get(paths[sys.argv[1]])
    except ImproperlyConfigured as exc:
        print("ImproperlyConfigured:", exc)
    except Exception as exc:
        print(type(exc).__name__ + ":", exc)
    else:
        print("no error")
''')


@pytest.mark.parametrize("surface", ["drf", "decorator", "mw", "api"])
def test_a_missing_app_is_named_on_first_use(surface: str, tmp_path: Path) -> None:
    script = tmp_path / "project.py"
    script.write_text(_PROJECT)
    result = subprocess.run(
        [sys.executable, str(script), surface],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == (
        "ImproperlyConfigured: django_quota is not in INSTALLED_APPS: add 'django_quota' to"
        " INSTALLED_APPS (it registers the system checks and the listeners that keep the"
        " limits current)"
    )
