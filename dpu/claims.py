"""Claims and sends: what an agent does to one slot -- claim it by CAS, give a claim back, write a request into it.

Admission is decided once, at claim time: a slot is taken only by a compare-and-swap of its state word from FREE
to CLAIMED (its claimant and tenant in the word), never written before that.  A claim given back unrung is one CAS
CLAIMED -> FREE.  A claimed slot gets its request with one RDMA WRITE of the frame (header and prompt, written once
by the edge) and its doorbell with the same operation's immediate.  Everything here acts on slots; which server to
try, and why, is decided by :mod:`edgepath.dpu.submission` and :mod:`edgepath.dpu.floor_book`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from edgepath.contract import wire
from edgepath.contract.plan import Prediction, Prompt
from edgepath.contract.pool import AgentFrames, FrameLayout
from edgepath.dpu.admission import Admission, Choice, Claimed, cached_tokens
from edgepath.dpu.frame_book import Flight, FrameBook
from edgepath.dpu.links import LinkSet, ServerLink
from edgepath.dpu.retry_advice import RetryAdvice
from edgepath.native.abi import REQUEST_HEADER, Event, field_offset, lib
from edgepath.transports.base import MemoryRegion, TransportError

log = logging.getLogger("edgepath.agent")

_DOORBELL_FIELD = field_offset(REQUEST_HEADER, "doorbell")
AT_ONCE = Prediction(0.0, 0.0)
#: the choice of a request placed without a decision (one server that publishes no load: nothing to predict)
ONLY = Choice(0, 0, AT_ONCE)
NO_CHAIN = np.zeros(0, dtype=np.uint64)


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
    prediction: Prediction = AT_ONCE  # the prediction it was claimed with (sent with it)


#: a claim: the link, the choice that put it there, the slot and the generation claimed
Claim = tuple[ServerLink, Choice, int, int]


class Claims:
    """The slot operations of one agent's requests, over its links, frames and frame book."""

    def __init__(
        self,
        link_set: LinkSet,
        frames: AgentFrames,
        frames_mr: MemoryRegion,
        layout: FrameLayout,
        book: FrameBook[InFlight],
        admission: Admission,
        retry_advice: RetryAdvice,
    ) -> None:
        self.link_set = link_set
        self.frames = frames
        self.frames_mr = frames_mr
        self.layout = layout
        self.book = book
        self.admission = admission
        self.retry_advice = retry_advice

    # -- claiming -------------------------------------------------------------------
    def unbounded(self, index: int, count: int, fits: list[ServerLink]) -> list[Choice]:
        """Where frame ``index`` (``count`` tokens) may be claimed, best first, with no bound on its wait: a request
        under its tenant's floor (its floor is a slot; its wait is not bounded), or one that moves (it was admitted
        already).  One server that publishes no load: nothing to predict or order."""
        if len(fits) == 1 and not fits[0].load.published:
            return [ONLY]
        salt = self.frames.request_headers[index].cache_salt
        tokens = self.frames.tokens[index, :count]
        return self.admission.decide(tokens, fits, math.inf, salt, self.link_set.clock()).choices

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

    def _try_claim(self, link: ServerLink, slot: int, tenant: int = 0) -> int | None:
        """CAS ``slot`` FREE -> CLAIMED (by this agent, for ``tenant``); the generation claimed, or None. Learns the
        word on failure."""
        offset = 8 * slot  # in the states region: the words alone
        words = link.words_ptr
        expected = int(words[slot])
        holder = wire.holder(link.claimant, tenant)
        for _ in range(2):  # second try only when the slot was FREE in a newer generation
            desired = wire.claim_next(expected, holder)
            if not desired:
                return None
            link.stats.cas_attempts += 1
            found = link.conn.compare_and_swap(link.states, offset, expected, desired)
            if found == expected:
                words[slot] = desired
                return wire.word_generation(desired)
            link.stats.cas_failures += 1
            words[slot] = found
            if not wire.is_free(found):
                return None
            expected = found
        return None

    def claim_all(self, link: ServerLink, n: int, tenant: int = 0) -> list[tuple[int, int]] | None:
        """Claim ``n`` slots of ``link``, all or none: [(slot, generation)], or None with nothing left claimed --
        the claims made before one failed are given back (:meth:`unclaim`)."""
        got: list[tuple[int, int]] = []
        try:
            for _ in range(n):
                claimed = self.claim(link, tenant)
                if claimed is None:
                    break
                got.append(claimed)
        finally:
            if len(got) < n:  # short, or the transport failed: give back what was taken
                self.give_back(link, got, tenant)
        return got if len(got) == n else None

    def first(
        self, choices: list[Choice], links: list[ServerLink], tenant: int = 0, n: int = 1
    ) -> tuple[ServerLink, Choice, list[tuple[int, int]]] | None:
        """``n`` slots claimed on the first chosen server that has them free: (link, choice, [(slot, generation)]), or
        None; a server without them is passed over, one whose compare-and-swap fails is taken down.  The claims
        name ``tenant`` (its floor id) in the state words."""
        for choice in choices:
            link = links[choice.server]
            try:
                claimed = self.claim_all(link, n, tenant)
            except TransportError as exc:
                self.link_set.failed(link, exc)
                continue
            if claimed is not None:
                return link, choice, claimed
        return None

    def first_one(self, choices: list[Choice], links: list[ServerLink], tenant: int = 0) -> Claim | None:
        """One slot claimed on the first chosen server that has one free (:meth:`first`)."""
        got = self.first(choices, links, tenant)
        if got is None:
            return None
        link, choice, [(slot, gen)] = got
        return link, choice, slot, gen

    def give_back(self, link: ServerLink, claims: list[tuple[int, int]], tenant: int = 0) -> None:
        """Give back this agent's unrung claims of ``tenant`` on ``link`` ([(slot, generation)])."""
        for slot, gen in claims:
            self.unclaim(link, slot, wire.claim_word(wire.free_word(gen - 1), link.claimant, tenant))

    def unclaim(self, link: ServerLink, slot: int, claimed: int) -> None:
        """Give back the claim ``claimed`` (a CLAIMED word of this agent's), never rung: one remote CAS CLAIMED ->
        FREE in its generation (the EXPIRE step the slot server takes when a lease runs out, taken early by the
        claimant).  A CAS that fails found the server had expired it already (the same FREE word) -- or a link gone
        down, whose slots are forgotten anyway."""
        gen = wire.word_generation(claimed)
        freed = wire.step(claimed, Event.EXPIRE, gen)
        try:
            found = link.conn.compare_and_swap(link.states, 8 * slot, claimed, freed)
        except TransportError as exc:
            log.warning("could not give back slot %d of %s: %s (its lease frees it)", slot, link.address, exc)
            return
        link.words_ptr[slot] = freed if found == claimed else found
        link.stats.unclaims += 1

    # -- sending --------------------------------------------------------------------
    def send(
        self,
        link: ServerLink,
        index: int,
        slot: int,
        gen: int,
        count: int,
        choice: Choice = ONLY,
        flight: InFlight | None = None,
        chain: np.ndarray | None = None,
    ) -> None:
        """Write frame ``index`` into ``slot`` of ``link`` and ring its doorbell (``choice``: the decision that
        put it there; ``flight``: a request that moved, in flight already; ``chain``: its prompt's prefix chain,
        by default the admission's last decision's).  Booked in flight before the write: a TransportError leaves
        it there, for the caller to unbook or lose with the link."""
        frame_off = self.frames.frame_offset(index)
        req = self.frames.request_headers[index]
        req.stamp(gen, slot, index)
        prediction = choice.prediction
        req.predicted(prediction.ttft_ms, prediction.wait_ms)
        cached = cached_tokens(count, choice.matched)
        if chain is None:
            chain = self.admission.chain if choice is not ONLY else NO_CHAIN  # ONLY: nothing was decided
        link.wrote(slot, gen, Claimed(Prompt(cached, count - cached), chain))
        if flight is None:
            flight = InFlight(
                link=link, slot=slot, generation=gen, prompt=count, max_new=req.max_new_tokens, prediction=prediction
            )
        self.book.sent(index, flight)
        link.inflight += 1
        link.conn.write_then_imm(
            self.frames_mr,
            frame_off,
            link.inbox,
            link.slots_offset + slot * link.slot_stride,
            self.layout.request_bytes(wire.input_words(count, req.flags)),  # the prompt and its constraint
            frame_off + _DOORBELL_FIELD,
            link.doorbells_offset + 8 * slot,
            8,
            wire.doorbell_imm(slot, gen),
        )

    def resend(
        self,
        index: int,
        flight: InFlight,
        claim: Claim,
        count: int,
        chain: np.ndarray | None = None,
        lost_with: ServerLink | None = None,
    ) -> bool:
        """Send frame ``index``, already in flight as ``flight``, to ``claim`` instead (a request that moved, or whose
        reclaim did not get its slot); False when the write failed: the claim's link is then down, and the flight
        stays booked on ``lost_with`` (by default that link), to be answered or moved with it."""
        link, choice, slot, gen = claim
        flight.link, flight.slot, flight.generation, flight.prediction = link, slot, gen, choice.prediction
        try:
            self.send(link, index, slot, gen, count, choice, flight, chain)
        except TransportError as exc:
            flight.link = lost_with or link
            link.inflight -= 1
            self.link_set.failed(link, exc)
            return False
        return True

    def frees_in(self, links: list[ServerLink], tenant: int | None = None) -> float:
        """A NO_SLOT's retry time (ms): when a slot of ``links`` is predicted to free for this client -- the soonest
        of this agent's requests there (of ``tenant`` only, when given: a SLOT_CAP's) to reach its ``max_tokens`` at
        the server's decode step cost (a stream that stops earlier frees its slot sooner), booked for the mean time
        between two slots freeing (:class:`~edgepath.dpu.retry_advice.RetryAdvice`); 0 (no estimate: the edge's
        default) when none is known."""
        frees = []
        headers = self.frames.request_headers
        for index, flight in self.book.inflight.items():
            load = flight.link.load
            if flight.link not in links or not load.published:
                continue
            if tenant is not None and headers[index].tenant != tenant:
                continue
            frees.append(max(1, flight.max_new - flight.count) * load.decode_step_ms())
        if not frees:
            return 0.0
        return self.retry_advice.advise(self.link_set.clock(), min(frees), max(frees) / len(frees))
