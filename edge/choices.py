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

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import orjson

from edgepath.contract.wire import Sampling
from edgepath.edge.actions import Answer, EndStream, Respond, SendChunk, StartStream
from edgepath.edge.apis.openai_answers import Usage
from edgepath.edge.http import Formatter, Headers, Request, Response, Work
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.tracked import Action, Phase, Tracked

#: seeds are carried as unsigned 64-bit words (contract/wire/sampling.py's ``Sampling``)
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


@dataclass(eq=False, slots=True)
class Choices:
    """A request of ``n`` choices in flight: its members (one :class:`Tracked` each, choice 0 first, answering under
    keys of their own) and the combiner that makes their answers one (:mod:`edgepath.edge.choices`)."""

    combine: ChoiceGroup
    route: str
    request: Request
    members: list[Tracked]


class Groups:
    """The requests of ``n`` choices in flight, by the client's key and by each member's: the fan-out of one request
    into its choices, and the fan-in of what they answer into the client's one answer."""

    def __init__(self, metrics: EdgeMetrics) -> None:
        self.metrics = metrics
        self._groups: dict[int, Choices] = {}
        self._keys = itertools.count(1)  # members answer under -1, -2, ... (clients' keys are >= 0)

    def __len__(self) -> int:
        return len(self._groups)

    def get(self, key: int) -> Choices | None:
        """The group of a client's key or of a member's (None: no group, or answered already)."""
        return self._groups.get(key)

    def fan_out(self, t: Tracked, formatter: Callable[[Work], Formatter], tokens: np.ndarray) -> Choices:
        """Make ``t``'s spare frames the requests of choices 1..n-1 -- the same ids (``tokens``: the frames' token
        arrays), their own seeds and formatters -- with ``t`` choice 0; every member answers under a key of its
        own.  The group is not in flight until :meth:`add`."""
        rid, frame = t.rid, t.frame
        assert frame is not None and t.formatter is not None
        words = t.input_count + (0 if t.work.constraint is None else len(t.work.constraint))
        t.rid = -next(self._keys)
        members = [t]
        for choice, spare in enumerate(t.spares, 1):
            tokens[spare, :words] = tokens[frame, :words]
            work = replace(
                t.work,
                sampling=choice_sampling(t.work.sampling, choice),
                options={**t.work.options, "choice": (t.formatter, choice)},
            )
            member = Tracked(
                -next(self._keys), t.request, t.route, work, formatter(work), Phase.TOKENIZING, dict(t.timings), spare,
                input_count=t.input_count, choice=choice,
            )  # fmt: skip
            members.append(member)
        t.spares = []
        return Choices(ChoiceGroup(rid, [m.rid for m in members], t.work.stream), t.route, t.request, members)

    def add(self, group: Choices) -> None:
        """``group`` is in flight: its members' actions are combined from now on."""
        for key in [group.combine.rid, *(m.rid for m in group.members)]:
            self._groups[key] = group

    def drop(self, group: Choices) -> list[Tracked]:
        """Forget ``group``; its members, for the lifecycle to abandon those still in flight."""
        self._groups.pop(group.combine.rid, None)
        for member in group.members:
            self._groups.pop(member.rid, None)
        return group.members

    def fan_in(self, actions: list[Action], now: int) -> list[Action]:
        """The actions of choices of several made the one answer to their request (:class:`ChoiceGroup`)."""
        out: list[Action] = []
        for action in actions:
            if action.rid >= 0:  # a client's own
                out.append(action)
                continue
            group = self._groups.get(action.rid)
            if group is None:
                continue  # a choice of a request answered already (another choice failed in the same event)
            combine, member = group.combine, action.rid
            formatter: Any = next(m.formatter for m in group.members if m.rid == member)  # a Choice
            match action:
                case StartStream(_, status, headers):
                    out += combine.start(status, headers)
                case SendChunk(_, data):
                    out += combine.chunk(data)
                case EndStream(_, data):
                    out += combine.end(member, data, formatter)
                case Respond(_, response) if response.status == 200:
                    out += combine.whole(member, response, formatter)
                case _:
                    raise AssertionError(f"a choice answered {action!r}: its failures are its request's")
            if combine.done:  # every choice answered and forgotten: only the keys are left
                for key in [combine.rid, *combine.members]:
                    self._groups.pop(key, None)
                self.metrics.answered(group.route, 200, now - group.request.t_receive_ns)
        return out
