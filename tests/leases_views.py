"""A view under a concurrency policy that counts, in Redis, how many copies of it run at
once and the most that ever did (tests/test_leases_load.py); also the URLconf and the
settings of its worker processes (``python -m tests.leases_views``)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import redis
from django.http import HttpRequest, HttpResponse
from django.urls import path

from django_quota.decorators import quota

#: Redis keys of the real counters (no quota prefix: never a counter of the library).
RUNNING, MOST = "leases-test:running", "leases-test:most"
STARTED, READY, GO = "leases-test:started", "leases-test:ready", "leases-test:go"
#: INCR the running count and raise the most seen to it, atomically.
ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""
LIMIT = 3
POLICIES = {
    "load": {"algorithm": "concurrency", "windows": f"{LIMIT}/m", "selector": ["ip"]},
    "hang": {"algorithm": "concurrency", "windows": "1/2s", "selector": ["ip"]},
}

_clients: dict[str, Any] = {}


def counters() -> Any:
    url = os.environ["LEASES_TEST_REDIS_URL"]
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url)
    return _clients[url]


@quota("load")
def work(request: HttpRequest) -> HttpResponse:
    client = counters()
    client.eval(ENTER, 2, RUNNING, MOST)
    try:
        time.sleep(0.01)
    finally:
        client.decr(RUNNING)
    return HttpResponse("ok")


@quota("hang")
def hang(request: HttpRequest) -> HttpResponse:
    counters().set(STARTED, "1")
    time.sleep(3600)  # killed with -9 meanwhile
    return HttpResponse("never")


urlpatterns = [path("work/", work), path("hang/", hang)]


def worker(requests: int) -> None:
    """Send ``requests`` GETs to ``/work/`` (or one to ``/hang/`` when 0); print how many
    were admitted and refused."""
    import django
    from django.conf import settings

    settings.QUOTA = {
        "HMAC_KEY": "tests-hmac-key-0123456789",
        "POLICY_SOURCES": ["settings"],
        "REDIS_URL": os.environ["LEASES_TEST_REDIS_URL"],
        "POLICIES": POLICIES,
        "TIMEOUT": 2.0,  # the bound is tested, not the latency (test_leases_load.py)
        "DEADLINE": 5.0,
    }
    settings.ROOT_URLCONF = __name__
    django.setup()
    from django.test import Client

    client = Client()
    if requests == 0:
        client.get("/hang/")
        return
    counters().incr(READY)
    while not counters().get(GO):  # every worker starts at once
        time.sleep(0.005)
    codes = [client.get("/work/").status_code for _ in range(requests)]
    print(codes.count(200), codes.count(429), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    worker(int(sys.argv[1]))
