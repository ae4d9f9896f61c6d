"""Host memory for llama.cpp's sequence-state blobs, reused rather than allocated afresh.

A blob is a sequence's whole KV (~23 KB a token for SmolLM2-135M F16: 12 MB for 512 tokens).  The model side
takes one on the step loop -- a finished sequence saved for the prefix cache, a running one copied to share its
prefix or to close a gap between runs of sequence ids -- and every stream decoding waits for it.  Copying is cheap
(~3 ms for 24 MB); fresh memory is not: its first touch faults in every page, and with transparent huge pages
on ``madvise`` (numpy asks for them on large arrays) the kernel may compact memory to find them first.  Measured on
this project's 2-core VM (2026-12-06): a fresh 12 MB array touched in 70-120 ms with numpy's huge-page advice on
a fragmented machine, 8.5 ms without it, 2 ms when memory is reused; the slot server's last step of a 515-token
request took 48-100 ms beyond its ``llama_decode`` for the save.

So a blob is a view of exactly its size into a buffer that this pool hands out again once the blob is dropped
(an evicted or superseded copy, a copy already written into its destination), and a new buffer is an anonymous
mapping advised against huge pages (its faults cost about the same every time) rounded up to a whole ``GRAIN``,
so blobs of similar lengths fit each other's buffers.  Buffers not in use are kept up to ``spare`` bytes.
"""

from __future__ import annotations

import mmap

import numpy as np

#: buffers are allocated in multiples of this (a blob fits a spare buffer at most one grain larger than it)
GRAIN = 1 << 20


class BlobPool:
    """Buffers for blobs: :meth:`take` one of a size, :meth:`give` it back when dropped."""

    def __init__(self, spare: int = 64 << 20) -> None:
        if spare < 0:
            raise ValueError(f"blob pool: spare must be >= 0 bytes, got {spare}")
        self.spare = spare
        self._free: list[mmap.mmap] = []  # buffers not in use, oldest first
        self._lent: dict[int, mmap.mmap] = {}  # a lent view's address -> its buffer
        self.allocated = 0  # buffers mapped so far (how often memory was taken fresh)

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of exactly ``nbytes``: a spare buffer's memory if one fits (the smallest that
        does, at most a grain larger than needed), else a new buffer's."""
        if nbytes < 1:
            raise ValueError(f"blob pool: a blob needs >= 1 byte, got {nbytes}")
        size = -(-nbytes // GRAIN) * GRAIN
        fits = [b for b in self._free if size <= len(b) <= size + GRAIN]
        if fits:
            buffer = min(fits, key=len)
            self._free.remove(buffer)
        else:
            buffer = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                buffer.madvise(mmap.MADV_NOHUGEPAGE)
            self.allocated += 1
        view = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
        self._lent[view.ctypes.data] = buffer
        return view

    def footprint(self, blob: np.ndarray) -> int:
        """The bytes a lent blob holds (its buffer's whole size): what a cache of blobs counts against its capacity."""
        return len(self._lent[blob.ctypes.data])

    def give(self, blob: np.ndarray) -> None:
        """``blob`` (from :meth:`take`) is no longer used: its buffer is kept for the next one, the oldest spare
        buffers let go beyond ``spare`` bytes.  A blob this pool did not lend is refused (ValueError)."""
        buffer = self._lent.pop(blob.ctypes.data, None)
        if buffer is None:
            raise ValueError("blob pool: given a blob it did not lend")
        self._free.append(buffer)
        while self._free and sum(len(b) for b in self._free) > self.spare:
            self._free.pop(0)  # unmapped once no view of it is left

    @property
    def spare_bytes(self) -> int:
        return sum(len(b) for b in self._free)

    @property
    def lent(self) -> int:
        return len(self._lent)
