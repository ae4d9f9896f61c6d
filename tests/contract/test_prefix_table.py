"""Prefix affinity in the wire contract: the chain hash of token blocks (C, against a Python reference of the
definition in native/edgepath_slot.h), the prefix table a slot server publishes and how an agent reads it, and
where the table sits in the pool (right after the state words: one READ gets both)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.prefix import prefix_match
from hypothesis import given
from hypothesis import strategies as st

from edgepath.contract import wire
from edgepath.contract.pool import PoolError, SlotPool
from edgepath.native.abi import lib

BLOCK = wire.PREFIX_BLOCK
M64 = 2**64 - 1


def reference_chain(tokens: list[int], salt: int = 0) -> list[int]:
    """The header's definition, written out in Python."""
    h, out = lib.EP_PREFIX_SEED ^ salt, []
    for b in range(len(tokens) // BLOCK):
        for t in tokens[b * BLOCK : (b + 1) * BLOCK]:
            h = ((h ^ (t & 0xFFFFFFFF)) * lib.EP_PREFIX_MUL) & M64
            h ^= h >> 32
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & M64
        h ^= h >> 31
        h = h or 1
        out.append(h)
    return out


def ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 49152, n, dtype=np.int32)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5 * BLOCK + 7), st.integers(0, M64))
def test_the_c_chain_is_the_definition(tokens: list[int], salt: int) -> None:
    assert wire.prefix_chain(np.array(tokens, dtype=np.int32), salt).tolist() == reference_chain(tokens, salt)


def test_a_blocks_hash_names_the_whole_prefix_before_it() -> None:
    a = ids(4 * BLOCK)
    b = a.copy()
    b[BLOCK + 3] += 1  # one id differs in the second block
    ca, cb = wire.prefix_chain(a), wire.prefix_chain(b)
    assert len(ca) == 4 and ca[0] == cb[0]
    assert all(x != y for x, y in zip(ca[1:], cb[1:], strict=True))  # every later block differs too
    assert wire.prefix_chain(a[: 2 * BLOCK + 5]).tolist() == ca[:2].tolist()  # only whole blocks count
    assert len(wire.prefix_chain(a[: BLOCK - 1])) == 0
    same_block_elsewhere = np.concatenate([a[BLOCK : 2 * BLOCK], a[BLOCK : 2 * BLOCK]])
    assert wire.prefix_chain(same_block_elsewhere)[1] != ca[1]  # a block's hash depends on what precedes it


def test_the_table_holds_every_block_of_each_sequence_once_first_ones_first() -> None:
    system = ids(3 * BLOCK, seed=1)
    chat_a = np.concatenate([system, ids(2 * BLOCK + 10, seed=2)])
    chat_b = np.concatenate([system, ids(BLOCK, seed=3)])
    table = wire.prefix_table([(0, chat_a), (0, chat_b)], 16)
    assert table.dtype == np.uint64 and len(table) == 16
    held = table[table != 0].tolist()
    assert held == wire.prefix_chain(chat_a).tolist() + wire.prefix_chain(chat_b)[3:].tolist()  # system prompt once
    # An agent reads how much of a request's prefix the table holds, in whole blocks.
    assert prefix_match(table, chat_a) == 5
    assert prefix_match(table, np.concatenate([system, ids(BLOCK, seed=9)])) == 3  # shares the system prompt
    assert prefix_match(table, np.concatenate([chat_b, ids(BLOCK, seed=4)])) == 4  # a follow-up turn
    assert prefix_match(table, ids(4 * BLOCK, seed=5)) == 0
    assert prefix_match(table, system[: BLOCK - 1]) == 0  # shorter than a block: nothing to match


def test_a_full_table_keeps_the_first_sequences() -> None:
    first, second = ids(3 * BLOCK, seed=6), ids(3 * BLOCK, seed=7)
    table = wire.prefix_table([(0, first), (0, second)], 4)
    assert table.tolist() == [*wire.prefix_chain(first).tolist(), int(wire.prefix_chain(second)[0])]
    assert prefix_match(table, first) == 3 and prefix_match(table, second) == 1
    assert not wire.prefix_table([], 4).any()


