"""Deliveries: what slot servers answer for an agent's requests -- streamed progress, a final result, a hand-over --
and what the agent asks of a slot running one: stop (cancel), or nothing more (abandon).

Every completion is matched to a frame in flight on the link it came from, in its generation; what does not match
is counted and dropped (exactly once: :class:`~edgepath.dpu.frame_book.FrameBook`).  A stream whose slot was taken
back for a tenant under its floor moves (:class:`~edgepath.dpu.migration.Mover`) or ends RECLAIMED; a hand-over
settles a reclaim of this agent's (:class:`~edgepath.dpu.floor_book.FloorBook`).
"""

from __future__ import annotations

import logging

from edgepath.contract import wire
from edgepath.dpu.claims import Claims, InFlight
from edgepath.dpu.floor_book import FloorBook
from edgepath.dpu.migration import Mover
from edgepath.dpu.port import Delivery
from edgepath.native.abi import Status

log = logging.getLogger("edgepath.agent")


class Deliveries:
    """Completions from slot servers matched to one agent's frames in flight, and cancels sent to them."""

    def __init__(self, claims: Claims, floors: FloorBook, mover: Mover) -> None:
        self.link_set = claims.link_set
        self.frames = claims.frames
        self.book = claims.book
        self.floors = floors
        self.mover = mover

    def deliver(self, conn_id: int, imm: int) -> Delivery | None:
        """Account one completion from a slot server: streamed progress or a final result. Anything
        that does not match a frame in flight there, in its generation, is counted and dropped."""
        if wire.is_handover_imm(imm):
            return self.floors.handed_over(conn_id, wire.imm_index(imm))
        index = wire.imm_index(imm)
        book = self.book
        flight = book.inflight.get(index)
        link = self.link_set.by_conn.get(conn_id)
        progress = wire.is_progress_imm(imm)
        if (link is None and conn_id in self.link_set.retired) or (
            link is not None and (not link.alive or (flight is not None and flight.moves and flight.link is not link))
        ):
            # Sent on a link given up on since (what was in flight there is answered, 503, or moved, and its frame
            # maybe reused), or by a server the request moved away from: late, never a second answer (nor
            # "unknown").
            book.stats.late += 1
            return None
        if flight is None or link is None or flight.link is not link:
            answered = self.frames.result_headers[index].generation if 0 <= index < self.frames.count else -1
            book.stray(index, not progress, answered)
            log.warning("ignoring a completion for frame %d from connection %d: not in flight", index, conn_id)
            return None
        gen = flight.generation
        result = self.frames.result_headers[index]
        if progress:
            count = result.placed_for(gen)
            if count is None:
                book.unknown()
                return None
            return book.progress(index, count)
        if result.generation != gen:
            book.unknown()
            log.warning("ignoring stale result for frame %d", index)
            return None
        link.inflight -= 1
        if result.status == Status.RECLAIMED:
            return self._reclaimed(index, flight, result.output_count)
        # The server frees the slot before notifying: remember it as FREE in this generation.
        link.words_ptr[flight.slot] = wire.free_word(gen)
        return book.final(index, result.output_count, gen)

    def _reclaimed(self, index: int, flight: InFlight, produced: int) -> Delivery | None:
        """Frame ``index``'s slot was taken back for a tenant under its floor, with ``produced`` tokens of its answer
        placed: the stream moves to any free slot (on this server too: only the slot was wanted), as a stream
        whose server went away does, and goes on as one stream; when it cannot, it ends RECLAIMED (the edge says
        why).  The answer so far is delivered either way."""
        news = self.book.progress(index, produced) if not flight.abandoned else None
        if self.mover.limit and not (flight.abandoned or flight.cancelled) and self.mover.move(index, flight, True):
            return news
        return self.book.final(index, produced, flight.generation)

    def cancel(self, index: int) -> None:
        """Write the slot's cancel word (its generation) and ring it: the slot server stops the handler at
        its next step and answers CANCELLED (or the result already on its way arrives)."""
        flight = self.book.inflight.get(index)
        if flight is None or flight.cancelled:
            return
        flight.cancelled = True
        link = flight.link
        if not link.alive or flight.reclaim:
            return  # a reclaim under way runs nothing yet: its slot is given back when it is handed over
        self.link_set.send_cancel(link, flight.slot, flight.generation)

    def abandon(self, index: int) -> None:
        """Give up on frame ``index``: cancel its slot, deliver nothing more for it, and put the frame
        back on the free list when its final result arrives (or its slot server is lost) -- never
        before, so nothing of this request can land in the frame's next use."""
        if self.book.abandon(index) is not None:
            self.cancel(index)
