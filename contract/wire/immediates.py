"""The 32-bit immediates that announce a write, and the 64-bit words they announce: towards a slot server (doorbell,
cancel, reclaim), towards an agent (progress and final results, stalls, hand-overs), and between an edge and its
agent process (submissions, group members, cancels).  Every one carries what tells a late write from an older
request apart (a generation, a frame index)."""

from __future__ import annotations

from edgepath.native.abi import lib

IMM_CANCEL = lib.EP_IMM_CANCEL
IMM_RECLAIM = lib.EP_IMM_RECLAIM
IMM_GEN_MASK = lib.EP_IMM_GEN_MASK


def doorbell_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a doorbell: generation's low 14 bits << 16 | slot (bits 31 and 30 clear)."""
    return lib.ep_doorbell_imm_of(generation & 0xFFFFFFFF, slot)


def doorbell_word(slot: int, generation: int) -> int:
    """The u64 rung into ``doorbell[slot]`` (what a GPU poller watches)."""
    return lib.ep_doorbell_word(generation & 0xFFFFFFFF, slot)


def cancel_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a cancel: bit 31 | generation's low 14 bits << 16 | slot."""
    return IMM_CANCEL | ((generation & IMM_GEN_MASK) << 16) | (slot & lib.EP_SLOT_MAX)


def reclaim_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a reclaim of ``slot`` running ``generation``: bits 31 and 30 | its low 14 bits << 16 |
    slot.  ``reclaim[slot]`` holds the word the slot is to be handed over as (:func:`claim_word` of it)."""
    return lib.ep_reclaim_imm_of(generation & 0xFFFFFFFF, slot)


def is_reclaim_imm(imm: int) -> bool:
    return imm & (IMM_CANCEL | IMM_RECLAIM) == IMM_CANCEL | IMM_RECLAIM


def cancel_word(generation: int) -> int:
    """The u64 written into ``cancel[slot]``: the generation being cancelled, and a set bit."""
    return ((generation & 0xFFFFFFFF) << 32) | 1


def is_cancel_imm(imm: int) -> bool:
    return bool(imm & IMM_CANCEL)


def imm_slot(imm: int) -> int:
    return imm & lib.EP_SLOT_MAX


def imm_generation_matches(imm: int, generation: int) -> bool:
    """Whether an immediate names ``generation`` (it carries only the low 14 bits)."""
    return (imm >> 16) & IMM_GEN_MASK == generation & IMM_GEN_MASK


def doorbell_entry(conn_id: int, imm: int) -> int:
    """A doorbell completion as the poller core takes it (``ep_accept_doorbells``): the connection that
    rang in the high 32 bits, the immediate in the low 32."""
    return (conn_id << 32) | (imm & 0xFFFFFFFF)


# -- towards an agent: progress and final results ---------------------------------------------------
IMM_PROGRESS = lib.EP_IMM_PROGRESS
IMM_FINAL = lib.EP_IMM_FINAL
IMM_STALLED = lib.EP_IMM_STALLED
IMM_HANDOVER = lib.EP_IMM_HANDOVER
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


def stalled_imm(index: int) -> int:
    """An agent process tells its edge: frame ``index``'s slot server is unresponsive (it stays in flight)."""
    return IMM_STALLED | (index & IMM_INDEX_MASK)


def is_stalled_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_STALLED


def handover_imm(slot: int) -> int:
    """A slot server tells a reclaiming agent: its reclaim of ``slot`` was acted on (handed over or not: the state
    word says which)."""
    return IMM_HANDOVER | (slot & IMM_INDEX_MASK)


def is_handover_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_HANDOVER


def progress_word(generation: int, count: int) -> int:
    """``progress`` of a result header: the generation it belongs to and the tokens placed so far."""
    return ((generation & 0xFFFFFFFF) << 32) | (count & 0xFFFFFFFF)


def progress_generation(word: int) -> int:
    return word >> 32


def progress_count(word: int) -> int:
    return word & 0xFFFFFFFF


# -- edge <-> agent process: submissions and cancels (the answers are final_imm / progress_imm) -----------
def submit_imm(index: int) -> int:
    """An edge hands its frame ``index`` (within its own range) to the agent."""
    return index & IMM_INDEX_MASK


def group_member_imm(index: int) -> int:
    """An edge hands its frame ``index`` as a choice of a group whose last frame follows with :func:`submit_imm`: the
    agent claims the group's slots together (OpenAI's ``n``; an edge never sends the progress kind this bit is)."""
    return IMM_PROGRESS | (index & IMM_INDEX_MASK)


def is_group_member_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_PROGRESS


def edge_cancel_imm(index: int) -> int:
    """An edge asks the agent to cancel its frame ``index``."""
    return IMM_CANCEL | (index & IMM_INDEX_MASK)


def edge_imm_frame(imm: int) -> int:
    """The frame (within the edge's range) an edge's immediate names."""
    return imm & IMM_INDEX_MASK
