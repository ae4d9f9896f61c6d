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
  again at once (:mod:`~edgepath.slots.peers`).
  every ``scan_interval``: peers that went away are reaped, and leases -- CLAIMED slots whose writer
  never rang are reclaimed.
  the heartbeat: every turn (and after every model step) advances a word in the pool header, so agents
  that read it see a frozen CPU side as a still word (:mod:`edgepath.dpu.link_state`); a handler that
  can (:class:`~edgepath.slots.handlers.BeatsWithinSteps`: llama.cpp, between its graph's nodes) advances
  it inside a long step too; a model step over ``step_budget`` is logged and counted.

Where the pool lives (host, GPU-mapped, GPU memory) is :mod:`~edgepath.slots.memory`'s business, which
doorbell poller fits it :mod:`~edgepath.slots.pollers`'; the server only asks them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgepath.contract import wire
from edgepath.contract.plan import Load, Prompt, own_ms
from edgepath.contract.wire import RequestHeader
from edgepath.native.abi import Event, Status, lib
from edgepath.slots.config import SLOT_MEMORY, SlotServerConfig
from edgepath.slots.drain import Drain
from edgepath.slots.handlers import (
    BatchHandler,
    BeatsWithinSteps,
    Emit,
    HandlerConfig,
    HoldsPrefixes,
    OneShot,
    ReportsLoad,
    SlotRequest,
    adapt,
)
from edgepath.slots.memory import PoolMemory, PoolSpec, open_pool_memory
from edgepath.slots.peers import AgentPeer
from edgepath.slots.streams import OutputStream
from edgepath.transports.base import Completion, Connection, Transport, TransportError
from edgepath.transports.connections import ConnectionManager

log = logging.getLogger("edgepath.slot_server")

__all__ = ["SLOT_MEMORY", "ServerStats", "SlotServer", "SlotServerConfig"]


def handler_config(config: SlotServerConfig, options: dict[str, str] | None = None) -> HandlerConfig:
    """What a handler for a server of ``config`` may size itself by (``options``: ``--handler-option`` values)."""
    return HandlerConfig(
        config.slots, config.input_capacity, config.output_capacity, options or {}, config.handler_deadline
    )


@dataclass
class ServerStats:
    served: int = 0  # requests the handler finished (any final status but BAD_REQUEST)
    handler_errors: int = 0
    bad_requests: int = 0
    rejected_doorbells: int = 0
    expired_leases: int = 0
    restored_words: int = 0  # state words found written back by a failed remote CAS and restored (slots/owned.py)
    results_dropped: int = 0
    deadline_exceeded: int = 0  # handlers answered HANDLER_ERROR at their deadline
    quarantined: int = 0  # slots held (DONE) until their handler lets go of them
    connections: int = 0
    peers_refused: int = 0  # peers that did not prove they hold the peer secret, or were not admitted (each logged)
    cancelled: int = 0  # running slots stopped by their requester
    cancels_ignored: int = 0  # cancels for a slot that had already finished, or not the claimer's
    reclaimed: int = 0  # running slots taken back for a tenant under its slot floor and handed to its agent
    reclaims_refused: int = 0  # reclaims of a slot not running the generation they named (the agent is told)
    progress_writes: int = 0  # streamed-output notifications sent
    slow_steps: int = 0  # model steps longer than the step budget (each is logged)
    longest_step: float = 0.0  # seconds of the longest model step so far


#: seconds the loop may stand still (a step, a wait that overran, a SIGSTOP) before it asks every agent's
#: connection whether it is still there before writing anything: an agent lets go of a server only after its
#: heartbeat stood still for a whole hang timeout (seconds), and may have moved the server's requests, whose
#: frames must then get nothing more from here.  Well below any hang timeout; a check is one call per agent.
STOOD_STILL = 0.25


@dataclass(eq=False, slots=True, kw_only=True)
class _Running(OutputStream):
    """A RUNNING slot between its start and its final result, and its output as its agent heard of it."""

    slot: int
    generation: int
    peer: AgentPeer | None
    reply_index: int
    offset: int = 0  # output tokens the request's answer already has (a migrated request): its own go after


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
        holder = self.handler if isinstance(self.handler, HoldsPrefixes) else None
        spec = PoolSpec.of(cfg, self.epoch, wire.PREFIX_ENTRIES if holder is not None else 0)
        self.memory: PoolMemory = open_pool_memory(transport, cfg.memory, spec)
        if isinstance(self.handler, BeatsWithinSteps):
            self.handler.beat_within_steps(self.memory.heartbeat())
        self.pool = self.memory.pool
        #: the handler whose prefixes the pool's table publishes (None: it holds none, or the pool has no table)
        self._holder = holder if len(self.pool.prefixes) else None
        self._prefixes_version: int | None = None
        self._publish_prefixes()  # a handler may hold prefixes from the start
        #: the handler whose load the pool header publishes (None: it reports none; the pace word stays 0)
        self._reporter = self.handler if isinstance(self.handler, ReportsLoad) else None
        self._load = Load()
        self._load_fields = wire.load_record(self._load)
        self._publish_load()
        self.pool_mr = self.memory.region
        self.poller = self.memory.poller
        #: the pool in GPU memory (``memory="gpu-device"``); then ``pool`` is its pinned host mirror
        self.device_slots = self.memory.device_slots
        self._req_hdr = self.pool.slots.request_headers
        self._res_hdr = self.pool.slots.result_headers
        self.peers: dict[int, AgentPeer] = {}
        self.running: dict[int, _Running] = {}
        self._held: dict[int, int] = {}  # slot -> generation: answered, kept until the handler lets go
        #: slot -> (holder, reclaimer): a reclaimed slot the handler still holds, handed over once it lets go
        self._handovers: dict[int, tuple[int, AgentPeer]] = {}
        self._handed: dict[int, float] = {}  # slot -> until when the next step waits for its reclaimer's request
        self._lock = threading.Lock()
        self.stats = ServerStats()
        self._turned = time.monotonic()  # when the loop last ended a turn (poll_once)
        try:
            self.listener = transport.listen(address, self.memory.exports, self._pool_info())
        except BaseException:
            self.memory.close()
            raise
        self.address = address
        self.connections = ConnectionManager(self.listener, self._admit, "slot-server-cm")
        self._stop = threading.Event()
        self._drain_asked = threading.Event()  # drain(): set from a signal handler, acted on by the loop
        self.draining: Drain | None = None  # since when this server drains (it told its agents)
        self._serving = threading.Lock()  # held by serve(): close() frees GPU memory only after it returns

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
                "prefixes_offset",
                "prefix_entries",
            )
        }

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

    def _problem(self, req: RequestHeader, peer: AgentPeer | None) -> str | None:
        """Why the request in a slot cannot run (None: it can): the slot server checks what any writer put
        there, the agent's checks notwithstanding."""
        out_cap = self.config.output_capacity
        if peer is not None:
            out_cap = min(out_cap, peer.layout.output_capacity)
            if not 0 <= req.reply_index < peer.frames:
                return f"reply_index {req.reply_index} outside the agent's {peer.frames} frames"
        if req.output_offset:
            if req.output_offset > out_cap:
                return f"output_offset {req.output_offset} is past the {out_cap} output tokens of a reply entry"
            out_cap -= req.output_offset  # the migrated request's own output goes after what its answer has
        words = wire.input_words(req.token_count, req.flags)  # the prompt and its constraint
        problem = wire.request_problem(words, req.max_new_tokens, self.config.input_capacity, out_cap)
        if problem is None and req.logit_biases > wire.LOGIT_BIAS_MAX:
            problem = f"{req.logit_biases} logit biases; a request carries at most {wire.LOGIT_BIAS_MAX}"
        return problem

    def _read(self, req: RequestHeader, slot: int) -> tuple[str | None, wire.Sampling]:
        """The request's constraint (None: none) and its sampling, logit biases included (the words after its prompt,
        which :meth:`_problem` found within the slot); ValueError naming what is wrong with them."""
        constraint: str | None = None
        logit_bias: wire.LogitBias = ()
        if req.flags & wire.FLAG_CONSTRAINT or req.logit_biases:
            after = self.pool.slots.tokens[slot, req.token_count : wire.input_words(req.token_count, req.flags)]
            constraint, logit_bias = wire.read_after_prompt(after, req.logit_biases)
        sampling = req.sampling(logit_bias)
        try:
            sampling.check()
        except wire.RequestInvalid as exc:
            raise ValueError(str(exc)) from None
        return constraint, sampling

    def _start(self, slot: int, conn_id: int, gen: int, now: float) -> None:
        """A RUNNING slot: validate its request and hand it to the model side."""
        self._handed.pop(slot, None)
        req = self._req_hdr[slot]
        peer = self.peers.get(conn_id)
        request_id = req.request_id
        self._res_hdr[slot].begin(request_id, gen, slot)
        window = req.streaming(self.config.stream_window)
        run = self.running[slot] = _Running(
            stream=window is not None,
            window=window or 0.0,
            slot=slot,
            generation=gen,
            peer=peer,
            reply_index=req.reply_index,
            offset=req.output_offset,
        )
        problem = self._problem(req, peer)
        if problem is None:
            try:
                constraint, sampling = self._read(req, slot)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            log.warning("slot %d: bad request: %s", slot, problem)
            self.stats.bad_requests += 1
            self._finish(run, Status.BAD_REQUEST, 0)
            return
        slots = self.pool.slots
        max_new = req.max_new_tokens
        request = SlotRequest(
            slot,
            request_id,
            max_new,
            req.flags,
            slots.tokens[slot, : req.token_count],
            slots.outputs[slot, :max_new],
            sampling,
            req.cache_salt,
            constraint,
            req.tenant,
            req.slot_floor,
        )
        try:
            emits = self.handler.add(request, now)
        except Exception:
            log.exception("handler refused slot %d (request %d)", slot, request_id)
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
        self._publish_prefixes()  # before any finished slot is freed: an agent that sees it free sees the table
        self._publish_load()  # likewise: an agent that sees a slot free sees the work left behind it
        for emit in emits:
            run = self.running.get(emit.slot)
            if run is None:
                if emit.release and emit.slot in self._held:
                    self._release_held(emit.slot)
                continue
            if emit.cached_tokens:
                self._res_hdr[run.slot].cached(emit.cached_tokens)
            if run.produced(emit.count):
                result = self._res_hdr[run.slot]
                result.first_token(lib.ep_now_ns())
                uncached = max(1, self._req_hdr[run.slot].token_count - emit.cached_tokens)
                result.prefill(own_ms(self._load, Prompt(emit.cached_tokens, uncached)) / 1e3)
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

    def _push_progress(self, run: _Running, now: float) -> None:
        """The run's new output tokens and its progress word to its agent."""
        peer = run.peer
        if peer is None:
            return
        self._res_hdr[run.slot].placed(run.generation, run.offset + run.count)
        self.memory.publish_result(run.slot, run.count)
        try:
            peer.send_progress(
                self.pool_mr, self.pool.slots.result_offset(run.slot), run.reply_index, run.sent, run.count, run.offset
            )
        except TransportError as exc:
            log.warning("streamed output for slot %d lost: %s", run.slot, exc)
            run.peer = None
            self._cancel_running(run)
            return
        run.pushed(now)
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
            self._tell_reclaimer(peer, slot)
            return
        self.stats.reclaimed += 1
        released = self.handler.cancel(run.slot)
        self._publish_prefixes()
        self._publish_load()  # before the slot changes hands: its prompt leaves no load behind it
        self._finish(run, Status.RECLAIMED, run.count, hold=not released, handover=(wire.word_holder(word), peer))

    def _tell_reclaimer(self, peer: AgentPeer, slot: int) -> None:
        try:
            peer.notify_handover(self.pool_mr, slot)
        except TransportError as exc:
            log.warning("hand-over notice for slot %d lost: %s (the reclaimer's claim ends with its lease)", slot, exc)

    def _hand_over(self, slot: int, gen: int, handover: tuple[int, AgentPeer]) -> None:
        """DONE -> CLAIMED in the next generation for the reclaimer, who is told; its lease runs from now."""
        holder, peer = handover
        if self.peers.get(peer.conn.conn_id) is not peer:  # the reclaimer went away meanwhile
            self.memory.step(slot, Event.RELEASE, gen)
            return
        self.memory.step(slot, Event.HANDOVER, gen, holder)
        self._tell_reclaimer(peer, slot)
        if self.config.handover_wait > 0:
            self._handed[slot] = time.monotonic() + self.config.handover_wait

    def _handover_hold(self, now: float) -> float | None:
        """Seconds the next model step still waits for the request of a reclaimer a slot was handed over to (None:
        it waits for none).  Without it the step that starts right after the hand-over runs without that request
        -- the reclaimer cannot have sent it yet --, and the tenant under its floor waits a whole step more."""
        for slot, until in list(self._handed.items()):
            if until <= now:
                del self._handed[slot]
        return min(self._handed.values()) - now if self._handed else None

    def _publish_prefixes(self) -> None:
        """Rewrite the pool's prefix table when what the handler holds has changed."""
        holder = self._holder
        if holder is None:
            return
        version = holder.prefixes_version()
        if version == self._prefixes_version:
            return
        self._prefixes_version = version
        self.memory.publish_prefixes(wire.prefix_table(holder.prefixes(), len(self.pool.prefixes)))

    def _publish_load(self) -> None:
        """Rewrite the pool's load region when the handler's load has changed."""
        if self._reporter is None:
            return
        self._load = self._reporter.load()
        fields = wire.load_record(self._load)
        if fields.tobytes() != self._load_fields.tobytes():
            self._load_fields = fields
            self.memory.publish_load(fields)

    def _cancel_running(self, run: _Running) -> None:
        released = self.handler.cancel(run.slot)
        self._publish_prefixes()
        self._publish_load()  # before the slot is freed: a cancelled prompt leaves no load behind it
        self.stats.cancelled += 1
        self._finish(run, Status.CANCELLED, run.count, hold=not released)

    def _finish(
        self,
        run: _Running,
        status: Status,
        output_count: int,
        hold: bool = False,
        handover: tuple[int, AgentPeer] | None = None,
    ) -> None:
        """RUNNING -> DONE, the result back to its agent, DONE -> FREE -- or, reclaimed (``handover``: the holder
        and the agent the slot goes to), DONE -> CLAIMED for the reclaimer -- unless the handler still holds the
        slot's memory: then it stays DONE until the handler lets go."""
        slot, gen, memory = run.slot, run.generation, self.memory
        del self.running[slot]
        if handover is not None:
            self._handovers[slot] = handover
        self._res_hdr[slot].end(gen, status, run.offset + output_count)  # counted in the whole answer
        if status in (Status.OK, Status.LENGTH, Status.STOP):
            self.stats.served += 1
        memory.publish_result(slot, output_count)
        memory.step(slot, Event.COMPLETE, gen)
        if hold:
            self._held[slot] = gen
            self.stats.quarantined += 1
        peer = run.peer
        if peer is None or not 0 <= run.reply_index < peer.frames:
            # Nobody to answer (the agent has gone, or named no valid reply frame): free the slot.
            if not hold:
                self._free(slot, gen)
            self.stats.results_dropped += 1
            return
        try:
            peer.send_final(
                self.pool_mr, self.pool.slots.result_offset(slot), run.reply_index, output_count, run.offset
            )
        except TransportError as exc:
            log.warning("result for slot %d lost: %s", slot, exc)
            self.stats.results_dropped += 1
            if not hold:
                self._free(slot, gen)
            return
        if not hold:
            self._free(slot, gen)
        try:
            peer.notify_final(self.pool_mr, run.reply_index)
        except TransportError as exc:
            log.warning("result notification for slot %d lost: %s", slot, exc)
            self.stats.results_dropped += 1

    def _free(self, slot: int, gen: int) -> None:
        """The end of a slot's cycle: DONE -> FREE, or to its reclaimer when it was reclaimed."""
        handover = self._handovers.pop(slot, None)
        if handover is None:
            self.memory.step(slot, Event.RELEASE, gen)
        else:
            self._hand_over(slot, gen, handover)

    def _release_held(self, slot: int) -> None:
        self._free(slot, self._held.pop(slot))
        self.stats.quarantined -= 1

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
        hold = self._handover_hold(now)
        for t in (wait if hold is None else hold, due):
            if t is not None:
                timeout = min(timeout, t)
        if self._held:
            timeout = min(timeout, self.config.scan_interval)
        waited = time.monotonic()
        completions = self.transport.cq.wait(max(0.0, timeout), spin=self.config.spin, max_entries=256)
        now = time.monotonic()
        if now - waited > max(0.0, timeout) + STOOD_STILL:
            self._drop_gone_peers()  # frozen while it waited: before the completions are acted on
        if completions or self.poller.hands_over:
            self.process(completions, now)
        wait = self.handler.wake_in(now)
        if ((wait is not None and wait <= 0) or self._held) and self._handover_hold(now) is None:
            self.step(now)
            now = time.monotonic()
            memory.beat(now)
        self.flush(now)
        # Whatever happened this turn (a cancel, a peer gone, a handler's own timer), the load agents read is
        # the handler's now: an idle server never publishes work it no longer has (a stale load refused
        # every request for good: issue 34).
        self._publish_load()
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
