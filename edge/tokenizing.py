"""Where a request's prompt becomes token ids: written straight into its frame's registered array (or, for
``/v1/tokenize``, into a fresh one), through the model's chat template when it is a chat -- and where a grammar its
tenant has not sent before is built.

A small prompt is encoded inline, on the event loop (cheaper than a hand-off); a large one goes to a worker as a
:class:`~edgepath.edge.tracked.Tokenize` action, and its result comes back to the lifecycle's ``tokenized``.  "Large"
counts what the work costs, not only the text: a chat's messages each cost its template
:data:`~edgepath.edge.apis.limits.MESSAGE_CHARS` beyond their content (30,000 empty messages held the event loop
2.9 s when only the contents were counted).  A request whose grammar is not in its tenant's cache
(:mod:`edgepath.edge.grammars`) goes to a worker too, whatever its prompt: the worker builds the grammar's words with
the prompt's ids (llama.cpp's schema converter is milliseconds of Python).  The workers are few and counted here,
each tenant's too: a tenant may hold at most its share of them (:attr:`Tokenizing.share`, all but one when there are
several), so one tenant's large prompts wait behind its own and a worker stays free for the others.  A request for a
worker that finds every worker busy, or its tenant's share taken, is refused at once (429 ``tokenizer_busy``), never
queued.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from edgepath.edge.apis.limits import MESSAGE_CHARS
from edgepath.edge.http import HttpError, Work
from edgepath.edge.text.tokenizer import INLINE_CHARS, Tokenizer
from edgepath.edge.tracked import Tokenize, Tracked

log = logging.getLogger("edgepath.edge")


def chat_size(messages: Any, tools: list[dict[str, Any]] | None) -> int:
    """About how many characters of work a chat's template and tokenizer do: its contents, each message's own cost
    to the template, and the tools its template renders."""
    size = sum(len(m.get("content") or "") + MESSAGE_CHARS for m in messages)
    return size + (len(json.dumps(tools)) if tools else 0)


def chat_keywords(tools: list[dict[str, Any]] | None, enable_thinking: bool) -> dict[str, Any]:
    """``encode_chat_into``'s keywords: the tools its template renders (none without them), and ``enable_thinking``
    when the request turned the thinking off (the template's default otherwise)."""
    keywords: dict[str, Any] = {} if tools is None else {"tools": tools}
    if not enable_thinking:
        keywords["enable_thinking"] = False
    return keywords


def builds_grammar(work: Work) -> bool:
    """``work`` asks for a grammar whose words it does not have yet (not in its tenant's cache): a worker builds it."""
    return work.grammar is not None and work.constraint is None


def on_worker(work: Work) -> bool:
    """``work`` is done on a worker: its prompt is large, or its grammar is to be built."""
    return prompt_size(work) > INLINE_CHARS or builds_grammar(work)


def prompt_size(work: Work) -> int:
    """About how many characters the tokenizer reads for ``work`` (0 for token ids, which need none)."""
    if work.prompt is not None:
        return len(work.prompt)
    messages = work.options.get("messages")
    return 0 if messages is None else chat_size(messages, work.options.get("tools"))


#: what :meth:`Tokenizing.start` did: the count written into the frame (or the ids), a worker's action, or the
#: exception the tokenizer raised
Started = int | np.ndarray | Tokenize | BaseException


class Tokenizing:
    """The tokenizer of one edge and its ``workers`` (``clock``: monotonic ns, for the ``tokenize`` timing)."""

    def __init__(self, tokenizer: Tokenizer, clock: Callable[[], int], workers: int) -> None:
        if workers < 1:
            raise ValueError(f"tokenizer workers must be at least 1, got {workers}")
        self.tokenizer = tokenizer
        self.clock = clock
        self.workers = workers
        #: most workers one tenant may hold at once: all but one, so another tenant always finds one free
        self.share = max(1, workers - 1)
        self.busy = 0
        self._held: dict[str, int] = {}  # workers held by each tenant (those holding none are not listed)

    def full(self, work: Work) -> bool:
        """``work`` needs a worker and every worker is busy, or its tenant holds its share of them: refuse it now
        (nothing is queued)."""
        if not on_worker(work):
            return False
        return self.busy >= self.workers or self._held.get(work.tenant.name, 0) >= self.share

    def start(self, t: Tracked, out: np.ndarray | None) -> Started:
        """Encode ``t``'s prompt into ``out`` (a frame's token array; None: into a fresh array) inline, or hand it to
        a worker when it is large or its grammar is to be built.  Token ids given as such are copied (they fit ``out``
        or the caller's length check refuses them)."""
        work = t.work
        messages, tools = work.options.get("messages"), work.options.get("tools")
        thinking = work.options.get("enable_thinking", True)
        encode = work.options.get("encode")  # a route's own way to encode (llama-server's /tokenize options)
        if on_worker(work):
            self.busy += 1
            tenant = work.tenant.name
            self._held[tenant] = self._held.get(tenant, 0) + 1
            t.timings["tokenize_start"] = self.clock()
            grammar = work.grammar if builds_grammar(work) else None
            return Tokenize(t.rid, work.prompt, out, messages, tools, encode, work.tokens, grammar, thinking)
        t0 = self.clock()
        try:
            result = encode_prompt(self.tokenizer, work.prompt, out, messages, tools, work.tokens, encode, thinking)
        except Exception as exc:
            return exc
        t.timings["tokenize"] = self.clock() - t0
        return result

    def done(self, t: Tracked, now: int) -> None:
        """A worker finished ``t``'s prompt (``now``: monotonic ns): it is free again (its tenant's share too), the
        stage is timed."""
        self.busy -= 1
        tenant = t.work.tenant.name
        left = self._held[tenant] - 1
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]
        t.timings["tokenize"] = now - t.timings.pop("tokenize_start")


