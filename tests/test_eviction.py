"""Eviction is seen before it bites (``docs/operations.md``, "Eviction"): a Redis whose
``maxmemory-policy`` may evict live counters is a W009 warning of ``manage.py check``,
the status page shows each primary's policy and evicted keys with the change since this
process first read them, and ``django_quota_backend_evicted_keys`` exposes the count. On
a real redis-server, with real evictions."""

from __future__ import annotations

import html
import io
import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.test_admin import STATUS

pytestmark = pytest.mark.redis

POLICIES = {"p": {"windows": "5/m", "selector": ["ip"]}}


def check_output(capsys: pytest.CaptureFixture[str]) -> str:
    out = io.StringIO()
    call_command("check", stdout=out, stderr=out)
    captured = capsys.readouterr()
    return out.getvalue() + captured.out + captured.err


@pytest.fixture
def evicting(redis_client: Any) -> Iterator[Any]:
    """The test server with a 4 MB ``maxmemory`` and ``allkeys-lru``; reset afterwards."""
    redis_client.config_set("maxmemory", 4 * 1024 * 1024)
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        yield redis_client
    finally:
        redis_client.config_set("maxmemory", 0)
        redis_client.config_set("maxmemory-policy", "noeviction")


def evict_some(client: Any) -> int:
    """Write until the server evicts: the ``evicted_keys`` count after."""
    before = int(client.info("stats")["evicted_keys"])
    payload = b"x" * 10_000
    for index in range(2_000):
        client.set(f"filler:{index}", payload)
        if index % 100 == 99 and int(client.info("stats")["evicted_keys"]) > before:
            break
    after = int(client.info("stats")["evicted_keys"])
    assert after > before, "the server evicted nothing"
    return after


def test_an_evicting_redis_is_a_w009_warning(
    quota: Any, redis_url: str, evicting: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    quota(REDIS_URL=redis_url, POLICIES=POLICIES)
    output = check_output(capsys)
    assert "(django_quota.W009) the Redis of node 'default' has maxmemory-policy allkeys-lru " \
           "with maxmemory 4194304: it can evict live counters" in output
    assert "HINT: set maxmemory-policy noeviction on the rate-limit Redis" in output


def test_a_noeviction_redis_and_an_unreachable_one_give_no_w009(
    quota: Any, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    quota(REDIS_URL=redis_url, POLICIES=POLICIES)
    assert "W009" not in check_output(capsys)
    quota(REDIS_URL="redis://127.0.0.1:1/0", POLICIES=POLICIES)  # nothing listens there
    assert "W009" not in check_output(capsys)


def eviction_rows(response: Any) -> list[list[str]]:
    table = re.search(r'<table id="quota-eviction">(.*?)</table>', response.content.decode(), re.S)
    assert table is not None
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(1), re.S)[1:]
    return [
        [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td>(.*?)</td>", row)]
        for row in rows
    ]


def test_the_status_page_shows_the_policy_and_the_evictions_since_it_first_read_them(
    admin_client: Client, quota: Any, redis_url: str, evicting: Any
) -> None:
    quota(REDIS_URL=redis_url, POLICIES=POLICIES)
    before = int(evicting.info("stats")["evicted_keys"])
    (first,) = eviction_rows(admin_client.get(STATUS))
    assert first[:4] == [
        "default", "allkeys-lru (can evict live counters)", "4194304", str(before)
    ]
    assert first[4].startswith("+0 since ")
    after = evict_some(evicting)
    (second,) = eviction_rows(admin_client.get(STATUS))
    assert second[3] == str(after)
    assert second[4] == f"+{after - before} since {first[4].removeprefix('+0 since ')}"


def test_the_memory_backend_has_no_eviction_table(admin_client: Client, quota: Any) -> None:
    quota(POLICIES=POLICIES)
    assert b"quota-eviction" not in admin_client.get(STATUS).content


def test_the_metric_is_the_servers_evicted_keys_at_each_scrape(
    client: Client, quota: Any, redis_url: str, evicting: Any
) -> None:
    quota(REDIS_URL=redis_url, POLICIES=POLICIES)

    def scraped() -> float:
        text = client.get("/metrics/quota").content.decode()
        families = {family.name: family for family in text_string_to_metric_families(text)}
        (sample,) = families["django_quota_backend_evicted_keys"].samples
        assert sample.labels == {"node": "default"}
        return float(sample.value)

    assert scraped() == float(evicting.info("stats")["evicted_keys"])
    after = evict_some(evicting)
    assert scraped() == float(after)
