"""Slot floors decided from state words alone (sans I/O, dpu/floors.py), and a model of a pool under any
interleaving of arrivals, ends and reclaims: a tenant under its floor is never refused, and a slot is only ever
taken from a tenant above its floor."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepath.contract import wire
from edgepath.contract.plan import under_floor
from edgepath.contract.wire import SlotWord
from edgepath.dpu import floors
from edgepath.native.abi import Event, State

QUIET, BUSY, OTHER = 1, 2, 3  # floor ids; 0 is a tenant without a floor


def words(*slots: tuple[State, int]) -> np.ndarray:
    """State words of one pool: (state, tenant) per slot, generation 5, claimant 1 (FREE words hold no tenant)."""
    return np.array(
        [SlotWord(5, s, 0 if s == State.FREE else 1, 0 if s == State.FREE else t).pack() for s, t in slots],
        dtype=np.uint64,
    )


def test_held_counts_every_slot_that_is_not_free_by_its_tenant() -> None:
    a = words((State.RUNNING, QUIET), (State.FREE, 0), (State.CLAIMED, BUSY), (State.DONE, BUSY))
    b = words((State.READY, 0), (State.RUNNING, BUSY))
    assert floors.held([a, b]) == Counter({BUSY: 3, QUIET: 1, 0: 1})
    assert floors.held([words((State.FREE, 0))]) == Counter()


def test_under_floor_only_for_a_tenant_with_a_floor() -> None:
    holdings = Counter({QUIET: 1, 0: 5})
    assert under_floor(QUIET, 2, holdings)
    assert not under_floor(QUIET, 1, holdings)
    assert under_floor(OTHER, 1, holdings)  # holds none
    assert not under_floor(0, 3, holdings)  # no floor id: never under a floor


def test_lent_slots_are_those_above_the_floor_and_all_of_a_tenant_without_one() -> None:
    holdings = Counter({QUIET: 3, BUSY: 1, 0: 2, 9: 4})
    table = {QUIET: 2, BUSY: 2}
    assert floors.above_floor(QUIET, table, holdings) == 1
    assert floors.above_floor(BUSY, table, holdings) == 0
    assert floors.above_floor(0, table, holdings) == 2
    assert floors.above_floor(9, table, holdings) == 0  # a floor not known here: never taken from


def test_victims_are_running_slots_of_tenants_above_their_floors_the_most_lent_first() -> None:
    pool = words(
        (State.RUNNING, BUSY),
        (State.RUNNING, 0),
        (State.CLAIMED, BUSY),  # not running yet: offered after every running one
        (State.RUNNING, QUIET),  # the reclaimer's own
        (State.RUNNING, BUSY),
        (State.RUNNING, OTHER),  # within its floor
    )
    holdings = floors.held([pool])
    assert holdings == Counter({BUSY: 3, 0: 1, QUIET: 1, OTHER: 1})
    table = {QUIET: 2, BUSY: 1, OTHER: 1}
    got = floors.victims(QUIET, [pool], table, holdings)
    # BUSY lends 2 (3 held, floor 1), the floorless tenant 1: BUSY's running slots first
    assert [(v.slot, v.tenant) for v in got] == [(0, BUSY), (4, BUSY), (1, 0), (2, BUSY)]
    assert all(v.generation == 5 and v.server == 0 for v in got)
    assert [v.slot for v in floors.victims(QUIET, [pool], table, holdings, start=2)] == [4, 0, 1, 2]
    assert [v.slot for v in floors.victims(QUIET, [pool], table, holdings, skip=frozenset({(0, 0)}))] == [4, 1, 2]


def test_of_one_tenants_running_slots_the_stream_that_has_run_least_is_taken_first() -> None:
    """Its cut throws away least: a flood of short requests under a floor takes back the slot a borrower refilled
    last, not a long answer near its end (tests/dpu/test_reclaim_rate.py)."""
    pool = words((State.RUNNING, 0), (State.RUNNING, 0), (State.RUNNING, 0), (State.CLAIMED, 0))
    since = np.array([3.0, 9.0, 1.0, 10.0])  # when each claim was first seen: slot 1 started last of those running
    got = floors.victims(QUIET, [pool], {QUIET: 1}, floors.held([pool]), since=[since])
    assert [v.slot for v in got] == [1, 0, 2, 3]  # running ones first, youngest first; then the one not started


def test_slots_claimed_but_not_started_are_victims_after_every_running_one() -> None:
    pool = words((State.CLAIMED, 0), (State.READY, 0), (State.RUNNING, QUIET))
    holdings = floors.held([pool])
    got = floors.victims(QUIET, [pool], {QUIET: 2}, holdings)
    assert [v.slot for v in got] == [1, 0]  # rung before claimed: it starts first
    other = words((State.RUNNING, 0))
    both = floors.victims(QUIET, [pool, other], {QUIET: 2}, floors.held([pool, other]))
    assert [(v.server, v.slot) for v in both] == [(1, 0), (0, 1), (0, 0)]  # a running slot on any server first


def test_no_victim_when_every_slot_is_held_within_floors() -> None:
    pool = words((State.RUNNING, BUSY), (State.RUNNING, OTHER))
    holdings = floors.held([pool])
    assert floors.victims(QUIET, [pool], {QUIET: 1, BUSY: 1, OTHER: 1}, holdings) == []


def test_reclaims_under_way_count_as_done() -> None:
    holdings = Counter({BUSY: 4, QUIET: 0})
    assert floors.moving(holdings, [(BUSY, QUIET), (BUSY, QUIET)]) == Counter({BUSY: 2, QUIET: 2})


# -- the model ---------------------------------------------------------------------------------------------
SLOTS = 6


@dataclass
class Pool:
    """A slot pool's state words stepped with the real state machine, a slot server that acts on reclaims in the
    order they arrive, and agents that decide with dpu/floors.py as :class:`~edgepath.dpu.floor_book.FloorBook` does."""

    floors_of: dict[int, int]
    agents: int
    words: np.ndarray = field(default_factory=lambda: np.zeros(SLOTS, dtype=np.uint64))
    reclaims: list[tuple[int, int, int, int]] = field(default_factory=list)  # (agent, slot, word, tenant) rung
    notices: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # (agent, slot, word, tenant, tries)
    pending: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)  # agent -> slot -> (word, tenant)
    refused_owners: int = 0
    taken_within_floor: int = 0
    handovers: int = 0
    tries: int = 8

    def holdings(self, agent: int) -> Counter[int]:
        mine = self.pending.get(agent, {})
        moves = [(wire.word_tenant(int(self.words[slot])), tenant) for slot, (_, tenant) in mine.items()]
        return floors.moving(floors.held([self.words]), moves)

    def claimant(self, agent: int) -> int:
        return agent + 1

    def arrive(self, agent: int, tenant: int, tries: int = 0) -> None:
        """A request of ``tenant`` at ``agent``: a free slot, else (under its floor) a slot taken back."""
        free = np.flatnonzero(wire.in_state(self.words, State.FREE))
        if len(free):
            slot = int(free[0])
            self._run(slot, wire.claim_word(int(self.words[slot]), self.claimant(agent), tenant))
            return
        floor = self.floors_of.get(tenant, 0)
        holdings = self.holdings(agent)
        if not under_floor(tenant, floor, holdings):
            return  # a borrower finds no free slot: 429, as always
        skip = frozenset((0, slot) for slot in self.pending.get(agent, {}))
        found = floors.victims(tenant, [self.words], self.floors_of, holdings, skip, start=agent * 7 + tries)
        if not found:
            self.refused_owners += 1
            return
        victim = found[0]
        word = wire.claim_word(wire.free_word(victim.generation), self.claimant(agent), tenant)
        self.pending.setdefault(agent, {})[victim.slot] = (word, tenant)
        self.reclaims.append((agent, victim.slot, word, tries))

    def _run(self, slot: int, claimed: int) -> None:
        gen = wire.word_generation(claimed)
        self.words[slot] = wire.step(wire.step(claimed, Event.DOORBELL, gen), Event.START, gen)

    def claim_only(self, agent: int, tenant: int) -> None:
        """A claim of ``agent``'s that is not rung yet (its agent between the CAS and the doorbell)."""
        slot = int(np.flatnonzero(wire.in_state(self.words, State.FREE))[0])
        self.words[slot] = wire.claim_word(int(self.words[slot]), self.claimant(agent), tenant)

    def start(self, slot: int) -> None:
        """The claim on ``slot`` is rung and the slot server starts it."""
        word = int(self.words[slot])
        assert wire.word_state(word) == State.CLAIMED
        self._run(slot, word)

    def end(self, slot: int) -> None:
        """A running stream ends by itself: RUNNING -> DONE -> FREE."""
        word = int(self.words[slot])
        if wire.word_state(word) == State.RUNNING:
            gen = wire.word_generation(word)
            self.words[slot] = wire.step(wire.step(word, Event.COMPLETE, gen), Event.RELEASE, gen)

    def serve_reclaim(self) -> None:
        """The slot server acts on the oldest reclaim: hands the slot over when it still runs the generation
        before the word's, and tells the reclaimer either way."""
        agent, slot, word, tries = self.reclaims.pop(0)
        cur = int(self.words[slot])
        gen = wire.word_generation(cur)
        if wire.word_state(cur) == State.RUNNING and wire.next_generation(gen) == wire.word_generation(word):
            owner = wire.word_tenant(cur)
            held = sum(
                1 for w in self.words.tolist() if wire.word_state(w) != State.FREE and wire.word_tenant(w) == owner
            )
            if owner and held <= self.floors_of.get(owner, 0):
                self.taken_within_floor += 1  # counted here, independently of dpu/floors.py
            self.handovers += 1
            self.words[slot] = wire.step(
                wire.step(cur, Event.COMPLETE, gen), Event.HANDOVER, gen, wire.word_holder(word)
            )
        self.notices.append((agent, slot, word, wire.word_tenant(word), tries))

    def settle(self, at: int) -> None:
        """A reclaimer reads the word: handed over -> it runs; FREE in the generation before -> one CAS; else it
        tries again (a free slot, another slot taken back), at most ``tries`` times."""
        agent, slot, word, tenant, tries = self.notices.pop(at)
        del self.pending[agent][slot]
        cur = int(self.words[slot])
        if wire.word_state(cur) == State.FREE and wire.next_generation(wire.word_generation(cur)) == (
            wire.word_generation(word)
        ):
            cur = self.words[slot] = word
        if cur == word:
            self._run(slot, word)
        elif tries + 1 < self.tries:
            self.arrive(agent, tenant, tries + 1)
        elif under_floor(tenant, self.floors_of.get(tenant, 0), self.holdings(agent)):
            self.refused_owners += 1

    def drain(self) -> None:
        while self.reclaims or self.notices:
            if self.reclaims:
                self.serve_reclaim()
            while self.notices:
                self.settle(0)


