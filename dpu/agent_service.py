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
import selectors
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgepath.dma.slot_server import REPLIES_REGION
from edgepath.dma.transport import Access, Connection, Listener, MemoryRegion, Transport, TransportError
from edgepath.dpu.agent import Agent
from edgepath.native.abi import Status

log = logging.getLogger("edgepath.agent_service")

STATUS_REGION = "status"
STATUS_INTERVAL = 0.1  # seconds between status refreshes (one state-word READ per slot server)
EDGE_FRAMES_REGION = REPLIES_REGION  # the agent's frames: edges fill them, slot servers answer into them


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
        frames_per_edge: int = 64,
        spin: float = 0.0,
    ) -> None:
        if agent.transport is not edge_transport:
            raise ValueError("the agent and its edges must share one endpoint (one completion queue)")
        if not 1 <= frames_per_edge <= agent.frames.count:
            raise ValueError(f"frames_per_edge must be 1..{agent.frames.count}, got {frames_per_edge}")
        self.agent = agent
        self.transport = edge_transport
        self.frames_per_edge = frames_per_edge
        self.spin = spin
        self._free_ranges = list(range(agent.frames.count // frames_per_edge - 1, -1, -1))
        self.edges: dict[int, _Edge] = {}
        self._by_range: dict[int, _Edge] = {}
        self._gone: list[int] = []
        self._lock = threading.Lock()
        self.notify_mr: MemoryRegion = edge_transport.register("notify", 8, Access.NONE)
        # Free/total slots and liveness of the slot servers, refreshed by the serve loop, read by edges.
        self.status_mr: MemoryRegion = edge_transport.register(STATUS_REGION, 64, Access.REMOTE_READ)
        self._status = self.status_mr.buf[:24].view(np.uint64)
        self.listener: Listener = edge_transport.listen(
            address,
            [agent.frames_mr, self.status_mr],
            {"input_capacity": agent.layout.input_capacity, "output_capacity": agent.layout.output_capacity},
        )
        self.address = address
        self._stop = threading.Event()
        self.answered = 0

    # -- edges come and go -----------------------------------------------------------
    def _admit(self, conn: Connection) -> dict[str, Any]:
        """Give a new edge a frame range of its own (refused when none is left)."""
        with self._lock:
            if not self._free_ranges:
                raise ValueError("no free frame range for another edge")
            base = self._free_ranges.pop() * self.frames_per_edge
            edge = _Edge(conn, base, self.frames_per_edge)
            self.edges[conn.conn_id] = edge
            self._by_range[base // self.frames_per_edge] = edge
        return {"frame_base": base, "frame_count": self.frames_per_edge}

    def _manage(self) -> None:
        """Edges come and go (slot servers are watched by the serve loop, which can revive them)."""
        sel = selectors.DefaultSelector()
        sel.register(self.listener.fileno(), selectors.EVENT_READ, None)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                if key.data is None:
                    self._accept(sel)
                elif not key.data.conn.check_alive():
                    sel.unregister(key.fd)
                    with self._lock:
                        self._gone.append(key.data.conn.conn_id)
        sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn = self.listener.accept(timeout=1.0, admit=self._admit)
        except (OSError, TransportError, ValueError) as exc:
            log.warning("edge connection refused: %s", exc)
            return
        if conn is not None:
            sel.register(conn.fileno(), selectors.EVENT_READ, self.edges[conn.conn_id])

    def _reap(self) -> None:
        with self._lock:
            gone, self._gone = self._gone, []
        for cid in gone:
            edge = self.edges.pop(cid, None)
            if edge is None:
                continue
            edge.conn.close()
            with self._lock:
                self._by_range.pop(edge.base // self.frames_per_edge, None)
                self._free_ranges.append(edge.base // self.frames_per_edge)

    # -- data path -------------------------------------------------------------------
    def _edge_of(self, index: int) -> _Edge | None:
        return self._by_range.get(index // self.frames_per_edge)

    def _answer(self, index: int) -> None:
        edge = self._edge_of(index)
        if edge is None:
            return  # the edge has gone; nothing to tell
        try:
            edge.conn.write_with_imm(self.notify_mr, 0, edge.conn.remote["completions"], 0, 0, index - edge.base)
            self.answered += 1
        except TransportError as exc:
            log.warning("could not answer frame %d: %s", index, exc)

    def _refuse(self, index: int, status: Status) -> None:
        res = self.agent.frames.results[index]
        res["status"] = status
        res["output_count"] = 0
        self._answer(index)

    def handle(self, conn_id: int, imm: int) -> None:
        edge = self.edges.get(conn_id)
        if edge is not None:
            if not 0 <= imm < edge.count:
                log.warning("edge %d named frame %d outside its range of %d", conn_id, imm, edge.count)
                return
            index = edge.base + imm
            status = self.agent.submit(index)
            if status is not None:
                self._refuse(index, status)
            return
        index = self.agent.complete(conn_id, imm)
        if index is not None:
            self._answer(index)

    def publish_status(self) -> None:
        """Re-attach slot servers that came back, then publish free/total slots and liveness."""
        agent = self.agent
        if not all(link.alive for link in agent.links):
            agent.revive(timeout=0.05)
        free, total = agent.free_slots()
        self._status[:] = (free, total, int(any(link.alive for link in agent.links)))

    def serve(self) -> None:
        threading.Thread(target=self._manage, name="agent-cm", daemon=True).start()
        cq = self.transport.cq
        next_status = 0.0
        while not self._stop.is_set():
            for c in cq.wait(0.05, spin=self.spin, max_entries=256):
                self.handle(c.conn_id, c.imm)
            if self._gone:
                self._reap()
            now = time.monotonic()
            if now >= next_status:
                for index in self.agent.check_links():
                    self._refuse(index, Status.UNAVAILABLE)
                self.publish_status()
                next_status = now + STATUS_INTERVAL

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop()
        self.listener.close()
