"""The shared transition step (``ep_step``, the code the CPU and CUDA pollers both run),
checked exhaustively against a reference model written independently here."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgepath.contract.pool import PoolError, SlotPool
from edgepath.contract.wire import SlotWord, TransitionRefused, claim_word, doorbell_imm, doorbell_word, step
from edgepath.native.abi import Event, State, StepError, ffi, lib

# The reference model: event -> (state it needs, state it leads to).
LEGAL = {
    Event.DOORBELL: (State.CLAIMED, State.READY),
    Event.START: (State.READY, State.RUNNING),
    Event.COMPLETE: (State.RUNNING, State.DONE),
    Event.RELEASE: (State.DONE, State.FREE),
    Event.EXPIRE: (State.CLAIMED, State.FREE),
    Event.HANDOVER: (State.DONE, State.CLAIMED),
}
GENERATION_WRAP = 1 << 24  # the state word's generation field: 24 bits (ABI 10)


def reference(word: SlotWord, event: Event, generation: int, holder: int) -> SlotWord | StepError:
    """``holder``: tenant << 24 | claimant, what CLAIM and HANDOVER name; the tenant stays until FREE."""
    claimant, tenant = holder % (1 << 24), holder >> 24
    if event == Event.CLAIM:
        if word.state != State.FREE:
            return StepError.STATE
        if claimant == 0:
            return StepError.EVENT
        return SlotWord((word.generation + 1) % GENERATION_WRAP, State.CLAIMED, claimant, tenant)
    if event == Event.HANDOVER and claimant == 0:
        return StepError.EVENT
    if generation != word.generation:
        return StepError.STALE
    need, to = LEGAL[event]
    if word.state != need:
        return StepError.STATE
    if event == Event.HANDOVER:
        return SlotWord((word.generation + 1) % GENERATION_WRAP, State.CLAIMED, claimant, tenant)
    if to == State.FREE:
        return SlotWord(word.generation, to, 0, 0)
    return SlotWord(word.generation, to, word.claimant, word.tenant)


GENERATIONS = (0, 1, 7, 0xFFFF, 0x10000, 0xFFFFFF)
CLAIMANTS = (0, 1, 42, lib.EP_CLAIMANT_MAX)
TENANTS = (0, 1, lib.EP_TENANT_MAX)
HOLDERS = (0, 5, lib.EP_CLAIMANT_MAX + 1, (3 << 24) | 9, (lib.EP_TENANT_MAX << 24) | lib.EP_CLAIMANT_MAX)


@pytest.mark.parametrize("event", list(Event))
def test_every_state_event_generation_combination_matches_the_model(event: Event) -> None:
    checked = 0
    for state, gen, who, tenant, arg_gen, holder in itertools.product(
        State, GENERATIONS, CLAIMANTS, TENANTS, (0, 1, 7, 0xFFFFFF, 0xFFFFFFFF), HOLDERS
    ):
        word = SlotWord(gen, state, who, tenant)
        expected = reference(word, event, arg_gen, holder)
        try:
            got: SlotWord | StepError = SlotWord.unpack(step(word.pack(), event, arg_gen, holder))
        except TransitionRefused as refused:
            assert refused.word == word.pack()
            got = refused.reason
        assert got == expected, (word, event, arg_gen, holder)
        checked += 1
    assert checked == len(State) * len(GENERATIONS) * len(CLAIMANTS) * len(TENANTS) * 5 * len(HOLDERS)


def test_a_claim_carries_its_tenant_through_the_cycle_and_free_forgets_it() -> None:
    w = claim_word(SlotWord(3, State.FREE, 0).pack(), claimant=9, tenant=4)
    assert SlotWord.unpack(w) == SlotWord(4, State.CLAIMED, 9, 4)
    for event in (Event.DOORBELL, Event.START, Event.COMPLETE):
        w = step(w, event, 4)
        assert SlotWord.unpack(w).tenant == 4
    handed = step(w, Event.HANDOVER, 4, (7 << 24) | 2)  # a reclaimer of tenant 7, claimant 2
    assert SlotWord.unpack(handed) == SlotWord(5, State.CLAIMED, 2, 7)
    assert SlotWord.unpack(step(w, Event.RELEASE, 4)) == SlotWord(4, State.FREE, 0, 0)


def test_generations_wrap_at_24_bits() -> None:
    w = claim_word(SlotWord(0xFFFFFF, State.FREE, 0, 0).pack(), claimant=1)
    assert SlotWord.unpack(w) == SlotWord(0, State.CLAIMED, 1)


def test_a_word_of_the_generation_before_a_handover_is_written_back() -> None:
    """After the owner handed a slot over (the one step by which it stores a CLAIMED word), a word of the previous
    generation can only be a failed remote CAS's write-back: it is recognised and put right."""
    done = SlotWord(8, State.DONE, 3, 1).pack()
    handed = step(done, Event.HANDOVER, 8, (2 << 24) | 5)
    assert lib.ep_word_reverted_of(done, handed)
    assert lib.ep_word_reverted_of(SlotWord(8, State.RUNNING, 3, 1).pack(), handed)
    assert not lib.ep_word_reverted_of(step(handed, Event.DOORBELL, 9), handed)
    assert not lib.ep_word_reverted_of(SlotWord(9, State.FREE, 0).pack(), handed)  # the reclaimer gave it back


