"""Settings of the example project: a small DRF API limited by django-quota.

Everything that differs between a laptop and the demo run comes from the environment:

- ``DJANGO_SECRET_KEY``: the secret key (an obvious development default otherwise).
- ``DJANGO_DEBUG``: ``1``/``true``/``yes`` turns ``DEBUG`` on (off by default).
- ``DJANGO_ALLOWED_HOSTS``: extra comma-separated hosts besides the loopback ones.
- ``EXAMPLE_DB_PATH``: the SQLite file (default ``<repo>/var/example.sqlite3``).
- ``REDIS_URL``: the Redis server; unset means django-quota's per-process memory backend.
- ``QUOTA_HMAC_KEY``: the key that pseudonymises subjects in counter keys.
- ``QUOTA_KEY_PREFIX``: the counter namespace (the demo uses a fresh one per run).
- ``EXAMPLE_QUOTA_STATS``: ``1`` serves ``GET /api/quota-stats/`` (this worker's decision
  counts; also served when ``DEBUG`` is on). The demo turns it on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import django

BASE_DIR = Path(__file__).resolve().parent
REPO_DIR = BASE_DIR.parent


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


SECRET_KEY = os.environ.get(
    "DJANGO_SECRET_KEY", "django-insecure-example-project-dev-only-never-use-in-production"
)
DEBUG = _env_flag("DJANGO_DEBUG")
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"] + [
    host.strip() for host in os.environ.get("DJANGO_ALLOWED_HOSTS", "").split(",") if host.strip()
]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    # DRF's tokens: the demo's users authenticate with "Authorization: Token <key>".
    "rest_framework.authtoken",
    "django_quota",
    "example_project.shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # After authentication, so that policies selecting "user" see the session user.
    "django_quota.middleware.QuotaMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "example_project.wsgi.application"
ASGI_APPLICATION = "example_project.asgi.application"

EXAMPLE_DB_PATH = Path(
    os.environ.get("EXAMPLE_DB_PATH") or REPO_DIR / "var" / "example.sqlite3"
).resolve()
EXAMPLE_DB_PATH.parent.mkdir(parents=True, exist_ok=True)

DATABASES: dict[str, dict[str, Any]] = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": EXAMPLE_DB_PATH,
        # Several gunicorn workers may write at once: wait for the lock instead of failing.
        "OPTIONS": {"timeout": 20},
    }
}
if django.VERSION >= (5, 1):
    # Take the write lock when a transaction starts, so waiting writers queue on the timeout
    # above instead of failing with "database is locked" on a lock upgrade.
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"

REST_FRAMEWORK = {
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 20,
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # The rates of django-quota's drop-in AnonRateThrottle and UserRateThrottle (used by
    # GET /api/me/), read when a throttle runs, in DRF's syntax: "3/second" is DRF's own,
    # "8/4s" adds a multiplier (8 requests per 4 seconds). Their policies are drf:anon
    # and drf:user, with the algorithm QUOTA["DRF_ALGORITHM"].
    "DEFAULT_THROTTLE_RATES": {"anon": "3/second", "user": "8/4s"},
}

# GET /api/quota-stats/ reports this worker's decision counts: a debugging aid, off
# unless DEBUG is on or EXAMPLE_QUOTA_STATS is set (the demo sets it).
EXAMPLE_QUOTA_STATS = DEBUG or _env_flag("EXAMPLE_QUOTA_STATS")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_quota": {"handlers": ["console"], "level": "INFO"}},
}

# None selects django-quota's embedded memory backend: exact, but per process, so run a
# single worker process with it (the demo does).
REDIS_URL = os.environ.get("REDIS_URL") or None

QUOTA: dict[str, Any] = {
    "REDIS_URL": REDIS_URL,
    "HMAC_KEY": os.environ.get("QUOTA_HMAC_KEY", "example-only-hmac-key"),
    "KEY_PREFIX": os.environ.get("QUOTA_KEY_PREFIX", "example"),
    # Fixed windows for the DRF drop-in throttles (the default is "sliding_log", DRF's
    # own sliding log). The demo checks every decision by replaying epoch-aligned fixed
    # windows over the send times it recorded, sending nothing near their boundaries; a
    # sliding log forgets each request one period after the server admitted it, a moment
    # the client knows only to within a round trip, so its admitted count could not be
    # predicted exactly. Fixed windows are also DRF's own statuses where DRF's timestamps
    # start at a window boundary (docs/drf.md).
    "DRF_ALGORITHM": "fixed_window",
    # The health check and the stats endpoint are never limited, whatever policy routes say.
    "EXEMPT_PATHS": ["/healthz", "/api/quota-stats"],
    "POLICIES": {
        # Every method on the items collection, per client IP: at most 5 a second and 12
        # in any epoch-aligned 3-second window, so a busy client meets both limits.
        "api-items": {
            "algorithm": "fixed_window",
            "windows": {"burst": "5/s", "sustained": "12/3s"},
            "selector": ["ip"],
            "routes": ["/api/items"],
            "methods": [],
        },
        # The expensive search: 3 requests per 2-second window per client IP.
        "api-search": {
            "algorithm": "fixed_window",
            "windows": "3/2s",
            "selector": ["ip"],
            "routes": ["/api/search"],
            "methods": ["GET"],
        },
        # A policy on trial: "shadow" enforcement decides and counts (metrics, the
        # quota_denied log line) but never refuses and never adds rate-limit headers.
        # GET /api/catalog/ would be refused above 4 requests a second per client IP.
        "api-catalog": {
            "algorithm": "fixed_window",
            "windows": "4/s",
            "selector": ["ip"],
            "routes": ["/api/catalog"],
            "methods": ["GET"],
            "enforcement": "shadow",
        },
        # No routes: the middleware leaves it alone; QuotaThrottle applies it to the views
        # that name it (GET /api/orders/ has quota_policies = ["orders"]). Per DRF user.
        "orders": {
            "algorithm": "fixed_window",
            "windows": {"burst": "3/s", "sustained": "7/3s"},
            "selector": ["user"],
        },
    },
}
