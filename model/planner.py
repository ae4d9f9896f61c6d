"""What the llama handler's next step carries, and the load the agents replay it from -- both by the one step
policy both sides run (:class:`~edgepath.contract.plan.StepPolicy`).

Every decoding slot has one token a step (but in a floor's first-token step); prompts get what the policy plans
(decode steps stay short; prompts go in few large steps within a stall bound; a whole prompt at once when nothing
decodes), in prefill order: those within their tenant's slot floor first, then oldest first.  While a floor this
server has seen asked for is lent out, other tenants' prompts add at most ``lent_ms`` to a step
(docs/TENANTS.md).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from edgepath.contract.plan import (
    FloorMemory,
    Load,
    PolicyOptions,
    Prompt,
    StepPolicy,
    decodes,
    floor_lent,
    prefill_order,
)
from edgepath.model.cost import CostModel
from edgepath.model.llama_options import LlamaOptions
from edgepath.model.prefix import common_prefix, runs
from edgepath.model.sequences import Sequence, Sequences
from edgepath.slots.handlers import SlotRequest

log = logging.getLogger("edgepath.model.llama")

#: a step's parts: (sequence, first position, tokens), in sequence-id order
Parts = list[tuple[Sequence, int, int]]


class StepPlanner:
    """Plans steps over ``sequences`` with ``cost``'s costs and a step of at most ``batch`` tokens, on a server of
    ``slots`` slots (all taken: a full house, objective 9); token ids outside ``n_vocab`` are refused."""

    def __init__(
        self, options: LlamaOptions, batch: int, cost: CostModel, sequences: Sequences, n_vocab: int, slots: int
    ) -> None:
        stall = float(np.float32(options.stall_ms))  # as published: the agents replay the plan with it
        self.policy = StepPolicy(PolicyOptions(stall, options.min_prefill, batch))
        self.lent_ms = float(np.float32(options.lent_ms))  # as published, as the stall
        self.prefix_cache, self.cache_min = options.prefix_cache, options.cache_min
        self.cost = cost
        self.sequences = sequences
        self.n_vocab = n_vocab
        self.slots = slots
        #: floors learned from the requests that name them (a floor lent out keeps steps short: objective 8)
        self.floors: FloorMemory[int] = FloorMemory()

    def learn(self, request: SlotRequest) -> None:
        """A request's tenant floor, learned when it arrives (nothing is lent without a request)."""
        if request.tenant and request.floor:
            self.floors.learn(request.tenant, request.floor, time.monotonic())

    def plan(self) -> tuple[Parts, list[Sequence]]:
        """This step's parts, in sequence-id order (llama.cpp cuts a step into micro-batches of consecutive
        sequence ids), and the sequences whose planned prompt tokens are outside the vocabulary (to be answered
        BAD_REQUEST).  A request is placed on its sequence here, when its first prompt tokens are planned."""
        decoding: list[Sequence] = []
        waiting: list[Sequence] = []
        order, within = self.in_prefill_order()
        floor_ones = set(map(id, order[:within]))
        for seq in order:
            (decoding if seq.decoding else waiting).append(seq)
        longest = max((seq.prompt_len + seq.count - 1 for seq in decoding), default=0)
        costs, lent = self.cost.costs(), self.lent()
        full = len(self.sequences.running) >= self.slots  # every slot taken: objective 9
        while True:
            prompts = [Prompt(seq.prefilled, seq.prompt_len - seq.prefilled) for seq in waiting]
            floors = sum(id(seq) in floor_ones for seq in waiting)  # the first ones: the order keeps them first
            streams = runs(s.stream for s in decoding)
            takes = self.policy.plan(costs, len(decoding), longest, prompts, streams, floors, lent, full)
            # A request takes its sequence (and what it can reuse) when its first prompt tokens are planned,
            # not on arrival: requests that arrive together with a shared prefix then copy it from the one
            # that computed it first.  Placing one can shorten its prompt: plan again.
            new = next((s for s, take in zip(waiting, takes, strict=True) if take and s.stream < 0), None)
            if new is None:
                break
            if self._shares_pending(new, waiting):
                waiting.remove(new)  # not this step: an older prompt is still computing the prefix it shares
                continue
            self.sequences.place(new)
        parts: Parts = []  # a floor's first token: the streams decoding decode in the next step (objective 7)
        if decodes(prompts, takes, floors):
            parts = [(seq, seq.prompt_len + seq.count - 1, 1) for seq in decoding]
        bad = []
        for seq, take in zip(waiting, takes, strict=True):
            if take == 0:
                continue
            chunk = seq.request.tokens[seq.prefilled : seq.prefilled + take]
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= self.n_vocab:
                log.warning(
                    "slot %d: token id %d is outside the vocabulary [0, %d)",
                    seq.request.slot,
                    low if low < 0 else high,
                    self.n_vocab,
                )
                bad.append(seq)
                continue
            parts.append((seq, seq.prefilled, take))
        parts.sort(key=lambda part: part[0].stream)
        return parts, bad

    def in_prefill_order(self) -> tuple[list[Sequence], int]:
        """The running sequences in the order their prompts are served (:func:`prefill_order`: those within their
        tenant's slot floor first, then oldest first), and how many are within a floor."""
        running = list(self.sequences.running.values())
        order, within = prefill_order([(s.request.tenant, s.request.floor) for s in running])
        return [running[i] for i in order], within

    def lent(self) -> float:
        """The policy's ``lent_ms`` now: the option while a floor this server has seen asked for is lent out
        (:func:`floor_lent`), else 0."""
        if not self.floors:
            return 0.0
        running = [(s.request.tenant, s.request.floor) for s in self.sequences.running.values()]
        return self.lent_ms if floor_lent(running, self.floors.table()) else 0.0

    def _shares_pending(self, new: Sequence, waiting: list[Sequence]) -> bool:
        """Whether a waiting prompt served before ``new`` (:meth:`in_prefill_order`) will compute, but has not yet
        computed, a prefix of ``new``'s prompt worth reusing: ``new`` then waits, and copies it once computed instead
        of computing it again."""
        if not self.prefix_cache:
            return False
        for older in waiting:
            if older is new:
                return False
            if older.request.salt not in new.request.readable:  # a cache namespace it may not read: never shared
                continue
            shared = common_prefix(older.request.tokens, new.request.tokens)
            if shared - older.prefilled >= self.cache_min:
                return True
        return False

    def load(self) -> Load:
        """What the step policy will plan from, as the agents replay it: the costs it plans with, its knobs, the
        streams decoding and the positions they hold, the prompts in prefill in the order they are served (those
        within their tenant's floor, then oldest first; a request not placed yet as what it would reuse if placed
        now: a free stream's or a host copy's prefix, or one it shares with a prompt before it of its cache
        namespace)."""
        decoding: list[int] = []
        longest = floors = 0
        waiting = []
        ahead: list[Sequence] = []
        book = self.sequences.book
        order, within = self.in_prefill_order()
        for index, seq in enumerate(order):
            if seq.prefilled < seq.prompt_len:
                floors += index < within
            if seq.stream < 0 and self.prefix_cache:
                readable = seq.request.readable
                older = (s.request.tokens for s in ahead if s.request.salt in readable)
                reuse = book.reusable(seq.request.tokens, older, seq.request.salt, readable)
                waiting.append(Prompt(reuse, seq.prompt_len - reuse))
            elif seq.prefilled < seq.prompt_len:
                waiting.append(Prompt(seq.prefilled, seq.prompt_len - seq.prefilled))
            else:
                decoding.append(seq.stream)
                longest = max(longest, seq.prompt_len + seq.count - 1)
            ahead.append(seq)
        self.cost.forget(time.monotonic())
        options, lent = self.policy.options, self.lent()
        waits = tuple(waiting)
        return Load(self.cost.costs(), options, len(decoding), longest, waits, runs(decoding), floors, lent, self.slots)
