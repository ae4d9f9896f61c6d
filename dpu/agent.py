"""The DPU-side agent: claims a slot with a remote CAS, writes the request, rings the doorbell.

The agent owns a registered *frame* region.  Whoever feeds it (the edge, in
process or through :mod:`edgepath.dpu.agent_service`) writes a request's token
ids once, straight into a frame; the agent sends that frame to the claimed slot
with one RDMA WRITE (no copy on the way) and the slot server writes the result
back into the same frame's result area.

This class is the agent port (:class:`~edgepath.dpu.port.AgentPort`) over parts that each do one job: the slot
servers it is attached to and their links' states (:class:`~edgepath.dpu.links.LinkSet`: attach, verify, watch
the heartbeat, re-attach), the frames in flight (:class:`~edgepath.dpu.frame_book.FrameBook`), which server a
request is claimed on and whether it is refused (:class:`~edgepath.dpu.submission.Submission`, over
:class:`~edgepath.dpu.admission.Admission`, sans I/O), what is done to a slot (:class:`~edgepath.dpu.claims.Claims`:
claim, give back, send), slot floors and taking a lent slot back (:class:`~edgepath.dpu.floor_book.FloorBook`),
moving a request to another slot (:class:`~edgepath.dpu.migration.Mover`) and what slot servers answer
(:class:`~edgepath.dpu.deliveries.Deliveries`).  Admission is decided once, at claim time: a slot is taken only by a
CAS of its state word from FREE to CLAIMED.  If no CAS on any UP slot server succeeds (after one refresh of the
cached state words), the answer is NO_SLOT at once.  A link that goes down answers what it held
(:meth:`Agent.check_links`); one found unresponsive reports the frames in flight on it once
(:meth:`Agent.stalled`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.contract.pool import DEFAULT_CAPACITY, AgentFrames, FrameLayout
from edgepath.dpu.admission import Admission
from edgepath.dpu.backoff import Backoff
from edgepath.dpu.claims import Claims, InFlight
from edgepath.dpu.deliveries import Deliveries
from edgepath.dpu.floor_book import FloorBook
from edgepath.dpu.frame_book import FrameBook
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT, LinkHealth, Reason
from edgepath.dpu.links import (
    DEFAULT_DRAIN_TIMEOUT,
    REATTACH_BACKOFF,
    REATTACH_TIMEOUT,
    AgentError,
    LinkSet,
    ServerLink,
)
from edgepath.dpu.migration import DEFAULT_MIGRATION_LIMIT, Mover
from edgepath.dpu.port import Delivery, SlotLimits, SlotServerStatus
from edgepath.dpu.resolvers import Follower
from edgepath.dpu.retry_advice import RetryAdvice
from edgepath.dpu.submission import Submission
from edgepath.native.abi import Status
from edgepath.transports.base import Access, MemoryRegion, Transport

__all__ = ["DEFAULT_MAX_WAIT", "DEFAULT_MIGRATION_LIMIT", "Agent", "AgentError", "InFlight", "ServerLink"]

#: seconds a request may be predicted to wait for its first token beyond its own prompt's time, by default
#: (``--max-wait``): about one other long prompt ahead of it on this project's 2-core CPU (docs/ADMISSION.md)
DEFAULT_MAX_WAIT = 2.0


class Agent:
    """Claims slots on attached slot servers and moves frames into them."""

    def __init__(
        self,
        transport: Transport,
        frames: int = 256,
        input_capacity: int = DEFAULT_CAPACITY,
        output_capacity: int = DEFAULT_CAPACITY,
        max_servers: int = 8,
        max_slots_per_server: int = 65536,
        frames_buffer: np.ndarray | None = None,
        replies_buffer: np.ndarray | None = None,
        frames_access: Access = Access.NONE,
        hang_timeout: float = DEFAULT_HANG_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        reattach: Backoff = REATTACH_BACKOFF,
        max_wait: float = DEFAULT_MAX_WAIT,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        seed: int | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        """Frames are two registered regions (least privilege): requests, which the agent only sends
        from -- no peer may write them (``frames_access`` widens that only for an agent whose edges
        share the region over loopback) -- and replies, the one region slot servers may write.
        ``frames_buffer``/``replies_buffer``: memory owned elsewhere (shared with edges) that
        ``transport`` registers in place (the verbs transport can), so the edges' token writes are
        what the NIC sends and results land where the edges read them.  ``hang_timeout``: seconds of a
        still heartbeat that make a slot server UNRESPONSIVE; ``clock``: monotonic seconds (a test's own);
        ``reattach``: how often :meth:`revive` tries a slot server that went away; ``max_wait``: seconds a
        request may be predicted to wait for its first token beyond its own prompt's time (its own bound,
        ``max_wait_ms`` in its request header, may only be smaller); ``migration_limit``: how often one request
        may move to another slot server when its own goes down or unresponsive (0: never: it is answered 503 or
        504 then); ``seed``: of the jitter on refused clients' retry times (a test's own); ``drain_timeout``:
        seconds a draining slot server keeps its requests before they move (:meth:`LinkSet.settle`)."""
        if migration_limit < 0:
            raise ValueError(f"migration limit must be >= 0, got {migration_limit}")
        if not max_wait > 0:
            raise ValueError(f"max wait must be positive seconds, got {max_wait}")
        self.max_wait_ms = max_wait * 1e3
        self.retry_advice = RetryAdvice(random.Random(seed))
        self.transport = transport
        self.layout = FrameLayout(input_capacity, output_capacity)
        req_size, rep_size = AgentFrames.sizes(frames, self.layout)
        if not hang_timeout > 0:  # checked before anything is registered
            raise ValueError(f"hang timeout must be positive seconds, got {hang_timeout}")
        self.frames_mr: MemoryRegion = transport.register(
            wire.REQUESTS_REGION, req_size, frames_access, buffer=frames_buffer
        )
        self.replies_mr: MemoryRegion = transport.register(
            wire.REPLIES_REGION, rep_size, wire.REPLIES_ACCESS, buffer=replies_buffer
        )
        self.frames = AgentFrames(self.frames_mr.buf, self.replies_mr.buf, frames, self.layout)
        self.link_set = LinkSet(
            transport,
            wire.AgentHello(frames, input_capacity, output_capacity),
            [self.replies_mr],
            max_servers,
            max_slots_per_server,
            hang_timeout,
            clock,
            reattach,
            on_down=self._lose,
            on_unresponsive=self._stall,
            drain_timeout=drain_timeout,
        )
        self.follower: Follower | None = None  # where the slot servers are read from, when they are not fixed
        #: the attached slot servers, in attach order (the link set's own list)
        self.links = self.link_set.links
        self.admission = Admission(input_capacity)
        self.book: FrameBook[InFlight] = FrameBook(frames)
        self.inflight = self.book.inflight
        self.delivery_stats = self.book.stats
        self.claims = Claims(
            self.link_set, self.frames, self.frames_mr, self.layout, self.book, self.admission, self.retry_advice
        )
        self.floors = FloorBook(self.claims)
        self.submission = Submission(self.claims, self.floors, self.max_wait_ms)
        self.mover = Mover(self.claims, migration_limit)
        self.deliveries = Deliveries(self.claims, self.floors, self.mover)
        self._lost: list[int] = []  # frames lost with a link that went down, for check_links to return
        self._stalled: list[int] = []  # frames in flight on a link when it became unresponsive, for stalled()

    def set_limits(self, limits: Mapping[int, SlotLimits]) -> None:
        """The slot floors and caps of every tenant that has one, by its id (:meth:`FloorBook.set_limits`)."""
        self.floors.set_limits(limits)

    # -- requests: the port's calls, each answered by the part whose job it is ----------------------
    def check_frame(self, index: int) -> str | None:
        """Why frame ``index`` cannot be sent (None if it can)."""
        return self.submission.check_frame(index)

    def early_refusal(self, index: int, tenant: int, floor: int, slots: int = 1) -> Status | None:
        """NO_SLOT before frame ``index``'s prompt costs anything (:meth:`Submission.early_refusal`)."""
        return self.submission.early_refusal(index, tenant, floor, slots)

    def submit(self, index: int) -> Status | None:
        """Send frame ``index`` (:meth:`Submission.submit`): None when in flight (its result arrives via
        :meth:`poll`), else the refusal."""
        return self.submission.submit(index)

    def submit_group(self, indexes: Sequence[int]) -> Status | None:
        """Send frames ``indexes`` -- one request's choices -- to as many slots of one slot server, all or none
        (:meth:`Submission.submit_group`)."""
        return self.submission.submit_group(indexes)

    def deliver(self, conn_id: int, imm: int) -> Delivery | None:
        """Account one completion from a slot server (:meth:`Deliveries.deliver`)."""
        return self.deliveries.deliver(conn_id, imm)

    def cancel(self, index: int) -> None:
        """Ask the slot running frame ``index`` to stop (:meth:`Deliveries.cancel`)."""
        self.deliveries.cancel(index)

    def abandon(self, index: int) -> None:
        """Give up on frame ``index`` (:meth:`Deliveries.abandon`)."""
        self.deliveries.abandon(index)

    # -- frames ---------------------------------------------------------------------
    def acquire(self) -> int | None:
        """A frame index the caller may fill (tokens, request header), or None if all are taken."""
        return self.book.acquire()

    def release(self, index: int) -> None:
        """Give a frame back once its result has been read (or it was refused)."""
        self.book.release(index)

    def capacity(self) -> FrameLayout:
        """The largest request and answer the first slot server takes in these frames."""
        if not self.links:
            return self.layout
        link = self.links[0]
        return FrameLayout(
            min(self.layout.input_capacity, link.input_capacity), min(self.layout.output_capacity, link.output_capacity)
        )

    def fileno(self) -> int:
        return self.transport.cq.fileno()

    def arm(self) -> bool:
        return self.transport.cq.arm()

    def alive(self) -> bool:
        """Whether any slot server is connected (UP or UNRESPONSIVE)."""
        return self.link_set.alive()

    def links_health(self) -> list[LinkHealth]:
        """Every slot server's link: state, reason, since when (one per attached server, in order)."""
        return self.link_set.health()

    def attach(self, address: str, timeout: float = 5.0) -> ServerLink:
        """Connect to a slot server and verify its pool (:meth:`LinkSet.attach`)."""
        return self.link_set.attach(address, timeout)

    def follow(self, follower: Follower, timeout: float = 5.0) -> None:
        """Take the slot servers from ``follower``'s source from now on: resolve it and attach what it names
        now (one that does not answer is tried again with back-off), then follow its changes in :meth:`revive`."""
        self.follower = follower
        for address in follower.first().attach:
            self.link_set.add(address)
        self.link_set.join_now(timeout)

    def revive(self, timeout: float = REATTACH_TIMEOUT) -> list[ServerLink]:
        """Follow the source of slot servers (attach the new, drain the gone: :meth:`LinkSet.settle`) and
        re-attach slot servers that went away (:meth:`LinkSet.revive`); cheap at every tick."""
        link_set = self.link_set
        if self.follower is not None:
            changes = self.follower.poll()
            for address in changes.attach:
                link_set.add(address)
            for address in changes.drain:
                link_set.remove(address)
        link_set.settle()
        return link_set.revive(timeout)

    def _lose(self, link: ServerLink) -> None:
        """``link`` went down: what was in flight there moves to another slot server when it can
        (:class:`~edgepath.dpu.migration.Mover`); the rest is lost -- abandoned frames go back to the free list, the
        others wait in ``_lost`` for :meth:`check_links` to return them."""
        if self.mover.limit:
            for index, flight in list(self.book.inflight.items()):
                if flight.link is link and not (flight.abandoned or flight.cancelled or flight.reclaim):
                    self.mover.move(index, flight)
        self.floors.forget(link)
        self._lost += self.book.lose(lambda flight: flight.link is link)

    def _stall(self, link: ServerLink) -> None:
        """``link`` became unresponsive.  When another server is up and requests may move, the link is taken
        down at once (its connection closed, so a server that thaws cannot write into frames that moved) and
        its requests migrate; otherwise the frames in flight there are reported once by :meth:`stalled`."""
        moving = self.mover.limit and any(other.up for other in self.links if other is not link)
        if moving and any(f.link is link for f in self.book.inflight.values()):
            link.conn.close()
            self.link_set.down(link, Reason.DROPPED, "its heartbeat stood still for the hang timeout")
            return
        self._stalled += [i for i, f in self.book.inflight.items() if f.link is link and not f.abandoned]

    def check_links(self) -> list[int]:
        """Handle connection events and read the heartbeat of every connected server not read within the
        probe interval; frames lost with a slot server that went away are returned (answer them 503)."""
        self.link_set.check()
        overdue = self.floors.overdue()
        lost, self._lost = self._lost, []
        return overdue + self.book.take(lost)  # those abandoned since they were lost were freed then

    def stalled(self) -> list[int]:
        """Frames that were in flight on a slot server when it was found UNRESPONSIVE (even if it has come back
        since), each reported once; the caller answers them and abandons them (they stay fenced until that
        server lets go of them or its link is lost)."""
        stalled, self._stalled = self._stalled, []
        inflight = self.book.inflight
        return [index for index in stalled if index in inflight and not inflight[index].abandoned]

    def poll(self, timeout: float | None = 0.0, spin: float = 0.0) -> list[Delivery]:
        """What arrived for frames in flight: streamed progress and final results (in ``frames.results`` /
        ``frames.outputs``)."""
        out = []
        for c in self.transport.cq.wait(timeout, spin=spin, max_entries=256):
            delivery = self.deliveries.deliver(c.conn_id, c.imm)
            if delivery is not None:
                out.append(delivery)
        return out

    def free_slots(self) -> tuple[int, int]:
        """(free slots on UP servers, slots on all servers), read now (:meth:`LinkSet.free_slots`)."""
        return self.link_set.free_slots()

    def servers(self) -> list[SlotServerStatus]:
        """Every slot server this agent attached, in attach order (:meth:`LinkSet.servers`)."""
        return self.link_set.servers()

    def describe(self) -> dict[str, Any]:
        return {"servers": self.link_set.describe()}