EVENTS = st.one_of(
    st.tuples(st.just("flood"), st.integers(0, 1), st.sampled_from([0, BUSY])),
    st.tuples(st.just("arrive"), st.integers(0, 1), st.sampled_from([0, 0, QUIET, BUSY, OTHER])),
    st.tuples(st.just("end"), st.integers(0, SLOTS - 1), st.just(0)),
    st.tuples(st.just("serve"), st.just(0), st.just(0)),
    st.tuples(st.just("settle"), st.integers(0, 7), st.just(0)),
)
FLOORS = st.fixed_dictionaries({QUIET: st.integers(1, 3), BUSY: st.integers(0, 2), OTHER: st.integers(0, 1)})


@settings(max_examples=300, deadline=None)
@given(floors_of=FLOORS, events=st.lists(EVENTS, max_size=80), agents=st.sampled_from([1, 2]))
def test_under_any_interleaving_a_tenant_under_its_floor_is_never_refused(
    floors_of: dict[int, int], events: list[tuple[str, int, int]], agents: int
) -> None:
    """Floors that fit in the slots (their sum at most the slots), borrowers that fill every free slot, streams that
    end by themselves, reclaims served and answered in any order, one or two agents on the pool: a request of a
    tenant under its floor (counting its own agent's reclaims under way) always gets a slot -- free, or taken back
    from a tenant above its floor -- and every reclaim is answered once."""
    floors_of = {t: f for t, f in floors_of.items() if f}
    assert sum(floors_of.values()) <= SLOTS
    pool = Pool(floors_of, agents)
    for kind, a, tenant in events:
        b = tenant if tenant in floors_of else 0  # a tenant without a floor has no floor id
        if kind == "flood":  # a noisy tenant's closed loop takes every slot that is free
            for _ in range(int(np.count_nonzero(wire.in_state(pool.words, State.FREE)))):
                pool.arrive(a % agents, b)
        elif kind == "arrive":
            pool.arrive(a % agents, b)
        elif kind == "end":
            pool.end(a)
        elif kind == "serve" and pool.reclaims:
            pool.serve_reclaim()
        elif kind == "settle" and pool.notices:
            pool.settle(a % len(pool.notices))
    pool.drain()
    assert pool.refused_owners == 0
    assert pool.taken_within_floor == 0
    assert not any(pool.pending.values())  # every reclaim answered once
    # every word is a well-formed one: its tenant set while held, none while FREE
    for word in pool.words.tolist():
        slot = SlotWord.unpack(word)
        assert slot.state in (State.FREE, State.RUNNING)
        assert (slot.tenant == 0) if slot.state == State.FREE else slot.claimant in range(1, agents + 1)


