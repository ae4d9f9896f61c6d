"""An agent as a slot server sees it: its connection and its reply entries, and the result write-back.

Admission checks what the agent says about its replies region (:class:`~edgepath.contract.wire.AgentHello`)
against the region it exports.  Where each write of a result goes -- streamed tokens and the progress
word, the final header + output, the notification -- is computed here from the two layouts (the slot's
result part in the pool, the agent's reply entry) as plain offsets (:meth:`AgentPeer.entry`,
:func:`progress_writes`), and :class:`AgentPeer`'s three sends hand them to the connection.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.contract import wire
from edgepath.contract.pool import FrameLayout, reply_stride
from edgepath.native.abi import RESULT_HEADER, field_offset
from edgepath.transports.base import Connection, MemoryRegion, RemoteRegion, TransportError

_HEADER = RESULT_HEADER.itemsize
_PROGRESS_FIELD = field_offset(RESULT_HEADER, "progress")
# A progress write places `progress`, the first-token time, the cached prompt tokens and the prompt's own
# prefill time next to it (one 24-byte WRITE_WITH_IMM).
_PROGRESS_BYTES = field_offset(RESULT_HEADER, "prefill_us") + 4 - _PROGRESS_FIELD
assert _PROGRESS_BYTES == 24, "ep_result_header: t_first_ns, cached_tokens and prefill_us must follow progress"


@dataclass(frozen=True, slots=True)
class Write:
    """``length`` bytes from ``local`` (an offset in the pool) to ``remote`` (an offset in the replies)."""

    local: int
    remote: int
    length: int


def progress_writes(result: int, entry: int, sent: int, count: int, offset: int = 0) -> tuple[Write, Write]:
    """Streamed output ``[sent, count)`` of the slot whose result part starts at pool offset ``result`` into
    the reply entry at ``entry`` (``offset`` tokens further on: a migrated request's answer so far), then the
    progress word and first-token time (rung with the immediate)."""
    tokens = Write(result + _HEADER + 4 * sent, entry + _HEADER + 4 * (offset + sent), 4 * (count - sent))
    return tokens, Write(result + _PROGRESS_FIELD, entry + _PROGRESS_FIELD, _PROGRESS_BYTES)


@dataclass(eq=False)
class AgentPeer:
    """An agent connection and its replies region: ``frames`` entries of ``[result header][output]``."""

    conn: Connection
    replies: RemoteRegion
    layout: FrameLayout
    frames: int
    replies_offset: int

    def __post_init__(self) -> None:
        self._stride = reply_stride(self.layout.output_capacity)

    @classmethod
    def admit(cls, conn: Connection) -> AgentPeer:
        """Check the agent's reply-region description against what it exports; ValueError says what is wrong."""
        try:
            hello = wire.AgentHello.parse(conn.peer_info)
            layout = FrameLayout(hello.input_capacity, hello.output_capacity)
            replies = conn.remote[wire.REPLIES_REGION]
            size = hello.frames * reply_stride(layout.output_capacity)
            replies.check(hello.replies_offset, size, wire.REPLIES_ACCESS)
        except (KeyError, ValueError, TransportError) as exc:
            raise ValueError(f"bad reply-region description: {exc}") from exc
        return cls(conn, replies, layout, hello.frames, hello.replies_offset)

    def entry(self, index: int) -> int:
        """Byte offset of reply entry ``index`` in the replies region."""
        return self.replies_offset + index * self._stride

    # -- the result write-back (each raises TransportError when the agent is gone) -------------------
    def send_progress(
        self, pool: MemoryRegion, result: int, index: int, sent: int, count: int, offset: int = 0
    ) -> None:
        """New output tokens (``offset`` further on in the entry), then the progress word with WRITE_WITH_IMM
        (RC ordering places the tokens before the agent hears of them)."""
        tokens, bell = progress_writes(result, self.entry(index), sent, count, offset)
        self.conn.write_then_imm(
            pool,
            tokens.local,
            self.replies,
            tokens.remote,
            tokens.length,
            bell.local,
            bell.remote,
            bell.length,
            wire.progress_imm(index),
        )

    def send_final(self, pool: MemoryRegion, result: int, index: int, output_count: int, offset: int = 0) -> None:
        """The whole result -- header and the first ``output_count`` output tokens -- into the reply entry, in
        one WRITE (the agent is told by :meth:`notify_final`); with an ``offset`` (a migrated request) the
        tokens go that far on, then the header, in two."""
        entry = self.entry(index)
        if not offset:
            self.conn.write(pool, result, self.replies, entry, _HEADER + 4 * output_count)
            return
        self.conn.write(pool, result + _HEADER, self.replies, entry + _HEADER + 4 * offset, 4 * output_count)
        self.conn.write(pool, result, self.replies, entry, _HEADER)

    def notify_final(self, pool: MemoryRegion, index: int) -> None:
        """A zero-length WRITE_WITH_IMM: entry ``index`` holds its final result."""
        self.conn.write_with_imm(pool, 0, self.replies, 0, 0, wire.final_imm(index))

    def notify_handover(self, pool: MemoryRegion, slot: int) -> None:
        """A zero-length WRITE_WITH_IMM: this agent's reclaim of ``slot`` was acted on (its state word says how)."""
        self.conn.write_with_imm(pool, 0, self.replies, 0, 0, wire.handover_imm(slot))