def test_unknown_event_is_refused() -> None:
    out = ffi.new("uint64_t *", 123)
    assert lib.ep_step_word(0, 99, 0, 1, out) == lib.EP_E_EVENT
    assert out[0] == 123  # untouched


def test_full_cycle_bumps_generation_once_per_claim() -> None:
    w = SlotWord(41, State.FREE, 0).pack()
    w = claim_word(w, claimant=9)
    assert SlotWord.unpack(w) == SlotWord(42, State.CLAIMED, 9)
    for event in (Event.DOORBELL, Event.START, Event.COMPLETE, Event.RELEASE):
        w = step(w, event, 42)
    assert SlotWord.unpack(w) == SlotWord(42, State.FREE, 0)
    assert SlotWord.unpack(claim_word(w, 3)).generation == 43


def test_stale_doorbell_after_expiry_and_reclaim_is_refused() -> None:
    w = claim_word(SlotWord(0, State.FREE, 0).pack(), 1)  # gen 1, claimant 1
    w = step(w, Event.EXPIRE, 1)  # lease expired
    w = claim_word(w, 2)  # gen 2, someone else
    with pytest.raises(TransitionRefused) as err:
        step(w, Event.DOORBELL, 1)
    assert err.value.reason == StepError.STALE
    assert SlotWord.unpack(step(w, Event.DOORBELL, 2)).state == State.READY


def test_apply_is_the_atomic_form_of_step() -> None:
    word = ffi.new("uint64_t *", SlotWord(5, State.CLAIMED, 3).pack())
    prev = ffi.new("uint64_t *")
    assert lib.ep_apply(word, Event.DOORBELL, 4, 0, prev) == lib.EP_E_STALE
    assert word[0] == SlotWord(5, State.CLAIMED, 3).pack() == prev[0]
    assert lib.ep_apply(word, Event.DOORBELL, 5, 0, prev) == lib.EP_OK
    assert SlotWord.unpack(word[0]) == SlotWord(5, State.READY, 3)


def test_doorbell_encodings() -> None:
    assert doorbell_imm(slot=3, generation=0x12345) == (0x2345 << 16) | 3
    assert doorbell_word(slot=3, generation=0x12345) == (0x12345 << 32) | lib.EP_DOORBELL_VALID | 3


def test_pool_create_and_views_share_the_buffer() -> None:
    buf = np.zeros(1 << 16, dtype=np.uint8)
    pool = SlotPool.create(buf, slot_count=4, input_capacity=100, output_capacity=50, lease_ns=10**9, epoch=7)
    assert pool.free_count() == 4
    assert pool.slots.tokens.shape == (4, 100) and pool.slots.outputs.shape == (4, 50)
    assert np.shares_memory(pool.slots.tokens, buf) and np.shares_memory(pool.states, buf)
    assert pool.layout.stride % 64 == 0
    assert int(pool.header["server_epoch"]) == 7


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, 0xDEADBEEF, "not an edgepath slot pool"),
        (8, 99, "ABI version 99 is not supported"),
    ],
)
def test_pool_with_wrong_magic_or_version_is_rejected_clearly(offset: int, value: int, message: str) -> None:
    buf = np.zeros(1 << 16, dtype=np.uint8)
    SlotPool.create(buf, 2, 16, 16, 10**9, 1)
    width = np.uint64 if offset == 0 else np.uint32
    buf[offset : offset + np.dtype(width).itemsize].view(width)[0] = value
    with pytest.raises(PoolError, match=message):
        SlotPool(buf)


def test_pool_dimensions_are_validated() -> None:
    with pytest.raises(PoolError, match="invalid pool dimensions"):
        SlotPool.layout_for(0, 16, 16)
    with pytest.raises(ValueError, match="input_capacity must be between"):
        SlotPool.create(np.zeros(1 << 16, np.uint8), 2, 0, 16, 10**9, 1)
    with pytest.raises(PoolError, match="needs"):
        SlotPool.create(np.zeros(256, np.uint8), 2, 16, 16, 10**9, 1)
