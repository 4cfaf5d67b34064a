"""What a concurrency policy's leases cost in Redis (docs/concurrency.md): ``MEMORY
USAGE`` of one subject's lease set with 1, 2, 4, 8 and 16 leases held, and the keys
left once they are released or expired. Printed by ``--instructions`` with its goal
(at most 160 B plus 32 B per held lease, 0 B once none is held)."""

from __future__ import annotations

import time

from benchmarks import django_settings as bench_settings
from benchmarks.redis_server import RedisServer

HELD = (1, 2, 4, 8, 16)
BASE_BYTES, LEASE_BYTES = 160, 32


def lease_bytes(binary: str = "redis-server") -> tuple[dict[int, int], int, int]:
    """Bytes of one subject's lease set per number of leases held; the keys left after
    every lease was released, and after the leases of a 1 s policy expired (and a call
    pruned them)."""
    from django.test import override_settings

    import django_quota

    subject = {"ip": "192.0.2.7"}
    with RedisServer(binary) as server:
        quota = bench_settings.quota_settings(server.url, 100)
        quota["POLICIES"] = {
            **quota["POLICIES"],
            "short": {"algorithm": "concurrency", "windows": "100/s", "selector": ["ip"]},
        }
        quota["CLEANUP_GRACE"] = 0
        admin = server.client()
        with override_settings(QUOTA=quota):
            sizes: dict[int, int] = {}
            ids = []
            for held in range(1, max(HELD) + 1):
                ids.append(django_quota.evaluate("concurrency", subject).evaluation_id)
                if held in HELD:
                    (key,) = admin.keys("quota:*")
                    sizes[held] = int(admin.memory_usage(key, samples=0) or 0)
            for evaluation_id in ids:
                django_quota.release("concurrency", subject, evaluation_id)
            after_release = len(admin.keys("*"))
            for _ in range(4):
                django_quota.evaluate("short", subject)
            time.sleep(1.1)  # every lease of the 1 s policy expired, and so did its key
            after_expiry = len(admin.keys("*"))
        admin.close()
    return sizes, after_release, after_expiry


def goal_lines(sizes: dict[int, int], after_release: int, after_expiry: int) -> list[str]:
    """The figures and the goal's verdict per line."""
    lines = []
    for held, size in sizes.items():
        target = BASE_BYTES + LEASE_BYTES * held
        verdict = "PASS" if size <= target else "MISS"
        lines.append(f"concurrency, {held} lease(s) held: {size} B (target <= {target} B): "
                     f"{verdict}")
    verdict = "PASS" if after_release == after_expiry == 0 else "MISS"
    lines.append(f"concurrency, keys left once released / expired: {after_release} / "
                 f"{after_expiry} (target 0 / 0): {verdict}")
    return lines
