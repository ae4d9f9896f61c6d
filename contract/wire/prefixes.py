"""Prefix affinity: what a slot server's model side holds, as chain hashes of token blocks under a cache salt (the
prefix table it publishes, the chain an agent computes for a request), and which salts a request may read."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from edgepath.native.abi import ffi, lib

#: tokens per block: a prefix is published and matched in whole blocks
PREFIX_BLOCK = lib.EP_PREFIX_BLOCK
#: the prefix table a slot server publishes when its handler keeps KV of earlier requests (8 bytes each)
PREFIX_ENTRIES = 256
PREFIX_ENTRIES_MAX = lib.EP_PREFIX_ENTRIES_MAX


def prefix_chain(tokens: np.ndarray, salt: int = 0) -> np.ndarray:
    """The chain hashes under ``salt`` (a request's ``cache_salt``) of the whole blocks of ``tokens`` (int32
    ids): entry ``b`` names the prefix of blocks ``0..b`` (the hash is defined in ``native/edgepath_slot.h``)."""
    ids = np.ascontiguousarray(tokens, dtype=np.int32)
    out = np.empty(len(ids) // PREFIX_BLOCK, dtype=np.uint64)
    n = lib.ep_prefix_chain(
        salt, ffi.from_buffer("int32_t[]", ids), len(ids), ffi.from_buffer("uint64_t[]", out), len(out)
    )
    return out[:n]


def cache_salt(namespace: bytes, salt: str | None = None) -> int:
    """The request header's ``cache_salt``: the prefix cache's namespace of a tenant (``namespace``: empty for
    the anonymous tenant) and a request's own ``cache_salt`` string, as 64 bits of SHA-256 (never 0); 0 when
    both are empty -- the one namespace of a server without tenants.  Two requests share cached KV only when
    their values are equal, so one tenant cannot name another's namespace without its key."""
    if not namespace and salt is None:
        return 0
    material = b"edgepath-cache-salt\0" + namespace + b"\0" + (b"" if salt is None else b"\1" + salt.encode())
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "little") or 1


#: the namespace of tenants that share their prefixes (``share_prefix``), which readers of the shared prefix read
PUBLIC_NAMESPACE = b"public"
#: its cache salt: what a request with :data:`FLAG_READ_PUBLIC` may reuse besides its own salt's prefixes
PUBLIC_SALT = cache_salt(PUBLIC_NAMESPACE)


def prefix_table(sequences: Iterable[tuple[int, np.ndarray]], entries: int) -> np.ndarray:
    """The table a slot server publishes for the token sequences its model side holds, each with the salt it
    was written under, the most useful first: the chain hashes of every whole block of each, each hash once,
    in that order, until ``entries`` are taken; unused entries are 0 (never a chain hash)."""
    table = np.zeros(entries, dtype=np.uint64)
    seen: set[int] = set()
    for salt, tokens in sequences:
        chain = prefix_chain(tokens, salt).tolist()
        if not chain or chain[-1] in seen:  # its last block is in: so is every block before it
            continue
        for h in chain:
            if len(seen) == entries:
                return table
            if h not in seen:
                table[len(seen)] = h
                seen.add(h)
    return table


class PrefixChain:
    """A request's chain hashes in a reusable buffer (an agent computes them once per request, from the ids
    already in its frame), and how much of it a server's published table holds."""

    __slots__ = ("_out", "blocks", "hashes")

    def __init__(self, max_tokens: int) -> None:
        self.hashes = np.zeros(max(1, max_tokens // PREFIX_BLOCK), dtype=np.uint64)
        self._out = ffi.from_buffer("uint64_t[]", self.hashes)
        self.blocks = 0

    def compute(self, tokens: np.ndarray, salt: int = 0) -> int:
        """Hash the whole blocks of ``tokens`` (a contiguous int32 view; those beyond the buffer are left
        out) under ``salt``; how many."""
        self.blocks = lib.ep_prefix_chain(
            salt, ffi.from_buffer("int32_t[]", tokens), len(tokens), self._out, len(self.hashes)
        )
        return self.blocks

    def matched(self, table: np.ndarray) -> int:
        """How many leading blocks of the chain ``table`` (a published prefix table) holds."""
        if not self.blocks or not len(table):
            return 0
        return lib.ep_prefix_match(ffi.from_buffer("uint64_t[]", table), len(table), self._out, self.blocks)


#: the request may also reuse prefixes written under :data:`PUBLIC_SALT`; what it writes stays under its own salt
FLAG_READ_PUBLIC = lib.EP_FLAG_READ_PUBLIC


def readable_salts(salt: int, flags: int) -> tuple[int, ...]:
    """The cache salts a request of ``salt`` and ``flags`` may reuse KV from: its own, and the public one when it
    reads the shared prefix (:data:`FLAG_READ_PUBLIC`)."""
    return (salt, PUBLIC_SALT) if flags & FLAG_READ_PUBLIC and salt != PUBLIC_SALT else (salt,)
