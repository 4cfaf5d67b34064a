"""A healthy Redis behind a busy ASGI server gives no 503 (``docs/failures.md``, "Who is
to blame"): uvicorn with two workers, the default ``TIMEOUT`` and ``DEADLINE``, 64
concurrent clients and a busy loop holding one of the machine's cores. One policy per
algorithm, each on its own async route, with a limit ``L`` below the requests it gets:
exactly ``L`` requests are admitted and every other one is refused with 429, so nothing
was charged without being admitted, and no decision failed.

Before the engine's pipelined async path, a late reply read on a busy event loop was
``indeterminate`` (503), and five of them opened the node's breaker (more 503s).

Bounded: one server, ``REQUESTS`` requests per route, each with a 30 s timeout; the busy
loop and the server are stopped at the end.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.test_asgi_servers import serving

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 64
#: Requests per route; the limit of each route's policy is below it.
REQUESTS = 400
LIMIT = 300
#: One policy per algorithm, on a route of its own. The windows are long (30 days) so
#: that no window ends and no token refills during the run: exactly LIMIT admissions.
ROUTES = {
    "fw": {"algorithm": "fixed_window", "windows": f"{LIMIT}/30d"},
    "sw": {"algorithm": "sliding_window", "windows": f"{LIMIT}/30d"},
    "sl": {"algorithm": "sliding_log", "windows": f"{LIMIT}/30d"},
    "tb": {"algorithm": "token_bucket", "windows": f"{LIMIT}/30d"},
}

URLS = '''
from django.http import HttpResponse
from django.urls import path


async def ok(request):
    return HttpResponse("ok")



urlpatterns = [path(name + "/", ok) for name in NAMES]
'''


@contextmanager
def busy_core() -> Iterator[None]:
    """A process spinning on one core for the duration."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@contextmanager
def uvicorn_workers(tmp_path: Path, redis_url: str) -> Iterator[int]:
    """uvicorn with two workers serving one async view per route, each route limited by
    one policy (``selector: ip``: every request of the test is one client)."""
    policies = {
        f"load-{name}": {**policy, "selector": ["ip"], "routes": [f"/{name}/"]}
        for name, policy in ROUTES.items()
    }
    quota = {
        "HMAC_KEY": "tests-hmac-key-0123456789",
        "POLICY_SOURCES": ["settings"],
        "REDIS_URL": redis_url,
        "POLICIES": policies,
    }
    (tmp_path / "load_urls.py").write_text(f"NAMES = {list(ROUTES)!r}\n" + URLS)
    (tmp_path / "load_settings.py").write_text(
        "from tests.settings import *  # noqa: F403\n"
        f"DEBUG = False\nROOT_URLCONF = 'load_urls'\nQUOTA = {quota!r}\n"
    )
    with serving(tmp_path, "load_settings", "--workers", "2") as port:
        yield port


async def _status(port: int, path: str) -> int:
    """One GET on its own connection: its status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        writer.write(request.encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()
    return int(raw.split(b" ", 2)[1])


def load(port: int) -> dict[str, Counter[int]]:
    """``REQUESTS`` requests per route, the routes interleaved, from ``CLIENTS``
    concurrent clients: the statuses per route."""
    paths = [name for _ in range(REQUESTS) for name in ROUTES]

    async def run() -> dict[str, Counter[int]]:
        found: dict[str, Counter[int]] = {name: Counter() for name in ROUTES}
        queue = iter(paths)

        async def client() -> None:
            for name in queue:
                found[name][await _status(port, f"/{name}/")] += 1

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        return found

    return asyncio.run(run())


def test_a_busy_uvicorn_with_a_healthy_redis_admits_exactly_the_limit_and_fails_none(
    tmp_path: Path, redis_url: str
) -> None:
    with uvicorn_workers(tmp_path, redis_url) as port, busy_core():
        statuses = load(port)
    assert statuses == {name: Counter({200: LIMIT, 429: REQUESTS - LIMIT}) for name in ROUTES}
