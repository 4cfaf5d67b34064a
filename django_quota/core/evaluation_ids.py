"""The evaluation-id ledger of one counter: its entries, how it is searched and grown.

Its bytes are the same here and in Redis (``evaluate.lua`` mirrors these functions);
:mod:`django_quota.core.model` says how a group uses the ledgers of its counters.
"""

from __future__ import annotations

import struct

#: How many charged evaluation ids each counter remembers.
LEDGER_SIZE = 8
#: Bytes of one evaluation id's fingerprint (40 bits).
FINGERPRINT_BYTES = 5
#: Bytes of one ledger entry: the fingerprint, then the charge time modulo 2**32 ms.
ENTRY_BYTES = FINGERPRINT_BYTES + 4
STAMP_MODULUS = 2**32
#: Bytes of a full ledger.
LEDGER_FULL = LEDGER_SIZE * ENTRY_BYTES
#: An entry's charge time (modulo 2**32 ms), as it is stored.
_STAMP = struct.Struct(">I")


def _stamp_age(records: bytes, start: int, now: int) -> int:
    """Milliseconds since the entry at ``start`` was charged (modulo 2**32)."""
    at = int.from_bytes(records[start + FINGERPRINT_BYTES : start + ENTRY_BYTES], "big")
    return (now - at) % STAMP_MODULUS


def remembers(records: bytes, fingerprint: bytes, now: int, dedup_ttl_ms: int) -> bool:
    """Whether the ledger ``records`` holds ``fingerprint`` in an entry charged less than
    ``dedup_ttl_ms`` before ``now``."""
    for start in range(0, len(records), ENTRY_BYTES):
        if (
            records[start : start + FINGERPRINT_BYTES] == fingerprint
            and _stamp_age(records, start, now) < dedup_ttl_ms
        ):
            return True
    return False


def appended(
    records: bytes, fingerprint: bytes, now: int, dedup_ttl_ms: int
) -> tuple[bytes, int | None]:
    """The ledger with ``fingerprint`` charged at ``now`` appended, the oldest entry
    dropped when full; and that entry's charge time when it was younger than
    ``dedup_ttl_ms`` (else None)."""
    stamp = now % STAMP_MODULUS
    entry = fingerprint + _STAMP.pack(stamp)
    if len(records) < LEDGER_FULL:
        return records + entry, None
    age = (stamp - _STAMP.unpack_from(records, FINGERPRINT_BYTES)[0]) % STAMP_MODULUS
    return records[ENTRY_BYTES:] + entry, (now - age if age < dedup_ttl_ms else None)
