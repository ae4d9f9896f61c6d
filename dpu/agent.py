"""The DPU-side agent: claims a slot with a remote CAS, writes the request, rings the doorbell.

The agent owns a registered *frame* region.  Whoever feeds it (the edge, in
process or through :mod:`edgepath.dpu.agent_service`) writes a request's token
ids once, straight into a frame; the agent sends that frame to the claimed slot
with one RDMA WRITE (no copy on the way) and the slot server writes the result
back into the same frame's result area.

Three parts, each with one job: the slot servers it is attached to and their links' states
(:class:`~edgepath.dpu.links.LinkSet`: attach, verify, watch the heartbeat, re-attach), which server a
request is claimed on (:class:`~edgepath.dpu.admission.Admission`, sans I/O), and this class: frames in
flight, claims, deliveries, cancels.  Admission is decided once, at claim time: a slot is taken only by a
CAS of its state word from FREE to CLAIMED.  If no CAS on any UP slot server succeeds (after one refresh of
the cached state words), the answer is NO_SLOT at once.  A link that goes down answers what it held
(:meth:`Agent.check_links`); one found unresponsive reports the frames in flight on it once
(:meth:`Agent.stalled`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.contract.plan import Prediction, Prompt
from edgepath.contract.pool import DEFAULT_CAPACITY, AgentFrames, FrameLayout
from edgepath.contract.wire import claim_next
from edgepath.dpu import floors
from edgepath.dpu.admission import Admission, Choice, Claimed, Decision, cached_tokens
from edgepath.dpu.backoff import Backoff
from edgepath.dpu.frame_book import Flight, FrameBook
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT, LinkHealth, Reason
from edgepath.dpu.links import (
    DEFAULT_DRAIN_TIMEOUT,
    REATTACH_BACKOFF,
    REATTACH_TIMEOUT,
    AgentError,
    LinkSet,
    ServerLink,
)
from edgepath.dpu.port import Delivery, SlotServerStatus
from edgepath.dpu.resolvers import Follower
from edgepath.dpu.retry_advice import RetryAdvice
from edgepath.native.abi import REQUEST_HEADER, Status, field_offset, lib
from edgepath.transports.base import Access, MemoryRegion, Transport, TransportError

__all__ = ["Agent", "AgentError", "InFlight", "ServerLink"]

log = logging.getLogger("edgepath.agent")

_DOORBELL_FIELD = field_offset(REQUEST_HEADER, "doorbell")
_AT_ONCE = Prediction(0.0, 0.0)
_ONLY = Choice(0, 0, _AT_ONCE)
_NO_CHAIN = np.zeros(0, dtype=np.uint64)
#: seconds a request may be predicted to wait for its first token beyond its own prompt's time, by default
#: (``--max-wait``): about one other long prompt ahead of it on this project's 2-core CPU (docs/ADMISSION.md)
DEFAULT_MAX_WAIT = 2.0
#: how many slots one request under its tenant's floor tries to take back before it is refused (each try is one
#: reclaim word written and rung, answered by the slot server at its next turn): another agent may take the same
#: slot first, or the stream there may end by itself meanwhile and its slot be claimed by someone else
RECLAIM_TRIES = 8
#: how often one request may move to another slot server when its own goes away (``--migration-limit``): a
#: second move covers a failover during a failover; a request that outlives more servers than that is unlucky
#: in a way a retry by the client handles as well
DEFAULT_MIGRATION_LIMIT = 2


@dataclass(slots=True, kw_only=True)
class InFlight(Flight):
    """A frame sent to a slot server: where it runs, in which generation."""

    link: ServerLink
    slot: int
    generation: int
    prompt: int  # the request's own prompt tokens (a migrated one's prompt also holds its answer so far)
    max_new: int  # output tokens it may produce in all
    cancelled: bool = False
    moves: int = 0  # times it moved to another slot server
    #: a reclaim under way (docs/TENANTS.md): the CLAIMED word the slot is to be handed over as; the request is
    #: written and rung only once it is (0: sent, or on its way)
    reclaim: int = 0
    reclaim_tries: int = 0  # slots it tried to take back
    reclaim_due: float = 0.0  # when a reclaim not answered by then is given up (the agent's clock)
    prediction: Prediction = _AT_ONCE  # the prediction it was claimed with (sent with it)


class Agent:
    """Claims slots on attached slot servers and moves frames into them."""

    def __init__(
        self,
        transport: Transport,
        frames: int = 256,
        input_capacity: int = DEFAULT_CAPACITY,
        output_capacity: int = DEFAULT_CAPACITY,
        max_servers: int = 8,
        max_slots_per_server: int = 65536,
        frames_buffer: np.ndarray | None = None,
        replies_buffer: np.ndarray | None = None,
        frames_access: Access = Access.NONE,
        hang_timeout: float = DEFAULT_HANG_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        reattach: Backoff = REATTACH_BACKOFF,
        max_wait: float = DEFAULT_MAX_WAIT,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        seed: int | None = None,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        """Frames are two registered regions (least privilege): requests, which the agent only sends
        from -- no peer may write them (``frames_access`` widens that only for an agent whose edges
        share the region over loopback) -- and replies, the one region slot servers may write.
        ``frames_buffer``/``replies_buffer``: memory owned elsewhere (shared with edges) that
        ``transport`` registers in place (the verbs transport can), so the edges' token writes are
        what the NIC sends and results land where the edges read them.  ``hang_timeout``: seconds of a
        still heartbeat that make a slot server UNRESPONSIVE; ``clock``: monotonic seconds (a test's own);
        ``reattach``: how often :meth:`revive` tries a slot server that went away; ``max_wait``: seconds a
        request may be predicted to wait for its first token beyond its own prompt's time (its own bound,
        ``max_wait_ms`` in its request header, may only be smaller); ``migration_limit``: how often one request
        may move to another slot server when its own goes down or unresponsive (0: never: it is answered 503 or
        504 then); ``seed``: of the jitter on refused clients' retry times (a test's own); ``drain_timeout``:
        seconds a draining slot server keeps its requests before they move (:meth:`LinkSet.settle`)."""
        if migration_limit < 0:
            raise ValueError(f"migration limit must be >= 0, got {migration_limit}")
        self.migration_limit = migration_limit
        if not max_wait > 0:
            raise ValueError(f"max wait must be positive seconds, got {max_wait}")
        self.max_wait_ms = max_wait * 1e3
        self.retry_advice = RetryAdvice(random.Random(seed))
        self.transport = transport
        self.layout = FrameLayout(input_capacity, output_capacity)
        req_size, rep_size = AgentFrames.sizes(frames, self.layout)
        if not hang_timeout > 0:  # checked before anything is registered
            raise ValueError(f"hang timeout must be positive seconds, got {hang_timeout}")
        self.frames_mr: MemoryRegion = transport.register(
            wire.REQUESTS_REGION, req_size, frames_access, buffer=frames_buffer
        )
        self.replies_mr: MemoryRegion = transport.register(
            wire.REPLIES_REGION, rep_size, wire.REPLIES_ACCESS, buffer=replies_buffer
        )
        self.frames = AgentFrames(self.frames_mr.buf, self.replies_mr.buf, frames, self.layout)
        self.link_set = LinkSet(
            transport,
            wire.AgentHello(frames, input_capacity, output_capacity),
            [self.replies_mr],
            max_servers,
            max_slots_per_server,
            hang_timeout,
            clock,
            reattach,
            on_down=self._lose,
            on_unresponsive=self._stall,
            drain_timeout=drain_timeout,
        )
        self.follower: Follower | None = None  # where the slot servers are read from, when they are not fixed
        #: the attached slot servers, in attach order (the link set's own list)
        self.links = self.link_set.links
        self.admission = Admission(input_capacity)
        self.book: FrameBook[InFlight] = FrameBook(frames)
        self.inflight = self.book.inflight
        self.delivery_stats = self.book.stats
        #: slot floors by floor id (the tenants file's, :meth:`set_floors`), and those learned from requests
        self._floors: dict[int, int] = {}
        self._learned: dict[int, int] = {}
        self._reclaims: dict[tuple[int, int], int] = {}  # (id of the link, slot) -> frame reclaiming it
        self._victim_cursor = 0
        self._lost: list[int] = []  # frames lost with a link that went down, for check_links to return
        self._stalled: list[int] = []  # frames in flight on a link when it became unresponsive, for stalled()

    def set_floors(self, floors_by_id: dict[int, int]) -> None:
        """The slot floors of every tenant that has one, by floor id (docs/TENANTS.md): whose slots above their
        floor this agent may take back for a tenant under its own.  A tenant not listed here is learned from the
        requests that name it (their header's floor); one neither listed nor seen is never taken from."""
        self._floors = dict(floors_by_id)

    def _floor_of(self, tenant: int) -> int | None:
        floor = self._floors.get(tenant)
        return self._learned.get(tenant) if floor is None else floor

    def _floor_table(self) -> dict[int, int]:
        return {**self._learned, **self._floors}

    # -- frames ---------------------------------------------------------------------
    def acquire(self) -> int | None:
        """A frame index the caller may fill (tokens, request header), or None if all are taken."""
        return self.book.acquire()

    def release(self, index: int) -> None:
        """Give a frame back once its result has been read (or it was refused)."""
        self.book.release(index)

    def capacity(self) -> FrameLayout:
        """The largest request and answer the first slot server takes in these frames."""
        if not self.links:
            return self.layout
        link = self.links[0]
        return FrameLayout(
            min(self.layout.input_capacity, link.input_capacity), min(self.layout.output_capacity, link.output_capacity)
        )

    def fileno(self) -> int:
        return self.transport.cq.fileno()

    def arm(self) -> bool:
        return self.transport.cq.arm()

    def alive(self) -> bool:
        """Whether any slot server is connected (UP or UNRESPONSIVE)."""
        return self.link_set.alive()

    def links_health(self) -> list[LinkHealth]:
        """Every slot server's link: state, reason, since when (one per attached server, in order)."""
        return self.link_set.health()

    def attach(self, address: str, timeout: float = 5.0) -> ServerLink:
        """Connect to a slot server and verify its pool (:meth:`LinkSet.attach`)."""
        return self.link_set.attach(address, timeout)

    def follow(self, follower: Follower, timeout: float = 5.0) -> None:
        """Take the slot servers from ``follower``'s source from now on: resolve it and attach what it names
        now (one that does not answer is tried again with back-off), then follow its changes in :meth:`revive`."""
        self.follower = follower
        for address in follower.first().attach:
            self.link_set.add(address)
        self.link_set.join_now(timeout)

    def revive(self, timeout: float = REATTACH_TIMEOUT) -> list[ServerLink]:
        """Follow the source of slot servers (attach the new, drain the gone: :meth:`LinkSet.settle`) and
        re-attach slot servers that went away (:meth:`LinkSet.revive`); cheap at every tick."""
        link_set = self.link_set
        if self.follower is not None:
            changes = self.follower.poll()
            for address in changes.attach:
                link_set.add(address)
            for address in changes.drain:
                link_set.remove(address)
        link_set.settle()
        return link_set.revive(timeout)

    def _lose(self, link: ServerLink) -> None:
        """``link`` went down: what was in flight there moves to another slot server when it can
        (:meth:`_migrate`); the rest is lost -- abandoned frames go back to the free list, the others wait in
        ``_lost`` for :meth:`check_links` to return them."""
        if self.migration_limit:
            for index, flight in list(self.book.inflight.items()):
                if flight.link is link and not (flight.abandoned or flight.cancelled or flight.reclaim):
                    self._migrate(index, flight)
        for key in [key for key in self._reclaims if key[0] == id(link)]:
            del self._reclaims[key]
        self._lost += self.book.lose(lambda flight: flight.link is link)

    def _stall(self, link: ServerLink) -> None:
        """``link`` became unresponsive.  When another server is up and requests may move, the link is taken
        down at once (its connection closed, so a server that thaws cannot write into frames that moved) and
        its requests migrate; otherwise the frames in flight there are reported once by :meth:`stalled`."""
        moving = self.migration_limit and any(other.up for other in self.links if other is not link)
        if moving and any(f.link is link for f in self.book.inflight.values()):
            link.conn.close()
            self.link_set.down(link, Reason.DROPPED, "its heartbeat stood still for the hang timeout")
            return
        self._stalled += [i for i, f in self.book.inflight.items() if f.link is link and not f.abandoned]

    def _migrate(self, index: int, flight: InFlight, stay: bool = False) -> bool:
        """Claim frame ``index`` again on another UP slot server: its prompt followed by the answer so far as
        the new prompt, what is left of its output to produce, the same sampling and seed; the new server
        places its output after the answer so far in the same reply entry, so the caller sees one stream.
        False when it cannot move (limit reached, nothing left to produce, too long for every server, no slot
        free): it is then lost like the others.  ``stay``: its own server may take it too (a reclaimed stream:
        the server is up, only the slot was taken back); such a move only takes a FREE slot, never reclaims."""
        gone = flight.link
        produced = flight.count
        prompt = flight.prompt + produced
        remaining = flight.max_new - produced
        why = ""
        if flight.moves >= self.migration_limit:
            why = f"it moved {flight.moves} times already (the limit)"
        elif remaining <= 0:
            why = "its answer is complete but for the final word"
        elif wire.logprobs_top(self.frames.request_headers[index].flags) is not None:
            why = "its output holds log-probability records, which a prompt cannot carry"
        elif wire.constraint_words(self.frames.request_headers[index].flags):
            why = "a constraint follows its prompt, which the answer so far would overwrite"
        candidates = [
            link for link in self.links if link.up and (stay or link is not gone) and prompt <= link.input_capacity
        ]
        if not why and (prompt > self.layout.input_capacity or not candidates):
            why = f"no other slot server is up with room for a prompt of {prompt} tokens"
        if not why:
            frames = self.frames
            frames.tokens[index, flight.prompt : prompt] = frames.outputs[index, :produced]
            frames.request_headers[index].migrate(prompt, remaining, produced, flight.moves + 1)
            salt = frames.request_headers[index].cache_salt
            now = self.link_set.clock()
            choices = self.admission.decide(frames.tokens[index, :prompt], candidates, math.inf, salt, now).choices
            claimed = self._first_claim(choices, candidates, frames.request_headers[index].tenant)
            why = "no other slot server had a free slot" if not stay else "no slot was free"
            if claimed is not None:
                link, choice, slot, gen = claimed
                flight.link, flight.slot, flight.generation, flight.moves = link, slot, gen, flight.moves + 1
                try:
                    self._send(link, index, slot, gen, prompt, choice, flight)
                except TransportError as exc:
                    flight.link = gone  # not moved: lost with the link it was on
                    link.inflight -= 1
                    self.link_set.failed(link, exc)
                else:
                    self.delivery_stats.migrated += 1
                    log.info(
                        "frame %d moved from %s to %s with %d tokens of its answer (%d to go)",
                        index,
                        gone.address,
                        link.address,
                        produced,
                        remaining,
                    )
                    return True
        # a reclaimed stream that finds no free slot ends RECLAIMED, as floors mean it to: not a fault
        (log.info if stay else log.warning)("frame %d cannot move from %s: %s", index, gone.address, why)
        return False

    # -- slot floors: taking a lent slot back (docs/TENANTS.md) ----------------------------------------
    def _reclaim(self, index: int, count: int, fits: list[ServerLink], choices: list[Choice], tries: int = 0) -> bool:
        """Frame ``index``'s tenant is under its floor and no slot is free: ask for a slot of a tenant above
        its floor (:func:`~edgepath.dpu.floors.victims`, on the servers in admission's order).  One WRITE_WITH_IMM
        of the slot's reclaim word -- the CLAIMED word, this agent's and the tenant's, of the generation after the
        running one -- and the slot server ends that stream (RECLAIMED, to its own agent, which moves it) and
        hands the slot over without its ever being FREE.  The frame is booked in flight meanwhile and sent when the
        server says it acted (:meth:`_settle_reclaim`).  False when no slot may be taken back."""
        req = self.frames.request_headers[index]
        tenant = req.tenant
        order = [fits[choice.server] for choice in choices]
        predictions = [choice.prediction for choice in choices]
        holdings = self._holdings()
        positions = {id(link): at for at, link in enumerate(order)}
        under_way = frozenset((positions[key[0]], key[1]) for key in self._reclaims if key[0] in positions)
        self._victim_cursor += 1
        table = self._floor_table()
        start = self._victim_cursor + 7 * (order[0].claimant if order else 0)  # agents start apart
        for victim in floors.victims(tenant, [link.words for link in order], table, holdings, under_way, start):
            link = order[victim.server]
            word = wire.claim_word(wire.free_word(victim.generation), link.claimant, tenant)
            if not self.link_set.send_reclaim(link, victim.slot, victim.generation, word):
                continue  # that link is down now
            flight = InFlight(
                link=link,
                slot=victim.slot,
                generation=wire.word_generation(word),
                prompt=count,
                max_new=req.max_new_tokens,
                reclaim=word,
                reclaim_tries=tries + 1,
                reclaim_due=self.link_set.clock() + self.link_set.hang_timeout,
                prediction=predictions[victim.server],
            )
            self.book.sent(index, flight)
            self._reclaims[(id(link), victim.slot)] = index
            log.debug("frame %d (tenant %d) takes back slot %d of %s from tenant %d", index, tenant, victim.slot,
                      link.address, victim.tenant)  # fmt: skip
            return True
        return False

    def _handed_over(self, conn_id: int, slot: int) -> Delivery | None:
        """A slot server acted on this agent's reclaim of ``slot``."""
        link = self.link_set.by_conn.get(conn_id)
        index = None if link is None else self._reclaims.pop((id(link), slot), None)
        flight = None if index is None else self.book.inflight.get(index)
        if index is None or flight is None or not flight.reclaim:
            self.book.unknown()
            return None
        return self._settle_reclaim(index, flight)

    def _settle_reclaim(self, index: int, flight: InFlight) -> Delivery | None:
        """The reclaim of frame ``index`` was answered (or is overdue): read the slot's word.  Handed over (the
        word is the reclaim's) -- or found FREE in the generation it was asked in (the stream there ended first) and
        claimed with one CAS -- the request is sent.  Otherwise another claim took it: the request claims a free
        slot or takes another back (at most :data:`RECLAIM_TRIES` slots), else it is refused NO_SLOT, answered
        through the port.  None unless it is answered now."""
        link, slot, word, gen = flight.link, flight.slot, flight.reclaim, flight.generation
        flight.reclaim = 0
        try:
            self.link_set.refresh(link)
            found = int(link.words[slot])
            if wire.is_free(found) and wire.next_generation(wire.word_generation(found)) == gen:
                swapped = link.conn.compare_and_swap(link.pool, link.states_offset + 8 * slot, found, word)
                link.stats.cas_attempts += 1
                found = word if swapped == found else swapped
                link.words_ptr[slot] = found
        except TransportError as exc:
            self.link_set.failed(link, exc)  # lost with the link (answered 503), or freed when abandoned
            return None
        if found == word:
            link.stats.handovers += 1
            if flight.abandoned or flight.cancelled:
                self._unclaim(link, slot, word)
            else:
                try:
                    # handed over long after its decision: what was matched then is not known here
                    handed = Choice(0, 0, flight.prediction)
                    self._send(link, index, slot, gen, flight.prompt, handed, flight, _NO_CHAIN)
                except TransportError as exc:
                    link.inflight -= 1
                    self.link_set.failed(link, exc)
                return None
        elif (
            not (flight.abandoned or flight.cancelled)
            and flight.reclaim_tries < RECLAIM_TRIES
            and (self._claim_again(index, flight))
        ):
            return None
        result = self.frames.result_headers[index]
        if flight.cancelled and not flight.abandoned:
            result.refuse(Status.CANCELLED)
        else:
            result.no_slot(self._slot_frees_in([link]))
        return self.book.final(index, 0, gen)

    def _claim_again(self, index: int, flight: InFlight) -> bool:
        """A reclaim that did not get its slot: claim a free one, or take another back while the tenant is still
        under its floor; whether the request is in flight again."""
        words = wire.input_words(flight.prompt, self.frames.request_headers[index].flags)
        fits = [link for link in self.links if link.up and words <= link.input_capacity]
        if not fits:
            return False
        tenant = self.frames.request_headers[index].tenant
        choices = self._choose(index, flight.prompt, fits, owner=True)
        assert not isinstance(choices, Status)  # no bound: never OVER_BOUND
        claimed = self._first_claim(choices, fits, tenant)
        if claimed is not None:
            link, choice, slot, gen = claimed
            flight.link, flight.slot, flight.generation, flight.prediction = link, slot, gen, choice.prediction
            try:
                self._send(link, index, slot, gen, flight.prompt, choice, flight)
            except TransportError as exc:
                link.inflight -= 1
                self.link_set.failed(link, exc)
            return True
        return self._tenant(index)[1] and self._reclaim(index, flight.prompt, fits, choices, flight.reclaim_tries)

    def _overdue_reclaims(self) -> list[int]:
        """Reclaims no slot server answered within a hang timeout: settled on what their slot's word says now;
        those it answers are returned (the caller reports them as lost: answered 503)."""
        now = self.link_set.clock()
        overdue = [(i, f) for i, f in self.book.inflight.items() if f.reclaim and now >= f.reclaim_due]
        answered = []
        for index, flight in overdue:
            self._reclaims.pop((id(flight.link), flight.slot), None)
            flight.reclaim_tries = RECLAIM_TRIES  # a server that does not answer is not asked again
            if self._settle_reclaim(index, flight) is not None:
                answered.append(index)
        return answered

    # -- claiming -------------------------------------------------------------------
    def _first_claim(
        self, choices: list[Choice], links: list[ServerLink], tenant: int = 0
    ) -> tuple[ServerLink, Choice, int, int] | None:
        """A claim on the first chosen server that has a free slot: (link, choice, slot, generation), or None;
        a server without a free slot is passed over, one whose compare-and-swap fails is taken down.  The claim
        names ``tenant`` (its floor id) in the state word."""
        for choice in choices:
            link = links[choice.server]
            try:
                claimed = self.claim(link, tenant)
            except TransportError as exc:
                self.link_set.failed(link, exc)
                continue
            if claimed is not None:
                return link, choice, claimed[0], claimed[1]
        return None

    def _try_claim(self, link: ServerLink, slot: int, tenant: int = 0) -> int | None:
        """CAS ``slot`` FREE -> CLAIMED (by this agent, for ``tenant``); the generation claimed, or None. Learns the
        word on failure."""
        offset = link.states_offset + 8 * slot
        words = link.words_ptr
        expected = int(words[slot])
        holder = wire.holder(link.claimant, tenant)
        for _ in range(2):  # second try only when the slot was FREE in a newer generation
            desired = claim_next(expected, holder)
            if not desired:
                return None
            link.stats.cas_attempts += 1
            found = link.conn.compare_and_swap(link.pool, offset, expected, desired)
            if found == expected:
                words[slot] = desired
                return wire.word_generation(desired)
            link.stats.cas_failures += 1
            words[slot] = found
            if not wire.is_free(found):
                return None
            expected = found
        return None

    def _claim_all(self, link: ServerLink, n: int, tenant: int = 0) -> list[tuple[int, int]] | None:
        """Claim ``n`` slots of ``link``, all or none: [(slot, generation)], or None with nothing left claimed --
        the claims made before one failed are given back (:meth:`_unclaim`)."""
        got: list[tuple[int, int]] = []
        try:
            for _ in range(n):
                claimed = self.claim(link, tenant)
                if claimed is None:
                    break
                got.append(claimed)
        finally:
            if len(got) < n:  # short, or the transport failed: give back what was taken
                for slot, gen in got:
                    self._unclaim(link, slot, wire.claim_word(wire.free_word(gen - 1), link.claimant, tenant))
        return got if len(got) == n else None

    def _unclaim(self, link: ServerLink, slot: int, claimed: int) -> None:
        """Give back the claim ``claimed`` (a CLAIMED word of this agent's), never rung: one remote CAS CLAIMED ->
        FREE in its generation (the EXPIRE step the slot server takes when a lease runs out, taken early by the
        claimant).  A CAS that fails found the server had expired it already (the same FREE word) -- or a link gone
        down, whose slots are forgotten anyway."""
        gen = wire.word_generation(claimed)
        freed = wire.step(claimed, wire.Event.EXPIRE, gen)
        try:
            found = link.conn.compare_and_swap(link.pool, link.states_offset + 8 * slot, claimed, freed)
        except TransportError as exc:
            log.warning("could not give back slot %d of %s: %s (its lease frees it)", slot, link.address, exc)
            return
        link.words_ptr[slot] = freed if found == claimed else found
        link.stats.unclaims += 1

    def claim(self, link: ServerLink, tenant: int = 0) -> tuple[int, int] | None:
        """Claim any free slot of ``link`` for ``tenant`` (its floor id): (slot, generation), or None when none
        is free.

        Candidates are the slots the cache says are FREE, from a rotating cursor; a failed CAS
        teaches the cache the real word.  When the cache has no FREE slot left, one RDMA READ
        refreshes it and the scan runs once more; then the answer is final."""
        n = link.slot_count
        for attempt in range(2):
            slot = lib.ep_next_free(link.words_ptr, n, link.cursor)
            for _ in range(n):
                if slot < 0:
                    break
                gen = self._try_claim(link, slot, tenant)
                if gen is not None:
                    link.cursor = (slot + 1) % n
                    link.stats.claims += 1
                    return slot, gen
                slot = lib.ep_next_free(link.words_ptr, n, (slot + 1) % n)
            if attempt == 0:
                self.link_set.refresh(link)
        link.stats.no_slot += 1
        return None

    # -- requests -------------------------------------------------------------------
    def check_frame(self, index: int) -> str | None:
        """Why frame ``index`` cannot be sent (None if it can)."""
        if not 0 <= index < self.frames.count:
            return f"frame index {index} outside 0..{self.frames.count - 1}"
        if index in self.inflight:
            return f"frame {index} is already in flight"
        req = self.frames.request_headers[index]
        return wire.request_problem(
            wire.input_words(req.token_count, req.flags),
            req.max_new_tokens,
            self.layout.input_capacity,
            self.layout.output_capacity,
        )

    def early_refusal(self, index: int, tenant: int, floor: int, slots: int = 1) -> Status | None:
        """Before frame ``index``'s prompt costs anything: NO_SLOT (its retry time in the frame's result header) when
        no UP slot server has ``slots`` free slots in the state words read now -- not as cached -- and the request's
        tenant (floor id ``tenant``, its ``floor``) is not under its floor, so the claim :meth:`submit` would make
        after the prompt is templated and tokenized could only fail.  None: go on (:meth:`submit` decides).  A
        flood that never backs off is refused for the price of a READ, not a tokenization (docs/TENANTS.md)."""
        ups = [link for link in self.links if link.up]
        if not ups:
            return None  # submit probes the others and answers UNAVAILABLE
        if any(link.free_hint >= slots for link in ups):
            return None
        for link in ups:
            self.link_set.probe(link)  # the cache saw none free: the words as they are now
        ups = [link for link in ups if link.up]
        if not ups or any(link.free_hint >= slots for link in ups):
            return None
        if tenant and floor:
            self._learned[tenant] = floor
            if slots == 1 and floors.under_floor(tenant, floor, self._holdings()):
                return None  # it takes a slot back (submit_group never does)
        self.frames.result_headers[index].no_slot(self._slot_frees_in(ups))
        return Status.NO_SLOT

    def submit(self, index: int) -> Status | None:
        """Send frame ``index``. None: in flight (its result arrives via :meth:`poll`);
        otherwise the immediate outcome: NO_SLOT, UNAVAILABLE (no live server) or BAD_REQUEST."""
        if self.check_frame(index) is not None:
            return Status.BAD_REQUEST
        req = self.frames.request_headers[index]
        count, words = req.token_count, wire.input_words(req.token_count, req.flags)
        links = self.links
        fits = [link for link in links if link.up and words <= link.input_capacity]  # one pass in the common case
        if len(fits) < len(links):
            up = sum(link.up for link in links)
            if up < len(links):
                self.link_set.probe_stale()  # an unresponsive server may have come back
                fits = [link for link in links if link.up and words <= link.input_capacity]
                up = sum(link.up for link in links)
            if not up:
                return Status.UNAVAILABLE
            if not fits:
                return Status.BAD_REQUEST
        tenant, owner = self._tenant(index)
        choices = self._choose(index, count, fits, owner)
        if choices == Status.OVER_BOUND and tenant and not owner:
            owner = self._tenant(index)[1]  # on the words the refusal re-read: under its floor, it is not refused
            if owner:
                choices = self._choose(index, count, fits, owner)
        if isinstance(choices, Status):
            return choices
        claimed = self._first_claim(choices, fits, tenant)
        if claimed is None:
            if tenant and self._tenant(index)[1] and self._reclaim(index, count, fits, choices):
                return None  # in flight: sent once its slot is handed over
            if not any(link.up for link in links):
                return Status.UNAVAILABLE
            self.frames.result_headers[index].no_slot(self._slot_frees_in(fits))
            return Status.NO_SLOT
        link, choice, slot, gen = claimed
        if choice.matched:
            link.stats.affine += 1
        if log.isEnabledFor(logging.DEBUG):
            self._log_admission(index, link, slot, count, choice)
        try:
            self._send(link, index, slot, gen, count, choice)
        except TransportError as exc:
            self.book.unsent(index)  # the caller still owns the frame: it answers and releases it
            link.inflight -= 1
            self.link_set.failed(link, exc)
            return Status.UNAVAILABLE
        return None

    def submit_group(self, indexes: Sequence[int]) -> Status | None:
        """Send frames ``indexes`` -- one request's choices: the same prompt, their own seeds -- to as many slots of
        **one** slot server, claimed all or none (each claim one CAS; when one fails, those taken are given back
        and the answer is NO_SLOT at once).  One server, so its prefix cache computes the shared prompt once: the
        first to be placed prefills it, the others copy its KV (docs/ARCHITECTURE.md).  None: all in flight;
        otherwise the refusal (its figures in the first frame's result header), and none is."""
        n = len(indexes)
        if n == 0 or len(set(indexes)) != n or any(self.check_frame(index) is not None for index in indexes):
            return Status.BAD_REQUEST
        first = indexes[0]
        req = self.frames.request_headers[first]
        count, words = req.token_count, wire.input_words(req.token_count, req.flags)
        links = self.links
        if not any(link.up for link in links):
            self.link_set.probe_stale()
            if not any(link.up for link in links):
                return Status.UNAVAILABLE
        fits = [link for link in links if link.up and words <= link.input_capacity and n <= link.slot_count]
        if not fits:
            return Status.BAD_REQUEST
        tenant, _ = self._tenant(first)
        choices = self._choose(first, count, fits)
        if isinstance(choices, Status):
            return choices  # its figures are in the first frame's result header
        for choice in choices:
            link = fits[choice.server]
            try:
                claims = self._claim_all(link, n, tenant)
            except TransportError as exc:
                self.link_set.failed(link, exc)
                continue
            if claims is not None:
                break
        else:
            if not any(link.up for link in links):
                return Status.UNAVAILABLE
            self.frames.result_headers[first].no_slot(self._slot_frees_in(fits))
            return Status.NO_SLOT
        if choice.matched:
            link.stats.affine += 1
        for k, (index, (slot, gen)) in enumerate(zip(indexes, claims, strict=True)):
            try:
                self._send(link, index, slot, gen, count, choice)
            except TransportError as exc:
                # The link is lost with every choice on it -- those not written yet too, booked there now -- so
                # each is answered (or moved) as any request in flight on a lost link is: the group stays whole.
                for later, (slot_, gen_) in zip(indexes[k + 1 :], claims[k + 1 :], strict=True):
                    self.book.sent(
                        later,
                        InFlight(link=link, slot=slot_, generation=gen_, prompt=count, max_new=req.max_new_tokens),
                    )
                    link.inflight += 1
                self.link_set.failed(link, exc)
                break
        return None

    def _tenant(self, index: int) -> tuple[int, bool]:
        """Frame ``index``'s tenant (its floor id, learned with its floor) and whether that tenant is under its floor
        now, counted over every slot server this agent reads (the state words as last read)."""
        req = self.frames.request_headers[index]
        tenant, floor = req.tenant, req.slot_floor
        if not tenant or not floor:
            return tenant, False
        self._learned[tenant] = floor
        return tenant, floors.under_floor(tenant, floor, self._holdings())

    def _holdings(self) -> Counter[int]:
        """Slots each tenant holds on the slot servers this agent reads (the state words as last read), this
        agent's reclaims under way counted as done."""
        holdings = floors.held([link.words for link in self.links if link.alive])
        under_way = []
        for index in self._reclaims.values():
            flight = self.book.inflight.get(index)
            if flight is not None and flight.reclaim:
                victim = wire.word_tenant(int(flight.link.words[flight.slot]))
                under_way.append((victim, wire.word_tenant(flight.reclaim)))
        return floors.moving(holdings, under_way)

    def _choose(self, index: int, count: int, fits: list[ServerLink], owner: bool = False) -> list[Choice] | Status:
        """Where frame ``index`` may be claimed, best first, or OVER_BOUND (its result header then says why).  A
        request of a tenant under its floor (``owner``) is never refused for its wait: its floor is a slot."""
        if len(fits) == 1 and not fits[0].load.published:
            return [_ONLY]  # one server, and it publishes no load: nothing to predict or order
        if owner:
            salt = self.frames.request_headers[index].cache_salt
            tokens = self.frames.tokens[index, :count]
            return self.admission.decide(tokens, fits, math.inf, salt, self.link_set.clock()).choices
        decision = self._decide(index, count, fits)
        if not decision.choices and decision.over_bound_ms is not None and self._reread(fits):
            # A refusal rests on a view a heartbeat old at most: decide again on what was just read.
            fits[:] = [link for link in fits if link.up]
            decision = self._decide(index, count, fits) if fits else Decision([])
        if not decision.choices and decision.over_bound_ms is not None:
            wait, bound = decision.over_bound_ms, self._bound(index)
            retry = self.retry_advice.advise(self.link_set.clock(), wait - bound, decision.over_bound_work_ms)
            self.frames.result_headers[index].over_bound(wait, bound, retry)
            return Status.OVER_BOUND
        return decision.choices

    def _log_admission(self, index: int, link: ServerLink, slot: int, count: int, choice: Choice) -> None:
        """What an admission rested on (``-v``): the load as read and how old, the claims it did not show yet, the
        prompt, and the prediction -- so a prediction can be checked against the steps the model side then logs."""
        load = link.load
        now = self.link_set.clock()
        age_ms = (now - link.tracker.observed) * 1e3
        under_way = link.under_way_ms(now)
        log.debug(
            "admit frame %d on %s slot %d: prompt %d tokens, %d held; load read %.1f ms ago: %d decoding "
            "(longest %d, %d runs), waiting %s, %d unseen, its first step under way for %s; predicted first token "
            "%.1f ms, wait %.1f ms",
            index,
            link.address,
            slot,
            count,
            cached_tokens(count, choice.matched),
            age_ms,
            load.decoding,
            load.longest,
            load.runs,
            [(p.done, p.remaining) for p in load.waiting],
            len(link.unseen),
            "?" if under_way is None else f"{under_way:.1f} ms",
            choice.prediction.ttft_ms,
            choice.prediction.wait_ms,
        )

    def _reread(self, links: list[ServerLink]) -> bool:
        """Read again the links whose load was last read more than a probe interval ago (the heartbeat's
        period), before refusing on it; whether any was read.  Refusals under a flood cost at most one READ
        per link and interval."""
        now = self.link_set.clock()
        stale = [link for link in links if now - link.tracker.observed >= self.link_set.probe_interval]
        for link in stale:
            self.link_set.probe(link)
        return bool(stale)

    def _bound(self, index: int) -> float:
        """Frame ``index``'s bound on waiting (ms): the request's own (its header's ``max_wait_ms``), never more
        than the agent's -- the one owner of the server's bound."""
        asked = self.frames.request_headers[index].max_wait_ms
        return min(asked, self.max_wait_ms) if asked else self.max_wait_ms

    def _decide(self, index: int, count: int, fits: list[ServerLink]) -> Decision:
        """The admission decision for frame ``index``, within its bound."""
        salt = self.frames.request_headers[index].cache_salt
        tokens = self.frames.tokens[index, :count]
        return self.admission.decide(tokens, fits, self._bound(index), salt, self.link_set.clock())

    def _slot_frees_in(self, links: list[ServerLink]) -> float:
        """A NO_SLOT's retry time (ms): when a slot of ``links`` is predicted to free for this client -- the soonest
        of this agent's requests there to reach its ``max_tokens`` at the server's decode step cost (a stream that
        stops earlier frees its slot sooner), booked for the mean time between two slots freeing
        (:class:`~edgepath.dpu.retry_advice.RetryAdvice`); 0 (no estimate: the edge's default) when none is known."""
        frees = []
        for flight in self.book.inflight.values():
            load = flight.link.load
            if flight.link not in links or not load.published:
                continue
            frees.append(max(1, flight.max_new - flight.count) * load.decode_step_ms())
        if not frees:
            return 0.0
        return self.retry_advice.advise(self.link_set.clock(), min(frees), max(frees) / len(frees))

    def _send(
        self,
        link: ServerLink,
        index: int,
        slot: int,
        gen: int,
        count: int,
        choice: Choice = _ONLY,
        flight: InFlight | None = None,
        chain: np.ndarray | None = None,
    ) -> None:
        """Write frame ``index`` into ``slot`` of ``link`` and ring its doorbell (``choice``: the decision that
        put it there; ``flight``: a request that moved, in flight already; ``chain``: its prompt's prefix chain,
        by default the admission's last decision's)."""
        frame_off = self.frames.frame_offset(index)
        req = self.frames.request_headers[index]
        req.stamp(gen, slot, index)
        prediction = choice.prediction
        req.predicted(prediction.ttft_ms, prediction.wait_ms)
        cached = cached_tokens(count, choice.matched)
        if chain is None:
            chain = self.admission.chain if choice is not _ONLY else _NO_CHAIN  # _ONLY: nothing was decided
        link.wrote(slot, gen, Claimed(Prompt(cached, count - cached), chain))
        pool = link.pool
        if flight is None:
            flight = InFlight(
                link=link, slot=slot, generation=gen, prompt=count, max_new=req.max_new_tokens, prediction=prediction
            )
        self.book.sent(index, flight)
        link.inflight += 1
        link.conn.write_then_imm(
            self.frames_mr,
            frame_off,
            pool,
            link.slots_offset + slot * link.slot_stride,
            self.layout.request_bytes(wire.input_words(count, req.flags)),  # the prompt and its constraint
            frame_off + _DOORBELL_FIELD,
            link.doorbells_offset + 8 * slot,
            8,
            wire.doorbell_imm(slot, gen),
        )

    def deliver(self, conn_id: int, imm: int) -> Delivery | None:
        """Account one completion from a slot server: streamed progress or a final result. Anything
        that does not match a frame in flight there, in its generation, is counted and dropped."""
        if wire.is_handover_imm(imm):
            return self._handed_over(conn_id, wire.imm_index(imm))
        index = wire.imm_index(imm)
        book = self.book
        flight = book.inflight.get(index)
        link = self.link_set.by_conn.get(conn_id)
        progress = wire.is_progress_imm(imm)
        if (link is None and conn_id in self.link_set.retired) or (
            link is not None and (not link.alive or (flight is not None and flight.moves and flight.link is not link))
        ):
            # Sent on a link given up on since (what was in flight there is answered, 503, or moved, and its frame
            # maybe reused), or by a server the request moved away from: late, never a second answer (nor
            # "unknown").
            book.stats.late += 1
            return None
        if flight is None or link is None or flight.link is not link:
            answered = self.frames.result_headers[index].generation if 0 <= index < self.frames.count else -1
            book.stray(index, not progress, answered)
            log.warning("ignoring a completion for frame %d from connection %d: not in flight", index, conn_id)
            return None
        gen = flight.generation
        result = self.frames.result_headers[index]
        if progress:
            count = result.placed_for(gen)
            if count is None:
                book.unknown()
                return None
            return book.progress(index, count)
        if result.generation != gen:
            book.unknown()
            log.warning("ignoring stale result for frame %d", index)
            return None
        link.inflight -= 1
        if result.status == Status.RECLAIMED:
            return self._reclaimed(index, flight, result.output_count)
        # The server frees the slot before notifying: remember it as FREE in this generation.
        link.words_ptr[flight.slot] = wire.free_word(gen)
        return book.final(index, result.output_count, gen)

    def _reclaimed(self, index: int, flight: InFlight, produced: int) -> Delivery | None:
        """Frame ``index``'s slot was taken back for a tenant under its floor, with ``produced`` tokens of its answer
        placed: the stream moves to any free slot (on this server too: only the slot was wanted), as a stream
        whose server went away does, and goes on as one stream; when it cannot, it ends RECLAIMED (the edge says
        why).  The answer so far is delivered either way."""
        news = self.book.progress(index, produced) if not flight.abandoned else None
        if self.migration_limit and not (flight.abandoned or flight.cancelled) and self._migrate(index, flight, True):
            return news
        return self.book.final(index, produced, flight.generation)

    def cancel(self, index: int) -> None:
        """Write the slot's cancel word (its generation) and ring it: the slot server stops the handler at
        its next step and answers CANCELLED (or the result already on its way arrives)."""
        flight = self.inflight.get(index)
        if flight is None or flight.cancelled:
            return
        flight.cancelled = True
        link = flight.link
        if not link.alive or flight.reclaim:
            return  # a reclaim under way runs nothing yet: its slot is given back when it is handed over
        self.link_set.send_cancel(link, flight.slot, flight.generation)

    def abandon(self, index: int) -> None:
        """Give up on frame ``index``: cancel its slot, deliver nothing more for it, and put the frame
        back on the free list when its final result arrives (or its slot server is lost) -- never
        before, so nothing of this request can land in the frame's next use."""
        if self.book.abandon(index) is not None:
            self.cancel(index)

    def check_links(self) -> list[int]:
        """Handle connection events and read the heartbeat of every connected server not read within the
        probe interval; frames lost with a slot server that went away are returned (answer them 503)."""
        self.link_set.check()
        overdue = self._overdue_reclaims()
        lost, self._lost = self._lost, []
        return overdue + self.book.take(lost)  # those abandoned since they were lost were freed then

    def stalled(self) -> list[int]:
        """Frames that were in flight on a slot server when it was found UNRESPONSIVE (even if it has come back
        since), each reported once; the caller answers them and abandons them (they stay fenced until that
        server lets go of them or its link is lost)."""
        stalled, self._stalled = self._stalled, []
        inflight = self.book.inflight
        return [index for index in stalled if index in inflight and not inflight[index].abandoned]

    def poll(self, timeout: float | None = 0.0, spin: float = 0.0) -> list[Delivery]:
        """What arrived for frames in flight: streamed progress and final results (in ``frames.results`` /
        ``frames.outputs``)."""
        out = []
        for c in self.transport.cq.wait(timeout, spin=spin, max_entries=256):
            delivery = self.deliver(c.conn_id, c.imm)
            if delivery is not None:
                out.append(delivery)
        return out

    def free_slots(self) -> tuple[int, int]:
        """(free slots on UP servers, slots on all servers), read now (:meth:`LinkSet.free_slots`)."""
        return self.link_set.free_slots()

    def servers(self) -> list[SlotServerStatus]:
        """Every slot server this agent attached, in attach order (:meth:`LinkSet.servers`)."""
        return self.link_set.servers()

    def describe(self) -> dict[str, Any]:
        return {"servers": self.link_set.describe()}
