"""Model-based test of the slot pool under adversarial interleavings (hypothesis).

Claimers CAS slots, write, ring (in time, late, or for the wrong generation), stall or crash;
the poller accepts doorbells, runs, completes and releases; time advances and leases expire;
a failed remote CAS stores back a word it read before some of the server's steps (soft-RoCE on
Linux 6.1 does).  The real C code (CAS, ep_accept_doorbells, ep_apply_owned, ep_scan_leases) runs
on real pool memory, and after every step the pool must equal an independent model of what should
have happened -- a written-back word until the server's next step or scan on it puts it right.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edgepath.contract.pool import SlotPool
from edgepath.contract.wire import SlotWord, claim_word, doorbell_imm
from edgepath.native.abi import Event, State, ffi, lib
from edgepath.slots.owned import OwnedWords

SLOTS, CLAIMERS, LEASE = 3, 3, 100


class PoolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf = np.zeros(1 << 15, dtype=np.uint8)
        self.pool = SlotPool.create(self.buf, SLOTS, 8, 8, LEASE, 1)
        self.ptr = ffi.cast("char *", ffi.from_buffer(self.buf))
        self.states = ffi.cast("uint64_t *", self.ptr + self.pool.states_offset)
        self.seen_w, self.seen_t = ffi.new(f"uint64_t[{SLOTS}]"), ffi.new(f"uint64_t[{SLOTS}]")
        self.out = ffi.new(f"uint32_t[{SLOTS}]")
        self.owned = OwnedWords(self.pool.states)
        self.now = 0
        # the model
        self.model = [SlotWord(0, State.FREE, 0) for _ in range(SLOTS)]
        self.first_seen: dict[int, int] = {}  # slot -> time the scan first saw this CLAIMED word
        self.holds: dict[int, tuple[int, int]] = {}  # claimant -> (slot, generation) it believes it owns
        self.rejected = 0
        self.read_back: dict[int, int] = {}  # slot -> the word a failed remote CAS read and will store back
        self.written_back: dict[int, int] = {}  # slot -> the stale word it stored, until the server puts it right

    # -- claimers -------------------------------------------------------------------
    @rule(claimant=st.integers(1, CLAIMERS), slot=st.integers(0, SLOTS - 1), stale_guess=st.booleans())
    def claim(self, claimant: int, slot: int, stale_guess: bool) -> None:
        if claimant in self.holds or self.read_back:  # remote atomics run one at a time (rxe: one lock)
            return
        cur = int(self.states[slot])
        expected = cur if not stale_guess else SlotWord(max(0, (cur >> 32) - 1), State.FREE, 0).pack()
        if SlotWord.unpack(expected).state != State.FREE:
            return
        desired = claim_word(expected, claimant)
        found = lib.ep_cas64(self.states + slot, expected, desired)
        m = self.model[slot]
        if m.state == State.FREE and m.pack() == expected:
            assert found == expected
            self.model[slot] = SlotWord(m.generation + 1, State.CLAIMED, claimant)
            self.holds[claimant] = (slot, m.generation + 1)
            req = self.pool.slots.requests[slot]
            req["generation"] = m.generation + 1
        else:
            assert found != expected and found == self.written_back.get(slot, m.pack())

    @rule(claimant=st.integers(1, CLAIMERS), generation_skew=st.sampled_from([0, 0, 0, -1, 1]))
    def ring(self, claimant: int, generation_skew: int) -> None:
        """The claimer rings its doorbell -- possibly late (after its lease) or for a wrong generation."""
        if claimant not in self.holds:
            return
        slot, gen = self.holds.pop(claimant)
        rung = gen + generation_skew
        entries = ffi.new("uint64_t[1]", [(claimant << 32) | doorbell_imm(slot, rung)])
        ready_s, ready_c, rejected = ffi.new("uint32_t[1]"), ffi.new("uint32_t[1]"), ffi.new("int *")
        o = self.owned
        n = lib.ep_accept_doorbells(self.ptr, o.ptr, o.restored_ptr, entries, 1, ready_s, ready_c, self.now, rejected)
        if n:
            self.written_back.pop(slot, None)
        m = self.model[slot]
        valid = (
            m.state == State.CLAIMED
            and m.claimant == claimant
            and (m.generation & 0xFFFF) == (rung & 0xFFFF)
            and m.generation == gen
        )
        if valid:
            assert (n, rejected[0]) == (1, 0) and (ready_s[0], ready_c[0]) == (slot, claimant)
            self.model[slot] = SlotWord(m.generation, State.READY, claimant)
        else:
            assert (n, rejected[0]) == (0, 1)

    @rule(claimant=st.integers(1, CLAIMERS))
    def crash(self, claimant: int) -> None:
        """The claimer vanishes without ringing: only the lease can free its slot."""
        self.holds.pop(claimant, None)

    @precondition(lambda self: not self.read_back)
    @rule(slot=st.integers(0, SLOTS - 1))
    def failed_remote_cas_reads(self, slot: int) -> None:
        """A claim whose compare fails reads the word (soft-RoCE, Linux 6.1: and will store it back)."""
        word = int(self.states[slot])
        if SlotWord.unpack(word).state != State.FREE:  # a FREE word stored back is the same word: no one moves it
            self.read_back[slot] = word

    @precondition(lambda self: bool(self.read_back))
    @rule()
    def failed_remote_cas_stores_back(self) -> None:
        """... stores it back, after whatever steps the server took on the slot meanwhile."""
        slot, word = self.read_back.popitem()
        self.states[slot] = word
        if word != self.model[slot].pack():
            self.written_back[slot] = word

    # -- the slot server ------------------------------------------------------------
    @precondition(lambda self: any(m.state in (State.READY, State.RUNNING, State.DONE) for m in self.model))
    @rule(slot=st.integers(0, SLOTS - 1))
    def serve_step(self, slot: int) -> None:
        m = self.model[slot]
        event, nxt = {
            State.READY: (Event.START, State.RUNNING),
            State.RUNNING: (Event.COMPLETE, State.DONE),
            State.DONE: (Event.RELEASE, State.FREE),
        }.get(m.state, (None, None))
        if event is None:
            return
        assert self.owned.step(slot, event, m.generation) == lib.EP_OK
        self.model[slot] = SlotWord(m.generation, nxt, 0 if nxt == State.FREE else m.claimant)
        self.written_back.pop(slot, None)

    @rule(dt=st.sampled_from([1, 10, 50, LEASE, 2 * LEASE]))
    def tick(self, dt: int) -> None:
        self.now += dt
        n = self._scan()
        self.written_back.clear()
        expired = {self.out[i] for i in range(n)}
        for slot, m in enumerate(self.model):
            if m.state != State.CLAIMED:
                self.first_seen.pop(slot, None)
                continue
            key = (slot, m.pack())
            if self.first_seen.get(slot, (None, None))[0] != key:
                self.first_seen[slot] = (key, self.now)
                assert slot not in expired
            elif self.now - self.first_seen[slot][1] >= LEASE:
                assert slot in expired
                self.model[slot] = SlotWord(m.generation, State.FREE, 0)
                self.first_seen.pop(slot)
            else:
                assert slot not in expired

    # -- what must always hold ------------------------------------------------------------
    @invariant()
    def memory_equals_model(self) -> None:
        for i in range(SLOTS):
            if i in self.written_back:
                assert int(self.states[i]) == self.written_back[i]
            else:
                assert SlotWord.unpack(int(self.states[i])) == self.model[i]

    @invariant()
    def no_slot_has_two_owners(self) -> None:
        owners = [
            slot
            for slot, gen in self.holds.values()
            if self.model[slot].generation == gen and self.model[slot].state == State.CLAIMED
        ]
        assert len(owners) == len(set(owners))

    def _scan(self) -> int:
        o = self.owned
        return int(
            lib.ep_scan_leases(self.ptr, o.ptr, o.restored_ptr, self.seen_w, self.seen_t, self.now, self.out, SLOTS)
        )

    def teardown(self) -> None:
        """Drain: whatever is in flight finishes and leases run out -> every slot FREE."""
        for slot, m in enumerate(self.model):
            for event in {
                State.READY: (Event.START, Event.COMPLETE, Event.RELEASE),
                State.RUNNING: (Event.COMPLETE, Event.RELEASE),
                State.DONE: (Event.RELEASE,),
            }.get(m.state, ()):
                assert self.owned.step(slot, event, m.generation) == lib.EP_OK
        for _ in range(2):
            self.now += LEASE
            self._scan()
        assert all(SlotWord.unpack(int(self.states[i])).state == State.FREE for i in range(SLOTS))


PoolModel.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPoolModel = PoolModel.TestCase
