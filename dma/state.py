"""The slot state word and its transitions: a thin, I/O-free wrapper over ``ep_step``.

The transition logic itself lives in C (``native/edgepath_step.h``) so the CPU
poller, this module and the CUDA poller run the same code.  A state word packs
generation (bits 32..63) | claimant (bits 8..31) | state (bits 0..7).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.native.abi import Event, State, StepError, ffi, lib


@dataclass(frozen=True, slots=True)
class SlotWord:
    generation: int
    state: State | int
    claimant: int

    @classmethod
    def unpack(cls, word: int) -> SlotWord:
        """Unpack a word; a state byte outside the ABI (corrupt memory) is kept as a plain int."""
        code = word & 0xFF
        state = State(code) if code in State._value2member_map_ else code
        return cls(word >> 32, state, (word >> 8) & lib.EP_CLAIMANT_MAX)

    def pack(self) -> int:
        return (self.generation << 32) | ((self.claimant & lib.EP_CLAIMANT_MAX) << 8) | int(self.state)


class TransitionRefused(Exception):
    """``ep_step`` refused an event: the word is left as it was."""

    def __init__(self, word: int, event: Event, reason: StepError) -> None:
        self.word, self.event, self.reason = word, event, reason
        name = event.name if isinstance(event, Event) else f"event {event}"
        super().__init__(f"{name} refused on {SlotWord.unpack(word)}: {reason.name.lower()}")


def step(word: int, event: Event, generation: int = 0, claimant: int = 0) -> int:
    """The state word after ``event``; raises :class:`TransitionRefused` when not allowed."""
    out = ffi.new("uint64_t *")
    rc = lib.ep_step_word(word, int(event), generation & 0xFFFFFFFF, claimant, out)
    if rc != lib.EP_OK:
        raise TransitionRefused(word, event, StepError(rc))
    return int(out[0])


def claim_word(free_word: int, claimant: int) -> int:
    """The word a claimer CASes in for ``free_word`` (FREE): generation + 1, CLAIMED, claimant."""
    return step(free_word, Event.CLAIM, 0, claimant)


def doorbell_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a doorbell: generation's low 16 bits | slot (16 bits)."""
    return lib.ep_doorbell_imm_of(generation & 0xFFFFFFFF, slot)


def doorbell_word(slot: int, generation: int) -> int:
    """The u64 rung into ``doorbell[slot]`` (what a GPU poller watches)."""
    return lib.ep_doorbell_word(generation & 0xFFFFFFFF, slot)
