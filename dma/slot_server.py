"""The reference slot server: owns the slot pool, polls doorbells, drives the model side.

Loop (one thread; connection management on a second):
  wait on the completion queue (no longer than the handler's next step is due)
  doorbells -> the poller (CPU or CUDA): CLAIMED -> READY -> RUNNING, the slot joins the handler
  cancels  -> the handler drops the slot; it is answered CANCELLED
  one handler step over every running slot -> new output tokens are streamed into the agent's reply
  entry (WRITE of the tokens, then the progress word with WRITE_WITH_IMM), the first at once and
  later ones coalesced within the stream window; a finished slot's whole result (header + output)
  goes with one WRITE, the slot is freed (DONE -> FREE), then a zero-length WRITE_WITH_IMM tells the
  agent -- so an agent that sees a result can claim the slot again at once.
  every ``scan_interval``: leases -- CLAIMED slots whose writer never rang are reclaimed.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgepath.dma import wire
from edgepath.dma.handlers import BatchHandler, Emit, HandlerConfig, OneShot, SlotRequest, adapt
from edgepath.dma.pollers import DeviceDoorbellPoller, GpuDoorbellPoller, HostPoller, Poller
from edgepath.dma.pool import FrameLayout, SlotPool, reply_stride
from edgepath.dma.transport import Completion, Connection, MemoryRegion, RemoteRegion, Transport, TransportError
from edgepath.dma.wire import Sampling
from edgepath.native.abi import RESULT_HEADER, Event, Status, ffi, field_offset, lib

if TYPE_CHECKING:
    from edgepath.dma.gpu import DeviceInfo, DeviceSlots

log = logging.getLogger("edgepath.slot_server")

SLOT_MEMORY = ("host", "gpu", "gpu-device")
_PROGRESS_FIELD = field_offset(RESULT_HEADER, "progress")
# A progress write places `progress`, the first-token time and the cached prompt tokens next to it (one
# 24-byte WRITE_WITH_IMM).
_PROGRESS_BYTES = field_offset(RESULT_HEADER, "reserved32") + 4 - _PROGRESS_FIELD
assert _PROGRESS_BYTES == 24, "ep_result_header: t_first_ns and cached_tokens must follow progress"


@dataclass
class SlotServerConfig:
    slots: int = 64
    input_capacity: int = 4096
    output_capacity: int = 4096
    lease: float = 1.0  # seconds a CLAIMED slot may wait for its doorbell
    spin: float = 0.0  # seconds to spin on the CQ before sleeping
    scan_interval: float = 0.05
    # "host": host memory, CPU poller; "gpu": host memory mapped into the GPU, CUDA poller;
    # "gpu-device": GPU memory registered with the NIC (transport.register_device), CUDA poller
    memory: str = "host"
    gpu_device: int = 0
    handoff_wait: float = 0.002  # seconds to wait for the GPU's hand-off after a doorbell arrives
    handler_deadline: float = 0.0  # > 0: one-shot handlers run on worker threads and are answered after this long
    stream_window: float = 0.002  # seconds within which streamed tokens after the first are coalesced

    def __post_init__(self) -> None:
        if self.memory not in SLOT_MEMORY:
            raise ValueError(f"slot memory must be one of {', '.join(SLOT_MEMORY)}, got {self.memory!r}")
        if self.lease <= 0:
            raise ValueError(f"lease must be positive seconds, got {self.lease}")
        if self.handler_deadline < 0:
            raise ValueError(f"handler deadline must be >= 0 seconds (0: none), got {self.handler_deadline}")
        if self.spin < 0:
            raise ValueError(f"spin must be >= 0 seconds, got {self.spin}")
        if self.stream_window < 0:
            raise ValueError(f"stream window must be >= 0 seconds, got {self.stream_window}")


def _require_write_ordering(device: DeviceInfo) -> None:
    """Refuse a GPU that may show a NIC's doorbell before the request it rings for.

    The kernel trusts a slot's data once its doorbell is visible; that holds for NIC writes into HBM
    only if the device orders GPUDirect RDMA writes for its own readers (attribute >= 100, "owner").
    Otherwise the writer would have to flush (an RDMA READ of the slot) before ringing, which agents do
    not do yet (docs/GPU.md)."""
    from edgepath.dma.gpu import GpuUnavailable

    if device.rdma_writes_ordering < 100:
        raise GpuUnavailable(
            f"--slots gpu-device: device {device.index} ({device.name}) does not order GPUDirect RDMA writes "
            f"(cudaDevAttrGPUDirectRDMAWritesOrdering = {device.rdma_writes_ordering}, needs >= 100), so a "
            "doorbell could be seen before its request, and agents do not flush before ringing yet; "
            "use --slots host with --data-path verbs"
        )


@dataclass
class ServerStats:
    served: int = 0  # requests the handler finished (any final status but BAD_REQUEST)
    handler_errors: int = 0
    bad_requests: int = 0
    rejected_doorbells: int = 0
    expired_leases: int = 0
    results_dropped: int = 0
    deadline_exceeded: int = 0  # handlers answered HANDLER_ERROR at their deadline
    quarantined: int = 0  # slots held (DONE) until their handler lets go of them
    connections: int = 0
    cancelled: int = 0  # running slots stopped by their requester
    cancels_ignored: int = 0  # cancels for a slot that had already finished, or not the claimer's
    progress_writes: int = 0  # streamed-output notifications sent


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


@dataclass(eq=False, slots=True)
class _Running:
    """A RUNNING slot between its start and its final result."""

    slot: int
    generation: int
    peer: _Peer | None
    reply_index: int
    stream: bool
    window: float
    count: int = 0  # output tokens the handler has written
    sent: int = 0  # output tokens announced to the agent
    pushed_at: float = 0.0  # when the last progress went


class SlotServer:
    """Owns a slot pool on ``transport`` and serves it with ``handler``."""

    def __init__(
        self,
        transport: Transport,
        address: str,
        handler: BatchHandler | OneShot,
        config: SlotServerConfig | None = None,
    ) -> None:
        """``handler``: a batch handler, or anything :func:`~edgepath.dma.handlers.adapt` turns into one
        (a one-shot function, a generator function)."""
        self.config = config or SlotServerConfig()
        self.transport = transport
        cfg = self.config
        sizes = HandlerConfig(cfg.slots, cfg.input_capacity, cfg.output_capacity, {}, cfg.handler_deadline)
        self.handler: BatchHandler = handler if isinstance(handler, BatchHandler) else adapt(handler, sizes)
        self.epoch = int.from_bytes(os.urandom(8), "little") >> 1
        #: the pool in GPU memory (``memory="gpu-device"``); then ``pool`` is its pinned host mirror
        self.device_slots: DeviceSlots | None = None
        self.pool_mr: MemoryRegion
        if cfg.memory == "gpu-device":
            self.pool_mr, self.pool = self._device_pool(transport, cfg)
        else:
            dims = SlotPool.layout_for(cfg.slots, cfg.input_capacity, cfg.output_capacity)
            self.pool_mr = transport.register(wire.POOL_REGION, int(dims["total_size"]), wire.POOL_ACCESS)
            self.pool = SlotPool.create(
                self.pool_mr.buf,
                cfg.slots,
                cfg.input_capacity,
                cfg.output_capacity,
                int(cfg.lease * 1e9),
                self.epoch,
            )
        self._states_ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.pool.states))
        self._req_hdr = self.pool.slots.request_headers
        self._res_hdr = self.pool.slots.result_headers
        self.peers: dict[int, _Peer] = {}
        self.running: dict[int, _Running] = {}
        self._held: dict[int, int] = {}  # slot -> generation: answered, kept until the handler lets go
        self._gone: list[int] = []
        self._lock = threading.Lock()
        self.stats = ServerStats()
        try:
            self.listener = transport.listen(address, [self.pool_mr], self._pool_info())
        except BaseException:
            if self.device_slots is not None:
                self._close_device_pool(self.device_slots)
            raise
        self.address = address
        self._stop = threading.Event()
        self._serving = threading.Lock()  # held by serve(): close() frees GPU memory only after it returns
        self._cm_thread: threading.Thread | None = None
        self.on_result: Callable[[int, int], None] | None = None
        self.poller: Poller
        if self.device_slots is not None:
            self.poller = DeviceDoorbellPoller(self.device_slots, cfg.handoff_wait)
        elif cfg.memory == "gpu":
            from edgepath.dma.gpu import start_mapped_poller

            try:
                cuda = start_mapped_poller(self.pool_mr.buf, cfg.slots, cfg.gpu_device)
            except BaseException:
                self.listener.close()
                raise
            self.poller = GpuDoorbellPoller(self.pool, cuda, cfg.handoff_wait)
        else:
            self.poller = HostPoller(self.pool)

    def _device_pool(self, transport: Transport, cfg: SlotServerConfig) -> tuple[MemoryRegion, SlotPool]:
        """``--slots gpu-device``: the pool in GPU memory with the CUDA poller over it, registered with
        the transport's NIC (``register_device``: dma-buf, else nvidia-peermem), so agents write the ids
        straight into HBM; the host works on the pool's pinned mirror."""
        register = getattr(transport, "register_device", None)
        if register is None:
            raise ValueError(
                f"--slots gpu-device: the {transport.name} data path cannot let agents write GPU memory "
                "(it has no register_device); use --data-path verbs (GPUDirect RDMA), or --slots gpu with loopback"
            )
        from edgepath.dma.gpu import start_device_poller

        slots = start_device_poller(
            cfg.slots,
            cfg.input_capacity,
            cfg.output_capacity,
            int(cfg.lease * 1e9),
            self.epoch,
            cfg.gpu_device,
        )
        try:
            _require_write_ordering(slots.poller.device)
            region = register(wire.POOL_REGION, slots, wire.POOL_ACCESS)
        except BaseException:
            slots.close()
            raise
        self.device_slots = slots
        return region, slots.mirror

    def _close_device_pool(self, slots: DeviceSlots) -> None:
        """Deregister the device pool from the NIC before its memory is freed (a region's close may run
        again when the transport closes)."""
        try:
            self.pool_mr.close()  # type: ignore[attr-defined]
        finally:
            slots.close()

    def _step_state(self, slot: int, event: Event, gen: int) -> None:
        """One of the model side's own steps (RUNNING -> DONE -> FREE).  A device pool's word is stepped
        in the mirror (current: read at hand-off and at every lease scan) and stored on the device."""
        rc = lib.ep_apply(self._states_ptr + slot, event, gen, 0, ffi.NULL)
        if self.device_slots is not None and rc == lib.EP_OK:
            self.device_slots.store_state(slot, int(self.pool.states[slot]))

    def _result_to_device(self, slot: int, output_count: int) -> None:
        """A device pool's result header and first ``output_count`` tokens, copied from the mirror where
        the host wrote them into the GPU memory the NIC sends them from (host and mapped pools: nothing)."""
        if self.device_slots is not None:
            self.device_slots.push_result(slot, output_count)

    def _cancel_word(self, slot: int) -> int:
        if self.device_slots is not None:
            return self.device_slots.load_word(self.pool.cancels_offset + 8 * slot)
        return int(self.pool.cancels[slot])

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
                "cancels_offset",
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
            layout = FrameLayout(int(info[wire.INPUT_CAPACITY]), int(info[wire.OUTPUT_CAPACITY]))
            frames = int(info["frames"])
            replies = conn.remote[wire.REPLIES_REGION]
            offset = int(info.get("replies_offset", 0))
            replies.check(offset, frames * reply_stride(layout.output_capacity), wire.REPLIES_ACCESS)
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
        """Drop peers whose connection ended: their CLAIMED slots are reclaimed at once and their
        running slots are cancelled (nobody is left to read the output)."""
        with self._lock:
            gone, self._gone = self._gone, []
            peers = [self.peers.pop(cid) for cid in gone if cid in self.peers]
        for peer in peers:
            self.poller.expire_claims_of(peer.conn.conn_id)
            for run in [r for r in self.running.values() if r.peer is peer]:
                run.peer = None
                self._cancel_running(run)
            peer.conn.close()

    # -- data path ----------------------------------------------------------------
    def process(self, completions: list[Completion], now: float | None = None) -> int:
        """Handle one batch of completions: doorbells start slots, cancels stop them. Returns how many
        slots started."""
        now = time.monotonic() if now is None else now
        doorbells = []
        for c in completions:
            if wire.is_cancel_imm(c.imm):
                self._on_cancel(c.conn_id, c.imm)
            else:
                doorbells.append((c.conn_id << 32) | c.imm)
        started = self.poller.started(doorbells, lib.ep_now_ns()) if doorbells or self._gpu else []
        self.stats.rejected_doorbells = self.poller.rejected_doorbells
        for slot, conn_id, gen in started:
            self._start(slot, conn_id, gen, now)
        return len(started)

    @property
    def _gpu(self) -> bool:
        return isinstance(self.poller, GpuDoorbellPoller)

    def _start(self, slot: int, conn_id: int, gen: int, now: float) -> None:
        """A RUNNING slot: validate its request and hand it to the model side."""
        pool = self.pool
        req = self._req_hdr[slot]
        res = self._res_hdr[slot]
        peer = self.peers.get(conn_id)
        count = req.token_count
        max_new = req.max_new_tokens
        reply_index = req.reply_index
        flags = req.flags
        res.request_id = req.request_id
        res.generation = gen
        res.slot = slot
        res.t_start_ns = lib.ep_now_ns()
        res.t_first_ns = 0
        res.cached_tokens = 0
        res.progress = wire.progress_word(gen, 0)
        window_us = req.stream_window_us
        run = _Running(
            slot,
            gen,
            peer,
            reply_index,
            bool(flags & wire.FLAG_STREAM),
            window_us / 1e6 if window_us else self.config.stream_window,
        )
        self.running[slot] = run
        out_cap = (
            self.config.output_capacity
            if peer is None
            else min(self.config.output_capacity, peer.layout.output_capacity)
        )
        sampling = Sampling(req.temperature, req.top_p, req.top_k, req.seed)
        problem = wire.request_problem(count, max_new, self.config.input_capacity, out_cap)
        if problem is None and peer is not None and reply_index >= peer.frames:
            problem = f"reply_index {reply_index} outside the agent's {peer.frames} frames"
        if problem is None:
            try:
                sampling.check()
            except wire.RequestInvalid as exc:
                problem = str(exc)
        if problem is not None:
            log.warning("slot %d: bad request: %s", slot, problem)
            self.stats.bad_requests += 1
            self._finish(run, Status.BAD_REQUEST, 0)
            return
        request = SlotRequest(
            slot,
            req.request_id,
            max_new,
            flags,
            pool.slots.tokens[slot, :count],
            pool.slots.outputs[slot, :max_new],
            sampling,
        )
        try:
            emits = self.handler.add(request, now)
        except Exception:
            log.exception("handler refused slot %d (request %d)", slot, request.request_id)
            emits = [Emit(slot, 0, Status.HANDLER_ERROR)]
        self._apply(emits, now)

    def step(self, now: float | None = None) -> int:
        """One handler step over the running slots; streams what it produced. Returns emits applied."""
        now = time.monotonic() if now is None else now
        try:
            emits = self.handler.step(now)
        except Exception:
            log.exception("handler step failed: every running slot is answered HANDLER_ERROR")
            emits = [Emit(slot, run.count, Status.HANDLER_ERROR) for slot, run in self.running.items()]
            for run in list(self.running.values()):
                self.handler.cancel(run.slot)
        self._apply(emits, now)
        return len(emits)

    def _apply(self, emits: list[Emit], now: float) -> None:
        for emit in emits:
            run = self.running.get(emit.slot)
            if run is None:
                if emit.release and emit.slot in self._held:
                    self._release_held(emit.slot)
                continue
            if emit.cached_tokens:
                self._res_hdr[run.slot].cached_tokens = emit.cached_tokens
            if emit.count > run.count:
                if run.count == 0:
                    self._res_hdr[run.slot].t_first_ns = lib.ep_now_ns()
                run.count = emit.count
            if emit.status is not None:
                if emit.status == Status.HANDLER_ERROR:
                    self.stats.handler_errors += 1
                    if not emit.release:
                        self.stats.deadline_exceeded += 1
                self._finish(run, emit.status, run.count, hold=not emit.release)
            elif run.stream and run.count > run.sent and (run.sent == 0 or now - run.pushed_at >= run.window):
                self._push_progress(run, now)

    def flush(self, now: float) -> float | None:
        """Send coalesced tokens whose window has passed; seconds until the next one is due (None: none)."""
        due: float | None = None
        for run in list(self.running.values()):
            if not run.stream or run.count <= run.sent:
                continue
            wait = run.pushed_at + run.window - now
            if wait <= 0:
                self._push_progress(run, now)
            else:
                due = wait if due is None else min(due, wait)
        return due

    def _push_progress(self, run: _Running, now: float) -> None:
        """New output tokens into the agent's reply entry, then the progress word with WRITE_WITH_IMM
        (RC ordering places the tokens before the agent hears of them)."""
        peer = run.peer
        if peer is None:
            return
        res_off = self.pool.slots.result_offset(run.slot)
        out_off = res_off + RESULT_HEADER.itemsize
        self._res_hdr[run.slot].progress = wire.progress_word(run.generation, run.count)
        self._result_to_device(run.slot, run.count)
        dst = peer.result_offset(run.reply_index)
        try:
            peer.conn.write_then_imm(
                self.pool_mr,
                out_off + 4 * run.sent,
                peer.replies,
                dst + RESULT_HEADER.itemsize + 4 * run.sent,
                4 * (run.count - run.sent),
                res_off + _PROGRESS_FIELD,
                dst + _PROGRESS_FIELD,
                _PROGRESS_BYTES,
                wire.progress_imm(run.reply_index),
            )
        except TransportError as exc:
            log.warning("streamed output for slot %d lost: %s", run.slot, exc)
            run.peer = None
            self._cancel_running(run)
            return
        run.sent = run.count
        run.pushed_at = now
        self.stats.progress_writes += 1

    def _on_cancel(self, conn_id: int, imm: int) -> None:
        """A requester asked to stop a slot: honoured only for its own claim, in that generation."""
        slot = wire.imm_slot(imm)
        run = self.running.get(slot)
        peer = self.peers.get(conn_id)
        if (
            run is None
            or peer is None
            or run.peer is not peer
            or not wire.imm_generation_matches(imm, run.generation)
            or wire.progress_generation(self._cancel_word(slot)) != run.generation
        ):
            self.stats.cancels_ignored += 1
            return
        self._cancel_running(run)

    def _cancel_running(self, run: _Running) -> None:
        released = self.handler.cancel(run.slot)
        self.stats.cancelled += 1
        self._finish(run, Status.CANCELLED, run.count, hold=not released)

    def _finish(self, run: _Running, status: Status, output_count: int, hold: bool = False) -> None:
        """RUNNING -> DONE, the result back to its agent, DONE -> FREE (unless the handler still holds
        the slot's memory: then it stays DONE until the handler lets go)."""
        slot, gen = run.slot, run.generation
        del self.running[slot]
        res = self._res_hdr[slot]
        res.status = status
        res.output_count = output_count
        res.progress = wire.progress_word(gen, output_count)
        res.t_done_ns = lib.ep_now_ns()
        if status in (Status.OK, Status.LENGTH, Status.STOP):
            self.stats.served += 1
        self._result_to_device(slot, output_count)
        self._step_state(slot, Event.COMPLETE, gen)
        if hold:
            self._held[slot] = gen
            self.stats.quarantined += 1
        peer = run.peer
        if peer is None or not 0 <= run.reply_index < peer.frames:
            # Nobody to answer (the agent has gone, or named no valid reply frame): free the slot.
            if not hold:
                self._step_state(slot, Event.RELEASE, gen)
            self.stats.results_dropped += 1
            return
        try:
            peer.conn.write(
                self.pool_mr,
                self.pool.slots.result_offset(slot),
                peer.replies,
                peer.result_offset(run.reply_index),
                peer.layout.result_bytes(output_count),
            )
        except TransportError as exc:
            log.warning("result for slot %d lost: %s", slot, exc)
            self.stats.results_dropped += 1
            if not hold:
                self._step_state(slot, Event.RELEASE, gen)
            return
        if not hold:
            self._step_state(slot, Event.RELEASE, gen)
        try:
            peer.conn.write_with_imm(self.pool_mr, 0, peer.replies, 0, 0, wire.final_imm(run.reply_index))
        except TransportError as exc:
            log.warning("result notification for slot %d lost: %s", slot, exc)
            self.stats.results_dropped += 1

    def _release_held(self, slot: int) -> None:
        self._step_state(slot, Event.RELEASE, self._held.pop(slot))
        self.stats.quarantined -= 1

    def scan_leases(self, now_ns: int | None = None) -> int:
        n = self.poller.scan_leases(now_ns or lib.ep_now_ns())
        self.stats.expired_leases = self.poller.expired_leases
        return n

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
        next_scan = time.monotonic()
        while not self._stop.is_set() and not (until and until()):
            now = self.poll_once(cfg.scan_interval)
            if now >= next_scan:
                self._reap_gone()
                self.scan_leases()
                next_scan = now + cfg.scan_interval

    def poll_once(self, timeout: float) -> float:
        """One turn of the loop: wait for completions (at most ``timeout``, and no longer than the handler's
        next step or a coalesced stream is due), start and cancel slots, step the handler, flush streams.
        Returns the time it ended (monotonic seconds)."""
        now = time.monotonic()
        wait = self.handler.wake_in(now)
        due = self.flush(now)
        for t in (wait, due):
            if t is not None:
                timeout = min(timeout, t)
        if self._held:
            timeout = min(timeout, self.config.scan_interval)
        completions = self.transport.cq.wait(max(0.0, timeout), spin=self.config.spin, max_entries=256)
        now = time.monotonic()
        if completions or self._gpu:
            self.process(completions, now)
        wait = self.handler.wake_in(now)
        if (wait is not None and wait <= 0) or self._held:
            self.step(now)
            now = time.monotonic()
        self.flush(now)
        return now

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
        self.handler.close()
        if self._gpu:
            if not self._serving.acquire(timeout=5.0):
                raise RuntimeError("slot server: serve() did not return within 5 s; GPU poller left running")
            try:
                if self.device_slots is not None:
                    self._close_device_pool(self.device_slots)
                else:
                    self.poller.close()
            finally:
                self._serving.release()
