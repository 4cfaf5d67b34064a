"""Engines for the differential tests: the same GroupRequest sent to the Python model
(the memory backend with a frozen wall clock, so nothing expires by TTL), to the Lua
script on fakeredis and to the Lua script on a real redis-server."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import fakeredis
import redis

from django_quota.backends.memory import MemoryBackend
from django_quota.backends.redis import RedisBackend
from django_quota.backends.scripting import Call
from django_quota.core.calls import PolicyCall, State
from django_quota.core.errors import BackendError
from django_quota.core.policy import CONCURRENCY
from django_quota.core.protocol import (
    GroupReply,
    GroupRequest,
    decode_counter,
    decode_leases,
    log_key,
)
from django_quota.scripts.shapes import SINGLE_WINDOW_SCRIPTS

#: The most windows a generated policy has (tests/test_differential.py).
MAX_WINDOWS = 3

#: Sequences run per (algorithm or "group", engine), and steps run per ("step:" and the
#: script that decided them, engine), printed at the end of the session.
SEQUENCES: Counter[tuple[str, str]] = Counter()


def expected_script(request: GroupRequest) -> str:
    """The script that must decide ``request`` (docs/architecture.md#the-script-protocol):
    one policy with one window its algorithm's variant of ``evaluate.lua``, any other
    group the general script."""
    calls = request.calls
    if len(calls) == 1 and len(calls[0].windows) == 1:
        return SINGLE_WINDOW_SCRIPTS.get(calls[0].algorithm, "evaluate")  # concurrency: none
    return "evaluate"


class ModelEngine:
    name = "model"

    def __init__(self) -> None:
        self.backend = MemoryBackend(10**6, clock_ms=lambda: 0)

    def reset(self) -> None:
        self.backend.clear()

    def evaluate(self, request: GroupRequest) -> GroupReply | str:
        try:
            return self.backend.evaluate(request)
        except BackendError as exc:
            return exc.reason

    def state(self, key: str, call: PolicyCall | None = None) -> tuple[State | None, bytes]:
        return self.backend.peek_state(key), self.backend.peek_records(key)

    def logs(self, key: str, call: PolicyCall | None = None) -> dict[int, list[int]]:
        """The sliding-log lists of counter ``key``, by window, as Redis would hold them
        (an empty list is no key); a concurrency policy's leases as its window 1."""
        return {
            index: list(log)
            for index, log in enumerate(self.backend.peek_logs(key), 1)
            if log
        }

    def keys(self, counters: tuple[str, ...]) -> set[str]:
        """Every key the model's state amounts to in Redis."""
        found = set()
        for counter in counters:
            state, records = self.state(counter)
            if state or records:
                found.add(counter)
            elif state is not None and self.logs(counter):  # a concurrency lease set
                found.add(counter)
                continue
            found.update(log_key(counter, index) for index in self.logs(counter))
        return found


class RedisEngine:
    def __init__(self, name: str, client: Any) -> None:
        self.name = name
        self.client = client
        self.backend = RedisBackend(
            url=None, timeout=5.0, max_inflight=4, client_factory=lambda _async: client
        )
        #: The script of every call this engine ran, in order.
        self.scripts: list[str] = []
        run = self.backend.run

        def recording(call: Call) -> Any:
            self.scripts.append(call.script)
            return run(call)

        self.backend.run = recording  # type: ignore[method-assign]

    def reset(self) -> None:
        self.client.flushall()

    def evaluate(self, request: GroupRequest) -> GroupReply | str:
        try:
            return self.backend.evaluate(request)
        except BackendError as exc:
            return exc.reason

    def state(self, key: str, call: PolicyCall | None = None) -> tuple[State | None, bytes]:
        """The counter read back in the model's terms (``decode_counter``)."""
        assert call is not None
        if call.algorithm == CONCURRENCY:  # its key is a sorted set: no numbers, no ledger
            return ({} if self.client.exists(key) else None), b""
        return decode_counter(self.client.get(key), call.algorithm, len(call.windows))

    def logs(self, key: str, call: PolicyCall | None = None) -> dict[int, list[int]]:
        if call is not None and call.algorithm == CONCURRENCY:
            leases = decode_leases(self.client.zrange(key, 0, -1, withscores=True))
            return {1: list(leases)} if leases else {}
        found = {}
        for index in range(1, MAX_WINDOWS + 1):
            values = self.client.lrange(log_key(key, index), 0, -1)
            if values:
                found[index] = [int(value) for value in values]
        return found

    def keys(self, counters: tuple[str, ...]) -> set[str]:
        return {key.decode() for key in self.client.keys("*")}


@dataclass
class Mismatch:
    step: int
    engine: str
    expected: object
    got: object


def engines_on(redis_server: Any, db: int) -> list[ModelEngine | RedisEngine]:
    """What a differential test compares: the model, the script on fakeredis, and the
    script on ``redis_server``'s database ``db``."""
    real = redis.Redis(host=redis_server.host, port=redis_server.port, db=db)
    return [
        ModelEngine(),
        RedisEngine("fakeredis", fakeredis.FakeRedis()),
        RedisEngine("redis", real),
    ]


def fake_backend(server: fakeredis.FakeServer) -> RedisBackend:
    """A Redis backend on the fakeredis ``server``: its sync and asyncio clients."""
    return RedisBackend(
        url=None,
        timeout=1.0,
        max_inflight=8,
        client_factory=lambda asynchronous: (
            fakeredis.FakeAsyncRedis(server=server)
            if asynchronous
            else fakeredis.FakeRedis(server=server)
        ),
    )


def prepared_costs(monkeypatch: Any) -> list[int]:
    """The cost of every group ``Limiter.prepare`` prepares from now on, in order (a spy
    for the tests that the short paths leave ``prepare`` alone)."""
    from django_quota.engine import Limiter

    costs: list[int] = []
    real = Limiter.prepare

    def spy(self: Limiter, *args: Any, **kwargs: Any) -> Any:
        costs.append(args[2])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Limiter, "prepare", spy)
    return costs