def encode_prompt(
    tokenizer: Tokenizer,
    prompt: str | None,
    out: np.ndarray | None,
    messages: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
    tokens: list[int] | None,
    encode: Callable[[str], np.ndarray] | None = None,
    enable_thinking: bool = True,
) -> int | np.ndarray:
    """A prompt's ids written into ``out`` (their count; None: a fresh array of them, made by ``encode`` when the
    route has its own): a chat through the model's template (rendered with ``enable_thinking``), text through the
    tokenizer, ids given as such copied (when they fit: the caller's length check refuses the rest)."""
    if prompt is None and messages is None:
        assert tokens is not None
        if out is None:
            return np.asarray(tokens, dtype=np.int32)
        if len(tokens) <= len(out):
            out[: len(tokens)] = tokens
        return len(tokens)
    if messages is not None:
        assert out is not None  # /v1/tokenize takes a prompt or ids, never a chat
        return tokenizer.encode_chat_into(messages, out, **chat_keywords(tools, enable_thinking))  # type: ignore[attr-defined]
    assert prompt is not None
    if out is not None:
        return tokenizer.encode_into(prompt, out)
    return (encode or tokenizer.encode)(prompt)


def work_on_worker(tokenizer: Tokenizer, action: Tokenize) -> tuple[int | np.ndarray, np.ndarray | None]:
    """What a tokenizer worker does for ``action``, off the event loop: its grammar's words built (when it asks
    for one), then its prompt encoded (:func:`encode_prompt`).  Raises what either raised."""
    words = action.grammar.build() if action.grammar is not None else None
    prompt = encode_prompt(
        tokenizer, action.prompt, action.out, action.messages, action.tools, action.tokens, action.encode,
        action.enable_thinking,
    )  # fmt: skip
    return prompt, words


def tokenizer_error(work: Work, exc: BaseException) -> HttpError:
    """The answer to a request whose worker raised: its grammar's refusal (a 400 naming the field) as it is, 400 when
    the model's chat template refused the messages (a ValueError: the client's to fix), else 500 (logged: the
    server's)."""
    if isinstance(exc, HttpError):
        return exc
    if "messages" in work.options and isinstance(exc, ValueError):
        return HttpError(400, "invalid_request", f"the chat could not be rendered: {exc}")
    log.error("tokenizer failed on a %d-character prompt: %r", len(work.prompt or ""), exc)
    return HttpError(500, "tokenizer_error", f"the tokenizer failed: {exc}")
