"""Typed views of slot-pool memory and of frame arrays (same per-entry layout).

A *frame* is ``[request header][int32 tokens[in]][result header][int32 output[out]]``.
The slot pool holds one frame per slot behind a pool header and the state and
doorbell word arrays; a requester's reply region is a bare frame array.  These
classes only compute views over a buffer someone else owns (shared memory, a
registered MR, GPU-mapped memory): they never copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from edgepath.contract.wire import RequestHeader, ResultHeader, SlotWord, in_state
from edgepath.native.abi import (
    POOL_HEADER,
    REQUEST_HEADER,
    RESULT_HEADER,
    State,
    ffi,
    lib,
)

#: tokens per slot or frame, in and out, when nothing else is said (slot servers, agents, the commands)
DEFAULT_CAPACITY = 4096
#: slots of a pool when nothing else is said
DEFAULT_SLOTS = 64

_V = TypeVar("_V", RequestHeader, ResultHeader)


class PoolError(ValueError):
    """Pool memory that is not a valid edgepath pool of this ABI version."""


@dataclass(frozen=True, slots=True)
class FrameLayout:
    """Byte layout of one frame for given token capacities (computed by the C ABI code)."""

    input_capacity: int
    output_capacity: int

    def __post_init__(self) -> None:
        for name in ("input_capacity", "output_capacity"):
            value = getattr(self, name)
            if not 1 <= value <= 1 << 24:
                raise ValueError(f"{name} must be between 1 and {1 << 24} tokens, got {value}")

    @property
    def stride(self) -> int:
        return int(lib.ep_frame_stride(self.input_capacity, self.output_capacity))

    @property
    def result_offset(self) -> int:
        return int(lib.ep_result_offset(self.input_capacity))

    def request_bytes(self, token_count: int) -> int:
        """Bytes of a request with ``token_count`` tokens: what one RDMA WRITE sends."""
        return REQUEST_HEADER.itemsize + 4 * token_count

    def result_bytes(self, output_count: int) -> int:
        return RESULT_HEADER.itemsize + 4 * output_count


def header_views(rows: np.ndarray, offset: int, view: type[_V]) -> list[_V]:
    """A typed header view (:class:`~edgepath.contract.wire.RequestHeader` or ``ResultHeader``) of byte
    ``offset`` of each row of ``rows``: the hot path reads and writes headers through these, a numpy
    structured field access costing about ten times more.  They point into ``rows``' memory, which
    their owner keeps alive."""
    base = int(rows.__array_interface__["data"][0]) + offset
    stride = int(rows.strides[0])
    return [view.at(base + i * stride) for i in range(rows.shape[0])]


class _Frames:
    """Typed views of ``count`` frames: request parts (header, tokens) and result parts (header, output)."""

    layout: FrameLayout
    count: int

    def _view(self, requests: np.ndarray, request_at: int, replies: np.ndarray, result_at: int) -> None:
        """Views of the rows of ``requests`` from byte ``request_at`` and of ``replies`` from ``result_at``."""
        layout, count = self.layout, self.count
        tokens_at, output_at = request_at + REQUEST_HEADER.itemsize, result_at + RESULT_HEADER.itemsize
        self.requests = requests[:, request_at:tokens_at].view(REQUEST_HEADER).reshape(count)
        self.tokens = requests[:, tokens_at : tokens_at + 4 * layout.input_capacity].view(np.int32)
        self.results = replies[:, result_at:output_at].view(RESULT_HEADER).reshape(count)
        self.outputs = replies[:, output_at : output_at + 4 * layout.output_capacity].view(np.int32)
        self.request_headers = header_views(requests, request_at, RequestHeader)
        self.result_headers = header_views(replies, result_at, ResultHeader)


class FrameArray(_Frames):
    """``count`` frames laid out back to back in ``buf`` starting at byte ``offset``."""

    def __init__(self, buf: np.ndarray, offset: int, count: int, layout: FrameLayout) -> None:
        self.layout = layout
        self.count = count
        self.offset = offset
        self.raw = _rows(buf, offset, count, layout.stride, "frame array")
        self._view(self.raw, 0, self.raw, layout.result_offset)

    def frame_offset(self, index: int) -> int:
        """Byte offset of frame ``index`` within the underlying buffer."""
        return self.offset + index * self.layout.stride

    def result_offset(self, index: int) -> int:
        return self.frame_offset(index) + self.layout.result_offset


def reply_stride(output_capacity: int) -> int:
    """Bytes of one reply entry ``[result header][int32 output[out]]``, 64-byte aligned."""
    return RESULT_HEADER.itemsize + -(-4 * output_capacity // 64) * 64


def request_stride(input_capacity: int) -> int:
    """Bytes of one request entry ``[request header][int32 tokens[in]]``, 64-byte aligned."""
    return REQUEST_HEADER.itemsize + -(-4 * input_capacity // 64) * 64


class AgentFrames(_Frames):
    """An agent's frames, split for least privilege: requests in one region (only the edge writes it,
    and it is sent from, never written by a peer) and replies in another (the one region a slot server
    may write).  Same attributes as :class:`FrameArray` for the code that fills and reads frames."""

    def __init__(
        self,
        requests_buf: np.ndarray,
        replies_buf: np.ndarray,
        count: int,
        layout: FrameLayout,
        requests_offset: int = 0,
        replies_offset: int = 0,
    ) -> None:
        self.layout = layout
        self.count = count
        self.request_stride = request_stride(layout.input_capacity)
        self.requests_offset = requests_offset
        self.raw = _rows(requests_buf, requests_offset, count, self.request_stride, "request region")
        replies = _rows(replies_buf, replies_offset, count, reply_stride(layout.output_capacity), "reply region")
        self._view(self.raw, 0, replies, 0)

    @staticmethod
    def sizes(count: int, layout: FrameLayout) -> tuple[int, int]:
        """Bytes of the requests region and of the replies region for ``count`` frames."""
        return count * request_stride(layout.input_capacity), count * reply_stride(layout.output_capacity)

    def frame_offset(self, index: int) -> int:
        """Byte offset of request ``index`` within the requests region."""
        return self.requests_offset + index * self.request_stride


def _rows(buf: np.ndarray, offset: int, count: int, stride: int, what: str) -> np.ndarray:
    need = offset + count * stride
    if buf.nbytes < need:
        raise PoolError(f"{what} needs {need} bytes, buffer has {buf.nbytes}")
    return buf[offset:need].reshape(count, stride)


#: the pool header's fields a slot server sends a peer on connect (:meth:`SlotPool.info`)
_INFO = (
    "abi_version",
    "slot_count",
    "input_capacity",
    "output_capacity",
    "slot_stride",
    "states_offset",
    "doorbells_offset",
    "cancels_offset",
    "slots_offset",
    "total_size",
    "server_epoch",
    "lease_ns",
    "prefixes_offset",
    "prefix_entries",
)


class SlotPool:
    """Views of a slot pool: header, state words, doorbell words and slot frames."""

    def __init__(self, buf: np.ndarray) -> None:
        rc = lib.ep_pool_validate(ffi.from_buffer(buf), buf.nbytes)
        if rc != lib.EP_OK:
            raise PoolError(_describe_invalid(buf, rc))
        self.buf = buf
        self.header = buf[: POOL_HEADER.itemsize].view(POOL_HEADER)[0]
        h = self.header
        self.slot_count = int(h["slot_count"])
        self.layout = FrameLayout(int(h["input_capacity"]), int(h["output_capacity"]))
        n = self.slot_count
        self.states_offset = int(h["states_offset"])
        self.doorbells_offset = int(h["doorbells_offset"])
        self.states = buf[self.states_offset : self.states_offset + 8 * n].view(np.uint64)
        self.doorbells = buf[self.doorbells_offset : self.doorbells_offset + 8 * n].view(np.uint64)
        self.cancels_offset = int(h["cancels_offset"])
        self.cancels = buf[self.cancels_offset : self.cancels_offset + 8 * n].view(np.uint64)
        self.reclaims_offset = int(h["reclaims_offset"])
        #: the words reclaimers write (the CLAIMED word each asks a running slot to be handed over as)
        self.reclaims = buf[self.reclaims_offset : self.reclaims_offset + 8 * n].view(np.uint64)
        self.prefixes_offset = int(h["prefixes_offset"])
        #: the prefix table the slot server publishes (empty when the pool has none)
        self.prefixes = buf[self.prefixes_offset : self.prefixes_offset + 8 * int(h["prefix_entries"])].view(np.uint64)
        self.slots = FrameArray(buf, int(h["slots_offset"]), n, self.layout)
        self._states_ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.states))

    @staticmethod
    def layout_for(
        slot_count: int, input_capacity: int, output_capacity: int, prefix_entries: int = 0
    ) -> dict[str, int]:
        """Header fields (offsets, sizes) of a pool with these dimensions (and a prefix table of
        ``prefix_entries`` chain hashes, 0: none)."""
        hdr = ffi.new("struct ep_pool_header *")
        if not 0 <= prefix_entries <= lib.EP_PREFIX_ENTRIES_MAX or (
            lib.ep_pool_layout_prefixes(slot_count, input_capacity, output_capacity, prefix_entries, hdr) != lib.EP_OK
        ):
            raise PoolError(
                f"invalid pool dimensions: {slot_count} slots (allowed 1..{lib.EP_SLOT_MAX + 1}), "
                f"input {input_capacity} and output {output_capacity} tokens (each at least 1), "
                f"{prefix_entries} prefix entries (allowed 0..{lib.EP_PREFIX_ENTRIES_MAX})"
            )
        return {
            name: getattr(hdr, name)
            for name, _ in ffi.typeof("struct ep_pool_header").fields
            if not name.startswith("reserved")
        }

    @classmethod
    def create(
        cls,
        buf: np.ndarray,
        slot_count: int,
        input_capacity: int,
        output_capacity: int,
        lease_ns: int,
        epoch: int,
        prefix_entries: int = 0,
    ) -> SlotPool:
        """Initialise ``buf`` as an empty pool (all slots FREE, generation 0, an empty prefix table of
        ``prefix_entries``) and view it."""
        FrameLayout(input_capacity, output_capacity)
        hdr = ffi.new("struct ep_pool_header *")
        if not 0 <= prefix_entries <= lib.EP_PREFIX_ENTRIES_MAX or (
            lib.ep_pool_layout_prefixes(slot_count, input_capacity, output_capacity, prefix_entries, hdr) != lib.EP_OK
        ):
            cls.layout_for(slot_count, input_capacity, output_capacity, prefix_entries)  # raises: says what is wrong
        hdr.lease_ns = lease_ns
        hdr.server_epoch = epoch
        if lib.ep_pool_init(ffi.from_buffer(buf), buf.nbytes, hdr) != lib.EP_OK:
            raise PoolError(f"pool needs {hdr.total_size} bytes, buffer has {buf.nbytes}")
        return cls(buf)

    def info(self) -> dict[str, int]:
        """What a slot server tells every peer of its pool when it connects: the header's dimensions and offsets,
        its ABI version and epoch."""
        return {name: int(self.header[name]) for name in _INFO}

    def word(self, slot: int) -> int:
        """The state word of ``slot``, read with acquire ordering."""
        return int(lib.ep_load64(self._states_ptr + slot))

    def slot_word(self, slot: int) -> SlotWord:
        return SlotWord.unpack(self.word(slot))

    def count(self, state: State) -> int:
        return int(np.count_nonzero(in_state(self.states, state)))

    def free_count(self) -> int:
        return self.count(State.FREE)


def _describe_invalid(buf: np.ndarray, rc: int) -> str:
    if rc == lib.EP_POOL_E_MAGIC:
        found = int(buf[:8].view(np.uint64)[0]) if buf.nbytes >= 8 else None
        return f"not an edgepath slot pool: magic {found:#x}, expected {lib.EP_POOL_MAGIC:#x}"
    if rc == lib.EP_POOL_E_VERSION:
        found = int(buf[8:12].view(np.uint32)[0])
        return (
            f"slot pool ABI version {found} is not supported: this edgepath speaks version "
            f"{lib.EP_ABI_VERSION}; run agent and slot server from the same release"
        )
    if rc == lib.EP_POOL_E_LAYOUT:
        return "slot pool header is inconsistent (offsets or sizes do not match its dimensions)"
    return f"slot pool memory too small ({buf.nbytes} bytes) for its header"
