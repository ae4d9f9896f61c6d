"""The slot server's poller core (doorbell acceptance, lease scan) on plain memory: no transport,
no clock — time is passed in, so lease expiry is tested exactly."""

from __future__ import annotations

import numpy as np
import pytest

from edgepath.contract.pool import SlotPool
from edgepath.contract.wire import SlotWord, claim_word, doorbell_imm
from edgepath.native.abi import State, ffi, lib

LEASE_NS = 1_000_000


@pytest.fixture
def pool() -> SlotPool:
    return SlotPool.create(np.zeros(1 << 16, dtype=np.uint8), 4, 32, 32, LEASE_NS, 1)


def _claim(pool: SlotPool, slot: int, claimant: int) -> int:
    new = claim_word(pool.word(slot), claimant)
    pool.states[slot] = new
    pool.slots.requests[slot]["generation"] = new >> 32
    return new >> 32


def _accept(pool: SlotPool, entries: list[int], now: int = 0) -> tuple[list[tuple[int, int]], int]:
    ptr = ffi.cast("char *", ffi.from_buffer(pool.buf))
    slots, conns, rejected = ffi.new("uint32_t[16]"), ffi.new("uint32_t[16]"), ffi.new("int *")
    n = lib.ep_accept_doorbells(ptr, ffi.new("uint64_t[]", entries), len(entries), slots, conns, now, rejected)
    return [(slots[i], conns[i]) for i in range(n)], rejected[0]


def test_valid_doorbell_makes_the_slot_ready_and_stamps_the_time(pool: SlotPool) -> None:
    gen = _claim(pool, 2, claimant=7)
    ready, rejected = _accept(pool, [(7 << 32) | doorbell_imm(2, gen)], now=555)
    assert (ready, rejected) == ([(2, 7)], 0)
    assert pool.slot_word(2) == SlotWord(gen, State.READY, 7)
    assert int(pool.slots.results[2]["t_ready_ns"]) == 555


@pytest.mark.parametrize(
    "case", ["never claimed", "other claimant", "old generation", "slot out of range", "header generation mismatch"]
)
def test_bad_doorbells_are_rejected_and_change_nothing(pool: SlotPool, case: str) -> None:
    gen = _claim(pool, 1, claimant=7)
    entry = {
        "never claimed": (7 << 32) | doorbell_imm(0, 1),
        "other claimant": (8 << 32) | doorbell_imm(1, gen),
        "old generation": (7 << 32) | doorbell_imm(1, gen - 1),
        "slot out of range": (7 << 32) | doorbell_imm(9, gen),
        "header generation mismatch": (7 << 32) | doorbell_imm(1, gen),
    }[case]
    if case == "header generation mismatch":  # a torn or stale write of the request header
        pool.slots.requests[1]["generation"] = gen + 5
    before = pool.states.copy()
    ready, rejected = _accept(pool, [entry])
    assert (ready, rejected) == ([], 1)
    assert np.array_equal(pool.states, before)


def test_lease_runs_from_first_sighting_and_reclaims_only_stuck_claims(pool: SlotPool) -> None:
    ptr = ffi.cast("char *", ffi.from_buffer(pool.buf))
    seen_w, seen_t, out = ffi.new("uint64_t[4]"), ffi.new("uint64_t[4]"), ffi.new("uint32_t[4]")
    gen = _claim(pool, 0, claimant=3)
    _claim(pool, 1, claimant=4)
    assert lib.ep_scan_leases(ptr, seen_w, seen_t, 10_000, out, 4) == 0  # first sighting at t=10us
    _accept(pool, [(4 << 32) | doorbell_imm(1, 1)])  # slot 1 rang in time
    assert lib.ep_scan_leases(ptr, seen_w, seen_t, 10_000 + LEASE_NS - 1, out, 4) == 0
    assert lib.ep_scan_leases(ptr, seen_w, seen_t, 10_000 + LEASE_NS, out, 4) == 1
    assert out[0] == 0
    assert pool.slot_word(0) == SlotWord(gen, State.FREE, 0)
    assert pool.slot_word(1).state == State.READY
    # The expired claimer's late doorbell is now stale.
    assert _accept(pool, [(3 << 32) | doorbell_imm(0, gen)]) == ([], 1)


def test_a_reclaimed_slot_is_claimed_in_a_new_generation(pool: SlotPool) -> None:
    ptr = ffi.cast("char *", ffi.from_buffer(pool.buf))
    seen_w, seen_t, out = ffi.new("uint64_t[4]"), ffi.new("uint64_t[4]"), ffi.new("uint32_t[4]")
    old = _claim(pool, 3, claimant=1)
    lib.ep_scan_leases(ptr, seen_w, seen_t, 0, out, 4)
    assert lib.ep_scan_leases(ptr, seen_w, seen_t, LEASE_NS, out, 4) == 1
    new = _claim(pool, 3, claimant=2)
    assert new == old + 1
    assert _accept(pool, [(1 << 32) | doorbell_imm(3, old)]) == ([], 1)
    assert _accept(pool, [(2 << 32) | doorbell_imm(3, new)]) == ([(3, 2)], 0)
