"""Anthropic's Messages API on the edge: the routes bound to the lifecycle and the answers, whole or streamed.

A body becomes the one chat :class:`~edgepath.edge.http.Work` item every shape makes
(:func:`edgepath.edge.apis.conversation.chat_work`); the answer's ids go through the one text pipeline
(:class:`~edgepath.edge.apis.output.OutputText`) and come out as Anthropic's ``Message`` -- a ``thinking`` block
when the model thought, a ``text`` block, ``tool_use`` blocks -- or as its event stream: ``message_start``,
``ping``, per block ``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, ``message_delta`` with the ``stop_reason`` and the usage, and
``message_stop``.  ``usage.input_tokens`` is the prompt less what the prefix cache gave
(``cache_read_input_tokens``), as Anthropic counts them.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import orjson

from edgepath.contract import wire
from edgepath.edge.apis.anthropic import AnthropicError, MessagesRequest, parse_messages, sse
from edgepath.edge.apis.conversation import ChatRoutes, chat_work
from edgepath.edge.apis.output import EventFormatter, OutputText, Piece
from edgepath.edge.http import COUNT_TOKENS, JSON, MESSAGES, HttpError, Outcome, Response, Work
from edgepath.edge.text.tokenizer import Tokenizer


def anthropic_error(exc: HttpError) -> Response:
    return AnthropicError.of(exc).response()


class AnthropicRoutes(ChatRoutes):
    """Parses Anthropic's Messages requests into :class:`Work` for one served model (an
    :class:`~edgepath.edge.routes.ApiShape`)."""

    errors = AnthropicError

    def error(self, exc: HttpError) -> Response:
        return anthropic_error(exc)

    def unavailable(self) -> AnthropicError:
        return AnthropicError(400, f"messages are not available: {self.why_not}")

    def parse(self, path: str, body: bytes) -> Work:
        count = path == COUNT_TOKENS
        req = parse_messages(body, self.limits, count=count)
        if count:
            return _count_work(req)
        work = chat_work(
            MESSAGES, req.chat, req.constraint, max_tokens=req.max_tokens, stream=req.stream,
            sampling=req.sampling, options={"anthropic": req}, thinking=req.enable_thinking,
        )  # fmt: skip
        work.cache_salt = req.cache_salt
        return work


def _count_work(req: MessagesRequest) -> Work:
    """``count_tokens``: the chat tokenized with the model's template, answered with the count."""
    work = chat_work(
        COUNT_TOKENS, req.chat, None, max_tokens=0, stream=False, sampling=wire.Sampling(), options={},
        thinking=req.enable_thinking,
    )  # fmt: skip
    work.kind = "tokenize"
    work.counted = counted
    return work


def counted(count: int) -> Response:
    """The ``count_tokens`` answer: ``{"input_tokens": N}``, the tokens the chat's prompt takes."""
    return Response(200, [(b"content-type", JSON)], orjson.dumps({"input_tokens": count}))


def _stop_reason(out: OutputText, outcome: Outcome, produced: int, max_tokens: int) -> str:
    if out.calls:
        return "tool_use"
    if out.stop_sequence is not None:
        return "stop_sequence"
    if outcome.status == "RECLAIMED" and produced < max_tokens:
        return "pause_turn"  # cut short for a tenant under its floor: Anthropic's "send it back to go on"
    if outcome.status in ("LENGTH", "RECLAIMED") or produced >= max_tokens:
        return "max_tokens"
    return "end_turn"


