"""The wire contract: everything two edgepath processes agree on, in one place.

Layouts come from the C header (``native/edgepath_slot.h``, via :mod:`edgepath.native.abi`); this
module owns what the header cannot say on its own and every component needs: the names of the
regions peers export and the access each grants, the encodings of the 64-bit words written
through the transport (state, doorbell, cancel, progress) and of the 32-bit immediates that
announce them, the request validation both the writer and the reader apply, and the keys of the
edge <-> agent frame protocol.  No component imports another component to learn a name, and no
component decodes a word with its own bit masks.

Streams of a request, by direction:

* agent -> slot server: request header + tokens (one WRITE), then the doorbell word with
  ``doorbell_imm``; later, maybe, the cancel word with ``cancel_imm``.
* slot server -> agent: output tokens as they are produced (WRITEs into the reply entry), each
  batch followed by the ``progress`` word of the result header with ``progress_imm``; at the end
  the whole result header with ``final_imm``.  Every word carries the request's generation, so a
  write for an older request of the same entry is recognised and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.dma.transport import Access
from edgepath.native.abi import Event, State, Status, StepError, ffi, lib

# -- regions -------------------------------------------------------------------------------------
#: a slot server's pool: header, state/doorbell/cancel words, slots
POOL_REGION = "pool"
POOL_ACCESS = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC
#: an agent's request entries ``[request header][tokens]``: edges fill them, the agent sends from them
REQUESTS_REGION = "requests"
#: an agent's reply entries ``[result header][output]``: the one region a slot server may write
REPLIES_REGION = "replies"
REPLIES_ACCESS = Access.REMOTE_WRITE
#: an agent process's published status (free slots, total slots, slot servers alive), read by edges
STATUS_REGION = "status"
#: an edge's 8-byte landing spot for its agent's zero-length WRITE_WITH_IMM answers
COMPLETIONS_REGION = "completions"

# -- edge <-> agent frame protocol (connection private data) --------------------------------------
#: keys an agent process sends an edge on accept: the edge's own range of frames
FRAME_BASE, FRAME_COUNT = "frame_base", "frame_count"
#: keys both sides send: token capacities of a frame
INPUT_CAPACITY, OUTPUT_CAPACITY = "input_capacity", "output_capacity"

# -- state word: generation (32) | claimant (24) | state (8) ----------------------------------------
STATE_MASK = 0xFF
CLAIMANT_MAX = lib.EP_CLAIMANT_MAX


def word_state(word: int) -> int:
    return word & STATE_MASK


def word_generation(word: int) -> int:
    return word >> 32


def word_claimant(word: int) -> int:
    return (word >> 8) & CLAIMANT_MAX


def is_free(word: int) -> bool:
    return word & STATE_MASK == State.FREE


def claimed_by(word: int, claimant: int) -> bool:
    """The slot is CLAIMED (no doorbell yet) by ``claimant``."""
    return word & STATE_MASK == State.CLAIMED and (word >> 8) & CLAIMANT_MAX == claimant


def free_word(generation: int) -> int:
    """A FREE word in ``generation`` (what a slot server leaves when it releases a slot)."""
    return (generation & 0xFFFFFFFF) << 32


@dataclass(frozen=True, slots=True)
class SlotWord:
    generation: int
    state: State | int
    claimant: int

    @classmethod
    def unpack(cls, word: int) -> SlotWord:
        """Unpack a word; a state byte outside the ABI (corrupt memory) is kept as a plain int."""
        code = word & STATE_MASK
        state = State(code) if code in State._value2member_map_ else code
        return cls(word >> 32, state, word_claimant(word))

    def pack(self) -> int:
        return (self.generation << 32) | ((self.claimant & CLAIMANT_MAX) << 8) | int(self.state)


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


# -- towards a slot server: doorbell and cancel ------------------------------------------------------
IMM_CANCEL = lib.EP_IMM_CANCEL
IMM_GEN_MASK = lib.EP_IMM_GEN_MASK


def doorbell_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a doorbell: generation's low 15 bits << 16 | slot (bit 31 clear)."""
    return lib.ep_doorbell_imm_of(generation & 0xFFFFFFFF, slot)


