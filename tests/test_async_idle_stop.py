"""A server stopped while the event loop sat idle: the pooled connection's end of file is
not read yet, and no script was written, so the async path must say
``backend_unavailable`` (the local fallback may decide), not ``indeterminate``."""

from __future__ import annotations

import asyncio
from typing import Any

import django_quota
from tests.faults import redis_process


def test_async_evaluation_after_an_idle_stop_is_unavailable(quota: Any) -> None:
    with redis_process() as server:
        quota(
            REDIS_URL=server.url,
            TIMEOUT=0.5,
            DEADLINE=1.0,
            LOCAL_FALLBACK={"ENABLED": True, "MAX_ENTRIES": 100},
            POLICIES={"p": {"windows": "5/h", "selector": ["ip"]}},
        )

        async def scenario() -> tuple[str, str | None, str]:
            first = await django_quota.aevaluate("p", {"ip": "192.0.2.7"})
            server.stop()  # blocking: the loop does not run while the server goes away
            second = await django_quota.aevaluate("p", {"ip": "192.0.2.7"})
            return first.decision, second.reason, second.backend_mode

        decision, reason, mode = asyncio.run(scenario())
    assert decision == "allowed"
    assert (reason, mode) == (None, "fallback")  # the fallback decided: nothing was written
