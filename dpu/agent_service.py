"""``edgepath agent``: the agent as its own process, fed by edges over shared memory.

The agent's frame region is shared with each connected edge, which gets a range
of frames of its own: the edge writes token ids straight into a frame (the one
write), then posts a zero-length WRITE_WITH_IMM naming the frame.  The agent
claims a slot and sends the frame from that same memory; the slot server's
result lands in the same frame, and the agent posts the frame index back.
Refusals (NO_SLOT, UNAVAILABLE, BAD_REQUEST) are written into the frame's result
header and posted the same way, so every submission gets exactly one answer.

This edge <-> agent hop is shared memory (loopback) by design: it models a DPU
agent with access to host memory.  The agent <-> slot server hop may be any
transport.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgepath.contract import wire
from edgepath.contract.pool import AgentFrames, FrameLayout
from edgepath.dpu.agent import Agent
from edgepath.native.abi import Status
from edgepath.transports.base import Access, Connection, Listener, MemoryRegion, Transport, TransportError
from edgepath.transports.connections import ConnectionManager

log = logging.getLogger("edgepath.agent_service")

STATUS_INTERVAL = 0.1  # seconds between status refreshes (one state-word READ per slot server)


def edge_regions(
    transport: Transport, frames: int, input_capacity: int, output_capacity: int
) -> tuple[MemoryRegion, MemoryRegion]:
    """Requests (edges write them) and replies (edges only read them) registered with the edges'
    transport, for an agent that reaches slot servers over another one."""
    req_size, rep_size = AgentFrames.sizes(frames, FrameLayout(input_capacity, output_capacity))
    return (
        transport.register(wire.REQUESTS_REGION, req_size, Access.REMOTE_WRITE),
        transport.register(wire.REPLIES_REGION, rep_size, Access.REMOTE_READ),
    )


@dataclass
class _Edge:
    conn: Connection
    base: int
    count: int


class AgentService:
    """Serves edges on ``edge_transport`` (shared memory) with ``agent``."""

    def __init__(
        self,
        agent: Agent,
        edge_transport: Transport,
        address: str,
        frames_per_edge: int = 64,  # each edge gets a range of the agent's frames this long
        spin: float = 0.0,  # seconds the loop spins on its queues before it sleeps
        edge_frames: tuple[MemoryRegion, MemoryRegion] | None = None,
    ) -> None:
        """``edge_frames``: when the agent reaches slot servers over another transport (verbs), the
        same requests and replies memory registered with ``edge_transport``: what edges are given."""
        if agent.transport is not edge_transport and edge_frames is None:
            raise ValueError("an agent on another transport than its edges needs edge_frames (its frames, shared)")
        regions = edge_frames or (agent.frames_mr, agent.replies_mr)
        for region, own in zip(regions, (agent.frames_mr, agent.replies_mr), strict=True):
            if region.buf.ctypes.data != own.buf.ctypes.data:
                raise ValueError("edge_frames must be the very memory of the agent's frames (zero copy)")
        if not 1 <= frames_per_edge <= agent.frames.count:
            raise ValueError(f"frames_per_edge must be 1..{agent.frames.count}, got {frames_per_edge}")
        self.agent = agent
        self.transport = edge_transport
        self.frames_per_edge = frames_per_edge
        self.spin = spin
        self._free_ranges = list(range(agent.frames.count // frames_per_edge - 1, -1, -1))
        self.edges: dict[int, _Edge] = {}
        self._groups: dict[int, list[int]] = {}  # per edge: the frames of a group whose last frame has not come yet
        self._by_range: dict[int, _Edge] = {}
        self._lock = threading.Lock()
        self.notify_mr: MemoryRegion = edge_transport.register("notify", 8, Access.NONE)
        # Free/total slots and liveness of the slot servers, refreshed by the serve loop, read by edges.
        self.status_mr: MemoryRegion = edge_transport.register(
            wire.STATUS_REGION, wire.STATUS_BYTES, Access.REMOTE_READ
        )
        self._status = wire.AgentStatus(self.status_mr.buf)
        # Edges name the links by the addresses given here, in order: a set that follows a source changes, so
        # such an agent publishes its totals only.
        self._fixed = agent.follower is None
        self.listener: Listener = edge_transport.listen(
            address,
            [*regions, self.status_mr],
            wire.EdgeGrant.capacities(
                agent.layout.input_capacity,
                agent.layout.output_capacity,
                [link.address for link in agent.links] if self._fixed else [],
            ),
        )
        self.address = address
        self.connections = ConnectionManager(self.listener, self._admit, "agent-cm")
        self._stop = threading.Event()
        self.publish_status()  # true from the first edge on

    # -- edges come and go -----------------------------------------------------------
    def _admit(self, conn: Connection) -> dict[str, Any]:
        """Give a new edge a frame range of its own (refused when none is left)."""
        if not wire.is_edge_hello(conn.peer_info):
            raise ValueError(f"not an edge (connection data {conn.peer_info}): only edges connect to an agent process")
        with self._lock:
            if not self._free_ranges:
                raise ValueError("no free frame range for another edge")
            base = self._free_ranges.pop() * self.frames_per_edge
            edge = _Edge(conn, base, self.frames_per_edge)
            self.edges[conn.conn_id] = edge
            self._by_range[base // self.frames_per_edge] = edge
        return wire.EdgeGrant.frames(base, self.frames_per_edge)

    def _reap(self) -> None:
        """Edges that went away give their frame range back (slot servers are watched by the serve loop,
        which can revive them)."""
        for cid in self.connections.gone():
            edge = self.edges.pop(cid, None)
            self._groups.pop(cid, None)
            if edge is None:
                continue
            edge.conn.close()
            with self._lock:
                self._by_range.pop(edge.base // self.frames_per_edge, None)
                self._free_ranges.append(edge.base // self.frames_per_edge)

    # -- data path -------------------------------------------------------------------
    def _edge_of(self, index: int) -> _Edge | None:
        return self._by_range.get(index // self.frames_per_edge)

    def _answer(self, index: int, final: bool = True) -> None:
        """Tell the frame's edge that its result (``final``) or more streamed output arrived: the data is
        already in the replies region it reads."""
        self._tell(index, wire.final_imm if final else wire.progress_imm)

    def _tell(self, index: int, imm_of: Callable[[int], int]) -> None:
        """Post ``imm_of(the frame's index in its edge's range)`` to the frame's edge."""
        edge = self._edge_of(index)
        if edge is None:
            return  # the edge has gone; nothing to tell
        imm = imm_of(index - edge.base)
        try:
            edge.conn.write_with_imm(self.notify_mr, 0, edge.conn.remote[wire.COMPLETIONS_REGION], 0, 0, imm)
        except TransportError as exc:
            log.warning("could not answer frame %d: %s", index, exc)

    def _refuse(self, index: int, status: Status) -> None:
        self.agent.frames.result_headers[index].refuse(status)
        self._answer(index)

    def handle(self, conn_id: int, imm: int) -> None:
        """A completion on the one endpoint shared by edges and slot servers."""
        if conn_id in self.edges:
            self._from_edge(conn_id, imm)
        else:
            self._from_server(conn_id, imm)

    def _from_edge(self, conn_id: int, imm: int) -> None:
        edge = self.edges.get(conn_id)
        if edge is None:
            return
        local = wire.edge_imm_frame(imm)
        if not 0 <= local < edge.count:
            log.warning("edge %d named frame %d outside its range of %d", conn_id, local, edge.count)
            return
        index = edge.base + local
        if wire.is_cancel_imm(imm):
            self.agent.cancel(index)  # the edge frees the frame when the final answer comes
            return
        if wire.is_group_member_imm(imm):
            self._groups.setdefault(conn_id, []).append(index)
            return
        group = self._groups.pop(conn_id, None)
        if group is not None:  # its last frame: the choices are claimed together, all or none
            frames = [*group, index]
            refused = self.agent.submit_group(frames)
            if refused is not None:
                for frame in frames:  # each is answered; the first, whose header holds the figures, first
                    self._refuse(frame, refused)
            return
        status = self.agent.submit(index)
        if status is not None:
            self._refuse(index, status)

    def _from_server(self, conn_id: int, imm: int) -> None:
        delivery = self.agent.deliver(conn_id, imm)
        if delivery is not None:
            self._answer(delivery.index, delivery.final)

    def publish_status(self) -> None:
        """Follow the slot servers' source and re-attach those that came back, then publish free/total slots
        and each link's state (reading every server's heartbeat on the way); tell edges which of their frames
        are on a server that stopped responding."""
        agent = self.agent
        agent.revive()
        free, total = agent.free_slots()
        links = [health.words() for health in agent.links_health()] if self._fixed else []
        self._status.publish(free, total, agent.alive(), links)
        for index in agent.stalled():
            self._tell(index, wire.stalled_imm)

    def serve(self) -> None:
        self.connections.start()
        if self.agent.transport is not self.transport:
            self._serve_two()
            return
        cq = self.transport.cq
        next_status = 0.0
        while not self._stop.is_set():
            for c in cq.wait(0.05, spin=self.spin, max_entries=256):
                self.handle(c.conn_id, c.imm)
            next_status = self._housekeeping(next_status)

    def _housekeeping(self, next_status: float) -> float:
        """Reap what went away; every STATUS_INTERVAL check links and publish status. Returns the next time."""
        if self.connections.pending():
            self._reap()
        now = time.monotonic()
        if now >= next_status:
            for index in self.agent.check_links():
                self._refuse(index, Status.UNAVAILABLE)
            self.publish_status()
            next_status = now + STATUS_INTERVAL
        return next_status

    def _serve_two(self) -> None:
        """Edges on one completion queue, slot servers on another (their connection ids are separate
        spaces): poll both, then arm both and sleep on both descriptors."""
        edge_cq, server_cq = self.transport.cq, self.agent.transport.cq
        fds = [edge_cq.fileno(), server_cq.fileno()]
        next_status = 0.0
        while not self._stop.is_set():
            busy = False
            deadline = time.monotonic() + self.spin
            while True:
                for c in edge_cq.poll(256):
                    busy = True
                    self._from_edge(c.conn_id, c.imm)
                for c in server_cq.poll(256):
                    busy = True
                    self._from_server(c.conn_id, c.imm)
                if busy or time.monotonic() >= deadline:
                    break
            next_status = self._housekeeping(next_status)
            if busy:
                continue
            armed = [edge_cq.arm(), server_cq.arm()]  # both armed before sleeping, or a wake-up is lost
            if not any(armed):
                select.select(fds, [], [], 0.05)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop()
        self.connections.close()
