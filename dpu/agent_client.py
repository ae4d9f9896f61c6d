"""The edge's side of ``edgepath agent``: frames in shared memory, submissions, answers.

Same shape as :class:`edgepath.dpu.agent.Agent` for its caller (acquire a frame, fill it in place,
submit, poll, read the result, release; ``check_links``, ``revive``, ``free_slots``, ``links``), so an
edge can use an in-process agent or a separate agent process alike.  Every submission is answered
through :meth:`poll`; a refusal shows as its result's ``status``.  If the agent process dies, what
was in flight is returned by :meth:`check_links` (the edge answers 503) and :meth:`revive` connects to
its successor -- the edge keeps running.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edgepath.dma import wire
from edgepath.dma.loopback import LoopbackTransport
from edgepath.dma.pool import AgentFrames, FrameLayout, reply_stride, request_stride
from edgepath.dma.transport import Access, TransportError
from edgepath.dpu.port import Delivery, DeliveryStats
from edgepath.native.abi import Status

log = logging.getLogger("edgepath.agent_client")


@dataclass
class AgentLink:
    """The edge's view of its upstream: the agent process (fields as on a slot-server link)."""

    address: str
    input_capacity: int
    output_capacity: int
    alive: bool = True


@dataclass(slots=True)
class _Flight:
    count: int = 0  # output tokens delivered so far
    abandoned: bool = False


class AgentClient:
    """An :class:`~edgepath.dpu.port.AgentPort` backed by an ``edgepath agent`` process."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        self.address = address
        self.transport = LoopbackTransport()
        self._completions = self.transport.register(wire.COMPLETIONS_REGION, 8, Access.REMOTE_WRITE)
        self._scratch = self.transport.register("scratch", 8, Access.NONE)
        self.inflight: dict[int, _Flight] = {}
        self.links: list[AgentLink] = []
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
        self._free = list(range(count - 1, -1, -1))
        self._finals = np.zeros(count, dtype=np.int64) - 1
        self.inflight.clear()
        self.links = [AgentLink(self.address, self.layout.input_capacity, self.layout.output_capacity)]

    def fileno(self) -> int:
        return self.transport.cq.fileno()

    def arm(self) -> bool:
        return self.transport.cq.arm()

    def alive(self) -> bool:
        return self.links[0].alive

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        if index in self.inflight:
            raise ValueError(f"frame {index} is still in flight (abandon it instead)")
        self._free.append(index)

    def _post(self, imm: int) -> bool:
        try:
            self.conn.write_with_imm(self._scratch, 0, self._region, 0, 0, imm)
        except TransportError:
            return False
        return True

    def submit(self, index: int) -> Status | None:
        """Hand frame ``index`` to the agent; answered later through :meth:`poll`, or UNAVAILABLE now
        when the agent is gone."""
        if not 0 <= index < self.frames.count:
            return Status.BAD_REQUEST
        if not self.links[0].alive:
            return Status.UNAVAILABLE
        self.inflight[index] = _Flight()
        if not self._post(wire.submit_imm(index)):
            del self.inflight[index]
            return Status.UNAVAILABLE
        return None

    def cancel(self, index: int) -> None:
        if index in self.inflight and self.links[0].alive:
            self._post(wire.edge_cancel_imm(index))

    def abandon(self, index: int) -> None:
        """Cancel, deliver nothing more, and take the frame back when the agent's final answer for it comes
        (the agent cannot write into it after that), or when the agent is gone."""
        flight = self.inflight.get(index)
        if flight is None:
            raise ValueError(f"frame {index} is not in flight")
        if not flight.abandoned:
            flight.abandoned = True
            self.delivery_stats.abandoned += 1
            self.cancel(index)

    def poll(self, timeout: float | None = 0.0, spin: float = 0.0) -> list[Delivery]:
        out = []
        stats = self.delivery_stats
        for c in self.transport.cq.wait(timeout, spin=spin, max_entries=256):
            index = wire.imm_index(c.imm)
            flight = self.inflight.get(index) if c.conn_id == self.conn.conn_id else None
            if flight is None:
                if not wire.is_progress_imm(c.imm) and 0 <= index < self.frames.count and self._finals[index] >= 0:
                    stats.duplicates += 1
                else:
                    stats.unknown += 1
                log.warning("ignoring an answer for frame %d: not in flight", index)
                continue
            if wire.is_progress_imm(c.imm):
                count = wire.progress_count(self.frames.result_headers[index].progress)
                if not flight.abandoned and count > flight.count:
                    flight.count = count
                    out.append(Delivery(index, count, False))
                continue
            del self.inflight[index]
            self._finals[index] = 1
            if flight.abandoned:
                stats.late += 1
                self._free.append(index)
                continue
            stats.delivered += 1
            out.append(Delivery(index, self.frames.result_headers[index].output_count, True))
        return out

    def check_links(self) -> list[int]:
        """Frames lost because the agent process went away (answer them 503)."""
        link = self.links[0]
        if not link.alive or self.conn.check_alive():
            return []
        log.warning("agent %s disconnected", self.address)
        link.alive = False
        lost = sorted(i for i, f in self.inflight.items() if not f.abandoned)
        self._free.extend(i for i, f in self.inflight.items() if f.abandoned)
        self.inflight.clear()
        return lost

    def revive(self, timeout: float = 0.05) -> list[AgentLink]:
        """Connect to the agent again (a restarted one); its frames replace the old ones."""
        if self.links[0].alive:
            return []
        old = self.conn
        try:
            self._connect(timeout)
        except (TransportError, OSError):
            return []
        old.close()
        log.info("agent %s is back", self.address)
        return self.links

    def free_slots(self) -> tuple[int, int]:
        """(free, total) slots on the agent's live slot servers, as the agent last published them."""
        if not self.links[0].alive:
            return 0, 0
        free, total, _ = self._status.read()
        return free, total

    def close(self) -> None:
        self.transport.close()