def doorbell_word(slot: int, generation: int) -> int:
    """The u64 rung into ``doorbell[slot]`` (what a GPU poller watches)."""
    return lib.ep_doorbell_word(generation & 0xFFFFFFFF, slot)


def cancel_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a cancel: bit 31 | generation's low 15 bits << 16 | slot."""
    return IMM_CANCEL | ((generation & IMM_GEN_MASK) << 16) | (slot & lib.EP_SLOT_MAX)


def cancel_word(generation: int) -> int:
    """The u64 written into ``cancel[slot]``: the generation being cancelled, and a set bit."""
    return ((generation & 0xFFFFFFFF) << 32) | 1


def is_cancel_imm(imm: int) -> bool:
    return bool(imm & IMM_CANCEL)


def imm_slot(imm: int) -> int:
    return imm & lib.EP_SLOT_MAX


def imm_generation_matches(imm: int, generation: int) -> bool:
    """Whether an immediate names ``generation`` (it carries only the low 15 bits)."""
    return (imm >> 16) & IMM_GEN_MASK == generation & IMM_GEN_MASK


# -- towards an agent: progress and final results ---------------------------------------------------
IMM_PROGRESS = lib.EP_IMM_PROGRESS
IMM_FINAL = lib.EP_IMM_FINAL
IMM_KIND_MASK = lib.EP_IMM_KIND_MASK
IMM_INDEX_MASK = lib.EP_IMM_INDEX_MASK


def progress_imm(index: int) -> int:
    return IMM_PROGRESS | (index & IMM_INDEX_MASK)


def final_imm(index: int) -> int:
    return IMM_FINAL | (index & IMM_INDEX_MASK)


def imm_index(imm: int) -> int:
    return imm & IMM_INDEX_MASK


def is_progress_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_PROGRESS


def progress_word(generation: int, count: int) -> int:
    """``progress`` of a result header: the generation it belongs to and the tokens placed so far."""
    return ((generation & 0xFFFFFFFF) << 32) | (count & 0xFFFFFFFF)


def progress_generation(word: int) -> int:
    return word >> 32


def progress_count(word: int) -> int:
    return word & 0xFFFFFFFF


#: final statuses that mean "the model side ran the request" (output, if any, is valid)
FINISHED = (Status.OK, Status.LENGTH, Status.STOP, Status.CANCELLED)
#: statuses the data path answers before any slot ran the request
REFUSALS = (Status.NO_SLOT, Status.UNAVAILABLE, Status.BAD_REQUEST)
FLAG_STREAM = lib.EP_FLAG_STREAM


# -- request validation (writer and reader apply the same rules) ---------------------------------------
TOKEN_MIN = -(2**31)
TOKEN_MAX = 2**31 - 1


class RequestInvalid(ValueError):
    """A request that does not fit the slot format; the message says what is allowed."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters carried in the request header to the model side."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0 (a zeroed header) or 1: no nucleus cut
    top_k: int = 0  # 0: off
    seed: int = 0

    def check(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestInvalid(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise RequestInvalid(f"top_p must be between 0 and 1 (0 or 1: off), got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise RequestInvalid(f"top_k must be a non-negative integer, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise RequestInvalid(f"seed must be an unsigned 64-bit integer, got {self.seed}")


def request_problem(token_count: int, max_new_tokens: int, input_capacity: int, output_capacity: int) -> str | None:
    """Why a request with these counts cannot go into a slot of these capacities (None: it can)."""
    if token_count <= 0:
        return f"a request needs at least 1 token, got {token_count}"
    if token_count > input_capacity:
        return f"request has {token_count} tokens; a slot holds at most {input_capacity}"
    if not 0 <= max_new_tokens <= output_capacity:
        return f"max_new_tokens must be between 0 and {output_capacity}, got {max_new_tokens}"
    return None
