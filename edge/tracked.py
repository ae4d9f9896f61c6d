"""One request as the edge tracks it, from the moment it holds a frame until its answer is sent: its phase, its
timings, what it holds (a frame, spare frames for its other choices, its tenant's limits) and how far its answer has
gone; and what the lifecycle asks its driver to do for it (:data:`Action`).  Plain records, no behaviour: the
lifecycle (:mod:`edgepath.edge.lifecycle`) moves them along, the choices of one request are grouped by
:mod:`edgepath.edge.choices`, and their measurements are taken by :mod:`edgepath.edge.measure`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.dpu.frame import write_header
from edgepath.edge.actions import Answer
from edgepath.edge.http import Formatter, Grammar, Headers, Request, Work
from edgepath.edge.tenancy.gate import Hold
from edgepath.edge.tenancy.usage import Usage


@dataclass(frozen=True, slots=True)
class Tokenize:
    """Encode ``prompt`` on a worker thread -- into ``out`` (a frame's registered token array) with
    ``encode_into``, or into a fresh array with ``encode`` when ``out`` is None -- and build ``grammar``'s words
    when it is given, then report the result (count or array, and the words; or the exception) with
    :meth:`EdgeLifecycle.tokenized` (:func:`edgepath.edge.tokenizing.work_on_worker` is the worker's job)."""

    rid: int
    prompt: str | None
    out: np.ndarray | None
    messages: list[dict[str, Any]] | None = None  # a chat, tokenized with the model's template instead
    tools: list[dict[str, Any]] | None = None  # the tools the chat's template renders, when it has a place for them
    encode: Callable[[str], np.ndarray] | None = None  # a route's own encoding into a fresh array (out None)
    tokens: list[int] | None = None  # token ids given as such (copied; nothing to encode)
    grammar: Grammar | None = None  # a grammar to build (not in its tenant's cache)
    enable_thinking: bool = True  # false: the chat's template renders it with the thinking turned off


Action = Answer | Tokenize

#: the status a request is counted under in ``edgepath_requests_total`` when its client went away
#: before the answer was complete (nginx's "client closed request"; nothing is sent)
CLIENT_GONE = 499

#: ``_forget``'s output count for a request the data path refused before any slot ran it (charged nothing)
NOTHING_RAN = -1


def prompt_charged(t: Tracked) -> int:
    """The prompt tokens ``t`` is charged: a request's n choices share one prompt, counted with choice 0."""
    return t.input_count if t.choice == 0 else 0


def output_tokens(work: Work, words: int) -> int:
    """Output tokens in ``words`` output words (with log probabilities each token is a record of several)."""
    return words // wire.record_words(wire.logprobs_top(work.flags))


class Phase(Enum):
    TOKENIZING = "tokenizing"  # a worker is encoding the prompt (into the frame, for generate)
    IN_FLIGHT = "in flight"  # submitted; waiting for deliveries
    STREAMING = "streaming"  # the stream is started; chunks go out as deliveries arrive


@dataclass(eq=False, slots=True)
class Tracked:
    """One request the lifecycle still owes an answer or holds a frame for."""

    rid: int
    request: Request
    route: str
    work: Work
    formatter: Formatter | None
    phase: Phase
    timings: dict[str, int] = field(default_factory=dict)
    frame: int | None = None
    request_id: int = 0
    input_count: int = 0
    sent: int = 0  # output tokens already forwarded to a streaming client
    deadline_ns: int = 0
    t_first_ns: int = 0  # first output token seen at the edge
    t_last_ns: int = 0  # latest delivery that carried tokens
    gone: bool = False  # the client went away while a worker held the frame
    waited: bool = False  # its wait for the first token is measured (once)
    hold: Hold | None = None  # what it holds of its tenant's limits (edge/tenancy/gate.py), until settled
    limits: Headers = field(default_factory=list)  # the x-ratelimit-* headers of every answer to it
    choice: int = 0  # which of its request's n choices it is (edge/choices.py); only choice 0 counts the prompt
    spares: list[int] = field(default_factory=list)  # the frames of choices 1..n-1, until they become requests
    handover_from: int = 0  # submitted then while a slot was being taken back for it (sent at the hand-over)
    cached_first: int = -1  # cached prompt tokens its slot server reported with its first output (-1: none yet)


def write_request(req: wire.RequestHeader, t: Tracked, t_tokenized_ns: int) -> None:
    """``t``'s request header, as the agent and the slot server read it: its ids' count, its output bound, how
    its output comes back, its sampling, its tenant's cache namespace and floor, its bound on waiting."""
    work = t.work
    assert t.formatter is not None
    write_header(
        req,
        request_id=t.request_id,
        token_count=t.input_count,
        max_new_tokens=work.max_tokens,
        flags=(wire.FLAG_STREAM if work.stream or t.formatter.watch else 0)
        | work.flags
        | (wire.constraint_flags(len(work.constraint)) if work.constraint is not None else 0)
        | work.tenant.cache_flags,
        sampling=work.sampling,
        t_receive_ns=t.request.t_receive_ns,
        t_tokenized_ns=t_tokenized_ns,
    )
    req.bound(work.max_wait_ms)  # 0: the agent's own bound
    req.salted(work.salt)  # the prefix cache namespace: the tenant's and the request's cache_salt
    req.floored(work.tenant.floor_id, work.tenant.slot_floor, work.tenant.slot_cap)  # docs/TENANTS.md
    req.unsent()  # the agent stamps it when it sends the request (not yet, when it takes a slot back)


def usage_line(t: Tracked, completion: int, cached: int, finish: str) -> Usage:
    """``t``'s usage as billed: its prompt (once for n choices), the cached part of it, ``completion`` tokens, how
    it ended (``finish``), its first-token time and wait, the answer's model and id."""
    first, wait = t.timings.get("first_token"), t.timings.get("wait")
    return Usage(
        t.work.tenant.name,
        t.request_id,
        t.route,
        None if t.formatter is None else t.formatter.model,
        prompt_charged(t),
        cached if t.choice == 0 else 0,
        completion,
        finish,
        None if first is None else round(first / 1e6, 3),
        None if wait is None else round(wait / 1e6, 3),
        None if t.formatter is None else t.formatter.answer_id,
    )
