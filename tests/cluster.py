"""A real Redis Cluster for the tests: three ``redis-server --cluster-enabled yes``
primaries on free loopback ports (client and cluster-bus ports both chosen free), joined
by ``redis-cli --cluster create``; nodes can be stopped and restarted on their port."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from tests.conftest import IN_CI, require_redis_server
from tests.faults import RedisProcess, free_port

#: ms before the cluster marks a silent node as failing; longer than any test's outage,
#: so a stopped node never turns the whole cluster to ``cluster_state:fail``.
NODE_TIMEOUT_MS = 30_000


#: Starts of a node, each on fresh ports, before a cluster's start fails.
START_ATTEMPTS = 3
#: Seconds a node may miss another before it is introduced again (:meth:`Cluster.wait_ok`).
MEET_AGAIN_AFTER = 3.0


def bus_port(node: RedisProcess) -> int:
    """The cluster bus port ``node`` was started with (``--cluster-port``)."""
    args = list(node.extra_args)
    return int(args[args.index("--cluster-port") + 1])


class Cluster:
    """``size`` primaries (no replicas) covering all 16384 slots; ``options`` are more
    ``redis-server`` arguments for every node (``"--cluster-require-full-coverage",
    "no"``)."""

    def __init__(self, size: int = 3, *options: str) -> None:
        self.options = options
        self.nodes: list[RedisProcess] = []
        for _ in range(size):
            node = RedisProcess()
            self._ports(node)
            self.nodes.append(node)

    def _ports(self, node: RedisProcess, *, anew: bool = False) -> None:
        """Give ``node`` its cluster arguments (``anew``: on fresh free ports)."""
        if anew:
            node.port = free_port()
        node.extra_args = (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"{node.directory}/nodes-{node.port}.conf",
            "--cluster-port",
            str(free_port()),
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            *self.options,
        )

    @property
    def url(self) -> str:
        """A URL naming one node (the client discovers the others)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self) -> None:
        for node in self.nodes:
            # A free port is only free when it was probed: until the node binds it and
            # its cluster bus port, another socket (the other nodes' bus connections
            # take ephemeral ports) may have taken one, and redis-server exits with 1.
            for attempt in range(START_ATTEMPTS):
                try:
                    node.start()
                    break
                except RuntimeError:
                    if attempt == START_ATTEMPTS - 1:
                        raise
                    if node.process is not None and node.process.poll() is None:
                        node.process.kill()
                        node.process.wait(5)
                    node.process = None
                    self._ports(node, anew=True)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        self.wait_ok()

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every running node reports ``cluster_state:ok`` and knows every node.

        A node that still misses one after a few seconds is introduced again
        (``CLUSTER MEET`` of every other node: a no-op for those it knows). A handshake
        that fails, as a loaded CI machine once saw after ``redis-cli --cluster create``,
        is dropped by Redis and never retried: the node then knew 2 nodes of 3 for good."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.process is None:
                continue
            with contextlib.closing(node.client(socket_timeout=1.0)) as client:
                meet_at = time.monotonic() + MEET_AGAIN_AFTER
                while True:
                    fields = {str(k): str(v) for k, v in client.cluster("INFO").items()}
                    known = int(fields.get("cluster_known_nodes", 0))
                    if (
                        fields.get("cluster_state") == "ok"
                        and known == len(self.nodes)
                        and int(fields.get("cluster_slots_ok", 0)) == 16384
                    ):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster not ok on {node.port}: {fields}")
                    if known < len(self.nodes) and time.monotonic() > meet_at:
                        for other in self.nodes:
                            if other is not node and other.process is not None:
                                client.execute_command(
                                    "CLUSTER", "MEET", "127.0.0.1", other.port, bus_port(other)
                                )
                        meet_at = time.monotonic() + MEET_AGAIN_AFTER
                    time.sleep(0.05)

    def client(self, port: int) -> redis.Redis:
        """A plain client on one node (for reading keys back, SCRIPT EXISTS, INFO)."""
        node = next(node for node in self.nodes if node.port == port)
        return node.client(socket_timeout=5.0)

    def node_of(self, key: str) -> int:
        """The port of the primary serving ``key`` (asked of the cluster itself)."""
        with contextlib.closing(self.nodes[0].client()) as client:
            slot = int(client.cluster("KEYSLOT", key))
            for start, end, primary, *_ in client.cluster("SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        raise LookupError(f"no node serves slot {slot}")

    def flushall(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                with contextlib.closing(node.client()) as client:
                    client.flushall()

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@contextlib.contextmanager
def redis_cluster(size: int = 3, *options: str) -> Iterator[Cluster]:
    """A started :class:`Cluster`, every node killed at the end whatever happens.

    Skips locally and fails in CI (``CI=true``) without the ``redis-server`` or
    ``redis-cli`` binary.
    """
    require_redis_server()
    if shutil.which("redis-cli") is None:
        message = "redis-cli not found (Debian's redis-tools, installed with redis-server)"
        if IN_CI:
            pytest.fail(message + "; in CI a missing Redis is a failure")
        pytest.skip(message)
    cluster = Cluster(size, *options)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
