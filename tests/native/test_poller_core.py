"""The slot server's poller core (doorbell acceptance, lease scan) on plain memory: no transport,
no clock — time is passed in, so lease expiry is tested exactly."""

from __future__ import annotations

import numpy as np
import pytest

from edgepath.contract.pool import SlotPool
from edgepath.contract.wire import SlotWord, claim_word, doorbell_imm
from edgepath.native.abi import Event, State, ffi, lib
from edgepath.slots.owned import OwnedWords

LEASE_NS = 1_000_000


@pytest.fixture
def pool() -> SlotPool:
    return SlotPool.create(np.zeros(1 << 16, dtype=np.uint8), 4, 32, 32, LEASE_NS, 1)


class Core:
    """The poller core's C calls on one pool, with the words the server last stored (slots/owned.py)."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.ptr = ffi.cast("char *", ffi.from_buffer(pool.buf))
        self.owned = OwnedWords(pool.states)
        self.seen_w, self.seen_t = ffi.new("uint64_t[4]"), ffi.new("uint64_t[4]")
        self.out = ffi.new("uint32_t[4]")

    def accept(self, entries: list[int], now: int = 0) -> tuple[list[tuple[int, int]], int]:
        slots, conns, rejected = ffi.new("uint32_t[16]"), ffi.new("uint32_t[16]"), ffi.new("int *")
        entry_array = ffi.new("uint64_t[]", entries)
        o = self.owned
        n = lib.ep_accept_doorbells(
            self.ptr, o.ptr, o.restored_ptr, entry_array, len(entries), slots, conns, now, rejected
        )
        return [(slots[i], conns[i]) for i in range(n)], rejected[0]

    def scan(self, now: int) -> int:
        o = self.owned
        return int(lib.ep_scan_leases(self.ptr, o.ptr, o.restored_ptr, self.seen_w, self.seen_t, now, self.out, 4))

    def step(self, slot: int, event: Event) -> int:
        return self.owned.step(slot, event, self.pool.slot_word(slot).generation)


@pytest.fixture
def core(pool: SlotPool) -> Core:
    return Core(pool)


def _claim(pool: SlotPool, slot: int, claimant: int) -> int:
    new = claim_word(pool.word(slot), claimant)
    pool.states[slot] = new
    pool.slots.requests[slot]["generation"] = new >> 32
    return new >> 32


def test_valid_doorbell_makes_the_slot_ready_and_stamps_the_time(pool: SlotPool, core: Core) -> None:
    gen = _claim(pool, 2, claimant=7)
    ready, rejected = core.accept([(7 << 32) | doorbell_imm(2, gen)], now=555)
    assert (ready, rejected) == ([(2, 7)], 0)
    assert pool.slot_word(2) == SlotWord(gen, State.READY, 7)
    assert int(pool.slots.results[2]["t_ready_ns"]) == 555


@pytest.mark.parametrize(
    "case", ["never claimed", "other claimant", "old generation", "slot out of range", "header generation mismatch"]
)
def test_bad_doorbells_are_rejected_and_change_nothing(pool: SlotPool, core: Core, case: str) -> None:
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
    ready, rejected = core.accept([entry])
    assert (ready, rejected) == ([], 1)
    assert np.array_equal(pool.states, before)


def test_lease_runs_from_first_sighting_and_reclaims_only_stuck_claims(pool: SlotPool, core: Core) -> None:
    gen = _claim(pool, 0, claimant=3)
    _claim(pool, 1, claimant=4)
    assert core.scan(10_000) == 0  # first sighting at t=10us
    core.accept([(4 << 32) | doorbell_imm(1, 1)])  # slot 1 rang in time
    assert core.scan(10_000 + LEASE_NS - 1) == 0
    assert core.scan(10_000 + LEASE_NS) == 1
    assert core.out[0] == 0
    assert pool.slot_word(0) == SlotWord(gen, State.FREE, 0)
    assert pool.slot_word(1).state == State.READY
    # The expired claimer's late doorbell is now stale.
    assert core.accept([(3 << 32) | doorbell_imm(0, gen)]) == ([], 1)


def test_a_reclaimed_slot_is_claimed_in_a_new_generation(pool: SlotPool, core: Core) -> None:
    old = _claim(pool, 3, claimant=1)
    core.scan(0)
    assert core.scan(LEASE_NS) == 1
    new = _claim(pool, 3, claimant=2)
    assert new == old + 1
    assert core.accept([(1 << 32) | doorbell_imm(3, old)]) == ([], 1)
    assert core.accept([(2 << 32) | doorbell_imm(3, new)]) == ([(3, 2)], 0)


def _run_to(core: Core, slot: int, *events: Event) -> list[int]:
    """The server's own steps on ``slot``; the word after each."""
    words = []
    for event in events:
        assert core.step(slot, event) == lib.EP_OK
        words.append(core.pool.word(slot))
    return words


