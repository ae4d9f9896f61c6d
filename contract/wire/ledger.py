"""The quota ledger's words: tenants' quota buckets as words every edge debits by remote CAS (docs/TENANTS.md),
the region a ledger home exports and what it tells an edge."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from edgepath.contract.wire.hello import ROLE, InfoInvalid, info_ints
from edgepath.transports.base import Access

#: the region a ledger home exports: ``entries`` pairs of u64 words ``[key][bucket]``, all 0 when made
LEDGER_REGION = "ledger"
#: edges only compare-and-swap its words (a failed CAS is their read): nothing else is granted
LEDGER_ACCESS = Access.REMOTE_ATOMIC
#: entries of a ledger: one per (tenant, unit, window, limit) used since the home started
LEDGER_ENTRIES = 16384
#: the keys a ledger home sends every edge: what it is, and how many entries its region holds
LEDGER_ROLE, LEDGER_ENTRIES_KEY = "ledger", "ledger_entries"
#: the largest quota a bucket word keeps exact: a bucket's clock wraps at 2^64, and an idle bucket's word must stay
#: within 2^63 tokens of it (2^40 a minute: 16 years idle)
QUOTA_MAX = 2**40
_U64 = (1 << 64) - 1


def ledger_hello(entries: int) -> dict[str, Any]:
    """What a ledger home tells an edge."""
    return {ROLE: LEDGER_ROLE, LEDGER_ENTRIES_KEY: entries}


def read_ledger_hello(info: Mapping[str, Any]) -> int:
    """The entries of the ledger a home's ``info`` describes; :class:`InfoInvalid` when it is not a ledger home."""
    if info.get(ROLE) != LEDGER_ROLE:
        raise InfoInvalid(f"not a quota ledger (role {info.get(ROLE)!r})")
    (entries,) = info_ints(info, LEDGER_ENTRIES_KEY)
    if entries < 1:
        raise InfoInvalid(f"a ledger of {entries} entries")
    return entries


def ledger_key(tenant: str, unit: str, window: str, limit: int) -> int:
    """The key word of a tenant's bucket: 64 bits of SHA-256 of its tenant, unit (tokens, requests), window
    (minute, day) and limit (a changed limit is another bucket, so that every word is read at one scale); never
    0, the key of an unused entry."""
    material = f"edgepath-quota\0{tenant}\0{unit}\0{window}\0{limit}".encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "little") or 1


def bucket_clock(now_ns: int, limit: int, period_ns: int) -> int:
    """A bucket's clock at ``now_ns`` (Unix time: every edge reads its own): tokens (or requests) that have refilled
    since the epoch at ``limit`` per ``period_ns``, modulo 2^64."""
    return (now_ns * limit // period_ns) & _U64


def bucket_debt(word: int, clock: int) -> int:
    """What a bucket word owes at ``clock``: how far its word is ahead of the clock (the bucket holds its limit less
    that); 0 or less: full.  A word of 0 is a bucket never used: full."""
    if not word:
        return 0
    ahead = (word - clock) & _U64
    return ahead - (1 << 64) if ahead >> 63 else ahead


def bucket_word(clock: int, debt: int) -> int:
    """The word of a bucket that owes ``debt`` at ``clock``."""
    return (clock + debt) & _U64
