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

from edgepath.dma.loopback import LoopbackConnection, LoopbackTransport
from edgepath.dma.pool import AgentFrames, FrameLayout, reply_stride, request_stride
from edgepath.dma.transport import Access, TransportError
from edgepath.dpu.agent_service import EDGE_FRAMES_REGION, EDGE_REPLIES_REGION, STATUS_REGION
from edgepath.native.abi import Status

log = logging.getLogger("edgepath.agent_client")


@dataclass
class AgentLink:
    """The edge's view of its upstream: the agent process (fields as on a slot-server link)."""

    address: str
    input_capacity: int
    output_capacity: int
    alive: bool = True


class AgentClient:
    def __init__(self, address: str, timeout: float = 5.0) -> None:
        self.address = address
        self.transport = LoopbackTransport()
        self._completions = self.transport.register("completions", 8, Access.REMOTE_WRITE)
        self._scratch = self.transport.register("scratch", 8, Access.NONE)
        self.inflight: set[int] = set()
        self.links: list[AgentLink] = []
        self._connect(timeout)

    def _connect(self, timeout: float) -> None:
        conn = self.transport.connect(self.address, [self._completions], {"role": "edge"}, timeout=timeout)
        region = conn.remote.get(EDGE_FRAMES_REGION)
        replies = conn.remote.get(EDGE_REPLIES_REGION)
        status = conn.remote.get(STATUS_REGION)
        if region is None or replies is None or status is None:
            conn.close()
            raise TransportError(
                f"{self.address}: the agent must export {EDGE_FRAMES_REGION!r}, {EDGE_REPLIES_REGION!r} "
                f"and {STATUS_REGION!r}"
            )
        info = conn.peer_info
        self.conn: LoopbackConnection = conn
        self._region = region
        self._status = status.handle.array[:24].view(np.uint64)
        self.layout = FrameLayout(int(info["input_capacity"]), int(info["output_capacity"]))
        count = int(info["frame_count"])
        base = int(info["frame_base"])
        self.frames = AgentFrames(
            region.handle.array,
            replies.handle.array,
            count,
            self.layout,
            requests_offset=base * request_stride(self.layout.input_capacity),
            replies_offset=base * reply_stride(self.layout.output_capacity),
        )
        self._free = list(range(count - 1, -1, -1))
        self.inflight.clear()
        self.links = [AgentLink(self.address, self.layout.input_capacity, self.layout.output_capacity)]

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        if index in self.inflight:
            raise ValueError(f"frame {index} is still in flight")
        self._free.append(index)

    def submit(self, index: int) -> Status | None:
        """Hand frame ``index`` to the agent; answered later through :meth:`poll`, or UNAVAILABLE now
        when the agent is gone."""
        if not 0 <= index < self.frames.count:
            return Status.BAD_REQUEST
        if not self.links[0].alive:
            return Status.UNAVAILABLE
        self.inflight.add(index)
        try:
            self.conn.write_with_imm(self._scratch, 0, self._region, 0, 0, index)
        except TransportError:
            self.inflight.discard(index)
            return Status.UNAVAILABLE
        return None

    def poll(self, timeout: float | None = 0.0, spin: float = 0.0) -> list[int]:
        done = []
        for c in self.transport.cq.wait(timeout, spin=spin, max_entries=256):
            if c.conn_id == self.conn.conn_id and c.imm in self.inflight:
                self.inflight.discard(c.imm)
                done.append(c.imm)
        return done

    def check_links(self) -> list[int]:
        """Frames lost because the agent process went away (answer them 503)."""
        link = self.links[0]
        if not link.alive or self.conn.check_alive():
            return []
        log.warning("agent %s disconnected", self.address)
        link.alive = False
        lost = sorted(self.inflight)
        self.inflight.clear()
        return lost

    def revive(self, timeout: float = 1.0) -> list[AgentLink]:
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
        free, total, _ = (int(v) for v in self._status)
        return free, total

    def close(self) -> None:
        self.transport.close()
