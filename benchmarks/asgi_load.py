"""A busy ASGI server with a healthy Redis, for a fixed time (``docs/benchmarks.md``, "A busy
uvicorn"): ``python -m benchmarks.asgi_load [--seconds 20] [--clients 64] [--limit 1000]``.

Starts its own redis-server on a free loopback port, uvicorn with two workers serving one
async view per algorithm (each limited by one policy of ``--limit`` per 30 days, so no
window ends and no token refills during the run), and a process spinning on one core.
``--clients`` concurrent clients then send requests, the routes interleaved, each on a
new connection, for ``--seconds``. Prints the statuses per route, and the counter each
policy holds in Redis afterwards (``django_quota.peek``): with a healthy Redis every
request is answered 200 or 429, exactly ``--limit`` are admitted per route, and the
counter charged equals the admissions. ``tests/test_asgi_load.py`` holds the same
property on a bounded number of requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
HMAC_KEY = "django-quota-benchmark-hmac-key"
ALGORITHMS = {
    "fw": "fixed_window",
    "sw": "sliding_window",
    "sl": "sliding_log",
    "tb": "token_bucket",
}
SETTINGS = """
SECRET_KEY = "asgi-load-benchmark"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_quota"]
MIDDLEWARE = ["django_quota.middleware.QuotaMiddleware"]
ROOT_URLCONF = "load_urls"
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}}}
QUOTA = {quota!r}
"""
URLS = """
from django.http import HttpResponse
from django.urls import path


async def ok(request):
    return HttpResponse("ok")


urlpatterns = [path(name + "/", ok) for name in {names!r}]
"""


def quota_settings(redis_url: str, limit: int) -> dict[str, object]:
    return {
        "HMAC_KEY": HMAC_KEY,
        "POLICY_SOURCES": ["settings"],
        "REDIS_URL": redis_url,
        "POLICIES": {
            f"load-{name}": {
                "algorithm": algorithm,
                "windows": f"{limit}/30d",
                "selector": ["ip"],
                "routes": [f"/{name}/"],
            }
            for name, algorithm in ALGORITHMS.items()
        },
    }


def serve(directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    """uvicorn, two workers, on a free loopback port; returns once it listens."""
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "load_settings",
        "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT)]),
    }
    server = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "--factory",
            "django.core.asgi:get_asgi_application", "--host", "127.0.0.1",
            "--port", str(port), "--workers", "2", "--no-access-log",
            "--log-level", "warning",
        ],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        if server.poll() is not None:
            raise RuntimeError("uvicorn exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, port
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("uvicorn did not listen within 30 s") from None
            time.sleep(0.05)


async def status(port: int, path: str) -> int:
    """One GET on a connection of its own: its status (0 when no answer in 30 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=30)
    except TimeoutError:
        return 0
    finally:
        writer.close()
    return int(raw.split(b" ", 2)[1])


def load(port: int, clients: int, seconds: float) -> dict[str, Counter[int]]:
    async def run() -> dict[str, Counter[int]]:
        found: dict[str, Counter[int]] = {name: Counter() for name in ALGORITHMS}
        names = list(ALGORITHMS)
        end = time.monotonic() + seconds
        sent = 0

        async def client() -> None:
            nonlocal sent
            while time.monotonic() < end:
                name = names[sent % len(names)]
                sent += 1
                found[name][await status(port, f"/{name}/")] += 1

        await asyncio.gather(*(client() for _ in range(clients)))
        return found

    return asyncio.run(run())


def charged(redis_url: str, limit: int) -> dict[str, int]:
    """What each policy's counter holds for the one client, read through the API."""
    import django
    from django.conf import settings

    settings.configure(
        SECRET_KEY="asgi-load-benchmark",
        INSTALLED_APPS=["django.contrib.contenttypes", "django_quota"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        USE_TZ=True,
        QUOTA=quota_settings(redis_url, limit),
    )
    django.setup()
    import django_quota

    used = {}
    for name in ALGORITHMS:
        outcome = django_quota.peek(f"load-{name}", {"ip": "127.0.0.1"})
        assert outcome.remaining is not None, outcome
        used[name] = limit - outcome.remaining
    return used


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--no-busy-core", action="store_true")
    args = parser.parse_args()
    with RedisServer() as redis_server, tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        quota = quota_settings(redis_server.url, args.limit)
        (path / "load_settings.py").write_text(SETTINGS.format(quota=quota))
        (path / "load_urls.py").write_text(URLS.format(names=list(ALGORITHMS)))
        server, port = serve(path)
        spinner = None
        if not args.no_busy_core:
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            started = time.monotonic()
            statuses = load(port, args.clients, args.seconds)
            took = time.monotonic() - started
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
            server.terminate()
            server.wait(timeout=15)
        used = charged(redis_server.url, args.limit)
    total = sum(sum(counts.values()) for counts in statuses.values())
    busy = "one core busy" if not args.no_busy_core else "no busy core"
    print(
        f"uvicorn, 2 workers, {args.clients} clients, {took:.1f} s, {busy}: "
        f"{total:,} requests ({total / took:,.0f}/s), limit {args.limit:,} per route"
    )
    failed = False
    for name, algorithm in ALGORITHMS.items():
        counts = statuses[name]
        others = {code: n for code, n in counts.items() if code not in (200, 429)}
        exact = counts[200] == used[name] == min(args.limit, sum(counts.values()))
        failed |= bool(others) or not exact
        print(
            f"  {algorithm:15} 200: {counts[200]:6,}  429: {counts[429]:6,}  "
            f"other: {others or 0}  charged: {used[name]:,}  "
            f"{'OK' if exact and not others else 'NOT EXACT'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
