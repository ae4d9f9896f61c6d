"""``n`` choices of one OpenAI request, sans I/O: n member requests in, one answer out.

The lifecycle runs each choice as a request of its own -- its own frame, slot, seed and formatter, answering
under an internal key -- claimed together on one slot server (the agent's ``submit_group``: all or none).  A
:class:`ChoiceGroup` turns what the members answer into the one answer the client gets: a stream opens once,
carries every choice's chunks (each with its ``index``) as they come and closes after the last choice's finish
chunk with one usage chunk and ``[DONE]``; whole answers are merged into one body whose ``choices`` are in index
order.  ``usage`` counts the prompt once, the completion tokens of every choice, and as cached the fewest any
choice reused (the prompt tokens no slot computed for this request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import orjson

from edgepath.contract.wire import Sampling
from edgepath.edge.actions import Answer, EndStream, Respond, SendChunk, StartStream
from edgepath.edge.http import Headers, Response
from edgepath.edge.openai import Usage

#: seeds are carried as unsigned 64-bit words (contract/wire.py's ``Sampling``)
_SEED_MASK = (1 << 64) - 1


def choice_sampling(sampling: Sampling, index: int) -> Sampling:
    """Choice ``index``'s sampling: the request's, seeded ``seed + index`` -- so choices differ at temperature > 0,
    and a request that gives a seed gets the same n answers again."""
    return replace(sampling, seed=(sampling.seed + index) & _SEED_MASK)


class Choice(Protocol):
    """What the group needs of a choice's formatter once it has ended."""

    def usage(self) -> Usage:
        """This choice's token counts (its prompt, its completion, what it reused)."""
        ...

    def closing(self, usage: Usage) -> bytes:
        """The end of the whole stream: the usage chunk (when the client asked for it) and ``[DONE]``."""
        ...


def merged_usage(usages: Sequence[Usage]) -> Usage:
    """The request's usage over its choices: the prompt once, every choice's completion tokens, and the fewest
    cached tokens any choice had (unknown if any is)."""
    cached = [u.cached_tokens for u in usages]
    return Usage(
        usages[0].prompt_tokens,
        sum(u.completion_tokens for u in usages),
        None if any(c is None for c in cached) else min(c for c in cached if c is not None),
    )


@dataclass(eq=False)
class ChoiceGroup:
    """The n choices of one request (``rid``: the client's key), answered as one."""

    rid: int
    members: list[int]  # the members' internal keys, choice 0 first
    stream: bool
    started: bool = False
    ended: set[int] = field(default_factory=set)
    usages: dict[int, Usage] = field(default_factory=dict)
    bodies: dict[int, Response] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.members)

    def index(self, member: int) -> int:
        return self.members.index(member)

    def start(self, status: int, headers: Headers) -> list[Answer]:
        """A choice's stream opened: the client's opens with the first."""
        if self.started:
            return []
        self.started = True
        return [StartStream(self.rid, status, headers)]

    def chunk(self, data: bytes) -> list[Answer]:
        return [SendChunk(self.rid, data)] if data else []

    def end(self, member: int, data: bytes, choice: Choice) -> list[Answer]:
        """Choice ``member``'s stream ended with ``data`` (its finish chunk): the client's ends after the last."""
        self._ended(member, choice)
        if len(self.ended) < self.n:
            return self.chunk(data)
        return [EndStream(self.rid, data + choice.closing(self.usage()))]

    def whole(self, member: int, response: Response, choice: Choice) -> list[Answer]:
        """Choice ``member``'s whole answer (a ``200`` body with its one choice): the merged body after the last."""
        self._ended(member, choice)
        self.bodies[self.index(member)] = response
        if len(self.ended) < self.n:
            return []
        first = self.bodies[0]
        body = orjson.loads(first.body)
        body["choices"] = [orjson.loads(self.bodies[i].body)["choices"][0] for i in range(self.n)]
        body["usage"] = self.usage().payload()
        return [Respond(self.rid, Response(first.status, first.headers, orjson.dumps(body)))]

    def usage(self) -> Usage:
        return merged_usage([self.usages[i] for i in range(self.n)])

    @property
    def done(self) -> bool:
        return len(self.ended) == self.n

    def _ended(self, member: int, choice: Choice) -> None:
        if member in self.ended:
            raise RuntimeError(f"choice {self.index(member)} of request {self.rid} ended twice")
        self.ended.add(member)
        self.usages[self.index(member)] = choice.usage()