def test_the_agents_reusable_chain_matches_like_the_function() -> None:
    request = ids(3 * BLOCK + 5, seed=8)
    table = wire.prefix_table([(0, request[: 2 * BLOCK])], 8)
    chain = wire.PrefixChain(4 * BLOCK)
    assert chain.compute(request) == 3
    assert chain.matched(table) == 2 == prefix_match(table, request)
    assert chain.matched(np.zeros(0, dtype=np.uint64)) == 0  # a server without a table
    assert chain.compute(ids(10 * BLOCK, seed=8)) == 4  # blocks past the buffer are left out
    chain.compute(ids(BLOCK - 1))
    assert chain.matched(table) == 0


def test_the_table_follows_the_state_words_and_is_in_the_header() -> None:
    plain = SlotPool.layout_for(3, 16, 16)
    dims = SlotPool.layout_for(3, 16, 16, prefix_entries=100)
    assert (plain["prefixes_offset"], plain["prefix_entries"]) == (0, 0)
    assert dims["prefix_entries"] == 100
    assert dims["prefixes_offset"] == dims["states_offset"] + 64  # 3 state words, padded to 64 bytes
    assert dims["doorbells_offset"] == dims["prefixes_offset"] + 832  # 800 bytes of table, padded
    assert dims["total_size"] == plain["total_size"] + 832
    buf = np.zeros(dims["total_size"], dtype=np.uint8)
    pool = SlotPool.create(buf, 3, 16, 16, 10**9, 1, prefix_entries=100)
    assert len(pool.prefixes) == 100 and not pool.prefixes.any()
    assert pool.prefixes.ctypes.data - buf.ctypes.data == dims["prefixes_offset"]
    SlotPool(buf)  # validates (a header whose table disagrees with the layout is refused below)
    buf[pool.header.dtype.fields["prefixes_offset"][1]] += 8
    with pytest.raises(PoolError, match="inconsistent"):
        SlotPool(buf)


def test_a_table_beyond_the_limit_is_refused() -> None:
    with pytest.raises(PoolError, match=f"prefix entries \\(allowed 0..{wire.PREFIX_ENTRIES_MAX}\\)"):
        SlotPool.layout_for(2, 16, 16, prefix_entries=wire.PREFIX_ENTRIES_MAX + 1)


def test_a_prefix_written_under_one_salt_is_not_found_under_another() -> None:
    """The tenant boundary in the table: the same tokens under two cache salts are named by different hashes, so
    an agent finds a server's prefix only for requests of the salt it was written under."""
    system = ids(3 * BLOCK, seed=11)
    a, b = wire.cache_salt(b"tenant-a"), wire.cache_salt(b"tenant-b")
    assert len({0, a, b}) == 3
    table = wire.prefix_table([(a, system)], 16)
    chain = wire.PrefixChain(4 * BLOCK)
    chain.compute(system, a)
    assert chain.matched(table) == 3
    for other in (b, 0):
        chain.compute(system, other)
        assert chain.matched(table) == 0
    assert prefix_match(table, system) == 0  # no salt: the anonymous namespace, not a's


def test_the_cache_salt_is_the_tenant_and_the_requests_own_salt() -> None:
    assert wire.cache_salt(b"") == 0  # no tenants, no cache_salt: one anonymous namespace, as before ABI 8
    assert wire.cache_salt(b"", "s") not in (0, wire.cache_salt(b"", "t"))
    assert wire.cache_salt(b"k", "s") != wire.cache_salt(b"j", "s")  # the same cache_salt in two tenants
    assert wire.cache_salt(b"k") != wire.cache_salt(b"k", "")  # an empty cache_salt is a salt of its own
    assert wire.cache_salt(b"k", "s") == wire.cache_salt(b"k", "s") < 2**64