def test_a_step_written_back_by_a_failed_remote_cas_is_stepped_on_from_what_the_server_stored(
    pool: SlotPool, core: Core
) -> None:
    """soft-RoCE (Linux 6.1) stores the word a failed CAS read: a claim that read the slot before the server's
    step can undo it.  The server's next step starts from what it stored, and counts the write-back."""
    gen = _claim(pool, 2, claimant=7)
    claimed = pool.word(2)
    assert core.accept([(7 << 32) | doorbell_imm(2, gen)]) == ([(2, 7)], 0)
    pool.states[2] = claimed  # the write-back lands after CLAIMED -> READY
    _run_to(core, 2, Event.START)
    assert pool.slot_word(2) == SlotWord(gen, State.RUNNING, 7) and core.owned.restored == 1
    running, _ = _run_to(core, 2, Event.COMPLETE, Event.RELEASE)
    assert pool.slot_word(2) == SlotWord(gen, State.FREE, 0)
    pool.states[2] = running  # one read before COMPLETE, stored after RELEASE: two steps undone
    assert core.scan(0) == 0
    assert pool.slot_word(2) == SlotWord(gen, State.FREE, 0) and core.owned.restored == 2


def test_a_cycle_s_last_step_written_back_is_stored_again_by_the_lease_scan(pool: SlotPool, core: Core) -> None:
    """Nothing else would move a word after DONE -> FREE or CLAIMED -> FREE: the scan puts it back."""
    gen = _claim(pool, 1, claimant=4)
    core.accept([(4 << 32) | doorbell_imm(1, gen)])
    done = _run_to(core, 1, Event.START, Event.COMPLETE, Event.RELEASE)[1]
    pool.states[1] = done
    stuck = _claim(pool, 3, claimant=5)
    claimed = pool.word(3)
    assert core.scan(0) == 0 and core.scan(LEASE_NS) == 1  # slot 3's lease ran out
    pool.states[3] = claimed
    assert core.scan(LEASE_NS + 1) == 0  # restored, not expired again
    assert pool.slot_word(1) == SlotWord(gen, State.FREE, 0) and pool.slot_word(3) == SlotWord(stuck, State.FREE, 0)
    assert core.owned.restored == 2


def test_words_the_server_did_not_move_past_are_left_alone(pool: SlotPool, core: Core) -> None:
    """A claim of the next generation, a slot the server never stepped, a word it stored: not write-backs."""
    gen = _claim(pool, 0, claimant=2)
    core.accept([(2 << 32) | doorbell_imm(0, gen)])
    _run_to(core, 0, Event.START, Event.COMPLETE, Event.RELEASE)
    _claim(pool, 0, claimant=3)  # the next generation
    _claim(pool, 1, claimant=6)  # never stepped by the server
    core.accept([(1 << 32) | doorbell_imm(2, _claim(pool, 2, claimant=1))])
    running = _run_to(core, 2, Event.START)[0]
    before = pool.states.copy()
    assert core.scan(0) == 0
    assert np.array_equal(pool.states, before) and pool.word(2) == running and core.owned.restored == 0
