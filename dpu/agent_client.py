"""The edge's side of ``edgepath agent``: frames in shared memory, submissions, answers.

Same shape as :class:`edgepath.dpu.agent.Agent` for its caller (acquire a frame,
fill it in place, submit, poll, read the result, release), so an edge can use an
in-process agent or a separate agent process alike.  Every submission is answered
through :meth:`poll`; a refusal shows as its result's ``status``.
"""

from __future__ import annotations

from edgepath.dma.loopback import LoopbackTransport
from edgepath.dma.pool import FrameArray, FrameLayout
from edgepath.dma.transport import Access, TransportError
from edgepath.dpu.agent_service import EDGE_FRAMES_REGION
from edgepath.native.abi import Status


class AgentClient:
    def __init__(self, address: str, timeout: float = 5.0) -> None:
        self.transport = LoopbackTransport()
        self._completions = self.transport.register("completions", 8, Access.REMOTE_WRITE)
        self._scratch = self.transport.register("scratch", 8, Access.NONE)
        self.conn = self.transport.connect(address, [self._completions], {"role": "edge"}, timeout=timeout)
        info = self.conn.peer_info
        region = self.conn.remote.get(EDGE_FRAMES_REGION)
        if region is None:
            raise TransportError(f"{address}: the agent exported no {EDGE_FRAMES_REGION!r} region")
        self._region = region
        self.layout = FrameLayout(int(info["input_capacity"]), int(info["output_capacity"]))
        base = int(info["frame_base"])
        count = int(info["frame_count"])
        self.frames = FrameArray(region.handle.array, base * self.layout.stride, count, self.layout)
        self._free = list(range(count - 1, -1, -1))
        self.inflight: set[int] = set()

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        if index in self.inflight:
            raise ValueError(f"frame {index} is still in flight")
        self._free.append(index)

    def submit(self, index: int) -> Status | None:
        """Hand frame ``index`` to the agent; always answered later through :meth:`poll`."""
        if not 0 <= index < self.frames.count:
            return Status.BAD_REQUEST
        self.inflight.add(index)
        self.conn.write_with_imm(self._scratch, 0, self._region, 0, 0, index)
        return None

    def poll(self, timeout: float | None = 0.0, spin: float = 0.0) -> list[int]:
        done = []
        for c in self.transport.cq.wait(timeout, spin=spin, max_entries=256):
            if c.imm in self.inflight:
                self.inflight.discard(c.imm)
                done.append(c.imm)
        return done

    def alive(self) -> bool:
        return self.conn.check_alive()

    def close(self) -> None:
        self.transport.close()
