"""Which slot server a request is claimed on, or none: the admission policy, sans I/O.

A free slot is not a fast slot: prompts admitted together share the model's steps, and each waits for the
others.  So the policy predicts, for every candidate server, this request's **time to first token** from
what the agent last read of it -- its load region (:class:`~edgepath.contract.plan.Load`: the step costs
and the policy's knobs its model side uses, the streams decoding, the prompts in prefill) and its prefix
table (what of this prompt it would not compute) -- all of it in the READ that also carries the heartbeat and
the state words: no extra round trip, no queue.  The prediction runs the model side's own step policy
forward (:func:`~edgepath.contract.plan.predict`): one code plans the steps and predicts them.

The bound is on **waiting, not on work**: a request's wait is its predicted time to first token minus what
its own uncached prompt takes on an idle server.  A server is a candidate when its predicted wait is within
the request's bound; candidates are tried those with a free slot (as last seen) first, lowest predicted
time to first token first (a server that holds the prompt's prefix computes less, so affinity falls out of
the cost), then the longest prefix held, then the most free slots; the others last (the agent's claim
reads their state words again).  When every server's wait is over the bound, the request is refused at
once (429) with the least predicted wait, from which the edge says when to come back.  A server that
publishes no load (a handler without a model, such as echo) is predicted to answer at once.  Slots claimed
but not yet seen by the model side (CLAIMED or READY in the cached state words) are counted ahead of it: those
this agent claimed as the prompts it wrote there, another claimant's as long as this one (their lengths are not
in what the agent reads); a prefix this request shares with one of this agent's claims there counts as held (the
server copies it once computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgepath.contract import wire
from edgepath.contract.plan import Load, Prediction, Prompt, predict


class Server(Protocol):
    """What the policy reads of one candidate (a :class:`~edgepath.dpu.links.ServerLink` is one)."""

    @property
    def free_hint(self) -> int: ...

    @property
    def prefixes(self) -> np.ndarray: ...

    @property
    def load(self) -> Load: ...

    def under_way_ms(self, now: float) -> float | None:
        """How long the step the server planned first from :attr:`load` has been running at ``now`` (None: not
        known)."""
        ...

    @property
    def unseen(self) -> list[Claimed | None]:
        """Slots claimed whose request the model side has not taken yet (CLAIMED or READY), in the order it will
        take them: what this agent wrote into each it claimed, None for another claimant's (not known here)."""
        ...


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claim of this agent's that the model side has not taken yet: the prompt written there (what of it the
    server holds, what it computes) and the chain hashes of its whole blocks -- a request that shares a prefix
    with it will copy that prefix once computed (docs/MODEL.md, "KV layout and the prefix cache")."""

    prompt: Prompt
    chain: np.ndarray


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
    (``over_bound_ms``: every one is over the bound; None when no server was given) and what the request's own
    prompt costs that server (``over_bound_work_ms``: what a retry there brings it)."""

    choices: list[Choice]
    over_bound_ms: float | None = None
    over_bound_work_ms: float = 0.0


class Admission:
    """The claim decision for requests of at most ``input_capacity`` tokens."""

    def __init__(self, input_capacity: int) -> None:
        self._chain = wire.PrefixChain(input_capacity)

    @property
    def chain(self) -> np.ndarray:
        """The last decided request's chain hashes (a copy; empty when none were computed): what the agent keeps
        with the claim it makes for it."""
        return self._chain.hashes[: self._chain.blocks].copy()

    def decide(
        self, tokens: np.ndarray, servers: Sequence[Server], bound_ms: float, salt: int = 0, now: float | None = None
    ) -> Decision:
        """Where a request of ``tokens`` may be claimed, best first, if its wait is to stay within
        ``bound_ms``; only prefixes published under its ``salt`` (its ``cache_salt``) count as held.  ``now``
        (the servers' clock): when given, each server's step under way counts for what is left of it."""
        chain = self._chain
        chain.blocks = 0
        if len(tokens) >= wire.PREFIX_BLOCK and any(len(server.prefixes) for server in servers):
            chain.compute(tokens, salt)
        count = len(tokens)
        free = [server.free_hint for server in servers]
        ranked = []
        over: float | None = None
        work = 0.0
        mine = chain.hashes[: chain.blocks]
        for i, server in enumerate(servers):
            matched = chain.matched(server.prefixes)
            ahead = []
            for claim in server.unseen:
                if claim is None:
                    ahead.append(Prompt(0, count))
                    continue
                ahead.append(claim.prompt)
                if len(server.prefixes):  # a server that reuses prefixes copies this one from the claim ahead
                    matched = max(matched, _leading(mine, claim.chain))
            cached = cached_tokens(count, matched)
            under_way = None if now is None else server.under_way_ms(now)
            prediction = predict(server.load, Prompt(cached, count - cached), ahead, under_way)
            if prediction.wait_ms > bound_ms:
                if over is None or prediction.wait_ms < over:
                    over, work = prediction.wait_ms, prediction.ttft_ms - prediction.wait_ms
                continue
            ranked.append((not free[i], prediction.ttft_ms, -matched, -free[i], i, Choice(i, matched, prediction)))
        ranked.sort()
        choices = [entry[-1] for entry in ranked]
        return Decision(choices) if choices or over is None else Decision([], over, work)


def _leading(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading chain hashes ``a`` and ``b`` share (a block's hash covers every block before it)."""
    n = min(len(a), len(b))
    if not n:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def cached_tokens(count: int, matched: int) -> int:
    """Of a prompt of ``count`` tokens whose first ``matched`` prefix blocks a server holds, what it will not
    compute (the last token is always computed)."""
    return min(count - 1, matched * wire.PREFIX_BLOCK)