def usage(outcome: Outcome, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: the prompt's uncached tokens, the cached ones, and the answer's."""
    return {
        "input_tokens": outcome.input_count - outcome.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": outcome.cached_tokens,
        "output_tokens": output_tokens,
    }


class AnthropicFormatter(EventFormatter):
    """One Anthropic answer for the lifecycle (see :class:`edgepath.edge.http.Formatter`)."""

    def __init__(self, request: MessagesRequest, tokenizer: Tokenizer, message_id: str) -> None:
        self.request = request
        self.id = message_id
        self.answer_id: str | None = message_id
        self.model: str | None = request.model
        self.watch = bool(request.stop)  # stop sequences need the output as it is produced
        out = OutputText(tokenizer, request.stop, request.chat.tools, f"toolu_{message_id[4:]}", request.thinking)
        super().__init__(out, request.stream)
        self._started = False
        self._block: str | None = None  # the kind of the content block open on the stream
        self._index = -1

    # -- the lifecycle's calls --------------------------------------------------------------------------
    def complete(self, outcome: Outcome) -> Response:
        self._feed(outcome.tokens[self._fed :])
        self._out.finish()
        produced = self._out.token_count
        body = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": self._blocks(),
            "stop_reason": _stop_reason(self._out, outcome, produced, self.request.max_tokens),
            "stop_sequence": self._out.stop_sequence,
            "usage": usage(outcome, produced),
        }
        return Response(200, [(b"content-type", JSON)], orjson.dumps(body))

    def end(self, outcome: Outcome) -> bytes:
        out = self._opening() + self._feed(outcome.tokens[self._fed :])
        for piece in self._out.finish():
            out += self._piece(piece)
        out += self._close()
        produced = self._out.token_count
        delta: dict[str, Any] = {
            "stop_reason": _stop_reason(self._out, outcome, produced, self.request.max_tokens),
            "stop_sequence": self._out.stop_sequence,
        }
        out += sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(outcome, produced)})
        return out + sse("message_stop", {"type": "message_stop"})

    def failure(self, error: HttpError) -> Response:
        return anthropic_error(error)

    def error(self, error: HttpError) -> bytes:
        return AnthropicError.of(error).event()

    # -- the answer ---------------------------------------------------------------------------------------
    def _opening(self) -> bytes:
        """``message_start`` (the usage is known at the end: ``message_delta`` carries it) and a ``ping``."""
        if self._started:
            return b""
        self._started = True
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.request.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0},
        }  # fmt: skip
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def _piece(self, piece: Piece) -> bytes:
        out = b""
        if piece.reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            delta = {"type": "thinking_delta", "thinking": piece.reasoning}
            out += sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        if piece.text:
            out += self._open("text", {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": piece.text}
            out += sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        for call in piece.calls:  # each call a block of its own, its input's JSON as the model writes it
            if call.name is not None:
                block: dict[str, Any] = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                out += self._open(f"tool_use {call.index}", block)
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                out += sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        return out

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        """Start a ``kind`` block unless one is open (the one open before it is stopped)."""
        if self._block == kind:
            return b""
        out = self._close()
        self._index += 1
        self._block = kind
        return out + sse("content_block_start", {"type": "content_block_start", "index": self._index,
                                                 "content_block": block})  # fmt: skip

    def _close(self) -> bytes:
        if self._block is None:
            return b""
        out = b""
        if self._block == "thinking":  # no signature: the thinking is the model's own, not Anthropic's
            delta = {"type": "signature_delta", "signature": ""}
            out = sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        self._block = None
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _blocks(self) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if self._out.reasoning:
            blocks.append({"type": "thinking", "thinking": self._out.reasoning, "signature": ""})
        if self._out.text:
            blocks.append({"type": "text", "text": self._out.text})
        blocks += [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)} for c in self._out.calls
        ]
        return blocks


def formatter_factory() -> Callable[[Work, Tokenizer], AnthropicFormatter]:
    """The lifecycle's formatter factory for ``/v1/messages``: each answer's ``msg_…`` id from a counter."""
    ids = itertools.count(1)

    def make(work: Work, tokenizer: Tokenizer) -> AnthropicFormatter:
        return AnthropicFormatter(work.options["anthropic"], tokenizer, f"msg_ep{next(ids)}")

    return make
