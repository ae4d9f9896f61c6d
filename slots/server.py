"""The reference slot server: the loop, and the handler driving in it.

Loop (one thread; peers come and go on a second, :class:`~edgepath.transports.connections.ConnectionManager`):
  one turn (:meth:`SlotServer.poll_once`): wait on the completion queue (no longer than the handler's
  next step or a coalesced stream is due); doorbells -> the poller (CPU or CUDA): CLAIMED -> READY ->
  RUNNING, the slot joins the handler; cancels -> the handler drops the slot, it is answered CANCELLED;
  one model step (:meth:`SlotServer.step`) over every running slot -> new output tokens are streamed
  into the agent's reply entry (WRITE of the tokens, then the progress word with WRITE_WITH_IMM), the
  first at once and later ones coalesced within the stream window (:mod:`~edgepath.slots.streams`); a
  finished slot's whole result (header + output) goes with one WRITE, the slot is freed (DONE -> FREE),
  then a zero-length WRITE_WITH_IMM tells the agent -- so an agent that sees a result can claim the slot
  again at once (:mod:`~edgepath.slots.results`, over :mod:`~edgepath.slots.peers`' writes).
  every ``scan_interval``: peers that went away are reaped, and leases -- CLAIMED slots whose writer
  never rang are reclaimed.
  the heartbeat: every turn (and after every model step) advances a word in the pool header, so agents
  that read it see a frozen CPU side as a still word (:mod:`edgepath.dpu.link_state`); a handler that
  can (:class:`~edgepath.slots.handlers.BeatsWithinSteps`: llama.cpp, between its graph's nodes) advances
  it inside a long step too; a model step over ``step_budget`` is logged and counted.

Where the pool lives (host, GPU-mapped, GPU memory) is :mod:`~edgepath.slots.memory`'s business, which
doorbell poller fits it :mod:`~edgepath.slots.pollers`'; how a started slot's request is checked and read,
:mod:`~edgepath.slots.requests`'; what the pool publishes for the agents' admission (the handler's load, its
prefixes), :mod:`~edgepath.slots.published`'.  The server only asks them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from edgepath.contract import wire
from edgepath.contract.plan import Prompt, own_ms
from edgepath.native.abi import Status, lib
from edgepath.slots.config import SLOT_MEMORY, SlotServerConfig
from edgepath.slots.drain import Drain
from edgepath.slots.handlers import (
    BatchHandler,
    BeatsWithinSteps,
    Emit,
    HandlerConfig,
    HoldsPrefixes,
    OneShot,
    adapt,
)
from edgepath.slots.memory import PoolMemory, PoolSpec, open_pool_memory
from edgepath.slots.peers import AgentPeer
from edgepath.slots.published import Published
from edgepath.slots.requests import read_request
from edgepath.slots.results import Handover, Results, Running, ServerStats
from edgepath.transports.base import Completion, Connection, Transport
from edgepath.transports.connections import ConnectionManager

log = logging.getLogger("edgepath.slot_server")

__all__ = ["SLOT_MEMORY", "ServerStats", "SlotServer", "SlotServerConfig"]


def handler_config(config: SlotServerConfig, options: dict[str, str] | None = None) -> HandlerConfig:
    """What a handler for a server of ``config`` may size itself by (``options``: ``--handler-option`` values)."""
    return HandlerConfig(
        config.slots, config.input_capacity, config.output_capacity, options or {}, config.handler_deadline
    )


#: seconds the loop may stand still (a step, a wait that overran, a SIGSTOP) before it asks every agent's
#: connection whether it is still there before writing anything: an agent lets go of a server only after its
#: heartbeat stood still for a whole hang timeout (seconds), and may have moved the server's requests, whose
#: frames must then get nothing more from here.  Well below any hang timeout; a check is one call per agent.
STOOD_STILL = 0.25


class SlotServer:
    """Owns a slot pool on ``transport`` and serves it with ``handler``."""

    def __init__(
        self,
        transport: Transport,
        address: str,
        handler: BatchHandler | OneShot,
        config: SlotServerConfig | None = None,
    ) -> None:
        """``handler``: a batch handler, or anything :func:`~edgepath.slots.handlers.adapt` turns into one
        (a one-shot function, a generator function)."""
        self.config = cfg = config or SlotServerConfig()
        self.transport = transport
        self.handler: BatchHandler = (
            handler if isinstance(handler, BatchHandler) else adapt(handler, handler_config(cfg))
        )
        self.epoch = int.from_bytes(os.urandom(8), "little") >> 1
        holds = isinstance(self.handler, HoldsPrefixes)
        spec = PoolSpec.of(cfg, self.epoch, wire.PREFIX_ENTRIES if holds else 0)
        self.memory: PoolMemory = open_pool_memory(transport, cfg.memory, spec)
        if isinstance(self.handler, BeatsWithinSteps):
            self.handler.beat_within_steps(self.memory.heartbeat())
        self.pool = self.memory.pool
        self.published = Published(self.handler, self.memory)
        self.pool_mr = self.memory.region
        self.poller = self.memory.poller
        #: the pool in GPU memory (``memory="gpu-device"``); then ``pool`` is its pinned host mirror
        self.device_slots = self.memory.device_slots
        self._req_hdr = self.pool.slots.request_headers
        self._res_hdr = self.pool.slots.result_headers
        self.peers: dict[int, AgentPeer] = {}
        self.running: dict[int, Running] = {}
        self._lock = threading.Lock()
        self.stats = ServerStats()
        self.results = Results(self.memory, self.pool, self.pool_mr, self.peers, self.stats, cfg)
        self._turned = time.monotonic()  # when the loop last ended a turn (poll_once)
        try:
            self.listener = transport.listen(address, self.memory.exports, self.pool.info())
        except BaseException:
            self.memory.close()
            raise
        self.address = address
        self.connections = ConnectionManager(self.listener, self._admit, "slot-server-cm")
        self._stop = threading.Event()
        self._drain_asked = threading.Event()  # drain(): set from a signal handler, acted on by the loop
        self.draining: Drain | None = None  # since when this server drains (it told its agents)
        self._serving = threading.Lock()  # held by serve(): close() frees GPU memory only after it returns

    # -- peers (admitted on the connection manager's thread, reaped on the loop's) ---------------
    def _admit(self, conn: Connection) -> dict[str, Any]:
        """Check the agent's reply-region description and register it before it is accepted."""
        peer = AgentPeer.admit(conn)
        with self._lock:
            self.peers[conn.conn_id] = peer
            self.stats.connections += 1
        return {}

    def _drop_gone_peers(self) -> None:
        """After the loop stood still (a long step, a SIGSTOP): which agents are still connected, asked of each
        connection now -- one that let go of this server meanwhile (and may have moved its requests to
        another) gets nothing more written into its memory: its running slots are cancelled."""
        for peer in list(self.peers.values()):
            if peer.conn.check_alive():
                continue
            log.warning("agent on connection %d went away while this server stood still", peer.conn.conn_id)
            for run in [r for r in self.running.values() if r.peer is peer]:
                run.peer = None
                self._cancel_running(run)

    def _reap_gone(self) -> None:
        """Drop peers whose connection ended: their CLAIMED slots are reclaimed at once and their
        running slots are cancelled (nobody is left to read the output)."""
        self.stats.peers_refused = self.connections.refusals
        gone = self.connections.gone()
        with self._lock:
            peers = [self.peers.pop(cid) for cid in gone if cid in self.peers]
        for peer in peers:
            self.poller.expire_claims_of(peer.conn.conn_id)
            for run in [r for r in self.running.values() if r.peer is peer]:
                run.peer = None
                self._cancel_running(run)
            peer.conn.close()

    # -- data path: one turn of the loop, one model step -----------------------------------------
    def process(self, completions: list[Completion], now: float | None = None) -> int:
        """Handle one batch of completions: doorbells start slots, cancels stop them. Returns how many
        slots started."""
        now = time.monotonic() if now is None else now
        doorbells = []
        for c in completions:
            if wire.is_reclaim_imm(c.imm):
                self._on_reclaim(c.conn_id, c.imm)
            elif wire.is_cancel_imm(c.imm):
                self._on_cancel(c.conn_id, c.imm)
            else:
                doorbells.append(wire.doorbell_entry(c.conn_id, c.imm))
        poller = self.poller
        started = poller.started(doorbells, lib.ep_now_ns()) if doorbells or poller.hands_over else []
        self.stats.rejected_doorbells = poller.rejected_doorbells
        for slot, conn_id, gen in started:
            self._start(slot, conn_id, gen, now)
        return len(started)

    def _start(self, slot: int, conn_id: int, gen: int, now: float) -> None:
        """A RUNNING slot: validate its request (:func:`~edgepath.slots.requests.read_request`) and hand it to the
        model side."""
        self.results.started(slot)
        req = self._req_hdr[slot]
        peer = self.peers.get(conn_id)
        self._res_hdr[slot].begin(req.request_id, gen, slot)
        window = req.streaming(self.config.stream_window)
        run = self.running[slot] = Running(
            stream=window is not None,
            window=window or 0.0,
            slot=slot,
            generation=gen,
            peer=peer,
            reply_index=req.reply_index,
            offset=req.output_offset,
        )
        request = read_request(self.pool, self.config, slot, peer)
        if isinstance(request, str):
            log.warning("slot %d: bad request: %s", slot, request)
            self.stats.bad_requests += 1
            self._finish(run, Status.BAD_REQUEST, 0)
            return
        try:
            emits = self.handler.add(request, now)
        except Exception:
            log.exception("handler refused slot %d (request %d)", slot, request.request_id)
            emits = [Emit(slot, 0, Status.HANDLER_ERROR)]
        self._apply(emits, now)

    def step(self, now: float | None = None) -> int:
        """One model step over the running slots; streams what it produced. Returns emits applied."""
        now = time.monotonic() if now is None else now
        started = time.monotonic()
        try:
            emits = self.handler.step(now)
        except Exception:
            log.exception("handler step failed: every running slot is answered HANDLER_ERROR")
            emits = [Emit(slot, run.count, Status.HANDLER_ERROR) for slot, run in self.running.items()]
            for run in list(self.running.values()):
                self.handler.cancel(run.slot)
        took = time.monotonic() - started
        self._timed_step(took)
        if took > STOOD_STILL:
            self._drop_gone_peers()  # it stood still: agents may have let go of it meanwhile
        self._apply(emits, now)
        return len(emits)

    def _timed_step(self, took: float) -> None:
        """Count a model step's duration; one over the step budget is logged: the heartbeat stood still
        that long, and one near the agents' hang timeout makes them call this server unresponsive."""
        stats = self.stats
        stats.longest_step = max(stats.longest_step, took)
        budget = self.config.step_budget
        if took > budget:
            stats.slow_steps += 1
            log.warning(
                "a model step took %.3f s, over its budget of %g s, with %d running slots (slow steps so far: %d)",
                took,
                budget,
                len(self.running),
                stats.slow_steps,
            )

    def _apply(self, emits: list[Emit], now: float) -> None:
        # before any finished slot is freed: an agent that sees it free sees the table and the work left behind it
        self.published.publish()
        for emit in emits:
            run = self.running.get(emit.slot)
            if run is None:
                if emit.release and emit.slot in self.results.held:
                    self.results.release_held(emit.slot)
                continue
            if emit.cached_tokens:
                self._res_hdr[run.slot].cached(emit.cached_tokens)
            if run.produced(emit.count):
                result = self._res_hdr[run.slot]
                result.first_token(lib.ep_now_ns())
                uncached = max(1, self._req_hdr[run.slot].token_count - emit.cached_tokens)
                result.prefill(own_ms(self.published.load, Prompt(emit.cached_tokens, uncached)) / 1e3)
            if emit.status is not None:
                if emit.status == Status.HANDLER_ERROR:
                    self.stats.handler_errors += 1
                    if not emit.release:
                        self.stats.deadline_exceeded += 1
                self._finish(run, emit.status, run.count, hold=not emit.release)
            elif run.due(now):
                self._push_progress(run, now)

    def flush(self, now: float) -> float | None:
        """Send coalesced tokens whose window has passed; seconds until the next one is due (None: none)."""
        due: float | None = None
        for run in list(self.running.values()):
            wait = run.wait(now)
            if wait is None:
                continue
            if wait <= 0:
                self._push_progress(run, now)
            else:
                due = wait if due is None else min(due, wait)
        return due

    def _push_progress(self, run: Running, now: float) -> None:
        """The run's new output tokens and its progress word to its agent; a run whose agent lost them is cancelled."""
        if not self.results.push(run, now):
            self._cancel_running(run)

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
            or wire.progress_generation(self.memory.cancel_word(slot)) != run.generation
        ):
            self.stats.cancels_ignored += 1
            return
        self._cancel_running(run)

    def _on_reclaim(self, conn_id: int, imm: int) -> None:
        """An agent takes a running slot back for a tenant under its slot floor (docs/TENANTS.md): when the slot
        runs the generation the immediate names and ``reclaim[slot]`` is that agent's claim of the next one, the
        stream ends RECLAIMED (its answer so far goes to its own agent, which moves it or ends it) and the slot
        is handed over -- DONE -> CLAIMED for the reclaimer, never FREE between, so no other claim can take it.
        Either way the reclaimer is told (it reads the state word to learn which)."""
        slot = wire.imm_slot(imm)
        peer = self.peers.get(conn_id)
        if peer is None or slot >= self.pool.slot_count:
            self.stats.reclaims_refused += 1
            return
        word = self.memory.reclaim_word(slot)
        run = self.running.get(slot)
        if (
            run is None
            or not wire.imm_generation_matches(imm, run.generation)
            or not wire.claimed_by(word, conn_id)
            or wire.word_generation(word) != wire.next_generation(run.generation)
        ):
            self.stats.reclaims_refused += 1
            self.results.tell_reclaimer(peer, slot)
            return
        self.stats.reclaimed += 1
        released = self.handler.cancel(run.slot)
        self.published.publish()  # before the slot changes hands: its prompt leaves no load behind it
        self._finish(run, Status.RECLAIMED, run.count, hold=not released, handover=(wire.word_holder(word), peer))

    def _cancel_running(self, run: Running) -> None:
        released = self.handler.cancel(run.slot)
        self.published.publish()  # before the slot is freed: a cancelled prompt leaves no load behind it
        self.stats.cancelled += 1
        self._finish(run, Status.CANCELLED, run.count, hold=not released)

    def _finish(
        self, run: Running, status: Status, output_count: int, hold: bool = False, handover: Handover | None = None
    ) -> None:
        """The run leaves the running set and its cycle ends (:meth:`Results.finish`)."""
        del self.running[run.slot]
        self.results.finish(run, status, output_count, hold, handover)

    def scan_leases(self, now_ns: int | None = None) -> int:
        n = self.poller.scan_leases(now_ns or lib.ep_now_ns())
        self.stats.expired_leases = self.poller.expired_leases
        restored = self.memory.owned.restored
        if restored > self.stats.restored_words:
            log.warning(
                "%d slot state word(s) written back behind the server by a failed remote CAS (soft-RoCE stores "
                "what it read even when the compare fails) and restored; %d so far",
                restored - self.stats.restored_words,
                restored,
            )
            self.stats.restored_words = restored
        return n

    # -- lifecycle ------------------------------------------------------------------
    def start_connection_manager(self) -> None:
        self.connections.start()

    def serve(self, until: Callable[[], bool] | None = None) -> None:
        """Run until :meth:`stop` (or ``until()`` is true)."""
        if not self.connections.started:
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
            if self._drain_asked.is_set() and self._drained(now):
                return

    def drain(self) -> None:
        """Stop gracefully (safe from a signal handler): the loop tells the agents this server drains (they
        claim nothing more here), serves what it holds, and :meth:`serve` returns when that is done or the grace
        period is over (:class:`~edgepath.slots.drain.Drain`)."""
        self._drain_asked.set()

    def _drained(self, now: float) -> bool:
        if self.draining is None:
            self.memory.drain()
            self.draining = Drain(now, self.config.grace_period)
            log.info(
                "draining: no new claims; %d slots busy, %d agents connected; grace period %g s",
                self.pool.slot_count - self.pool.free_count(),
                len(self.peers),
                self.config.grace_period,
            )
        idle = not self.running and self.pool.free_count() == self.pool.slot_count
        why = self.draining.over(now, idle, len(self.peers))
        if why is not None:
            log.info("drained after %.2f s: %s", now - self.draining.started, why)
        return why is not None

    def poll_once(self, timeout: float) -> float:
        """One turn of the loop: wait for completions (at most ``timeout``, and no longer than the handler's
        next step or a coalesced stream is due), start and cancel slots, step the handler, flush streams.
        Returns the time it ended (monotonic seconds).  The heartbeat advances at its start and after a
        model step: a loop that waits no longer than the lease-scan interval beats at least that often."""
        now = time.monotonic()
        if now - self._turned > STOOD_STILL:
            self._drop_gone_peers()  # the loop stood still (frozen): before anything is written for anyone
        memory = self.memory
        memory.beat(now)
        wait = self.handler.wake_in(now)
        due = self.flush(now)
        hold = self.results.handover_hold(now)
        for t in (wait if hold is None else hold, due):
            if t is not None:
                timeout = min(timeout, t)
        if self.results.held:
            timeout = min(timeout, self.config.scan_interval)
        waited = time.monotonic()
        completions = self.transport.cq.wait(max(0.0, timeout), spin=self.config.spin, max_entries=256)
        now = time.monotonic()
        if now - waited > max(0.0, timeout) + STOOD_STILL:
            self._drop_gone_peers()  # frozen while it waited: before the completions are acted on
        if completions or self.poller.hands_over:
            self.process(completions, now)
        wait = self.handler.wake_in(now)
        if ((wait is not None and wait <= 0) or self.results.held) and self.results.handover_hold(now) is None:
            self.step(now)
            now = time.monotonic()
            memory.beat(now)
        self.flush(now)
        # Whatever happened this turn (a cancel, a peer gone, a handler's own timer), the load agents read is
        # the handler's now: an idle server never publishes work it no longer has (a stale load refused
        # every request for good: issue 34).
        self.published.publish_load()
        self._turned = now
        return now

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop the loop and free what it uses only after it has returned: freeing the model's context (or GPU
        memory) under a step still running in the serve thread is a segfault, not an error."""
        self.stop()
        if not self._serving.acquire(timeout=5.0):
            raise RuntimeError("slot server: serve() did not return within 5 s; its model and memory left in place")
        try:
            self.connections.close()
            for peer in list(self.peers.values()):
                peer.conn.close()
            self.peers.clear()
            self.handler.close()
            self.memory.close()
        finally:
            self._serving.release()
