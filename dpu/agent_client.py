"""The edge's side of ``edgepath agent``: frames in shared memory, submissions, answers.

An :class:`~edgepath.dpu.port.AgentPort` like :class:`edgepath.dpu.agent.Agent` (acquire a frame, fill it
in place, submit, poll, read the result, release; ``check_links``, ``revive``, ``free_slots``,
``capacity``), with the same frame book (:mod:`edgepath.dpu.frame_book`), so an edge can use an
in-process agent or a separate agent process alike.  Every submission is answered
through :meth:`poll`; a refusal shows as its result's ``status``.  If the agent process dies, what
was in flight is returned by :meth:`check_links` (the edge answers 503) and :meth:`revive` connects to
its successor -- the edge keeps running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from edgepath.contract import wire
from edgepath.contract.pool import AgentFrames, FrameLayout, reply_stride, request_stride
from edgepath.dpu.frame_book import Flight, FrameBook
from edgepath.dpu.link_state import LinkHealth, LinkState, Reason
from edgepath.dpu.port import Delivery, DeliveryStats, SlotLimits, SlotServerStatus
from edgepath.native.abi import Status
from edgepath.transports.base import Access, TransportError
from edgepath.transports.loopback import LoopbackTransport
from edgepath.transports.peer_auth import PeerKeys

log = logging.getLogger("edgepath.agent_client")


class AgentClient:
    """An :class:`~edgepath.dpu.port.AgentPort` backed by an ``edgepath agent`` process."""

    def __init__(self, address: str, keys: PeerKeys, timeout: float = 5.0) -> None:
        """Connect to the agent process at ``address``, proving this edge holds ``keys``' peer secret."""
        self.address = address
        self.transport = LoopbackTransport(keys)
        self._completions = self.transport.register(wire.COMPLETIONS_REGION, 8, Access.REMOTE_WRITE)
        self._scratch = self.transport.register("scratch", 8, Access.NONE)
        self._alive = False
        self._gone_at = 0.0  # when the agent process was seen gone (time.monotonic)
        self._stalled: list[int] = []  # frames the agent said are on an unresponsive slot server
        self.delivery_stats = DeliveryStats()
        self._connect(timeout)

    def _connect(self, timeout: float) -> None:
        conn = self.transport.connect(self.address, [self._completions], wire.edge_hello(), timeout=timeout)
        region = conn.remote.get(wire.REQUESTS_REGION)
        replies = conn.remote.get(wire.REPLIES_REGION)
        status = conn.remote.get(wire.STATUS_REGION)
        if region is None or replies is None or status is None:
            conn.close()
            raise TransportError(
                f"{self.address}: the agent must export {wire.REQUESTS_REGION!r}, {wire.REPLIES_REGION!r} "
                f"and {wire.STATUS_REGION!r}"
            )
        try:
            grant = wire.EdgeGrant.parse(conn.peer_info)
        except wire.InfoInvalid as exc:
            conn.close()
            raise TransportError(f"{self.address}: not an agent's answer ({exc})") from exc
        self.conn = conn
        self._region = region
        self._status = wire.AgentStatus(conn.local_view(status))
        self._slot_servers = grant.slot_servers
        self.layout = FrameLayout(grant.input_capacity, grant.output_capacity)
        count, base = grant.frame_count, grant.frame_base
        self.frames = AgentFrames(
            conn.local_view(region),
            conn.local_view(replies),
            count,
            self.layout,
            requests_offset=base * request_stride(self.layout.input_capacity),
            replies_offset=base * reply_stride(self.layout.output_capacity),
        )
        self.book: FrameBook[Flight] = FrameBook(count, self.delivery_stats)
        self._stalled = []
        self._alive = True

    def fileno(self) -> int:
        return self.transport.cq.fileno()

    def arm(self) -> bool:
        return self.transport.cq.arm()

    def alive(self) -> bool:
        return self._alive

    def capacity(self) -> FrameLayout:
        """The agent's frames: it checks each request against its slot servers itself."""
        return self.layout

    def acquire(self) -> int | None:
        return self.book.acquire()

    def release(self, index: int) -> None:
        self.book.release(index)

    def _post(self, imm: int) -> bool:
        try:
            self.conn.write_with_imm(self._scratch, 0, self._region, 0, 0, imm)
        except TransportError:
            return False
        return True

    def set_limits(self, limits: Mapping[int, SlotLimits]) -> None:
        """Nothing to hand over: the agent process learns each tenant's floor and cap from its requests' headers (an
        edge and the agent process share memory for frames only), so it takes slots back only from tenants whose
        floor a request has named there."""

    def early_refusal(self, index: int, tenant: int, floor: int, slots: int = 1) -> Status | None:
        """None: the agent process reads the state words and decides at :meth:`submit` (the free count it publishes
        is older than a claim, and a refusal never rests on an old view)."""
        return None

    def submit(self, index: int) -> Status | None:
        """Hand frame ``index`` to the agent; answered later through :meth:`poll`, or UNAVAILABLE now
        when the agent is gone."""
        if not 0 <= index < self.frames.count:
            return Status.BAD_REQUEST
        if not self._alive:
            return Status.UNAVAILABLE
        self.book.sent(index, Flight())
        if not self._post(wire.submit_imm(index)):
            self.book.unsent(index)
            return Status.UNAVAILABLE
        return None

    def submit_group(self, indexes: Sequence[int]) -> Status | None:
        """Hand frames ``indexes`` -- one request's choices -- to the agent as one group, claimed together there (all or
        none, :meth:`Agent.submit_group`); each is answered later through :meth:`poll` -- a refusal in every frame, the
        first's (which holds the figures) first -- or UNAVAILABLE now when the agent is gone."""
        if not indexes or not all(0 <= index < self.frames.count for index in indexes):
            return Status.BAD_REQUEST
        if not self._alive:
            return Status.UNAVAILABLE
        for index in indexes:
            self.book.sent(index, Flight())
        last = len(indexes) - 1
        for k, index in enumerate(indexes):
            if not self._post(wire.submit_imm(index) if k == last else wire.group_member_imm(index)):
                for sent in indexes:
                    self.book.unsent(sent)
                return Status.UNAVAILABLE
        return None

    def cancel(self, index: int) -> None:
        if index in self.book.inflight and self._alive:
            self._post(wire.edge_cancel_imm(index))

    def abandon(self, index: int) -> None:
        """Cancel, deliver nothing more, and take the frame back when the agent's final answer for it comes
        (the agent cannot write into it after that), or when the agent is gone."""
        if self.book.abandon(index) is not None:
            self.cancel(index)

    def poll(self, timeout: float | None = 0.0, spin: float = 0.0) -> list[Delivery]:
        out = []
        book = self.book
        for c in self.transport.cq.wait(timeout, spin=spin, max_entries=256):
            index = wire.imm_index(c.imm)
            if wire.is_stalled_imm(c.imm):
                if c.conn_id == self.conn.conn_id and index in book.inflight:
                    self._stalled.append(index)
                continue
            progress = wire.is_progress_imm(c.imm)
            if c.conn_id != self.conn.conn_id or index not in book.inflight:
                book.stray(index, not progress)  # the agent answers each frame's submission once
                log.warning("ignoring an answer for frame %d: not in flight", index)
                continue
            result = self.frames.result_headers[index]
            if progress:
                delivery = book.progress(index, wire.progress_count(result.progress))
            else:
                delivery = book.final(index, result.output_count)
            if delivery is not None:
                out.append(delivery)
        return out

    def check_links(self) -> list[int]:
        """Frames lost because the agent process went away (answer them 503)."""
        if not self._alive or self.conn.check_alive():
            return []
        log.warning("agent %s disconnected", self.address)
        self._alive = False
        self._gone_at = time.monotonic()
        return self.book.take(self.book.lose())

    def stalled(self) -> list[int]:
        """Frames the agent process reported on an unresponsive slot server (once each), still in flight."""
        stalled, self._stalled = self._stalled, []
        inflight = self.book.inflight
        return [index for index in stalled if index in inflight and not inflight[index].abandoned]

    def links_health(self) -> list[LinkHealth]:
        """The agent process's links to its slot servers as it last published them; while the agent process
        itself is gone, one DOWN link named by the agent's address."""
        if not self._alive:
            detail = "the agent process went away"
            return [LinkHealth(self.address, LinkState.DOWN, Reason.DISCONNECTED, self._gone_at, 0.0, 1.0, detail)]
        published = self._status.links()
        unpublished = [(0,) * wire.LINK_WORDS] * (len(self._slot_servers) - len(published))
        return [LinkHealth.from_words(a, w) for a, w in zip(self._slot_servers, published + unpublished, strict=False)]

    def revive(self, timeout: float = 0.05) -> list[str]:
        """Connect to the agent again (a restarted one); its frames replace the old ones. The address when
        it is back."""
        if self._alive:
            return []
        old = self.conn
        try:
            self._connect(timeout)
        except (TransportError, OSError):
            return []
        old.close()
        log.info("agent %s is back", self.address)
        return [self.address]

    def free_slots(self) -> tuple[int, int]:
        """(free, total) slots on the agent's live slot servers, as the agent last published them."""
        if not self._alive:
            return 0, 0
        free, total, _ = self._status.read()
        return free, total

    def servers(self) -> list[SlotServerStatus]:
        """The agent process's slot servers as their links' health (:meth:`links_health`); their slots and
        this agent's claims there are the agent process's to count: not published, so not listed."""
        return [SlotServerStatus(health) for health in self.links_health()]

    def close(self) -> None:
        self.transport.close()
