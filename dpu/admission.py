"""Which slot server a request is claimed on, or none: the admission policy, sans I/O.

A free slot is not a fast slot: prompts admitted together share the model's steps, and each waits for the
others.  So the policy predicts, for every candidate server, this request's **time to first token** from
what the agent last read of it -- the load and pace words in its pool header (:class:`~edgepath.contract.wire.Load`:
prompt tokens admitted and not yet computed, streams decoding, the step cost model and stall bound its
model side learned) and its prefix table (what of this prompt it would not compute) -- all of it in the READ
that also carries the heartbeat and the state words: no extra round trip, no queue.

The bound is on **waiting, not on work**: a request's wait is its predicted time to first token minus what
its own uncached prompt takes on an idle server.  A server is a candidate when its predicted wait is within
the request's bound; candidates are tried those with a free slot (as last seen) first, lowest predicted
time to first token first (a server that holds the prompt's prefix computes less, so affinity falls out of
the cost), then the longest prefix held, then the most free slots; the others last (the agent's claim
reads their state words again).  When every server's wait is over the bound, the request is refused at
once (429) with the least predicted wait, from which the edge says when to come back.  A server that
publishes no load (a handler without a model, such as echo) is predicted to answer at once.

The prediction follows the step policy of the model side (``edgepath.model.schedule``): while streams
decode, each step carries one token per stream and prompt tokens up to the stall bound (at least
``MIN_PREFILL``), oldest prompts first; with nothing decoding, the prompts ahead go in one step, and then
decode.  Slots claimed but not yet seen by the model side (CLAIMED or READY in the cached state words) are
counted as prompts as long as this one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgepath.contract import wire

#: prompt tokens a step carries at least while a prompt waits (the llama handler's ``min_prefill`` default)
MIN_PREFILL = 16


class Server(Protocol):
    """What the policy reads of one candidate (a :class:`~edgepath.dpu.links.ServerLink` is one)."""

    @property
    def free_hint(self) -> int: ...

    @property
    def prefixes(self) -> np.ndarray: ...

    @property
    def load(self) -> wire.Load: ...

    @property
    def unseen(self) -> int:
        """Slots claimed whose request the model side has not taken yet (CLAIMED or READY)."""
        ...


@dataclass(frozen=True, slots=True)
class Prediction:
    """A request's predicted time to first token on one server, and the wait in it (milliseconds)."""

    ttft_ms: float
    wait_ms: float


@dataclass(frozen=True, slots=True)
class Choice:
    """One candidate in claim order: its index among the servers given, the prefix blocks of the request it
    holds, and the prediction there."""

    server: int
    matched: int
    prediction: Prediction


@dataclass(frozen=True, slots=True)
class Decision:
    """The candidates to try, in order; when there are none, the least predicted wait among the servers
    (``over_bound_ms``: every one is over the bound; None when no server was given)."""

    choices: list[Choice]
    over_bound_ms: float | None = None


def predict(load: wire.Load, uncached: int, unseen: int = 0, tokens: int = 0) -> Prediction:
    """The time to first token of a prompt of ``uncached`` tokens to compute, arriving at a server under
    ``load`` with ``unseen`` more requests claimed there (each counted as ``tokens`` prompt tokens)."""
    if not load.published:
        return Prediction(0.0, 0.0)
    own = load.prefill_ms(uncached)
    pending = load.pending_tokens + unseen * tokens
    ahead = load.prefilling + unseen
    decoding = load.decoding
    if decoding == 0 and pending == 0:
        return Prediction(own, 0.0)

    def step(n: int) -> float:
        return load.overhead_ms + load.token_ms * n

    if decoding == 0:
        elapsed = step(pending)  # nobody decodes: the prompts ahead go in one step ...
        decoding, pending = ahead, 0  # ... and decode from then on
    else:
        decoding += ahead  # the prompts ahead decode too before this one is done
        elapsed = 0.5 * step(decoding)  # the step under way, half done on average
    budget = max(MIN_PREFILL, math.floor((load.stall_ms - load.overhead_ms) / load.token_ms) - decoding)
    work = pending + max(uncached, 1)
    full = (work - 1) // budget
    elapsed += full * step(decoding + budget) + step(decoding + work - full * budget)
    return Prediction(elapsed, max(0.0, elapsed - own))


class Admission:
    """The claim decision for requests of at most ``input_capacity`` tokens."""

    def __init__(self, input_capacity: int) -> None:
        self._chain = wire.PrefixChain(input_capacity)

    def decide(self, tokens: np.ndarray, servers: Sequence[Server], bound_ms: float) -> Decision:
        """Where a request of ``tokens`` may be claimed, best first, if its wait is to stay within
        ``bound_ms``."""
        chain = self._chain
        chain.blocks = 0
        if len(tokens) >= wire.PREFIX_BLOCK and any(len(server.prefixes) for server in servers):
            chain.compute(tokens)
        count = len(tokens)
        free = [server.free_hint for server in servers]
        ranked = []
        over: float | None = None
        for i, server in enumerate(servers):
            matched = chain.matched(server.prefixes)
            uncached = count - min(count - 1, matched * wire.PREFIX_BLOCK)  # the last token is always computed
            prediction = predict(server.load, uncached, server.unseen, count)
            if prediction.wait_ms > bound_ms:
                over = prediction.wait_ms if over is None else min(over, prediction.wait_ms)
                continue
            ranked.append((not free[i], prediction.ttft_ms, -matched, -free[i], i, Choice(i, matched, prediction)))
        ranked.sort()
        choices = [entry[-1] for entry in ranked]
        return Decision(choices, over if not choices else None)
