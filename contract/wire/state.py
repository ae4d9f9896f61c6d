"""The slot state word: tenant (8) | generation (24) | claimant (24) | state (8), and its transitions through the
shared ``ep_step`` (native/edgepath_step.h): what a claim compare-and-swaps, what a slot server steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgepath.native.abi import Event, State, StepError, ffi, lib

_STATE_MASK = 0xFF
_STATE_MASK_U64 = np.uint64(_STATE_MASK)
CLAIMANT_MAX = lib.EP_CLAIMANT_MAX
GENERATION_MAX = lib.EP_GENERATION_MAX
TENANT_MAX = lib.EP_TENANT_MAX
_TENANT_SHIFT = 56
_TENANT_SHIFT_U64 = np.uint64(_TENANT_SHIFT)


def word_state(word: int) -> int:
    return word & _STATE_MASK


def word_generation(word: int) -> int:
    return (word >> 32) & GENERATION_MAX


def word_claimant(word: int) -> int:
    return (word >> 8) & CLAIMANT_MAX


def word_tenant(word: int) -> int:
    """The floor id of the tenant whose request holds the slot (0: a tenant without a floor, or FREE)."""
    return word >> _TENANT_SHIFT


def words_tenants(words: np.ndarray) -> np.ndarray:
    """The tenant field of an array of state words (what :func:`word_tenant` is for one)."""
    return words >> _TENANT_SHIFT_U64


def word_holder(word: int) -> int:
    """The claimant and its tenant as one value (tenant << 24 | claimant): what a claim or a hand-over names."""
    return (word_tenant(word) << 24) | word_claimant(word)


def holder(claimant: int, tenant: int = 0) -> int:
    """What a claim or a hand-over names, as ``ep_step`` takes it: the tenant's floor id << 24 | the claimant."""
    if not 0 <= tenant <= TENANT_MAX:
        raise ValueError(f"tenant floor id must be in 0..{TENANT_MAX}, got {tenant}")
    return (tenant << 24) | (claimant & CLAIMANT_MAX)


def next_generation(generation: int) -> int:
    """The generation a claim of a word in ``generation`` begins (generations wrap at 2^24)."""
    return (generation + 1) & GENERATION_MAX


def is_free(word: int) -> bool:
    return word & _STATE_MASK == State.FREE


def claimed_by(word: int, claimant: int) -> bool:
    """The slot is CLAIMED (no doorbell yet) by ``claimant``."""
    return word & _STATE_MASK == State.CLAIMED and (word >> 8) & CLAIMANT_MAX == claimant


def in_state(words: np.ndarray, state: State) -> np.ndarray:
    """Which of an array of state words are in ``state`` (a boolean array of the same shape)."""
    return (words & _STATE_MASK_U64) == int(state)


def free_word(generation: int) -> int:
    """A FREE word in ``generation`` (what a slot server leaves when it releases a slot)."""
    return (generation & GENERATION_MAX) << 32


@dataclass(frozen=True, slots=True)
class SlotWord:
    generation: int
    state: State | int
    claimant: int
    tenant: int = 0

    @classmethod
    def unpack(cls, word: int) -> SlotWord:
        """Unpack a word; a state byte outside the ABI (corrupt memory) is kept as a plain int."""
        code = word & _STATE_MASK
        state = State(code) if code in State._value2member_map_ else code
        return cls(word_generation(word), state, word_claimant(word), word_tenant(word))

    def pack(self) -> int:
        return (
            (self.tenant << _TENANT_SHIFT)
            | ((self.generation & GENERATION_MAX) << 32)
            | ((self.claimant & CLAIMANT_MAX) << 8)
            | int(self.state)
        )


class TransitionRefused(Exception):
    """``ep_step`` refused an event: the word is left as it was."""

    def __init__(self, word: int, event: Event, reason: StepError) -> None:
        self.word, self.event, self.reason = word, event, reason
        name = event.name if isinstance(event, Event) else f"event {event}"
        super().__init__(f"{name} refused on {SlotWord.unpack(word)}: {reason.name.lower()}")


def step(word: int, event: Event, generation: int = 0, claimant: int = 0) -> int:
    """The state word after ``event``; raises :class:`TransitionRefused` when not allowed (``claimant``: CLAIM's
    and HANDOVER's holder, :func:`holder`)."""
    out = ffi.new("uint64_t *")
    rc = lib.ep_step_word(word, int(event), generation & 0xFFFFFFFF, claimant, out)
    if rc != lib.EP_OK:
        raise TransitionRefused(word, event, StepError(rc))
    return int(out[0])


def claim_word(free_word: int, claimant: int, tenant: int = 0) -> int:
    """The word a claimer CASes in for ``free_word`` (FREE): generation + 1, CLAIMED, claimant and its tenant."""
    return step(free_word, Event.CLAIM, 0, holder(claimant, tenant))


#: the claimer's hot path: ``claim_next(word, holder)`` is :func:`claim_word` without the exception,
#: 0 when ``word`` cannot be claimed (no claimed word is 0)
claim_next = lib.ep_claim_next
