"""Migration: a request in flight moves to another slot and goes on as one stream.

When its slot server goes away (down, or unresponsive while another is up) or its slot is taken back for a tenant
under its floor, a request is claimed again elsewhere: its prompt followed by the answer so far as the new prompt,
what is left of its output to produce, the same sampling and seed; the new server places its output after the
answer so far in the same reply entry, so the caller sees one stream (docs/DATAPATH.md).
"""

from __future__ import annotations

import logging

from edgepath.contract import wire
from edgepath.dpu.claims import Claims, InFlight

log = logging.getLogger("edgepath.agent")

#: how often one request may move to another slot server when its own goes away (``--migration-limit``): a
#: second move covers a failover during a failover; a request that outlives more servers than that is unlucky
#: in a way a retry by the client handles as well
DEFAULT_MIGRATION_LIMIT = 2


class Mover:
    """Moves one agent's requests (at most ``limit`` times each; 0: never)."""

    def __init__(self, claims: Claims, limit: int = DEFAULT_MIGRATION_LIMIT) -> None:
        self.claims = claims
        self.limit = limit

    def move(self, index: int, flight: InFlight, stay: bool = False) -> bool:
        """Claim frame ``index`` again on another UP slot server and send it there.  False when it cannot move
        (limit reached, nothing left to produce, too long for every server, no slot free): it is then lost like the
        others.  ``stay``: its own server may take it too (a reclaimed stream: the server is up, only the slot was
        taken back); such a move only takes a FREE slot, never reclaims."""
        claims, frames = self.claims, self.claims.frames
        gone = flight.link
        produced = flight.count
        prompt = flight.prompt + produced
        remaining = flight.max_new - produced
        flags = frames.request_headers[index].flags
        why = ""
        if flight.moves >= self.limit:
            why = f"it moved {flight.moves} times already (the limit)"
        elif remaining <= 0:
            why = "its answer is complete but for the final word"
        elif wire.logprobs_top(flags) is not None:
            why = "its output holds log-probability records, which a prompt cannot carry"
        elif wire.constraint_words(flags):
            why = "words follow its prompt (a grammar, logit biases), which the answer so far would overwrite"
        candidates = [
            link
            for link in claims.link_set.links
            if link.up and (stay or link is not gone) and prompt <= link.input_capacity
        ]
        if not why and (prompt > claims.layout.input_capacity or not candidates):
            why = f"no other slot server is up with room for a prompt of {prompt} tokens"
        if not why:
            frames.tokens[index, flight.prompt : prompt] = frames.outputs[index, :produced]
            frames.request_headers[index].migrate(prompt, remaining, produced, flight.moves + 1)
            choices = claims.unbounded(index, prompt, candidates)
            claimed = claims.first_one(choices, candidates, frames.request_headers[index].tenant)
            why = "no other slot server had a free slot" if not stay else "no slot was free"
            if claimed is not None:
                flight.moves += 1
                if claims.resend(index, flight, claimed, prompt, lost_with=gone):
                    claims.book.stats.migrated += 1
                    log.info(
                        "frame %d moved from %s to %s with %d tokens of its answer (%d to go)",
                        index,
                        gone.address,
                        claimed[0].address,
                        produced,
                        remaining,
                    )
                    return True
        # a reclaimed stream that finds no free slot ends RECLAIMED, as floors mean it to: not a fault
        (log.info if stay else log.warning)("frame %d cannot move from %s: %s", index, gone.address, why)
        return False