def test_a_quiet_tenant_takes_its_floor_back_from_a_noisy_one_that_filled_the_pool() -> None:
    pool = Pool({QUIET: 2}, agents=2)
    for _ in range(SLOTS):
        pool.arrive(1, 0)  # the noisy, floorless tenant fills every slot through the other agent
    assert floors.held([pool.words]) == Counter({0: SLOTS})
    pool.arrive(0, QUIET)
    pool.arrive(0, QUIET)
    pool.arrive(0, QUIET)  # its floor is 2: a third finds no free slot and takes nothing back
    assert len(pool.reclaims) == 2
    pool.drain()
    assert floors.held([pool.words]) == Counter({0: SLOTS - 2, QUIET: 2})
    assert pool.refused_owners == 0


def test_a_tenant_under_its_floor_is_not_refused_while_every_lent_slot_is_claimed_but_not_started() -> None:
    """A noisy closed loop re-claims every slot the moment it frees; a quiet request that comes just then finds no
    running slot to take back.  It asks for one not started yet: the slot server cannot end it yet and says so, the
    claim starts, and the next try takes it (before, the request was refused: tests/system/test_serve_floors.py)."""
    pool = Pool({QUIET: 1}, agents=2)
    for _ in range(SLOTS):
        pool.claim_only(1, 0)
    pool.arrive(0, QUIET)
    assert pool.refused_owners == 0 and len(pool.reclaims) == 1
    pool.serve_reclaim()  # not running yet: no hand-over, the reclaimer is told
    assert pool.handovers == 0
    for slot in range(SLOTS):
        pool.start(slot)
    pool.drain()  # the reclaimer tries again, on a running slot now
    assert pool.refused_owners == 0 and pool.handovers == 1
    assert floors.held([pool.words]) == Counter({0: SLOTS - 1, QUIET: 1})
