"""The ``SENTINEL`` setting against a real redis-server and a real Sentinel started here
on free loopback ports."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import django_quota
from tests.conftest import require_redis_server


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for(port: int, deadline: float = 10.0) -> None:
    client = redis.Redis(port=port, socket_timeout=0.5)
    stop = time.monotonic() + deadline
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > stop:
                raise
            time.sleep(0.05)


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(primary port, sentinel port): a primary and one Sentinel monitoring it."""
    require_redis_server()
    primary, watcher = _free_port(), _free_port()
    processes = [
        subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(primary),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
    ]
    try:
        _wait_for(primary)
        config = tmp_path / "sentinel.conf"
        config.write_text(
            f"port {watcher}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 {primary} 1\n"
        )
        processes.append(
            subprocess.Popen(["redis-server", str(config), "--sentinel"], stdout=subprocess.DEVNULL)
        )
        _wait_for(watcher)
        yield primary, watcher
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=10)


def test_sentinel_setting_finds_the_primary_and_counts_there(
    sentinel: tuple[int, int], quota: Any
) -> None:
    primary, watcher = sentinel
    quota(
        SENTINEL={"SENTINELS": [("127.0.0.1", watcher)], "SERVICE": "mymaster"},
        TIMEOUT=1.0,
        DEADLINE=2.0,
        POLICIES={"p": {"windows": "2/h", "selector": ["ip"]}},
    )
    decisions = [django_quota.evaluate("p", {"ip": "192.0.2.1"}) for _ in range(3)]
    assert [o.decision for o in decisions] == ["allowed", "allowed", "denied"]
    assert decisions[0].backend_mode == "redis"
    keys = redis.Redis(port=primary).keys("quota:*")
    assert len([key for key in keys if b":e:" not in key]) == 1


def test_sentinel_setting_works_on_the_async_path(sentinel: tuple[int, int], quota: Any) -> None:
    import asyncio

    _, watcher = sentinel
    quota(
        SENTINEL={"SENTINELS": [("127.0.0.1", watcher)], "SERVICE": "mymaster"},
        TIMEOUT=1.0,
        DEADLINE=2.0,
        POLICIES={"p": {"windows": "1/h", "selector": ["ip"]}},
    )

    async def twice() -> list[str]:
        first = await django_quota.aevaluate("p", {"ip": "192.0.2.2"})
        second = await django_quota.aevaluate("p", {"ip": "192.0.2.2"})
        return [first.decision, second.decision]

    assert asyncio.run(twice()) == ["allowed", "denied"]
