"""Submission: where a request is claimed, or why it is refused at once -- no queue.

A request (one frame, or the n frames of one request's choices) is checked, placed by admission (which slot
server gives its first token soonest, within its bound on waiting: :class:`~edgepath.dpu.admission.Admission`),
claimed (:class:`~edgepath.dpu.claims.Claims`: one CAS per slot, n slots of one server all or none) and sent --
or refused now: NO_SLOT, OVER_BOUND, SLOT_CAP (its tenant holds its cap of slots, counted from the state words
across every edge), UNAVAILABLE, BAD_REQUEST.  A request of a tenant under its slot floor is never
refused for its wait, and when no slot is free it takes one back (:class:`~edgepath.dpu.floor_book.FloorBook`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from edgepath.contract import wire
from edgepath.dpu.admission import Choice, Decision, cached_tokens
from edgepath.dpu.claims import ONLY, Claims, InFlight
from edgepath.dpu.floor_book import FloorBook, Standing
from edgepath.dpu.links import ServerLink
from edgepath.dpu.port import SlotLimits
from edgepath.native.abi import Status
from edgepath.transports.base import TransportError

log = logging.getLogger("edgepath.agent")


class Submission:
    """Decides and claims one agent's requests (``max_wait_ms``: the agent's bound on a predicted wait)."""

    def __init__(self, claims: Claims, floors: FloorBook, max_wait_ms: float) -> None:
        self.claims = claims
        self.floors = floors
        self.max_wait_ms = max_wait_ms
        self.link_set = claims.link_set
        self.frames = claims.frames
        self.book = claims.book

    def check_frame(self, index: int) -> str | None:
        """Why frame ``index`` cannot be sent (None if it can)."""
        if not 0 <= index < self.frames.count:
            return f"frame index {index} outside 0..{self.frames.count - 1}"
        if index in self.book.inflight:
            return f"frame {index} is already in flight"
        req = self.frames.request_headers[index]
        layout = self.claims.layout
        return wire.request_problem(
            wire.input_words(req.token_count, req.flags),
            req.max_new_tokens,
            layout.input_capacity,
            layout.output_capacity,
        )

    def early_refusal(self, index: int, tenant: int, floor: int, slots: int = 1) -> Status | None:
        """Before frame ``index``'s prompt costs anything: NO_SLOT (its retry time in the frame's result header) when
        no UP slot server has ``slots`` free slots in the state words read now -- not as cached -- and the request's
        tenant (floor id ``tenant``, its ``floor``) is not under its floor, so the claim :meth:`submit` would make
        after the prompt is templated and tokenized could only fail.  None: go on (:meth:`submit` decides).  A
        flood that never backs off is refused for the price of a READ, not a tokenization (docs/TENANTS.md)."""
        ups = [link for link in self.link_set.links if link.up]
        if not ups:
            return None  # submit probes the others and answers UNAVAILABLE
        if any(link.free_hint >= slots for link in ups):
            return None
        for link in ups:
            self.link_set.probe(link)  # the cache saw none free: the words as they are now
        ups = [link for link in ups if link.up]
        if not ups or any(link.free_hint >= slots for link in ups):
            return None
        standing = self.floors.named(tenant, SlotLimits(floor))
        if slots == 1 and standing.takes_back:
            return None  # it takes a slot back (a group never does)
        self.frames.result_headers[index].no_slot(self._retry_in(ups, standing))
        return Status.NO_SLOT

    def submit(self, index: int) -> Status | None:
        """Send frame ``index``. None: in flight (its result arrives through the port); otherwise the immediate
        outcome: NO_SLOT, OVER_BOUND, SLOT_CAP, UNAVAILABLE (no live server) or BAD_REQUEST."""
        if self.check_frame(index) is not None:
            return Status.BAD_REQUEST
        return self._submit([index])

    def submit_group(self, indexes: Sequence[int]) -> Status | None:
        """Send frames ``indexes`` -- one request's choices: the same prompt, their own seeds -- to as many slots of
        **one** slot server, claimed all or none (each claim one CAS; when one fails, those taken are given back
        and the answer is NO_SLOT at once).  One server, so its prefix cache computes the shared prompt once: the
        first to be placed prefills it, the others copy its KV (docs/ARCHITECTURE.md).  None: all in flight;
        otherwise the refusal (its figures in the first frame's result header), and none is."""
        n = len(indexes)
        if n == 0 or len(set(indexes)) != n or any(self.check_frame(index) is not None for index in indexes):
            return Status.BAD_REQUEST
        return self._submit(indexes)

    def _submit(self, indexes: Sequence[int]) -> Status | None:
        """The one way requests are sent: frames ``indexes`` (checked; the first's header and prompt are every
        one's) placed, claimed on one server all or none, and written there -- or the refusal.  One frame of a
        tenant under its floor that finds no free slot takes one back instead of being refused."""
        n, first = len(indexes), indexes[0]
        req = self.frames.request_headers[first]
        count, words = req.token_count, wire.input_words(req.token_count, req.flags)
        fits = self._fits(words, n)
        if isinstance(fits, Status):
            return fits
        standing = self.floors.standing(first)
        if standing.cap and self.floors.refuse_cap(first, standing, n):
            return Status.SLOT_CAP  # its figures are in the first frame's result header
        owner = n == 1 and standing.takes_back
        choices = self._choose(first, count, fits, owner)
        if choices == Status.OVER_BOUND and n == 1 and standing.floor and not owner:
            standing = self.floors.standing(first)  # on the words the refusal re-read: under its floor, not refused
            owner = standing.takes_back
            if owner:
                choices = self._choose(first, count, fits, owner)
        if isinstance(choices, Status):
            return choices  # its figures are in the first frame's result header
        got = self.claims.first(choices, fits, standing.tenant, n)
        if got is None:
            if owner:  # counted again on the words the failed claims re-read: still under its floor, it takes one back
                standing = self.floors.standing(first)
                if standing.takes_back and self.floors.take_back(first, count, fits, choices, standing):
                    return None  # in flight: sent once its slot is handed over
            if not any(link.up for link in self.link_set.links):
                return Status.UNAVAILABLE
            self.frames.result_headers[first].no_slot(self._retry_in(fits, standing))
            return Status.NO_SLOT
        link, choice, claimed = got
        if not self.floors.keeps(first, standing, link, claimed):
            return Status.SLOT_CAP  # counted with its claims on the words read now: over its cap, they went back
        if choice.matched:
            link.stats.affine += 1
        if log.isEnabledFor(logging.DEBUG):
            self._log_admission(first, link, claimed[0][0], count, choice)
        return self._send_all(link, indexes, claimed, count, choice)

    def _retry_in(self, links: list[ServerLink], standing: Standing) -> float:
        """A NO_SLOT's retry time (ms): when a slot of ``links`` is predicted to free, or -- for a tenant under its
        floor that took slots back as often as a floor may -- when it may take one back again, whichever is sooner
        (0: no estimate)."""
        frees, again = self.claims.frees_in(links), self.floors.take_back_in(standing)
        return min(frees, again) if frees and again else frees or again

    def _fits(self, words: int, n: int) -> list[ServerLink] | Status:
        """The UP slot servers with room for a prompt of ``words`` and ``n`` slots (one pass in the common case), or
        UNAVAILABLE (none is up, even after looking again at those that were not) or BAD_REQUEST (none has room)."""
        links = self.link_set.links
        fits = [link for link in links if link.up and words <= link.input_capacity and n <= link.slot_count]
        if len(fits) < len(links):
            if not all(link.up for link in links):
                self.link_set.probe_stale()  # an unresponsive server may have come back
                fits = [link for link in links if link.up and words <= link.input_capacity and n <= link.slot_count]
            if not any(link.up for link in links):
                return Status.UNAVAILABLE
            if not fits:
                return Status.BAD_REQUEST
        return fits

    def _send_all(
        self, link: ServerLink, indexes: Sequence[int], claimed: list[tuple[int, int]], count: int, choice: Choice
    ) -> Status | None:
        """Write each of ``indexes`` into its claimed slot of ``link`` and ring it.  A write that fails takes the link
        down: the first -- nothing sent yet -- is UNAVAILABLE at once (the caller still owns every frame, and answers
        and releases them); a later one leaves the rest booked on the link, so each is answered (or moved) as any
        request in flight on a lost link is: the group stays whole."""
        for k, (index, (slot, gen)) in enumerate(zip(indexes, claimed, strict=True)):
            try:
                self.claims.send(link, index, slot, gen, count, choice)
            except TransportError as exc:
                if k == 0:
                    self.book.unsent(index)
                    link.inflight -= 1
                    self.link_set.failed(link, exc)
                    return Status.UNAVAILABLE
                max_new = self.frames.request_headers[index].max_new_tokens
                for later, (slot_, gen_) in zip(indexes[k + 1 :], claimed[k + 1 :], strict=True):
                    self.book.sent(
                        later, InFlight(link=link, slot=slot_, generation=gen_, prompt=count, max_new=max_new)
                    )
                    link.inflight += 1
                self.link_set.failed(link, exc)
                break
        return None

    def _choose(self, index: int, count: int, fits: list[ServerLink], owner: bool = False) -> list[Choice] | Status:
        """Where frame ``index`` may be claimed, best first, or OVER_BOUND (its result header then says why).  A
        request of a tenant under its floor (``owner``) is never refused for its wait: its floor is a slot."""
        if owner:
            return self.claims.unbounded(index, count, fits)
        if len(fits) == 1 and not fits[0].load.published:
            return [ONLY]  # one server, and it publishes no load: nothing to predict or order
        decision = self._decide(index, count, fits)
        if not decision.choices and decision.over_bound_ms is not None and self._reread(fits):
            # A refusal rests on a view a heartbeat old at most: decide again on what was just read.
            fits[:] = [link for link in fits if link.up]
            decision = self._decide(index, count, fits) if fits else Decision([])
        if not decision.choices and decision.over_bound_ms is not None:
            wait, bound = decision.over_bound_ms, self._bound(index)
            retry = self.claims.retry_advice.advise(self.link_set.clock(), wait - bound, decision.over_bound_work_ms)
            self.frames.result_headers[index].over_bound(wait, bound, retry)
            return Status.OVER_BOUND
        return decision.choices

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
        return self.claims.admission.decide(tokens, fits, self._bound(index), salt, self.link_set.clock())

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
