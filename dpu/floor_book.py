"""The floor book: the tenants' slot floors and caps as one agent knows them, what they hold, and taking a lent
slot back.

One object holds everything an agent knows and does about a tenant's slots (docs/TENANTS.md):

- **the limits**: each tenant's slot floor and slot cap, by its id in the state words -- those configured (the
  tenants file's, :meth:`FloorBook.set_limits`) and those learned from the requests that name them (their header's
  id, floor and cap), each learned one forgotten an hour after a request last named it: the rule the slot server's
  handler follows too (:class:`~edgepath.contract.plan.FloorMemory`);
- **what each tenant holds**: counted from the state words as last read (:mod:`~edgepath.dpu.floors`), with this
  agent's reclaims under way counted as done (:class:`Standing`) -- once per request decided on them, and once more
  only on words read anew since (a failed claim, a refusal, re-reads them);
- **the cap**: a request whose tenant would hold more slots than its cap, across every pool -- so across every edge
  and agent that claims on them -- is refused SLOT_CAP; the count is taken again after its claims, on the words
  read then, so two edges never both keep a tenant's last slot (:meth:`FloorBook.keeps`);
- **the reclaim protocol**: a request of a tenant under its floor (:func:`~edgepath.contract.plan.under_floor`)
  that finds no free slot asks for a slot of a tenant above its floor -- one WRITE_WITH_IMM of the slot's reclaim
  word -- and is sent when the slot server hands it over (:meth:`FloorBook.handed_over`), claims another when it
  does not, or is refused once it has tried :data:`RECLAIM_TRIES` slots.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass

from edgepath.contract import wire
from edgepath.contract.plan import FloorMemory, under_floor
from edgepath.dpu import floors
from edgepath.dpu.admission import Choice
from edgepath.dpu.claims import NO_CHAIN, Claims, InFlight
from edgepath.dpu.links import ServerLink
from edgepath.dpu.port import Delivery, SlotLimits
from edgepath.native.abi import Status
from edgepath.transports.base import TransportError

log = logging.getLogger("edgepath.agent")

#: how many slots one request under its tenant's floor tries to take back before it is refused (each try is one
#: reclaim word written and rung, answered by the slot server at its next turn): another agent may take the same
#: slot first, or the stream there may end by itself meanwhile and its slot be claimed by someone else
RECLAIM_TRIES = 8
#: a tenant under its floor takes slots back -- cutting or moving another tenant's stream -- at most ``slot_floor``
#: times in any window of this many seconds, per agent (docs/TENANTS.md): a floor used for real work (requests
#: that hold their slot a second or more) never meets it, while a flood of requests that end as soon as they start
#: no longer cuts a borrower's answer for each of its tokens; beyond it the tenant claims like anyone (a free slot,
#: or 429 no_slot with when its next take-back is allowed)
RECLAIM_WINDOW_S = 1.0


@dataclass(frozen=True, slots=True)
class Standing:
    """A tenant's standing for one request: its id in the state words, its floor and cap, and what every tenant holds
    (the state words as last read, this agent's reclaims under way counted as done), counted once for the decision
    it is made for."""

    tenant: int
    limits: SlotLimits
    holdings: Counter[int]
    #: slots it may still take back in the window (:data:`RECLAIM_WINDOW_S`)
    reclaims_left: int = 0

    @property
    def floor(self) -> int:
        return self.limits.floor

    @property
    def cap(self) -> int:
        return self.limits.cap

    @property
    def under_floor(self) -> bool:
        """Whether the tenant holds fewer slots than its floor: it may take one back."""
        return under_floor(self.tenant, self.floor, self.holdings)

    @property
    def takes_back(self) -> bool:
        """Whether a request of the tenant that finds no free slot takes one back: under its floor, and within the
        rate at which a floor takes slots back."""
        return self.under_floor and self.reclaims_left > 0

    def over_cap(self, more: int = 0) -> bool:
        """Whether the tenant would hold more than its cap with ``more`` slots (0: as it is)."""
        return bool(self.tenant and self.cap) and self.holdings.get(self.tenant, 0) + more > self.cap


class FloorBook:
    """Slot floors and caps for one agent's requests: the tenants' limits, what they hold, the reclaims under way."""

    def __init__(self, claims: Claims) -> None:
        self.claims = claims
        self.link_set = claims.link_set
        self.frames = claims.frames
        self.book = claims.book
        self._configured: dict[int, SlotLimits] = {}  # tenant id -> its limits, from the tenants file
        self._learned: FloorMemory[SlotLimits] = FloorMemory()  # tenant id -> its limits, from requests
        self._reclaims: dict[tuple[int, int], int] = {}  # (id of the link, slot) -> frame reclaiming it
        self._taken: dict[int, deque[float]] = {}  # tenant id -> when its requests took slots back, in the window
        self._cursor = 0  # where victims are looked for from, turned at every reclaim (agents pick apart)

    # -- the limits -------------------------------------------------------------------------
    def set_limits(self, limits: Mapping[int, SlotLimits]) -> None:
        """The slot floors and caps of every tenant that has one, by its id in the state words (docs/TENANTS.md):
        whose slots above their floor this agent may take back for a tenant under its own.  A tenant not listed here
        is learned from the requests that name it (their header's floor and cap); one neither listed nor seen is
        never taken from."""
        self._configured = dict(limits)

    def table(self) -> dict[int, int]:
        """Every floor known here by tenant id (0 for a tenant with a cap only): those configured, and those
        learned that are not."""
        learned = self._learned.table()
        return {tenant: limits.floor for tenant, limits in {**learned, **self._configured}.items()}

    def learn(self, tenant: int, limits: SlotLimits) -> SlotLimits:
        """A request of ``tenant`` (its id) named ``limits``: remembered, and what this agent counts it by
        (:meth:`limits`)."""
        if tenant and (limits.floor or limits.cap):
            self._learned.learn(tenant, limits, self.link_set.clock())
        return self.limits(tenant, limits)

    def limits(self, tenant: int, named: SlotLimits) -> SlotLimits:
        """What this agent counts ``tenant`` by when a request names ``named``: the configured limits where there are
        some (the tenants file is the one source), else what the request named (none for id 0)."""
        return self._configured.get(tenant, named) if tenant else SlotLimits()

    # -- what tenants hold ----------------------------------------------------------------
    def holdings(self) -> Counter[int]:
        """Slots each tenant holds on the slot servers this agent reads (the state words as last read), this agent's
        reclaims under way counted as done."""
        holdings = floors.held([link.words for link in self.link_set.links if link.alive])
        under_way = []
        for index in self._reclaims.values():
            flight = self.book.inflight.get(index)
            if flight is not None and flight.reclaim:
                victim = wire.word_tenant(int(flight.link.words[flight.slot]))
                under_way.append((victim, wire.word_tenant(flight.reclaim)))
        return floors.moving(holdings, under_way)

    def standing(self, index: int) -> Standing:
        """Frame ``index``'s tenant's standing, its limits learned from the request's header (:meth:`named`)."""
        req = self.frames.request_headers[index]
        return self.named(req.tenant, self.learn(req.tenant, SlotLimits(req.slot_floor, req.slot_cap)))

    def named(self, tenant: int, named: SlotLimits) -> Standing:
        """The standing of ``tenant`` when a request names ``named`` (:meth:`limits`): what every tenant holds is
        counted here (once) only for a tenant with a floor or a cap."""
        limits = self.limits(tenant, named)
        if not limits.floor and not limits.cap:
            return Standing(tenant, limits, Counter())
        left = limits.floor - len(self._recent(tenant)) if limits.floor else 0
        return Standing(tenant, limits, self.holdings(), left)

    def _recent(self, tenant: int) -> deque[float]:
        """When ``tenant``'s requests took slots back within the last :data:`RECLAIM_WINDOW_S`, oldest first."""
        taken = self._taken.setdefault(tenant, deque())
        now = self.link_set.clock()
        while taken and now - taken[0] >= RECLAIM_WINDOW_S:
            taken.popleft()
        return taken

    def take_back_in(self, standing: Standing) -> float:
        """Milliseconds until ``standing``'s tenant, under its floor, may take a slot back again (0: it may now)."""
        if not standing.under_floor or standing.reclaims_left > 0:
            return 0.0
        taken = self._recent(standing.tenant)
        return max(0.0, taken[0] + RECLAIM_WINDOW_S - self.link_set.clock()) * 1e3 if taken else 0.0

    def fresh(self, standing: Standing) -> Standing:
        """``standing`` counted again on the state words read now (one RDMA READ per slot server connected)."""
        for link in self.link_set.links:
            if link.alive:
                self.link_set.probe(link)
        return Standing(standing.tenant, standing.limits, self.holdings())

    def keeps(self, index: int, standing: Standing, link: ServerLink, claimed: list[tuple[int, int]]) -> bool:
        """Whether frame ``index`` may keep the slots just ``claimed`` for it on ``link``: always, for a tenant without
        a cap; otherwise counted again on the words read now, which hold those claims -- over its cap, they are given
        back and the request is refused SLOT_CAP (its retry time in the result header).  Two claims that race for a
        tenant's last slot under its cap may both be refused, never both kept: the later one's READ sees the earlier
        one's claim."""
        if not standing.cap:
            return True
        if not self.fresh(standing).over_cap():
            return True
        self.claims.give_back(link, claimed, standing.tenant)
        self.frames.result_headers[index].capped(self.claims.frees_in(self.link_set.links, standing.tenant))
        return False

    def refuse_cap(self, index: int, standing: Standing, more: int = 1) -> bool:
        """Whether frame ``index`` is refused SLOT_CAP before any claim: its tenant would hold more than its cap with
        ``more`` slots on the words as last read, and still would on the words read now (a refusal never rests on an
        old view)."""
        if not standing.over_cap(more) or not self.fresh(standing).over_cap(more):
            return False
        self.frames.result_headers[index].capped(self.claims.frees_in(self.link_set.links, standing.tenant))
        return True

    # -- taking a lent slot back ------------------------------------------------------------
    def take_back(
        self, index: int, count: int, fits: list[ServerLink], choices: list[Choice], standing: Standing, tries: int = 0
    ) -> bool:
        """Frame ``index``'s tenant is under its floor and no slot is free: ask for a slot of a tenant above its floor
        (:func:`~edgepath.dpu.floors.victims`, on the servers in admission's order).  One WRITE_WITH_IMM of the
        slot's reclaim word -- the CLAIMED word, this agent's and the tenant's, of the generation after the running
        one -- and the slot server ends that stream (RECLAIMED, to its own agent, which moves it) and hands the slot
        over without its ever being FREE.  The frame is booked in flight meanwhile and sent when the server says it
        acted (:meth:`settle`).  False when no slot may be taken back."""
        req = self.frames.request_headers[index]
        tenant = standing.tenant
        order = [fits[choice.server] for choice in choices]
        predictions = [choice.prediction for choice in choices]
        positions = {id(link): at for at, link in enumerate(order)}
        under_way = frozenset((positions[key[0]], key[1]) for key in self._reclaims if key[0] in positions)
        self._cursor += 1
        start = self._cursor + 7 * (order[0].claimant if order else 0)  # agents start apart
        words = [link.words for link in order]
        since = [link.claimed_since for link in order]
        for victim in floors.victims(tenant, words, self.table(), standing.holdings, under_way, start, since):
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
            if not tries:  # a request counts once against the rate, however many slots it asks for
                self._recent(tenant).append(self.link_set.clock())
            log.debug("frame %d (tenant %d) takes back slot %d of %s from tenant %d", index, tenant, victim.slot,
                      link.address, victim.tenant)  # fmt: skip
            return True
        return False

    def handed_over(self, conn_id: int, slot: int) -> Delivery | None:
        """A slot server acted on this agent's reclaim of ``slot`` (its HANDOVER immediate)."""
        link = self.link_set.by_conn.get(conn_id)
        index = None if link is None else self._reclaims.pop((id(link), slot), None)
        flight = None if index is None else self.book.inflight.get(index)
        if index is None or flight is None or not flight.reclaim:
            self.book.unknown()
            return None
        return self.settle(index, flight)

    def settle(self, index: int, flight: InFlight) -> Delivery | None:
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
                swapped = link.conn.compare_and_swap(link.states, 8 * slot, found, word)
                link.stats.cas_attempts += 1
                found = word if swapped == found else swapped
                link.words_ptr[slot] = found
        except TransportError as exc:
            self.link_set.failed(link, exc)  # lost with the link (answered 503), or freed when abandoned
            return None
        if found == word:
            link.stats.handovers += 1
            if flight.abandoned or flight.cancelled:
                self.claims.unclaim(link, slot, word)
            elif not self.keeps(index, self.standing(index), link, [(slot, gen)]):  # another edge's claims came first
                return self.book.final(index, 0, gen)
            else:  # handed over long after its decision: what was matched then is not known here
                self.claims.resend(index, flight, (link, Choice(0, 0, flight.prediction), slot, gen), flight.prompt,
                                   NO_CHAIN)  # fmt: skip
                return None
        else:
            again: Status | None = Status.NO_SLOT
            if not (flight.abandoned or flight.cancelled) and flight.reclaim_tries < RECLAIM_TRIES:
                again = self._again(index, flight)
            if again is None:
                return None
            if again == Status.NO_SLOT:
                self.frames.result_headers[index].no_slot(self.claims.frees_in([link]))
        if flight.cancelled and not flight.abandoned:
            self.frames.result_headers[index].refuse(Status.CANCELLED)
        return self.book.final(index, 0, gen)

    def _again(self, index: int, flight: InFlight) -> Status | None:
        """A reclaim that did not get its slot: claim a free one, or take another back while the tenant is still
        under its floor.  None: the request is in flight again; else its refusal -- NO_SLOT, or SLOT_CAP (written
        in its result header: :meth:`keeps`)."""
        words = wire.input_words(flight.prompt, self.frames.request_headers[index].flags)
        fits = [link for link in self.link_set.links if link.up and words <= link.input_capacity]
        if not fits:
            return Status.NO_SLOT
        standing = self.standing(index)
        choices = self.claims.unbounded(index, flight.prompt, fits)
        claimed = self.claims.first_one(choices, fits, standing.tenant)
        if claimed is not None:
            link, _, slot, gen = claimed
            if not self.keeps(index, standing, link, [(slot, gen)]):
                return Status.SLOT_CAP
            self.claims.resend(index, flight, claimed, flight.prompt)
            return None
        if standing.under_floor and self.take_back(index, flight.prompt, fits, choices, standing, flight.reclaim_tries):
            return None
        return Status.NO_SLOT

    def overdue(self) -> list[int]:
        """Reclaims no slot server answered within a hang timeout: settled on what their slot's word says now;
        those it answers are returned (the caller reports them as lost: answered 503)."""
        now = self.link_set.clock()
        overdue = [(i, f) for i, f in self.book.inflight.items() if f.reclaim and now >= f.reclaim_due]
        answered = []
        for index, flight in overdue:
            self._reclaims.pop((id(flight.link), flight.slot), None)
            flight.reclaim_tries = RECLAIM_TRIES  # a server that does not answer is not asked again
            if self.settle(index, flight) is not None:
                answered.append(index)
        return answered

    def forget(self, link: ServerLink) -> None:
        """``link`` went down: the reclaims asked of it are answered with it (lost, or moved)."""
        for key in [key for key in self._reclaims if key[0] == id(link)]:
            del self._reclaims[key]
