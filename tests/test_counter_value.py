"""The counter as Redis holds it (docs/operations.md, "Redis memory"): one string per
(policy, revision, identity), its bytes exactly ``evaluate.lua``'s layout, read back by
``protocol.decode_counter``; a hash an earlier version left at the key is no counter and
never an error; numbers the scripts cannot take are refused before any call."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

import django_quota
from django_quota import limiter, policies
from django_quota.core.calls import PolicyCall
from django_quota.core.evaluation_ids import appended, entries
from django_quota.core.policy import Window
from django_quota.core.protocol import GroupRequest, decode_counter, fingerprint
from tests import clock

START = 1_800_000_000.0  # epoch seconds, the settable clock's start
START_MS = int(START * 1000)
SUBJECT = {"ip": "192.0.2.44"}


@pytest.fixture
def on_redis(quota: Any, redis_url: str) -> Iterator[Any]:
    clock.set_to(START)

    def configure(**definitions: Any) -> None:
        # Bytes, not latency, are under test: timeouts no loaded CI machine reaches.
        quota(
            REDIS_URL=redis_url,
            CLOCK="tests.clock.now",
            TIMEOUT=2.0,
            DEADLINE=5.0,
            POLICIES=definitions,
        )

    yield configure
    clock.set_to(START)


def counter_of(policy_id: str) -> str:
    prepared = limiter.get_limiter().prepare(
        [policies.get_policy(policy_id)], SUBJECT, 1, peek=True
    )
    assert prepared.request is not None
    return prepared.request.counters[0]


def test_one_charge_stores_the_documented_bytes(on_redis: Any, redis_client: Any) -> None:
    on_redis(p={"algorithm": "fixed_window", "windows": "5/m"})
    outcome = django_quota.evaluate("p", SUBJECT, evaluation_id="first-charge")
    assert (outcome.decision, outcome.remaining) == ("allowed", 4)
    value = redis_client.get(counter_of("p"))
    entry, _ = appended(b"", fingerprint("first-charge"), 1, START_MS, 5_000)
    assert len(entry) == 9
    assert value == (
        b"\x09"  # the ledger's 9 bytes: one entry, the fingerprint, then the charge time
        + entry  # mod 2**32 ms (a charge of cost 1 records no cost)
        + (0).to_bytes(6, "big")  # d + 1: nothing dropped
        + START_MS.to_bytes(6, "big")  # t
        + (1).to_bytes(6, "big")  # c1
    )
    assert decode_counter(value, "fixed_window", 1) == ({"t": START_MS, "c1": 1}, entry)
    assert redis_client.type(counter_of("p")) == b"string"


def test_a_token_bucket_keeps_its_remainder_beside_each_count(
    on_redis: Any, redis_client: Any
) -> None:
    on_redis(p={"algorithm": "token_bucket", "windows": "10/m", "capacity": 10})
    clock.set_to(START)
    django_quota.evaluate("p", SUBJECT, cost=3, evaluation_id="three")
    state, records = decode_counter(redis_client.get(counter_of("p")), "token_bucket", 1)
    # deficit D = 3 tokens x 60,000 ms: c1 = floor(D / P) = 3, p1 = D mod P = 0
    assert state == {"t": START_MS, "c1": 3, "p1": 0}
    # The entry records the cost: its fingerprint flagged, 6 bytes of cost, the time.
    assert len(records) == 15 and records[0] & 0x80
    assert list(entries(records)) == [(15, fingerprint("three"), 3, START_MS % 2**32)]


@pytest.mark.parametrize(
    ("algorithm", "windows"),
    [
        ("sliding_window", "5/m"),
        ("fixed_window", "5/m"),
        ("token_bucket", "5/m"),
        ("fixed_window", {"a": "5/m", "b": "9/h"}),
        ("sliding_window", {"a": "5/m", "b": "9/h"}),
    ],
)
def test_reset_keeps_only_the_ledger_and_its_expiry(
    on_redis: Any, redis_client: Any, algorithm: str, windows: Any
) -> None:
    on_redis(p={"algorithm": algorithm, "windows": windows})
    count = 1 if isinstance(windows, str) else len(windows)
    django_quota.evaluate("p", SUBJECT, cost=2)
    key = counter_of("p")
    ttl = redis_client.pttl(key)
    assert django_quota.reset("p", SUBJECT) == count
    state, records = decode_counter(redis_client.get(key), algorithm, count)
    assert state == {} and len(records) == 15  # numbers gone, the id (and cost) remembered
    assert 0 < redis_client.pttl(key) <= ttl
    assert django_quota.peek("p", SUBJECT).remaining == 5


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket"])
def test_a_hash_of_an_earlier_version_reads_as_no_counter_and_is_replaced(
    on_redis: Any, redis_client: Any, algorithm: str
) -> None:
    on_redis(p={"algorithm": algorithm, "windows": "5/m"})
    key = counter_of("p")
    redis_client.hset(key, mapping={"t": START_MS, "c1": 4, "e": b"x" * 5, "s": b"y" * 4})
    assert django_quota.peek("p", SUBJECT).remaining == 5
    outcome = django_quota.evaluate("p", SUBJECT)
    assert (outcome.decision, outcome.remaining) == ("allowed", 4)
    assert redis_client.type(key) == b"string"
    redis_client.delete(key)
    redis_client.hset(key, "t", START_MS)
    assert django_quota.reset("p", SUBJECT) == 0
    assert not redis_client.exists(key)


def test_another_error_on_the_counter_is_not_read_as_no_counter(
    on_redis: Any, redis_client: Any, redis_url: str, quota: Any
) -> None:
    redis_client.acl_setuser(
        "no-get", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-get"]
    )
    try:
        host_port = redis_url.split("//", 1)[1]
        quota(
            REDIS_URL=f"redis://no-get:pw@{host_port}",
            CLOCK="tests.clock.now",
            POLICIES={"p": {"windows": "5/m"}},
        )
        outcome = django_quota.peek("p", SUBJECT)
        assert (outcome.decision, outcome.reason) == ("failed_closed", "backend_error")
    finally:
        redis_client.acl_deluser("no-get")


def test_numbers_the_scripts_cannot_take_are_refused_before_any_call() -> None:
    window = Window("default", 1, 1000, 1)
    with pytest.raises(ValueError, match="2\\*\\*48"):
        PolicyCall("fixed_window", (window,), 2**48)
    request = GroupRequest(
        counters=("q:{s}:p",),
        calls=(PolicyCall("fixed_window", (window,), 1),),
        now_ms=2**48,
        peek=False,
        max_regression_ms=-1,
        dedup_ttl_ms=5_000,
        cleanup_grace_ms=1_000,
        fingerprint=fingerprint("x"),
    )
    with pytest.raises(ValueError, match="2\\*\\*48"):
        request.args()


def test_a_value_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="layout"):
        decode_counter(b"\x00" + b"\x00" * 6 + b"\x01", "fixed_window", 1)


@pytest.mark.parametrize(
    ("stored", "windows_reset"),
    [
        (b"garbage", 0),  # a ledger of 103 bytes, then too few
        (b"\x51" + b"\x00" * 105, 0),  # a ledger of 81 bytes: more than it holds
        (b"\x00" * 20, 0),  # no ledger, then numbers of another policy's shape
        (b"", 0),
    ],
)
def test_a_string_not_in_the_layout_is_an_honest_failure_and_reset_clears_it(
    on_redis: Any, redis_client: Any, stored: bytes, windows_reset: int
) -> None:
    on_redis(p={"algorithm": "fixed_window", "windows": "5/m"})
    key = counter_of("p")
    redis_client.set(key, stored)
    if stored == b"":  # an empty string holds nothing: no counter
        assert django_quota.evaluate("p", SUBJECT).remaining == 4
        return
    for outcome in (django_quota.peek("p", SUBJECT), django_quota.evaluate("p", SUBJECT)):
        assert (outcome.decision, outcome.reason) == ("failed_closed", "backend_error")
    assert redis_client.get(key) == stored  # nothing written over it
    assert django_quota.reset("p", SUBJECT) == windows_reset
    assert not redis_client.exists(key)
    assert django_quota.evaluate("p", SUBJECT).remaining == 4



@pytest.mark.parametrize(
    ("algorithm", "windows", "numbers"),
    [
        ("fixed_window", "5/m", 1),
        ("sliding_window", "5/m", 2),
        ("token_bucket", "5/m", 2),
        ("sliding_log", "5/m", 1),
        ("fixed_window", {"a": "5/m", "b": "50/h"}, 2),  # the general script
    ],
)
def test_a_counter_of_the_earlier_string_layout_keeps_its_numbers_and_its_ledger(
    on_redis: Any, redis_client: Any, algorithm: str, windows: Any, numbers: int
) -> None:
    # The earlier layout: one byte of entry count, 9-byte entries without costs (their
    # fingerprints 40 bits: the first bit may be set), d, t, the numbers. An upgrade keeps
    # what every subject used, and a repeat of an evaluation charged before it.
    on_redis(p={"algorithm": algorithm, "windows": windows})
    key = counter_of("p")
    windows_count = 1 if isinstance(windows, str) else len(windows)
    # Ids whose 40-bit digest has its first bit set and clear, alternately.
    ids = [f"before-{index}" for index in range(64)]
    high = [i for i in ids if hashlib.blake2b(i.encode(), digest_size=5).digest()[0] >= 128]
    low = [i for i in ids if i not in high]
    old_ids = [pair[k] for pair in zip(high, low, strict=False) for k in (0, 1)][:8]

    def earlier(count: int) -> bytes:
        entries_ = b"".join(
            hashlib.blake2b(old_ids[j].encode(), digest_size=5).digest()
            + (START_MS % 2**32).to_bytes(4, "big")
            for j in range(count)
        )
        return (
            bytes((count,)) + entries_ + (0).to_bytes(6, "big")
            + START_MS.to_bytes(6, "big") + (4).to_bytes(6, "big") * numbers
        )

    # 4 used of 5; the sliding window also counts 4 in the previous window, the bucket's
    # deficit is just over 4 tokens, and the sliding log's numbers are its list, empty here.
    kept = {"fixed_window": 1, "sliding_window": 0, "token_bucket": 0, "sliding_log": 5}
    for count in (0, 1, 8):
        redis_client.set(key, earlier(count))
        assert django_quota.peek("p", SUBJECT).remaining == kept[algorithm]
        for j in range(count):  # a repeat of a charge made before the upgrade
            again = django_quota.evaluate("p", SUBJECT, evaluation_id=old_ids[j])
            assert again.remaining == kept[algorithm], (count, j)
        assert redis_client.get(key) == earlier(count)  # a repeat writes nothing
        outcome = django_quota.evaluate("p", SUBJECT, evaluation_id=f"after-{count}")
        if kept[algorithm]:
            assert (outcome.decision, outcome.remaining) == ("allowed", kept[algorithm] - 1)
        else:
            assert outcome.decision == "denied"
        if outcome.decision == "allowed":
            state, records = decode_counter(redis_client.get(key), algorithm, windows_count)
            assert state is not None and state["t"] == START_MS
            assert [entry.fingerprint for entry in entries(records)] == [
                *(fingerprint(old_ids[j]) for j in range(max(0, count - 7), count)),
                fingerprint(f"after-{count}"),
            ]
        redis_client.set(key, earlier(count))  # a reset drops its numbers, keeps its ledger
        assert django_quota.reset("p", SUBJECT) == windows_count
        assert django_quota.peek("p", SUBJECT).remaining == 5
        for j in range(count):  # a charge made before the upgrade and the reset
            again = django_quota.evaluate("p", SUBJECT, evaluation_id=old_ids[j])
            assert again.remaining == 5, (count, j)
        redis_client.delete(key)


def test_a_costed_charge_drops_as_many_old_entries_as_it_needs(
    on_redis: Any, redis_client: Any
) -> None:
    on_redis(p={"algorithm": "fixed_window", "windows": "100/h"})
    for index in range(8):  # a full ledger: 8 entries of cost 1, 72 bytes
        clock.set_to(START + index / 1000)
        django_quota.evaluate("p", SUBJECT, evaluation_id=f"one-{index}")
    clock.set_to(START + 0.008)
    django_quota.evaluate("p", SUBJECT, cost=7, evaluation_id="seven")
    state, records = decode_counter(redis_client.get(counter_of("p")), "fixed_window", 1)
    # 15 bytes for the new entry: the two oldest leave (72 - 18 + 15 = 69 bytes), and d is
    # the charge time of the newer of them, both younger than DEDUP_TTL.
    assert [(entry.fingerprint, entry.cost) for entry in entries(records)] == [
        *((fingerprint(f"one-{index}"), 1) for index in range(2, 8)),
        (fingerprint("seven"), 7),
    ]
    assert len(records) == 69
    assert state == {"t": START_MS + 8, "d": START_MS + 1, "c1": 15}
