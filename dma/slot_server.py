"""The reference slot server: owns the slot pool, polls doorbells, runs a handler in place.

Loop (one thread; connection management on a second):
  completions (doorbells) -> ep_accept_doorbells: CLAIMED -> READY, or rejected
  each READY slot: READY -> RUNNING, handler on an in-place view, RUNNING -> DONE,
  result written straight from the slot into the agent's reply frame,
  DONE -> FREE, then a zero-length WRITE_WITH_IMM tells the agent (so an agent
  that sees the result can claim the slot again at once).
  every ``scan_interval``: leases -- CLAIMED slots whose writer never rang are reclaimed.

With ``memory="gpu"`` (``--slots gpu``) the CUDA poller (edgepath.dma.gpu) owns the doorbell side:
it moves rung slots CLAIMED -> READY -> RUNNING and hands them over through a ring; the CQ is only
a wake-up hint, and lease expiry is asked of the kernel, the one writer of CLAIMED words.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepath.dma.handlers import Handler, SlotRequest
from edgepath.dma.pool import FrameLayout, SlotPool, reply_stride
from edgepath.dma.transport import Access, Completion, Connection, RemoteRegion, Transport, TransportError
from edgepath.native.abi import Event, State, Status, ffi, lib

if TYPE_CHECKING:
    from edgepath.dma.gpu import GpuPoller

log = logging.getLogger("edgepath.slot_server")

REPLIES_REGION = "replies"
POOL_REGION = "pool"
SLOT_MEMORY = ("host", "gpu")


@dataclass
class SlotServerConfig:
    slots: int = 64
    input_capacity: int = 4096
    output_capacity: int = 4096
    lease: float = 1.0  # seconds a CLAIMED slot may wait for its doorbell
    spin: float = 0.0  # seconds to spin on the CQ before sleeping
    scan_interval: float = 0.05
    memory: str = "host"  # where the doorbells are polled: "host" (CPU) or "gpu" (CUDA poller)
    gpu_device: int = 0
    handoff_wait: float = 0.002  # seconds to wait for the GPU's hand-off after a doorbell arrives
    handler_deadline: float = 0.0  # > 0: handlers run on worker threads and are answered after this many seconds

    def __post_init__(self) -> None:
        if self.memory not in SLOT_MEMORY:
            raise ValueError(f"slot memory must be one of {', '.join(SLOT_MEMORY)}, got {self.memory!r}")
        if self.lease <= 0:
            raise ValueError(f"lease must be positive seconds, got {self.lease}")
        if self.handler_deadline < 0:
            raise ValueError(f"handler deadline must be >= 0 seconds (0: none), got {self.handler_deadline}")
        if self.spin < 0:
            raise ValueError(f"spin must be >= 0 seconds, got {self.spin}")


@dataclass
class ServerStats:
    served: int = 0
    handler_errors: int = 0
    bad_requests: int = 0
    rejected_doorbells: int = 0
    expired_leases: int = 0
    results_dropped: int = 0
    deadline_exceeded: int = 0  # handlers answered HANDLER_ERROR at their deadline
    quarantined: int = 0  # slots held (DONE) until their overdue handler returns
    connections: int = 0


@dataclass
class _Peer:
    """An agent connection and the layout of its replies region ([result header][output] entries)."""

    conn: Connection
    replies: RemoteRegion
    layout: FrameLayout
    frames: int
    replies_offset: int

    def result_offset(self, index: int) -> int:
        return self.replies_offset + index * reply_stride(self.layout.output_capacity)


class SlotServer:
    """Owns a slot pool on ``transport`` and serves it with ``handler``."""

    def __init__(
        self, transport: Transport, address: str, handler: Handler, config: SlotServerConfig | None = None
    ) -> None:
        self.config = config or SlotServerConfig()
        self.transport = transport
        self.handler = handler
        cfg = self.config
        dims = SlotPool.layout_for(cfg.slots, cfg.input_capacity, cfg.output_capacity)
        self.pool_mr = transport.register(
            POOL_REGION,
            int(dims["total_size"]),
            Access.REMOTE_WRITE | Access.REMOTE_ATOMIC | Access.REMOTE_READ,
        )
        self.epoch = int.from_bytes(os.urandom(8), "little") >> 1
        self.pool = SlotPool.create(
            self.pool_mr.buf,
            cfg.slots,
            cfg.input_capacity,
            cfg.output_capacity,
            int(cfg.lease * 1e9),
            self.epoch,
        )
        self._pool_ptr = ffi.cast("char *", ffi.from_buffer(self.pool_mr.buf))
        self._states_ptr = ffi.cast("uint64_t *", self._pool_ptr + self.pool.states_offset)
        self._seen_word = ffi.new("uint64_t[]", cfg.slots)
        self._seen_ns = ffi.new("uint64_t[]", cfg.slots)
        self._expired = ffi.new("uint32_t[]", cfg.slots)
        self._ready_slots = ffi.new("uint32_t[]", 256)
        self._ready_conns = ffi.new("uint32_t[]", 256)
        self._rejected = ffi.new("int *")
        self._lease_word = np.zeros(cfg.slots, dtype=np.uint64)
        self._lease_ns = np.zeros(cfg.slots, dtype=np.int64)
        self.peers: dict[int, _Peer] = {}
        # Handlers with a deadline run on worker threads (lazily created, at most one per slot);
        # an overdue one keeps its slot (DONE) until it returns.
        self._workers = (
            concurrent.futures.ThreadPoolExecutor(max_workers=cfg.slots, thread_name_prefix="handler")
            if cfg.handler_deadline > 0
            else None
        )
        self._late: dict[int, concurrent.futures.Future] = {}
        self._late_gen: dict[int, int] = {}
        self._gone: list[int] = []
        self._lock = threading.Lock()
        self.stats = ServerStats()
        self.listener = transport.listen(address, [self.pool_mr], self._pool_info())
        self.address = address
        self._stop = threading.Event()
        self._serving = threading.Lock()  # held by serve(): close() frees GPU memory only after it returns
        self._cm_thread: threading.Thread | None = None
        self.on_result: Callable[[int, int], None] | None = None
        self.gpu: GpuPoller | None = None
        if cfg.memory == "gpu":
            from edgepath.dma.gpu import start_mapped_poller

            try:
                self.gpu = start_mapped_poller(self.pool_mr.buf, cfg.slots, cfg.gpu_device)
            except BaseException:
                self.listener.close()
                raise

    def _pool_info(self) -> dict[str, Any]:
        h = self.pool.header
        return {
            name: int(h[name])
            for name in (
                "abi_version",
                "slot_count",
                "input_capacity",
                "output_capacity",
                "slot_stride",
                "states_offset",
                "doorbells_offset",
                "slots_offset",
                "total_size",
                "server_epoch",
                "lease_ns",
            )
        }

    # -- connection management (its own thread) ---------------------------------
    def _admit(self, conn: Connection) -> dict[str, Any]:
        """Check the agent's reply-region description and register it before it is accepted."""
        info = conn.peer_info
        try:
            layout = FrameLayout(int(info["input_capacity"]), int(info["output_capacity"]))
            frames = int(info["frames"])
            replies = conn.remote[REPLIES_REGION]
            offset = int(info.get("replies_offset", 0))
            replies.check(offset, frames * reply_stride(layout.output_capacity), Access.REMOTE_WRITE)
        except (KeyError, ValueError, TypeError, TransportError) as exc:
            raise ValueError(f"bad reply-region description: {exc}") from exc
        with self._lock:
            self.peers[conn.conn_id] = _Peer(conn, replies, layout, frames, offset)
            self.stats.connections += 1
        return {}

    def _manage_connections(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener.fileno(), selectors.EVENT_READ, None)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                if key.data is None:
                    try:
                        conn = self.listener.accept(timeout=1.0, admit=self._admit)
                    except (OSError, TransportError, ValueError) as exc:
                        log.warning("connection refused: %s", exc)
                        continue
                    if conn is not None:
                        sel.register(conn.fileno(), selectors.EVENT_READ, conn)
                elif not key.data.check_alive():
                    sel.unregister(key.fd)
                    with self._lock:
                        self._gone.append(key.data.conn_id)
        sel.close()

    def _reap_gone(self) -> None:
        """Drop peers whose connection ended; their CLAIMED slots are reclaimed at once."""
        with self._lock:
            gone, self._gone = self._gone, []
            peers = [self.peers.pop(cid) for cid in gone if cid in self.peers]
        for peer in peers:
            for slot in range(self.pool.slot_count):
                w = self.pool.word(slot)
                mine = (w & 0xFF) == State.CLAIMED and ((w >> 8) & lib.EP_CLAIMANT_MAX) == peer.conn.conn_id
                if not mine:
                    continue
                if self.gpu is not None:
                    self.gpu.request_expire(slot, w)
                elif lib.ep_apply(self._states_ptr + slot, Event.EXPIRE, w >> 32, 0, ffi.NULL) == lib.EP_OK:
                    self.stats.expired_leases += 1
            peer.conn.close()

    # -- data path ----------------------------------------------------------------
    def process(self, completions: list[Completion], now_ns: int | None = None) -> int:
        """Accept doorbells and run every slot they made READY. Returns how many ran."""
        if not completions:
            return 0
        entries = ffi.new("uint64_t[]", [(c.conn_id << 32) | c.imm for c in completions])
        ready = 0
        for base in range(0, len(completions), 256):
            n = min(256, len(completions) - base)
            got = lib.ep_accept_doorbells(
                self._pool_ptr,
                entries + base,
                n,
                self._ready_slots,
                self._ready_conns,
                now_ns or lib.ep_now_ns(),
                self._rejected,
            )
            self.stats.rejected_doorbells += self._rejected[0]
            for i in range(got):
                self._run(int(self._ready_slots[i]), int(self._ready_conns[i]))
            ready += got
        return ready

    def process_gpu(self, doorbells: int) -> int:
        """Run the slots the GPU poller handed over; after ``doorbells`` wake-ups, wait a little for them."""
        assert self.gpu is not None
        deadline = time.monotonic() + (self.config.handoff_wait if doorbells else 0.0)
        ran = 0
        while True:
            handed = self.gpu.poll()
            for slot, gen in handed:
                word = self.pool.word(slot)
                if word >> 32 != gen or word & 0xFF != State.RUNNING:
                    log.error("GPU handed over slot %d generation %d, but its word is %#x", slot, gen, word)
                    continue
                self.pool.slots.results[slot]["t_ready_ns"] = lib.ep_now_ns()
                self._serve_slot(slot, (word >> 8) & lib.EP_CLAIMANT_MAX, gen)
            ran += len(handed)
            if ran >= doorbells or time.monotonic() >= deadline:
                return ran

    def _run(self, slot: int, conn_id: int) -> None:
        gen = self.pool.word(slot) >> 32
        lib.ep_apply(self._states_ptr + slot, Event.START, gen, 0, ffi.NULL)
        self._serve_slot(slot, conn_id, gen)

    def _serve_slot(self, slot: int, conn_id: int, gen: int) -> None:
        """The handler on a RUNNING slot, the result back to its agent, RUNNING -> DONE -> FREE."""
        pool = self.pool
        req = pool.slots.requests[slot]
        res = pool.slots.results[slot]
        peer = self.peers.get(conn_id)
        count = int(req["token_count"])
        max_new = int(req["max_new_tokens"])
        reply_index = int(req["reply_index"])
        out_cap = (
            self.config.output_capacity
            if peer is None
            else min(self.config.output_capacity, peer.layout.output_capacity)
        )
        res["request_id"] = req["request_id"]
        res["generation"] = gen
        res["slot"] = slot
        res["t_start_ns"] = lib.ep_now_ns()
        output_count = 0
        if (
            not 1 <= count <= self.config.input_capacity
            or max_new > out_cap
            or (peer is not None and reply_index >= peer.frames)
        ):
            status = Status.BAD_REQUEST
            self.stats.bad_requests += 1
        else:
            status, output_count = self._call_handler(slot, req, count, max_new, out_cap)
        res["status"] = status
        res["output_count"] = output_count
        res["t_done_ns"] = lib.ep_now_ns()
        lib.ep_apply(self._states_ptr + slot, Event.COMPLETE, gen, 0, ffi.NULL)
        release = slot not in self._late
        if peer is None or reply_index >= peer.frames:
            # Nobody to answer (the agent has gone, or named no valid reply frame): free the slot.
            if release:
                lib.ep_apply(self._states_ptr + slot, Event.RELEASE, gen, 0, ffi.NULL)
            self.stats.results_dropped += 1
        else:
            self._push_result(peer, slot, reply_index, output_count, gen, release)
        if not release:
            self._late_gen[slot] = gen

    def _call_handler(self, slot: int, req: Any, count: int, max_new: int, out_cap: int) -> tuple[Status, int]:
        pool = self.pool
        request = SlotRequest(
            slot,
            int(req["request_id"]),
            max_new,
            int(req["flags"]),
            pool.slots.tokens[slot, :count],
            pool.slots.outputs[slot, :out_cap],
        )
        try:
            if self._workers is not None:
                future = self._workers.submit(self.handler, request)
                try:
                    produced = future.result(timeout=self.config.handler_deadline)
                except concurrent.futures.TimeoutError:
                    # The handler still owns the slot's memory: answer now, free the slot when it returns.
                    self._late[slot] = future
                    self.stats.deadline_exceeded += 1
                    self.stats.quarantined += 1
                    log.warning("handler on slot %d missed its %.3f s deadline", slot, self.config.handler_deadline)
                    return Status.HANDLER_ERROR, 0
            else:
                produced = self.handler(request)
            if isinstance(produced, (int, np.integer)):
                n = int(produced)
                if not 0 <= n <= out_cap:
                    raise ValueError(f"handler reported {n} output tokens, capacity is {out_cap}")
            else:
                values = np.asarray(produced, dtype=np.int32).ravel()
                n = len(values)
                if n > out_cap:
                    raise ValueError(f"handler returned {n} tokens, capacity is {out_cap}")
                request.output[:n] = values
        except Exception:
            log.exception("handler failed on slot %d (request %d)", slot, request.request_id)
            self.stats.handler_errors += 1
            return Status.HANDLER_ERROR, 0
        self.stats.served += 1
        return Status.OK, n

    def _push_result(
        self, peer: _Peer, slot: int, reply_index: int, output_count: int, gen: int, release: bool = True
    ) -> None:
        """Result straight from the slot into the agent's frame, free the slot (unless its handler is
        overdue and still holds it), then notify."""
        src = self.pool.slots.result_offset(slot)
        try:
            peer.conn.write(
                self.pool_mr,
                src,
                peer.replies,
                peer.result_offset(reply_index),
                peer.layout.result_bytes(output_count),
            )
        except TransportError as exc:
            log.warning("result for slot %d lost: %s", slot, exc)
            self.stats.results_dropped += 1
            if release:
                lib.ep_apply(self._states_ptr + slot, Event.RELEASE, gen, 0, ffi.NULL)
            return
        if release:
            lib.ep_apply(self._states_ptr + slot, Event.RELEASE, gen, 0, ffi.NULL)
        try:
            peer.conn.write_with_imm(self.pool_mr, 0, peer.replies, 0, 0, reply_index)
        except TransportError as exc:
            log.warning("result notification for slot %d lost: %s", slot, exc)
            self.stats.results_dropped += 1

    def release_late(self) -> int:
        """Free the slots whose overdue handlers have now returned (their output is discarded)."""
        done = [slot for slot, future in self._late.items() if future.done()]
        for slot in done:
            del self._late[slot]
            lib.ep_apply(self._states_ptr + slot, Event.RELEASE, self._late_gen.pop(slot), 0, ffi.NULL)
            self.stats.quarantined -= 1
        return len(done)

    def scan_leases(self, now_ns: int | None = None) -> int:
        if self.gpu is not None:
            return self._scan_leases_gpu(now_ns or lib.ep_now_ns())
        n = lib.ep_scan_leases(
            self._pool_ptr,
            self._seen_word,
            self._seen_ns,
            now_ns or lib.ep_now_ns(),
            self._expired,
            self.pool.slot_count,
        )
        self.stats.expired_leases += n
        return n

    def _scan_leases_gpu(self, now_ns: int) -> int:
        """ep_scan_leases' rule (the lease runs from the first scan that saw the claim), but the expiry
        itself is asked of the kernel. Returns how many expiries were asked for."""
        assert self.gpu is not None
        words = self.pool.states.copy()
        claimed = (words & np.uint64(0xFF)) == State.CLAIMED
        changed = words != self._lease_word
        self._lease_ns[changed] = now_ns
        self._lease_word[:] = words
        due = np.flatnonzero(claimed & ~changed & (now_ns - self._lease_ns >= int(self.pool.header["lease_ns"])))
        asked = 0
        for slot in due:
            if not self.gpu.expire_pending(int(slot)):
                self.gpu.request_expire(int(slot), int(words[slot]))
                asked += 1
        self.stats.expired_leases = self.gpu.counters()["expired"]
        return asked

    # -- lifecycle ------------------------------------------------------------------
    def start_connection_manager(self) -> None:
        self._cm_thread = threading.Thread(target=self._manage_connections, name="slot-server-cm", daemon=True)
        self._cm_thread.start()

    def serve(self, until: Callable[[], bool] | None = None) -> None:
        """Run until :meth:`stop` (or ``until()`` is true)."""
        if self._cm_thread is None:
            self.start_connection_manager()
        with self._serving:
            self._serve(until)

    def _serve(self, until: Callable[[], bool] | None) -> None:
        cfg = self.config
        cq = self.transport.cq
        next_scan = time.monotonic()
        while not self._stop.is_set() and not (until and until()):
            completions = cq.wait(cfg.scan_interval, spin=cfg.spin, max_entries=256)
            if self.gpu is not None:
                self.process_gpu(len(completions))
            elif completions:
                self.process(completions)
            now = time.monotonic()
            if now >= next_scan:
                self._reap_gone()
                self.scan_leases()
                if self._late:
                    self.release_late()
                next_scan = now + cfg.scan_interval

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.stop()
        if self._cm_thread is not None:
            self._cm_thread.join(timeout=2.0)
        self.listener.close()
        for peer in list(self.peers.values()):
            peer.conn.close()
        self.peers.clear()
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)
        if self.gpu is not None:
            if not self._serving.acquire(timeout=5.0):
                raise RuntimeError("slot server: serve() did not return within 5 s; GPU poller left running")
            try:
                self.gpu.close()
                self.gpu = None
            finally:
                self._serving.release()
