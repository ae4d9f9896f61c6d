"""What a slot server writes back to its agents, and how a slot's cycle ends.

A running slot's new output is streamed into its agent's reply entry (the tokens, then the progress word with
WRITE_WITH_IMM); a finished slot's whole result (header + output) goes with one WRITE, the slot is freed
(DONE -> FREE), then a zero-length WRITE_WITH_IMM tells the agent -- so an agent that sees a result can claim the
slot again at once.  A slot whose memory the handler still holds stays DONE until it lets go; a slot reclaimed for
a tenant under its floor goes DONE -> CLAIMED to its reclaimer instead of FREE (docs/TENANTS.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from edgepath.contract.pool import SlotPool
from edgepath.native.abi import Event, Status
from edgepath.slots.config import SlotServerConfig
from edgepath.slots.memory import PoolMemory
from edgepath.slots.peers import AgentPeer
from edgepath.slots.streams import OutputStream
from edgepath.transports.base import MemoryRegion, TransportError

log = logging.getLogger("edgepath.slot_server")


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


@dataclass(eq=False, slots=True, kw_only=True)
class Running(OutputStream):
    """A RUNNING slot between its start and its final result, and its output as its agent heard of it."""

    slot: int
    generation: int
    peer: AgentPeer | None
    reply_index: int
    offset: int = 0  # output tokens the request's answer already has (a migrated request): its own go after


#: a reclaimed slot's hand-over: the holder word of the reclaimer's claim, and the reclaimer's agent
Handover = tuple[int, AgentPeer]


class Results:
    """The write-back of a server whose pool is ``memory`` (``pool``, registered as ``region``), to the agents in
    ``peers`` (the server's own table: a reclaimer that went away is not handed a slot), counted in ``stats``."""

    def __init__(
        self,
        memory: PoolMemory,
        pool: SlotPool,
        region: MemoryRegion,
        peers: dict[int, AgentPeer],
        stats: ServerStats,
        config: SlotServerConfig,
    ) -> None:
        self.memory, self.pool, self.region, self.peers, self.stats = memory, pool, region, peers, stats
        self.handover_wait = config.handover_wait
        self._results = pool.slots.result_headers
        self.held: dict[int, int] = {}  # slot -> generation: answered, kept until the handler lets go
        #: slot -> (holder, reclaimer): a reclaimed slot the handler still holds, handed over once it lets go
        self._handovers: dict[int, Handover] = {}
        self._handed: dict[int, float] = {}  # slot -> until when the next step waits for its reclaimer's request

    def push(self, run: Running, now: float) -> bool:
        """The run's new output tokens and its progress word to its agent; False when they were lost (its agent is
        then forgotten: the run is to be cancelled)."""
        peer = run.peer
        if peer is None:
            return True
        self._results[run.slot].placed(run.generation, run.offset + run.count)
        self.memory.publish_result(run.slot, run.count)
        try:
            peer.send_progress(
                self.region, self.pool.slots.result_offset(run.slot), run.reply_index, run.sent, run.count, run.offset
            )
        except TransportError as exc:
            log.warning("streamed output for slot %d lost: %s", run.slot, exc)
            run.peer = None
            return False
        run.pushed(now)
        self.stats.progress_writes += 1
        return True

    def finish(
        self, run: Running, status: Status, output_count: int, hold: bool = False, handover: Handover | None = None
    ) -> None:
        """RUNNING -> DONE, the result back to its agent, DONE -> FREE -- or, reclaimed (``handover``), DONE ->
        CLAIMED for the reclaimer -- unless the handler still holds the slot's memory (``hold``): then it stays DONE
        until :meth:`release_held`."""
        slot, gen, memory, stats = run.slot, run.generation, self.memory, self.stats
        if handover is not None:
            self._handovers[slot] = handover
        self._results[slot].end(gen, status, run.offset + output_count)  # counted in the whole answer
        if status in (Status.OK, Status.LENGTH, Status.STOP):
            stats.served += 1
        memory.publish_result(slot, output_count)
        memory.step(slot, Event.COMPLETE, gen)
        if hold:
            self.held[slot] = gen
            stats.quarantined += 1
        peer = run.peer
        if peer is None or not 0 <= run.reply_index < peer.frames:
            # Nobody to answer (the agent has gone, or named no valid reply frame): free the slot.
            if not hold:
                self._free(slot, gen)
            stats.results_dropped += 1
            return
        try:
            peer.send_final(self.region, self.pool.slots.result_offset(slot), run.reply_index, output_count, run.offset)
        except TransportError as exc:
            log.warning("result for slot %d lost: %s", slot, exc)
            stats.results_dropped += 1
            if not hold:
                self._free(slot, gen)
            return
        if not hold:
            self._free(slot, gen)
        try:
            peer.notify_final(self.region, run.reply_index)
        except TransportError as exc:
            log.warning("result notification for slot %d lost: %s", slot, exc)
            stats.results_dropped += 1

    def release_held(self, slot: int) -> None:
        """The handler let go of a held slot: its cycle ends now."""
        self._free(slot, self.held.pop(slot))
        self.stats.quarantined -= 1

    def _free(self, slot: int, gen: int) -> None:
        """The end of a slot's cycle: DONE -> FREE, or to its reclaimer when it was reclaimed."""
        handover = self._handovers.pop(slot, None)
        if handover is None:
            self.memory.step(slot, Event.RELEASE, gen)
        else:
            self._hand_over(slot, gen, handover)

    def _hand_over(self, slot: int, gen: int, handover: Handover) -> None:
        """DONE -> CLAIMED in the next generation for the reclaimer, who is told; its lease runs from now."""
        holder, peer = handover
        if self.peers.get(peer.conn.conn_id) is not peer:  # the reclaimer went away meanwhile
            self.memory.step(slot, Event.RELEASE, gen)
            return
        self.memory.step(slot, Event.HANDOVER, gen, holder)
        self.tell_reclaimer(peer, slot)
        if self.handover_wait > 0:
            self._handed[slot] = time.monotonic() + self.handover_wait

    def tell_reclaimer(self, peer: AgentPeer, slot: int) -> None:
        """The reclaimer reads the state word to learn whether its reclaim of ``slot`` took."""
        try:
            peer.notify_handover(self.region, slot)
        except TransportError as exc:
            log.warning("hand-over notice for slot %d lost: %s (the reclaimer's claim ends with its lease)", slot, exc)

    def started(self, slot: int) -> None:
        """A slot started: a reclaimer's request, if it waited for one, has come."""
        self._handed.pop(slot, None)

    def handover_hold(self, now: float) -> float | None:
        """Seconds the next model step still waits for the request of a reclaimer a slot was handed over to (None:
        it waits for none).  Without it the step that starts right after the hand-over runs without that request
        -- the reclaimer cannot have sent it yet --, and the tenant under its floor waits a whole step more."""
        for slot, until in list(self._handed.items()):
            if until <= now:
                del self._handed[slot]
        return min(self._handed.values()) - now if self._handed else None
