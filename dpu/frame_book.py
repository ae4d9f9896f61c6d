"""The frame book of an agent port: which frames are free, which are in flight, exactly-once accounting.

Both ports keep one -- :class:`~edgepath.dpu.agent.Agent` (frames it sends to slot servers) and
:class:`~edgepath.dpu.agent_client.AgentClient` (frames it hands to an agent process) -- so the rules of a
frame's life are written once (see :mod:`edgepath.dpu.port`): a frame is acquired, sent, gets streamed
progress and exactly one final answer, and is released; an abandoned frame delivers nothing more but its final
(marked ``abandoned``: what was computed for it, for the bill) and goes back to the free list only when the other
side has let go of it.  A frame whose other side went away
before it was answered is *lost*: it waits, out of flight, until the caller hears of it (:meth:`FrameBook.take`)
-- or gives up on it first (:meth:`FrameBook.abandon`), which frees it then, so it is never reported too: the
request ends once and the frame is freed once, whichever comes first.  What does not match a frame in
flight is counted, never delivered: a second final for an answered frame (``duplicates``), a completion
for a frame that was never in flight or for another request of it (``unknown``), one for an abandoned
frame (``late``).  Sans-I/O: the ports decode completions and call in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from edgepath.dpu.port import Delivery, DeliveryStats


@dataclass(slots=True)
class Flight:
    """A frame in flight."""

    count: int = 0  # output tokens delivered so far
    abandoned: bool = False  # the caller gave up: deliver nothing, free the frame when the other side lets go


F = TypeVar("F", bound=Flight)


class FrameBook(Generic[F]):
    """``count`` frames, their flights (of type ``F``) and the delivery counters."""

    def __init__(self, count: int, stats: DeliveryStats | None = None) -> None:
        """``stats``: counters to go on with (a port that reconnects keeps counting where it was)."""
        self.count = count
        self.stats = stats if stats is not None else DeliveryStats()
        self.inflight: dict[int, F] = {}
        self._free = list(range(count - 1, -1, -1))
        self._answered = [-1] * count  # per frame: the request (generation) its last final answered
        #: frames lost with the other side (not abandoned), that the caller has not heard of yet (:meth:`take`)
        self.lost: set[int] = set()

    # -- a frame's life ------------------------------------------------------------------
    def acquire(self) -> int | None:
        """A frame the caller may fill, or None if all are taken."""
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        """Give a frame back once its result has been read (or it was refused, or never sent)."""
        if index in self.inflight:
            raise ValueError(f"frame {index} is still in flight (abandon it instead)")
        if index in self.lost:
            raise ValueError(f"frame {index} is lost and not taken yet (take it, or abandon it)")
        self._free.append(index)

    def sent(self, index: int, flight: F) -> None:
        """Frame ``index`` is in flight now."""
        self.inflight[index] = flight

    def unsent(self, index: int) -> None:
        """The send of frame ``index`` failed before it left: it is not in flight (the caller still owns it)."""
        del self.inflight[index]

    def progress(self, index: int, count: int) -> Delivery | None:
        """``count`` output tokens of in-flight frame ``index`` are placed: a delivery when that is news."""
        flight = self.inflight[index]
        if flight.abandoned or count <= flight.count:
            self.stats.late += flight.abandoned
            return None
        flight.count = count
        return Delivery(index, count, False)

    def final(self, index: int, output_count: int, answers: int = 0) -> Delivery:
        """In-flight frame ``index`` has its final result (for request ``answers``, e.g. its generation):
        delivered -- for an abandoned frame, counted late, the frame freed, and delivered as ``abandoned`` with the
        tokens computed for it (what its request is billed: docs/TENANTS.md, "Usage")."""
        flight = self.inflight.pop(index)
        self._answered[index] = answers
        if flight.abandoned:
            self.stats.late += 1
            self._free.append(index)
            return Delivery(index, output_count, True, abandoned=True)
        self.stats.delivered += 1
        return Delivery(index, output_count, True)

    def abandon(self, index: int) -> F | None:
        """The caller gives up on frame ``index``, sent and not answered: its flight when it is in flight and this
        is news (the caller cancels it); None when it was abandoned already, or lost with the other side -- then
        it is freed now (nothing can land in it) and never reported by :meth:`take`.  A frame the caller owns
        (never sent, answered, taken) or one that is free is not the caller's to abandon: ValueError."""
        if index in self.lost:
            self.lost.discard(index)
            self.stats.abandoned += 1
            self._free.append(index)
            return None
        flight = self.inflight.get(index)
        if flight is None:
            raise ValueError(f"frame {index} is not in flight nor lost: release the frames the caller holds")
        if flight.abandoned:
            return None
        flight.abandoned = True
        self.stats.abandoned += 1
        return flight

    def lose(self, which: Callable[[F], bool] | None = None) -> list[int]:
        """The other side of the flights ``which`` selects (None: all) is gone: they leave the book; abandoned
        ones go back to the free list, the others are lost (:attr:`lost`) and returned: the caller answers those
        it takes (:meth:`take`)."""
        lost = []
        for index, flight in list(self.inflight.items()):
            if which is not None and not which(flight):
                continue
            del self.inflight[index]
            if flight.abandoned:
                self._free.append(index)
            else:
                lost.append(index)
        self.lost.update(lost)
        return sorted(lost)

    def take(self, indexes: list[int]) -> list[int]:
        """The caller hears of lost frames ``indexes``: those still lost (not abandoned since), now the caller's
        to answer and release."""
        taken = sorted(index for index in set(indexes) if index in self.lost)
        self.lost.difference_update(taken)
        return taken

    # -- what does not match a frame in flight ---------------------------------------------------
    def stray(self, index: int, final: bool, answers: int = 0) -> None:
        """A completion for frame ``index`` that is not (or no longer) in flight: a second final for the
        request it last answered is a duplicate, anything else unknown."""
        if final and 0 <= index < self.count and self._answered[index] == answers:
            self.stats.duplicates += 1
        else:
            self.stats.unknown += 1

    def unknown(self) -> None:
        """A completion for an in-flight frame that belongs to another request of it."""
        self.stats.unknown += 1
