"""The evaluation-id ledger of one counter: its entries, how it is searched and grown.

Its bytes are the same here and in Redis (``evaluate.lua`` mirrors these functions);
:mod:`django_quota.core.model` says how a group uses the ledgers of its counters.

An entry records one charged evaluation: its fingerprint (5 bytes), then, when the
evaluation charged another cost than 1, that cost (6 bytes, big-endian), then the charge
time modulo 2**32 ms (4 bytes). The fingerprint's first bit says whether a cost follows
(:func:`~django_quota.core.protocol.fingerprint` leaves it 0), so an entry of cost 1
keeps its 9 bytes and one of another cost takes 15 (docs/refunds.md). The ledger keeps
the newest entries that fit in :attr:`LedgerLayout.BYTES`: the last 8 charges of cost 1,
at least the last 4 whatever their costs.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final, NamedTuple


class LedgerLayout:
    """The byte layout of a ledger and of its entries (``evaluate.lua`` mirrors it)."""

    #: How many charges of cost 1 each counter remembers.
    SIZE: Final = 8
    #: Bytes of one evaluation id's fingerprint (its first bit is the entry's cost flag).
    FINGERPRINT_BYTES: Final = 5
    #: Bytes of an entry of cost 1: the fingerprint, then the charge time modulo 2**32 ms.
    ENTRY_BYTES: Final = FINGERPRINT_BYTES + 4
    #: Bytes of an entry's cost, when it is not 1.
    COST_BYTES: Final = 6
    #: Set in an entry's first byte when a cost follows its fingerprint.
    COST_FLAG: Final = 0x80
    #: Charge times are stored modulo this (ms).
    STAMP_MODULUS: Final = 2**32
    #: The ledger's bound in bytes: a charge drops the oldest entries while it is over.
    BYTES: Final = SIZE * ENTRY_BYTES
    #: An entry's charge time (modulo 2**32 ms), as it is stored.
    STAMP: Final = struct.Struct(">I")


class Entry(NamedTuple):
    """One ledger entry: where it ends in the ledger's bytes, the fingerprint it
    records (its flag cleared), the cost it charged and its charge time modulo 2**32."""

    end: int
    fingerprint: bytes
    cost: int
    stamp: int


def entry_head(fingerprint: bytes, cost: int) -> bytes:
    """What an entry of ``fingerprint`` charged ``cost`` starts with: the fingerprint,
    or, for a cost other than 1, the fingerprint flagged and the cost after it (what
    ``evaluate.lua`` takes as its first argument and appends as it is)."""
    if cost == 1 or not fingerprint:
        return fingerprint
    flagged = bytes((fingerprint[0] | LedgerLayout.COST_FLAG,)) + fingerprint[1:]
    return flagged + cost.to_bytes(LedgerLayout.COST_BYTES, "big")


def entries(records: bytes) -> Iterator[Entry]:
    """The entries of the ledger ``records``, oldest first."""
    flag = LedgerLayout.COST_FLAG
    fingerprint_bytes = LedgerLayout.FINGERPRINT_BYTES
    cost_bytes = LedgerLayout.COST_BYTES
    unpack_stamp = LedgerLayout.STAMP.unpack_from
    start = 0
    size = len(records)
    while start < size:
        first = records[start]
        if first & flag:
            found = bytes((first ^ flag,)) + records[start + 1 : start + fingerprint_bytes]
            at = start + fingerprint_bytes + cost_bytes
            cost = int.from_bytes(records[start + fingerprint_bytes : at], "big")
        else:
            found = records[start : start + fingerprint_bytes]
            at = start + fingerprint_bytes
            cost = 1
        yield Entry(at + 4, found, cost, unpack_stamp(records, at)[0])
        start = at + 4


def remembers(records: bytes, fingerprint: bytes, now: int, dedup_ttl_ms: int) -> bool:
    """Whether the ledger ``records`` holds ``fingerprint`` in an entry charged less than
    ``dedup_ttl_ms`` before ``now``."""
    modulus = LedgerLayout.STAMP_MODULUS
    for entry in entries(records):
        if entry.fingerprint == fingerprint and (now - entry.stamp) % modulus < dedup_ttl_ms:
            return True
    return False


def appended(
    records: bytes, fingerprint: bytes, cost: int, now: int, dedup_ttl_ms: int
) -> tuple[bytes, int | None]:
    """The ledger with ``fingerprint`` charged ``cost`` at ``now`` appended, the oldest
    entries dropped while it is over :attr:`LedgerLayout.BYTES`; and the charge time of the
    newest one dropped younger than ``dedup_ttl_ms`` (else None)."""
    modulus = LedgerLayout.STAMP_MODULUS
    bound = LedgerLayout.BYTES
    stamp = now % modulus
    grown = records + entry_head(fingerprint, cost) + LedgerLayout.STAMP.pack(stamp)
    if len(grown) <= bound:
        return grown, None
    dropped_at = None
    start = 0
    for oldest in entries(grown):
        if len(grown) - start <= bound:
            break
        age = (stamp - oldest.stamp) % modulus
        if age < dedup_ttl_ms:
            dropped_at = now - age
        start = oldest.end
    return grown[start:], dropped_at
