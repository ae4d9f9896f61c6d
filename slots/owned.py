"""What the slot server last stored in each slot's state word, so that a word written back behind its back is
stepped on from there and put right.

A state word is shared with agents' remote CAS (claims).  soft-RoCE's responder (Linux 6.1, ``rxe_resp.c``
``atomic_reply``) stores the value it read even when a CAS's compare fails, so a failed claim that read a word
before one of the server's own steps can store the old word after it: the step is undone.  Within a generation
only the server moves a word on, so such a word is recognisable (``ep_word_reverted`` in
``native/edgepath_step.h``): of the current generation, earlier in its cycle than what the server stored.  The
server's steps (``ep_apply_owned``) then step from what it stored, and its lease scans (``ep_scan_leases``) store
it again where nothing else would (a cycle's last step: DONE -> FREE, CLAIMED -> FREE).
"""

from __future__ import annotations

import numpy as np

from edgepath.native.abi import Event, ffi, lib


class OwnedWords:
    """For each of a pool's state words (``states``), the word the server last stored there (0: none yet), and
    how many times a word was found written back and restored."""

    def __init__(self, states: np.ndarray) -> None:
        self._states = ffi.cast("uint64_t *", ffi.from_buffer(states))
        self.words = np.zeros(len(states), dtype=np.uint64)
        self.ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.words))
        self.restored_ptr = ffi.new("uint64_t *")

    @property
    def restored(self) -> int:
        """Words found written back to an older value of their generation and restored."""
        return int(self.restored_ptr[0])

    def step(self, slot: int, event: Event, generation: int, holder: int = 0) -> int:
        """``event`` (any but CLAIM) on ``slot``'s state word: ``EP_OK`` or an ``EP_E_*`` code (``ep_apply_owned``;
        ``holder``: a HANDOVER's, :func:`~edgepath.contract.wire.holder`)."""
        return int(
            lib.ep_apply_owned(self._states + slot, self.ptr + slot, event, generation, holder, self.restored_ptr)
        )
