"""How many new connections to a Redis at ``maxclients`` fail with the ``maxclients``
reason, per kind of connection the backends make (``docs/development.md``, "Versions CI
runs"): ``python -m benchmarks.maxclients_probe [--connections N] [--show]``.

Starts its own redis-server on a free loopback port, sets its ``maxclients`` to the
clients connected (the probe's own admin connection), then makes ``N`` new connections
of each kind, each through the backend's own pool or pipeline, and classifies each
failure as the backends do (``classify``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
from collections.abc import Callable

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from benchmarks.redis_server import RedisServer
from django_quota.backends.clients import client_options
from django_quota.backends.failures import ConnectFailed, classify
from django_quota.backends.redis import RedisBackend
from django_quota.backends.redispy import AsyncMarkingClusterConnection

TIMEOUT = 0.5


def reason(exc: BaseException | None, show: bool) -> str:
    """``reason/label`` of the failure ``exc`` (with its text when ``show`` and not
    ``maxclients``), or ``connected`` when there was none."""
    if exc is None:
        return "connected"
    error = classify(exc if isinstance(exc, ConnectFailed) else ConnectFailed(exc))
    if error.label:
        return f"{error.reason}/{error.label}"
    return f"{error.reason}/-" + (f" ({exc})" if show else "")


def sync_pool(url: str, public: bool) -> BaseException | None:
    backend = RedisBackend(url=url, timeout=TIMEOUT, max_inflight=4, public=public)
    pool = backend.client.connection_pool
    try:
        pool.get_connection()
    except Exception as exc:
        return exc
    finally:
        pool.disconnect()
    return None


async def async_pipeline(url: str, public: bool) -> BaseException | None:
    backend = RedisBackend(url=url, timeout=TIMEOUT, max_inflight=4, public=public)
    pipeline = backend._build(True)  # the client a pipelined event loop gets
    try:
        await pipeline.execute(("PING",))
    except Exception as exc:
        return exc
    finally:
        pipeline.close()
    return None


async def async_cluster_node(port: int) -> BaseException | None:
    connection = AsyncMarkingClusterConnection(
        port=port,
        socket_timeout=TIMEOUT,
        socket_connect_timeout=TIMEOUT,
        protocol=2,
        retry=AsyncRetry(NoBackoff(), 0),
    )
    try:
        await connection.connect()
    except Exception as exc:
        return exc
    finally:
        await connection.disconnect()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.maxclients_probe")
    parser.add_argument("--connections", type=int, default=100, help="per kind (100)")
    parser.add_argument("--show", action="store_true", help="the text of other failures")
    options = parser.parse_args()
    assert client_options(TIMEOUT, 4)["protocol"] == 2  # what the backends pin
    with RedisServer() as server:
        admin = server.client()
        admin.config_set("maxclients", int(admin.info("clients")["connected_clients"]))
        url, port = server.url, server.port
        kinds: list[tuple[str, Callable[[], BaseException | None]]] = [
            ("sync pool, fast path", lambda: sync_pool(url, False)),
            ("sync pool, public path", lambda: sync_pool(url, True)),
            ("asyncio pipeline, fast path", lambda: asyncio.run(async_pipeline(url, False))),
            ("asyncio pipeline, public path", lambda: asyncio.run(async_pipeline(url, True))),
            ("asyncio cluster node", lambda: asyncio.run(async_cluster_node(port))),
        ]
        print(f"redis-py {redis.__version__}, {options.connections} new connections per kind")
        for name, attempt in kinds:
            counts: collections.Counter[str] = collections.Counter()
            for _ in range(options.connections):
                counts[reason(attempt(), options.show)] += 1
            kept = counts["backend_unavailable/maxclients"]
            print(f"{name}: {kept} / {options.connections} maxclients; {dict(counts)}")
        admin.config_set("maxclients", 10000)


if __name__ == "__main__":
    main()
